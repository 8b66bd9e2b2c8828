"""benchmarks/bench_condiquant.py: its cases are well formed and its smoke cases run and write JSON."""

from __future__ import annotations

import json


def test_cases_and_smoke_run(tmp_path):
    from benchmarks import bench_condiquant
    from benchmarks.harness import run_module

    cond, fwd = bench_condiquant.CASES
    assert cond.anchor == "torch.linalg.svd" and fwd.anchor == "FP"
    assert fwd.goals[0].impl == "conditioned FP" and fwd.goals[0].max_ratio == 1.1
    path = run_module("condiquant", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    names = {e["case"] for e in data["cases"]}
    assert names == {"condiquant_conditioning_smoke", "condiquant_sr_forward_smoke"}
    for e in data["cases"]:
        assert len(e["time"]) == 3
