"""mtLoRA configuration: :class:`MtLoRAConfig`, the HydraLoRA preset and the known block layouts."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from rankwise.core.adapters import CONFIG_FILE, WEIGHTS_FILE  # noqa: F401  (re-exported)
from rankwise.core.validate import check_choice, check_int, check_number, check_positive, check_unit


PLACEMENTS = ("ffn", "attention", "both", "component")
BASES = ("singular", "column")
#: Epsilon of the squared coefficient of variation (HydraLoRA's ``cv_squared``).
CV_EPS = 1e-10

#: (input module, output module) suffixes of a block's sub-layer, per placement. The adapter reads the
#: input of the first and adds its output to the output of the second. BERT/RoBERTa/ViT (HF), Llama/
#: Qwen/Mistral, CLIP/OPT-style fc1/fc2, GPT-NeoX/Falcon.
BLOCK_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "ffn": (("intermediate.dense", "output.dense"), ("mlp.up_proj", "mlp.down_proj"), ("mlp.fc1", "mlp.fc2"),
            ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")),
    "attention": (("attention.self.query", "attention.output.dense"), ("self_attn.q_proj", "self_attn.o_proj"),
                  ("attention.attention.query", "attention.output.dense"), ("self_attn.q_proj", "self_attn.out_proj"),
                  ("attention.query_key_value", "attention.dense")),
}


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MtLoRAConfig:
    """mtLoRA hyper-parameters (defaults: the official LLaMA-2 scripts).

    Attributes:
        rank: r >= 1 of the shared ``A (r, d_in)`` and each ``B_i (d_out, r)``; at most min(d_in, d_out).
        alpha: scaling numerator, ``s = alpha / r`` (official: r = 16, alpha = 64).
        num_experts: E >= 1 expert up-projections per adapter (official 16). E = 1 disables the router.
        placement: "ffn" (default), "attention", "both" (block level), or "component" (one adapter per
            linear layer that ``target`` selects: HydraLoRA's placement).
        routing_group_size: output dimensions per routing group; must divide d_out. ``None``: d_out / 2
            (G = 2, the paper's 2048 for d = 4096; d_out when odd). ``group_size = d_out``: coarse router.
        dropout: dropout on the adapter's input (not the router's), in [0, 1) (official 0.05).
        balance_alpha: weight of the load-balance term (0.01).
        spectral_lambda: weight of the spectral term (1.0 on BBH, 0.5 on Dolly/MMLU; default 0.5).
        spectral_every: the spectral term is added on steps ``step > 0`` with ``step % spectral_every == 0``
            (the official ``step - last >= 500`` schedule when called every step).
        spectral_basis: "singular" (weights on B_i's own singular directions) or "column" (official code).
        spectral_max_matrices: at most this many B_i per spectral computation (sampled; official 64).
        target: linear-layer names for ``placement="component"`` (ignored by block placements).
        block_pairs: extra (input suffix, output suffix) pairs that identify a block's sub-layer, tried
            before :data:`BLOCK_PAIRS`, for architectures rankwise does not know.
        seed: seeds the initialisation (A and W_r Kaiming-uniform(a=sqrt 5), B_i = 0); None: global RNG.
    """

    rank: int = 16
    alpha: float = 64.0
    num_experts: int = 16
    placement: str = "ffn"
    routing_group_size: int | None = None
    dropout: float = 0.05
    balance_alpha: float = 0.01
    spectral_lambda: float = 0.5
    spectral_every: int = 500
    spectral_basis: str = "singular"
    spectral_max_matrices: int = 64
    target: tuple[str, ...] = ("query", "value")
    block_pairs: tuple[tuple[str, str], ...] = ()
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "MtLoRAConfig"
        for f in ("rank", "num_experts", "spectral_every", "spectral_max_matrices"):
            check_int(f"{c}.{f}", getattr(self, f), 1)
        object.__setattr__(self, "alpha", check_positive(f"{c}.alpha", self.alpha))
        check_choice(f"{c}.placement", self.placement, PLACEMENTS)
        check_int(f"{c}.routing_group_size", self.routing_group_size, 1, allow_none=True)
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))
        for f in ("balance_alpha", "spectral_lambda"):
            object.__setattr__(self, f, check_number(f"{c}.{f}", getattr(self, f), 0.0))
        check_choice(f"{c}.spectral_basis", self.spectral_basis, BASES)
        target = (self.target,) if isinstance(self.target, str) else self.target
        if not isinstance(target, (tuple, list)) or not target or not all(isinstance(t, str) and t for t in target):
            raise ValueError("MtLoRAConfig.target must be a non-empty tuple of module-name patterns, "
                             f"got {self.target!r}")
        object.__setattr__(self, "target", tuple(target))
        pairs = self.block_pairs
        if not isinstance(pairs, (tuple, list)) or not all(
                isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(s, str) and s for s in p)
                for p in pairs):
            raise ValueError("MtLoRAConfig.block_pairs must be a tuple of (input suffix, output suffix) string pairs, "
                             f"got {self.block_pairs!r}")
        object.__setattr__(self, "block_pairs", tuple(tuple(p) for p in pairs))
        check_int(f"{c}.seed", self.seed, allow_none=True)
        if self.num_experts == 1 and self.routing_group_size is not None:
            warnings.warn("MtLoRAConfig: num_experts=1 disables the router; routing_group_size is ignored",
                          stacklevel=3)


def hydralora_config(rank: int = 8, alpha: float = 16.0, num_experts: int = 4,
                     target: tuple[str, ...] = ("query", "value"), d_out: int | None = None,
                     dropout: float = 0.05, balance_alpha: float = 0.01, seed: int | None = 0) -> MtLoRAConfig:
    """HydraLoRA as an mtLoRA configuration: component placement, coarse router, no spectral term.

    ``d_out``: the output width of the targeted layers (coarse routing = one group of ``d_out``); None
    takes each layer's own width (the same thing when every target has one width).
    """
    return MtLoRAConfig(rank=rank, alpha=alpha, num_experts=num_experts, placement="component",
                        routing_group_size=d_out if d_out is not None else _COARSE, dropout=dropout,
                        balance_alpha=balance_alpha, spectral_lambda=0.0, target=tuple(target), seed=seed)


#: Sentinel group size meaning "one group of the layer's own d_out" (set by :func:`hydralora_config`).
_COARSE = 2 ** 31 - 1


def _group_size(config: MtLoRAConfig, d_out: int) -> int:
    if config.num_experts == 1:
        return d_out
    gs = config.routing_group_size
    if gs is None:
        return d_out // 2 if d_out % 2 == 0 else d_out
    if gs == _COARSE:
        return d_out
    return gs


def num_parameters(d_in: int, d_out: int, rank: int, num_experts: int, groups: int) -> int:
    """Trainable parameters of one adapter: ``d_in r + E r d_out + E G d_in`` (no router when E = 1).

    For a block-FFN adapter of a d-wide model this is the spec's ``d r + E r d + E G d``.
    """
    router = num_experts * groups * d_in if num_experts > 1 else 0
    return d_in * rank + num_experts * rank * d_out + router
