"""RankTuner (arXiv 2602.01745, ICML 2026): relative-rank token weights for supervised fine-tuning.

The token weight is the inverse relative rank indicator ``S_t = R_t / E[R_t]`` (the label's realised
rank over the rank the model's own distribution expects), clamped, mean-normalised and detached;
the loss is the weighted NLL. Public face:

* :class:`RankTunerConfig`, :class:`RankTunerLoss` (cross-entropy's signature, ``return_stats``);
* :func:`relative_scale` (the weights alone), :func:`rank_stats`, :func:`expected_rank`,
  :func:`realised_rank`;
* baselines: :class:`TokenWeightedLoss` with ``scheme`` in :data:`SCHEMES`, :func:`dft_loss`,
  :func:`one_minus_p_loss`, :func:`entropy_weighted_loss`, :func:`focal_loss`;
* TRL: :func:`trl_loss_func` (``SFTTrainer(compute_loss_func=...)``), :func:`sft_trainer`,
  :func:`sft_config` (TRL imported inside them).

docs/methods/ranktuner.md records the choices the paper leaves open (f, the clamp, the baselines).
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.train.ranktuner.integration import (
    TRL_LOSS_TYPES,
    examples_dataset,
    sft_config,
    sft_trainer,
    trl_loss_func,
)
from rankwise.train.ranktuner.loss import (
    SCHEMES,
    RankStats,
    check_logits_labels,
    expected_rank,
    rank_stats,
    realised_rank,
    relative_scale,
    scheme_scores,
    weighted_nll,
)
from rankwise.train.ranktuner.method import (
    RankTunerConfig,
    RankTunerLoss,
    TokenWeightedLoss,
    dft_loss,
    entropy_weighted_loss,
    focal_loss,
    one_minus_p_loss,
)

__all__ = [
    "SCHEMES",
    "TRL_LOSS_TYPES",
    "RankStats",
    "RankTunerConfig",
    "RankTunerLoss",
    "TokenWeightedLoss",
    "check_logits_labels",
    "dft_loss",
    "entropy_weighted_loss",
    "examples_dataset",
    "expected_rank",
    "focal_loss",
    "one_minus_p_loss",
    "rank_stats",
    "realised_rank",
    "relative_scale",
    "scheme_scores",
    "sft_config",
    "sft_trainer",
    "trl_loss_func",
    "weighted_nll",
]


def _entry(config: RankTunerConfig | None = None, **overrides: object) -> RankTunerLoss:
    return RankTunerLoss(config, **overrides)  # type: ignore[arg-type]


register("ranktuner", config=RankTunerConfig, entry=_entry)
