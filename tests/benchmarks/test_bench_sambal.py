"""benchmarks/bench_sambal.py: its cases are well-formed and its smoke cases run."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # ~15 s of CPU (transformers, nltk and two GPT-2 models), minutes on a loaded machine
def test_sambal_benchmark_smoke_run(tmp_path):
    from benchmarks import bench_sambal
    from benchmarks.harness import run_module

    for case in bench_sambal.CASES + bench_sambal.SMOKE_CASES:
        assert case.anchor in case.impls and all(g.impl in case.impls for g in case.goals)
    path = run_module("sambal", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    names = [c["case"] for c in data["cases"]]
    assert names[0] == "sambal_corpus" and names[-1] == "sambal_scoring"
    scoring = data["cases"][-1]["time"]
    assert set(scoring) == {"per-sentence loop", "batched", "batched (1/4 model)"}
    assert all(v["median_s"] > 0 for v in scoring.values())
