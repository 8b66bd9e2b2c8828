"""The locally pretrained tiny LM: smoke build in a temporary cache, cache reuse, determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rankwise.core.errors import ArtifactError
from rankwise.zoo import DATASETS, build, info, perplexity, tiny_lm, tiny_lm_info, tiny_lm_path, token_batches
from rankwise.zoo import tinylm as tinylm_mod


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_smoke_build_then_load_from_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = tiny_lm("smoke")
    path = tiny_lm_path("smoke")
    assert path.parent.parent == cache and path.name.startswith("smoke-")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "rankwise_tiny_lm.json"):
        assert (path / f).is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temporary folders left behind"
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    record = json.loads((path / "rankwise_tiny_lm.json").read_text())
    m = record["metrics"]
    assert math.isfinite(m["val_ppl"]) and math.isfinite(m["unigram_val_ppl"]) and m["val_tokens"] > 0
    assert record["key"]["corpus_sha256"] and record["key"]["recipe"]["steps"] == tinylm_mod.RECIPES["smoke"].steps

    ids = tok("Return the number of items.")["input_ids"]
    assert tok.decode(ids) == "Return the number of items."
    assert tok.eos_token_id == 0 and tok.pad_token_id == 1 and len(tok) == model.config.vocab_size

    first = _state(model)

    def no_training(*args, **kwargs):
        raise AssertionError("the second call must load from the cache, not retrain")

    monkeypatch.setattr(tinylm_mod, "_train", no_training)
    again, _ = tiny_lm("smoke")
    second = _state(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert tiny_lm_info("smoke", build=False)["metrics"] == m


def test_damaged_cache_is_reported_and_rebuild_is_deterministic(cache: Path) -> None:
    model, _ = tiny_lm("smoke")
    before = _state(model)
    (tiny_lm_path("smoke") / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="rebuild"):
        tiny_lm("smoke")
    rebuilt, _ = tiny_lm("smoke", rebuild=True)  # repairs the cache, same weights as the first build
    after = _state(rebuilt)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (tiny_lm_path("smoke") / "model.safetensors").is_file()
    assert not [p for p in tiny_lm_path("smoke").parent.iterdir() if p.name.startswith(".")]


def test_unknown_size(cache: Path) -> None:
    with pytest.raises(ValueError, match="size='huge'"):
        tiny_lm("huge")
    with pytest.raises(ValueError, match="unknown sizes"):
        build(sizes=("smoke", "huge"))
    with pytest.raises(ValueError, match="unknown sizes"):
        build(size="huge")


def test_batches_perplexity_and_build(cache: Path) -> None:
    result = build(sizes=("smoke",), progress=False)
    record = result["tiny_lm"]["smoke"]
    assert Path(record["path"]) == tiny_lm_path("smoke") and "val_ppl" in record["metrics"]
    assert result["corpus"]["sha256"] and result["minilm"]["path"]
    model, tok = tiny_lm("smoke")
    batches = token_batches(tok, "calib", seq_len=16, batch_size=4, n_batches=3)
    assert len(batches) == 3 and all(b.shape == (4, 16) and b.dtype == torch.long for b in batches)
    seeded = token_batches(tok, "calib", seq_len=16, batch_size=4, n_batches=2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(seeded, token_batches(tok, "calib", 16, 4, 2, seed=7)))
    ppl = perplexity(model, tok, "eval", seq_len=32, max_tokens=32 * 8)
    assert math.isfinite(ppl) and 1.0 < ppl < 10 * len(tok)
    with pytest.raises(ValueError, match="split"):
        token_batches(tok, "test")
    # the smoke set also builds the GQA Llama and the Qwen2-MoE twins
    assert set(result["tiny_lm"]) == {"smoke", "gqa-smoke", "moe-smoke"}
    gqa, _ = tiny_lm("gqa-smoke")
    assert type(gqa).__name__ == "LlamaForCausalLM"
    assert (gqa.config.num_attention_heads, gqa.config.num_key_value_heads) == (8, 2)
    moe, moe_tok = tiny_lm("moe-smoke")
    assert type(moe).__name__ == "Qwen2MoeForCausalLM" and moe.config.num_experts == 8
    assert moe.config.num_experts_per_tok == 2
    assert math.isfinite(perplexity(moe, moe_tok, "eval", seq_len=32, max_tokens=32 * 4))


def test_new_architecture_fields_keep_old_cache_keys() -> None:
    from rankwise.zoo.tinylm import _recipe_key

    assert "arch" not in _recipe_key("small")["recipe"]  # the Llama recipes hash as before the MoE fields
    assert _recipe_key("moe")["recipe"]["arch"] == "qwen2_moe"


def test_datasets_and_info_state_provenance(cache: Path) -> None:
    assert {"all-MiniLM-L6-v2", "stdlib-docstrings", "sklearn-digits", "tiny-lm"} <= set(DATASETS)
    for name, entry in DATASETS.items():
        assert entry["licence"] and entry["source"], name
    assert "Apache-2.0" in DATASETS["all-MiniLM-L6-v2"]["licence"]
    assert "PSF" in DATASETS["stdlib-docstrings"]["licence"]
    assert "BSD" in DATASETS["sklearn-digits"]["licence"]
    state = info()["state"]
    assert state["cache_dir"] == str(cache)
    assert state["tiny_lm"]["smoke"]["built"] is False


def test_a_cached_build_does_not_depend_on_the_callers_thread_count(cache: Path, tmp_path: Path) -> None:
    """The MoE's float sums change order with the intra-op thread count (a 2-thread and a 1-thread build
    differ by ~1e-7 after the smoke recipe's steps); the cache must hold the same model whoever builds it."""
    from safetensors.torch import load_file

    from rankwise.zoo.models import BUILD_THREADS, build_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(BUILD_THREADS + 1)
        tinylm_mod.build_tiny_lm("moe-smoke")
        assert torch.get_num_threads() == BUILD_THREADS + 1  # the caller's count is restored
    finally:
        torch.set_num_threads(before)
    built = load_file(str(tiny_lm_path("moe-smoke") / "model.safetensors"))
    record = json.loads((tiny_lm_path("moe-smoke") / "rankwise_tiny_lm.json").read_text())
    assert record["metrics"]["torch_threads"] == BUILD_THREADS and record["key"]["build_threads"] == BUILD_THREADS
    with build_threads(BUILD_THREADS):
        tinylm_mod._train("moe-smoke", tmp_path / "direct", False)
    direct = load_file(str(tmp_path / "direct" / "model.safetensors"))
    assert built.keys() == direct.keys() and all(torch.equal(built[k], direct[k]) for k in built)


def test_build_threads_pins_and_restores() -> None:
    from rankwise.zoo.models import build_threads

    before = torch.get_num_threads()
    with build_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(Exception, match="threads"):
        with build_threads(0):
            pass
    assert torch.get_num_threads() == before
