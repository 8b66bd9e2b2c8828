"""benchmarks/bench_agentvocab.py: its cases are well-formed and its smoke cases run and write JSON."""

from __future__ import annotations

import json


def test_agentvocab_benchmark_smoke_run(tmp_path):
    from benchmarks import bench_agentvocab
    from benchmarks.harness import run_module

    for case in bench_agentvocab.CASES + bench_agentvocab.SMOKE_CASES:
        assert case.anchor == "T0" and set(case.impls) == {"T0", "agentvocab", "continued-bpe"}
    path = run_module("agentvocab", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    names = [c["case"] for c in data["cases"]]
    assert names == ["encode_corpus_smoke", "decode_call_smoke"]
    for c in data["cases"]:
        assert all(v["median_s"] > 0 for v in c["time"].values())
