"""SANTA's Triton kernel vs SDPA on a GPU: decode-step time at 4k-32k context, correctness, JSON of ratios.

The one GPU check of issue 15. Shapes of the paper's setting (Llama-3.1-8B-like decode): batch 8, 32 query
heads over 8 KV heads, head dim 128, fp16 caches ``[B, n, H_kv, d]``, S = 6.25 % of n (the paper: S = 2048 at
32k), tiles of 256 rows, fixed and proportional budgets. Per context length n in 4096, 8192, 16384, 32768:

* time (CUDA events, median of ``--repeats`` after warm-up) of ``scaled_dot_product_attention`` (enable_gqa,
  its own ``[B, H_kv, n, d]`` layout) and of ``santa_decode_triton``; ``ratio = t_kernel / t_sdpa`` (< 1: faster);
* correctness: the kernel against the torch reference ``santa_decode`` with the same seed and step (max abs
  difference, equal rows read), the one-step relative error against SDPA, and the relative error of the mean
  of 32 steps (it must shrink: unbiasedness), plus a one-hot softmax returning its value row exactly;
* value rows read per head (fraction of n) and the bytes of K and V read.

Usage: ``PYTHONPATH=src python benchmarks/gpu/santa_gpu.py --out santa_gpu.json`` (needs CUDA, torch and
triton; about 1-3 minutes on one GPU, bounded by ``--budget-s``, default 420 s). Exits 2 without a GPU.
FlashInfer / flash-attn are timed when importable (``--no-peers`` to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _time(fn, repeats: int, warmup: int = 5) -> float:
    import torch

    if not torch.cuda.is_available():  # --check-cpu: wall clock, no CUDA events
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def _peers(q, k, v, repeats: int) -> dict:
    out: dict = {}
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]

        out["flash_attn_s"] = _time(lambda: flash_attn_with_kvcache(q.unsqueeze(1), k, v), repeats)
    except Exception as exc:  # noqa: BLE001 - optional peer: record why it is absent
        out["flash_attn"] = f"not measured ({type(exc).__name__})"
    try:
        import flashinfer  # type: ignore[import-not-found]

        # single-request decode, batch row 0 (NHD layout), as a per-request reference point
        out["flashinfer_single_s"] = _time(
            lambda: flashinfer.single_decode_with_kv_cache(q[0], k[0], v[0]), repeats)
    except Exception as exc:  # noqa: BLE001
        out["flashinfer"] = f"not measured ({type(exc).__name__})"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--frac", type=float, default=0.0625, help="S / n")
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new sizes after this")
    ap.add_argument("--mean-steps", type=int, default=32, help="steps averaged for the unbiasedness check")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--check-cpu", action="store_true",
                    help="run the script's code paths on CPU (set TRITON_INTERPRET=1; tiny sizes): a test of the script")
    ap.add_argument("--out", type=Path, default=Path("santa_gpu.json"))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.check_cpu:
        print("santa_gpu: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    import triton

    from rankwise.infer import santa
    from rankwise.infer.santa.triton_kernel import santa_decode_triton

    t_start = time.monotonic()
    dev = torch.device("cpu" if args.check_cpu else "cuda")
    B, H, Hkv, d = args.batch, args.heads, args.kv_heads, args.dim
    result = {"environment": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                              "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "none (--check-cpu)",
                              "cuda": torch.version.cuda},
              "shape": {"B": B, "H": H, "H_kv": Hkv, "d": d, "dtype": "float16", "S_over_n": args.frac,
                        "tile": args.tile}, "sizes": []}
    # one-hot softmax: the kernel returns that value row
    q1 = torch.zeros(1, 2, d, device=dev, dtype=torch.float16)
    q1[..., 0] = 1e4
    k1 = torch.zeros(1, 1000, 1, d, device=dev, dtype=torch.float16)
    k1[:, 700, :, 0] = 1.0
    v1 = torch.randn(1, 1000, 1, d, device=dev, dtype=torch.float16)
    o1 = santa_decode_triton(q1, k1, v1, 16, tile_size=args.tile, seed=0)
    result["one_hot_exact"] = bool(torch.equal(o1, v1[:, 700].expand(1, 2, d)))

    for n in args.sizes:
        if time.monotonic() - t_start > args.budget_s:
            result["sizes"].append({"n": n, "skipped": "time budget"})
            continue
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(B, H, d, device=dev, generator=g, dtype=torch.float16)
        k = torch.randn(B, n, Hkv, d, device=dev, generator=g, dtype=torch.float16)
        v = torch.randn(B, n, Hkv, d, device=dev, generator=g, dtype=torch.float16)
        S = max(1, round(args.frac * n))
        kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        sdpa = (lambda: torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kt, vt, enable_gqa=True))
        dense = sdpa()[:, :, 0].float()
        entry: dict = {"n": n, "S": S, "sdpa_s": _time(sdpa, args.repeats)}
        for budget in ("fixed", "proportional"):
            run = (lambda: santa_decode_triton(q, k, v, S, tile_size=args.tile, budget=budget, seed=1, step=0))
            t = _time(run, args.repeats)
            out, info = santa_decode_triton(q, k, v, S, tile_size=args.tile, budget=budget, seed=1, step=0,
                                            return_info=True)
            ref, rinfo = santa.santa_decode(q, k, v, S, "systematic", args.tile, budget, seed=1, step=0,
                                            return_info=True)
            mean = torch.stack([santa_decode_triton(q, k, v, S, tile_size=args.tile, budget=budget, seed=1,
                                                    step=s).float() for s in range(args.mean_steps)]).mean(0)
            rel = (lambda x: float((x - dense).norm() / dense.norm()))
            rows = info["rows_read"].float()
            entry[budget] = {
                "kernel_s": t, "ratio_vs_sdpa": t / entry["sdpa_s"],
                "max_abs_vs_reference": float((out.float() - ref.float()).abs().max()),
                "rows_equal_reference": float((info["rows_read"] == rinfo.rows_read).float().mean()),
                "rel_error_one_step": rel(out.float()), "rel_error_mean_of_steps": rel(mean),
                "mean_steps": args.mean_steps,
                "value_rows_fraction": float(rows.mean() / n),
                "bytes_read": int(B * n * Hkv * d * 2 + int(rinfo.kv_rows_read.sum()) * d * 2),
                "bytes_dense": int(2 * B * n * Hkv * d * 2),
            }
        if not args.no_peers:
            entry["peers"] = _peers(q, k, v, args.repeats)
        result["sizes"].append(entry)
        print(json.dumps({"n": n, "sdpa_ms": entry["sdpa_s"] * 1e3,
                          "ratio_fixed": entry["fixed"]["ratio_vs_sdpa"],
                          "ratio_prop": entry["proportional"]["ratio_vs_sdpa"]}), flush=True)
        del q, k, v, kt, vt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.monotonic() - t_start
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
