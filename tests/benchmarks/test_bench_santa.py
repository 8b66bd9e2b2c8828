"""The SANTA benchmark is well-formed and its factories record rows and bytes read."""

import importlib


def test_santa_benchmark_cases_and_reads():
    mod = importlib.import_module("benchmarks.bench_santa")
    for case in mod.CASES + mod.SMOKE_CASES:
        assert case.anchor == "torch-sdpa"
        assert set(case.impls) == {"torch-sdpa", "rankwise-santa", "rankwise-santa-tiled", "rankwise-topk"}
    case = mod.SMOKE_CASES[0]
    for f in case.impls.values():
        f()()
    reads = case.params["reads"]
    n, S = case.params["n"], case.params["S"]
    assert reads["torch-sdpa"]["value_rows_per_head"] == n
    assert reads["rankwise-topk"]["value_rows_per_head"] == S
    assert 0 < reads["rankwise-santa"]["value_rows_per_head"] <= S
    assert reads["rankwise-santa"]["bytes"] < reads["torch-sdpa"]["bytes"]


def test_gpu_script_runs_its_code_paths_on_cpu(tmp_path):
    """The GPU check script, on CPU under TRITON_INTERPRET=1 at toy sizes (timings meaningless there)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    cmd = [sys.executable, str(root / "benchmarks" / "gpu" / "santa_gpu.py"), "--check-cpu", "--sizes", "200",
           "--batch", "1", "--heads", "4", "--kv-heads", "2", "--dim", "16", "--tile", "64", "--repeats", "1",
           "--mean-steps", "2", "--no-peers", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["one_hot_exact"] is True
    (entry,) = data["sizes"]
    for budget in ("fixed", "proportional"):
        e = entry[budget]
        assert e["max_abs_vs_reference"] < 1e-2 and e["rows_equal_reference"] == 1.0
        assert 0 < e["value_rows_fraction"] < 1 and e["bytes_read"] < e["bytes_dense"]
        assert e["ratio_vs_sdpa"] > 0
