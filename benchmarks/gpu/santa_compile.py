"""Ahead-of-time compilation of SANTA's two Triton kernels for NVIDIA targets, on a machine without a GPU.

Issue 15 asks that the kernel compile on Triton 3.6 (torch 2.11) and 3.9 (torch 2.13). A GPU is not needed
for that: ``triton.compile`` with an explicit ``GPUTarget`` runs the whole pipeline (TTIR, TTGIR, LLVM IR,
PTX, and ``ptxas`` to a cubin, ``ptxas`` ships in the triton wheel) for a chosen architecture. This script
compiles ``scores_kernel`` and ``sample_kernel`` with the block sizes and warp count that
``santa_decode_triton`` uses at the GPU check's shapes (tiles of 256 rows, head dim 128, 8 warps), for the
cache dtypes fp16 (the GPU check) and fp32 (the tests), and writes a JSON of what compiled.

It proves that the kernels lower to machine code on those Triton versions; it does not run them (the
numerics are tested under ``TRITON_INTERPRET=1`` in tests/infer/test_santa*.py, the speed by
``santa_gpu.py`` on a GPU).

Usage: ``PYTHONPATH=src python benchmarks/gpu/santa_compile.py --arch 90 --out santa_compile.json``
(about one to two CPU minutes per kernel and dtype).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path


def _signatures(dtype: str) -> dict[str, dict[str, str]]:
    ptr = f"*{dtype}"
    scores = {"q_ptr": ptr, "k_ptr": ptr, "len_ptr": "*i32", "u_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
              "n": "i32", "H": "i32", "Hkv": "i32", "G": "i32", "d": "i32", "T": "i32", "scale": "fp32",
              "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}
    sample = {"v_ptr": ptr, "u_ptr": "*fp32", "st_ptr": "*i32", "a_ptr": "*fp32", "w_ptr": "*fp32",
              "part_ptr": "*fp32", "nread_ptr": "*i32", "n": "i32", "H": "i32", "Hkv": "i32", "G": "i32",
              "d": "i32", "T": "i32", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}
    return {"scores_kernel": scores, "sample_kernel": sample}


def compile_kernels(archs: list[int], dtypes: list[str], block_n: int = 256, block_d: int = 128,
                    num_warps: int = 8) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rankwise.infer.santa.triton_kernel import _kernels

    kernels = dict(zip(("scores_kernel", "sample_kernel"), _kernels()))
    rows = []
    for arch in archs:
        for dtype in dtypes:
            for name, sig in _signatures(dtype).items():
                rec = {"kernel": name, "arch": f"sm_{arch}", "dtype": dtype, "BLOCK_N": block_n, "BLOCK_D": block_d,
                       "num_warps": num_warps}
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        src = ASTSource(fn=kernels[name], signature=sig,
                                        constexprs={"BLOCK_N": block_n, "BLOCK_D": block_d})
                        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
                    rec.update(ok=True, stages=sorted(k.asm), ptx_bytes=len(k.asm.get("ptx", "")),
                               cubin_bytes=len(k.asm.get("cubin", b"")),
                               shared_bytes=int(getattr(k.metadata, "shared", 0) or 0))
                    rec["ok"] = "cubin" in k.asm and rec["cubin_bytes"] > 0
                except Exception as e:  # report, do not stop: the JSON says which combination failed
                    rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
                rec.update(wall_s=round(time.perf_counter() - t0, 1), cpu_s=round(time.process_time() - c0, 1))
                print(json.dumps(rec), flush=True)
                rows.append(rec)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities (90: H100/H200)")
    ap.add_argument("--dtype", nargs="+", default=["fp16", "fp32"], choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--out", type=Path, default=Path("santa_compile.json"))
    a = ap.parse_args(argv)
    try:
        import torch
        import triton
    except ImportError as e:
        print(f"needs torch and triton: {e}", file=sys.stderr)
        return 2
    rows = compile_kernels(a.arch, a.dtype)
    out = {"triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "all_ok": all(r["ok"] for r in rows), "kernels": rows}
    a.out.write_text(json.dumps(out, indent=1))
    print(f"triton {triton.__version__}, torch {torch.__version__}: "
          f"{sum(r['ok'] for r in rows)}/{len(rows)} compiled -> {a.out}")
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
