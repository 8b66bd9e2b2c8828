"""P2D (arXiv 2605.21558, ICML 2026): task-sensitive attention heads select both the data and the trainable
parameters; head scores from ALPS (arXiv 2505.18799).

Public face:

* :class:`P2DConfig`, :class:`P2D` (``probe_set``, ``localize_heads``, ``select_data``, ``restrict_to_heads``,
  ``aer``, ``save_heads``/``load_heads``, ``timings``), :func:`aer`, :class:`DataSelection`;
* heads: :func:`find_attention` (Llama-style q/k/v/o_proj, GPT-2 c_attn/c_proj,
  :func:`register_attention_finder` for others), :func:`head_scores`, :func:`distribution_distance`,
  :func:`wasserstein1`, :func:`select_heads`, :func:`restrict_to_heads` (gradient masks, GQA rule),
  :class:`HeadSelection`, :func:`save_heads`, :func:`load_heads`;
* scores: :func:`head_gradients`, :func:`head_activations`, :func:`sample_losses`, :func:`encode_pool`;
* baselines: :func:`random_data`, :func:`loss_data`, :func:`random_heads`, :func:`lora_model` (PEFT).

docs/methods/p2d.md records the choices the paper leaves open (the proxy, the affinity, AER).
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.train.p2d.baselines import DATA_METHODS, lora_model, loss_data, random_data, random_heads, select
from rankwise.train.p2d.heads import (
    HEAD_SCORES,
    AttentionLayout,
    HeadRestriction,
    HeadSelection,
    attention_parameters,
    distribution_distance,
    find_attention,
    head_count,
    head_mask,
    head_scores,
    head_vector,
    load_heads,
    register_attention_finder,
    restrict_to_heads,
    save_heads,
    select_heads,
    wasserstein1,
)
from rankwise.train.p2d.method import AFFINITIES, P2D, DataSelection, P2DConfig, aer, top_k
from rankwise.train.p2d.scoring import EncodedPool, encode_pool, head_activations, head_gradients, sample_losses

__all__ = [
    "AFFINITIES",
    "DATA_METHODS",
    "HEAD_SCORES",
    "AttentionLayout",
    "DataSelection",
    "EncodedPool",
    "HeadRestriction",
    "HeadSelection",
    "P2D",
    "P2DConfig",
    "aer",
    "attention_parameters",
    "distribution_distance",
    "encode_pool",
    "find_attention",
    "head_activations",
    "head_gradients",
    "head_count",
    "head_mask",
    "head_scores",
    "head_vector",
    "load_heads",
    "lora_model",
    "loss_data",
    "random_data",
    "random_heads",
    "register_attention_finder",
    "restrict_to_heads",
    "sample_losses",
    "save_heads",
    "select",
    "select_heads",
    "top_k",
    "wasserstein1",
]

register("p2d", config=P2DConfig, entry=P2D)
