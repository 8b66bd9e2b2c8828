"""Warm-up models: the smoke recipe builds into the cache once and loads back."""

from __future__ import annotations

import pytest

from rankwise.zoo import warm


def test_smoke_recipe_builds_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path))
    rec = warm.build_warm("ranktuner-smoke")
    assert rec["path"].startswith(str(tmp_path)) and rec["metrics"]["n_params"] > 0
    again = warm.build_warm("ranktuner-smoke")
    assert again == rec  # read from the cache, not rebuilt
    model, tok = warm.warm_lm("ranktuner-smoke")
    assert model.config.vocab_size == len(tok) == 300
    assert warm.warm_world("ranktuner-smoke").vocab_size == 300


def test_unknown_recipe():
    with pytest.raises(ValueError, match="no warm-up recipe"):
        warm.warm_lm("nope")
