"""STAR-KV's config (the spec's defaults, taken from the official ``train.py`` where the paper is silent)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rankwise.core.validate import check_choice, check_int, check_number

__all__ = ["StarKVConfig"]

Fold = Literal["shifted", "exact"]


@dataclass(frozen=True)
class StarKVConfig:
    """STAR-KV settings.

    Attributes:
        target_compression: ``C`` in ``[0, 1)``, the KV-cache fraction to remove. Phase 1 stops the
            thresholds of K (of V) once the *parameter* measure of the K (V) factors reaches
            ``C + offset_k`` (``C + offset_v``), as the official code does.
        offset_k, offset_v: the code's target offsets (``+0.09`` for K, ``-0.11`` for V).
        sharpness: ``s0`` of the soft threshold (50); ``c``: its below-threshold slope (0 = hard zero).
        kd_weight: ``w_kd`` on ``KL(p_teacher || p_student)`` (1.0).
        comp_weight_k, comp_weight_v: ``lambda_K``, ``lambda_V`` on ``sum exp(-alpha)`` (0.1 each).
        lr: Adam learning rate of the factors ``U, s, V`` (2e-5); ``alpha_lr``: of the thresholds (1e-2).
        steps: KD steps of phases 1 + 2 together; ``phase1_max_steps``: phase 1's cap (``None`` = three
            quarters of ``steps``, the code's 3000 of 4000 blocks); ``phase3_steps``: KD steps after the fold.
        skip_layers: layer indices left uncompressed (``None`` = the first and the last layer when the
            model has at least 3 layers, none otherwise; negative indices count from the end).
        min_head_rank: optional floor on every K head's and V layer's rank (off by default, as in the code).
        rank_multiple: at the fold, round every non-zero rank up to a multiple of it (16 suits GPU kernels;
            1 = no rounding, the default): more memory for kernel-friendly widths.
        fold: ``"shifted"`` multiplies the kept rows of ``V`` by ``(s_i - alpha)_+`` (the official code);
            ``"exact"`` by the training-time value ``s_i tanh(s0 (s_i - alpha))`` (the fold then changes
            nothing but the rounding).
    """

    target_compression: float = 0.6
    offset_k: float = 0.09
    offset_v: float = -0.11
    sharpness: float = 50.0
    c: float = 0.0
    kd_weight: float = 1.0
    comp_weight_k: float = 0.1
    comp_weight_v: float = 0.1
    lr: float = 2e-5
    alpha_lr: float = 1e-2
    steps: int = 300
    phase1_max_steps: int | None = None
    phase3_steps: int = 20
    skip_layers: tuple[int, ...] | None = None
    min_head_rank: int | None = None
    rank_multiple: int = 1
    fold: Fold = "shifted"

    def __post_init__(self) -> None:
        n = "StarKVConfig."
        check_number(n + "target_compression", self.target_compression, 0.0, 1.0, high_open=True)
        check_number(n + "offset_k", self.offset_k, -1.0, 1.0)
        check_number(n + "offset_v", self.offset_v, -1.0, 1.0)
        check_number(n + "sharpness", self.sharpness, 0.0, low_open=True)
        check_number(n + "c", self.c, 0.0)
        for f in ("kd_weight", "comp_weight_k", "comp_weight_v", "lr", "alpha_lr"):
            check_number(n + f, getattr(self, f), 0.0)
        check_int(n + "steps", self.steps, 0)
        check_int(n + "phase1_max_steps", self.phase1_max_steps, 0, allow_none=True)
        check_int(n + "phase3_steps", self.phase3_steps, 0)
        check_int(n + "min_head_rank", self.min_head_rank, 1, allow_none=True)
        check_int(n + "rank_multiple", self.rank_multiple, 1)
        check_choice(n + "fold", self.fold, ("shifted", "exact"))
        if self.skip_layers is not None:
            if not isinstance(self.skip_layers, (tuple, list)):
                raise ValueError(f"{n}skip_layers must be a tuple of ints or None, got {self.skip_layers!r}")
            for i in self.skip_layers:
                check_int(n + "skip_layers[]", i)
            object.__setattr__(self, "skip_layers", tuple(self.skip_layers))

    @property
    def phase1_cap(self) -> int:
        """Phase 1's step cap."""
        return (3 * self.steps) // 4 if self.phase1_max_steps is None else min(self.phase1_max_steps, self.steps)

    def skipped(self, n_layers: int) -> set[int]:
        """The uncompressed layer indices of an ``n_layers``-layer model."""
        if self.skip_layers is None:
            return {0, n_layers - 1} if n_layers >= 3 else set()
        return {i % n_layers for i in self.skip_layers if -n_layers <= i < n_layers}
