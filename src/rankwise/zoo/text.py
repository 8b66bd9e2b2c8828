"""Sentences of the embedded docstring corpus (:func:`rankwise.zoo.corpus`), for calibration and evaluation text.

:func:`split_sentences` keeps the prose sentences of a docstring-like text (code examples skipped);
:func:`docstring_sentences` applies it to one split of the corpus; :func:`sentence_pairs` pairs
consecutive sentences of a document (positive pairs for an in-batch contrastive loss).
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from rankwise.zoo.docstrings import corpus

__all__ = ["split_sentences", "docstring_sentences", "sentence_pairs"]

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")


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
    return [ss for ss in (split_sentences(d.text) for d in corpus().split(split)) if ss]


def sentence_pairs(docs: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """Disjoint pairs of consecutive sentences of the same document (``(s0, s1), (s2, s3), ...``)."""
    return [(ss[i], ss[i + 1]) for ss in docs for i in range(0, len(ss) - 1, 2)]
