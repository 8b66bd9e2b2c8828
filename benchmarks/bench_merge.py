"""Merging T LoRAs into one rank-r LoRA at LLM dimensions: CtM vs merge-then-compress vs PEFT (anchor: PEFT).

Synthetic LoRAs shaped like a 7-8B model's attention projections: ``d = 4096`` (every adapted
module is 4096 x 4096), ``T = 8`` adapters of rank 16 (alpha 16), ``L`` modules (default 32, one
per layer; set ``RANKWISE_BENCH_MERGE_LAYERS`` to run fewer: merging is per module and
independent, so time and the per-module part of memory scale linearly in ``L``). Factors are
float32, ``A ~ N(0, 1/n)``, ``B ~ N(0, 1/m)`` from a fixed generator. Output rank r = 16.

Implementations (each builds its inputs first; only the merge is timed):

* ``ctm`` — :func:`rankwise.merge.ctm.merge` (TA rule, λ = 1, β = 0.25; core bases by thin SVDs of
  the 4096 x 128 factor stacks, Tucker-2/HOOI on 128 x 128 x 8, projections; never an m x n matrix);
* ``mtc`` — :func:`rankwise.merge.baselines.merge` in full space (TA: Σ ΔW_t accumulated as one
  dense 4096 x 4096 matrix, float64 SVD, truncation to 16);
* ``mtc_core`` — the same merge-then-compress TA result computed in Core space (``space="core"``:
  the truncation of U_B (Σ M_t) V_Aᵀ, which equals the full-space truncation exactly, in O((m+n)R²)):
  the fair "smart MtC" for the TA rule, shown so that CtM's speed is not credited for what is only
  the low-rank trick (rules that act entry-wise on the dense ΔW_t, such as TIES, have no such shortcut);
* ``peft_svd`` — PEFT ``LoraModel.add_weighted_adapter(combination_type="svd", svd_rank=16)``
  (float32, ``torch.linalg.svd`` with PEFT's default ``full_matrices=True``), the anchor.

The base layers of the PEFT model hold a stride-0 (expanded) zero weight, so the 4096 x 4096 base
weights cost no memory and only the merge itself is measured. Run:
``RANKWISE_BENCH_MERGE_LAYERS=2 python -m benchmarks.run merge`` (minutes per layer for the
full-space methods on a busy 2-core machine; the default 32 layers takes correspondingly longer).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case

D, T, RANK = 4096, 8, 16
LAYERS = int(os.environ.get("RANKWISE_BENCH_MERGE_LAYERS", "32"))


def _names() -> list[str]:
    return [f"model.layers.{i}.self_attn.q_proj" for i in range(LAYERS)]


def _states() -> list[Any]:
    from rankwise.core.lora import AdapterState

    g = torch.Generator().manual_seed(0)
    out = []
    for t in range(T):
        f = {m: {"lora_A": torch.randn(RANK, D, generator=g) / D ** 0.5,
                 "lora_B": torch.randn(D, RANK, generator=g) / D ** 0.5} for m in _names()}
        out.append(AdapterState({"rank": RANK, "alpha": float(RANK)}, f, {m: 1.0 for m in _names()}))
    return out


def _ctm() -> Callable[[], Any]:
    from rankwise.merge.ctm import CtMConfig, merge

    states, cfg = _states(), CtMConfig(rank=RANK, rule="ta", scale=1.0)
    return lambda: merge(states, cfg)


def _mtc() -> Callable[[], Any]:
    from rankwise.merge.baselines import MergeConfig, merge

    states, cfg = _states(), MergeConfig(rank=RANK, rule="ta", space="full", scale=1.0)
    return lambda: merge(states, cfg)


def _mtc_core() -> Callable[[], Any]:
    from rankwise.merge.baselines import MergeConfig, merge

    states, cfg = _states(), MergeConfig(rank=RANK, rule="ta", space="core", scale=1.0)
    return lambda: merge(states, cfg)


def _peft_svd() -> Callable[[], Any]:
    import peft

    states = _states()
    holder = nn.Module()
    layers = nn.ModuleList()
    for _ in range(LAYERS):
        lin = nn.Linear(1, 1, bias=False)
        lin.weight = nn.Parameter(torch.zeros(1).expand(D, D), requires_grad=False)  # stride 0: no memory
        lin.in_features = lin.out_features = D
        block = nn.Module()
        block.self_attn = nn.Module()
        block.self_attn.q_proj = lin
        layers.append(block)
    holder.model = nn.Module()
    holder.model.layers = layers
    cfg = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["q_proj"], lora_dropout=0.0)
    lm = peft.LoraModel(holder, {"t0": cfg}, "t0")
    names = [f"t{i}" for i in range(T)]
    for n in names[1:]:
        lm.peft_config[n] = cfg
        lm.inject_adapter(holder, n)
    with torch.no_grad():
        for n, st in zip(names, states):
            for m in _names():
                layer = holder.get_submodule(m)
                layer.lora_A[n].weight.copy_(st.factors[m]["lora_A"])
                layer.lora_B[n].weight.copy_(st.factors[m]["lora_B"])
    del states

    def run() -> None:
        lm.add_weighted_adapter(names, [1.0] * T, "merged", combination_type="svd", svd_rank=RANK)
        lm.delete_adapter("merged")
    return run


CASES = [
    Case(f"ta_d{D}_T{T}_r{RANK}_L{LAYERS}", impls={"ctm": _ctm, "mtc_core": _mtc_core, "mtc": _mtc, "peft_svd": _peft_svd},
         anchor="peft_svd", params={"d": D, "T": T, "rank": RANK, "layers": LAYERS, "rule": "ta",
                                    "threads": torch.get_num_threads()},
         repeats=int(os.environ.get("RANKWISE_BENCH_MERGE_REPEATS", "3")), warmup=0),
]
