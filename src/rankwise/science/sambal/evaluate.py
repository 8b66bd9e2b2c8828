"""Minimal-pair evaluation of a causal LM, BLiMP's jsonl format in and out.

A pair is scored by the sum of the token log-probabilities of each full sentence (conditioned on a
prefix: the tokenizer's BOS token, else its EOS token, the document separator of the training stream).
The pair is correct (1) when the good member scores higher, wrong (0) when lower, and counts half
(0.5) on an exact tie, so a model that assigns equal log-probabilities is at 0.5. Members of unequal
token length are allowed (the sum is still compared) but flagged. BLiMP's fields are read and kept:
``sentence_good``, ``sentence_bad``, ``UID`` (the phenomenon), ``field``, ``pairID``; each output
record adds ``logprob_good``, ``logprob_bad``, ``score`` and ``unequal_length``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from rankwise.core.errors import NumericalError
from rankwise.core.io import atomic_write_text

__all__ = ["MinimalPair", "MinimalPairResult", "minimal_pair_accuracy", "read_pairs", "sentence_logprobs",
           "write_pairs"]


@dataclass(frozen=True)
class MinimalPair:
    """One minimal pair (BLiMP fields: ``sentence_good``, ``sentence_bad``, ``UID``, ``field``, ``pairID``)."""

    good: str
    bad: str
    uid: str = ""
    field: str = ""
    pair_id: int | str = 0
    extra: dict[str, Any] | None = None  # other fields of the record, kept on output

    def __post_init__(self) -> None:
        for name in ("good", "bad"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise ValueError(f"MinimalPair.{name} must be a str, got {type(v).__name__} (pair {self.pair_id})")
            if not v.strip():
                raise ValueError(f"MinimalPair.{name} is an empty sentence (pair {self.pair_id})")
        if self.good.split() == self.bad.split():
            raise ValueError(f"MinimalPair members are identical: {self.good!r} (pair {self.pair_id})")

    def to_json(self) -> dict[str, Any]:
        d = dict(self.extra or {})
        d.update({"sentence_good": self.good, "sentence_bad": self.bad, "UID": self.uid, "field": self.field,
                  "pairID": self.pair_id})
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "MinimalPair":
        if not isinstance(d, dict) or "sentence_good" not in d or "sentence_bad" not in d:
            raise ValueError(f"a BLiMP record needs sentence_good and sentence_bad, got {str(d)[:80]!r}")
        extra = {k: v for k, v in d.items() if k not in ("sentence_good", "sentence_bad", "UID", "field", "pairID")}
        return cls(d["sentence_good"], d["sentence_bad"], uid=str(d.get("UID", "")), field=str(d.get("field", "")),
                   pair_id=d.get("pairID", 0), extra=extra or None)


def read_pairs(path: str | Path) -> list[MinimalPair]:
    """Minimal pairs from a BLiMP-format jsonl file (one JSON object per line; blank lines skipped)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no minimal-pair file at {p}")
    out = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not JSON ({e.msg})") from None
        try:
            out.append(MinimalPair.from_json(d))
        except ValueError as e:
            raise ValueError(f"{p}:{i}: {e}") from None
    if not out:
        raise ValueError(f"{p}: no minimal pairs")
    return out


def write_pairs(path: str | Path, records: Iterable[MinimalPair | dict[str, Any]]) -> Path:
    """Write pairs (or scored records) as BLiMP-format jsonl, atomically."""
    lines = [json.dumps(r.to_json() if isinstance(r, MinimalPair) else r, sort_keys=True) for r in records]
    return atomic_write_text(path, "".join(line + "\n" for line in lines))


@dataclass
class MinimalPairResult:
    """``accuracy`` (ties half), ``scores`` (1 / 0.5 / 0 per pair, in input order), ``ties``, ``unequal_length``
    (flagged pairs), ``by_uid`` (accuracy per phenomenon) and ``records`` (the scored BLiMP records)."""

    accuracy: float
    scores: list[float]
    ties: int
    unequal_length: int
    by_uid: dict[str, float] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.scores)


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    if callable(tokenizer) and not hasattr(tokenizer, "convert_tokens_to_ids"):
        ids = [list(tokenizer(t)) for t in texts]
    else:
        ids = list(tokenizer(list(texts), add_special_tokens=False)["input_ids"])
    for t, x in zip(texts, ids):
        if not x:
            raise ValueError(f"the tokenizer gives no tokens for {t!r}")
    return ids


def _prefix(tokenizer: Any, prefix_ids: Sequence[int] | None) -> list[int]:
    if prefix_ids is not None:
        return [int(i) for i in prefix_ids]
    for name in ("bos_token_id", "eos_token_id"):
        i = getattr(tokenizer, name, None)
        if i is not None:
            return [int(i)]
    raise ValueError("minimal_pair_accuracy: the tokenizer has no BOS/EOS token; pass prefix_ids")


@torch.no_grad()
def sentence_logprobs(model: Any, ids: Sequence[Sequence[int]], prefix: Sequence[int], batch_size: int = 64) -> list[float]:
    """Sum of ``log p(token | prefix, earlier tokens)`` over each sequence's tokens (float64)."""
    if not prefix:
        raise ValueError("sentence_logprobs needs a non-empty prefix (the first token must have a context)")
    out: list[float] = []
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        dev = next(model.parameters()).device if hasattr(model, "parameters") else torch.device("cpu")
    except StopIteration:
        dev = torch.device("cpu")
    try:
        for i in range(0, len(ids), batch_size):
            chunk = [list(prefix) + list(x) for x in ids[i:i + batch_size]]
            T = max(len(c) for c in chunk)
            inp = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T, dtype=torch.long)
            for r, c in enumerate(chunk):
                inp[r, :len(c)] = torch.tensor(c)
                mask[r, :len(c)] = 1
            logits = model(input_ids=inp.to(dev), attention_mask=mask.to(dev)).logits.double()
            if not torch.isfinite(logits).all():
                raise NumericalError("minimal_pair_accuracy: the model returned non-finite logits")
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, inp[:, 1:, None].to(dev))[..., 0]
            keep = mask[:, 1:].to(dev).clone()
            keep[:, : len(prefix) - 1] = 0
            out.extend((lp * keep).sum(1).tolist())
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return out


def minimal_pair_accuracy(model: Any, tokenizer: Any, pairs: Sequence[MinimalPair] | str | Path, *,
                          prefix_ids: Sequence[int] | None = None, batch_size: int = 64,
                          out: str | Path | None = None) -> MinimalPairResult:
    """Share of pairs whose good member has the higher summed log-probability (ties count half).

    ``model(input_ids=..., attention_mask=...)`` returns ``.logits`` (a Hugging Face causal LM);
    ``tokenizer`` is a Hugging Face tokenizer (called with ``add_special_tokens=False``) or a callable
    ``text -> token ids``; ``pairs`` a list of :class:`MinimalPair` or a BLiMP jsonl path. ``out``: write
    the scored records there as jsonl.
    """
    if isinstance(pairs, (str, Path)):
        pairs = read_pairs(pairs)
    pairs = list(pairs)
    if not pairs:
        raise ValueError("minimal_pair_accuracy: no pairs")
    for p in pairs:
        if not isinstance(p, MinimalPair):
            raise TypeError(f"minimal_pair_accuracy: pairs must be MinimalPair objects, got {type(p).__name__}")
    prefix = _prefix(tokenizer, prefix_ids)
    good = _encode(tokenizer, [p.good for p in pairs])
    bad = _encode(tokenizer, [p.bad for p in pairs])
    lp = sentence_logprobs(model, good + bad, prefix, batch_size)
    lg, lb = lp[: len(pairs)], lp[len(pairs):]
    scores, records, ties, unequal = [], [], 0, 0
    by: dict[str, list[float]] = {}
    for p, g, b, ig, ib in zip(pairs, lg, lb, good, bad):
        if not (math.isfinite(g) and math.isfinite(b)):
            raise NumericalError(f"minimal_pair_accuracy: non-finite log-probability for pair {p.pair_id}")
        s = 1.0 if g > b else (0.0 if g < b else 0.5)
        ties += s == 0.5
        uneq = len(ig) != len(ib)
        unequal += uneq
        scores.append(s)
        by.setdefault(p.uid, []).append(s)
        records.append({**p.to_json(), "logprob_good": g, "logprob_bad": b, "score": s, "unequal_length": uneq})
    res = MinimalPairResult(sum(scores) / len(scores), scores, ties, unequal,
                            {k: sum(v) / len(v) for k, v in sorted(by.items())}, records)
    if out is not None:
        write_pairs(out, records)
    return res
