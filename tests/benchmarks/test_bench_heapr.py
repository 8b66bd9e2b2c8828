"""benchmarks/bench_heapr.py: its cases are well formed and its smoke case writes JSON with parameter counts."""

from __future__ import annotations

import json


def test_cases_and_smoke_run(tmp_path):
    from benchmarks import bench_heapr
    from benchmarks.harness import run_module

    (case,) = bench_heapr.CASES
    assert case.anchor == "fused" and set(case.impls) == {"fused", "unfused", "HEAPr p=0.25", "drop 2/8"}
    path = run_module("heapr", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    (entry,) = data["cases"]
    assert set(entry["time"]) == set(case.impls)
    n = entry["params"]["parameters"]
    assert n["fused"] == n["unfused"] > n["HEAPr p=0.25"] == n["drop 2/8"]
