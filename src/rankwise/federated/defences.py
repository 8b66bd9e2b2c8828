"""Server-side defences of every federated method: update-size bounds, example-count caps, robust
aggregation and the global-model health check.

Federated aggregation trusts what clients send. Before these defences, clients replying with
1e30-scale values or claiming 10^18 examples took a run's accuracy from 0.64 to 0.09, the server's
loss went NaN and the run went on checkpointing the broken model. The shared server logic
(:class:`rankwise.federated.strategy.LoRAStrategyLogic`) applies, every round, in this order:

1. **Validity** (always): count, float32 dtype, shapes, finiteness of every array; a negative or
   non-integer example count. A failing reply is rejected (``on_invalid="skip"``) or raises.
2. **Example counts** (:func:`cap_examples`): a claim above what the client was assigned is capped
   at the assigned count (the server knows it when the task is local: simulation, in-process, or a
   deployed ServerApp that builds the task); with no assigned count known, at
   ``max_examples_ratio`` times the round's lower median claim.
3. **Update size** (:func:`size_outliers`): a client whose update, the root-mean-square change of
   the arrays it was sent, exceeds ``max_update_norm_ratio`` times the round's *lower* median
   (the smaller middle value, so that one attacker among two clients cannot set the scale) is
   rejected.
4. **Robust aggregation** (``aggregator``): "mean" is each method's own weighted average;
   "median" and "trimmed" replace it coordinate-wise (:func:`robust_combine`, the logic of
   Flower's ``FedMedian`` / ``FedTrimmedAvg``, applied in each method's aggregation space, see
   ``LoRAStrategyLogic.contributions``); "krum" keeps the ``n - f`` updates with the lowest Krum
   scores (:func:`krum_select`, Flower's ``Krum`` scoring) and averages those with the method's mean.
5. **Health check** (:func:`health_problem`): after aggregation, every global tensor must be finite
   and, where the server evaluates, the test loss finite and at most ``max_loss_ratio`` times the
   last accepted round's, and the test accuracy at most ``max_accuracy_drop`` below it. A failing round is refused: the global state (and server-optimizer state)
   goes back to the previous round's, the refusal is in the history, and no checkpoint is written
   from it; the next round continues from the healthy state.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch

__all__ = ["cap_examples", "health_problem", "krum_select", "lower_median", "robust_combine", "size_outliers",
           "update_size"]

HOWS = ("mean", "median", "trimmed")


def lower_median(values: Sequence[float]) -> float:
    """The smaller middle value of ``values`` (the median for an odd count); NaN for none."""
    if not len(values):
        return float("nan")
    return float(sorted(values)[(len(values) - 1) // 2])


def update_size(returned: Sequence[np.ndarray], sent: Sequence[np.ndarray]) -> float:
    """Root-mean-square of ``returned - sent`` over all arrays, in float64 (inf if it overflows or is not finite)."""
    total, count = 0.0, 0
    with np.errstate(over="ignore", invalid="ignore"):
        for r, s in zip(returned, sent):
            d = np.asarray(r, np.float64) - np.asarray(s, np.float64)
            total += float(np.sum(d * d))
            count += d.size
    out = math.sqrt(total / max(count, 1))
    return out if math.isfinite(out) else float("inf")


def size_outliers(sizes: Sequence[float], ratio: float | None) -> list[bool]:
    """Which sizes exceed ``ratio`` times their lower median (none when ``ratio`` is None or the median is 0)."""
    if ratio is None or not sizes:
        return [False] * len(sizes)
    med = lower_median(sizes)
    if not med > 0 or not math.isfinite(med):
        return [not math.isfinite(s) for s in sizes]
    return [not s <= ratio * med for s in sizes]


def cap_examples(claims: Sequence[int], assigned: Sequence[int | None], ratio: float | None) -> list[int]:
    """Each claimed example count capped at the client's assigned count, or (unknown assignment) at
    ``ratio`` times the lower median claim of the round (``ratio`` None: no cap there)."""
    med = lower_median([float(c) for c in claims])
    out = []
    for c, a in zip(claims, assigned):
        if a is not None:
            out.append(min(int(c), int(a)))
        elif ratio is not None and math.isfinite(med):
            out.append(min(int(c), int(math.floor(ratio * max(med, 1.0)))))
        else:
            out.append(int(c))
    return out


def robust_combine(values: Sequence[torch.Tensor], weights: Sequence[float], how: str = "median", trim: float = 0.2,
                   masks: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Combine aligned client tensors coordinate-wise; float64.

    ``how="mean"``: ``sum_i w_i m_i x_i`` (the methods' own average, zeros where a client's mask is
    off). ``"median"`` / ``"trimmed"``: the same mass of weight, ``sum_i w_i m_i``, times the median
    (average of the two middle values for an even count, as ``np.median``) or the trimmed mean
    (``floor(trim * t)`` values cut at each end of the ``t`` values present, as Flower's
    ``FedTrimmedAvg``) of the values present at that coordinate. Without masks and with weights
    summing to 1 these are Flower's ``FedMedian`` / ``FedTrimmedAvg`` exactly. A coordinate that no
    client touched is 0.
    """
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    x = torch.stack([v.double() for v in values])
    present = (torch.ones_like(x, dtype=torch.bool) if masks is None or all(m is None for m in masks) else
               torch.stack([torch.ones_like(v, dtype=torch.bool) if m is None else m.bool().expand_as(v)
                            for v, m in zip(values, masks)]))
    w = torch.as_tensor([float(v) for v in weights], dtype=torch.float64).reshape(-1, *([1] * (x.ndim - 1)))
    mass = (w * present).sum(0)
    if how == "mean":
        return (w * torch.where(present, x, torch.zeros_like(x))).sum(0)
    t = present.sum(0)
    srt = torch.sort(torch.where(present, x, torch.full_like(x, float("nan"))), dim=0).values
    if how == "median":
        cut = torch.div(t - 1, 2, rounding_mode="floor").clamp_min(0)
    else:
        cut = torch.floor(float(trim) * t.double()).long()
    pos = torch.arange(x.shape[0]).reshape(-1, *([1] * (x.ndim - 1)))
    keep = (pos >= cut) & (pos < t - cut)
    stat = torch.where(keep, srt, torch.zeros_like(srt)).sum(0) / keep.sum(0).clamp_min(1)
    return torch.where(t > 0, mass * stat, torch.zeros_like(stat))


def krum_select(vectors: Sequence[torch.Tensor], byzantine: int) -> list[int]:
    """Multi-Krum: the indices of the ``n - f`` vectors with the lowest Krum scores, ascending.

    Score of i: the sum of squared distances to its ``max(1, n - f - 2)`` nearest other vectors (as
    Flower's ``aggregate_krum``). With fewer than ``f + 3`` vectors the scores cannot separate an
    attacker from the honest clients: every index is returned.
    """
    n, f = len(vectors), int(byzantine)
    if n < f + 3:
        return list(range(n))
    flat = torch.stack([v.double().reshape(-1) for v in vectors])
    d = torch.cdist(flat, flat).pow(2)
    closest = max(1, n - f - 2)
    scores = [float(torch.sort(torch.cat([d[i, :i], d[i, i + 1:]])).values[:closest].sum()) for i in range(n)]
    order = sorted(range(n), key=lambda i: (scores[i], i))
    return sorted(order[: max(1, n - f)])


def health_problem(tensors: Mapping[str, torch.Tensor], loss: float | None, reference_loss: float | None,
                   max_loss_ratio: float, accuracy: float | None = None, reference_accuracy: float | None = None,
                   max_accuracy_drop: float | None = None) -> str | None:
    """Why the global model is unhealthy, or None: a non-finite tensor, a non-finite test loss, a test
    loss above ``max_loss_ratio`` times the last accepted one, or a test accuracy more than
    ``max_accuracy_drop`` below the last accepted one (``loss`` / ``accuracy`` None: not evaluated)."""
    for n, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            return f"global tensor {n!r} holds NaN or inf"
    if loss is None:
        return None
    if not math.isfinite(loss):
        return f"test loss is {loss}"
    if reference_loss is not None and math.isfinite(reference_loss) and loss > max_loss_ratio * reference_loss:
        return (f"test loss {loss:.4g} exceeds {max_loss_ratio:g} x the last accepted round's {reference_loss:.4g} "
                f"(collapse bound)")
    if (max_accuracy_drop is not None and accuracy is not None and reference_accuracy is not None
            and accuracy < reference_accuracy - max_accuracy_drop):
        return (f"test accuracy {accuracy:.4g} fell more than {max_accuracy_drop:g} below the last accepted round's "
                f"{reference_accuracy:.4g} (collapse bound)")
    return None
