"""Safety at One Shot (arXiv 2601.01887, ICLR 2026): realign a harmfully fine-tuned LM with ONE safety example.

A model whose refusals were removed by a fine-tuning attack is patched by a few optimizer steps on a
single (harmful prompt, refusal) pair; the paper explains why one example suffices by the low-rank
structure of the safety gradient, whose top directions oppose the harmful update. Public face:

* :class:`SafetyPatchConfig`, :class:`OneShotSafetyPatch` (select, patch, early stop, restore on NaN,
  ``save`` the auditable delta), :class:`MultiExampleSafetyPatch` (the n-example baseline),
  :func:`apply_delta`, :func:`load_delta`;
* the analysis: :func:`safety_gradient`, :func:`safety_gradient_spectrum` (energy ratios, effective rank
  by ``core.linalg.effective_rank``), :func:`top_subspaces` and :func:`project_update` (the projected
  patch), :func:`gradient_antagonism`.

docs/methods/safety_one_shot.md records the choices the paper leaves open (the selection rule, the
projection of AdamW updates, the stopping rule).
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.train.safety_one_shot.config import SELECTION_RULES, SafetyPatchConfig
from rankwise.train.safety_one_shot.method import (
    DELTA_METHOD,
    MultiExampleSafetyPatch,
    OneShotSafetyPatch,
    PatchResult,
    apply_delta,
    load_delta,
)
from rankwise.train.safety_one_shot.spectrum import (
    DEFAULT_KS,
    LayerSpectrum,
    SafetySpectrum,
    encode_examples,
    energy_ratios,
    example_pair,
    flat_cosine,
    gradient_antagonism,
    gradient_spectrum,
    matrix_parameters,
    project_update,
    safety_gradient,
    safety_gradient_spectrum,
    safety_nll,
    top_subspaces,
)

__all__ = [
    "DEFAULT_KS",
    "DELTA_METHOD",
    "SELECTION_RULES",
    "LayerSpectrum",
    "MultiExampleSafetyPatch",
    "OneShotSafetyPatch",
    "PatchResult",
    "SafetyPatchConfig",
    "SafetySpectrum",
    "apply_delta",
    "encode_examples",
    "energy_ratios",
    "example_pair",
    "flat_cosine",
    "gradient_antagonism",
    "gradient_spectrum",
    "load_delta",
    "matrix_parameters",
    "project_update",
    "safety_gradient",
    "safety_gradient_spectrum",
    "safety_nll",
    "top_subspaces",
]


def _entry(model, tokenizer, config: SafetyPatchConfig | None = None, **overrides: object) -> OneShotSafetyPatch:  # type: ignore[no-untyped-def]
    import dataclasses

    config = SafetyPatchConfig(**overrides) if config is None else dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
    return OneShotSafetyPatch(model, tokenizer, config)


register("safety_one_shot", config=SafetyPatchConfig, entry=_entry)
