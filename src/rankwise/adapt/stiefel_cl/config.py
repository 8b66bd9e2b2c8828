"""EBLoRA configuration: :class:`EBLoRAConfig` (see :mod:`rankwise.adapt.stiefel_cl`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from rankwise.core.validate import check_int, check_number, check_patterns, check_positive, check_unit

#: the official code's ``grad_scaling`` constant c_g: the direction factors' step is rescaled by sqrt(c_g / r)
GRAD_SCALING = 4096.0
#: the spec's targets on a BERT-style encoder (all linear maps of a layer; "dense" matches both output denses)
BERT_TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")
_UNSUPPORTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class EBLoRAConfig:
    """EBLoRA hyper-parameters (defaults: the spec's small-scale setting; the paper's are rank 16, alpha 32).

    Attributes:
        rank: r, the number of orthonormal directions per task and layer (``ΔW_t = c s U V^T``).
        alpha: ``lora_alpha``; ``c = alpha / rank`` (the official code uses ``alpha = 2 r``, so ``c = 2``).
        energy_threshold: ε of the GPM-style update of the protected input subspace F, in (0, 1].
        target: module-name patterns (see :func:`rankwise.core.select.select`).
        direction_lr_scale: multiplier of the U, V step before the retraction; None gives the official
            ``sqrt(4096 / rank)`` (``grad_scaling``).
        alpha0, beta0: the initial magnitude of layer ``l`` of ``L`` is ``s_l = -(alpha0 + beta0 l / (L - 1))``;
            the defaults 0 start every task at ``ΔW_t = 0`` (the previous model exactly).
        grad_batches: batches averaged for the gradient of the initialisation and of the F update.
        seed: seeds ``torch.svd_lowrank`` and the random fallback directions (zero gradient).
    """

    rank: int = 4
    alpha: float = 8.0
    energy_threshold: float = 0.99
    target: tuple[str, ...] = BERT_TARGETS
    direction_lr_scale: float | None = None
    alpha0: float = 0.0
    beta0: float = 0.0
    grad_batches: int = 8
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "EBLoRAConfig"
        check_int(f"{c}.rank", self.rank, 1)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        object.__setattr__(self, "energy_threshold", check_unit(f"{c}.energy_threshold", self.energy_threshold,
                                                                low_open=True))
        object.__setattr__(self, "target", check_patterns(f"{c}.target", self.target))
        object.__setattr__(self, "direction_lr_scale", check_positive(f"{c}.direction_lr_scale",
                                                                      self.direction_lr_scale, allow_none=True))
        object.__setattr__(self, "alpha0", check_number(f"{c}.alpha0", self.alpha0))
        object.__setattr__(self, "beta0", check_number(f"{c}.beta0", self.beta0))
        check_int(f"{c}.grad_batches", self.grad_batches, 1)
        check_int(f"{c}.seed", self.seed, allow_none=True)

    @property
    def scaling(self) -> float:
        """``c = alpha / rank``."""
        return self.alpha / self.rank

    @property
    def lr_scale(self) -> float:
        """The direction step multiplier: ``direction_lr_scale`` or ``sqrt(4096 / rank)``."""
        return self.direction_lr_scale if self.direction_lr_scale is not None else math.sqrt(GRAD_SCALING / self.rank)

    def initial_magnitude(self, layer_index: int, n_layers: int) -> float:
        """``s_l = -(alpha0 + beta0 l / (L - 1))`` (``l / (L - 1) = 0`` for a single layer)."""
        frac = layer_index / (n_layers - 1) if n_layers > 1 else 0.0
        return -(self.alpha0 + self.beta0 * frac)
