"""The paper's mechanism, measured: per-token gradient norms by the token's probability.

For a sampled token ``o`` at a position with final hidden state ``h`` (the LM head's input), the gradient
of ``log pi(o)`` with respect to ``h`` is ``W^T (e_o - pi) / temperature`` (``W`` the head's weight), whose
norm grows with ``1 - pi(o)``. :func:`hidden_grad_norms` measures it by autograd (``|A| = 1``, so the
sign of the advantage does not matter) on a rollout, one value per completion token, without touching
the parameters' ``.grad``; :func:`closed_form_grad_norms` computes the same from the formula (a wiring
check). :func:`quartile_means` bins tokens by ``pi_old`` into equal-count bins.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.train.lopti.loss import quartile_means, token_logps

__all__ = ["closed_form_grad_norms", "hidden_grad_norms", "quartile_means"]


def _head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise TypeError("the model needs a linear output head (get_output_embeddings()) to measure hidden gradients")
    return head


def hidden_grad_norms(model: nn.Module, rollout: Any, temperature: float = 1.0) -> dict[str, list[float]]:
    """Per valid completion token: ``p_old`` (rollout probability) and ``grad_norm`` = ``||d log pi(o_t) / d h_t||``
    with ``h_t`` the final hidden state (the LM head's input), by autograd. Also ``closed_form`` (the formula's
    value from the same forward's probabilities)."""
    head = _head(model)
    captured: list[torch.Tensor] = []

    def grab(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0])

    handle = head.register_forward_pre_hook(grab)
    was = model.training
    model.eval()
    try:
        dev = next(iter(model.parameters())).device
        P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(dev)
        att = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(dev)
        with torch.enable_grad():
            logits = model(input_ids=ids, attention_mask=att).logits[:, P - 1:P + T - 1]
            mask = rollout.completion_mask.to(dev).bool()
            lp = token_logps(logits, rollout.completion_ids.to(dev), mask, temperature)
            h = captured[-1]
            (g,) = torch.autograd.grad(lp[mask].sum(), h)
        g = g[:, P - 1:P + T - 1]
        norms = g.norm(dim=-1)[mask]
        probs = torch.softmax(logits.detach().float() / temperature, -1)[mask]
        closed = closed_form_grad_norms(probs, rollout.completion_ids.to(dev)[mask], head.weight.detach(), temperature)
    finally:
        handle.remove()
        model.train(was)
    return {"p_old": torch.exp(rollout.logp_old.to(dev)[mask]).tolist(), "grad_norm": norms.tolist(),
            "closed_form": closed.tolist()}


def closed_form_grad_norms(probs: torch.Tensor, tokens: torch.Tensor, weight: torch.Tensor,
                           temperature: float = 1.0) -> torch.Tensor:
    """``||W^T (e_o - pi)|| / temperature`` per row of ``probs`` ``(N, V)`` with sampled ``tokens`` ``(N,)``."""
    w = weight.float()
    return (w[tokens] - probs.float() @ w).norm(dim=-1) / temperature

