"""The experiment-kit pieces issue 14 added: the configurable negation task, per-window LM losses, the
fixed probe head, and the per-reproduction helpers they feed (fast; no pretrained model)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rankwise.repro.kit import negation
from rankwise.repro.kit.cached_encoder import fit_probe_head
from rankwise.repro.kit.windows import window_losses


def test_negation_defaults_are_the_task_the_reproductions_used() -> None:
    train, test = negation.negation_task(0, 16, 8)
    assert len(train) == 16 and len(test) == 8
    assert not {t for t, _ in train} & {t for t, _ in test}
    assert sorted(y for _, y in train) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    from rankwise.repro import cdka

    assert cdka.negation_task(3, 16, 8) == negation.negation_task(3, 16, 8)  # cdka re-exports the same task


def test_negation_word_lists_are_parameters() -> None:
    train, test = negation.negation_task(1, 8, 8, films=("the opera",), foods=("the tart",), positive=("fine",),
                                         negative=("stale",), fillers=("", "now"))
    texts = [t for t, _ in train + test]
    assert all(t.split(" was ")[0] in ("the opera", "the tart") for t in texts)
    assert all(("fine" in t) != ("stale" in t) for t in texts)
    label = {("the opera", False, "fine"): 1, ("the opera", True, "fine"): 0, ("the tart", False, "stale"): 2,
             ("the tart", True, "stale"): 3}
    for t, y in train + test:
        subj = t.split(" was ")[0]
        adj = "fine" if "fine" in t else "stale"
        if (subj, " not " in t, adj) in label:
            assert label[(subj, " not " in t, adj)] == y
    with pytest.raises(ValueError, match="at most 16 sentences"):
        negation.negation_task(1, 16, 8, films=("the opera",), foods=("the tart",), positive=("fine",),
                               negative=("stale",), fillers=("", "now"))
    with pytest.raises(ValueError, match="fillers must be a non-empty"):
        negation.negation_task(0, 8, 8, fillers=())


def test_e2lora_exposes_the_negation_word_lists() -> None:
    import dataclasses

    from rankwise.repro import e2lora

    S = dataclasses.replace(e2lora.SETTINGS["smoke"], task="negation", n_train=8, n_test=8, neg_films=("the opera",),
                            neg_foods=("the tart",))
    train, _ = e2lora.task_data(S, 0)
    assert {t.split(" was ")[0] for t, _ in train} <= {"the opera", "the tart"}
    assert e2lora.task_labels(S) == list(negation.LABELS)
    with pytest.raises(ValueError, match="multiples of 4"):
        dataclasses.replace(S, n_train=None)
    with pytest.raises(ValueError, match="E2LoraSettings.task"):
        dataclasses.replace(e2lora.SETTINGS["smoke"], task="no_such_task")


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(256, 8)
        self.out = nn.Linear(8, 256)

    def forward(self, input_ids: torch.Tensor):  # noqa: ANN201 - a tiny causal LM with .logits
        return type("Out", (), {"logits": self.out(self.emb(input_ids))})()


def test_window_losses_average_to_the_token_mean() -> None:
    from rankwise.train.pretrain import eval_loss

    model = _LM().train()
    windows = torch.randint(0, 256, (10, 12), generator=torch.Generator().manual_seed(0))
    per = window_losses(model, windows, batch_size=3)
    assert per.shape == (10,) and per.dtype == torch.float64
    assert math.isclose(float(per.mean()), eval_loss(model, windows), rel_tol=1e-12)
    assert model.training  # mode restored


class _Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.classifier = nn.Linear(4, 2)

    def pooled(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden).mean(1)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooled(hidden, mask))


def test_fit_probe_head_fits_then_freezes_only_the_head() -> None:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 2
    hidden = torch.randn(40, 3, 4, generator=g) + labels[:, None, None] * 2.0
    mask = torch.ones(40, 3, dtype=torch.long)
    model = _Pooled()
    layer_before = model.layer.weight.clone()
    info = fit_probe_head(model, hidden, mask, labels, steps=200, lr=5e-2)
    assert info["train_acc"] >= 0.9
    assert not any(p.requires_grad for p in model.classifier.parameters())
    assert all(p.requires_grad for p in model.layer.parameters())
    assert torch.equal(model.layer.weight, layer_before)


def test_racs_unigram_floor_is_the_byte_cross_entropy() -> None:
    from rankwise.repro.racs_alice import unigram_floor

    uniform = torch.arange(256).repeat(40)
    windows = uniform[: 20 * 64].view(20, 64)
    assert math.isclose(unigram_floor({"train": uniform, "eval": windows}), math.log(256), rel_tol=1e-9)
    skewed = torch.zeros(1000, dtype=torch.long)
    assert unigram_floor({"train": skewed, "eval": skewed[:64].view(2, 32)}) < 0.3


def test_text_task_labels() -> None:
    from rankwise.zoo.tasks import UnknownTaskError, text_task_labels

    assert text_task_labels("kind") == ["class", "function", "method"]
    with pytest.raises(UnknownTaskError):
        text_task_labels("knd")


def test_sweep_val_accuracy_scores_every_row_at_every_rate() -> None:
    from types import SimpleNamespace

    import torch
    from torch import nn

    from rankwise.repro.kit.cached_encoder import sweep_val_accuracy

    class Sign(nn.Module):  # class 1 iff the first hidden feature of the first token is positive (times lr's sign)
        def __init__(self, s: float) -> None:
            super().__init__()
            self.s = s

        def forward(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            x = self.s * h[:, 0, 0]
            return torch.stack([-x, x], dim=1)

    h = torch.randn(10, 3, 2)
    val = SimpleNamespace(hidden=h, mask=torch.ones(10, 3), labels=(h[:, 0, 0] > 0).long())
    calls: list[float] = []

    def fit(lr: float) -> dict[str, nn.Module]:
        calls.append(lr)
        return {"right": Sign(1.0), "wrong": Sign(-1.0)}

    out = sweep_val_accuracy((1e-3, 1e-2), fit, val)
    assert calls == [1e-3, 1e-2]
    assert out == {"right": {1e-3: 1.0, 1e-2: 1.0}, "wrong": {1e-3: 0.0, 1e-2: 0.0}}
