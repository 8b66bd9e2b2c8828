"""RankTunerLoss and the token-weighted baselines as ``nn.Module`` losses with cross-entropy's call signature.

``loss_fn(logits, labels)`` with logits ``(..., V)`` and aligned labels ``(...)`` (``ignore_index`` masked),
``reduction`` as ``F.cross_entropy``'s. RankTuner (spec steps 1-6)::

    w_t = sg( clamp((R_t / E[R_t])^gamma, s_min, s_max) / mean_valid(...) )
    L   = sum_t m_t w_t (-log p_t) / sum_t m_t

The baselines share the same template with another weight: ``uniform`` (plain SFT), ``dft``
(``sg(p_t)``, not normalised, as the DFT paper and TRL's ``loss_type="dft"``), ``one_minus_p``
(``sg(1 - p_t)``, mean-normalised), ``entropy`` (``sg(H_t / log V)``, mean-normalised) and ``focal``
(``(1 - p_t)^gamma``, gamma 2, with its gradient, not normalised: the usual focal loss).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rankwise.core.validate import check_choice, check_int, check_number
from rankwise.train.ranktuner.loss import (
    SCHEMES,
    RankStats,
    _check_clamp,
    _finish,
    rank_stats,
    scheme_scores,
    weighted_nll,
)

__all__ = [
    "RankTunerConfig",
    "RankTunerLoss",
    "TokenWeightedLoss",
    "dft_loss",
    "entropy_weighted_loss",
    "focal_loss",
    "one_minus_p_loss",
]


@dataclass(frozen=True)
class RankTunerConfig:
    """RankTuner's hyper-parameters (spec defaults; every field validated).

    Attributes:
        f: the rank transform: ``"neglog"`` (f = -gamma log x, so S = (R / E[R])^gamma; the default) or
            ``"inv"`` (f = gamma / x, so S = exp(gamma (1/E[R] - 1/R))).
        gamma: the power (>= 0; 0 gives uniform weights).
        s_min, s_max: the clamp of S before normalisation (``s_max=None``: no upper clamp).
        normalize: ``"mean"`` (weights average 1 over the valid tokens of a call) or ``"none"``.
        ignore_index: the label of positions that carry no loss (prompt, padding).
        reduction: ``"mean"`` (over valid tokens), ``"sum"`` or ``"none"``, as ``F.cross_entropy``.
        chunk: positions per chunk of the rank pass (None: 2^24 / V).
    """

    f: str = "neglog"
    gamma: float = 1.0
    s_min: float = 0.0
    s_max: float | None = 5.0
    normalize: str = "mean"
    ignore_index: int = -100
    reduction: str = "mean"
    chunk: int | None = None

    def __post_init__(self) -> None:
        check_choice("RankTunerConfig.f", self.f, ("neglog", "inv"))
        check_number("RankTunerConfig.gamma", self.gamma, 0.0)
        _check_clamp("RankTunerConfig", self.s_min, self.s_max)
        check_choice("RankTunerConfig.normalize", self.normalize, ("mean", "none"))
        check_int("RankTunerConfig.ignore_index", self.ignore_index)
        check_choice("RankTunerConfig.reduction", self.reduction, ("mean", "sum", "none"))
        check_int("RankTunerConfig.chunk", self.chunk, 1, allow_none=True)


class TokenWeightedLoss(nn.Module):
    """``sum_t w_t CE_t`` with the weights of ``scheme`` (one of :data:`~rankwise.train.ranktuner.loss.SCHEMES`).

    ``forward(logits, labels, return_stats=False, num_items=None)``; with ``return_stats`` it returns
    ``(loss, stats)``, ``stats`` a dict of tensors shaped like ``labels`` (``R``, ``ER``, ``p``, ``H``,
    ``score`` (the raw weight before clamping/normalisation), ``weights``, ``mask``) plus floats
    ``mean_weight``, ``max_weight``, ``clamped_frac`` (share of valid tokens at ``s_max``).
    ``num_items`` replaces the number of valid tokens as the divisor of ``reduction="mean"``.
    """

    def __init__(self, scheme: str = "ranktuner", *, gamma: float | None = None, f: str = "neglog",
                 s_min: float = 0.0, s_max: float | None = None, normalize: str | None = None,
                 ignore_index: int = -100, reduction: str = "mean", chunk: int | None = None) -> None:
        super().__init__()
        self.scheme = check_choice("TokenWeightedLoss.scheme", scheme, SCHEMES)
        self.gamma = check_number("TokenWeightedLoss.gamma", 2.0 if gamma is None and scheme == "focal"
                                  else 1.0 if gamma is None else gamma, 0.0)
        self.f = check_choice("TokenWeightedLoss.f", f, ("neglog", "inv"))
        _check_clamp("TokenWeightedLoss", s_min, s_max)
        self.s_min, self.s_max = float(s_min), s_max
        if normalize is None:  # the spec: DFT and focal as published, the others mean-normalised
            normalize = "none" if scheme in ("dft", "focal", "uniform") else "mean"
        self.normalize = check_choice("TokenWeightedLoss.normalize", normalize, ("mean", "none"))
        self.ignore_index = check_int("TokenWeightedLoss.ignore_index", ignore_index)
        self.reduction = check_choice("TokenWeightedLoss.reduction", reduction, ("mean", "sum", "none"))
        self.chunk = check_int("TokenWeightedLoss.chunk", chunk, 1, allow_none=True)

    def extra_repr(self) -> str:
        return (f"scheme={self.scheme!r}, gamma={self.gamma}, s_max={self.s_max}, normalize={self.normalize!r}, "
                f"reduction={self.reduction!r}")

    def weights(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RankStats]:
        """``(weights, raw scores, stats)`` without gradient (all shaped like ``labels``)."""
        stats = rank_stats(logits, labels, self.ignore_index, self.chunk)
        score = scheme_scores(stats, self.scheme, gamma=self.gamma, f=self.f, vocab_size=logits.shape[-1])
        return _finish(score, stats.mask, self.s_min, self.s_max, self.normalize), score, stats

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, return_stats: bool = False,
                num_items: int | torch.Tensor | None = None) -> Any:
        w, score, stats = self.weights(logits, labels)
        if self.scheme == "focal":  # the focal factor keeps its gradient
            safe = torch.where(stats.mask, labels, torch.zeros_like(labels))
            p = torch.softmax(logits.float(), -1).gather(-1, safe[..., None]).squeeze(-1)
            w = torch.where(stats.mask, (1.0 - p) ** self.gamma, torch.zeros_like(p))
            if self.normalize == "mean":
                w = w / (w.detach().sum() / stats.mask.sum().clamp(min=1)).clamp(min=1e-12)
        loss = weighted_nll(logits, labels, None if self.scheme == "uniform" else w, self.ignore_index,
                            self.reduction, num_items)
        if not return_stats:
            return loss
        n = int(stats.mask.sum())
        wv = w.detach()[stats.mask]
        clamped = 0.0 if self.s_max is None or n == 0 else float((score[stats.mask] >= self.s_max).double().mean())
        return loss, {"R": stats.rank, "ER": stats.expected_rank, "p": stats.prob, "H": stats.entropy,
                      "score": score, "weights": w.detach(), "mask": stats.mask,
                      "mean_weight": float(wv.mean()) if n else 0.0, "max_weight": float(wv.max()) if n else 0.0,
                      "clamped_frac": clamped}


class RankTunerLoss(TokenWeightedLoss):
    """RankTuner's token-weighted NLL (relative-rank weights, spec steps 1-6) from a :class:`RankTunerConfig`.

    ``loss_fn(out.logits[:, :-1], labels[:, 1:])``; ``loss_fn(..., return_stats=True)`` also returns
    the statistics (``R``, ``ER``, ``weights``, ...; see :class:`TokenWeightedLoss`).
    """

    def __init__(self, config: RankTunerConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = RankTunerConfig(**overrides)
        elif not isinstance(config, RankTunerConfig):
            raise TypeError(f"config must be a RankTunerConfig, got {type(config).__name__}")
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        super().__init__("ranktuner", gamma=config.gamma, f=config.f, s_min=config.s_min, s_max=config.s_max,
                         normalize=config.normalize, ignore_index=config.ignore_index, reduction=config.reduction,
                         chunk=config.chunk)
        self.config = config


def _functional(scheme: str, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str,
                **kw: Any) -> torch.Tensor:
    return TokenWeightedLoss(scheme, ignore_index=ignore_index, reduction=reduction, **kw)(logits, labels)


def dft_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
    """DFT: ``sum_t sg(p_t) CE_t / n_valid`` (no normalisation; TRL's ``loss_type="dft"``)."""
    return _functional("dft", logits, labels, ignore_index, reduction)


def one_minus_p_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                     reduction: str = "mean") -> torch.Tensor:
    """Prob-dominant hard-token weighting: ``w_t = sg(1 - p_t)``, mean-normalised."""
    return _functional("one_minus_p", logits, labels, ignore_index, reduction)


def entropy_weighted_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                          reduction: str = "mean") -> torch.Tensor:
    """Entropy-dominant (EAFT-style) weighting: ``w_t = sg(H_t / log V)``, mean-normalised."""
    return _functional("entropy", logits, labels, ignore_index, reduction)


def focal_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float = 2.0, ignore_index: int = -100,
               reduction: str = "mean") -> torch.Tensor:
    """Multi-class focal loss ``(1 - p_t)^gamma CE_t`` (with its gradient), mean over valid tokens."""
    return _functional("focal", logits, labels, ignore_index, reduction, gamma=gamma)
