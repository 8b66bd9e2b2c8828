"""LoRA-Mixer configuration: :class:`LoRAMixerConfig` (see :mod:`rankwise.adapt.lora_mixer`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from rankwise.core.lora import AdapterState


FUSIONS = ("soft", "topk", "hard")
SHARE = ("none", "layer")
#: Projections that read the same input within a layer (their router is shared with share_router="layer").
_QKV = ("query", "key", "value", "q_proj", "k_proj", "v_proj")
F_DEFINITIONS = ("topk", "top1")
STAGES = ("experts", "router", "all")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.lora_mixer"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
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
        for f in ("num_experts", "rank"):
            if not _pos_int(getattr(self, f)):
                raise ValueError(f"LoRAMixerConfig.{f} must be an int >= 1, got {getattr(self, f)!r}")
        if isinstance(self.top_k_infer, bool) or not isinstance(self.top_k_infer, int) or self.top_k_infer < 1:
            raise ValueError(f"LoRAMixerConfig.top_k_infer must be an int >= 1, got {self.top_k_infer!r}")
        if self.top_k_infer > self.num_experts:
            warnings.warn(f"LoRAMixerConfig: top_k_infer={self.top_k_infer} > num_experts={self.num_experts}; "
                          f"capped at {self.num_experts}", stacklevel=3)
            object.__setattr__(self, "top_k_infer", self.num_experts)
        if self.num_experts == 1:
            warnings.warn("LoRAMixerConfig: num_experts=1 is plain LoRA (the router has nothing to choose)",
                          stacklevel=3)
        if not _number(self.alpha) or float(self.alpha) <= 0:
            raise ValueError(f"LoRAMixerConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if not _number(self.dropout) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"LoRAMixerConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"LoRAMixerConfig.renormalize must be a bool, got {self.renormalize!r}")
        target = (self.target,) if isinstance(self.target, str) else self.target
        if not isinstance(target, (tuple, list)) or not target or not all(isinstance(t, str) and t for t in target):
            raise ValueError(f"LoRAMixerConfig.target must be a non-empty tuple of module-name patterns, "
                             f"got {self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        for f in ("rsl_alpha", "rsl_lambda", "preserve_beta"):
            v = getattr(self, f)
            if not _number(v) or float(v) < 0:
                raise ValueError(f"LoRAMixerConfig.{f} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.entropy_sign not in (1, -1) or isinstance(self.entropy_sign, bool):
            raise ValueError(f"LoRAMixerConfig.entropy_sign must be +1 or -1, got {self.entropy_sign!r}")
        if self.f_definition not in F_DEFINITIONS:
            raise ValueError(f"LoRAMixerConfig.f_definition must be one of {F_DEFINITIONS}, got {self.f_definition!r}")
        if self.share_router not in SHARE:
            raise ValueError(f"LoRAMixerConfig.share_router must be one of {SHARE}, got {self.share_router!r}")
        if not _number(self.router_std) or float(self.router_std) <= 0:
            raise ValueError(f"LoRAMixerConfig.router_std must be a finite number > 0, got {self.router_std!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"LoRAMixerConfig.seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "router_std", float(self.router_std))


def num_parameters(d_in: int, d_out: int, rank: int, num_experts: int) -> int:
    """Trainable parameters of one adapted projection: ``E r (d_in + d_out) + E d_in`` (experts + router)."""
    return num_experts * rank * (d_in + d_out) + num_experts * d_in
