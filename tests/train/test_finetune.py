"""The shared classification fine-tuning loop: determinism, what it trains, schedule, lock step, bad input."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rankwise.core.errors import NumericalError
from rankwise.train.finetune import (
    Batch,
    FinetuneConfig,
    Trainer,
    evaluate,
    finetune,
    lockstep,
    make_batches,
    num_steps,
)

WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad", "the", "a", "movie", "day", "was", "is"]


class ToyTokenizer:
    """Whitespace tokenizer with the call signature of a Hugging Face tokenizer (0 = pad, 1 = unknown)."""

    def __init__(self) -> None:
        self.vocab = {w: i + 2 for i, w in enumerate(WORDS)}

    def __call__(self, texts, padding=True, truncation=True, max_length=64, return_tensors="pt"):
        ids = [[self.vocab.get(w, 1) for w in t.split()][:max_length] for t in texts]
        n = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [0] * (n - len(x)) for x in ids])
        return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}


class BagModel(nn.Module):
    """Mean of word embeddings -> dropout -> linear head; returns an HF-style object with ``.logits``."""

    def __init__(self, n_labels: int = 2, dropout: float = 0.0, seed: int = 0, output: str = "object") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(len(WORDS) + 2, 8)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(8, n_labels)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.output = output

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).float()
        h = (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        logits = self.head(self.drop(h))
        if self.output == "tensor":
            return logits
        if self.output == "dict":
            return {"logits": logits}
        return SimpleNamespace(logits=logits)


def sentiment(n: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    pos, neg, filler = WORDS[:4], WORDS[4:8], WORDS[8:]
    out = []
    for i in range(n):
        label = i % 2
        words = [rng.choice(pos if label else neg)] + rng.sample(filler, 3)
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


TRAIN, TEST = sentiment(64, 0), sentiment(40, 1)
TOK = ToyTokenizer()


def test_learns_a_separable_task() -> None:
    model = BagModel()
    res = finetune(model, TOK, TRAIN, TEST, FinetuneConfig(lr=0.05, epochs=6, batch_size=8, schedule="constant"))
    assert res.steps == 6 * 8 == len(res.losses) == len(res.step_times) == len(res.lrs)
    assert res.accuracy == 1.0
    assert sum(res.losses[-8:]) / 8 < 0.5 * sum(res.losses[:8]) / 8
    assert res.test_loss is not None and res.test_loss < 0.4
    assert res.logits is not None and res.logits.shape == (len(TEST), 2)
    assert res.trainable_parameters == res.total_parameters == sum(p.numel() for p in model.parameters())
    assert all(t > 0 for t in res.step_times)


def test_deterministic_given_the_seed_and_independent_of_the_global_rng() -> None:
    cfg = FinetuneConfig(lr=0.02, epochs=2, batch_size=8, seed=3)
    a = finetune(BagModel(dropout=0.3), TOK, TRAIN, TEST, cfg)
    torch.manual_seed(12345)
    torch.rand(7)  # disturb the global RNG: dropout masks must not depend on it
    b = finetune(BagModel(dropout=0.3), TOK, TRAIN, TEST, cfg)
    assert a.losses == b.losses and torch.equal(a.logits, b.logits)
    c = finetune(BagModel(dropout=0.3), TOK, TRAIN, TEST, FinetuneConfig(lr=0.02, epochs=2, batch_size=8, seed=4))
    assert c.losses != a.losses


def test_global_rng_untouched_by_training() -> None:
    model = BagModel(dropout=0.5)  # (building a module draws from the global RNG)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    finetune(model, TOK, TRAIN, None, FinetuneConfig(steps=3, batch_size=8))
    assert torch.equal(torch.rand(3), expected)


def test_batches_cover_each_example_once_per_epoch_and_wrap() -> None:
    cfg = FinetuneConfig(batch_size=10, epochs=2, seed=1)
    data = [(f"good day {'a ' * i}".strip(), i % 2) for i in range(25)]
    batches = make_batches(TOK, data, cfg)
    assert num_steps(25, cfg) == 6 == len(batches)
    assert [len(b) for b in batches] == [10, 10, 5, 10, 10, 5]
    lengths = lambda bs: sorted(int(b.inputs["attention_mask"][j].sum()) for b in bs for j in range(len(b)))
    assert lengths(batches[:3]) == lengths(batches[3:]) == sorted(len(t.split()) for t, _ in data)
    # padding to the longest text of each batch, truncation at max_length
    for b in batches:
        assert b.inputs["input_ids"].shape[1] == int(b.inputs["attention_mask"].sum(1).max())
    short = make_batches(TOK, data, FinetuneConfig(batch_size=10, max_length=4, steps=8))
    assert len(short) == 8 and max(b.inputs["input_ids"].shape[1] for b in short) == 4
    # the order depends on the seed
    other = make_batches(TOK, data, FinetuneConfig(batch_size=10, epochs=2, seed=2))
    assert any(not torch.equal(x.labels, y.labels) or not torch.equal(x.inputs["input_ids"], y.inputs["input_ids"])
               for x, y in zip(batches, other))


def test_group_by_length_pads_less_and_keeps_every_example() -> None:
    rng = random.Random(0)
    data = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))), i % 2) for i in range(96)]
    plain = make_batches(TOK, data, FinetuneConfig(batch_size=4, epochs=1, seed=0))
    grouped = make_batches(TOK, data, FinetuneConfig(batch_size=4, epochs=1, seed=0, group_by_length=True))
    assert len(plain) == len(grouped) == 24
    padded = lambda bs: sum(b.inputs["input_ids"].numel() for b in bs)
    assert padded(grouped) < 0.7 * padded(plain)
    key = lambda bs: sorted((int(b.inputs["attention_mask"][j].sum()), int(b.labels[j])) for b in bs for j in range(len(b)))
    assert key(grouped) == key(plain)  # the same examples, once each
    again = make_batches(TOK, data, FinetuneConfig(batch_size=4, epochs=1, seed=0, group_by_length=True))
    assert all(torch.equal(a.inputs["input_ids"], b.inputs["input_ids"]) for a, b in zip(grouped, again))
    # batches of a window are not simply in descending length order (they are shuffled)
    tops = [b.inputs["input_ids"].shape[1] for b in grouped[:16]]
    assert tops != sorted(tops, reverse=True)


def test_only_trainable_parameters_change() -> None:
    model = BagModel()
    model.emb.weight.requires_grad_(False)
    emb = model.emb.weight.detach().clone()
    head = model.head.weight.detach().clone()
    res = finetune(model, TOK, TRAIN, None, FinetuneConfig(lr=0.05, steps=4, batch_size=8))
    assert torch.equal(model.emb.weight, emb)
    assert not torch.equal(model.head.weight, head)
    assert res.trainable_parameters == model.head.weight.numel() + model.head.bias.numel()
    assert res.accuracy is None and res.logits is None


def test_linear_schedule_with_warmup() -> None:
    cfg = FinetuneConfig(lr=0.1, steps=10, batch_size=8, warmup_ratio=0.2, schedule="linear")
    res = finetune(BagModel(), TOK, TRAIN, None, cfg)
    warm = math.ceil(0.2 * 10)
    expected = [0.1 * (i + 1) / (warm + 1) if i < warm else 0.1 * (10 - i) / (10 - warm) for i in range(10)]
    assert res.lrs == pytest.approx(expected)
    const = finetune(BagModel(), TOK, TRAIN, None,
                     FinetuneConfig(lr=0.1, steps=5, batch_size=8, warmup_ratio=0.0, schedule="constant"))
    assert const.lrs == pytest.approx([0.1] * 5)


def test_optimizer_factory_and_instance() -> None:
    cfg = FinetuneConfig(lr=0.05, steps=3, batch_size=8, grad_clip=None, warmup_ratio=0.0, schedule="constant")
    seen = []

    def factory(params):
        seen.append(len(params))
        return torch.optim.SGD(params, lr=0.05)

    m1 = BagModel()
    finetune(m1, TOK, TRAIN, None, cfg, optimizer=factory)
    assert seen == [3]
    m2 = BagModel()
    finetune(m2, TOK, TRAIN, None, cfg, optimizer=torch.optim.SGD(m2.parameters(), lr=0.05))
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        finetune(BagModel(), TOK, TRAIN, None, cfg, optimizer=lambda params: "sgd")
    with pytest.raises(TypeError, match="optimizer must be"):
        finetune(BagModel(), TOK, TRAIN, None, cfg, optimizer=3)


@pytest.mark.parametrize("output", ["object", "dict", "tensor"])
def test_output_kinds_and_evaluate(output: str) -> None:
    model = BagModel(output=output)
    ev = evaluate(model, TOK, TEST, batch_size=7)
    assert ev.logits.shape == (len(TEST), 2)
    y = torch.tensor([label for _, label in TEST])
    assert ev.accuracy == pytest.approx(float((ev.logits.argmax(1) == y).double().mean()))
    assert ev.loss == pytest.approx(float(nn.functional.cross_entropy(ev.logits.double(), y)), rel=1e-6)
    model.train()
    evaluate(model, TOK, TEST)
    assert model.training  # the previous mode is restored
    model.eval()
    evaluate(model, TOK, TEST)
    assert not model.training


def test_lockstep_identical_models_identical_curves_and_alternating_order() -> None:
    cfg = FinetuneConfig(lr=0.05, steps=6, batch_size=8, seed=5)
    batches = make_batches(TOK, TRAIN, cfg)
    calls: list[str] = []
    models = {"a": BagModel(dropout=0.3, seed=1), "b": BagModel(dropout=0.3, seed=1)}
    for name, m in models.items():
        m.head.register_forward_hook(lambda mod, inp, out, name=name: calls.append(name))
    trainers = {k: Trainer(m, cfg, len(batches)) for k, m in models.items()}
    curves = lockstep(trainers, batches)
    assert curves["a"] == curves["b"]  # same dropout masks per step
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    with pytest.raises(RuntimeError, match="sized for 6 steps"):
        trainers["a"].step(batches[0])
    with pytest.raises(ValueError, match="at least one trainer"):
        lockstep({}, batches)


def test_rankwise_and_peft_lora_train_identically_on_a_tiny_bert() -> None:
    peft = pytest.importorskip("peft")
    from transformers import BertConfig, BertForSequenceClassification

    from rankwise.adapt import lora
    from rankwise.core.lora import lora_layers

    cfg = BertConfig(vocab_size=len(WORDS) + 2, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    base = BertForSequenceClassification(cfg)
    import copy

    rw = copy.deepcopy(base)
    lora.adapt(rw, lora.LoraConfig(rank=4, alpha=8, dropout=0.1, target=("query", "value"), seed=0))
    for p in rw.classifier.parameters():
        p.requires_grad_(True)
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["query", "value"]))
    with torch.no_grad():
        for name, layer in lora_layers(rw):
            other = pm.base_model.model.get_submodule(name)
            other.lora_A["default"].weight.copy_(layer.lora_A["default"].weight)
            other.lora_B["default"].weight.copy_(layer.lora_B["default"].weight)
    fcfg = FinetuneConfig(lr=0.01, steps=5, batch_size=8, seed=0)
    batches = make_batches(TOK, TRAIN, fcfg)
    trainers = {"rankwise": Trainer(rw, fcfg, 5), "peft": Trainer(pm, fcfg, 5)}
    curves = lockstep(trainers, batches)
    assert max(abs(a - b) for a, b in zip(curves["rankwise"], curves["peft"])) <= 1e-6
    assert len(set(curves["rankwise"])) > 1
    e1, e2 = evaluate(rw, TOK, TEST), evaluate(pm, TOK, TEST)
    assert float((e1.logits - e2.logits).abs().max()) <= 1e-5


# --------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("field,value", [
    ("lr", 0.0), ("lr", -1.0), ("lr", float("nan")), ("epochs", 0), ("steps", 0), ("steps", 2.5),
    ("batch_size", 0), ("batch_size", True), ("max_length", 1), ("weight_decay", -0.1), ("betas", (0.9, 1.0)),
    ("eps", 0.0), ("schedule", "cosine"), ("warmup_ratio", 1.0), ("warmup_ratio", -0.1), ("grad_clip", 0.0),
    ("eval_batch_size", 0), ("group_by_length", 1), ("seed", -1), ("seed", 1.5),
])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"FinetuneConfig.{field}"):
        FinetuneConfig(**{field: value})


def test_bad_data() -> None:
    cfg = FinetuneConfig(steps=2, batch_size=4)
    with pytest.raises(ValueError, match="train is empty"):
        finetune(BagModel(), TOK, [], None, cfg)
    with pytest.raises(TypeError, match="sequence of"):
        finetune(BagModel(), TOK, "good day", None, cfg)
    with pytest.raises(TypeError, match=r"train\[1\].*pair"):
        finetune(BagModel(), TOK, [("good", 0), "bad"], None, cfg)
    with pytest.raises(TypeError, match=r"train\[0\]: text must be a str"):
        finetune(BagModel(), TOK, [(3, 0)], None, cfg)
    with pytest.raises(ValueError, match=r"train\[0\]: label must be an int >= 0"):
        finetune(BagModel(), TOK, [("good", -1)], None, cfg)
    with pytest.raises(ValueError, match=r"test\[0\]: label"):
        finetune(BagModel(), TOK, TRAIN, [("good", 1.0)], cfg)
    with pytest.raises(ValueError, match="out of range for a model with 2 outputs"):
        finetune(BagModel(), TOK, [("good day", 2)] * 4, None, cfg)
    with pytest.raises(ValueError, match="out of range"):
        evaluate(BagModel(), TOK, [("good day", 5)])


def test_bad_model() -> None:
    cfg = FinetuneConfig(steps=2, batch_size=4)
    frozen = BagModel()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        finetune(frozen, TOK, TRAIN, None, cfg)
    with pytest.raises(TypeError, match="nn.Module"):
        Trainer(lambda **kw: None, cfg, 2)  # type: ignore[arg-type]

    class NoLogits(BagModel):
        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(hidden=super().forward(input_ids, attention_mask).logits)

    with pytest.raises(TypeError, match="must return logits"):
        finetune(NoLogits(), TOK, TRAIN, None, cfg)


def test_non_finite_loss_raises_and_leaves_parameters() -> None:
    model = BagModel()
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    before = model.emb.weight.detach().clone()
    with pytest.raises(NumericalError, match="step 0"):
        finetune(model, TOK, TRAIN, None, FinetuneConfig(steps=2, batch_size=8))
    assert torch.equal(model.emb.weight, before)


def test_batch_to_device_is_identity_on_same_device() -> None:
    b = Batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, torch.zeros(2, dtype=torch.long))
    assert b.to(torch.device("cpu")) is b
    assert len(b) == 2


def test_extra_loss_is_added_to_the_cross_entropy_and_logged() -> None:
    cfg = FinetuneConfig(steps=3, batch_size=8, lr=0.05, seed=3)
    batches = make_batches(TOK, TRAIN, cfg)
    seen = []

    def extra(model, batch, outputs, step):  # reads the forward's outputs, as a routing loss would
        seen.append((step, len(batch)))
        return 0.5 * outputs.logits.square().mean() + model.head.weight.abs().sum() * 1e-3

    plain, hooked = Trainer(BagModel(dropout=0.2), cfg, 3), Trainer(BagModel(dropout=0.2), cfg, 3, extra_loss=extra)
    plain.step(batches[0])
    hooked.step(batches[0])
    assert seen == [(0, 8)] and len(hooked.extra_losses) == 1 and plain.extra_losses == []
    # same model, batch and dropout seed: the logged loss is exactly CE + the extra term (summed in float32)
    assert hooked.losses[0] == float(torch.tensor(plain.losses[0]) + torch.tensor(hooked.extra_losses[0]))
    assert hooked.losses[0] != plain.losses[0]
    # and it is what was trained: the parameters moved differently
    assert not torch.equal(plain.model.head.weight, hooked.model.head.weight)
    zero = Trainer(BagModel(), cfg, 3, extra_loss=lambda m, b, o, s: torch.zeros(()))
    ref = Trainer(BagModel(), cfg, 3)
    for b in batches:
        zero.step(b)
        ref.step(b)
    assert zero.losses == ref.losses and torch.equal(zero.model.head.weight, ref.model.head.weight)
    res = finetune(BagModel(), TOK, TRAIN, None, cfg, extra_loss=lambda m, b, o, s: torch.tensor(1.0))
    assert res.losses == [float(torch.tensor(x) + 1.0) for x in finetune(BagModel(), TOK, TRAIN, None, cfg).losses]


def test_bad_extra_loss() -> None:
    cfg = FinetuneConfig(steps=1, batch_size=4)
    with pytest.raises(TypeError, match="extra_loss must be callable"):
        Trainer(BagModel(), cfg, 1, extra_loss=3.0)  # type: ignore[arg-type]
    batch = make_batches(TOK, TRAIN, cfg)[0]
    with pytest.raises(TypeError, match="scalar tensor, got Tensor of shape \\(2,\\)"):
        Trainer(BagModel(), cfg, 1, extra_loss=lambda m, b, o, s: torch.zeros(2)).step(batch)
    with pytest.raises(NumericalError, match="step 0"):
        Trainer(BagModel(), cfg, 1, extra_loss=lambda m, b, o, s: torch.tensor(float("nan"))).step(batch)
