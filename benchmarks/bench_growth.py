"""Growth: how the time of four operations grows with the layer width ``d`` (``t ~ d^p``).

``python -m benchmarks.run growth``; each case times one operation at ``d`` = 1024, 2048, 4096
(``RANKWISE_BENCH_GROWTH_SIZES`` to change them) and the harness fits the exponent ``p`` (with its
spread) beside the one the algorithm's cost predicts:

* ``swift_svd_dxd`` — Swift-SVD of a ``d x d`` layer from its output covariance (``eigh`` of ``d x d``,
  ``B = V_k^T W``): ``O(d^3)``, expected 3;
* ``svd_llm_dxd`` — SVD-LLM(W) of the same layer (Cholesky of ``H``, SVD of ``W S``, triangular solve):
  ``O(d^3)``, expected 3;
* ``ctm_merge`` — CtM (:func:`rankwise.merge.ctm.merge`, TA rule) of ``T = 8`` rank-16 LoRAs of one
  ``d x d`` module: thin SVDs of the ``d x 128`` factor stacks and a Tucker core of fixed size, ``O(d R^2)``
  with ``R = T r``: expected 1 (the fixed-size core work flattens the fit at small ``d``);
* ``ctm_merge_wide`` — the same merge at ``d`` = 4096, 16384, 65536 (``RANKWISE_BENCH_GROWTH_WIDE_SIZES``):
  the sizes where the ``O(d R^2)`` bases, not the ``d``-independent Tucker core (about 60 ms per module on
  the benchmark's adapters), take most of the time, so the fit can show the linear growth; expected 1.
  PEFT's merge has no such row: its dense ``d x d`` update does not fit in memory at ``d = 65536``;
* ``peft_svd_merge`` — PEFT's ``add_weighted_adapter(combination_type="svd")`` of the same LoRAs: the dense
  ``d x d`` update and its full SVD (``full_matrices=True``): expected 3.

Decompositions run in float32 at rho = 0.4 (statistics from ``d + 512`` synthetic tokens, not timed);
merges in float32. Every timed call uses ``RANKWISE_BENCH_THREADS`` torch threads (default 1).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case, Goal

SIZES = [int(s) for s in os.environ.get("RANKWISE_BENCH_GROWTH_SIZES", "1024,2048,4096").split(",")]
SMOKE_SIZES = [64, 128, 256]
WIDE_SIZES = [int(s) for s in os.environ.get("RANKWISE_BENCH_GROWTH_WIDE_SIZES", "4096,16384,65536").split(",")]
SMOKE_WIDE_SIZES = [256, 512, 1024]
T, RANK = 8, 16


def _decompose(which: str, d: int) -> Callable[[], Callable[[], Any]]:
    from benchmarks.bench_compress import _decompose as decompose

    return decompose([(d, d)], 0, torch.float32, which)


def _states(d: int) -> list[Any]:
    from rankwise.core.lora import AdapterState

    g = torch.Generator().manual_seed(0)
    name = "layer.q_proj"
    return [AdapterState({"rank": RANK, "alpha": float(RANK)},
                         {name: {"lora_A": torch.randn(RANK, d, generator=g) / d ** 0.5,
                                 "lora_B": torch.randn(d, RANK, generator=g) / d ** 0.5}}, {name: 1.0})
            for _ in range(T)]


def _ctm(d: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.merge.ctm import CtMConfig, merge

        states, cfg = _states(d), CtMConfig(rank=RANK, rule="ta", scale=1.0)
        return lambda: merge(states, cfg)
    return factory


def _peft(d: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        import peft

        states = _states(d)
        holder = nn.Module()
        lin = nn.Linear(1, 1, bias=False)
        lin.weight = nn.Parameter(torch.zeros(1).expand(d, d), requires_grad=False)  # stride 0: no memory
        lin.in_features = lin.out_features = d
        holder.layer = nn.Module()
        holder.layer.q_proj = lin
        cfg = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["q_proj"], lora_dropout=0.0)
        lm = peft.LoraModel(holder, {"t0": cfg}, "t0")
        names = [f"t{i}" for i in range(T)]
        for n in names[1:]:
            lm.peft_config[n] = cfg
            lm.inject_adapter(holder, n)
        with torch.no_grad():
            for n, st in zip(names, states):
                layer = holder.get_submodule("layer.q_proj")
                layer.lora_A[n].weight.copy_(st.factors["layer.q_proj"]["lora_A"])
                layer.lora_B[n].weight.copy_(st.factors["layer.q_proj"]["lora_B"])

        def run() -> None:
            lm.add_weighted_adapter(names, [1.0] * T, "merged", combination_type="svd", svd_rank=RANK)
            lm.delete_adapter("merged")
        return run
    return factory


def _threaded(factory: Callable[[], Callable[[], Any]]) -> Callable[[], Callable[[], Any]]:
    from benchmarks.bench_compress import _threads

    return lambda: _threads(factory())


def _growth(name: str, make: Callable[[int], Callable[[], Callable[[], Any]]], expected: float, sizes: list[int],
            repeats: int = 5) -> Case:
    impls = {f"d={d}": _threaded(make(d)) for d in sizes}
    return Case(name, impls=impls, anchor=f"d={sizes[0]}", repeats=repeats, warmup=1,
                sizes={f"d={d}": float(d) for d in sizes}, expected_exponent=expected,
                goals=(Goal(f"fitted exponent near the expected {expected:g}", metric="exponent"),),
                params={"sizes": sizes, "T": T, "rank": RANK, "rho": 0.4, "dtype": "float32",
                        "note": "ratio_vs_anchor = t(d) / t(smallest d)"})


def _cases(sizes: list[int], wide: list[int]) -> list[Case]:
    return [
        _growth("swift_svd_dxd", lambda d: _decompose("swift-svd", d), 3.0, sizes),
        _growth("svd_llm_dxd", lambda d: _decompose("svd-llm", d), 3.0, sizes),
        _growth("ctm_merge", _ctm, 1.0, sizes),
        _growth("ctm_merge_wide", _ctm, 1.0, wide),
        _growth("peft_svd_merge", _peft, 3.0, sizes),
    ]


CASES = _cases(SIZES, WIDE_SIZES)
#: What ``--smoke`` runs: every case at small sizes (a check that it runs, never tabulated).
SMOKE_CASES = _cases(SMOKE_SIZES, SMOKE_WIDE_SIZES)
