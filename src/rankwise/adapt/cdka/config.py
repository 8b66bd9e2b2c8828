"""CDKA configuration: :class:`CDKAConfig` and the budget syntax (see :mod:`rankwise.adapt.cdka`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rankwise.core.adapters import CONFIG_FILE, WEIGHTS_FILE  # noqa: F401  (re-exported)
from rankwise.core.validate import check_bool, check_choice, check_int, check_positive, check_unit


CONFIG_MODES = ("aligned", "fixed")
INITS = ("gradient", "zero")
_BUDGET_RE = re.compile(r"^lora_r([1-9][0-9]*)$")
#: Relative tolerance under which two alignment scores count as tied.
TIE_RTOL = 1e-9
_UNSUPPORTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.EmbeddingBag)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CDKAConfig:
    """CDKA hyper-parameters (defaults: the paper's / official code's).

    Attributes:
        target: module-name patterns (see :func:`rankwise.core.select.select`); default the four
            attention projections of a BERT-style model (the official configs adapt q, k, v, o).
        budget: per-matrix trainable-parameter budget for ``config_mode="aligned"``: an int, or
            ``"lora_r<k>"`` meaning the count of rank-``k`` LoRA on that layer, ``k (d_in + d_out)``.
        budget_tolerance: candidates must have ``|P - budget| <= budget_tolerance * budget``, in [0, 1).
        config_mode: ``"aligned"`` (choose ``(r1, r2, r)`` per layer by the alignment score) or
            ``"fixed"`` (use ``r1``, ``r2``, ``r`` below for every layer).
        r1, r2, r: component shapes and count for ``"fixed"`` (r1 divides d_out, r2 divides d_in).
        init: ``"gradient"`` (gradient-aligned factors, initial update removed) or ``"zero"``
            (A Kaiming-uniform, B = 0).
        alpha: scaling numerator; ``s = alpha / sqrt(r)`` (``use_rslora``) or ``alpha / r``.
        use_rslora: rank-stabilised scaling (the official config: ``use_rslora: True``, alpha 64).
        init_scale: ``c`` of the gradient initialisation, applied to each factor (official ``1/sqrt(1024)``).
        dropout: dropout on the adapter's input, in [0, 1).
        calib_batches: calibration batches used to estimate ``G`` (at most this many are read).
        seed: seeds the zero initialisation (``None``: global RNG); the gradient one is deterministic.
    """

    target: tuple[str, ...] = ("query", "key", "value", "attention.output.dense")
    budget: int | str = "lora_r8"
    budget_tolerance: float = 0.10
    config_mode: str = "aligned"
    r1: int | None = None
    r2: int | None = None
    r: int | None = None
    init: str = "gradient"
    alpha: float = 64.0
    use_rslora: bool = True
    init_scale: float = 1.0 / 32.0
    dropout: float = 0.0
    calib_batches: int = 8
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "CDKAConfig"
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError(f"{c}.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        parse_budget(self.budget, 1, 1)  # validates the form
        object.__setattr__(self, "budget_tolerance", check_unit(f"{c}.budget_tolerance", self.budget_tolerance,
                                                                high_open=True))
        check_choice(f"{c}.config_mode", self.config_mode, CONFIG_MODES)
        shape = {"r1": self.r1, "r2": self.r2, "r": self.r}
        if self.config_mode == "fixed":
            bad = {k: v for k, v in shape.items() if not _pos_int(v)}
            if bad:
                raise ValueError(f"{c}: config_mode='fixed' needs positive ints r1, r2, r; got {bad}")
        else:
            given = {k: v for k, v in shape.items() if v is not None}
            if given:
                raise ValueError(f"{c}: {sorted(given)} are only used with config_mode='fixed' "
                                 f"(config_mode='aligned' chooses them per layer); got {given}")
        check_choice(f"{c}.init", self.init, INITS)
        for fname in ("alpha", "init_scale"):
            object.__setattr__(self, fname, check_positive(f"{c}.{fname}", getattr(self, fname)))
        check_bool(f"{c}.use_rslora", self.use_rslora)
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        check_int(f"{c}.calib_batches", self.calib_batches, 1)
        check_int(f"{c}.seed", self.seed, allow_none=True)

    @property
    def needs_gradient(self) -> bool:
        """Whether :func:`adapt` needs calibration data (aligned shapes or gradient init)."""
        return self.config_mode == "aligned" or self.init == "gradient"

    def scaling(self, r: int) -> float:
        """``alpha / sqrt(r)`` (rsLoRA) or ``alpha / r``."""
        return self.alpha / math.sqrt(r) if self.use_rslora else self.alpha / r


def parse_budget(budget: int | str, d_out: int, d_in: int) -> int:
    """The per-matrix budget in parameters: an int as is, ``"lora_r<k>"`` as ``k (d_in + d_out)``."""
    if _pos_int(budget):
        return int(budget)
    if isinstance(budget, str):
        m = _BUDGET_RE.match(budget)
        if m:
            return int(m.group(1)) * (d_in + d_out)
    raise ValueError(f"CDKA budget must be an int >= 1 or 'lora_r<k>' (k >= 1, e.g. 'lora_r8'), got {budget!r}")
