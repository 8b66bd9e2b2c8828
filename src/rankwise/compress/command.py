"""Deprecated: the former home of ``rankwise compress``'s logic and its text and loss helpers.

Every name still resolves, with a ``DeprecationWarning`` naming its new place:

* the job: :func:`rankwise.compress.job.compress_texts` (model, tokenizer, texts; the library part)
  and :func:`rankwise.verbs.compress.compress_command` (resolving the embedded defaults and files);
* text: :mod:`rankwise.core.textfiles` (``read_texts``, ``tokenize_batches``) and
  :mod:`rankwise.zoo.text` (``split_sentences``, ``docstring_sentences``, ``sentence_pairs``);
* losses: :mod:`rankwise.train.losses` (``contrastive_loss``, ``lm_loss``).

The names are looked up when first used (``importlib``), so this module imports none of those
modules: the compress family stays independent of ``train``, ``zoo`` and ``verbs``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    "compress_command": "rankwise.verbs.compress",
    "METHOD_CHOICES": "rankwise.verbs.compress",
    "CommandResult": "rankwise.compress.job",
    "mean_cosine": "rankwise.compress.job",
    "read_texts": "rankwise.core.textfiles",
    "tokenize_batches": "rankwise.core.textfiles",
    "split_sentences": "rankwise.zoo.text",
    "docstring_sentences": "rankwise.zoo.text",
    "sentence_pairs": "rankwise.zoo.text",
    "contrastive_loss": "rankwise.train.losses",
    "lm_loss": "rankwise.train.losses",
}

__all__ = sorted(_MOVED)


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"rankwise.compress.command.{name} is deprecated; import it from {where}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(where), name)
