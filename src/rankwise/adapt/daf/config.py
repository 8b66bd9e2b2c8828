"""DAF configuration: :class:`DAFConfig` (see :mod:`rankwise.adapt.daf`)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from rankwise.core.adapters import deprecated_fields
from rankwise.core.adapters import CONFIG_FILE, WEIGHTS_FILE  # noqa: F401  (re-exported)
from rankwise.core.validate import check_bool, check_choice, check_int, check_positive, check_unit


RANK_BY = ("score_per_cost", "score")
FILL = ("stop", "skip")
ROLES = ("candidate", "training", "frozen")
#: the six linear layers of a BERT block (q, k, v, attention output, fc1, fc2), as module-name suffixes
BERT_CANDIDATES = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
log = logging.getLogger(__name__)


def renamed_keys(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with the field names of earlier releases (:data:`OLD_FIELDS`) replaced by today's."""
    return {OLD_FIELDS.get(k, k): v for k, v in d.items()}


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


#: field names of earlier releases (still accepted, with a DeprecationWarning; read silently from saved files)
OLD_FIELDS = {"lora_rank": "rank", "lora_alpha": "alpha", "analysis_batches": "calib_batches"}


@deprecated_fields(**OLD_FIELDS)
@dataclass(frozen=True)
class DAFConfig:
    """DAF hyper-parameters (defaults: the paper's: LoRA rank 8, n_b = 8, EMA 0.7, thresholds 0.10 / 0.20).

    Attributes:
        rank: rank ``r`` of every LoRA unit; a unit on ``W (d_out, d_in)`` costs ``r (d_in + d_out)``
            (``lora_rank``: deprecated name).
        alpha: LoRA scaling numerator, ``s = alpha / r`` (``lora_alpha``: deprecated name).
        budget_params: the budget ``P`` as an absolute number of *training* adapter parameters; None: use
            ``budget_fraction``.
        budget_fraction: ``P`` as a fraction in (0, 1] of the cost of a unit on every candidate matrix.
        target: module-name patterns of the candidate matrices (default: the six linear layers of a BERT
            block); pass types or a callable to :func:`adapt` as ``target=``.
        calib_batches: ``n_b >= 1``, calibration batches per sensitivity analysis (``analysis_batches``:
            deprecated name).
        analysis_every: steps between analyses (int >= 1) or a fraction of the total steps in (0, 1]
            (float; default 0.25: rounds at 0, 25 %, 50 %, 75 % of training).
        ema: weight of the previous scores in the smoothing, in [0, 1).
        change_thresholds: (matrix, vector) thresholds of the change test, each in [0, 1].
        rank_by: ``"score_per_cost"`` (greedy by ``S_j / cost_j``) or ``"score"`` (by ``S_j``, official).
        fill: ``"skip"`` a unit that does not fit and continue with cheaper ones (fills the budget; the
            rankwise default) or ``"stop"`` at the first unit that does not fit (the official rule).
        analysis_train_mode: run the analysis in train mode (dropout on, official) or eval mode.
        dropout: dropout on the adapter input, in [0, 1).
        seed: seeds the analysis RNG and the LoRA initialisations.
    """

    rank: int = 8
    alpha: float = 16.0
    budget_params: int | None = None
    budget_fraction: float = 0.25
    target: tuple[str, ...] = BERT_CANDIDATES
    calib_batches: int = 8
    analysis_every: int | float = 0.25
    ema: float = 0.7
    change_thresholds: tuple[float, float] = (0.10, 0.20)
    rank_by: str = "score_per_cost"
    fill: str = "skip"
    analysis_train_mode: bool = True
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        c = "DAFConfig"
        check_int(f"{c}.rank", self.rank, 1)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        check_int(f"{c}.budget_params", self.budget_params, 1, allow_none=True)
        object.__setattr__(self, "budget_fraction", check_unit(f"{c}.budget_fraction", self.budget_fraction,
                                                               low_open=True))
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError(f"{c}.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        check_int(f"{c}.calib_batches", self.calib_batches, 1)
        ae = self.analysis_every
        if isinstance(ae, bool) or not isinstance(ae, (int, float)) or (
                isinstance(ae, int) and ae < 1) or (isinstance(ae, float) and not 0.0 < ae <= 1.0):
            raise ValueError(f"{c}.analysis_every must be an int >= 1 (steps) or a float in (0, 1] "
                             f"(fraction of the total steps), got {ae!r}")
        object.__setattr__(self, "ema", check_unit(f"{c}.ema", self.ema, high_open=True))
        th = self.change_thresholds
        if (not isinstance(th, (tuple, list)) or len(th) != 2
                or not all(_number(t) and 0.0 <= float(t) <= 1.0 for t in th)):
            raise ValueError(f"{c}.change_thresholds must be two numbers in [0, 1] (matrix, vector), got {th!r}")
        object.__setattr__(self, "change_thresholds", (float(th[0]), float(th[1])))
        check_choice(f"{c}.rank_by", self.rank_by, RANK_BY)
        check_choice(f"{c}.fill", self.fill, FILL)
        check_bool(f"{c}.analysis_train_mode", self.analysis_train_mode)
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        check_int(f"{c}.seed", self.seed, 0)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def interval(self, total_steps: int | None) -> int:
        """Steps between analyses: ``analysis_every`` itself, or ``max(1, round(fraction * total_steps))``."""
        if isinstance(self.analysis_every, int):
            return self.analysis_every
        if total_steps is None:
            raise ValueError("DAFConfig.analysis_every is a fraction of the total steps; pass total_steps")
        return max(1, int(round(self.analysis_every * total_steps)))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target"] = list(self.target)
        d["change_thresholds"] = list(self.change_thresholds)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DAFConfig":
        """Inverse of :meth:`to_json`; unknown keys are ignored, the field names of earlier releases read."""
        d = renamed_keys(d)
        d["target"] = tuple(d.get("target", BERT_CANDIDATES))
        d["change_thresholds"] = tuple(d.get("change_thresholds", (0.10, 0.20)))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
