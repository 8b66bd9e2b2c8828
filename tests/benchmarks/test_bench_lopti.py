"""The Lopti update-time benchmark is well-formed: GRPO is the anchor, Lopti and AR carry their goals."""

import importlib


def test_lopti_benchmark_cases():
    mod = importlib.import_module("benchmarks.bench_lopti")
    for case in mod.CASES + mod.SMOKE_CASES:
        assert case.anchor == "rankwise-grpo" and set(case.impls) == {"rankwise-grpo", "rankwise-ar", "rankwise-lopti"}
        assert {(g.impl, g.max_ratio) for g in case.goals} == {("rankwise-lopti", 2.2), ("rankwise-ar", 1.1)}
    assert len(mod.SMOKE_CASES) == 1 and mod.SMOKE_CASES[0].repeats == 1
