"""The Triton kernel against the torch reference, on CPU under ``TRITON_INTERPRET=1``.

The interpreter must be switched on before triton is first imported, so the comparison runs in a fresh
interpreter with the variable set; it prints one JSON line that the test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, torch
from rankwise.infer import santa
from rankwise.infer.santa.triton_kernel import santa_decode_triton
out = []
g = torch.Generator().manual_seed(0)
for (B, H, Hkv, n, d, S, tile, budget, lens, dtype) in [
        (2, 4, 2, 300, 24, 32, 64, "fixed", (300, 200), torch.float32),
        (2, 4, 2, 300, 24, 32, 64, "proportional", (300, 130), torch.float32),
        (1, 4, 1, 50, 16, 8, 64, "fixed", (50,), torch.float32),          # one tile
        (1, 8, 2, 256, 32, 16, 64, "proportional", (256,), torch.bfloat16)]:
    q = (torch.randn(B, H, d, generator=g) * 2).to(dtype)
    k = torch.randn(B, n, Hkv, d, generator=g).to(dtype)
    v = torch.randn(B, n, Hkv, d, generator=g).to(dtype)
    lengths = torch.tensor(lens)
    mask = torch.arange(n)[None] < lengths[:, None]
    for step in range(1 if dtype == torch.bfloat16 else 2):
        o1, i1 = santa_decode_triton(q, k, v, S, tile_size=tile, budget=budget, seed=3, step=step,
                                     lengths=lengths, return_info=True)
        o2, i2 = santa.santa_decode(q, k, v, S, "systematic", tile, budget, seed=3, step=step, mask=mask,
                                    return_info=True)
        out.append({"budget": budget, "dtype": str(dtype), "max_abs": float((o1.float() - o2.float()).abs().max()),
                    "scale": float(o2.float().abs().max()), "same_rows": bool(torch.equal(i1["rows_read"], i2.rows_read)),
                    "same_budgets": bool(torch.equal(i1["budgets"], i2.budgets)), "out_dtype": str(o1.dtype)})
# one-hot softmax: the kernel returns that value row
q = torch.zeros(1, 2, 8); q[..., 0] = 1e4
k = torch.zeros(1, 100, 1, 8); k[:, 70, :, 0] = 1.0
v = torch.randn(1, 100, 1, 8, generator=g)
o = santa_decode_triton(q, k, v, 4, tile_size=32, budget="fixed", seed=0)
out.append({"one_hot": bool(torch.allclose(o, v[:, 70].expand(1, 2, 8), atol=1e-6))})
try:
    santa_decode_triton(q, k, v, 4, tile_size=48)
    out.append({"bad_tile": False})
except ValueError:
    out.append({"bad_tile": True})
print(json.dumps(out))
"""


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in rows[:-2]:
        tol = 1e-5 if r["dtype"] == "torch.float32" else 2e-2
        assert r["max_abs"] <= tol * max(1.0, r["scale"]), r
        assert r["same_rows"] and r["same_budgets"], r
        assert r["out_dtype"] == r["dtype"]
    assert rows[-2] == {"one_hot": True}
    assert rows[-1] == {"bad_tile": True}


@pytest.mark.slow
def test_kernels_compile_to_sm90_machine_code_without_a_gpu(tmp_path: Path):
    """Ahead-of-time compilation for an H100/H200 target (``benchmarks/gpu/santa_compile.py``): both kernels
    lower through PTX to a cubin on the installed Triton (about a minute per kernel)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu" / "santa_compile.py"), "--arch", "90",
                           "--dtype", "fp16", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rep = json.loads(out.read_text())
    assert rep["all_ok"] and {k["kernel"] for k in rep["kernels"]} == {"scores_kernel", "sample_kernel"}
    assert all(k["cubin_bytes"] > 0 for k in rep["kernels"])
