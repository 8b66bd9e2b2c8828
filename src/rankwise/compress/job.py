"""The work behind ``rankwise compress``, as a library function: compress a model on texts and measure the cost.

:func:`compress_texts` takes a model, its tokenizer and calibration / evaluation texts; it compresses
the model in place with any method config, measures the embedding fidelity on the evaluation texts
(mean cosine between the compressed and the original model's mean-pooled embeddings) and the
forward-time ratio, optionally saves the result, and returns a :class:`CompressJobResult`. Where the
model, the texts and the task loss come from (a model directory, the embedded all-MiniLM-L6-v2, text
files, the embedded corpus) is the caller's business: ``rankwise.verbs.compress`` resolves them.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.compress.api import compress, forward_time_ratio
from rankwise.compress.base import CompressionReport
from rankwise.compress.config import as_compress_config
from rankwise.compress.serialization import save_compressed
from rankwise.core.errors import RankwiseError
from rankwise.core.textfiles import tokenize_batches
from rankwise.core.validate import check_int

__all__ = ["CompressJobResult", "CommandResult", "compress_texts", "mean_cosine", "save_with_tokenizer"]


@dataclass
class CompressJobResult:
    """What ``rankwise compress`` prints: the report, fidelity, parameters, speed, where it was saved.

    ``model`` and ``calib_source`` are labels the caller sets (what the model and the texts were).
    """

    report: CompressionReport
    method: str
    n_calib: int
    n_eval: int
    fidelity: float | None
    speed: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    model: str = ""
    calib_source: str = ""

    def rows(self) -> list[dict[str, Any]]:
        """One row per compressed layer: name, shape, rank, parameters before/after, error, seconds."""
        return [{"layer": l.name, "shape": f"{l.shape[0]}x{l.shape[1]}", "rank": l.rank,
                 "params_before": l.params_before, "params_after": l.params_after,
                 "rel_error": l.rel_error, "seconds": l.seconds} for l in self.report.layers]


#: The former name (``rankwise.compress.command.CommandResult``).
CommandResult = CompressJobResult


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of two embedding matrices."""
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).mean())


def save_with_tokenizer(model: nn.Module, out: str | Path, report: CompressionReport, tokenizer: Any, *,
                        overwrite: bool = False) -> tuple[Path, list[str]]:
    """Save the compressed model (:func:`~rankwise.compress.serialization.save_compressed`) and its tokenizer.

    Returns the directory and notes. The one place this module writes a model directory. The tokenizer is
    written inside the directory before it is renamed into place (a killed run never leaves a model
    without its tokenizer); one that cannot be saved fails the save, leaving nothing.
    """
    return save_compressed(model, out, report, overwrite=overwrite, tokenizer=tokenizer), []


def _pair_batches(tokenizer: Any, texts: Sequence[str], batch_size: int, max_length: int) -> list[dict[str, Any]]:
    """Text ``i`` and text ``i + n/2`` are a positive pair: batches ``[a_1..a_k, b_1..b_k]`` of ``k = batch_size/2``."""
    half = len(texts) // 2
    a, b = texts[:half], texts[half:2 * half]
    step = max(1, batch_size // 2)
    out: list[dict[str, Any]] = []
    for i in range(0, half, step):
        out += tokenize_batches(tokenizer, list(a[i:i + step]) + list(b[i:i + step]), 2 * step, max_length)
    return out


def compress_texts(
    model: nn.Module,
    tokenizer: Any,
    config: Any,
    calib_texts: Sequence[str],
    eval_texts: Sequence[str],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    pairs: bool = False,
    mode: str = "auto",
    max_length: int = 64,
    batch_size: int = 16,
    out: str | Path | None = None,
    overwrite: bool = False,
    measure_speed: bool = True,
    progress: bool = False,
) -> CompressJobResult:
    """Compress ``model`` in place on ``calib_texts``; measure fidelity on ``eval_texts`` and speed; save.

    Args:
        model, tokenizer: a Hugging Face model whose output has ``last_hidden_state`` (or hidden states)
            and its tokenizer (with a padding token).
        config: a method config (``SwiftSVDConfig(...)``, ...) or a ``CompressConfig``.
        calib_texts, eval_texts: calibration texts (at least 2) and held-out texts (at least 1).
        loss_fn: the task loss of gradient-based methods (FWSVD, GFWSVD), ``loss(output, batch)``;
            required for them (e.g. ``rankwise.train.losses.task_loss_for(model)``).
        pairs: the loss reads positive pairs: text ``i`` and text ``i + n/2`` of ``calib_texts`` are
            batched together as ``[a_1..a_k, b_1..b_k]`` (the contrastive loss); only with ``loss_fn``.
        mode: ``auto`` / ``whole`` / ``blocks`` (see :func:`rankwise.compress.compress`).
        max_length, batch_size: tokenisation and batching.
        out: save the compressed model and the tokenizer there (atomically); None = do not save.
        measure_speed: time the original and the compressed model (keeps a copy of the original).
    """
    t0 = time.perf_counter()
    check_int("max_length", max_length, 4)
    check_int("batch_size", batch_size, 2)
    if len(calib_texts) < 2:
        raise ValueError(f"need at least 2 calibration texts, got {len(calib_texts)}")
    if len(eval_texts) < 1:
        raise ValueError("need at least 1 evaluation text")
    cfg = as_compress_config(config)
    cls = cfg.method_class
    if cls.needs_grad and loss_fn is None:
        raise ValueError(f"method {cls.name!r} needs a task loss for its gradients: pass loss_fn(output, batch)")
    if pairs and cls.needs_grad:
        batches = _pair_batches(tokenizer, calib_texts, batch_size, max_length)
    else:
        batches = tokenize_batches(tokenizer, calib_texts, batch_size, max_length)
    eval_batches = tokenize_batches(tokenizer, eval_texts, 32, max_length)

    original = copy.deepcopy(model) if measure_speed else None
    ref = _embed(model, eval_batches)
    report = compress(model, config, calib=batches, mode=mode, loss_fn=loss_fn if cls.needs_grad else None,
                      progress=progress)
    fidelity = mean_cosine(_embed(model, eval_batches), ref)
    speed: dict[str, float] = {}
    if original is not None:
        speed = forward_time_ratio(original, model, eval_batches[:4], repeats=3)
        del original
    out_dir, notes = None, []
    if out is not None:
        out_dir, notes = save_with_tokenizer(model, out, report, tokenizer, overwrite=overwrite)
    return CompressJobResult(report=report, method=cls.name, n_calib=len(calib_texts), n_eval=len(eval_texts),
                             fidelity=fidelity, speed=speed, out_dir=out_dir, seconds=time.perf_counter() - t0,
                             notes=notes)


@torch.no_grad()
def _embed(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Normalised mean-pooled last hidden states of ``batches`` (eval mode, restored after)."""
    was = model.training
    model.eval()
    try:
        out = []
        for b in batches:
            res = model(**b, output_hidden_states=True)
            h = getattr(res, "last_hidden_state", None)
            h = res.hidden_states[-1] if h is None else h
            m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
            out.append(torch.nn.functional.normalize(((h * m).sum(1) / m.sum(1).clamp_min(1.0)).float(), dim=-1))
    finally:
        model.train(was)
    e = torch.cat(out)
    if not bool(torch.isfinite(e).all()):
        raise RankwiseError("the model produced non-finite embeddings")
    return e
