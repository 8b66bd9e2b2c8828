"""The SANTA benchmark is well-formed and its factories record rows and bytes read."""

import importlib


def test_santa_benchmark_cases_and_reads():
    mod = importlib.import_module("benchmarks.bench_santa")
    for case in mod.CASES + mod.SMOKE_CASES:
        assert case.anchor == "torch-sdpa"
        assert set(case.impls) == {"torch-sdpa", "rankwise-santa", "rankwise-santa-tiled", "rankwise-topk"}
    case = mod.SMOKE_CASES[0]
    for f in case.impls.values():
        f()()
    reads = case.params["reads"]
    n, S = case.params["n"], case.params["S"]
    assert reads["torch-sdpa"]["value_rows_per_head"] == n
    assert reads["rankwise-topk"]["value_rows_per_head"] == S
    assert 0 < reads["rankwise-santa"]["value_rows_per_head"] <= S
    assert reads["rankwise-santa"]["bytes"] < reads["torch-sdpa"]["bytes"]
