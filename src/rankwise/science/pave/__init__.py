"""PAVE: parameter-vector specifications for identifying helpful models (learnwares).

Paper: "A Study on PAVE Specification for Learnware" (ICLR 2026, OpenReview JkKkquv5lw; spec
``shared/methods/pave.md``). A data set is described by the change ``tau`` it induces in a shared
pre-trained model: a LoRA adapter whose A matrices are one frozen random projection shared by everyone
(seeded), fine-tuned B-only on the data; ``tau = vec(B)`` (plus a small head) is the spec, well below 1 %
of the model. A user computes the spec of their own few labelled examples and picks the learnware whose
spec has the highest cosine similarity; the score ``100 * sigmoid(cos / 0.1)`` lets them apply a threshold.

Layout: :mod:`.config` (:class:`PaveConfig`), :mod:`.method` (:func:`pave_spec`, :func:`spec_from_inputs`,
:func:`shared_a`, :func:`l1_penalty`), :mod:`.spec` (:class:`PaveSpec`, the safetensors file,
:func:`check_comparable`), :mod:`.prefix` (:class:`TopEncoder`: specs of the top layers on cached
lower-layer outputs), :mod:`.identify` (:func:`identify`, :func:`cosine`, :func:`score`, the trace
formula), :mod:`.rkme` (the RKME baseline through learnware's ``RKMETableSpecification``).

Example::

    from rankwise.science.pave import PaveConfig, pave_spec, identify
    cfg = PaveConfig(steps=100, num_labels=2)
    lw = {name: pave_spec(model, tok, texts, labels, cfg) for name, (texts, labels) in dev_sets.items()}
    user = pave_spec(model, tok, my_texts, my_labels, cfg)
    ranking = identify(user, lw)          # Identification: matches (name, cosine, score, distance), best first
    user.save("me.pave.safetensors")      # metadata: base-model fingerprint and config
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.science.pave.config import BACKENDS, L1_KINDS, SCHEDULES, SPACE_FIELDS, PaveConfig
from rankwise.science.pave.identify import (
    Identification,
    Match,
    cosine,
    delta_cosine,
    delta_inner,
    distance,
    identify,
    score,
    trace_inner,
)
from rankwise.science.pave.method import (
    SpecFit,
    fit_spec,
    l1_penalty,
    lr_factor,
    pave_spec,
    select_targets,
    shared_a,
    spec_from_inputs,
)
from rankwise.science.pave.prefix import TopEncoder
from rankwise.science.pave.rkme import RKMESpec, rkme_data_mmd, rkme_identify, rkme_mmd, rkme_spec
from rankwise.science.pave.spec import SPEC_KIND, PaveSpec, check_comparable

__all__ = [
    "BACKENDS",
    "L1_KINDS",
    "SCHEDULES",
    "SPACE_FIELDS",
    "SPEC_KIND",
    "Identification",
    "Match",
    "PaveConfig",
    "PaveSpec",
    "RKMESpec",
    "SpecFit",
    "TopEncoder",
    "check_comparable",
    "cosine",
    "delta_cosine",
    "delta_inner",
    "distance",
    "fit_spec",
    "identify",
    "l1_penalty",
    "lr_factor",
    "pave_spec",
    "rkme_data_mmd",
    "rkme_identify",
    "rkme_mmd",
    "rkme_spec",
    "score",
    "select_targets",
    "shared_a",
    "spec_from_inputs",
    "trace_inner",
]

register("pave", config=PaveConfig, entry=pave_spec)
