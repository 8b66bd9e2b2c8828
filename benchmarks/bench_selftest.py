"""A tiny benchmark used by the tests of the harness itself: a matmul against a slower loop of matmuls."""

from __future__ import annotations

import torch

from benchmarks.harness import Case


def _matmul(n: int, reps: int):
    def factory():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g)
        return lambda: [a @ a for _ in range(reps)]
    return factory


CASES = [
    Case("matmul_1_vs_4", impls={"one": _matmul(192, 1), "four": _matmul(192, 4)}, anchor="one",
         params={"n": 192}, repeats=7, warmup=1),
]
