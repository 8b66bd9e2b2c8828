"""SANTA / S²ANTA (arXiv 2605.01910, ICML 2026): sample value rows from the softmax instead of a dense ``p^T V``.

At a decode step the value stage ``o = sum_i p_i v_i`` is an expectation under ``p = softmax(q K^T / sqrt(d))``;
SANTA estimates it from S sampled rows, gathered and added with integer counts (spec
``shared/methods/santa.md``). Public face:

* :func:`santa_decode` (``q [B, H, d]``, caches ``[B, n, H_kv, d]``; i.i.d., stratified, systematic;
  tiled with fixed or proportional budgets; GQA; fp32 inside; hashed seeding per step/head/tile;
  ``return_info`` gives the rows-read counter :class:`SantaInfo`), :func:`dense_decode` (SDPA),
  :func:`topk_decode` (the biased top-k baseline), :func:`ternary_query` (Bernoulli ternary query),
  :func:`sample_counts` / :func:`tile_budgets` (the counts alone), :func:`iid_mse` (closed form);
* :class:`SantaConfig`; :func:`patch_attention` / :func:`unpatch_attention` / :func:`santa_stats` for
  ``transformers`` models (``AttentionInterface``; prefill falls back to SDPA);
* :mod:`rankwise.infer.santa.triton_kernel`: the optional GPU kernel (``pip install rankwise[gpu]``),
  checked against this reference.

Example::

    from rankwise.infer import santa
    out = santa.santa_decode(q, k_cache, v_cache, num_samples=64, scheme="systematic",
                             generator=torch.Generator().manual_seed(0))
    model = santa.patch_attention(model, santa.SantaConfig(num_samples=64))
    model.generate(ids, max_new_tokens=32)
    santa.unpatch_attention(model)
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.infer.santa.config import BUDGETS, MODEL_SCHEMES, SCHEMES, SantaConfig
from rankwise.infer.santa.decode import SantaInfo, dense_decode, iid_mse, santa_core, santa_decode, topk_decode
from rankwise.infer.santa.model import (
    ATTN_NAME,
    SantaState,
    patch_attention,
    santa_attention_forward,
    santa_state,
    santa_stats,
    unpatch_attention,
)
from rankwise.infer.santa.sampling import (
    SampleCounts,
    hashed_uniforms,
    sample_counts,
    splitmix64,
    ternary_query,
    tile_budgets,
)

__all__ = [
    "ATTN_NAME",
    "BUDGETS",
    "MODEL_SCHEMES",
    "SCHEMES",
    "SampleCounts",
    "SantaConfig",
    "SantaInfo",
    "SantaState",
    "dense_decode",
    "hashed_uniforms",
    "iid_mse",
    "patch_attention",
    "sample_counts",
    "santa_attention_forward",
    "santa_core",
    "santa_decode",
    "santa_state",
    "santa_stats",
    "splitmix64",
    "ternary_query",
    "tile_budgets",
    "topk_decode",
    "unpatch_attention",
]

register("santa", config=SantaConfig, entry=patch_attention, module=__name__)
