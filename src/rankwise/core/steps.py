"""One optimisation step of a causal LM on a padded batch, shared by the loops that train small LMs by hand
(the zoo's warm-up models, AgentVocab's stage 2): forward with labels, a finite-loss check, backward,
gradient-norm clipping, the optimizer step."""

from __future__ import annotations

import torch

from rankwise.core.errors import NumericalError

__all__ = ["causal_lm_step"]


def causal_lm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, labels: torch.Tensor, *, step: int, grad_clip: float | None = 1.0,
                   who: str = "training") -> float:
    """Train ``model`` on one batch (a Hugging Face causal LM: ``model(..., labels=...).loss``) and return the
    loss. A non-finite loss raises :class:`NumericalError` (a ``FloatingPointError``) naming ``who`` and
    ``step`` before any parameter changes."""
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    if not torch.isfinite(loss):
        raise NumericalError(f"{who}: non-finite loss at step {step}")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return float(loss.detach())
