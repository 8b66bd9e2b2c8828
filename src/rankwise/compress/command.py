"""What ``rankwise compress`` does, as a library function (the CLI verb only parses and prints).

:func:`compress_command` loads a model (a ``save_pretrained`` directory, or the embedded
all-MiniLM-L6-v2), builds calibration batches from a text / JSONL file (or the embedded docstring
corpus), compresses with any registered method, measures the embedding fidelity on held-out text
(mean cosine between the compressed and the original model's mean-pooled embeddings) and the
forward-time ratio, optionally saves the result, and returns a :class:`CommandResult` to print.

The embedded defaults come from :mod:`rankwise.zoo`, imported inside the function (the compression
methods themselves never depend on the zoo). Text helpers (:func:`docstring_sentences`,
:func:`sentence_pairs`, :func:`read_texts`) and the in-batch contrastive loss used as the task loss of
the gradient-based methods on an embedding model (:func:`contrastive_loss`) live here so that the
reproduction uses the same ones.
"""

from __future__ import annotations

import copy
import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from rankwise.compress.base import CompressionReport, layer_methods, resolve_layer_method
from rankwise.core.errors import ArtifactError, RankwiseError, UnknownMethodError

__all__ = ["CommandResult", "compress_command", "METHOD_CHOICES", "docstring_sentences", "sentence_pairs",
           "read_texts", "tokenize_batches", "contrastive_loss", "lm_loss", "mean_cosine"]

#: The methods the CLI advertises (the last two come from their own modules).
METHOD_CHOICES = ("swift-svd", "saes-svd", "gfwsvd", "svd", "asvd", "fwsvd", "svd-llm")

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")


# ----------------------------------------------------------------------------------------------
# text


def _paragraphs(text: str) -> Iterable[str]:
    for para in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "$ ", "% ")) for ln in lines):
            continue  # doctest / shell examples are code, not sentences
        yield " ".join(ln for ln in lines if ln)


def split_sentences(text: str, min_words: int = 5, max_words: int = 40) -> list[str]:
    """Prose sentences of a docstring-like text (code examples skipped; 5-40 words, mostly letters)."""
    out = []
    for p in _paragraphs(text):
        for s in _SENT_SPLIT.split(p):
            s = s.strip()
            if min_words <= len(s.split()) <= max_words and sum(ch.isalpha() for ch in s) > 0.6 * len(s):
                out.append(s)
    return out


def docstring_sentences(split: str) -> list[list[str]]:
    """Sentences of the embedded docstring corpus, one list per docstring, for split ``"calib"`` / ``"eval"`` / ``"train"``."""
    from rankwise import zoo

    return [ss for ss in (split_sentences(d.text) for d in zoo.corpus().split(split)) if ss]


def sentence_pairs(docs: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """Disjoint pairs of consecutive sentences of the same document (``(s0, s1), (s2, s3), ...``)."""
    return [(ss[i], ss[i + 1]) for ss in docs for i in range(0, len(ss) - 1, 2)]


def read_texts(path: str | Path) -> list[str]:
    """Texts of a calibration / evaluation file: ``.jsonl`` (one JSON object with a ``"text"`` field, or a
    JSON string, per line) or plain text (one text per non-empty line)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = p.read_bytes()[:e.start].count(b"\n") + 1
        raise ValueError(f"{p}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out: list[str] = []
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not valid JSON ({e.msg})") from None
            text = obj.get("text") if isinstance(obj, dict) else obj
            if not isinstance(text, str):
                raise ValueError(f"{p}:{i}: expected a JSON string or an object with a 'text' string field")
            if text.strip():
                out.append(text.strip())
    else:
        out = [ln.strip() for ln in lines if ln.strip()]
    if not out:
        raise ValueError(f"{p}: contains no text")
    return out


def tokenize_batches(tokenizer: Any, texts: Sequence[str], batch_size: int = 16, max_length: int = 64
                     ) -> list[dict[str, torch.Tensor]]:
    """``[{"input_ids", "attention_mask"}, ...]`` batches of ``texts`` in order (padded per batch)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


def _pooled(out: Any, mask: torch.Tensor) -> torch.Tensor:
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        hs = getattr(out, "hidden_states", None)
        if hs is None:
            raise ValueError("the model output has neither last_hidden_state nor hidden_states")
        h = hs[-1]
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def contrastive_loss(out: Any, batch: dict[str, torch.Tensor], temperature: float = 0.05) -> torch.Tensor:
    """In-batch contrastive loss of a batch ``[a_1..a_B, b_1..b_B]`` (``a_i``, ``b_i`` a positive pair).

    Cross-entropy over the cosine similarities of the mean-pooled embeddings divided by
    ``temperature`` (0.05), the task loss of FWSVD / GFWSVD on a sentence-embedding model.
    """
    e = torch.nn.functional.normalize(_pooled(out, batch["attention_mask"]).float(), dim=-1)
    B = e.shape[0] // 2
    if B < 1 or e.shape[0] % 2:
        raise ValueError(f"contrastive_loss needs an even batch [anchors, positives], got {e.shape[0]} texts")
    logits = e[:B] @ e[B:].mT / temperature
    return torch.nn.functional.cross_entropy(logits, torch.arange(B, device=logits.device))


def lm_loss(out: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM output on the batch's ``input_ids`` (padding ignored)."""
    logits = out.logits[:, :-1].float()
    labels = batch["input_ids"][:, 1:].clone()
    labels[batch["attention_mask"][:, 1:] == 0] = -100
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of two embedding matrices."""
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).mean())


# ----------------------------------------------------------------------------------------------
# the command


@dataclass
class CommandResult:
    """What ``rankwise compress`` prints: the report, fidelity, parameters, speed, where it was saved."""

    report: CompressionReport
    method: str
    model: str
    calib_source: str
    n_calib: int
    n_eval: int
    fidelity: float | None
    speed: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """One row per compressed layer: name, shape, rank, parameters before/after, error, seconds."""
        return [{"layer": l.name, "shape": f"{l.shape[0]}x{l.shape[1]}", "rank": l.rank,
                 "params_before": l.params_before, "params_after": l.params_after,
                 "rel_error": l.rel_error, "seconds": l.seconds} for l in self.report.layers]


def _available_methods() -> list[str]:
    return sorted(layer_methods())


def _resolve_method(name: str) -> str:
    try:
        return resolve_layer_method(name).name
    except UnknownMethodError:
        known = _available_methods()
        norm = name.strip().lower().replace("_", "-")
        if norm in METHOD_CHOICES:
            raise UnknownMethodError(f"method {name!r} is not available in this installation (its module "
                                     f"rankwise.compress.{norm.replace('-', '_')} is missing or did not register "
                                     f"it); available: {', '.join(known)}") from None
        raise UnknownMethodError(f"unknown method {name!r}; choose one of {', '.join(known)}") from None


def _is_causal_lm(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM") or hasattr(model, "lm_head")


def compress_command(
    method: str,
    ratio: float = 0.4,
    *,
    model_dir: str | Path | None = None,
    calib_file: str | Path | None = None,
    eval_file: str | Path | None = None,
    out: str | Path | None = None,
    mode: str = "auto",
    allocation: str = "uniform",
    n_calib: int = 64,
    n_eval: int = 128,
    max_length: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = False,
    measure_speed: bool = True,
) -> CommandResult:
    """Compress a model and measure what it cost; the work behind ``rankwise compress``.

    Args:
        method: a registered method (``swift-svd``, ``saes-svd``, ``gfwsvd``, ``svd``, ``asvd``, ``fwsvd``,
            ``svd-llm``).
        ratio: kept-parameter fraction of the target layers, in ``(0, 1]``.
        model_dir: a ``save_pretrained`` directory with a tokenizer; default the embedded all-MiniLM-L6-v2.
        calib_file: calibration texts (``.txt``: one per line; ``.jsonl``: ``{"text": ...}`` per line);
            default: sentences of the embedded corpus's calibration split.
        eval_file: held-out texts for the fidelity; default: the corpus's evaluation split (or, with a
            ``calib_file`` and no ``eval_file``, the calibration texts after the first ``n_calib``).
        out: save the compressed model there (atomically); None = do not save.
        mode: ``auto`` / ``whole`` / ``blocks`` (see :func:`rankwise.compress.compress`).
        allocation: ``uniform`` or ``dynamic``.
        n_calib, n_eval: how many texts to use (sampled with ``seed`` from the defaults; the first ones
            of a file).
        max_length, batch_size: tokenisation and batching.
    """
    from rankwise.compress.pipeline import CompressConfig, compress, forward_time_ratio

    t0 = time.perf_counter()
    name = _resolve_method(method)
    for field_name, v, lo in (("n_calib", n_calib, 2), ("n_eval", n_eval, 1), ("max_length", max_length, 4),
                              ("batch_size", batch_size, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{field_name}={v!r} must be an int >= {lo}")
    cfg = CompressConfig(method=name, ratio=ratio, allocation=allocation)
    cls = cfg.method_class
    notes: list[str] = []
    if out is not None:  # an existing or unwritable --out fails now, not after the compression
        from rankwise.compress.serialization import check_output_dir

        check_output_dir(out, overwrite=overwrite)

    # the model
    if model_dir is None:
        from rankwise import zoo

        model, tokenizer = zoo.minilm()
        model_name = "all-MiniLM-L6-v2 (embedded)"
    else:
        model, tokenizer = _load_model(Path(model_dir))
        model_name = str(model_dir)
    causal = _is_causal_lm(model)

    # the texts
    rng = random.Random(seed)
    if calib_file is not None:
        texts = read_texts(calib_file)
        calib_texts = texts[:n_calib]
        calib_source = str(calib_file)
        if eval_file is not None:
            eval_texts = read_texts(eval_file)[:n_eval]
        else:
            eval_texts = texts[n_calib:n_calib + n_eval]
            if not eval_texts:
                eval_texts = calib_texts[:n_eval]
                notes.append("no held-out text: the fidelity is measured on the calibration texts")
    else:
        pairs = sentence_pairs(docstring_sentences("calib"))
        take = rng.sample(pairs, min(len(pairs), max(1, n_calib // 2)))
        calib_texts = [a for a, _ in take] + [b for _, b in take]
        calib_source = "embedded docstring corpus (calib split)"
        if eval_file is not None:
            eval_texts = read_texts(eval_file)[:n_eval]
        else:
            pool = [s for ss in docstring_sentences("eval") for s in ss]
            eval_texts = rng.sample(pool, min(len(pool), n_eval))
    if len(calib_texts) < 2:
        raise ValueError("need at least 2 calibration texts")

    # batches; the gradient methods need a task loss
    loss_fn: Callable | None = None
    if cls.needs_grad:
        if causal:
            loss_fn = lm_loss
            batches = tokenize_batches(tokenizer, calib_texts, batch_size, max_length)
        else:
            loss_fn = contrastive_loss
            half = (len(calib_texts) // 2)
            a, b = calib_texts[:half], calib_texts[half:2 * half]
            batches = []
            step = max(1, batch_size // 2)
            for i in range(0, half, step):
                batches += tokenize_batches(tokenizer, a[i:i + step] + b[i:i + step], 2 * step, max_length)
            notes.append("task loss for the Fisher: in-batch contrastive loss of consecutive sentence pairs "
                         "(temperature 0.05)" if calib_file is None else
                         "task loss for the Fisher: in-batch contrastive loss pairing text i with text i + n/2")
    else:
        batches = tokenize_batches(tokenizer, calib_texts, batch_size, max_length)
    eval_batches = tokenize_batches(tokenizer, eval_texts, 32, max_length)

    # reference embeddings, then compress in place
    original = copy.deepcopy(model) if measure_speed else None
    ref = _embed(model, eval_batches)
    report = compress(model, cfg, calib=batches, mode=mode, loss_fn=loss_fn, progress=progress)
    emb = _embed(model, eval_batches)
    fidelity = mean_cosine(emb, ref)
    speed = {}
    if original is not None:
        speed = forward_time_ratio(original, model, eval_batches[:4], repeats=3)
        del original
    out_dir = None
    if out is not None:
        from rankwise.compress.serialization import save_compressed

        out_dir = save_compressed(model, out, report, overwrite=overwrite, tokenizer=tokenizer)
    return CommandResult(report=report, method=name, model=model_name, calib_source=calib_source,
                         n_calib=len(calib_texts), n_eval=len(eval_texts), fidelity=fidelity, speed=speed,
                         out_dir=out_dir, seconds=time.perf_counter() - t0, notes=notes)


def _load_model(d: Path) -> tuple[nn.Module, Any]:
    from rankwise.compress.model_dir import load_model_dir

    model, tok = load_model_dir(d)  # dense or compressed; weights, config and tokenizer checked
    if getattr(tok, "pad_token", None) is None:
        tok.pad_token = getattr(tok, "eos_token", None) or getattr(tok, "unk_token", None)
        if tok.pad_token is None:
            raise ArtifactError(f"{d}: the tokenizer has no padding, end-of-sequence or unknown token")
    return model.eval(), tok


@torch.no_grad()
def _embed(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    was = model.training
    model.eval()
    try:
        out = []
        for b in batches:
            kw = dict(b)
            res = model(**kw, output_hidden_states=True)
            out.append(torch.nn.functional.normalize(_pooled(res, b["attention_mask"]).float(), dim=-1))
    finally:
        model.train(was)
    e = torch.cat(out)
    if not bool(torch.isfinite(e).all()):
        raise RankwiseError("the model produced non-finite embeddings")
    return e
