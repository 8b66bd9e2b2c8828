"""The pure math of GRPO, Advantage Reweighting and Lopti (no model, no sampling): small functions on tensors.

Shapes: ``B`` completions (``B = prompts x G``, each prompt's G completions contiguous, as TRL's
``RepeatSampler`` lays them out), ``T`` completion positions; ``mask`` is ``(B, T)`` with 1 on completion
tokens (up to and including the first EOS, as TRL masks them) and 0 on padding.

* :func:`group_advantages`: spec step 3, ``A_i = (r_i - mean_group r) / (std_group r + 1e-4)`` (Bessel std);
* :func:`per_token_loss`: spec step 5, ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta KL_k3``,
  with TRL's order of operations (so the parity with ``trl.GRPOTrainer._compute_loss`` is exact);
* :func:`aggregate`: spec step 6 (``loss_type``);
* :func:`reweight_advantages` (AR) and :func:`lopti_masks` (Lopti's split);
* :func:`k3_kl`; :func:`token_logps` (log-probabilities of the sampled tokens from logits).
"""

from __future__ import annotations

from typing import Sequence

import torch

from rankwise.core.errors import NumericalError

__all__ = [
    "aggregate",
    "check_mask",
    "group_advantages",
    "k3_kl",
    "lopti_masks",
    "per_token_loss",
    "reweight_advantages",
    "token_logps",
]

STD_EPS = 1e-4  # TRL's and the spec's denominator floor


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """``(N,)`` advantages of ``(N,)`` rewards in contiguous groups of ``num_generations`` (N = prompts x G).

    ``scale_rewards``: ``"group"`` divides by each group's std (Bessel) + 1e-4, ``"batch"`` by the whole
    batch's std + 1e-4, ``"none"`` does not divide. A group of equal rewards gets all-zero advantages.
    Raises ValueError when ``N`` is not a multiple of ``num_generations`` or a reward is not finite
    (naming the prompt index).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-d tensor, got {getattr(rewards, 'shape', type(rewards).__name__)}")
    G = int(num_generations)
    if G < 2:
        raise ValueError(f"num_generations must be >= 2 (the group std needs two completions), got {G}")
    if rewards.numel() == 0 or rewards.numel() % G:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of num_generations={G}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"reward of completion {bad[0]} (prompt {bad[0] // G}) is {float(rewards[bad[0]])}; "
                         "reward functions must return finite numbers")
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    adv = rewards - mean
    if scale_rewards == "group":
        adv = adv / (grouped.std(dim=1).repeat_interleave(G) + STD_EPS)
    elif scale_rewards == "batch":
        adv = adv / (rewards.std().expand_as(rewards) + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of 'group', 'batch', 'none', got {scale_rewards!r}")
    return adv


def check_mask(mask: torch.Tensor, like: torch.Tensor, what: str = "mask") -> None:
    if not isinstance(mask, torch.Tensor) or mask.shape != like.shape:
        raise ValueError(f"{what} must be a tensor shaped {tuple(like.shape)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None,
                temperature: float = 1.0) -> torch.Tensor:
    """``(B, T)`` log-probabilities of ``tokens`` under ``logits / temperature`` (``(B, T, V)``), in float32.

    Raises :class:`~rankwise.core.errors.NumericalError` when a logit at a masked-in position is not
    finite (NaN/inf logits would otherwise turn the loss into NaN silently).
    """
    if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits must be (B, T, V) matching tokens {tuple(tokens.shape)}, got {tuple(logits.shape)}")
    valid = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
    finite = torch.isfinite(logits.detach()).all(dim=-1)
    bad = (valid & ~finite).nonzero()
    if len(bad):
        i, t = bad[0].tolist()
        raise NumericalError(f"non-finite logits at completion {i}, position {t} ({len(bad)} position(s) in all); "
                             "the policy has diverged or its inputs are corrupt")
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """The k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, exactly 0 where they are equal)."""
    d = logp_ref - logp
    return torch.exp(d) - d - 1


def per_token_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, *,
                   epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
                   logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per_token_loss, ratio)``, both ``(B, T)``: the clipped surrogate plus ``beta`` times the k3 KL.

    ``advantages``: ``(B,)``, ``(B, 1)`` or ``(B, T)`` (a hook's per-token advantages). The operations
    follow ``trl.GRPOTrainer._compute_loss`` one for one (loss_type grpo / bnpo / dr_grpo).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(logp - logp_old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        if logp_ref is None:
            raise ValueError("beta > 0 needs the reference log-probabilities logp_ref")
        loss = loss + beta * k3_kl(logp, logp_ref)
    return loss, coef_1


def aggregate(loss: torch.Tensor, mask: torch.Tensor, loss_type: str = "bnpo",
              max_completion_length: int | None = None) -> torch.Tensor:
    """The scalar loss of a ``(B, T)`` per-token loss over ``mask`` (spec step 6; TRL's formulas).

    ``"bnpo"``: ``sum(l * m) / max(sum(m), 1)``; ``"grpo"``: per sequence ``sum(l * m) / max(sum(m), 1)``,
    then the mean over sequences; ``"dr_grpo"``: ``sum(l * m) / (B * max_completion_length)``.
    """
    check_mask(mask, loss)
    if loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return (loss * mask).sum() / (loss.size(0) * max_completion_length)
    raise ValueError(f"loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', got {loss_type!r}")


def reweight_advantages(advantages: torch.Tensor, logp_old: torch.Tensor, alpha: float,
                        positive_only: bool = False) -> torch.Tensor:
    """AR: ``(B, T)`` advantages ``[alpha * exp(logp_old) + (1 - alpha)] * A`` (the weight is a constant in
    ``[1 - alpha, 1]``); ``positive_only`` leaves negative advantages unchanged. ``alpha = 0`` returns
    ``A`` broadcast to ``(B, T)`` bit for bit (the weight is exactly 1.0)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    weight = alpha * torch.exp(logp_old.detach()) + (1 - alpha)
    out = weight * advantages
    if positive_only:
        out = torch.where(advantages > 0, out, advantages.expand_as(out))
    return out


def lopti_masks(logp_old: torch.Tensor, mask: torch.Tensor, eta: float, quantile: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` ``(B, T)`` masks partitioning ``mask`` by ``pi_old = exp(logp_old) < threshold``.

    The threshold is ``eta`` or, with ``quantile``, the ``eta``-quantile of the valid tokens' ``pi_old``.
    ``eta = 1``: every valid token is low; ``eta = 0``: none is.
    """
    check_mask(mask, logp_old)
    valid = mask.bool()
    p = torch.exp(logp_old.detach())
    if eta >= 1.0:
        low = valid
    elif eta <= 0.0:
        low = torch.zeros_like(valid)
    else:
        thr = torch.quantile(p[valid].float(), eta) if quantile and valid.any() else torch.tensor(eta)
        low = valid & (p < thr)
    high = valid & ~low
    return low.to(mask.dtype), high.to(mask.dtype)


def quartile_means(values: Sequence[float], keys: Sequence[float], n_bins: int = 4) -> list[float]:
    """Mean of ``values`` in each of ``n_bins`` equal-count bins of ``keys`` (ascending keys)."""
    if len(values) != len(keys) or len(values) < n_bins:
        raise ValueError(f"need >= {n_bins} matching values and keys, got {len(values)} and {len(keys)}")
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    out = []
    for b in range(n_bins):
        idx = order[b * len(order) // n_bins:(b + 1) * len(order) // n_bins]
        out.append(sum(values[i] for i in idx) / len(idx))
    return out
