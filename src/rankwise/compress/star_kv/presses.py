"""kvpress rows at a matched cache size, and the continuation metric every row shares.

Protocol (one for every row): a window of ``T`` tokens is split into a context (the first ``context_len``)
and a continuation. A press compresses the context's KV cache during prefill (kvpress' forward hooks), then
the continuation is scored teacher-forced on top of the compressed cache, with its true positions. A
low-rank row (STAR-KV, uniform, energy) simply runs the window: its cache is the latents of every token.
The metric is the negative log-likelihood of the continuation tokens (the first one predicted from the
last context position).

Matched size: a press keeping a fraction ``k`` of the cache runs at ``compression_ratio = 1 - k``.
ThinK prunes key *channels* and zeroes them without shrinking the tensor; its size is counted as kept
elements (non-zero keys plus all values), and its key-channel ratio ``2 (1 - k)`` (at most 1) gives the
same element count. Imports kvpress inside functions (a peer library).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

__all__ = ["PRESSES", "make_press", "press_continuation_nll", "continuation_nll"]

#: row name -> kvpress class name
PRESSES = {"knorm": "KnormPress", "snapkv": "SnapKVPress", "expected_attention": "ExpectedAttentionPress",
           "think": "ThinKPress"}


def make_press(name: str, kept_fraction: float, window: int = 32) -> Any:
    """The kvpress press ``name`` keeping ``kept_fraction`` of the KV cache elements of the context."""
    import kvpress

    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; choose one of {sorted(PRESSES)}")
    if not 0.0 < kept_fraction <= 1.0:
        raise ValueError(f"kept_fraction must be in (0, 1], got {kept_fraction}")
    ratio = 1.0 - kept_fraction
    cls = getattr(kvpress, PRESSES[name])
    if name == "think":
        return cls(key_channel_compression_ratio=min(1.0, 2.0 * ratio), window_size=window)
    if name == "snapkv":
        return cls(compression_ratio=ratio, window_size=window)
    if name == "expected_attention":
        return cls(compression_ratio=ratio, n_future_positions=window)
    return cls(compression_ratio=ratio)


def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


@torch.no_grad()
def continuation_nll(model: nn.Module, windows: Tensor, context_len: int) -> Tensor:
    """Per-token NLL ``(N, T - context_len)`` of each window's continuation, full forward (no press)."""
    logits = model(input_ids=windows).logits
    return _nll(logits[:, context_len - 1:-1], windows[:, context_len:])


@torch.no_grad()
def press_continuation_nll(model: nn.Module, press: Any, windows: Tensor, context_len: int) -> tuple[Tensor, float]:
    """Per-token continuation NLL with the context's cache compressed by ``press``, and the kept fraction of
    the context's cached K/V elements (measured on the cache: zeroed ThinK channels do not count)."""
    from transformers import DynamicCache

    if not 0 < context_len < windows.shape[1]:
        raise ValueError(f"context_len must be in (0, {windows.shape[1]}), got {context_len}")
    cache = DynamicCache(config=model.config)
    ctx, cont = windows[:, :context_len], windows[:, context_len:]
    with press(model):
        pre = model(input_ids=ctx, past_key_values=cache, use_cache=True)
    kept = full = 0
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for layer in cache.layers:
        kept += int((layer.keys != 0).sum()) + layer.values.numel()
        full += 2 * windows.shape[0] * cfg.num_key_value_heads * context_len * hd
    B, T2 = cont.shape
    pos = torch.arange(context_len, context_len + T2).expand(B, T2)
    out = model(input_ids=cont, past_key_values=cache, position_ids=pos, use_cache=True)
    logits = torch.cat([pre.logits[:, -1:], out.logits[:, :-1]], 1)
    return _nll(logits, cont), kept / full
