"""Task losses with the signature ``loss(output, batch) -> scalar``, for training and for the backward
passes of gradient-based compression (FWSVD's Fisher, GFWSVD's Kronecker factors: the caller passes
one to ``rankwise.compress.compress(..., loss_fn=...)``; the compress family never imports this module).

* :func:`contrastive_loss`: in-batch contrastive loss of a sentence-embedding model on a batch
  ``[a_1..a_B, b_1..b_B]`` of positive pairs (mean-pooled, cosine / temperature 0.05);
* :func:`lm_loss`: next-token cross-entropy of a causal LM (padding ignored);
* :func:`task_loss_for`: which of the two suits a model, and whether its batches must be pairs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["mean_pool", "contrastive_loss", "lm_loss", "is_causal_lm", "task_loss_for"]


def mean_pool(out: Any, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the last hidden states over the non-padding tokens (``mask``): ``(batch, hidden)``."""
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        hs = getattr(out, "hidden_states", None)
        if hs is None:
            raise ValueError("the model output has neither last_hidden_state nor hidden_states")
        h = hs[-1]
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def contrastive_loss(out: Any, batch: dict[str, torch.Tensor], temperature: float = 0.05) -> torch.Tensor:
    """In-batch contrastive loss of a batch ``[a_1..a_B, b_1..b_B]`` (``a_i``, ``b_i`` a positive pair).

    Cross-entropy over the cosine similarities of the mean-pooled embeddings divided by
    ``temperature`` (0.05), the task loss of FWSVD / GFWSVD on a sentence-embedding model.
    """
    e = torch.nn.functional.normalize(mean_pool(out, batch["attention_mask"]).float(), dim=-1)
    B = e.shape[0] // 2
    if B < 1 or e.shape[0] % 2:
        raise ValueError(f"contrastive_loss needs an even batch [anchors, positives], got {e.shape[0]} texts")
    logits = e[:B] @ e[B:].mT / temperature
    return torch.nn.functional.cross_entropy(logits, torch.arange(B, device=logits.device))


def lm_loss(out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM output on the batch's ``input_ids`` (padding ignored)."""
    logits = out.logits[:, :-1].float()
    labels = batch["input_ids"][:, 1:].clone()
    labels[batch["attention_mask"][:, 1:] == 0] = -100
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` looks like a causal LM (``*ForCausalLM`` or an ``lm_head``)."""
    return type(model).__name__.endswith("ForCausalLM") or hasattr(model, "lm_head")


def task_loss_for(model: nn.Module) -> tuple[Callable[[Any, Any], torch.Tensor], bool]:
    """``(loss_fn, pairs)``: :func:`lm_loss` for a causal LM (plain batches, ``pairs=False``), else
    :func:`contrastive_loss` (batches of positive pairs ``[a_1..a_k, b_1..b_k]``, ``pairs=True``)."""
    return (lm_loss, False) if is_causal_lm(model) else (contrastive_loss, True)
