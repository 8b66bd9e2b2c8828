"""Root Purge settings: the type aliases and constants of the package, :class:`RootPurgeConfig` and
:class:`TrainConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from torch import Tensor

from rankwise.core.validate import check_choice, check_int, check_number, check_positive


ArrayLike = np.ndarray | Tensor | Sequence[float]
Method = Literal["ols", "rrr", "dwrr", "linear", "root_purge"]
_METHODS = ("ols", "rrr", "dwrr", "linear", "root_purge")
_BACKBONES = ("linear", "frequency", "dlinear")
_CHANNEL_MODES = ("independent", "individual")
# Singular values of X below RCOND * s_max are zeroed in the pseudo-inverse (spec §1 uses an
# absolute 1e-9; a relative floor keeps the forecast equivariant to rescaling the series).
RCOND = 1e-9


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RootPurgeConfig:
    """Root Purge regulariser (spec §5).

    ``lam``: weight lambda of the purge term (official default 0.3; the synthetic study uses 1).
    ``order``: purge order k, how many times the model is applied to the residual.
    ``target``: ``"zero"`` (``f(e) -> 0``) or ``"model_zero"`` (``f(e) -> f(0)``, identical for
    bias-free models).
    """

    lam: float = 0.3
    order: int = 1
    target: Literal["zero", "model_zero"] = "zero"

    def __post_init__(self) -> None:
        check_number("RootPurgeConfig.lam", self.lam, 0.0)
        check_int("RootPurgeConfig.order", self.order, 1)
        check_choice("RootPurgeConfig.target", self.target, ("zero", "model_zero"))


@dataclass(frozen=True)
class TrainConfig:
    """Adam training of a forecaster (spec §6: Adam, no weight decay, batch 64/128).

    ``steps``: optimiser steps; ``lr``: Adam learning rate; ``batch_size``: windows per step
    (drawn from a fresh permutation each epoch); ``weight_decay``: decoupled L2 (AdamW) baseline;
    ``l1``: L1 penalty on the weights added to the loss; ``val_every``: when validation windows
    are given, evaluate every this many steps and keep the weights with the lowest validation
    MSE (the official training loop does this); ``seed``: initialisation and sampling seed.
    """

    steps: int = 5000
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 0.0
    l1: float = 0.0
    val_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "val_every"):
            check_int(f"TrainConfig.{name}", getattr(self, name), 1)
        check_positive("TrainConfig.lr", self.lr)
        for name in ("weight_decay", "l1"):
            check_number(f"TrainConfig.{name}", getattr(self, name), 0.0)
        check_int("TrainConfig.seed", self.seed)
