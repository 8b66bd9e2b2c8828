"""benchmarks/bench_uldnet.py: its cases are well formed and its smoke case runs (TenSEAL needed)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tenseal")


def test_cases_and_smoke_run(tmp_path):
    from benchmarks import bench_uldnet
    from benchmarks.harness import run_module

    (case,) = bench_uldnet.CASES
    assert case.anchor == "post-hoc" and set(case.impls) == {"post-hoc", "ULD-Net"}
    assert case.goals[0].impl == "ULD-Net" and case.goals[0].max_ratio == 0.6
    path = run_module("uldnet", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    (entry,) = data["cases"]
    assert set(entry["time"]) == {"post-hoc", "ULD-Net"}
