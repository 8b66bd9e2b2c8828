"""Text classification tasks derived from the docstring corpus (:mod:`rankwise.zoo.docstrings`).

Each task maps a docstring to a label. The *text* of an example is the docstring with its
whitespace collapsed, cut at a word boundary to at most :data:`MAX_CHARS` characters (about 40 to
60 WordPiece tokens; a classifier with ``max_length >= 64`` sees all of it). Labels that read the
docstring (``raises``, ``has_example``, ``length``, ...) are computed from the *full* docstring, so
the classifier has to infer them from the beginning, which keeps keyword tasks from being trivial.

Construction, identical for every task:

1. candidates: the corpus documents the task labels (others get ``None``) whose text has at least
   four words; repeated texts are kept once (first in corpus order), so a text never appears twice;
2. split: an example goes to the test set iff ``sha256(text) mod 4 == 0`` (about 25 %): fixed,
   independent of the seed, and identical texts can never straddle the split;
3. balance: within each split every class is cut to the size of the smallest class (and to
   ``max_train // n_classes`` / ``max_test // n_classes`` per class when given). The test set is
   subsampled with a fixed generator (seed 0), the training set with ``seed``, which also sets the
   order of the training examples. So the test set is the same for every seed.

The accuracies a logistic regression on frozen, mean-pooled all-MiniLM-L6-v2 embeddings reaches
(between about 0.65 and 0.93, see docs/zoo.md) show that every task is learnable but not trivial.
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Callable

from rankwise.core.errors import RankwiseError
from rankwise.core.validate import check_int
from rankwise.zoo.docstrings import Document, corpus

__all__ = ["MAX_CHARS", "TASKS", "TextTask", "UnknownTaskError", "snippet", "text_task", "text_task_labels",
           "text_tasks"]

#: Longest example text, in characters.
MAX_CHARS = 240
_MIN_WORDS = 4


class UnknownTaskError(RankwiseError, ValueError):
    """A task name that the zoo does not define."""


@dataclass(frozen=True)
class TextTask:
    """A balanced text classification task.

    ``train`` and ``test`` are lists of ``(text, label)`` with ``label`` an index into ``labels``.
    """

    name: str
    labels: list[str]
    train: list[tuple[str, int]]
    test: list[tuple[str, int]]
    description: str

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def snippet(text: str, max_chars: int = MAX_CHARS) -> str:
    """Whitespace-collapsed ``text`` cut at a word boundary to at most ``max_chars`` characters."""
    flat = " ".join(text.split())
    if len(flat) <= max_chars:
        return flat
    cut = flat[: max_chars + 1].rsplit(" ", 1)[0]
    return cut if cut else flat[:max_chars]


def _name(d: Document) -> str:
    return d.qualname.rsplit(".", 1)[-1]


def _is_dunder(n: str) -> bool:
    return len(n) > 4 and n.startswith("__") and n.endswith("__")


_RAISES = re.compile(r"\b(raise[sd]?|Raises?|raising)\b")
_BOOL = re.compile(r"\b(True|False)\b")
_NONE = re.compile(r"\bNone\b")
_SIGNATURE = re.compile(r"^[A-Za-z_][\w.]*\(.*\)")
_ASYNCIO = ("asyncio.tasks", "asyncio.locks", "asyncio.events", "asyncio.queues")
_THREADS = ("threading", "queue", "concurrent.futures._base", "subprocess", "sched", "selectors")


@dataclass(frozen=True)
class _Spec:
    labels: tuple[str, ...]
    rule: Callable[[Document], str | None]  # label name, or None when the document is not an example
    description: str


def _binary(pred: Callable[[Document], bool], kinds: tuple[str, ...] | None, labels: tuple[str, str]
            ) -> Callable[[Document], str | None]:
    def rule(d: Document) -> str | None:
        if kinds is not None and d.kind not in kinds:
            return None
        return labels[1] if pred(d) else labels[0]
    return rule


def _length(d: Document) -> str | None:
    n = len(d.text.split())
    return "long" if n >= 60 else "short" if n <= 12 else None


TASKS: dict[str, _Spec] = {
    "topic": _Spec(
        ("text", "numbers", "containers", "files", "formats", "internet", "concurrency", "devtools"),
        lambda d: d.group if d.kind != "module" else None,
        "Which of 8 topic groups (rankwise.zoo.docstrings.GROUPS) the documented object's module belongs to; "
        "class, function and method docstrings."),
    "kind": _Spec(
        ("class", "function", "method"),
        lambda d: d.kind if d.kind in ("class", "function", "method") else None,
        "Whether a docstring documents a class, a module-level function or a method."),
    "dunder": _Spec(
        ("regular", "special"),
        _binary(lambda d: _is_dunder(_name(d)), ("method",), ("regular", "special")),
        "Method docstrings: a special (dunder, e.g. __len__) method or a regular one."),
    "private": _Spec(
        ("public", "private"),
        _binary(lambda d: _name(d).startswith("_") and not _is_dunder(_name(d)), ("function", "method"),
                ("public", "private")),
        "Function and method docstrings: a private helper (name starts with one underscore, not dunder) "
        "or public API."),
    "raises": _Spec(
        ("no", "yes"),
        _binary(lambda d: bool(_RAISES.search(d.text)), None, ("no", "yes")),
        "Whether the full docstring says the object raises an exception ('raise', 'raises', 'raised', "
        "'raising')."),
    "returns_bool": _Spec(
        ("no", "yes"),
        _binary(lambda d: bool(_BOOL.search(d.text)), None, ("no", "yes")),
        "Whether the full docstring mentions True or False (typical of predicates and flags)."),
    "mentions_none": _Spec(
        ("no", "yes"),
        _binary(lambda d: bool(_NONE.search(d.text)), None, ("no", "yes")),
        "Whether the full docstring mentions None."),
    "has_example": _Spec(
        ("no", "yes"),
        _binary(lambda d: ">>>" in d.text, None, ("no", "yes")),
        "Whether the full docstring contains an interactive example ('>>>')."),
    "length": _Spec(
        ("short", "long"),
        _length,
        "Whether the full docstring is short (<= 12 words) or long (>= 60 words); others excluded."),
    "c_signature": _Spec(
        ("no", "yes"),
        _binary(lambda d: bool(_SIGNATURE.match(d.text)), None, ("no", "yes")),
        "Whether the docstring opens with a call signature such as 'sqrt(x)', the style of objects "
        "implemented in C."),
    "asyncio_vs_threads": _Spec(
        ("threads", "asyncio"),
        lambda d: "asyncio" if d.module in _ASYNCIO else "threads" if d.module in _THREADS else None,
        "Concurrency docstrings: from asyncio (tasks, locks, events, queues) or from thread/process "
        "modules (threading, queue, concurrent.futures, subprocess, sched, selectors)."),
    "files_vs_formats": _Spec(
        ("files", "formats"),
        lambda d: d.group if d.group in ("files", "formats") else None,
        "Docstrings of the 'files' group (os, pathlib, shutil, ...) or of the 'formats' group (json, csv, "
        "zipfile, ...)."),
}


def text_tasks() -> list[str]:
    """The names of the text classification tasks, in a fixed order."""
    return list(TASKS)


def text_task_labels(name: str) -> list[str]:
    """The label names of the text task ``name`` without building it (to size a model's head, or to pick
    a task by its number of classes). Raises :class:`UnknownTaskError` for an unknown ``name``."""
    _check_name(name, text_tasks(), "text task")
    return list(TASKS[name].labels)


def _check_name(name: str, known: list[str], what: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{what} name must be a str, got {type(name).__name__}")
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownTaskError(f"unknown {what} {name!r}{hint}; known: {', '.join(known)}")


def _in_test(text: str) -> bool:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 4 == 0


def _balance(by_class: list[list[str]], rng: random.Random, cap: int | None) -> list[list[str]]:
    n = min(len(v) for v in by_class)
    if cap is not None:
        n = min(n, cap)
    return [[v[i] for i in sorted(rng.sample(range(len(v)), n))] for v in by_class]


def text_task(name: str, seed: int = 0, max_train: int | None = None, max_test: int | None = None
              ) -> TextTask:
    """Build the text classification task ``name`` (one of :func:`text_tasks`).

    ``seed`` chooses which training examples are kept when a class is cut to the balanced size and
    the order of ``train``; the test set does not depend on it. ``max_train`` / ``max_test`` cap the
    number of examples (``cap // n_classes`` per class). Raises :class:`UnknownTaskError` (a
    ``ValueError``) naming the closest task for an unknown ``name``.
    """
    _check_name(name, text_tasks(), "text task")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    spec = TASKS[name]
    k = len(spec.labels)
    # a cap below the number of classes k would leave a class without an example
    check_int("max_train", max_train, k, allow_none=True)
    check_int("max_test", max_test, k, allow_none=True)

    seen: set[str] = set()
    pools: dict[bool, list[list[str]]] = {False: [[] for _ in range(k)], True: [[] for _ in range(k)]}
    for d in corpus().documents:
        label = spec.rule(d)
        if label is None:
            continue
        text = snippet(d.text)
        if len(text.split()) < _MIN_WORDS or text in seen:
            continue
        seen.add(text)
        pools[_in_test(text)][spec.labels.index(label)].append(text)
    for part, pool in pools.items():
        if min(len(v) for v in pool) == 0:
            raise RankwiseError(f"text task {name!r}: a class has no {'test' if part else 'train'} example "
                                "in this Python version's corpus")

    test_cls = _balance(pools[True], random.Random(0), None if max_test is None else max_test // k)
    train_cls = _balance(pools[False], random.Random(seed), None if max_train is None else max_train // k)
    test = [(t, c) for c, texts in enumerate(test_cls) for t in texts]
    train = [(t, c) for c, texts in enumerate(train_cls) for t in texts]
    random.Random(seed).shuffle(train)
    random.Random(0).shuffle(test)
    return TextTask(name=name, labels=list(spec.labels), train=train, test=test, description=spec.description)
