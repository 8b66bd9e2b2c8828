"""benchmarks/bench_vapt.py: its parameter table matches the models it times, and its smoke case runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")


def test_added_parameters_and_smoke_run(tmp_path):
    from benchmarks import bench_vapt
    from benchmarks.harness import run_module

    table = bench_vapt._params()["added_parameters"]
    assert {impl: bench_vapt.added_parameters(impl) for impl in bench_vapt.IMPLS} == table
    path = run_module("vapt", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    (case,) = data["cases"]
    assert case["case"] == "vapt_train_step" and set(case["time"]) == set(bench_vapt.IMPLS)
