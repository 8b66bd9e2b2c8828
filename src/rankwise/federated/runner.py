"""Running a federated LoRA job with Flower: in-process, in the simulation engine, or deployed.

Three ways to run the *same* Strategy and client code, none of which is a runtime of our own:

* ``run_federated(..., backend="inprocess")``: Flower's legacy ``Server`` loop (``flwr.server.Server.fit``:
  configure_fit -> clients -> aggregate_fit -> evaluate, failures and timeouts included) with the
  clients as in-process ``ClientProxy`` objects, one at a time. No Ray start-up (about 10 s here),
  so tests and the quick reproduction use it.
* ``run_federated(..., backend="flower")``: ``flwr.simulation.run_simulation`` with a ``ServerApp`` and a
  ``ClientApp`` built around the strategy and the client (Ray backend, one CPU per client actor).
* deployment: the module-level apps of :mod:`rankwise.federated.app` read a :class:`RunSettings` from
  the Flower run config, so ``flwr run`` against a SuperLink with SuperNodes runs them unchanged.

:class:`RunSettings` names everything a run needs (method, task, clients, rounds, config); it
round-trips through a Flower run config (:meth:`RunSettings.to_run_config` /
:meth:`RunSettings.from_run_config`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

import rankwise.federated.registry as registry
from rankwise.core.lora import AdapterState, add_lora, get_state, set_state
from rankwise.core.validate import check_int
from rankwise.federated.client import make_client_fn
from rankwise.federated.common import derive_seed
from rankwise.federated.config import FederatedConfig
from rankwise.federated.strategy import CHECKPOINT
from rankwise.federated.tasks import evaluate_model, resolve_task

__all__ = ["METHODS", "RunSettings", "build_strategy", "initial_state", "make_client_app", "make_evaluate_fn",
           "make_server_app", "methods", "register_method", "run_federated", "run_settings"]

log = logging.getLogger("rankwise.federated")
METHODS = ("fslora", "fedavg", "hetlora", "flexlora")
BACKENDS = ("inprocess", "flower")


def register_method(name: str, logic: Callable[[], type], class_name: str,
                    client_factory: Callable[..., Any] | None = None) -> None:
    """Make a federated method available to :func:`build_strategy`, :class:`RunSettings`, the apps and the CLI.

    Kept for compatibility: :func:`rankwise.federated.registry.register_method` is the family's
    registry (with the method's default task and config). ``logic``: the strategy logic class or a
    zero-argument callable returning it; ``client_factory(task, task_kwargs, faults) -> client_fn``
    for clients that differ from the LoRA client.
    """
    registry.register_method(name, logic, class_name, client_factory=client_factory)


def methods() -> tuple[str, ...]:
    """The registered method names (built in: fslora, fedavg, hetlora, flexlora, and the SMoE methods)."""
    return registry.names()


def initial_state(task: Any, config: FederatedConfig) -> tuple[AdapterState, dict[str, torch.Tensor]]:
    """The initial global adapter (rank r on ``config.target_modules`` or the task's targets; A
    kaiming-uniform from ``Generator(seed)``, B = 0) and the task model's head tensors.

    A target that matches nothing raises ``SelectionError`` listing the model's modules; a rank above
    a layer's ``min(out, in)`` raises ValueError naming the layer.
    """
    model = task.build_model()
    gen = torch.Generator().manual_seed(derive_seed(config.seed, "init", 0) % (2**63))
    add_lora(model, config.target_modules or task.targets, "default", rank=config.rank, alpha=config.alpha,
             generator=gen, dtype=torch.float32)
    state = get_state(model, "default")
    params = dict(model.named_parameters())
    missing = [h for h in task.head if h not in params]
    if missing:
        raise ValueError(f"task {task.name!r} names head parameters {missing} that its model lacks")
    head = {h: params[h].detach().to(torch.float32).clone() for h in task.head}
    return state, head


def make_evaluate_fn(task: Any, batch_size: int = 256) -> Callable[[AdapterState, dict[str, torch.Tensor]],
                                                                    tuple[float, dict[str, float]]]:
    """Server-side evaluation on ``task.test_data()``: (mean cross-entropy, {"accuracy": ...})."""
    base = task.build_model()
    for p in base.parameters():
        p.requires_grad_(False)
    data = task.test_data()

    def evaluate_fn(adapter: AdapterState, head: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
        import copy

        model = copy.deepcopy(base)
        set_state(model, adapter, "default", check_base=False)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in head.items():
                params[n].copy_(t.to(params[n].dtype))
        loss, acc = evaluate_model(model, data, batch_size)
        return loss, {"accuracy": acc}

    return evaluate_fn


def build_strategy(method: str, config: FederatedConfig, task: Any, *, num_clients: int | None = None,
                   checkpoint_dir: str | Path | None = None, resume: str | Path | None = None,
                   evaluate: bool = True, on_round: Callable[[dict[str, Any]], None] | None = None,
                   **kwargs: Any) -> Any:
    """A Flower strategy for ``method`` on ``task`` (initial state from :func:`initial_state`).

    ``resume``: a checkpoint file (or a folder holding ``checkpoint.safetensors``) to continue from.
    The strategy caps each client's claimed example count at what ``task.client_data`` gives it
    (pass ``assigned_examples=None`` to cap relative to the round's claims instead).
    """
    cls = registry.get(method).strategy_class()
    state, head = initial_state(task, config)
    kwargs.setdefault("assigned_examples", _assigned_counts(task))
    strategy = cls(config, state, head=head, num_clients=num_clients or task.num_clients,
                                         evaluate_fn=make_evaluate_fn(task) if evaluate else None,
                                         checkpoint_dir=checkpoint_dir, on_round=on_round, **kwargs)
    if resume is not None:
        path = Path(resume)
        strategy.load_checkpoint(path / CHECKPOINT if path.is_dir() else path)
    return strategy


def _assigned_counts(task: Any) -> Callable[[int], int]:
    """How many examples ``task`` gives each client (the server caps claimed counts at it)."""
    return lambda pid: len(task.client_data(pid))


# ------------------------------------------------------------------------------------------------
# in-process clients
# ------------------------------------------------------------------------------------------------

def _proxy_class() -> type:
    from flwr.common import Code, DisconnectRes, EvaluateRes, FitRes, GetParametersRes, GetPropertiesRes, Status
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.client_proxy import ClientProxy

    class InProcessClientProxy(ClientProxy):
        """A ``ClientProxy`` that calls a ``NumPyClient`` in this process; ``timeout`` is enforced with a thread."""

        def __init__(self, cid: str, make_client: Callable[[], Any]) -> None:
            super().__init__(cid)
            self._make = make_client

        def _call(self, fn: Callable[[], Any], timeout: float | None) -> Any:
            if timeout is None:
                return fn()
            box: dict[str, Any] = {}

            def target() -> None:
                try:
                    box["value"] = fn()
                except BaseException as e:  # re-raised in the caller's thread
                    box["error"] = e

            th = threading.Thread(target=target, daemon=True)
            th.start()
            th.join(timeout)
            if th.is_alive():
                raise TimeoutError(f"client {self.cid} did not answer within {timeout} s")
            if "error" in box:
                raise box["error"]
            return box["value"]

        def get_properties(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
            props = self._call(lambda: self._make().get_properties(dict(ins.config)), timeout)
            return GetPropertiesRes(status=Status(Code.OK, ""), properties=props)

        def get_parameters(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
            arrays = self._call(lambda: self._make().get_parameters(dict(ins.config)), timeout)
            return GetParametersRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(arrays))

        def fit(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
            def run() -> Any:
                return self._make().fit(parameters_to_ndarrays(ins.parameters), dict(ins.config))
            arrays, n, metrics = self._call(run, timeout)
            return FitRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(arrays), num_examples=n,
                          metrics=metrics)

        def evaluate(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
            return EvaluateRes(status=Status(Code.OK, ""), loss=float("nan"), num_examples=0, metrics={})

        def reconnect(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
            return DisconnectRes(reason="")

    return InProcessClientProxy


def _numpy_client(client_fn: Callable[[Any], Any], pid: int, num: int) -> Any:
    from flwr.app import Context, RecordDict

    ctx = Context(run_id=0, node_id=pid + 1, node_config={"partition-id": pid, "num-partitions": num},
                  state=RecordDict(), run_config={})
    client = client_fn(ctx)
    return getattr(client, "numpy_client", client)


def run_federated(strategy: Any, client_fn: Callable[[Any], Any], num_clients: int, rounds: int,
                  backend: str = "inprocess", round_timeout: float | None = None,
                  backend_config: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run ``strategy`` until round ``rounds`` (a resumed strategy runs only the remaining ones); returns its history.

    ``client_fn(context) -> Client`` as for a Flower ``ClientApp`` (e.g.
    :func:`rankwise.federated.client.make_client_fn`). ``backend``: "inprocess" (Flower's ``Server`` loop,
    in-process clients, sequential) or "flower" (``run_simulation``, Ray). ``round_timeout``: seconds
    after which a client's round counts as failed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
    if not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an int >= 0, got {rounds!r}")
    if round_timeout is not None and not round_timeout > 0:
        raise ValueError(f"round_timeout must be None or > 0 seconds, got {round_timeout!r}")
    remaining = rounds - strategy.completed_rounds
    if remaining <= 0:
        return strategy.history
    if backend == "inprocess":
        from flwr.server import Server, SimpleClientManager

        manager = SimpleClientManager()
        proxy_cls = _proxy_class()
        for pid in range(num_clients):
            manager.register(proxy_cls(str(pid + 1), lambda pid=pid: _numpy_client(client_fn, pid, num_clients)))
        server = Server(client_manager=manager, strategy=strategy)
        server.set_max_workers(1)
        server.fit(num_rounds=remaining, timeout=round_timeout)
        return strategy.history
    from flwr.client import ClientApp
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.simulation import run_simulation

    def server_fn(context: Any) -> Any:
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=remaining,
                                                                          round_timeout=round_timeout))

    cfg = dict(backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=num_clients, backend_config=cfg)
    return strategy.history


# ------------------------------------------------------------------------------------------------
# settings shared by the CLI, the simulation and the deployed apps
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSettings:
    """Everything a federated run needs, JSON-serialisable (it travels in the Flower run config).

    ``task``: "synthetic" or "package.module:factory"; ``task_kwargs`` its keyword arguments (the
    number of clients is passed as ``num_clients``). ``config``: the :class:`FederatedConfig`.
    """

    method: str = "fslora"
    task: str = "synthetic"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    num_clients: int = 16
    rounds: int = 5
    config: FederatedConfig = field(default_factory=FederatedConfig)
    checkpoint_dir: str | None = None
    resume: str | None = None
    round_timeout: float | None = None
    faults: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        registry.get(self.method)  # ValueError naming the registered methods
        check_int("num_clients", self.num_clients, 1)
        check_int("rounds", self.rounds, 1)
        if self.config.clients_per_round > self.num_clients:
            raise ValueError(f"config.clients_per_round must be at most num_clients={self.num_clients}, "
                             f"got {self.config.clients_per_round}")
        if self.round_timeout is not None and not (isinstance(self.round_timeout, (int, float))
                                                   and self.round_timeout > 0):
            raise ValueError(f"round_timeout must be None or a number of seconds > 0, got {self.round_timeout!r}")

    def task_object(self) -> Any:
        kwargs = dict(self.task_kwargs)
        kwargs.setdefault("num_clients", self.num_clients)
        return resolve_task(self.task, kwargs)

    def to_run_config(self) -> dict[str, Any]:
        """Flower run-config entries (flat: str / int / float / bool)."""
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_json()
        return {"rankwise-settings": json.dumps(d)}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "RunSettings":
        raw = run_config.get("rankwise-settings")
        if not isinstance(raw, str):
            raise ValueError("the Flower run config lacks 'rankwise-settings' (write the app with "
                             "rankwise.federated.app.write_app_dir or pass --run-config)")
        d = json.loads(raw)
        cfg = dict(d.pop("config"))
        cfg["client_ranks"] = {int(k): int(v) for k, v in (cfg.get("client_ranks") or {}).items()}
        if cfg.get("target_modules") is not None:
            cfg["target_modules"] = tuple(cfg["target_modules"])
        d["faults"] = {int(k): v for k, v in (d.get("faults") or {}).items()}
        config_cls: type = FederatedConfig
        base_fields = {f.name for f in dataclasses.fields(FederatedConfig)}
        if set(cfg) - base_fields:  # a subclass's extra fields (UB-SMoE's): rebuild the method's config class
            config_cls = registry.get(d.get("method", "fslora")).config or FederatedConfig
            for k, v in list(cfg.items()):
                if isinstance(v, list) and k not in ("client_ranks",):
                    cfg[k] = tuple(v)
        return cls(config=config_cls(**cfg), **d)


def run_settings(method: str = "fslora", **kwargs: Any) -> RunSettings:
    return RunSettings(method=method, **kwargs)


def strategy_from_settings(settings: RunSettings, on_round: Callable[[dict[str, Any]], None] | None = None) -> Any:
    task = settings.task_object()
    if task.num_clients != settings.num_clients:
        raise ValueError(f"task {settings.task!r} has {task.num_clients} clients, the run asks for {settings.num_clients}")
    return build_strategy(settings.method, settings.config, task, num_clients=settings.num_clients,
                          checkpoint_dir=settings.checkpoint_dir, resume=settings.resume,
                          round_timeout=settings.round_timeout, on_round=on_round)


def client_fn_from_settings(settings: RunSettings) -> Callable[[Any], Any]:
    kwargs = dict(settings.task_kwargs)
    kwargs.setdefault("num_clients", settings.num_clients)
    factory = registry.get(settings.method).client_factory or make_client_fn
    return factory(settings.task, kwargs, settings.faults)


def make_server_app(settings: RunSettings | None = None, on_round: Callable[[dict[str, Any]], None] | None = None,
                    holder: dict[str, Any] | None = None) -> Any:
    """A Flower ``ServerApp``: settings given here, or read from ``context.run_config`` (deployment).

    ``holder`` (optional dict) receives the strategy under ``"strategy"`` so a caller can read its history.
    """
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig

    def server_fn(context: Any) -> Any:
        s = settings or RunSettings.from_run_config(context.run_config)
        strategy = strategy_from_settings(s, on_round)
        if holder is not None:
            holder["strategy"] = strategy
        remaining = max(0, s.rounds - strategy.completed_rounds)
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=remaining,
                                                                          round_timeout=s.round_timeout))

    return ServerApp(server_fn=server_fn)


def make_client_app(settings: RunSettings | None = None) -> Any:
    """A Flower ``ClientApp``: settings given here, or read from ``context.run_config`` (deployment)."""
    from flwr.client import ClientApp

    def client_fn(context: Any) -> Any:
        s = settings or RunSettings.from_run_config(context.run_config)
        return client_fn_from_settings(s)(context)

    return ClientApp(client_fn=client_fn)


def run_simulation_settings(settings: RunSettings, backend: str = "flower",
                            on_round: Callable[[dict[str, Any]], None] | None = None,
                            backend_config: Mapping[str, Any] | None = None) -> Any:
    """Run ``settings`` in Flower's simulation engine with the apps of :func:`make_server_app` /
    :func:`make_client_app` (``backend="flower"``) or in-process; returns the strategy."""
    if backend == "inprocess":
        strategy = strategy_from_settings(settings, on_round)
        run_federated(strategy, client_fn_from_settings(settings), settings.num_clients, settings.rounds,
                      backend="inprocess", round_timeout=settings.round_timeout)
        return strategy
    if backend != "flower":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    from flwr.simulation import run_simulation

    holder: dict[str, Any] = {}
    cfg = dict(backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    run_simulation(server_app=make_server_app(settings, on_round, holder), client_app=make_client_app(settings),
                   num_supernodes=settings.num_clients, backend_config=cfg)
    if "strategy" not in holder:
        raise RuntimeError("the Flower simulation ended without starting the server app")
    return holder["strategy"]
