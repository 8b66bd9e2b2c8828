"""What a federated run trains on: a task gives a base model, per-client data and a test set.

A task is any object with the attributes of :class:`FederatedTask`. The federated apps (simulation
and deployment) name it by a string, so that a ClientApp process can rebuild it from its run
configuration: ``"synthetic"`` / ``"synthetic-moe"`` (built in, :class:`SyntheticTask`,
:class:`SyntheticMoETask`) or ``"package.module:factory"``,
an importable callable ``factory(**task_kwargs) -> task``. Tasks are cached per process
(:func:`resolve_task`), so a simulation actor or a SuperNode builds its task once.

Data are tensors (:class:`TensorData`): ``inputs`` is a dict of tensors whose first dimension is
the example, ``labels`` a ``(N,)`` int64 tensor; ``model(**inputs[idx]) -> logits (B, C)``.
Non-IID client partitions come from :func:`dirichlet_partition` (label proportions per client drawn
from ``Dirichlet(alpha)``, the usual federated benchmark protocol).
"""

from __future__ import annotations

import importlib
import json
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from rankwise.core.validate import check_int, check_number
from rankwise.federated.moe import LoRAMoE

__all__ = [
    "FederatedTask",
    "SyntheticMoETask",
    "SyntheticTask",
    "TensorData",
    "dirichlet_partition",
    "evaluate_model",
    "resolve_task",
]


@dataclass
class TensorData:
    """Examples as tensors: ``inputs[k]`` has shape ``(N, ...)``, ``labels`` shape ``(N,)``.

    With an ``attention_mask`` input, :meth:`select` trims every 2-D+ input to the longest real
    sequence of the selected rows (padding beyond it is masked anyway).
    """

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor

    def __post_init__(self) -> None:
        n = int(self.labels.shape[0])
        for k, v in self.inputs.items():
            if v.shape[0] != n:
                raise ValueError(f"TensorData: input {k!r} has {v.shape[0]} rows, labels have {n}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def select(self, idx: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs = {k: v[idx] for k, v in self.inputs.items()}
        mask = inputs.get("attention_mask")
        if mask is not None and mask.ndim == 2 and len(idx):
            n = max(1, int(mask.sum(1).max()))
            inputs = {k: (v[:, :n].contiguous() if v.ndim >= 2 else v) for k, v in inputs.items()}
        return inputs, self.labels[idx]


class FederatedTask(Protocol):
    """The interface the federated client and server use.

    Attributes / methods:
        name: a short identifier.
        num_clients: how many partitions :meth:`client_data` serves (ids ``0 .. num_clients-1``).
        targets: module-name patterns of the Linear layers that get LoRA (see ``rankwise.core.select``).
        head: names of parameters that every client trains and the server averages (a classifier head);
            empty for none.
        build_model(): a fresh copy of the base model (deterministic; base frozen by the caller).
        client_data(partition) / test_data(): :class:`TensorData`.
    """

    name: str
    num_clients: int
    targets: tuple[str, ...]
    head: tuple[str, ...]

    def build_model(self) -> nn.Module: ...

    def client_data(self, partition: int) -> TensorData: ...

    def test_data(self) -> TensorData: ...


def dirichlet_partition(labels: Sequence[int] | np.ndarray | torch.Tensor, num_clients: int, alpha: float,
                        seed: int, min_size: int = 1, max_tries: int = 200) -> list[np.ndarray]:
    """Split example indices over ``num_clients`` with label proportions ~ ``Dirichlet(alpha)`` per class.

    For each class, a proportion vector over clients is drawn from ``Dirichlet(alpha * 1)`` and the
    class's (shuffled) examples are cut accordingly. Redrawn (up to ``max_tries``) until every client
    holds at least ``min_size`` examples; then examples are moved from the largest clients to the
    smallest. Returns one sorted index array per client; deterministic in ``seed``.
    """
    y = np.asarray(labels.tolist() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64)
    if not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha (Dirichlet concentration) must be a finite number > 0, got {alpha!r}")
    if min_size * num_clients > len(y):
        raise ValueError(f"cannot give {num_clients} clients {min_size} examples each from {len(y)} examples")
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    parts: list[list[int]] = []
    for _ in range(max_tries):
        parts = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            break
    else:
        for i in range(num_clients):  # top up the smallest clients from the largest
            while len(parts[i]) < min_size:
                j = max(range(num_clients), key=lambda k: len(parts[k]))
                parts[i].append(parts[j].pop())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


@torch.no_grad()
def evaluate_model(model: nn.Module, data: TensorData, batch_size: int = 256, *,
                   per_example: list[float] | None = None) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``data`` (eval mode, restored afterwards).

    ``per_example``: a list that receives 1.0 / 0.0 per example (predicted right or not), in order.
    """
    was = model.training
    model.eval()
    loss, correct = 0.0, 0
    try:
        for s in range(0, len(data), batch_size):
            inputs, y = data.select(torch.arange(s, min(len(data), s + batch_size)))
            logits = model(**inputs)
            loss += float(nn.functional.cross_entropy(logits.double(), y, reduction="sum"))
            right = logits.argmax(-1) == y
            correct += int(right.sum())
            if per_example is not None:
                per_example += right.double().tolist()
    finally:
        model.train(was)
    n = max(1, len(data))
    return loss / n, correct / n


# ------------------------------------------------------------------------------------------------
# a small synthetic task (tests, deployment smoke runs, users without the zoo)
# ------------------------------------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class _TeacherStudentTask:
    """What the synthetic tasks share: Gaussian inputs labelled by a teacher, a Dirichlet split, the accessors."""

    num_clients: int

    def _label(self, base: nn.Module, teacher: nn.Module, gen: torch.Generator, per_client: int, n_test: int,
               d_in: int, dirichlet_alpha: float, seed: int) -> None:
        self._state = base.state_dict()
        n_train = per_client * self.num_clients
        x = torch.randn(n_train + n_test, d_in, generator=gen)
        with torch.no_grad():
            y = teacher(x).argmax(-1)
        self._train = TensorData({"x": x[:n_train]}, y[:n_train])
        self._test = TensorData({"x": x[n_train:]}, y[n_train:])
        self._parts = dirichlet_partition(y[:n_train], self.num_clients, dirichlet_alpha, seed, min_size=8)

    def client_data(self, partition: int) -> TensorData:
        if not 0 <= partition < self.num_clients:
            raise ValueError(f"partition {partition} is outside 0..{self.num_clients - 1}")
        idx = torch.as_tensor(self._parts[partition])
        return TensorData({k: v[idx] for k, v in self._train.inputs.items()}, self._train.labels[idx])

    def test_data(self) -> TensorData:
        return self._test


class SyntheticTask(_TeacherStudentTask):
    """A teacher-student classification task whose solution is a low-rank change of a frozen MLP.

    Base model ``x (B, d_in) -> fc1 -> tanh -> fc2 -> tanh -> classifier -> logits (B, C)`` with
    seeded random weights; the labels come from a teacher whose ``fc1``/``fc2`` weights differ from
    the base by a rank-``teacher_rank`` perturbation, so LoRA on ``fc1``/``fc2`` can learn them.
    Training examples are split over clients non-IID by :func:`dirichlet_partition`.
    """

    name = "synthetic"
    targets: tuple[str, ...] = ("fc1", "fc2")
    head: tuple[str, ...] = ("classifier.weight", "classifier.bias")

    def __init__(self, num_clients: int = 16, per_client: int = 64, n_test: int = 512, d_in: int = 16,
                 hidden: int = 32, num_labels: int = 4, teacher_rank: int = 4, dirichlet_alpha: float = 0.3,
                 seed: int = 0) -> None:
        for k, v in dict(num_clients=num_clients, per_client=per_client, n_test=n_test, d_in=d_in, hidden=hidden,
                         num_labels=num_labels, teacher_rank=teacher_rank).items():
            check_int(f"SyntheticTask.{k}", v, 1)
        self.num_clients, self.seed = num_clients, seed
        self.d_in, self.hidden, self.num_labels = d_in, hidden, num_labels
        gen = torch.Generator().manual_seed(seed)
        base = self._fresh(gen)
        teacher = _MLP(d_in, hidden, num_labels)
        teacher.load_state_dict(base.state_dict())
        with torch.no_grad():
            for lin in (teacher.fc1, teacher.fc2):
                out_f, in_f = lin.weight.shape
                u = torch.randn(out_f, teacher_rank, generator=gen)
                v = torch.randn(teacher_rank, in_f, generator=gen)
                lin.weight.add_(1.5 * (u @ v) / math.sqrt(in_f * teacher_rank))
        self._label(base, teacher, gen, per_client, n_test, d_in, dirichlet_alpha, seed)

    def _fresh(self, gen: torch.Generator) -> _MLP:
        m = _MLP(self.d_in, self.hidden, self.num_labels)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        return m

    def build_model(self) -> nn.Module:
        m = _MLP(self.d_in, self.hidden, self.num_labels)
        m.load_state_dict(self._state)
        return m


# ------------------------------------------------------------------------------------------------
# a synthetic MoE task (tests, CLI smoke runs, users without a MoE model at hand)
# ------------------------------------------------------------------------------------------------

class _MoEClassifier(nn.Module):
    def __init__(self, d_in: int, hidden: int, ffn: int, num_experts: int, top_k: int, num_layers: int,
                 num_labels: int) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.moe = nn.ModuleList(LoRAMoE(hidden, ffn, num_experts, top_k, router_bias=True) for _ in range(num_layers))
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.moe:
            h = h + layer(h)
        return self.classifier(h)


class SyntheticMoETask(_TeacherStudentTask):
    """Teacher-student classification on a frozen random MoE (``x (B, d_in) -> logits (B, C)``).

    The base is a seeded MoE classifier (``num_layers`` LoRAMoE layers with residuals); its router
    carries a per-expert bias ``router_skew * linspace(1, -1, M)`` so that utilisation is imbalanced,
    as in a pretrained MoE; expert weights are drawn ``expert_scale`` times larger than 1/sqrt(fan_in)
    so that the MoE output, not the residual, decides the label. The teacher perturbs EVERY expert of
    the base by its own rank-``teacher_rank`` change (times ``teacher_scale``), so a student that
    leaves some experts untrained mislabels the tokens those experts receive. Labels are the
    teacher's argmax at its full top-k; partitions are Dirichlet non-IID over labels. ``targets``:
    all expert projections; ``head``: the classifier and every layer's phi.
    """

    name = "synthetic-moe"

    def __init__(self, num_clients: int = 16, per_client: int = 64, n_test: int = 512, d_in: int = 16,
                 hidden: int = 32, ffn: int = 32, num_experts: int = 8, top_k: int = 4, num_layers: int = 1,
                 num_labels: int = 4, teacher_rank: int = 2, router_skew: float = 1.0, teacher_scale: float = 2.0,
                 expert_scale: float = 3.0, dirichlet_alpha: float = 0.3, seed: int = 0) -> None:
        for k, v in dict(num_clients=num_clients, per_client=per_client, n_test=n_test, d_in=d_in, hidden=hidden,
                         ffn=ffn, num_experts=num_experts, top_k=top_k, num_layers=num_layers, num_labels=num_labels,
                         teacher_rank=teacher_rank).items():
            check_int(f"SyntheticMoETask.{k}", v, 1)
        for k, v in dict(router_skew=router_skew, teacher_scale=teacher_scale, expert_scale=expert_scale).items():
            check_number(f"SyntheticMoETask.{k}", v)
        self.num_clients, self.seed, self.top_k = num_clients, seed, top_k
        self.dims = (d_in, hidden, ffn, num_experts, top_k, num_layers, num_labels)
        self.targets: tuple[str, ...] = (r"re:.*\.experts\.\d+\.w[123]",)
        self.head: tuple[str, ...] = ("classifier.weight", "classifier.bias",
                                      *(f"moe.{i}.phi" for i in range(num_layers)))
        gen = torch.Generator().manual_seed(seed)
        base = _MoEClassifier(*self.dims)
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith("phi"):
                    continue
                if name.endswith("router.bias"):
                    p.copy_(float(router_skew) * torch.linspace(1.0, -1.0, num_experts))
                    continue
                scale = 2.0 if "router" in name else float(expert_scale) if "experts" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        teacher = _MoEClassifier(*self.dims)
        teacher.load_state_dict(base.state_dict())
        with torch.no_grad():
            for layer in teacher.moe:
                for e in layer.experts:
                    for lin in (e.w1, e.w3, e.w2):
                        o, i = lin.weight.shape
                        u = torch.randn(o, teacher_rank, generator=gen)
                        v = torch.randn(teacher_rank, i, generator=gen)
                        lin.weight.add_(float(teacher_scale) * (u @ v) / math.sqrt(i * teacher_rank))
        self._label(base, teacher, gen, per_client, n_test, d_in, dirichlet_alpha, seed)

    def build_model(self) -> nn.Module:
        m = _MoEClassifier(*self.dims)
        m.load_state_dict(self._state)
        return m


# ------------------------------------------------------------------------------------------------
# resolving a task by name (process-level cache)
# ------------------------------------------------------------------------------------------------

BUILTIN: dict[str, Callable[..., Any]] = {"synthetic": SyntheticTask, "synthetic-moe": SyntheticMoETask}
_CACHE: dict[str, Any] = {}
_LOCK = threading.Lock()


def resolve_task(spec: str | Any, kwargs: Mapping[str, Any] | None = None) -> Any:
    """The task named by ``spec`` built with ``kwargs`` (cached per process), or ``spec`` itself if it is a task.

    ``spec``: ``"synthetic"`` or ``"package.module:factory"``. Unknown names raise ValueError.
    """
    if not isinstance(spec, str):
        return spec
    kwargs = dict(kwargs or {})
    key = spec + "|" + json.dumps(kwargs, sort_keys=True)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        if spec in BUILTIN:
            factory = BUILTIN[spec]
        elif ":" in spec:
            mod, _, attr = spec.partition(":")
            try:
                factory = getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"task {spec!r} cannot be imported: {e}") from e
        else:
            raise ValueError(f"unknown task {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:factory'")
        task = factory(**kwargs)
        _CACHE[key] = task
        return task
