"""The one-shot safety benchmark runs its smoke case (timing rows for every implementation)."""

from __future__ import annotations

import json

from benchmarks.harness import run_module


def test_smoke_runs_every_implementation(tmp_path):
    path = run_module("safety_one_shot", tmp_path, memory=False, smoke=True)
    data = json.loads(path.read_text())
    text = json.dumps(data)
    for impl in ("multi-example-100", "one-shot", "one-shot-projected-k8"):
        assert impl in text
