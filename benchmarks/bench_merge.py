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
  dense 4096 x 4096 matrix, float64 SVD, truncation to 16); only with ``RANKWISE_BENCH_MERGE_FULL=1``:
  no goal needs it, ``mtc_core`` computes the same result exactly, and at L = 32 it adds about as
  much time as the anchor;
* ``mtc_core`` — the same merge-then-compress TA result computed in Core space (``space="core"``:
  the truncation of U_B (Σ M_t) V_Aᵀ, which equals the full-space truncation exactly, in O((m+n)R²)):
  the fair "smart MtC" for the TA rule, shown so that CtM's speed is not credited for what is only
  the low-rank trick (rules that act entry-wise on the dense ΔW_t, such as TIES, have no such shortcut);
* ``peft_svd`` — PEFT ``LoraModel.add_weighted_adapter(combination_type="svd", svd_rank=16)``
  (float32, ``torch.linalg.svd`` with PEFT's default ``full_matrices=True``), the anchor.

The base layers of the PEFT model hold a stride-0 (expanded) zero weight, so the 4096 x 4096 base
weights cost no memory and only the merge itself is measured. Run:
``python -m benchmarks.run merge`` (the 32 layers of a 7-8B model, 5 repeats after one warm-up: the
full-space methods take minutes per repeat, so PEFT and ``mtc`` are *cold*: they skip the warm-up,
whose first-call costs the first of their 32 module merges absorbs; one call in the memory subprocess) or ``RANKWISE_BENCH_MERGE_LAYERS=2`` for a quick look
(goals are judged at L = 32 only in the summary table's sense: every row says its L). The second case
is the same merge end to end on PEFT directories: T directories read, one written.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case, Goal

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


def _holder() -> nn.Module:
    """A model with ``LAYERS`` 4096 x 4096 ``q_proj`` linears whose weights are stride-0 zeros (no memory)."""
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
    return holder


def _peft_svd() -> Callable[[], Any]:
    import peft

    states = _states()
    holder = _holder()
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


_DIRS: dict[str, Any] = {}


def _adapter_dirs() -> list[Path]:
    """The T adapters as PEFT LoRA directories (written once per process, outside the timing)."""
    if "paths" not in _DIRS:
        from rankwise.core.peft_format import write_adapter_dir

        root = Path(tempfile.mkdtemp(prefix="rankwise-bench-merge-"))
        atexit.register(shutil.rmtree, root, True)
        _DIRS["root"] = root
        _DIRS["paths"] = [write_adapter_dir(st, root / f"t{i}", base_model_name_or_path=None)
                          for i, st in enumerate(_states())]
    return _DIRS["paths"]


def _rankwise_dirs(method: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.merge.dirs import merge_dirs

        dirs = _adapter_dirs()
        out = _DIRS["root"] / f"out-{method}"
        return lambda: merge_dirs(dirs, method, RANK, out, overwrite=True, rule="ta", scale=1.0)
    return factory


def _peft_svd_dirs() -> Callable[[], Any]:
    """PEFT end to end: load the T directories onto the (memory-free) base, SVD-merge, save the result."""
    import peft

    dirs = _adapter_dirs()
    out = _DIRS["root"] / "out-peft"

    def run() -> None:
        model = peft.PeftModel.from_pretrained(_holder(), str(dirs[0]), adapter_name="t0")
        for i, d in enumerate(dirs[1:], 1):
            model.load_adapter(str(d), adapter_name=f"t{i}")
        names = [f"t{i}" for i in range(T)]
        model.add_weighted_adapter(names, [1.0] * T, "merged", combination_type="svd", svd_rank=RANK)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(str(out), selected_adapters=["merged"])
    return run


_REPEATS = int(os.environ.get("RANKWISE_BENCH_MERGE_REPEATS", "5"))
_PARAMS = {"d": D, "T": T, "rank": RANK, "layers": LAYERS, "rule": "ta", "threads": torch.get_num_threads()}
_GOALS = (Goal("CtM >= 50x faster than PEFT's SVD merge", impl="ctm", max_ratio=1 / 50),
          Goal("CtM within 1.5x of the core-space merge-then-compress bound", impl="ctm", versus="mtc_core",
               max_ratio=1.5))

FULL = os.environ.get("RANKWISE_BENCH_MERGE_FULL", "0").strip().lower() in ("1", "true", "yes")
_IMPLS: dict[str, Callable[[], Callable[[], Any]]] = {"ctm": _ctm, "mtc_core": _mtc_core, "peft_svd": _peft_svd}
if FULL:
    _IMPLS["mtc"] = _mtc

CASES = [
    Case(f"ta_d{D}_T{T}_r{RANK}_L{LAYERS}", impls=_IMPLS, anchor="peft_svd", params=_PARAMS, repeats=_REPEATS,
         warmup=1, goals=_GOALS, cold=tuple(k for k in ("peft_svd", "mtc") if k in _IMPLS), memory_calls=1),
    # end to end on PEFT directories: read T directories, merge, write one (rankwise's `core` method
    # with the TA rule is the core-space merge-then-compress)
    Case(f"dirs_ta_d{D}_T{T}_r{RANK}_L{LAYERS}",
         impls={"ctm": _rankwise_dirs("ctm"), "mtc_core": _rankwise_dirs("core"), "peft_svd": _peft_svd_dirs},
         anchor="peft_svd", params={**_PARAMS, "io": "PEFT directories in and out"}, repeats=_REPEATS, warmup=1,
         goals=_GOALS, cold=("peft_svd",), memory_calls=1),
]
