"""The task-incremental loop shared by the reproduction and ``rankwise continual``.

A :class:`MultiHeadModel` is an encoder (``encoder(**inputs) -> (B, H)`` pooled features) with one linear
head per task. For each task, in order (:func:`run_continual`):

1. a new head (seeded random init); a copy of it is fitted as a linear probe on the current (frozen) encoder's
   features, whose test accuracy is the "before training" accuracy of the task (FWT, below); with
   ``probe_init`` the fitted probe is the head's starting point instead (LP-FT);
2. ``learner.begin_task`` (new adapter), then ``epochs`` epochs over the task's batches training the adapter
   and the head (plus the learner's penalty and after-step constraint);
3. ``learner.end_task`` (merge, protected subspace) and the head is frozen;
4. every task learned so far is evaluated with its own head: row ``i`` of the accuracy matrix ``R``.

Metrics (:func:`continual_metrics`; accuracies in [0, 1]): MFN = mean_j R[T-1][j]; MAA = mean_i mean_{j<=i}
R[i][j]; BWT = mean_{j<T-1} (R[T-1][j] - R[j][j]); FWT = mean_{t>=1} (probe_t on the encoder after tasks < t
- probe_t on the pretrained encoder), the linear-probe reading of "accuracy before training minus zero-shot"
for a task-incremental protocol where a task's head does not exist before the task.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.adapt.stiefel_cl.baselines import ContinualLearner
from rankwise.core.errors import NumericalError

__all__ = ["ContinualResult", "ContinualTask", "MultiHeadModel", "continual_metrics", "probe_accuracy",
           "run_continual"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class MultiHeadModel(nn.Module):
    """``encoder`` + ``heads[task]``; ``forward(**inputs)`` gives the logits of :attr:`active` task."""

    def __init__(self, encoder: nn.Module, hidden: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.heads = nn.ModuleDict()
        self.hidden = hidden
        self.active: str | None = None

    def add_head(self, task: str, num_labels: int, seed: int) -> nn.Linear:
        head = nn.Linear(self.hidden, num_labels)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.02)
            head.bias.zero_()
        self.heads[task] = head
        return head

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        if self.active is None:
            raise RuntimeError("MultiHeadModel: no active task head")
        return self.heads[self.active](self.encoder(**inputs))


@dataclass
class ContinualTask:
    """One task: ``train`` batches (one epoch), ``test`` batches, the ``grad`` batches of the gradient passes."""

    name: str
    num_labels: int
    train: list[Batch]
    test: list[Batch]
    grad: list[Batch]


@dataclass
class ContinualResult:
    """``R[i][j]``: accuracy on task j after task i (None for j > i); ``correct[i][j]`` the per-example 0/1."""

    method: str
    tasks: list[str]
    R: list[list[float | None]]
    correct: list[list[list[float] | None]]
    before: list[float]
    zero_shot: list[float]
    spectra: list[dict[str, float]]
    losses: list[list[float]] = field(default_factory=list)
    seconds: float = 0.0
    step_ms: float = 0.0

    def metrics(self) -> dict[str, float]:
        return continual_metrics(self.R, self.before, self.zero_shot)

    def to_json(self) -> dict[str, Any]:
        def fin(x: float) -> float | None:
            return x if x is not None and math.isfinite(x) else None
        return {"method": self.method, "tasks": self.tasks, "R": self.R, "before": self.before,
                "zero_shot": self.zero_shot, "metrics": {k: fin(v) for k, v in self.metrics().items()},
                "spectra": [{k: fin(v) for k, v in s.items()} for s in self.spectra],
                "seconds": self.seconds, "step_ms": self.step_ms}


def continual_metrics(R: Sequence[Sequence[float | None]], before: Sequence[float] = (),
                      zero_shot: Sequence[float] = ()) -> dict[str, float]:
    """MFN, MAA, BWT and FWT of an accuracy matrix (see the module docstring); BWT/FWT are NaN for one task."""
    T = len(R)
    if T == 0 or any(R[i][j] is None for i in range(T) for j in range(i + 1)):
        raise ValueError("R must be a lower-triangular T x T accuracy matrix with R[i][j] set for j <= i")
    mfn = statistics.fmean(R[T - 1][j] for j in range(T))
    maa = statistics.fmean(statistics.fmean(R[i][j] for j in range(i + 1)) for i in range(T))
    bwt = statistics.fmean(R[T - 1][j] - R[j][j] for j in range(T - 1)) if T > 1 else float("nan")
    fwt = (statistics.fmean(before[t] - zero_shot[t] for t in range(1, T))
           if T > 1 and len(before) >= T and len(zero_shot) >= T else float("nan"))
    return {"MFN": mfn, "MAA": maa, "BWT": bwt, "FWT": fwt}


@torch.no_grad()
def _features(model: MultiHeadModel, batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    was = model.training
    model.eval()
    try:
        return torch.cat([model.encoder(**x) for x, _ in batches]), torch.cat([y for _, y in batches])
    finally:
        model.train(was)


def probe_accuracy(model: MultiHeadModel, task: ContinualTask, head: nn.Linear, *, steps: int = 100,
                   lr: float = 1e-2) -> tuple[float, nn.Linear]:
    """Fit ``head`` as a linear probe on the encoder's features of ``task.train`` (full-batch Adam, ``steps``)
    and return its test accuracy and the fitted head (in place)."""
    Xtr, ytr = _features(model, task.train)
    Xte, yte = _features(model, task.test)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    with torch.enable_grad():
        for p in head.parameters():
            p.requires_grad_(True)
        for _ in range(steps):
            loss = nn.functional.cross_entropy(head(Xtr), ytr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = float((head(Xte).argmax(-1) == yte).double().mean())
    return acc, head


@torch.no_grad()
def _evaluate(model: MultiHeadModel, task: ContinualTask) -> list[float]:
    was = model.training
    model.eval()
    model.active = task.name
    try:
        return [float(c) for x, y in task.test for c in (model(**x).argmax(-1) == y).double().tolist()]
    finally:
        model.train(was)


def _order(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def _train_task(learner: ContinualLearner, model: MultiHeadModel, task: ContinualTask, opt: torch.optim.Optimizer,
                epochs: int, seed: int, i: int, losses: list[float], steps_t: list[float]) -> None:
    for ep in range(epochs):
        for k in _order(len(task.train), seed * 1009 + i * 31 + ep):
            x, y = task.train[k]
            ts = time.perf_counter()
            loss = nn.functional.cross_entropy(model(**x), y)
            pen = learner.penalty()
            if pen is not None:
                loss = loss + pen
            if not torch.isfinite(loss):
                raise NumericalError(f"{learner.name}: training loss is {float(loss)} on task {task.name!r}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            learner.after_step()
            steps_t.append(time.perf_counter() - ts)
            losses.append(float(loss.detach()))


def run_continual(learner: ContinualLearner, model: MultiHeadModel, tasks: Sequence[ContinualTask], *,
                  epochs: int = 1, lr: float = 1e-3, head_lr: float = 1e-3, seed: int = 0,
                  probe_steps: int = 100, probe_lr: float = 1e-2, zero_shot: Sequence[float] | None = None,
                  start: int = 0, stop: int | None = None, probe_init: bool = False, log: Callable[[str], None] | None = None,
                  after_task: Callable[[int, "ContinualResult"], None] | None = None,
                  result: ContinualResult | None = None) -> ContinualResult:
    """Learn ``tasks[start:stop]`` in order with ``learner`` on ``model`` (see the module docstring).

    ``zero_shot``: probe accuracies on the pretrained encoder, one per task (computed here when None and
    ``start == 0``). ``result``: the result of the tasks before ``start`` (a resumed run). ``after_task(i, res)``
    runs after each task (e.g. to save state). ``probe_init``: start each head from its fitted probe (linear probing
    then fine-tuning) instead of the seeded random init.
    """
    names = [t.name for t in tasks]
    res = result or ContinualResult(learner.name, names, [], [], [], [], [])
    if zero_shot is None and not res.zero_shot:
        zs = []
        for k, task in enumerate(tasks):
            head = nn.Linear(model.hidden, task.num_labels)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 7919 + k)
                nn.init.normal_(head.weight, std=0.02)
                nn.init.zeros_(head.bias)
            zs.append(probe_accuracy(model, task, head, steps=probe_steps, lr=probe_lr)[0])
        res.zero_shot = zs
    elif zero_shot is not None:
        res.zero_shot = list(zero_shot)
    t0 = time.perf_counter()
    steps_t: list[float] = []
    for i in range(start, len(tasks) if stop is None else stop):
        task = tasks[i]
        head = model.add_head(task.name, task.num_labels, seed * 7919 + i)
        model.active = task.name
        probe = head if probe_init else copy.deepcopy(head)
        acc_before, _ = probe_accuracy(model, task, probe, steps=probe_steps, lr=probe_lr)
        res.before.append(acc_before)
        learner.begin_task(task.grad, task.name)
        for p in head.parameters():
            p.requires_grad_(True)
        opt = learner.optimizer(lr, list(head.parameters()), head_lr)
        model.train()
        losses = []
        with torch.random.fork_rng(devices=[]):  # dropout masks from the task's own seed: a resumed run is identical
            torch.manual_seed(seed * 1_000_003 + i)
            _train_task(learner, model, task, opt, epochs, seed, i, losses, steps_t)
        model.eval()
        res.spectra.append(learner.end_task(task.grad))
        for p in head.parameters():
            p.requires_grad_(False)
        row: list[float | None] = []
        crow: list[list[float] | None] = []
        for j in range(len(tasks)):
            if j <= i:
                c = _evaluate(model, tasks[j])
                crow.append(c)
                row.append(statistics.fmean(c))
            else:
                crow.append(None)
                row.append(None)
        res.R.append(row)
        res.correct.append(crow)
        res.losses.append(losses)
        if log is not None:
            shown = "  ".join(f"{names[j]} {row[j]:.3f}" for j in range(i + 1))
            log(f"[{learner.name}] task {i + 1}/{len(tasks)} {task.name}: probe before {acc_before:.3f}, "
                f"final loss {statistics.fmean(losses[-5:]):.3f}; accuracies: {shown}")
        if after_task is not None:
            after_task(i, res)
    res.seconds += time.perf_counter() - t0
    res.step_ms = 1e3 * statistics.median(steps_t) if steps_t else res.step_ms
    return res
