"""RankTuner's relative-rank token weights and the token-weighted losses it is compared with.

Everything takes next-token logits ``(..., V)`` (class dimension last, the causal-LM layout, e.g.
``out.logits[:, :-1]``) and labels ``(...)`` already aligned with them (``labels[:, 1:]``), with
``ignore_index`` marking prompt and padding positions, exactly like
``F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=..., reduction=...)``.

Per valid position t (``z_t`` the logits, ``p_t`` the probability of the label ``y_t``):

* realised rank ``R_t = |{i : z_{t,i} >= z_{t,y_t}}|`` (1-indexed, ties pessimistic; computed on the
  logits, so it is exactly invariant to a positive temperature);
* expected rank ``E[R_t] = sum_k k p_{t,(k)}`` with ``p_{t,(1)} >= p_{t,(2)} >= ...`` (one sort);
* relative scale ``S_t = 1 / I_t``, ``I_t = g(f(R_t) - f(E[R_t]))``: with ``f = -gamma log`` and ``g = exp``
  (the default, ``f="neglog"``) ``S_t = (R_t / E[R_t])^gamma``; with ``f="inv"`` (``f(x) = gamma / x``)
  ``S_t = exp(gamma (1/E[R_t] - 1/R_t))``;
* weight ``w_t = clamp(S_t, s_min, s_max)`` divided by its mean over the valid positions of the call
  (``normalize="mean"``), computed without gradient;
* loss ``sum_t w_t (-log p_t) / n_valid`` (``reduction="mean"``), ``sum_t w_t (-log p_t)`` (``"sum"``)
  or the per-position terms (``"none"``, zero at ignored positions).

Statistics are computed in float32 (whatever the logits' dtype), in chunks of positions so that
the extra memory is ``O(chunk * V)``: with the default budget of 2^24 elements per chunk (64 MiB of
float32), a 152k vocabulary is processed about 110 positions at a time. The losses' own
cross-entropy is ``F.cross_entropy`` on the whole (float32) tensor, as a plain SFT step would do.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_choice, check_int, check_number

__all__ = [
    "CHUNK_ELEMENTS",
    "REDUCTIONS",
    "SCHEMES",
    "RankStats",
    "check_logits_labels",
    "expected_rank",
    "rank_stats",
    "realised_rank",
    "relative_scale",
    "scheme_scores",
    "weighted_nll",
]

CHUNK_ELEMENTS = 1 << 24  # float32 elements per chunk of the statistics pass (64 MiB)
REDUCTIONS = ("mean", "sum", "none")
#: token-weighting schemes: RankTuner and the baselines of the spec
SCHEMES = ("ranktuner", "uniform", "dft", "one_minus_p", "entropy", "focal")


def check_logits_labels(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> None:
    """Raise ValueError unless ``logits`` is ``(..., V)`` floating and ``labels`` ``(...)`` integer with
    values in ``[0, V)`` or ``ignore_index``."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"logits and labels must be tensors, got {type(logits).__name__}, {type(labels).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer class indices, got {labels.dtype}")
    if logits.ndim < 1 or logits.shape[:-1] != labels.shape or logits.shape[-1] < 1:
        raise ValueError(f"logits (..., V) and labels (...) must agree: got logits {tuple(logits.shape)} and "
                         f"labels {tuple(labels.shape)}")
    V = logits.shape[-1]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        raise ValueError(f"labels {tuple(labels.shape)} hold {int(bad.sum())} values outside [0, {V}) other than "
                         f"ignore_index={ignore_index} (e.g. {int(labels[bad][0])}); logits are {tuple(logits.shape)}")


@dataclass
class RankStats:
    """Per-position statistics, each shaped like the labels (zero at ignored positions).

    ``rank`` (R, float), ``expected_rank`` (E[R]), ``prob`` (p of the label), ``entropy`` (nats),
    ``mask`` (bool: valid positions).
    """

    rank: torch.Tensor
    expected_rank: torch.Tensor
    prob: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


def _chunk_rows(V: int, chunk: int | None) -> int:
    if chunk is not None:
        return check_int("chunk", chunk, 1)
    return max(1, CHUNK_ELEMENTS // max(V, 1))


@torch.no_grad()
def rank_stats(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
               chunk: int | None = None) -> RankStats:
    """R, E[R], p and H at every valid position, in float32, ``chunk`` positions at a time.

    Raises :class:`~rankwise.core.errors.NumericalError` naming the number of valid positions with a
    NaN or infinite logit.
    """
    check_logits_labels(logits, labels, ignore_index)
    V = logits.shape[-1]
    flat = logits.detach().reshape(-1, V)
    y = labels.reshape(-1)
    mask = y != ignore_index
    idx = mask.nonzero().squeeze(1)
    n = int(idx.numel())
    out = {k: torch.zeros(y.shape, dtype=torch.float32, device=logits.device)
           for k in ("rank", "expected_rank", "prob", "entropy")}
    step = _chunk_rows(V, chunk)
    bad = 0
    k = torch.arange(1, V + 1, dtype=torch.float32, device=logits.device)
    for s in range(0, n, step):
        rows = idx[s:s + step]
        z = flat[rows].float()
        finite = torch.isfinite(z).all(-1)
        if not bool(finite.all()):
            bad += int((~finite).sum())
            continue
        t = y[rows]
        zt = z.gather(1, t[:, None])
        out["rank"][rows] = (z >= zt).sum(-1).float()
        logp = torch.log_softmax(z, -1)
        p = logp.exp()
        out["prob"][rows] = p.gather(1, t[:, None]).squeeze(1)
        out["entropy"][rows] = -(p * logp).sum(-1)
        out["expected_rank"][rows] = (p.sort(-1, descending=True).values * k).sum(-1)
    if bad:
        raise NumericalError(f"{bad} of {n} target positions have NaN or infinite logits "
                             f"(logits {tuple(logits.shape)})")
    return RankStats(**{k: v.view(labels.shape) for k, v in out.items()}, mask=mask.view(labels.shape))


def realised_rank(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """R_t (float32, 0 at ignored positions): how many tokens score at least as high as the label."""
    return rank_stats(logits, labels, ignore_index).rank


def expected_rank(logits: torch.Tensor, labels: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """E[R_t] = sum_k k p_(k) (float32). Without ``labels``, at every position of ``logits`` (..., V)."""
    if labels is None:
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return rank_stats(logits, labels, ignore_index).expected_rank


def _scale(stats: RankStats, f: str, gamma: float) -> torch.Tensor:
    R, E = stats.rank, stats.expected_rank
    one = torch.ones_like(R)
    R, E = torch.where(stats.mask, R, one), torch.where(stats.mask, E, one)
    if f == "neglog":
        return (R / E) ** gamma
    return torch.exp(gamma * (1.0 / E - 1.0 / R))


def _normalise(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = torch.where(mask, w, torch.zeros_like(w))
    n = int(mask.sum())
    mean = w.sum() / max(n, 1)
    if n == 0 or float(mean) <= 0:
        return w
    return w / mean


def scheme_scores(stats: RankStats, scheme: str, *, gamma: float = 1.0, f: str = "neglog",
                  vocab_size: int | None = None) -> torch.Tensor:
    """The raw (un-clamped, un-normalised) per-token score of a weighting ``scheme`` (0 at ignored positions).

    ``ranktuner``: S_t; ``uniform``: 1; ``dft``: p_t; ``one_minus_p``: 1 - p_t; ``entropy``: H_t / log V
    (``vocab_size`` required); ``focal``: (1 - p_t)^gamma.
    """
    check_choice("scheme", scheme, SCHEMES)
    if scheme == "ranktuner":
        s = _scale(stats, f, gamma)
    elif scheme == "uniform":
        s = torch.ones_like(stats.prob)
    elif scheme == "dft":
        s = stats.prob.clone()
    elif scheme == "one_minus_p":
        s = 1.0 - stats.prob
    elif scheme == "entropy":
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"scheme 'entropy' needs vocab_size >= 2, got {vocab_size!r}")
        s = stats.entropy / math.log(vocab_size)
    else:
        s = (1.0 - stats.prob) ** gamma
    return torch.where(stats.mask, s, torch.zeros_like(s))


@torch.no_grad()
def relative_scale(logits: torch.Tensor, labels: torch.Tensor, *, gamma: float = 1.0, f: str = "neglog",
                   s_min: float = 0.0, s_max: float | None = 5.0, normalize: str = "mean",
                   ignore_index: int = -100, chunk: int | None = None) -> torch.Tensor:
    """RankTuner's token weights ``w_t`` (float32, shaped like ``labels``, 0 at ignored positions), no gradient.

    ``S_t`` clamped to ``[s_min, s_max]`` (``s_max=None``: no upper clamp) and, with ``normalize="mean"``,
    divided by its mean over the valid positions.
    """
    check_number("relative_scale.gamma", gamma, 0.0)
    check_choice("relative_scale.f", f, ("neglog", "inv"))
    check_choice("relative_scale.normalize", normalize, ("mean", "none"))
    _check_clamp("relative_scale", s_min, s_max)
    stats = rank_stats(logits, labels, ignore_index, chunk)
    return _finish(_scale(stats, f, gamma), stats.mask, s_min, s_max, normalize)


def _check_clamp(who: str, s_min: float, s_max: float | None) -> None:
    check_number(f"{who}.s_min", s_min, 0.0)
    if s_max is not None:
        check_number(f"{who}.s_max", s_max, 0.0, low_open=True)
        if s_min > s_max:
            raise ValueError(f"{who}.s_min must be <= s_max, got s_min={s_min}, s_max={s_max}")


def _finish(s: torch.Tensor, mask: torch.Tensor, s_min: float, s_max: float | None, normalize: str) -> torch.Tensor:
    w = s.clamp(min=s_min) if s_max is None else s.clamp(s_min, s_max)
    return _normalise(w, mask) if normalize == "mean" else torch.where(mask, w, torch.zeros_like(w))


def weighted_nll(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None,
                 ignore_index: int = -100, reduction: str = "mean",
                 num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """``sum_t w_t * CE_t`` reduced like ``F.cross_entropy`` (mean over valid positions, sum, or none).

    ``weights`` (shaped like ``labels``; None: 1) multiply the per-token cross-entropy as they are (the
    caller detaches them); ``num_items`` replaces the number of valid positions as the divisor of
    ``"mean"`` (what TRL passes as ``num_items_in_batch`` under gradient accumulation). With every
    position ignored, ``"mean"`` gives a zero that still carries a gradient, with a warning.
    """
    check_choice("reduction", reduction, REDUCTIONS)
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=ignore_index,
                         reduction="none").view(labels.shape)
    terms = ce if weights is None else ce * weights.to(ce.dtype)
    if reduction == "none":
        return terms
    total = terms.sum()
    if reduction == "sum":
        return total
    n = int((labels != ignore_index).sum()) if num_items is None else num_items
    if isinstance(n, int) and n == 0:
        warnings.warn("every target position is ignored (labels == ignore_index): the loss is 0", stacklevel=3)
        return logits.sum() * 0.0
    return total / torch.as_tensor(n, dtype=total.dtype, device=total.device).clamp(min=1)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
