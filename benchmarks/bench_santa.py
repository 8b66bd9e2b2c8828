"""SANTA's decode step vs exact SDPA and top-k on CPU: time, and value rows / bytes read (JSON).

One decode step of one batch row: ``q [1, H, d]`` against a cache ``[1, n, H_kv, d]`` (H 8, H_kv 2, d 64,
float32), S = 6.25 % of n value rows (the paper's operating point: S = 2048 at 32k). Implementations:
``torch-sdpa`` (the anchor: ``scaled_dot_product_attention`` with ``enable_gqa``), ``rankwise-santa``
(systematic S²ANTA, untiled), ``rankwise-santa-tiled`` (tiles of 256, proportional budgets: the official
kernels' layout) and ``rankwise-topk`` (k = S). The factories record what each implementation reads in the
case's ``params`` (``reads``: value rows and distinct KV rows read per step, and the bytes of K and V read,
at fp16 as a GPU cache would hold them). Speed is not expected on CPU in torch (the spec: only a GPU kernel
turns fewer reads into time); the rows and bytes are the point here. GPU: ``benchmarks/gpu/santa_gpu.py``.

Run ``python -m benchmarks.run santa`` (``--smoke`` for a tiny check).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case

H, HKV, D = 8, 2, 64
FP16 = 2


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, D, generator=g) * 2
    k = torch.randn(1, n, HKV, D, generator=g)
    v = torch.randn(1, n, HKV, D, generator=g)
    return q, k, v


def _impl(name: str, n: int, S: int, params: dict[str, Any]) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.infer import santa

        q, k, v = _inputs(n)
        reads = params.setdefault("reads", {})
        kbytes = n * HKV * D * FP16  # every implementation scores against all keys
        if name == "torch-sdpa":
            qq, kk, vv = q.unsqueeze(2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            reads[name] = {"value_rows_per_head": n, "kv_rows": n * HKV, "bytes": kbytes + n * HKV * D * FP16}
            return lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
        if name == "rankwise-topk":
            _, info = santa.topk_decode(q, k, v, S, return_info=True)
            run = (lambda: santa.topk_decode(q, k, v, S))
        else:
            tile = 256 if name == "rankwise-santa-tiled" else None
            kw = dict(scheme="systematic", tile_size=tile, budget="proportional")
            _, info = santa.santa_decode(q, k, v, S, seed=0, return_info=True, **kw)
            step = iter(range(1, 1 << 30))
            run = (lambda: santa.santa_decode(q, k, v, S, seed=0, step=next(step), **kw))
        reads[name] = {"value_rows_per_head": float(info.rows_read.float().mean()),
                       "kv_rows": int(info.kv_rows_read.sum()),
                       "bytes": kbytes + info.value_bytes(D, FP16)}
        return run

    return factory


def _case(n: int, repeats: int = 9) -> Case:
    S = max(1, n // 16)
    params: dict[str, Any] = {"n": n, "S": S, "H": H, "H_kv": HKV, "d": D, "dtype": "float32",
                              "bytes_at": "fp16"}
    impls = {k: _impl(k, n, S, params)
             for k in ("torch-sdpa", "rankwise-santa", "rankwise-santa-tiled", "rankwise-topk")}
    return Case(f"decode_n{n}", impls, anchor="torch-sdpa", params=params, repeats=repeats, warmup=2)


CASES = [_case(4096), _case(16384)]
SMOKE_CASES = [_case(512, repeats=1)]
