"""repro.kit.sambal_models: corpora, cache keys and the cached round trip of a trained model."""

from __future__ import annotations

import pytest
import torch

from rankwise.repro.kit import sambal_models as K


def test_corpora_share_their_skeleton() -> None:
    g = K.grammar(K.RECIPES["smoke"])
    nat = K.corpus(g, "natural", 300, seed=0)
    sam = K.corpus(g, "sambal", 300, seed=0)
    shuf = K.corpus(g, "shuffled", 300, seed=0)
    assert sum(len(s) + 1 for s in nat) >= 300 and len(nat) == len(sam) == len(shuf)
    assert [len(s) for s in nat] == [len(s) for s in sam]  # relexicalisation keeps the length
    assert all(sorted(a) == sorted(b) for a, b in zip(nat, shuf))
    assert nat != sam and K.corpus(g, "natural", 300, seed=0) == nat
    tok = K.tokenizer(g)
    ids = K.stream(tok, nat[:3])
    assert ids[0] == tok.eos_token_id and int((ids == tok.eos_token_id).sum()) == 4
    assert tok.unk_token_id not in ids.tolist()
    with pytest.raises(ValueError, match="corpus kind"):
        K.corpus(g, "poetry", 300, seed=0)


def test_model_sizes_and_keys() -> None:
    assert K.RECIPES["small"].tokens == 300_000 and K.RECIPES["full"].tokens == 2_000_000
    a = K.model_path("small", "natural", "full", 0)
    assert a != K.model_path("small", "sambal", "full", 0) != K.model_path("small", "natural", "full", 1)
    assert a == K.model_path("small", "natural", "full", 0)
    with pytest.raises(ValueError, match="recipe"):
        K.trained_model("huge", "natural", "full", 0)
    with pytest.raises(ValueError, match="size"):
        K.trained_model("smoke", "natural", "giant", 0)


def test_cached_round_trip(repro_cache) -> None:
    m = K.trained_model("smoke", "sambal", "smoke", 0)
    again = K.trained_model("smoke", "sambal", "smoke", 0)
    x = torch.arange(4, 20)[None]
    assert torch.equal(m(input_ids=x).logits, again(input_ids=x).logits)
    assert again.sambal_info["steps"] == K.RECIPES["smoke"].steps and again.sambal_info["corpus"] == "sambal"
    assert K.model_path("smoke", "sambal", "smoke", 0).is_relative_to(repro_cache)


def test_an_uncached_build_depends_on_its_seed_only() -> None:
    """Dropout draws from a seeded fork of the global generator: two in-memory builds from different global
    states are the same model, and the caller's generator is untouched."""
    x = torch.arange(4, 20)[None]

    def build(prior: int) -> torch.Tensor:
        torch.manual_seed(prior)
        before = torch.get_rng_state()
        m = K.trained_model("smoke", "natural", "smoke", 0, cache=False)
        assert torch.equal(torch.get_rng_state(), before)
        return m(input_ids=x).logits

    assert torch.equal(build(1), build(2))
