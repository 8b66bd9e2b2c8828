"""RankTuner's weights and loss: the spec's correctness checks, bad inputs, and the TRL integration."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from rankwise.core.errors import NumericalError
from rankwise.train.ranktuner import (
    RankTunerConfig,
    RankTunerLoss,
    TokenWeightedLoss,
    dft_loss,
    entropy_weighted_loss,
    expected_rank,
    focal_loss,
    one_minus_p_loss,
    rank_stats,
    relative_scale,
    trl_loss_func,
)


def _data(B=3, T=5, V=11, seed=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    if masked:
        labels[0, :2] = -100
        labels[2, -1] = -100
    return logits, labels


def test_one_hot_prediction_gives_unit_everything():
    V = 7
    logits = torch.full((1, 1, V), -1e4)
    logits[0, 0, 3] = 1e4
    s = rank_stats(logits, torch.tensor([[3]]))
    assert float(s.rank) == 1 and float(s.expected_rank) == pytest.approx(1.0)
    assert float(relative_scale(logits, torch.tensor([[3]]), normalize="none")) == pytest.approx(1.0)


@pytest.mark.parametrize("V", [2, 10, 1000])
def test_uniform_distribution(V):
    logits = torch.zeros(2, 3, V)
    labels = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(1))
    s = rank_stats(logits, labels)
    assert torch.allclose(s.expected_rank, torch.full((2, 3), (V + 1) / 2))
    assert torch.equal(s.rank, torch.full((2, 3), float(V)))
    w = relative_scale(logits, labels, s_max=None, normalize="none")
    assert torch.allclose(w, torch.full((2, 3), 2 * V / (V + 1)))


def test_expected_rank_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for V in (3, 5, 9):
        logits = torch.randn(4, 6, V, generator=g)
        er = expected_rank(logits)
        p = torch.softmax(logits, -1)
        for i in range(4):
            for t in range(6):
                probs = sorted(p[i, t].tolist(), reverse=True)
                brute = sum((k + 1) * q for k, q in enumerate(probs))
                assert abs(float(er[i, t]) - brute) < 1e-5


def test_ties_with_top1_count_pessimistically():
    logits = torch.tensor([[[2.0, 2.0, 0.0, -1.0]]])
    assert float(rank_stats(logits, torch.tensor([[1]])).rank) == 2
    assert float(rank_stats(logits, torch.tensor([[0]])).rank) == 2
    assert float(rank_stats(logits, torch.tensor([[3]])).rank) == 4


def test_temperature_changes_expected_rank_not_rank():
    logits, labels = _data(masked=False)
    a, b = rank_stats(logits, labels), rank_stats(logits * 3.0, labels)
    assert torch.equal(a.rank, b.rank)
    assert not torch.allclose(a.expected_rank, b.expected_rank)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gamma0_no_clamp_equals_cross_entropy(reduction):
    logits, labels = _data()
    loss = RankTunerLoss(gamma=0.0, s_max=None, reduction=reduction)(logits, labels)
    ref = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction=reduction).view(
        labels.shape if reduction == "none" else ())
    assert torch.allclose(loss, ref, atol=1e-6)
    uni = TokenWeightedLoss("uniform", reduction=reduction)(logits, labels)
    assert torch.allclose(uni, ref, atol=1e-6)


def test_chunking_invariance():
    logits, labels = _data(B=4, T=9, V=50)
    full = RankTunerLoss()(logits, labels, return_stats=True)
    for chunk in (1, 3, 7, 1000):
        part = RankTunerLoss(chunk=chunk)(logits, labels, return_stats=True)
        assert torch.equal(part[1]["weights"], full[1]["weights"])
        assert torch.allclose(part[0], full[0])


def test_weights_carry_no_gradient():
    logits, labels = _data()
    x = logits.clone().requires_grad_(True)
    loss, stats = RankTunerLoss()(x, labels, return_stats=True)
    loss.backward()
    y = logits.clone().requires_grad_(True)
    ce = F.cross_entropy(y.reshape(-1, 11), labels.reshape(-1), reduction="none").view(labels.shape)
    ref = (stats["weights"].detach() * ce).sum() / (labels != -100).sum()
    ref.backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-7)
    assert not stats["weights"].requires_grad


def test_weights_clamped_and_mean_normalised():
    logits, labels = _data(B=8, T=16, V=40, seed=3)
    w = relative_scale(logits, labels, s_max=2.0)
    mask = labels != -100
    assert float(w[mask].mean()) == pytest.approx(1.0, abs=1e-5)
    assert torch.all(w[~mask] == 0)
    raw = relative_scale(logits, labels, s_max=2.0, normalize="none")
    assert float(raw.max()) <= 2.0
    _, st = RankTunerLoss(s_max=2.0)(logits, labels, return_stats=True)
    assert 0.0 <= st["clamped_frac"] <= 1.0 and st["mean_weight"] == pytest.approx(1.0, abs=1e-5)


def test_masked_positions_do_not_change_others():
    logits, labels = _data(masked=False)
    masked = labels.clone()
    masked[1, 2] = -100
    w_all = relative_scale(logits, labels, normalize="none")
    w_m = relative_scale(logits, masked, normalize="none")
    keep = masked != -100
    assert torch.equal(w_all[keep], w_m[keep]) and float(w_m[1, 2]) == 0
    terms = RankTunerLoss(reduction="none")(logits, masked)
    assert float(terms[1, 2]) == 0.0


def test_intuition_confident_wrong_prior_gets_large_weight():
    V = 20
    logits = torch.zeros(1, 3, V)
    logits[0, 0, 0] = 12.0           # confident on token 0, label 5: wrong prior
    logits[0, 1, :4] = 8.0           # 4 equally likely synonyms, label 2
    logits[0, 2, 7] = 12.0           # learned: label 7
    labels = torch.tensor([[5, 2, 7]])
    S = relative_scale(logits, labels, s_max=None, normalize="none")[0]
    assert float(S[0]) > 10 and float(S[1]) <= 2.0 + 1e-4 and float(S[2]) <= 1.0 + 1e-6


def test_baselines_formulas():
    logits, labels = _data(B=4, T=6, V=13, seed=5)
    mask = labels != -100
    p = torch.softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    ce = F.cross_entropy(logits.reshape(-1, 13), labels.reshape(-1), reduction="none").view(labels.shape)
    n = mask.sum()
    assert torch.allclose(dft_loss(logits, labels), (p * ce)[mask].sum() / n, atol=1e-6)
    w = (1 - p)[mask]
    assert torch.allclose(one_minus_p_loss(logits, labels), (w / w.mean() * ce[mask]).sum() / n, atol=1e-6)
    lp = torch.log_softmax(logits, -1)
    H = -(lp.exp() * lp).sum(-1)[mask] / math.log(13)
    assert torch.allclose(entropy_weighted_loss(logits, labels), (H / H.mean() * ce[mask]).sum() / n, atol=1e-6)
    assert torch.allclose(focal_loss(logits, labels), ((1 - p) ** 2 * ce)[mask].sum() / n, atol=1e-6)


def test_bf16_logits_computed_in_float32():
    logits, labels = _data()
    w16 = relative_scale(logits.bfloat16(), labels)
    assert w16.dtype == torch.float32
    assert torch.isfinite(RankTunerLoss()(logits.bfloat16(), labels))


def test_all_masked_gives_zero_loss_with_grad_and_warning():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.full((2, 3), -100)
    with pytest.warns(UserWarning, match="ignored"):
        loss = RankTunerLoss()(logits, labels)
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()


def test_nan_logits_raise_with_count():
    logits, labels = _data(masked=False)
    logits[0, 1, 3] = float("nan")
    logits[1, 2, 0] = float("inf")
    with pytest.raises(NumericalError, match="2 of 15 target positions"):
        RankTunerLoss()(logits, labels)
    labels[0, 1] = labels[1, 2] = -100  # masked positions may hold anything
    assert torch.isfinite(RankTunerLoss()(logits, labels))


def test_bad_inputs():
    logits, labels = _data()
    with pytest.raises(ValueError, match=r"\(3, 5, 11\).*\(3, 4\)"):
        RankTunerLoss()(logits, labels[:, :4])
    bad = labels.clone()
    bad[0, 3] = 11
    with pytest.raises(ValueError, match="outside"):
        RankTunerLoss()(logits, bad)
    with pytest.raises(TypeError):
        RankTunerLoss()(logits, labels.float())
    for kw, msg in (({"s_max": 0.0}, "s_max"), ({"s_min": 3.0, "s_max": 2.0}, "s_min"), ({"gamma": -1.0}, "gamma"),
                    ({"f": "cube"}, "f"), ({"reduction": "avg"}, "reduction")):
        with pytest.raises(ValueError, match=f"RankTunerConfig.{msg}"):
            RankTunerConfig(**kw)
    with pytest.raises(ValueError, match="scheme"):
        TokenWeightedLoss("bogus")


def test_registered():
    from rankwise.core import registry

    registry.discover()
    e = registry.get("ranktuner") if hasattr(registry, "get") else registry._ENTRIES["ranktuner"]
    assert e.config is RankTunerConfig


def test_trl_loss_func_shifts_and_uses_num_items():
    logits, labels = _data(masked=False)

    class Out:
        pass

    out = Out()
    out.logits = logits
    f = trl_loss_func(RankTunerLoss())
    got = f(out, labels)
    ref = RankTunerLoss()(logits[:, :-1], labels[:, 1:])
    assert torch.allclose(got, ref)
    got2 = f(out, labels, num_items_in_batch=torch.tensor(24))
    assert torch.allclose(got2, ref * 12 / 24)
    log: list = []
    trl_loss_func(RankTunerLoss(s_max=1.5), log=log)(out, labels)
    assert len(log) == 1 and 0 <= log[0]["clamped_frac"] <= 1 and log[0]["max_weight"] >= log[0]["mean_weight"]
    with pytest.raises(TypeError):
        trl_loss_func(3)


def test_trl_sft_trainer_runs_ranktuner_and_dft():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from rankwise.train.ranktuner import sft_trainer
    from rankwise.zoo.models import tiny_llama
    from rankwise.zoo.synthetic import ArithmeticWorld

    w = ArithmeticWorld(n_digits=2, vocab_size=40)
    tok = w.tokenizer()
    ex = w.examples(w.split(16, 0, seed=0)[0], "add_rev", seed=0)
    for arm in ("dft", RankTunerLoss()):
        model = tiny_llama(0, vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)
        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = sft_trainer(model, tok, ex, arm, steps=2, batch_size=8)
            before = [p.detach().clone() for p in model.parameters()]
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
