"""E²LoRA configuration: :class:`E2LoRAConfig` (see :mod:`rankwise.adapt.e2lora`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rankwise.core.adapters import deprecated_fields
from rankwise.core.adapters import CONFIG_FILE, WEIGHTS_FILE  # noqa: F401  (re-exported)
from rankwise.core.validate import check_bool, check_choice, check_int, check_positive, check_str, check_unit


THRESHOLDS = ("adaptive",)
HRA_SCORES = ("paper", "shifted")
ROUNDINGS = ("round", "largest_remainder")
GRANULARITIES = ("type", "block")
SIMILARITIES = ("rmi", "cosine")
SHARINGS = ("lora", "sharelora")
#: The first purely numeric component of a module name is its layer index (depth).
DEFAULT_DEPTH_REGEX = r"(?:^|\.)(\d+)(?=\.|$)"
_HALF_LOG_2PI_E = 0.5 * math.log(2.0 * math.pi) + 0.5
#: Entropy is >= 0 once sigma >= 1/sqrt(2 pi e) ~= 0.242; RMI is then no similarity (see plan_e2lora).
SIGMA_SIGN_CHANGE = 1.0 / math.sqrt(2.0 * math.pi * math.e)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@deprecated_fields(base_rank="rank", n_calib_batches="calib_batches")
@dataclass(frozen=True)
class E2LoRAConfig:
    """E²LoRA hyper-parameters (defaults: the paper's RoBERTa/GLUE setting, r0 = 8 on query/value).

    Attributes:
        rank: ``r0``, the vanilla LoRA rank; the rank budget of a module type is ``K * r0``
            (``base_rank``: deprecated name).
        alpha: LoRA scale numerator; layer ``l`` uses ``alpha / r_k(l)``.
        target: module-name patterns (see :func:`rankwise.core.select.select`).
        threshold: ``"adaptive"`` (``tau_m`` = mean RMI of layer ``m`` with the others, step 4) or a fixed
            float in [0, 1] (the authors' flag suggests 0.85).
        hra_score: ``"paper"`` (``F_k = H_k / sum H``, literal) or ``"shifted"`` (scores
            ``H_k - min_i H_i + 1``: more rank to higher entropy).
        rounding: ``"round"`` (Python ``round`` as in the paper; the sum may miss ``K r0``) or
            ``"largest_remainder"`` (sum exactly ``K r0``).
        granularity: ``"type"`` (a partition per module type) or ``"block"`` (one partition for all types,
            from the concatenated gradients of each block's targeted modules).
        calib_batches: calibration batches averaged into ``G_l`` (the paper: 1; ``n_calib_batches``:
            deprecated name).
        lss: share within entropy intervals (False: one interval per layer, the "HRA only" ablation).
        hra: entropy ranks (False: uniform ``r0``, the "LSS only" ablation).
        similarity: ``"rmi"`` (the paper) or ``"cosine"`` (cosine of ``vec G``; an ablation).
        sharing: ``"lora"`` (E²LoRA: A and B shared per interval) or ``"sharelora"`` (E²ShareLoRA).
        depth_regex: regex whose group 1 is the layer index inside a module name (default: the first purely
            numeric name component); modules equal up to that index form a type. ``None``: every module is
            its own type (no sharing; plain LoRA of rank ``r0``).
        dropout: dropout on the adapter input, in [0, 1).
        seed: seeds the Kaiming-uniform initialisation of ``A`` (``None``: the global torch RNG).
    """

    rank: int = 8
    alpha: float = 16.0
    target: tuple[str, ...] = ("query", "value")
    threshold: str | float = "adaptive"
    hra_score: str = "paper"
    rounding: str = "round"
    granularity: str = "type"
    calib_batches: int = 1
    lss: bool = True
    hra: bool = True
    similarity: str = "rmi"
    sharing: str = "lora"
    depth_regex: str | None = DEFAULT_DEPTH_REGEX
    dropout: float = 0.0
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "E2LoRAConfig"
        check_int(f"{c}.rank", self.rank, 1)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError(f"{c}.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        t = self.threshold
        if isinstance(t, str) and t in THRESHOLDS:
            pass
        elif isinstance(t, str) or not _number(t) or not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"{c}.threshold must be 'adaptive' or a float in [0, 1], got {t!r}")
        else:
            object.__setattr__(self, "threshold", float(t))
        for fname, allowed in (("hra_score", HRA_SCORES), ("rounding", ROUNDINGS), ("granularity", GRANULARITIES),
                               ("similarity", SIMILARITIES), ("sharing", SHARINGS)):
            check_choice(f"{c}.{fname}", getattr(self, fname), allowed)
        check_int(f"{c}.calib_batches", self.calib_batches, 1)
        for fname in ("lss", "hra"):
            check_bool(f"{c}.{fname}", getattr(self, fname))
        if self.depth_regex is not None:
            check_str(f"{c}.depth_regex", self.depth_regex)
            try:
                rx = re.compile(self.depth_regex)
            except re.error as e:
                raise ValueError(f"{c}.depth_regex {self.depth_regex!r} is not a valid regex: {e}") from None
            if rx.groups < 1:
                raise ValueError(f"{c}.depth_regex {self.depth_regex!r} needs a group capturing the layer index")
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        check_int(f"{c}.seed", self.seed, allow_none=True)
