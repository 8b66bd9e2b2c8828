"""SANTA inside a Hugging Face model: an attention function registered with transformers' ``AttentionInterface``.

:func:`patch_attention` registers ``"rankwise_santa"`` once (with the SDPA mask builder in
``AttentionMaskInterface``), attaches a :class:`SantaState` to every attention module of the model and
switches it over with ``model.set_attn_implementation``; :func:`unpatch_attention` restores the previous
implementation. Decode steps (one query position) use :func:`~rankwise.infer.santa.decode.santa_core`;
calls with several query positions (prefill) use transformers' own SDPA function unless
``decode_only=False``, when every position is estimated under its causal / padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rankwise.infer.santa.config import SantaConfig

ATTN_NAME = "rankwise_santa"
_STATE_ATTR = "_rankwise_santa"


@dataclass
class SantaState:
    """Shared by the patched attention modules of one model: the config, the step counters, the reads.

    ``steps[layer]`` counts that layer's SANTA calls (the decode step of the seed); ``rows_read`` /
    ``rows_valid`` sum over every estimated query and head; ``kv_rows_read`` sums distinct KV-head
    rows; ``estimated_calls`` / ``fallback_calls`` count calls by path.
    """

    config: SantaConfig
    previous: str
    steps: dict[int, int] = field(default_factory=dict)
    rows_read: int = 0
    rows_valid: int = 0
    kv_rows_read: int = 0
    estimated_calls: int = 0
    fallback_calls: int = 0

    def stats(self) -> dict[str, Any]:
        frac = self.rows_read / self.rows_valid if self.rows_valid else float("nan")
        return {"rows_read": self.rows_read, "rows_valid": self.rows_valid, "kv_rows_read": self.kv_rows_read,
                "fraction_read": frac, "estimated_calls": self.estimated_calls,
                "fallback_calls": self.fallback_calls}

    def reset(self) -> None:
        self.steps.clear()
        self.rows_read = self.rows_valid = self.kv_rows_read = 0
        self.estimated_calls = self.fallback_calls = 0


def _query_valid(attention_mask: torch.Tensor | None, B: int, Q: int, n: int, device: torch.device) -> torch.Tensor:
    """bool ``[B, Q, n]``: which cache rows each query position may attend to."""
    if attention_mask is None:  # transformers skipped a pure causal mask
        qpos = torch.arange(Q, device=device).view(Q, 1) + (n - Q)
        return (torch.arange(n, device=device).view(1, n) <= qpos).unsqueeze(0).expand(B, Q, n)
    m = attention_mask
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    m = m[..., -n:]
    if m.shape[1] != 1:
        raise ValueError(f"SANTA expects a mask shared by heads, got shape {tuple(attention_mask.shape)}")
    return m[:, 0].expand(B, Q, n)


def santa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention signature: ``query [B, H, Q, d]``, ``key`` / ``value [B, H_kv, n, d]`` -> ``[B, Q, H, d]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rankwise.infer.santa.decode import santa_core
    from rankwise.infer.santa.sampling import hashed_uniforms

    state: SantaState | None = getattr(module, _STATE_ATTR, None)
    B, H, Q, d = query.shape
    if state is None or (Q > 1 and state.config.decode_only) or getattr(module, "training", False):
        if state is not None:
            state.fallback_calls += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = int(getattr(module, "layer_idx", 0) or 0)
    step = state.steps.get(layer, 0)
    state.steps[layer] = step + 1
    n = key.shape[2]
    valid = _query_valid(attention_mask, B, Q, n, query.device)
    # one seed per (model seed, layer); the step goes in as the step of the hashed stream
    lay = torch.tensor([layer], dtype=torch.int64, device=query.device)
    seed = int(hashed_uniforms(state.config.seed, 0, lay, lay, lay).item() * 2 ** 52)
    scale = scaling if scaling is not None else d ** -0.5
    out, info = santa_core(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), valid,
                           state.config, seed, step, scale)
    state.estimated_calls += 1
    state.rows_read += int(info.rows_read.sum())
    state.rows_valid += int(info.rows_valid.sum()) * H
    state.kv_rows_read += int(info.kv_rows_read.sum())
    return out, None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, santa_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "config")]


def patch_attention(model: Any, config: SantaConfig | None = None) -> Any:
    """Make a ``transformers`` model decode with SANTA (in place; returns the model).

    The model must follow transformers' attention interface (``set_attn_implementation``; Llama, Qwen2,
    Mistral, ...). ``generate`` works unchanged; prefill falls back to SDPA unless
    ``config.decode_only`` is False. Patching an already patched model replaces its config and resets
    its counters. :func:`santa_stats` reads the counters; :func:`unpatch_attention` undoes the patch.
    """
    config = SantaConfig() if config is None else config
    if not isinstance(config, SantaConfig):
        raise TypeError(f"patch_attention: config must be a SantaConfig, got {type(config).__name__}")
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"patch_attention: {type(model).__name__} is not a transformers PreTrainedModel")
    mods = _attention_modules(model)
    if not mods:
        raise ValueError(f"patch_attention: {type(model).__name__} has no attention module with the "
                         "transformers attention interface (num_key_value_groups)")
    _register()
    old = getattr(model, _STATE_ATTR, None)
    previous = old.previous if old is not None else (model.config._attn_implementation or "sdpa")
    if previous == ATTN_NAME:
        previous = "sdpa"
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        raise ValueError(f"patch_attention: {type(model).__name__} does not accept a registered attention "
                         f"implementation (still {model.config._attn_implementation!r})")
    state = SantaState(config=config, previous=previous)
    setattr(model, _STATE_ATTR, state)
    for m in mods:
        setattr(m, _STATE_ATTR, state)
    return model


def unpatch_attention(model: Any) -> Any:
    """Restore the attention implementation the model had before :func:`patch_attention` (in place)."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("unpatch_attention: the model is not patched with SANTA")
    model.set_attn_implementation(state.previous)
    for m in _attention_modules(model):
        if hasattr(m, _STATE_ATTR):
            delattr(m, _STATE_ATTR)
    delattr(model, _STATE_ATTR)
    return model


def santa_stats(model: Any) -> dict[str, Any]:
    """The patched model's counters (rows read / valid, fraction read, calls by path)."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("santa_stats: the model is not patched with SANTA")
    return state.stats()


def santa_state(model: Any) -> SantaState:
    """The patched model's :class:`SantaState` (to reset counters or change the config between runs)."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("santa_state: the model is not patched with SANTA")
    return state
