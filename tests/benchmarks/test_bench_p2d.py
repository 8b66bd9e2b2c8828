"""benchmarks/bench_p2d.py: its smoke case (the selection stages vs one epoch of full FT) runs."""

from __future__ import annotations

import json


def test_smoke_run(tmp_path):
    from benchmarks import bench_p2d
    from benchmarks.harness import run_module

    path = run_module("p2d", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    (case,) = data["cases"]
    assert case["case"] == "p2d_stages_smoke" and set(case["time"]) == set(bench_p2d.STAGES)
