"""STAR-KV's latent cache at decode time against SDPA over the full KV cache and over a kvpress-sized one.

One attention layer of the reproduction's geometry (hidden 256, 8 query heads of dim 32 over 2 KV heads,
random weights: timing does not depend on them), one new token (batch 1) attending to ``n`` cached tokens.

Cases (``ratio_vs_anchor`` < 1: cheaper than the anchor):

* ``star_kv_decode``: anchor ``sdpa-full-kv`` (``q_proj`` / ``k_proj`` / ``v_proj`` of the new token, RoPE,
  ``torch.nn.functional.scaled_dot_product_attention`` over the full ``2 x Hkv x d`` numbers per cached
  token, ``o_proj``); ``sdpa-pruned-kv``: the same over ``kept x n`` tokens (what a kvpress press leaves at
  the same cache size); ``star-kv-latent``: :func:`rankwise.compress.star_kv.latent_attention` reading
  ``kept x 2 Hkv d`` latent numbers per token (keys rebuilt per head then rotated, values mixed in the
  latent space and lifted once). ``params`` give the cached bytes of each.

No goal on speed: on CPU, rebuilding ``n`` keys costs ``n x r_K x d`` multiply-adds that the full cache
does not pay; the paper's speedups come from fused GPU kernels on memory-bound decoding. The case records
what the CPU reference costs. Run ``python -m benchmarks.run star_kv``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from benchmarks.harness import Case

KEPT = 0.4


@functools.lru_cache(maxsize=4)
def _setup(n: int, hidden: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.compress.star_kv import LatentKVCache, lowrank_kv

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=n + 8)
    model = LlamaForCausalLM(cfg).eval()
    attn = model.model.layers[0].self_attn
    hd, hkv = attn.head_dim, cfg.num_key_value_heads
    dense = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
    ctx = torch.randn(1, n, hidden)
    h = torch.randn(1, 1, hidden)
    rotary = model.model.rotary_emb
    pos = torch.arange(n + 1)[None]
    cos, sin = rotary(ctx, pos)
    with torch.no_grad():
        k = dense["k"](ctx).view(1, n, hkv, hd).transpose(1, 2)
        v = dense["v"](ctx).view(1, n, hkv, hd).transpose(1, 2)
        k = k * cos[:, None, :n] + torch.cat([-k[..., hd // 2:], k[..., :hd // 2]], -1) * sin[:, None, :n]
    rk = max(1, round(KEPT * hd))
    lowrank_kv(model, {0: ([rk] * hkv, max(1, round(KEPT * hkv * hd)))})
    cache = LatentKVCache()
    with torch.no_grad():
        cache.update(0, attn.k_proj.latent(ctx), attn.v_proj.latent(ctx))
    return {"attn": attn, "dense": dense, "h": h, "k": k, "v": v, "cos": cos, "sin": sin, "rotary": rotary,
            "cache": cache, "n": n, "hd": hd, "hkv": hkv}


def _sdpa(st: dict[str, Any], keep: float) -> None:
    import torch.nn.functional as F

    n, hd, hkv, d = st["n"], st["hd"], st["hkv"], st["dense"]
    m = max(1, int(keep * n))
    with torch.no_grad():
        q = d["q"](st["h"]).view(1, 1, -1, hd).transpose(1, 2)
        kn = d["k"](st["h"]).view(1, 1, hkv, hd).transpose(1, 2)
        vn = d["v"](st["h"]).view(1, 1, hkv, hd).transpose(1, 2)
        c, s = st["cos"][:, None, n:], st["sin"][:, None, n:]
        rot = lambda x: x * c + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * s  # noqa: E731
        q, kn = rot(q), rot(kn)
        k = torch.cat([st["k"][:, :, n - m:], kn], 2)
        v = torch.cat([st["v"][:, :, n - m:], vn], 2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        d["o"](out.transpose(1, 2).reshape(1, 1, -1))


def _latent(st: dict[str, Any]) -> None:
    from rankwise.compress.star_kv import LatentKVCache, latent_attention

    cache = LatentKVCache()
    cache.k[0], cache.v[0] = st["cache"].k[0], st["cache"].v[0]  # a fresh cache of the same n latents
    with torch.no_grad():
        latent_attention(st["attn"], st["h"], st["rotary"], cache=cache, layer=0)


def _impl(kind: str, n: int, hidden: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        st = _setup(n, hidden)
        if kind == "sdpa-full-kv":
            return lambda: _sdpa(st, 1.0)
        if kind == "sdpa-pruned-kv":
            return lambda: _sdpa(st, KEPT)
        return lambda: _latent(st)

    return factory


IMPLS = ("sdpa-full-kv", "sdpa-pruned-kv", "star-kv-latent")


def _case(n: int, hidden: int, repeats: int, suffix: str = "") -> Case:
    hd, hkv = hidden // 8, 2
    full = 2 * hkv * hd * n * 4
    return Case(f"star_kv_decode{suffix}", {k: _impl(k, n, hidden) for k in IMPLS}, anchor="sdpa-full-kv",
                params={"context": n, "hidden": hidden, "heads": 8, "kv_heads": hkv, "head_dim": hd, "kept": KEPT,
                        "cache_bytes_full": full, "cache_bytes_pruned": int(KEPT * n) * 2 * hkv * hd * 4,
                        "cache_bytes_latent": n * (hkv * max(1, round(KEPT * hd)) + max(1, round(KEPT * hkv * hd))) * 4},
                repeats=repeats, warmup=2)


CASES = [_case(1024, 256, repeats=20), _case(4096, 256, repeats=10, suffix="_4k")]
SMOKE_CASES = [_case(64, 64, repeats=1, suffix="_smoke")]
