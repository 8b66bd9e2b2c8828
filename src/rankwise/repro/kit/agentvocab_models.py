"""AgentVocab's stage-1 checkpoint: the zoo's tiny LM taught tool calling with its own tokenizer, cached.

Recipe (:data:`RECIPES`, deterministic):

1. ``zoo.tiny_lm(recipe.lm)`` and its byte-level BPE tokenizer; the hermes template's markers
   (``<|im_start|>``, ``<tool_call>``, ...) become single added tokens with mean-initialised rows
   (:func:`rankwise.infer.agentvocab.add_markers`: the template set-up every arm shares, as a chat
   tokenizer has them);
2. data: the first ``n_train`` trajectories of ``zoo.agent_traces`` seed 0, rendered by the template;
3. stage 1: full fine-tuning (:func:`rankwise.infer.agentvocab.sft_train`) for ``steps`` batches of
   ``batch_size`` trajectories, loss on the assistant turns only, learning rate ``lr``, seed 0.

Files: ``cache_dir()/agentvocab/<recipe>-<hash>/`` (``save_pretrained`` model and tokenizer plus
``agentvocab_stage1.json``), written atomically; the hash covers the recipe, the tiny LM's folder name, a
fingerprint of the trace generator (its first 8 trajectories) and the torch/transformers major.minor versions. Reproductions only load it (``rankwise zoo build`` builds it).

The trained arms (:data:`ARM_RECIPES`): from the stage-1 checkpoint, the seed-independent vocabulary
(:func:`mined_vocab`, mining on the first ``n_train`` trajectories: structural n-grams; content candidates
ranked by the stage-1 model's embedding gradients on ``grad_samples`` sequences; the reachable top
``structural_budget`` + ``content_budget`` (mixed) and top ``structural_only_budget`` structural tokens, the
tokenizer-only contrast) in ``cache_dir()/agentvocab/vocab-<recipe>-<hash>.json``; then stage 2 with the same
budget and seed for both arms, **vanilla** (T0) and **agentvocab** (mean-initialised rows for the mixed tokens),
one artefact per seed and arm: ``cache_dir()/agentvocab/arm-<recipe>-s<seed>-<arm>-<hash>/``
(``save_pretrained`` model and tokenizer plus ``agentvocab_arm.json``: losses and build times). The hash
covers the recipe and the stage-1 folder name. ``rankwise zoo build`` builds the recipes of :data:`BUILD_SETS`;
a reproduction asked for other settings builds them on first use.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ARM_RECIPES", "ARMS", "ArmsRecipe", "BUILD_SETS", "RECIPES", "SIZES", "Stage1Recipe", "arm_path", "build",
           "mined_vocab", "stage1", "stage1_path", "trained_arm", "trained_arms", "vocab_path"]

_INFO = "agentvocab_stage1.json"
_ARMS_INFO = "agentvocab_arm.json"
ARMS = ("vanilla", "agentvocab")


@dataclass(frozen=True)
class Stage1Recipe:
    lm: str  # zoo.tiny_lm size
    n_train: int
    steps: int
    batch_size: int = 8
    lr: float = 2e-3
    max_length: int = 1024
    threads: int = 1
    version: int = 1


RECIPES: dict[str, Stage1Recipe] = {
    "smoke": Stage1Recipe(lm="smoke", n_train=200, steps=10, batch_size=2, max_length=512),
    "small": Stage1Recipe(lm="gqa", n_train=5000, steps=300),
}


def stage1_path(name: str = "small") -> Path:
    import torch
    import transformers

    from rankwise.zoo import cache_dir, tiny_lm_path

    if name not in RECIPES:
        raise ValueError(f"unknown AgentVocab stage-1 recipe {name!r}; choose from {list(RECIPES)}")
    r = RECIPES[name]
    mm = lambda v: ".".join(v.split("+")[0].split(".")[:2])  # noqa: E731
    from rankwise.zoo.agent_traces import agent_traces

    sample = hashlib.sha256(json.dumps(agent_traces(8, 0), sort_keys=True).encode()).hexdigest()[:12]
    key = {"recipe": asdict(r), "lm": tiny_lm_path(r.lm).name, "traces": sample, "torch": mm(torch.__version__),
           "transformers": mm(transformers.__version__)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "agentvocab" / f"{name}-{digest}"


def _build(name: str, path: Path) -> dict[str, Any]:
    from rankwise.core.io import atomic_dir
    from rankwise.infer.agentvocab import MARKERS, add_markers, render_corpus, sft_train
    from rankwise.zoo import tiny_lm
    from rankwise.zoo.agent_traces import agent_traces
    from rankwise.zoo.models import build_threads, quiet_transformers

    r = RECIPES[name]
    t0, cpu0 = time.perf_counter(), time.process_time()
    with build_threads(r.threads):
        model, tok = tiny_lm(r.lm)
        tok, added = add_markers(model, tok, MARKERS)
        rendered, _ = render_corpus(agent_traces(r.n_train, 0))
        losses = sft_train(model, tok, rendered, steps=r.steps, lr=r.lr, batch_size=r.batch_size,
                           max_length=r.max_length, seed=0)
    info = {"recipe": name, **asdict(r), "markers_added": added, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "first_loss": losses[0] if losses else None, "build_s": time.perf_counter() - t0,
            "build_cpu_s": time.process_time() - cpu0}
    with atomic_dir(path, overwrite=True) as tmp:
        with quiet_transformers():
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
        (tmp / _INFO).write_text(json.dumps(info, indent=2))
    return info


def stage1(name: str = "small", rebuild: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)`` of the cached stage-1 checkpoint (built on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise.zoo.models import quiet_transformers

    path = stage1_path(name)
    if rebuild or not (path / _INFO).is_file():
        _build(name, path)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.eval(), tok, json.loads((path / _INFO).read_text())


@dataclass(frozen=True)
class ArmsRecipe:
    """Stage 2 of both arms and the mined vocabularies (what the reproduction's settings fix)."""

    stage1: str = "small"
    n_train: int = 5000
    steps: int = 600
    batch_size: int = 8
    lr: float = 1e-3
    max_length: int = 1024
    structural_budget: int = 96
    content_budget: int = 32
    structural_only_budget: int = 128
    min_freq: int = 10
    grad_samples: int = 200
    threads: int = 1
    version: int = 1


ARM_RECIPES: dict[str, ArmsRecipe] = {
    "smoke": ArmsRecipe(stage1="smoke", n_train=60, steps=2, batch_size=2, max_length=512, structural_budget=12,
                        content_budget=4, structural_only_budget=16, min_freq=5, grad_samples=4),
    # the reproduction's quick mode (seed 0) and full mode (seeds 0-2)
    "quick": ArmsRecipe(n_train=1000, steps=300, batch_size=4, structural_budget=48, content_budget=16,
                        structural_only_budget=64, grad_samples=64),
    "full": ArmsRecipe(),
}

#: what ``rankwise zoo build --size S`` builds: the stage-1 recipe of that size, then these (arm recipe, seeds)
BUILD_SETS: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {
    "smoke": (("smoke", (0,)),),
    "small": (("quick", (0,)),),
    # full mode's arms (about 75 CPU minutes cold): `rankwise zoo build --size full`, or built on the first --full run
    "full": (("full", (0, 1, 2)),),
}

#: the ``--size`` values :func:`build` accepts (``full`` uses the ``small`` stage-1 checkpoint)
SIZES: tuple[str, ...] = ("smoke", "small", "full")


def _digest(recipe: ArmsRecipe) -> str:
    key = {"recipe": asdict(recipe), "stage1": stage1_path(recipe.stage1).name}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _tag(recipe: ArmsRecipe) -> str:
    return next((n for n, r in ARM_RECIPES.items() if r == recipe), "custom")


def vocab_path(recipe: ArmsRecipe) -> Path:
    from rankwise.zoo import cache_dir

    return cache_dir() / "agentvocab" / f"vocab-{_tag(recipe)}-{_digest(recipe)}.json"


def arm_path(recipe: ArmsRecipe, seed: int, arm: str) -> Path:
    from rankwise.zoo import cache_dir

    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    return cache_dir() / "agentvocab" / f"arm-{_tag(recipe)}-s{seed}-{arm}-{_digest(recipe)}"


def _candidate_json(c: Any) -> dict[str, Any]:
    return {"text": c.text, "stream": c.stream, "score": c.score, "freq": c.freq}


def _mean_init_error(model: Any, base: Any, tok0: Any, texts: list[str]) -> float:
    from rankwise.infer.agentvocab import subtoken_ids

    w, h = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    w0, h0 = base.get_input_embeddings().weight, base.get_output_embeddings().weight
    err = 0.0
    for j, ids in enumerate(subtoken_ids(tok0, texts)):
        i = len(tok0) + j
        err = max(err, float((w[i] - w0[ids].mean(0)).detach().abs().max()),
                  float((h[i] - h0[ids].mean(0)).detach().abs().max()))
    return err


def _train(recipe: ArmsRecipe) -> list[Any]:
    from rankwise.infer.agentvocab import render_corpus
    from rankwise.zoo.agent_traces import agent_traces

    return render_corpus(agent_traces(recipe.n_train, 0))[0]


def mined_vocab(recipe: ArmsRecipe, rebuild: bool = False) -> dict[str, Any]:
    """The seed-independent vocabulary of ``recipe`` (cached JSON): the mixed tokens, the structural-only
    contrast's tokens (``{"text", "stream", "score", "freq"}`` each) and the candidate counts."""
    from rankwise.core.io import read_json, write_json
    from rankwise.infer.agentvocab import AgentVocab, AgentVocabConfig
    from rankwise.zoo.models import build_threads

    path = vocab_path(recipe)
    if path.is_file() and not rebuild:
        return read_json(path)
    r = recipe
    cpu0 = time.process_time()
    base, tok0, s1 = stage1(r.stage1)
    with build_threads(r.threads):
        train = _train(r)
        av = AgentVocab(tok0, AgentVocabConfig(structural_budget=r.structural_budget, content_budget=r.content_budget,
                                               min_freq=r.min_freq, grad_samples=r.grad_samples))
        cands = av.mine(train, grad_model=base if r.grad_samples else None)
        mixed = av.select_reachable(cands, train)
        struct = av.select_reachable(cands, train, structural_budget=r.structural_only_budget, content_budget=0)
        expanded = copy.deepcopy(base)
        av.expand(expanded, mixed)  # wiring, measured before any training: new rows = subtoken means
        info = {"recipe": asdict(r), "mixed": [_candidate_json(c) for c in mixed],
                "structural_only": [_candidate_json(c) for c in struct],
                "n_candidates": {k: len(v) for k, v in cands.items()},
                "mean_init_error": _mean_init_error(expanded, base, tok0, [c.text for c in mixed]),
                "stage1": {k: s1[k] for k in ("lm", "final_loss", "steps", "n_train")},
                "build_cpu_s": time.process_time() - cpu0}
    write_json(path, info)
    return info


def _build_arm(recipe: ArmsRecipe, seed: int, arm: str, path: Path) -> dict[str, Any]:
    from rankwise.core.io import atomic_dir
    from rankwise.infer.agentvocab import AgentVocab, AgentVocabConfig, sft_train
    from rankwise.zoo.models import build_threads, quiet_transformers

    r = recipe
    t0, cpu0 = time.perf_counter(), time.process_time()
    model, tok, _ = stage1(r.stage1)
    if arm == "agentvocab":
        texts = [c["text"] for c in mined_vocab(r)["mixed"]]
        tok, _ = AgentVocab(tok, AgentVocabConfig()).expand(model, texts)
    with build_threads(r.threads):
        losses = sft_train(model, tok, _train(r), steps=r.steps, lr=r.lr, batch_size=r.batch_size,
                           max_length=r.max_length, seed=seed)
    info = {"recipe": asdict(r), "seed": seed, "arm": arm, "first_loss": losses[0] if losses else None,
            "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "build_s": time.perf_counter() - t0,
            "build_cpu_s": time.process_time() - cpu0}
    with atomic_dir(path, overwrite=True) as tmp:
        with quiet_transformers():
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
        (tmp / _ARMS_INFO).write_text(json.dumps(info, indent=2))
    return info


def trained_arm(recipe: ArmsRecipe, seed: int, arm: str, rebuild: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)`` of one cached stage-2 arm (built on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise.zoo.models import quiet_transformers

    path = arm_path(recipe, seed, arm)
    if rebuild or not (path / _ARMS_INFO).is_file():
        _build_arm(recipe, seed, arm, path)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.eval(), tok, json.loads((path / _ARMS_INFO).read_text())


def trained_arms(recipe: ArmsRecipe, seed: int) -> dict[str, Any]:
    """``{"vanilla": (model, tok), "agentvocab": (model, tok), "info": {...}}`` for ``recipe`` and ``seed``:
    ``info`` is the mined vocabulary (:func:`mined_vocab`) plus ``info["arms"][arm]`` (losses, build times)."""
    info = dict(mined_vocab(recipe), arms={})
    out: dict[str, Any] = {"info": info}
    for arm in ARMS:
        model, tok, arm_info = trained_arm(recipe, seed, arm)
        out[arm] = (model, tok)
        info["arms"][arm] = arm_info
    return out


def build(force: bool = False, size: str = "small") -> dict[str, Any]:
    """Build (or check) the stage-1 checkpoint of ``size`` and the arm recipes of ``BUILD_SETS[size]``;
    what ``rankwise zoo build`` calls. Returns ``{"stage1": info, "arms-<recipe>-s<seed>": {...}}``."""
    stage = "small" if size == "full" else size
    path = stage1_path(stage)
    if force or not (path / _INFO).is_file():
        out: dict[str, Any] = {"stage1": _build(stage, path)}
    else:
        out = {"stage1": json.loads((path / _INFO).read_text())}
    for name, seeds in BUILD_SETS.get(size, ()):
        recipe = ARM_RECIPES[name]
        mined_vocab(recipe, rebuild=force)
        for seed in seeds:
            for arm in ARMS:
                p = arm_path(recipe, seed, arm)
                built = force or not (p / _ARMS_INFO).is_file()
                info = _build_arm(recipe, seed, arm, p) if built else json.loads((p / _ARMS_INFO).read_text())
                out[f"{name}-s{seed}-{arm}"] = {"built_now": built, "final_loss": info["final_loss"],
                                                "build_cpu_s": info["build_cpu_s"]}
    return out
