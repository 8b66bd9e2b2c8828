"""Configuration of the GRPO loop and its two token hooks (Advantage Reweighting, Lopti).

The GRPO field names are TRL's (``trl.GRPOConfig``): ``num_generations``, ``epsilon`` (the lower clip),
``epsilon_high``, ``beta``, ``loss_type``, ``scale_rewards``, ``num_iterations``, ``temperature``,
``max_completion_length``, ``max_grad_norm``, ``reward_weights``; the defaults are TRL 1.16's except
``loss_type="bnpo"`` (the paper's token-mean, verl's "token-mean"), which the spec makes the library
default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive, check_unit

__all__ = ["LOSS_TYPES", "ORDERS", "SCALE_REWARDS", "AdvantageReweighting", "GRPOConfig", "Lopti"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
ORDERS = ("low_first", "high_first")


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO hyper-parameters with TRL's names (spec "Base: GRPO as in TRL's GRPOTrainer").

    * ``num_generations`` G completions per prompt (>= 2: the group std needs two);
    * ``epsilon`` / ``epsilon_high``: the clip range ``[1 - epsilon, 1 + epsilon_high]`` of the ratio
      (``epsilon_high=None`` means ``epsilon``, as in TRL);
    * ``beta``: the k3 KL coefficient (0 = no reference model);
    * ``loss_type``: ``"grpo"`` (mean over each sequence's tokens, then over sequences), ``"bnpo"`` (sum over
      the batch's completion tokens / their count), ``"dr_grpo"`` (sum / (sequences x max_completion_length));
    * ``scale_rewards``: ``"group"`` (divide by the group std + 1e-4; ``True`` is accepted for it), ``"batch"``
      (the batch std), ``"none"`` (``False``; Dr. GRPO);
    * ``num_iterations`` mu: optimiser passes over each rollout batch;
    * ``temperature``: the sampling temperature, also dividing the logits of every log-probability, as TRL does;
    * ``max_completion_length``: new tokens per completion; ``max_grad_norm``: clipping (None: none);
    * ``reward_weights``: one weight per reward function (None: all 1).
    """

    num_generations: int = 8
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    loss_type: str = "bnpo"
    scale_rewards: Any = "group"
    num_iterations: int = 1
    temperature: float = 1.0
    max_completion_length: int = 512
    max_grad_norm: float | None = 1.0
    reward_weights: tuple[float, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("GRPOConfig.num_generations", self.num_generations, 2)  # the group std needs two
        check_positive("GRPOConfig.epsilon", self.epsilon)
        check_positive("GRPOConfig.epsilon_high", self.epsilon_high, allow_none=True)
        if self.epsilon >= 1:
            raise ValueError(f"GRPOConfig.epsilon must be in (0, 1) (the lower clip 1 - epsilon must stay "
                             f"positive), got {self.epsilon}")
        check_number("GRPOConfig.beta", self.beta, 0.0)
        check_choice("GRPOConfig.loss_type", self.loss_type, LOSS_TYPES)
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards) \
            if isinstance(self.scale_rewards, bool) else self.scale_rewards
        check_choice("GRPOConfig.scale_rewards", scale, SCALE_REWARDS)
        object.__setattr__(self, "scale_rewards", scale)
        check_int("GRPOConfig.num_iterations", self.num_iterations, 1)
        check_positive("GRPOConfig.temperature", self.temperature)
        check_int("GRPOConfig.max_completion_length", self.max_completion_length, 1)
        check_positive("GRPOConfig.max_grad_norm", self.max_grad_norm, allow_none=True)
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (tuple, list)) or not self.reward_weights:
                raise ValueError(f"GRPOConfig.reward_weights must be a non-empty tuple of numbers or None, got "
                                 f"{self.reward_weights!r}")
            object.__setattr__(self, "reward_weights", tuple(
                check_number(f"GRPOConfig.reward_weights[{i}]", w) for i, w in enumerate(self.reward_weights)))
        check_int("GRPOConfig.seed", self.seed, 0)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class AdvantageReweighting:
    """Advantage Reweighting (AR): ``A'_{i,t} = [alpha * pi_old(o_{i,t}) + (1 - alpha)] * A_{i,t}``.

    ``pi_old`` is the rollout policy's probability of the sampled token (a constant); ``alpha`` in [0, 1]
    (paper default 0.3; 0 recovers GRPO exactly). ``positive_only`` reweights only positive advantages
    (the paper code's ablation).
    """

    alpha: float = 0.3
    positive_only: bool = False

    def __post_init__(self) -> None:
        check_unit("AdvantageReweighting.alpha", self.alpha)
        check_bool("AdvantageReweighting.positive_only", self.positive_only)

    def reweight(self, advantages: Any, logp_old: Any) -> Any:
        """``(B, T)`` reweighted advantages from ``(B, 1)`` or ``(B, T)`` advantages and ``(B, T)`` ``logp_old``."""
        from rankwise.train.lopti.loss import reweight_advantages

        return reweight_advantages(advantages, logp_old, self.alpha, self.positive_only)


@dataclass(frozen=True)
class Lopti:
    """Low-probability token isolation: update on the low-probability tokens, then on the others.

    ``eta``: the threshold on ``pi_old`` (paper default 0.5): a completion token is *low* when
    ``pi_old < eta`` (``eta = 1``: every token is low; ``eta = 0``: none). With ``quantile=True`` the
    threshold is the ``eta``-quantile of the batch's valid token probabilities (the official code's
    ``seperate_portion``). ``order``: ``"low_first"`` (the paper) or ``"high_first"`` (the ablation).
    """

    eta: float = 0.5
    order: str = "low_first"
    quantile: bool = False

    def __post_init__(self) -> None:
        check_unit("Lopti.eta", self.eta)
        check_choice("Lopti.order", self.order, ORDERS)
        check_bool("Lopti.quantile", self.quantile)

    def stages(self, logp_old: Any, mask: Any) -> list[tuple[str, Any]]:
        """``[(name, stage_mask), ...]`` in update order, each a ``(B, T)`` 0/1 mask inside ``mask``."""
        from rankwise.train.lopti.loss import lopti_masks

        low, high = lopti_masks(logp_old, mask, self.eta, self.quantile)
        pair = [("low", low), ("high", high)]
        return pair if self.order == "low_first" else pair[::-1]
