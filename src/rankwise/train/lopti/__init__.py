"""Lopti and Advantage Reweighting (arXiv 2505.12929, ICLR 2026): stop low-probability tokens from dominating
GRPO updates.

The gradient of ``log pi(o_t)`` with respect to a token's logits is ``e_{o_t} - pi``, whose norm grows with
``1 - pi(o_t)``: low-probability tokens dominate the update. Advantage Reweighting scales each token's
advantage by ``alpha * pi_old + (1 - alpha)``; Lopti updates on the low-probability tokens first, then on
the others, both stages against the rollout's ``logp_old``. Public face:

* :class:`GRPOConfig` (TRL's field names), :class:`GRPOTrainer` (a GRPO loop on any causal LM with token
  hooks), :class:`Rollout`, :class:`AdvantageReweighting`, :class:`Lopti`;
* the pure math: :func:`group_advantages`, :func:`per_token_loss`, :func:`aggregate`, :func:`k3_kl`,
  :func:`reweight_advantages`, :func:`lopti_masks`, :func:`token_logps`;
* the mechanism: :func:`hidden_grad_norms`, :func:`closed_form_grad_norms`, :func:`quartile_means`;
* TRL: :func:`trl_grpo_config`, :func:`grpo_trainer` (plain ``trl.GRPOTrainer`` or AR's subclass
  :func:`ar_trainer_class`), :func:`trl_loss`, :func:`trl_parity_inputs` (TRL imported inside them).

docs/methods/lopti.md records the choices the paper leaves open.
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.train.lopti.analysis import closed_form_grad_norms, hidden_grad_norms
from rankwise.train.lopti.config import LOSS_TYPES, ORDERS, SCALE_REWARDS, AdvantageReweighting, GRPOConfig, Lopti
from rankwise.train.lopti.integration import (
    ar_trainer_class,
    grpo_trainer,
    trl_grpo_config,
    trl_loss,
    trl_parity_inputs,
)
from rankwise.train.lopti.loss import (
    aggregate,
    group_advantages,
    k3_kl,
    lopti_masks,
    per_token_loss,
    quartile_means,
    reweight_advantages,
    token_logps,
)
from rankwise.train.lopti.trainer import GRPOTrainer, Rollout, completion_logps, sample_completions

__all__ = [
    "LOSS_TYPES",
    "ORDERS",
    "SCALE_REWARDS",
    "AdvantageReweighting",
    "GRPOConfig",
    "GRPOTrainer",
    "Lopti",
    "Rollout",
    "aggregate",
    "ar_trainer_class",
    "closed_form_grad_norms",
    "completion_logps",
    "group_advantages",
    "grpo_trainer",
    "hidden_grad_norms",
    "k3_kl",
    "lopti_masks",
    "per_token_loss",
    "quartile_means",
    "reweight_advantages",
    "sample_completions",
    "token_logps",
    "trl_grpo_config",
    "trl_loss",
    "trl_parity_inputs",
]


register("lopti", config=GRPOConfig, entry=GRPOTrainer, module=__name__)
