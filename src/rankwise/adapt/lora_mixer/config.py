"""LoRA-Mixer configuration: :class:`LoRAMixerConfig` (see :mod:`rankwise.adapt.lora_mixer`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from rankwise.core.adapters import CONFIG_FILE, WEIGHTS_FILE  # noqa: F401  (re-exported)
from rankwise.core.lora import AdapterState
from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive, check_unit


FUSIONS = ("soft", "topk", "hard")
SHARE = ("none", "layer")
#: Projections that read the same input within a layer (their router is shared with share_router="layer").
_QKV = ("query", "key", "value", "q_proj", "k_proj", "v_proj")
F_DEFINITIONS = ("topk", "top1")
STAGES = ("experts", "router", "all")
#: Probabilities are clamped to this floor inside log p of the entropy (p log p -> 0 as p -> 0).
LOG_FLOOR = 1e-12
DEFAULT_TARGET = ("query", "key", "value", "attention.output.dense", "q_proj", "k_proj", "v_proj", "o_proj",
                  "in_proj", "out_proj")
ExpertSource = Union[str, Path, AdapterState]


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoRAMixerConfig:
    """LoRA-Mixer hyper-parameters (paper App. A.6/A.8 where stated; choices documented otherwise).

    Attributes:
        num_experts: E >= 1 (one per task/domain). E = 1 is plain LoRA (warning).
        rank, alpha: LoRA rank and scaling numerator of new experts (paper: r = 64, lora_alpha = 128).
        dropout: dropout on the experts' input, in [0, 1) (paper 0.1).
        top_k_infer: K >= 1 experts kept per token at inference (paper 3); capped at E with a warning.
        renormalize: renormalise the K kept weights to sum 1 (choice; the paper does not say).
        target: projection names (attention Q/K/V/O of BERT- and Llama-style models, SSM in/out_proj).
        rsl_alpha, rsl_lambda: alpha (balance) and lambda (entropy) of the RSL (choice: 0.01 each).
        entropy_sign: +1 (default: minimising lowers per-token entropy) or -1 (Eq. 5 as printed).
        f_definition: "topk" (f_bar = top-k slot share / k, default; = Eq. 3 for k = 1) or "top1" (Eq. 3).
        preserve_beta: beta of the expert-preservation term (Eq. 11; choice 1e-3).
        router_std: std of the router's normal initialisation (0.02).
        share_router: "none" (default: one router per projection; choice) or "layer" (one router shared by the
            query/key/value projections of a layer, which read the same input).
        seed: seeds the initialisation; None: the global RNG.
    """

    num_experts: int = 4
    rank: int = 64
    alpha: float = 128.0
    dropout: float = 0.1
    top_k_infer: int = 3
    renormalize: bool = True
    target: tuple[str, ...] = DEFAULT_TARGET
    rsl_alpha: float = 0.01
    rsl_lambda: float = 0.01
    entropy_sign: int = 1
    f_definition: str = "topk"
    preserve_beta: float = 1e-3
    router_std: float = 0.02
    share_router: str = "none"
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "LoRAMixerConfig"
        for f in ("num_experts", "rank", "top_k_infer"):
            check_int(f"{c}.{f}", getattr(self, f), 1)
        if self.top_k_infer > self.num_experts:
            warnings.warn(f"{c}: top_k_infer={self.top_k_infer} > num_experts={self.num_experts}; "
                          f"capped at {self.num_experts}", stacklevel=3)
            object.__setattr__(self, "top_k_infer", self.num_experts)
        if self.num_experts == 1:
            warnings.warn(f"{c}: num_experts=1 is plain LoRA (the router has nothing to choose)", stacklevel=3)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        check_bool(f"{c}.renormalize", self.renormalize)
        target = (self.target,) if isinstance(self.target, str) else self.target
        if not isinstance(target, (tuple, list)) or not target or not all(isinstance(t, str) and t for t in target):
            raise ValueError(f"{c}.target must be a non-empty tuple of module-name patterns, "
                             f"got {self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        for f in ("rsl_alpha", "rsl_lambda", "preserve_beta"):
            object.__setattr__(self, f, check_number(f"{c}.{f}", getattr(self, f), 0.0))
        if self.entropy_sign not in (1, -1) or isinstance(self.entropy_sign, bool):
            raise ValueError(f"{c}.entropy_sign must be +1 or -1, got {self.entropy_sign!r}")
        check_choice(f"{c}.f_definition", self.f_definition, F_DEFINITIONS)
        check_choice(f"{c}.share_router", self.share_router, SHARE)
        object.__setattr__(self, "router_std", check_positive(f"{c}.router_std", self.router_std))
        check_int(f"{c}.seed", self.seed, allow_none=True)


def num_parameters(d_in: int, d_out: int, rank: int, num_experts: int) -> int:
    """Trainable parameters of one adapted projection: ``E r (d_in + d_out) + E d_in`` (experts + router)."""
    return num_experts * rank * (d_in + d_out) + num_experts * d_in
