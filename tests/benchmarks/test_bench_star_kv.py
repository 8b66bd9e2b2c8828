"""benchmarks/bench_star_kv.py: its smoke case (latent-cache decode vs SDPA) runs."""

from __future__ import annotations

import json


def test_smoke_run(tmp_path):
    from benchmarks import bench_star_kv
    from benchmarks.harness import run_module

    path = run_module("star_kv", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    (case,) = data["cases"]
    assert case["case"] == "star_kv_decode_smoke" and set(case["time"]) == set(bench_star_kv.IMPLS)
