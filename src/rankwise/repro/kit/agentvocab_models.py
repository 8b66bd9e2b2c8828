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
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["RECIPES", "Stage1Recipe", "build", "stage1", "stage1_path"]

_INFO = "agentvocab_stage1.json"


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
    "small": Stage1Recipe(lm="small", n_train=5000, steps=300),
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
    import torch

    from rankwise.core.io import atomic_dir
    from rankwise.infer.agentvocab import MARKERS, add_markers, render_corpus, sft_train
    from rankwise.zoo import tiny_lm
    from rankwise.zoo.agent_traces import agent_traces
    from rankwise.zoo.models import quiet_transformers

    r = RECIPES[name]
    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    torch.set_num_threads(r.threads)
    try:
        model, tok = tiny_lm(r.lm)
        tok, added = add_markers(model, tok, MARKERS)
        rendered, _ = render_corpus(agent_traces(r.n_train, 0))
        losses = sft_train(model, tok, rendered, steps=r.steps, lr=r.lr, batch_size=r.batch_size,
                           max_length=r.max_length, seed=0)
    finally:
        torch.set_num_threads(threads)
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


def build(force: bool = False, size: str = "small") -> dict[str, Any]:
    """Build (or check) the stage-1 checkpoint of ``size``; what ``rankwise zoo build`` calls."""
    path = stage1_path(size)
    if force or not (path / _INFO).is_file():
        return _build(size, path)
    return json.loads((path / _INFO).read_text())
