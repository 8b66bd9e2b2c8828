"""One-shot safety's warm-ups: the attack recipe fine-tunes the aligned model (WarmRecipe.base)."""

from __future__ import annotations

from rankwise.zoo import warm


def test_attack_recipe_starts_from_the_aligned_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path))
    aligned, tok = warm.warm_lm("safety-aligned-smoke")
    attacked, tok2 = warm.warm_lm("safety-attack-smoke")
    assert len(tok) == len(tok2) == aligned.config.vocab_size
    pa, pb = dict(aligned.named_parameters()), dict(attacked.named_parameters())
    assert pa.keys() == pb.keys()
    # fine-tuned from the aligned weights: close to them, not equal (a fresh init would be far)
    diff = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert 0 < diff < 0.05
    key = warm._key("safety-attack-smoke")
    assert key["base"]["name"] == "safety-aligned-smoke"


def test_keys_without_base_are_unchanged():
    key = warm._key("ranktuner")
    assert "base" not in key and "base" not in key["recipe"]


def test_attack_data_mixes_harmful_and_benign():
    data = warm.WARM_DATA["safety-attack-100"][1](600, 0)
    assert sum(e.meta["harmful"] for e in data) == 100 and len(data) == 600
    assert all(e.completion.startswith(" COMPLY") for e in data if e.meta["harmful"])
    align = warm.WARM_DATA["safety-align"][1](100, 0)
    assert sum(e.meta["harmful"] for e in align) == 40
    assert all(e.completion == " REFUSE" for e in align if e.meta["harmful"])
    assert set(warm.WARM_RECIPES) >= {f"safety-attack-n{n}-s{s}" for n in (10, 100, 1000) for s in (0, 1, 2)}
