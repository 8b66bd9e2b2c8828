"""The DiffBCP benchmark cases are well-formed (nothing is timed here)."""

import importlib

from benchmarks.harness import Case, _smoke_cases


def test_diffbcp_cases_have_tensorly_anchors():
    mod = importlib.import_module("benchmarks.bench_diffbcp")
    for case in mod.CASES + mod.SMOKE_CASES:
        assert isinstance(case, Case) and case.anchor.startswith("tensorly")
    assert {"BCP-CUSP", "PnP-DM", "DiffBCP"} <= set(mod.CASES[0].impls)
    assert _smoke_cases(mod) == mod.SMOKE_CASES and mod.SMOKE_CASES[0].params["outer_iterations"] == 2
