"""The server side shared by FSLoRA and its baselines: a Flower ``Strategy`` holding one global LoRA adapter.

:class:`LoRAStrategyLogic` implements Flower's legacy ``Strategy`` hooks (``initialize_parameters``,
``configure_fit``, ``aggregate_fit``, ``evaluate``); the concrete Flower classes
(``FSLoRAStrategy``, ``FedAvgLoRAStrategy``, ``HetLoRAStrategy``, ``FlexLoRAStrategy``) are this
logic mixed into ``flwr.server.strategy.FedAvg``, built on first use so that importing rankwise
never imports flwr (see :func:`flower_class`). A method only says what a client receives
(:meth:`client_payload`) and how the accepted replies change the global state (:meth:`aggregate`).

What the shared part does, every round ``t`` (absolute: a resumed run continues the count):

* learns each node's partition id once (``get_properties``), so client ids are the data partitions,
  stable across simulation and deployment, and k_i comes from ``config.client_ranks``;
* samples ``clients_per_round`` partitions with a generator seeded by ``(seed, t)``: the same
  clients in a fresh and in a resumed run;
* checks every reply against the layout it was sent (count, float32 dtype, shapes, finiteness); a
  malformed reply is logged and left out (or raises with ``on_invalid="raise"``), a client that
  raised or timed out is a Flower *failure* and is left out too; a round with no valid reply leaves
  the global state unchanged;
* applies the server-side defences of :mod:`rankwise.federated.defences` (example-count caps,
  update-size bounds, robust aggregation, the health check that refuses a poisoned round);
* aggregates the accepted replies in partition order (Flower hands them over in an arbitrary order);
* records per-round metrics (clients ok / failed / rejected, bytes up and down per client, mean
  client loss, and the server-side evaluation's loss and accuracy) in :attr:`history`;
* writes a checkpoint (safetensors, atomic) after every round: global tensors, server-optimizer
  state, round, history. :meth:`load_checkpoint` resumes; a resumed run ends with the same global
  adapter as an uninterrupted one (client work is a function of (seed, round, partition)).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from rankwise.core import io
from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.core.lora import AdapterState
from rankwise.federated.common import (
    HEAD_PREFIX,
    WIRE_DTYPE,
    check_update,
    derive_seed,
    encode_layout,
    nbytes,
)
from rankwise.federated.config import FederatedConfig
from rankwise.federated.defences import (
    cap_examples,
    health_problem,
    krum_select,
    lower_median,
    robust_combine,
    size_outliers,
    update_size,
)

__all__ = ["ClientUpdate", "InvalidUpdateError", "LoRAStrategyLogic", "flower_class", "CHECKPOINT"]

log = logging.getLogger("rankwise.federated")
CHECKPOINT = "checkpoint.safetensors"
_KIND = "rankwise.federated.checkpoint"


class InvalidUpdateError(RankwiseError, ValueError):
    """A client's update was malformed and the strategy was configured with ``on_invalid="raise"``."""


@dataclass
class ClientUpdate:
    """One accepted reply: partition id, tensors by layout name, example count, metrics, the raw Flower pair."""

    pid: int
    tensors: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, Any]
    raw: Any = None


class LoRAStrategyLogic:
    """Shared server logic (see the module docstring); mixed into Flower's FedAvg by :func:`flower_class`.

    Args:
        config: the run's :class:`~rankwise.federated.config.FederatedConfig`.
        init_adapter: the initial global adapter (rank ``config.rank`` on every module; B = 0 for LoRA's
            usual start), e.g. from :func:`rankwise.federated.runner.initial_state`.
        head: ``{parameter name: tensor}`` trained by every client and averaged (may be empty).
        evaluate_fn: ``f(adapter, head) -> (loss, {"accuracy": ...})`` for server-side evaluation (it may
            return None to skip a round; ``adapter.config["rounds"]`` is the round), or None.
        num_clients: how many clients exist (ids 0..N-1); checks ``client_ranks`` ids, waits for N nodes.
        checkpoint_dir: where ``checkpoint.safetensors`` is written after every round (None: not written).
        round_timeout: seconds a node may take to answer ``get_properties`` (fit timeouts are the
            server config's ``round_timeout``).
        on_round: called with each round's metrics dict after its evaluation (progress display).
        assigned_examples: ``{client: n}`` or ``f(client) -> n``, the example count each client was
            assigned; a larger claimed ``num_examples`` is capped at it (None: capped relative to the
            round's claims, ``config.max_examples_ratio``). See :mod:`rankwise.federated.defences`.
    """

    method = "lora"
    supports_server_optimizer = True

    def __init__(self, config: FederatedConfig, init_adapter: AdapterState, *, head: Mapping[str, torch.Tensor] | None = None,
                 evaluate_fn: Callable[[AdapterState, dict[str, torch.Tensor]], tuple[float, dict[str, Any]]] | None = None,
                 num_clients: int | None = None, checkpoint_dir: str | Path | None = None,
                 round_timeout: float | None = None, on_round: Callable[[dict[str, Any]], None] | None = None,
                 assigned_examples: Callable[[int], int] | Mapping[int, int] | None = None) -> None:
        if not isinstance(config, FederatedConfig):
            raise TypeError(f"config must be a FederatedConfig, got {type(config).__name__}")
        if not isinstance(init_adapter, AdapterState):
            raise TypeError(f"init_adapter must be an AdapterState, got {type(init_adapter).__name__}")
        init_adapter.validate()
        for m, r in init_adapter.ranks().items():
            if r != config.rank:
                raise ValueError(f"init_adapter module {m!r} has rank {r}, the config's global rank is {config.rank}")
            out_f, in_f = init_adapter.shape(m)
            if config.rank > min(out_f, in_f):
                raise ValueError(f"global rank {config.rank} exceeds min(out, in) = {min(out_f, in_f)} of layer {m!r}")
        if num_clients is not None:
            if not isinstance(num_clients, int) or num_clients < 1:
                raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
            if config.clients_per_round > num_clients:
                raise ValueError(f"clients_per_round {config.clients_per_round} exceeds the {num_clients} clients")
            unknown = sorted(c for c in config.client_ranks if c >= num_clients)
            if unknown:
                raise ValueError(f"client_ranks names client ids {unknown[:10]} but there are only {num_clients} "
                                 f"clients (ids 0..{num_clients - 1})")
        if not self.supports_server_optimizer and (config.server_optimizer != "avg" or config.server_lr != 1.0):
            raise ValueError(f"{self.method} aggregates factors directly: it needs server_optimizer='avg' and "
                             f"server_lr=1.0, got {config.server_optimizer!r}, {config.server_lr}")
        super().__init__(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=1, min_evaluate_clients=0,  # type: ignore[call-arg]
                         min_available_clients=num_clients or 1, accept_failures=True,
                         fit_metrics_aggregation_fn=_no_metrics)
        self.config = config
        self.num_clients = num_clients
        self.evaluate_fn = evaluate_fn
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.round_timeout = round_timeout
        self.on_round = on_round
        self.modules = init_adapter.modules()
        self.scaling = config.alpha / config.rank
        self.fingerprint = init_adapter.fingerprint
        self.tensors: dict[str, torch.Tensor] = {}
        for m in self.modules:
            for kind in ("lora_A", "lora_B"):
                self.tensors[f"{m}.{kind}"] = init_adapter.factors[m][kind].detach().to(torch.float32).clone()
        for n, t in (head or {}).items():
            self.tensors[HEAD_PREFIX + n] = t.detach().to(torch.float32).clone()
        self.completed_rounds = 0
        self.history: list[dict[str, Any]] = []
        self._offset = 0
        self._pid: dict[str, int] = {}
        self._sent: dict[tuple[int, int], tuple[list[tuple[str, tuple[int, ...]]], int, list[np.ndarray]]] = {}
        self._assigned = assigned_examples
        self._assigned_cache: dict[int, int | None] = {}
        self._evaluated: tuple[int, tuple[float, dict[str, Any]] | None] | None = None
        self._refused_round: int | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._params: dict[str, torch.nn.Parameter] = {}

    # -- global state -------------------------------------------------------------------------
    @property
    def global_adapter(self) -> AdapterState:
        """The global rank-r adapter (copies), scaling alpha / r on every module."""
        factors = {m: {k: self.tensors[f"{m}.{k}"].clone() for k in ("lora_A", "lora_B")} for m in self.modules}
        cfg = {"method": self.method, "rank": self.config.rank, "alpha": self.config.alpha, "use_rslora": False,
               "dropout": 0.0, "init": "kaiming", "targets": list(self.modules), "rounds": self.completed_rounds}
        return AdapterState(cfg, factors, {m: self.scaling for m in self.modules}, self.fingerprint)

    @property
    def global_head(self) -> dict[str, torch.Tensor]:
        return {n[len(HEAD_PREFIX):]: t.clone() for n, t in self.tensors.items() if n.startswith(HEAD_PREFIX)}

    def head_names(self) -> list[str]:
        return [n for n in self.tensors if n.startswith(HEAD_PREFIX)]

    def global_arrays(self) -> list[np.ndarray]:
        return [t.numpy().astype(WIRE_DTYPE, copy=True) for t in self.tensors.values()]

    def apply_delta(self, deltas: Mapping[str, torch.Tensor]) -> None:
        """Server update with an aggregated change: avg adds ``server_lr * delta``; sgd/adam step on ``-delta``."""
        cfg = self.config
        if cfg.server_optimizer == "avg":
            for n, d in deltas.items():
                self.tensors[n].add_(d.to(torch.float32), alpha=cfg.server_lr)
            return
        opt = self._optimizer()
        for n, p in self._params.items():
            p.grad = (-deltas[n].to(torch.float32)) if n in deltas else None
        opt.step()
        opt.zero_grad(set_to_none=True)

    def _optimizer(self) -> torch.optim.Optimizer:
        if self._opt is None:
            self._params = {n: torch.nn.Parameter(t, requires_grad=True) for n, t in self.tensors.items()}
            for n, p in self._params.items():  # share storage: the optimizer updates self.tensors in place
                self.tensors[n] = p.data
            params = list(self._params.values())
            if self.config.server_optimizer == "sgd":
                self._opt = torch.optim.SGD(params, lr=self.config.server_lr, momentum=self.config.server_momentum)
            else:
                self._opt = torch.optim.AdamW(params, lr=self.config.server_lr, weight_decay=0.0)
        return self._opt

    def weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Aggregation weights: 1 / |valid| ("uniform") or n_i / sum n ("examples")."""
        if self.config.weighting == "uniform":
            return [1.0 / len(updates)] * len(updates)
        total = sum(max(0, u.num_examples) for u in updates)
        if total <= 0:
            return [1.0 / len(updates)] * len(updates)
        return [max(0, u.num_examples) / total for u in updates]

    # -- method hooks ---------------------------------------------------------------------------
    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list[tuple[str, tuple[int, ...]]],
                                                             dict[str, float]]:
        """Arrays, their layout and the per-module scaling that client ``pid`` receives in round ``rnd``."""
        raise NotImplementedError

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        """Change the global state from the accepted replies of round ``rnd`` (at least one)."""
        raise NotImplementedError

    def fit_config_extra(self, rnd: int, pid: int) -> dict[str, Any]:
        """Method-specific entries of ``FitIns.config`` (Flower scalars), merged into the common ones.

        A method with more global state than LoRA factors and a head (e.g. UB-SMoE's routing
        modulation) keeps it in :attr:`tensors` under its own names (checkpointed with the rest),
        sends what a client needs through :meth:`client_payload` / this hook, and reads client
        statistics from ``ClientUpdate.metrics`` in :meth:`aggregate`.
        """
        return {}

    def factor_payload(self, factors: Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                       scaling: Mapping[str, float] | None = None) -> tuple[list[np.ndarray], list, dict[str, float]]:
        """A :meth:`client_payload` of per-module factors ``factors(module, A, B) -> (a (k, in), b (out, k))``
        followed by the head; ``scaling`` per module (default alpha / r everywhere)."""
        arrays, layout = [], []
        for m in self.modules:
            a, b = factors(m, self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"])
            arrays += [a.float().numpy().astype(WIRE_DTYPE), b.float().numpy().astype(WIRE_DTYPE)]
            layout += [(f"{m}.lora_A", tuple(a.shape)), (f"{m}.lora_B", tuple(b.shape))]
        h_arrays, h_layout = self._head_payload()
        return (arrays + h_arrays, layout + h_layout,
                dict(scaling) if scaling is not None else {m: self.scaling for m in self.modules})

    def _head_payload(self) -> tuple[list[np.ndarray], list[tuple[str, tuple[int, ...]]]]:
        names = self.head_names()
        return ([self.tensors[n].numpy().astype(WIRE_DTYPE, copy=True) for n in names],
                [(n, tuple(self.tensors[n].shape)) for n in names])

    def _head_average(self, updates: list[ClientUpdate], w: list[float]) -> dict[str, torch.Tensor]:
        """``sum_i w_i (h_i - h)`` for every head tensor (float64 accumulation)."""
        out = {}
        for n in self.head_names():
            cur = self.tensors[n].double()
            out[n] = sum((wi * (u.tensors[n].double() - cur) for u, wi in zip(updates, w)),
                         torch.zeros_like(cur)).float()
        return out

    # -- Flower Strategy hooks -------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.config.rank}, modules={len(self.modules)})"

    def initialize_parameters(self, client_manager: Any) -> Any:
        from flwr.common import ndarrays_to_parameters

        self._offset = self.completed_rounds
        return ndarrays_to_parameters(self.global_arrays())

    def _discover(self, client_manager: Any, rnd: int) -> dict[int, Any]:
        from flwr.common import GetPropertiesIns

        if self.num_clients:
            client_manager.wait_for(self.num_clients, timeout=int(self.round_timeout or 600))
        by_pid: dict[int, Any] = {}
        for cid, proxy in sorted(client_manager.all().items()):
            if cid not in self._pid:
                try:
                    res = proxy.get_properties(GetPropertiesIns(config={}), timeout=self.round_timeout, group_id=rnd)
                    self._pid[cid] = int(res.properties["partition-id"])
                except Exception as e:  # a node that cannot answer is skipped this round
                    log.warning("round %d: node %s did not report its partition id (%s); skipped", rnd, cid, e)
                    continue
            pid = self._pid[cid]
            if pid in by_pid:
                log.warning("round %d: nodes %s and %s both report partition %d; using the first", rnd,
                            by_pid[pid].cid, cid, pid)
                continue
            by_pid[pid] = proxy
        return by_pid

    def sample(self, rnd: int, pids: list[int]) -> list[int]:
        """The partitions trained in round ``rnd``: ``clients_per_round`` of ``pids`` from a (seed, rnd) generator."""
        m = min(self.config.clients_per_round, len(pids))
        rng = np.random.default_rng(derive_seed(self.config.seed, "sample", rnd))
        return sorted(int(p) for p in rng.choice(sorted(pids), size=m, replace=False))

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
        from flwr.common import FitIns, ndarrays_to_parameters

        rnd = server_round + self._offset
        by_pid = self._discover(client_manager, rnd)
        cfg = self.config
        out = []
        for pid in self.sample(rnd, list(by_pid)):
            arrays, layout, scaling = self.client_payload(rnd, pid)
            self._sent[(rnd, pid)] = (layout, nbytes(arrays), arrays)
            fit_cfg = {"round": rnd, "seed": cfg.seed, "local-steps": cfg.local_steps, "batch-size": cfg.batch_size,
                       "lr": cfg.client_lr, "head-lr": cfg.client_lr if cfg.head_lr is None else cfg.head_lr,
                       "weight-decay": cfg.weight_decay, "layout": encode_layout(layout),
                       "scaling": json.dumps(scaling), "method": self.method, **self.fit_config_extra(rnd, pid)}
            out.append((by_pid[pid], FitIns(ndarrays_to_parameters(arrays), fit_cfg)))
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]],
                      failures: list[Any]) -> tuple[Any, dict[str, Any]]:
        from flwr.common import ndarrays_to_parameters

        rnd = server_round + self._offset
        sent = {pid: v for (r, pid), v in self._sent.items() if r == rnd}
        updates, rejected, up_bytes = self._accept(rnd, sent, results)
        # Flower hands the replies over in the iteration order of a set of futures (memory addresses):
        # aggregate in partition order so that the float sums do not depend on it
        updates.sort(key=lambda u: u.pid)
        defence = self._defend(rnd, sent, updates, rejected)
        updates = [u for u in updates if u.pid not in set(rejected)]
        kept = self._select(rnd, updates, defence)
        snapshot = self._snapshot() if self.config.health_check and kept else None
        if kept:
            if self.config.aggregator in ("median", "trimmed"):
                self.aggregate_robust(rnd, kept)
            else:
                self.aggregate(rnd, kept)
        if snapshot is not None:
            self._check_health(rnd, snapshot, defence)
        for key in [k for k in self._sent if k[0] <= rnd]:
            del self._sent[key]
        up_bytes = [b for u, b in up_bytes if u in {v.pid for v in updates}]
        losses = [float(u.metrics["loss"]) for u in updates if isinstance(u.metrics.get("loss"), (int, float))]
        row = {"round": rnd, "clients_sampled": len(sent), "clients_ok": len(updates),
               "clients_failed": len(failures), "clients_rejected": len(rejected),
               "rejected": rejected, "failed_or_missing": sorted(set(sent) - {u.pid for u in updates} - set(rejected)),
               "train_loss": float(np.mean(losses)) if losses else float("nan"),
               "upload_bytes_per_client": float(np.mean(up_bytes)) if up_bytes else 0.0,
               "download_bytes_per_client": float(np.mean([v[1] for v in sent.values()])) if sent else 0.0,
               "upload_bytes_total": int(sum(up_bytes)),
               "client_ranks": {str(u.pid): self._rank_sent(sent[u.pid][0]) for u in updates}, **defence}
        if not updates:
            log.warning("round %d: no valid client update (%d failed, %d rejected); global state unchanged",
                        rnd, len(failures), len(rejected))
        self.history = [h for h in self.history if h["round"] != rnd] + [row]
        self.completed_rounds = rnd
        self.save_checkpoint()
        metrics = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return ndarrays_to_parameters(self.global_arrays()), metrics

    # -- defences (see rankwise.federated.defences) ------------------------------------------------
    def _reject(self, rnd: int, who: Any, problem: str) -> None:
        msg = f"round {rnd}: rejected the update of client {who}: {problem}"
        if self.config.on_invalid == "raise":
            raise InvalidUpdateError(msg)
        log.warning(msg)

    def _accept(self, rnd: int, sent: dict[int, Any], results: list[tuple[Any, Any]]
                ) -> tuple[list[ClientUpdate], list[int], list[tuple[int, int]]]:
        """Step 1: the replies that match what was sent (count, dtype, shapes, finite, an int example count)."""
        from flwr.common import parameters_to_ndarrays

        updates: list[ClientUpdate] = []
        rejected: list[int] = []
        up_bytes: list[tuple[int, int]] = []
        for proxy, res in results:
            pid = self._pid.get(proxy.cid)
            problem = None
            if pid is None or pid not in sent:
                problem = "reply from a client that was not sent work this round"
                arrays: list[Any] = []
            else:
                try:
                    arrays = parameters_to_ndarrays(res.parameters)
                except Exception as e:  # undecodable bytes
                    arrays, problem = [], f"cannot decode the parameters ({e})"
                problem = problem or check_update(arrays, sent[pid][0])
                n = getattr(res, "num_examples", None)
                if problem is None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
                    problem = f"num_examples {n!r} is not an int >= 0"
            if problem is not None:
                self._reject(rnd, pid if pid is not None else proxy.cid, problem)
                rejected.append(-1 if pid is None else pid)
                continue
            layout = sent[pid][0]
            tensors = {name: torch.from_numpy(np.array(a, copy=True)) for a, (name, _) in zip(arrays, layout)}
            u = ClientUpdate(pid, tensors, int(res.num_examples), dict(res.metrics or {}), (proxy, res))
            u.arrays = arrays  # type: ignore[attr-defined]
            updates.append(u)
            up_bytes.append((pid, nbytes(arrays)))
        return updates, rejected, up_bytes

    def assigned(self, pid: int) -> int | None:
        """The example count client ``pid`` was assigned, if the server knows it (memoised)."""
        if self._assigned is None:
            return None
        if pid not in self._assigned_cache:
            src = self._assigned
            try:
                n = src(pid) if callable(src) else src.get(pid)
            except Exception as e:  # noqa: BLE001  (a task that cannot say: no cap from it)
                log.warning("assigned example count of client %d unknown (%s)", pid, e)
                n = None
            self._assigned_cache[pid] = None if n is None else int(n)
        return self._assigned_cache[pid]

    def _defend(self, rnd: int, sent: dict[int, Any], updates: list[ClientUpdate],
                rejected: list[int]) -> dict[str, Any]:
        """Steps 2-3: cap example counts, reject updates far larger than the round's lower median."""
        cfg = self.config
        out: dict[str, Any] = {}
        if not updates:
            return out
        claims = [u.num_examples for u in updates]
        capped = cap_examples(claims, [self.assigned(u.pid) for u in updates], cfg.max_examples_ratio)
        out["examples_capped"] = [u.pid for u, c, k in zip(updates, claims, capped) if k < c]
        for u, c, k in zip(updates, claims, capped):
            if k < c:
                log.warning("round %d: client %d claimed %d examples; capped at %d", rnd, u.pid, c, k)
                u.num_examples = k
                proxy, res = u.raw
                u.raw = (proxy, dataclasses.replace(res, num_examples=k))
        sizes = [update_size(u.arrays, sent[u.pid][2]) for u in updates]  # type: ignore[attr-defined]
        out["update_sizes"] = {str(u.pid): s for u, s in zip(updates, sizes)}
        too_big = []
        for u, s, bad in zip(updates, sizes, size_outliers(sizes, cfg.max_update_norm_ratio)):
            if bad:
                self._reject(rnd, u.pid, f"update size {s:.3g} exceeds {cfg.max_update_norm_ratio:g} x the round's "
                                         f"lower median {lower_median(sizes):.3g}")
                rejected.append(u.pid)
                too_big.append(u.pid)
        out["rejected_size"] = too_big
        return out

    def _select(self, rnd: int, updates: list[ClientUpdate], defence: dict[str, Any]) -> list[ClientUpdate]:
        """Step 4 for "krum": the updates Multi-Krum keeps (all of them for the other aggregators)."""
        if self.config.aggregator != "krum" or len(updates) < 2:
            return updates
        vectors = [torch.cat([c.reshape(-1) if m is None else (c * m).reshape(-1) for c, m in contrib.values()])
                   for contrib in self.contributions(rnd, updates)]
        keep = krum_select(vectors, self.config.krum_byzantine)
        defence["krum_dropped"] = [u.pid for i, u in enumerate(updates) if i not in keep]
        return [updates[i] for i in keep]

    def _snapshot(self) -> tuple[dict[str, torch.Tensor], Any]:
        opt = None if self._opt is None else copy.deepcopy(self._opt.state_dict())
        return {n: t.clone() for n, t in self.tensors.items()}, opt

    def _check_health(self, rnd: int, snapshot: tuple[dict[str, torch.Tensor], Any], defence: dict[str, Any]) -> None:
        """Step 5: evaluate the new global model; refuse the round (roll back, no checkpoint) if it is unhealthy."""
        result = None
        if self.evaluate_fn is not None and all(bool(torch.isfinite(t).all()) for t in self.tensors.values()):
            out = self.evaluate_fn(self._adapter_at(rnd), self.global_head)
            result = None if out is None else (float(out[0]), dict(out[1]))
        ref = self._reference(rnd)
        acc = None if result is None else result[1].get("accuracy")
        problem = health_problem(self.tensors, None if result is None else result[0], ref.get("loss"),
                                 self.config.max_loss_ratio, None if acc is None else float(acc), ref.get("accuracy"),
                                 self.config.max_accuracy_drop)
        if problem is None:
            self._evaluated = (rnd, result)
            return
        log.warning("round %d: refused by the health check (%s); the global model stays at round %d's", rnd,
                    problem, rnd - 1)
        tensors, opt = snapshot
        for n, t in tensors.items():
            self.tensors[n].copy_(t)
        if opt is not None and self._opt is not None:
            self._opt.load_state_dict(opt)
        elif self._opt is not None:  # the optimizer was created by the refused step: start it afresh
            self._opt, self._params = None, {}
        self._evaluated = None
        self._refused_round = rnd
        defence["refused"] = problem

    def _adapter_at(self, rnd: int) -> AdapterState:
        state = self.global_adapter
        state.config["rounds"] = rnd
        return state

    def _reference(self, rnd: int) -> dict[str, float]:
        """The test loss and accuracy of the last accepted, evaluated round before ``rnd`` (empty if none)."""
        for h in reversed(self.history):
            if h["round"] < rnd and "refused" not in h and isinstance(h.get("loss"), (int, float)) \
                    and math.isfinite(h["loss"]):
                return {k: float(h[k]) for k in ("loss", "accuracy") if isinstance(h.get(k), (int, float))}
        return {}

    # -- robust aggregation hooks ---------------------------------------------------------------
    def contributions(self, rnd: int, updates: list[ClientUpdate]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Each update in the method's aggregation space: ``{key: (tensor, mask or None)}``, aligned across clients.

        :meth:`aggregate` is ``apply_combined(sum_i w_i m_i x_i)`` over these; "median" / "trimmed"
        replace the sum coordinate-wise (:func:`~rankwise.federated.defences.robust_combine`) and
        "krum" measures distances between them. Default: the change ``x_i - x`` of every tensor the
        client returned (for methods whose clients receive the global tensors whole).
        """
        return [{n: (t.double() - self.tensors[n].double(), None) for n, t in u.tensors.items()} for u in updates]

    def apply_combined(self, rnd: int, combined: dict[str, torch.Tensor], updates: list[ClientUpdate]) -> None:
        """Change the global state from the combined contributions (default: :meth:`apply_delta`)."""
        self.apply_delta({n: d.float() for n, d in combined.items()})

    def aggregate_robust(self, rnd: int, updates: list[ClientUpdate]) -> None:
        """The "median" / "trimmed" aggregation: :meth:`contributions` combined coordinate-wise, then applied."""
        contrib = self.contributions(rnd, updates)
        w = self.weights(updates)
        combined = {k: robust_combine([c[k][0] for c in contrib], w, self.config.aggregator, self.config.trim_fraction,
                                      [c[k][1] for c in contrib]) for k in contrib[0]}
        self.apply_combined(rnd, combined, updates)

    @staticmethod
    def _rank_sent(layout: list[tuple[str, tuple[int, ...]]]) -> int:
        ranks = [s[0] for n, s in layout if n.endswith(".lora_A")]
        return int(round(float(np.mean(ranks)))) if ranks else 0

    def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Any) -> tuple[float, dict[str, Any]] | None:
        """Server-side evaluation of the global adapter with ``evaluate_fn`` (None without one)."""
        rnd = server_round + self._offset
        if server_round == 0 and self._offset > 0:  # a resumed run: round `offset` was evaluated before the checkpoint
            return None
        result = None
        if self._evaluated is not None and self._evaluated[0] == rnd:  # done by the health check
            result = self._evaluated[1]
        elif self.evaluate_fn is not None and self._refused_round != rnd:
            out = self.evaluate_fn(self.global_adapter, self.global_head)  # None: skipped this round
            if out is not None:
                result = (float(out[0]), dict(out[1]))
        self._evaluated = None
        row = next((h for h in self.history if h["round"] == rnd), None)
        if row is None and rnd == 0:
            row = {"round": 0}
            self.history.insert(0, row)
        if row is not None:
            if result is not None:
                row["loss"] = result[0]
                row.update({k: float(v) for k, v in result[1].items()})
            if rnd > 0:
                self.save_checkpoint()
            if self.on_round is not None:
                self.on_round(dict(row))
        return result

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path | None = None) -> Path | None:
        """Write the server state (atomically) to ``path`` or ``checkpoint_dir/checkpoint.safetensors``.

        The automatic save (no ``path``) writes nothing after a round the health check refused: the
        checkpoint on disk stays the last healthy round's.
        """
        if path is None:
            if self.checkpoint_dir is None or self._refused_round == self.completed_rounds:
                return None
            path = self.checkpoint_dir / CHECKPOINT
        tensors = {f"g/{n}": t.detach().clone().contiguous() for n, t in self.tensors.items()}
        opt_meta: dict[str, Any] | None = None
        if self._opt is not None:
            sd = self._opt.state_dict()
            names = list(self._params)
            state_meta: dict[str, dict[str, Any]] = {}
            for idx, st in sd["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        tensors[f"opt/{names[idx]}/{k}"] = v.detach().clone().contiguous()
                    else:
                        state_meta.setdefault(names[idx], {})[k] = v
            opt_meta = {"param_groups": sd["param_groups"], "scalars": state_meta}
        meta = {"kind": _KIND, "method": self.method, "config": self.config.to_json(), "round": self.completed_rounds,
                "modules": self.modules, "names": list(self.tensors), "fingerprint": self.fingerprint,
                "optimizer": opt_meta, "history": _jsonable(self.history)}
        return io.save_tensors(path, tensors, meta)

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a checkpoint written by :meth:`save_checkpoint` (method, rank, modules and shapes must match)."""
        tensors, meta = io.load_tensors(path)
        src = str(path)
        if meta.get("kind") != _KIND:
            raise ArtifactError(f"{src}: not a rankwise federated checkpoint")
        if meta.get("method") != self.method:
            raise ArtifactError(f"{src}: checkpoint of method {meta.get('method')!r}, this strategy is {self.method!r}")
        r = (meta.get("config") or {}).get("rank")
        if r != self.config.rank:
            raise ArtifactError(f"{src}: checkpoint has global rank r={r}, the config has rank={self.config.rank}")
        if meta.get("names") != list(self.tensors):
            raise ArtifactError(f"{src}: checkpoint holds tensors {meta.get('names')[:6]}..., this run expects "
                                f"{list(self.tensors)[:6]}...")
        for n, t in self.tensors.items():
            g = tensors.get(f"g/{n}")
            if g is None or tuple(g.shape) != tuple(t.shape):
                raise ArtifactError(f"{src}: tensor {n!r} missing or of shape {None if g is None else tuple(g.shape)}, "
                                    f"expected {tuple(t.shape)}")
        for n in list(self.tensors):
            self.tensors[n].copy_(tensors[f"g/{n}"].to(torch.float32))
        opt_meta = meta.get("optimizer")
        if opt_meta is not None:
            opt = self._optimizer()
            names = list(self._params)
            state: dict[int, dict[str, Any]] = {}
            for i, n in enumerate(names):
                st = {k[len(f"opt/{n}/"):]: v for k, v in tensors.items() if k.startswith(f"opt/{n}/")}
                st.update(opt_meta["scalars"].get(n, {}))
                if st:
                    state[i] = st
            opt.load_state_dict({"state": state, "param_groups": opt_meta["param_groups"]})
        self.completed_rounds = int(meta["round"])
        self._offset = self.completed_rounds
        self.history = list(meta.get("history") or [])


def _no_metrics(metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Flower's FedAvg aggregates client metrics through this; the strategies record their own."""
    return {}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


_CLASSES: dict[str, type] = {}


def flower_class(logic: type, name: str) -> type:
    """``logic`` mixed into ``flwr.server.strategy.FedAvg`` (built once, on first use: flwr is imported here)."""
    if name not in _CLASSES:
        from flwr.server.strategy import FedAvg

        _CLASSES[name] = type(name, (logic, FedAvg), {"__module__": logic.__module__, "__doc__": logic.__doc__})
    return _CLASSES[name]
