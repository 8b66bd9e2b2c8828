"""AgentVocab's configuration (spec defaults; every field validated)."""

from __future__ import annotations

from dataclasses import dataclass

from rankwise.core.validate import check_choice, check_int

__all__ = ["AgentVocabConfig"]


@dataclass(frozen=True)
class AgentVocabConfig:
    """What AgentVocab mines and adds.

    Attributes:
        structural_budget: structural tokens kept after the reachability filter (paper: 200-1000).
        content_budget: content tokens kept (paper: 100-800).
        min_freq: minimum corpus frequency of a candidate (paper: 10).
        max_subwords: at most this many T0 subwords per content candidate (paper: 4).
        max_candidates: candidates scored per stream (paper: 10 000).
        max_structural_chars: longest structural candidate, in characters (a choice).
        init: ``"mean"`` (the paper: the mean of the T0 subtoken rows) or ``"random"`` (a contrast).
        grad_samples: rendered sequences whose embedding gradients rank the content candidates (paper: 1000).
        grad_max_length: tokens per gradient sequence (paper: 4096).
        template: the agent template (``"hermes"``).
    """

    structural_budget: int = 96
    content_budget: int = 32
    min_freq: int = 10
    max_subwords: int = 4
    max_candidates: int = 10_000
    max_structural_chars: int = 64
    init: str = "mean"
    grad_samples: int = 1000
    grad_max_length: int = 4096
    template: str = "hermes"

    def __post_init__(self) -> None:
        check_int("AgentVocabConfig.structural_budget", self.structural_budget, 0)
        check_int("AgentVocabConfig.content_budget", self.content_budget, 0)
        check_int("AgentVocabConfig.min_freq", self.min_freq, 1)
        check_int("AgentVocabConfig.max_subwords", self.max_subwords, 2)
        check_int("AgentVocabConfig.max_candidates", self.max_candidates, 1)
        check_int("AgentVocabConfig.max_structural_chars", self.max_structural_chars, 2)
        check_choice("AgentVocabConfig.init", self.init, ("mean", "random"))
        check_int("AgentVocabConfig.grad_samples", self.grad_samples, 0)
        check_int("AgentVocabConfig.grad_max_length", self.grad_max_length, 8)
        check_choice("AgentVocabConfig.template", self.template, ("hermes",))
