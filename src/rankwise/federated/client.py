"""The client side, shared by every strategy: install the received LoRA blocks, train H steps, send them back.

The client is method-agnostic: FSLoRA, HetLoRA, FlexLoRA and FedAvg-LoRA differ only in what the
server sends (which rank-``k`` blocks ``A (k, in)``, ``B (out, k)`` and which scaling ``s``) and how
it aggregates. A client installs the blocks as a rankwise LoRA adapter on a fresh copy of its task's
base model (:func:`rankwise.core.lora.set_state`; base frozen, head trainable), runs ``local_steps``
AdamW steps on mini-batches of its own data (order drawn from a seed derived from
``(seed, round, partition)``, so a run is reproducible and a resumed run trains identically), and
returns the trained blocks in the layout it received (see :mod:`rankwise.federated.common`).

For FSLoRA the received blocks are ``B[:, J]``, ``A[J, :]`` with scaling ``alpha / k``
(= ``alpha / r * r / k``, the sketch ``S = (r/k) sum_{j in J} e_j e_j^T``); gradients of the columns /
rows outside ``J`` are never formed, which is the paper's sliced implementation.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import weakref
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from rankwise.core.lora import AdapterState, lora_layers, set_state
from rankwise.federated.common import HEAD_PREFIX, WIRE_DTYPE, check_update, decode_layout, derive_seed
from rankwise.federated.tasks import TensorData, resolve_task

__all__ = ["FAULTS", "LoRAClient", "install", "local_train", "make_client_fn", "read_blocks", "task_loss",
           "train_steps"]

log = logging.getLogger(__name__)
ADAPTER = "default"
FAULTS = ("raise", "sleep", "nan", "inf", "shape", "dtype", "boost", "value", "examples")


def install(base: nn.Module, arrays: list[np.ndarray], layout: list[tuple[str, tuple[int, ...]]],
            scaling: Mapping[str, float]) -> nn.Module:
    """A copy of ``base`` with the layout's LoRA blocks installed as adapter ``default`` and head values set.

    Only the adapter factors and the ``head:`` parameters are trainable afterwards.
    """
    problem = check_update(arrays, layout)
    if problem is not None:
        raise ValueError(f"server payload does not match its layout: {problem}")
    model = copy.deepcopy(base)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    head: dict[str, torch.Tensor] = {}
    for a, (name, _) in zip(arrays, layout):
        t = torch.from_numpy(np.array(a, copy=True))
        if name.startswith(HEAD_PREFIX):
            head[name[len(HEAD_PREFIX):]] = t
        else:
            module, _, kind = name.rpartition(".")
            factors.setdefault(module, {})[kind] = t
    state = AdapterState({"method": "federated"}, factors, {m: float(scaling[m]) for m in factors})
    set_state(model, state, ADAPTER, check_base=False, freeze_base=True, source="server payload")
    params = dict(model.named_parameters())
    for name, t in head.items():
        if name not in params:
            raise ValueError(f"server payload names head parameter {name!r}, which the model lacks")
        p = params[name]
        if tuple(p.shape) != tuple(t.shape):
            raise ValueError(f"head parameter {name!r}: payload {tuple(t.shape)}, model {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        p.requires_grad_(True)
    return model


def read_blocks(model: nn.Module, layout: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray]:
    """The model's adapter factors and head values in ``layout`` order, as float32 ndarrays."""
    layers = dict(lora_layers(model))
    params = dict(model.named_parameters())
    out = []
    for name, _ in layout:
        if name.startswith(HEAD_PREFIX):
            t = params[name[len(HEAD_PREFIX):]]
        else:
            module, _, kind = name.rpartition(".")
            layer = layers[module]
            t = (layer.lora_A if kind == "lora_A" else layer.lora_B)[ADAPTER].weight
        out.append(t.detach().to(torch.float32).cpu().numpy().astype(WIRE_DTYPE, copy=True))
    return out


def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classification (labels (B,)) or token prediction (labels (B, T), -100 ignored)."""
    if labels.ndim == 1:
        return nn.functional.cross_entropy(logits, labels)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def train_steps(model: nn.Module, data: TensorData, *, steps: int, batch_size: int, lr: float,
                head_lr: float | None = None, weight_decay: float = 0.0, seed: int = 0,
                objective: Callable[[torch.Tensor], torch.Tensor] | None = None,
                after_backward: Callable[[], None] | None = None) -> float:
    """The client loop every method shares: ``steps`` AdamW steps on mini-batches of ``data``.

    The adapter factors train at ``lr``, the other trainable parameters (the head) at ``head_lr``
    (None: ``lr``). Batches are epochs over ``data`` in orders drawn from ``Generator(seed)``; a client
    with fewer than ``batch_size`` examples uses all of them each step. Each step computes the task
    loss (:func:`task_loss`; a non-finite loss raises FloatingPointError), backpropagates
    ``objective(loss)`` (None: the loss itself; a method adds its regularisers there), calls
    ``after_backward()`` (a method may edit the gradients there) and steps. Returns the mean task
    loss; the model is left in eval mode.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    head_ids = {id(p) for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    groups = [{"params": [p for p in params if id(p) not in head_ids], "lr": lr},
              {"params": [p for p in params if id(p) in head_ids], "lr": lr if head_lr is None else head_lr}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    n = len(data)
    bs = min(batch_size, n)
    order: list[torch.Tensor] = []
    losses = []
    model.train()
    for _ in range(steps):
        if not order:
            perm = torch.randperm(n, generator=gen)
            order = [perm[s:s + bs] for s in range(0, n - bs + 1, bs)]
        inputs, y = data.select(order.pop(0))
        loss = task_loss(model(**inputs), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"local training loss is {float(loss)}")
        total = loss if objective is None else objective(loss)
        opt.zero_grad(set_to_none=True)
        total.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return float(np.mean(losses)) if losses else float("nan")


def local_train(model: nn.Module, data: TensorData, *, steps: int, batch_size: int, lr: float,
                head_lr: float | None = None, weight_decay: float = 0.0, seed: int = 0) -> float:
    """The LoRA client's local training: :func:`train_steps` on the task loss alone; the mean training loss."""
    return train_steps(model, data, steps=steps, batch_size=batch_size, lr=lr, head_lr=head_lr,
                       weight_decay=weight_decay, seed=seed)


def _flower_numpy_client() -> type:
    from flwr.client import NumPyClient

    return NumPyClient


class _ClientImpl:
    """The logic of :class:`LoRAClient` (kept free of flwr so the module imports without it)."""

    def __init__(self, task: Any, partition: int, faults: Mapping[int, str] | None = None) -> None:
        self.task = task
        self.partition = int(partition)
        self.faults = {int(k): str(v) for k, v in (faults or {}).items()}

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        return {"partition-id": self.partition, "num-examples": len(self.task.client_data(self.partition))}

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return []

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        fault = self.faults.get(self.partition, "")
        if fault == "raise":
            raise RuntimeError(f"injected fault: client {self.partition} raises")
        if fault.startswith("sleep"):
            time.sleep(float(fault.partition(":")[2] or 30))
        layout = decode_layout(config["layout"])
        model = install(_base_model(self.task), parameters, layout, json.loads(config["scaling"]))
        data = self.task.client_data(self.partition)
        torch_threads = int(config.get("torch-threads", 0))
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        loss, metrics = self.train(model, data, config,
                                   seed=derive_seed(int(config["seed"]), "batches", int(config["round"]),
                                                    self.partition))
        out = _inject(fault, read_blocks(model, layout), parameters)
        n = len(data)
        if fault.startswith("examples:"):
            n = int(float(fault.partition(":")[2]))
        return out, n, {"loss": loss, "partition": self.partition, **metrics}

    def train(self, model: nn.Module, data: TensorData, config: dict[str, Any], *,
              seed: int) -> tuple[float, dict[str, Any]]:
        """Local training of the installed ``model``: (mean loss, extra metrics). A method's client overrides it."""
        loss = local_train(model, data, steps=int(config["local-steps"]), batch_size=int(config["batch-size"]),
                           lr=float(config["lr"]), head_lr=float(config["head-lr"]),
                           weight_decay=float(config.get("weight-decay", 0.0)), seed=seed)
        layout = decode_layout(config["layout"])
        ranks = [s[0] for n, s in layout if n.endswith(".lora_A")]
        return loss, {"rank": float(np.mean(ranks)) if ranks else 0.0}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        return float("nan"), 0, {}


def _inject(fault: str, out: list[np.ndarray], sent: list[np.ndarray]) -> list[np.ndarray]:
    """A malformed or malicious reply for robustness tests (see :func:`LoRAClient`'s ``faults``)."""
    if fault in ("nan", "inf"):
        out[0] = out[0].copy()
        out[0].flat[0] = np.nan if fault == "nan" else np.inf
    elif fault == "shape":
        out[0] = np.zeros((out[0].shape[0] + 1, *out[0].shape[1:]), WIRE_DTYPE)
    elif fault == "dtype":
        out[0] = out[0].astype(np.float64)
    elif fault.startswith("boost:"):  # model replacement: sent + factor x the honest change
        factor = float(fault.partition(":")[2])
        out = [(np.asarray(s, np.float64) + factor * (o.astype(np.float64) - np.asarray(s, np.float64)))
               .astype(WIRE_DTYPE) for o, s in zip(out, sent)]
    elif fault.startswith("value:"):  # every entry replaced by one value (e.g. 1e30)
        v = float(fault.partition(":")[2])
        out = [np.full(o.shape, v, WIRE_DTYPE) for o in out]
    return out


_BASES: "weakref.WeakKeyDictionary[Any, nn.Module]" = weakref.WeakKeyDictionary()


def _base_model(task: Any) -> nn.Module:
    """The task's base model, built once per process and task (copied per fit, never trained in place)."""
    key = task
    if key not in _BASES:
        m = task.build_model()
        for p in m.parameters():
            p.requires_grad_(False)
        m.eval()
        _BASES[key] = m
    return _BASES[key]


_CLIENT_CLS: list[type] = []


def LoRAClient(task: Any, partition: int, faults: Mapping[int, str] | None = None) -> Any:
    """A Flower ``NumPyClient`` training LoRA blocks for ``partition`` of ``task``.

    ``faults`` (testing robustness): ``{partition: fault}`` makes that client misbehave: ``"raise"``,
    ``"sleep:<seconds>"`` (stall), ``"nan"`` / ``"inf"`` / ``"shape"`` / ``"dtype"`` (a malformed reply),
    ``"boost:<factor>"`` (reply ``sent + factor x`` its honest change), ``"value:<v>"`` (every entry
    ``v``, e.g. 1e30) or ``"examples:<n>"`` (claim ``n`` examples).
    """
    if not _CLIENT_CLS:
        _CLIENT_CLS.append(type("LoRAClient", (_ClientImpl, _flower_numpy_client()), {}))
    return _CLIENT_CLS[0](task, partition, faults)


def make_client_fn(task: str | Any = "synthetic", task_kwargs: Mapping[str, Any] | None = None,
                   faults: Mapping[int, str] | None = None, *, client: Callable[..., Any] | None = None) -> Any:
    """A Flower ``client_fn(context) -> Client`` for ``task`` (a task object, or a name for :func:`resolve_task`).

    The partition comes from ``context.node_config["partition-id"]`` (set by the simulation engine, or
    ``--node-config "partition-id=0"`` on a SuperNode). Nothing heavy happens here: the task is built
    lazily, once per process, on the first message. ``client(task, partition, faults)`` builds the
    NumPyClient (default :func:`LoRAClient`; a method with its own local training passes its own).
    """
    make = LoRAClient if client is None else client
    kwargs = dict(task_kwargs or {})
    faults = dict(faults or {})

    def client_fn(context: Any) -> Any:
        pid = context.node_config.get("partition-id")
        if pid is None:
            raise ValueError("node_config lacks 'partition-id' (start the SuperNode with "
                             "--node-config \"partition-id=<i> num-partitions=<n>\")")
        t = resolve_task(task, kwargs)
        return make(t, int(pid), faults).to_client()

    return client_fn
