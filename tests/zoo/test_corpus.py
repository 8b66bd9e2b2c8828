"""The docstring corpus: deterministic, isolated from monkeypatching, split by module."""

from __future__ import annotations

import logging

import pytest

from rankwise.zoo import docstrings as corpus_mod
from rankwise.zoo.docstrings import GROUPS, MODULES, SPLITS, corpus


def test_corpus_size_fields_and_licence() -> None:
    c = corpus()
    assert 40 <= len(MODULES) <= 80 and len(set(MODULES)) == len(MODULES)
    assert len(c.documents) > 1500
    info = c.info
    assert info["python_version"].count(".") == 2
    assert len(info["sha256"]) == 64
    assert "PSF" in info["licence"]
    assert info["n_documents"] == len(c.documents) == sum(info["documents_per_split"].values())
    kinds = {d.kind for d in c.documents}
    assert kinds == {"module", "class", "function", "method"}
    keys = [d.key for d in c.documents]
    assert len(keys) == len(set(keys)), "module:qualname must be unique"
    assert all(d.text and d.text == d.text.strip() for d in c.documents)
    assert {d.module for d in c.documents} <= set(MODULES)


def test_splits_disjoint_by_module_and_cover_every_topic() -> None:
    c = corpus()
    mods = {s: {d.module for d in c.split(s)} for s in SPLITS}
    assert not mods["train"] & mods["calib"]
    assert not mods["train"] & mods["eval"]
    assert not mods["calib"] & mods["eval"]
    assert sum(len(c.split(s)) for s in SPLITS) == len(c.documents)
    for s in SPLITS:
        assert {d.group for d in c.split(s)} == set(GROUPS), f"split {s} misses a topic"
        assert set(c.modules(s)) >= mods[s]
    # the held-out splits are smaller than train but not tiny
    assert len(c.text("eval")) > 30_000 and len(c.text("calib")) > 30_000
    assert len(c.text("train")) > 5 * len(c.text("eval"))
    assert c.text("eval").startswith(c.split("eval")[0].text)


def test_bad_split_name() -> None:
    with pytest.raises(ValueError, match="split='test'"):
        corpus().split("test")


def test_hash_ignores_monkeypatched_stdlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Libraries patch the stdlib at import time; the corpus is extracted in a clean interpreter."""
    before = corpus()
    assert before.info["extraction"] == "isolated-interpreter"

    def warning_advice(self: logging.Logger, msg: str) -> None:
        """Injected by some library."""

    monkeypatch.setattr(logging.Logger, "warning_advice", warning_advice, raising=False)
    corpus_mod._build.cache_clear()
    try:
        after = corpus()
    finally:
        corpus_mod._build.cache_clear()
    assert after.info["sha256"] == before.info["sha256"]
    assert [d.key for d in after.documents] == [d.key for d in before.documents]
    assert "Logger.warning_advice" not in {d.qualname for d in after.documents}


def test_documents_list_is_a_copy() -> None:
    c = corpus()
    c.documents.clear()
    assert len(corpus().documents) > 0
