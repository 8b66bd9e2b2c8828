"""Lopti / Advantage Reweighting on the GRPO loop: the spec's correctness checks, bad inputs, TRL parity."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from rankwise.core.errors import NumericalError
from rankwise.train.lopti import (
    AdvantageReweighting,
    GRPOConfig,
    GRPOTrainer,
    Lopti,
    Rollout,
    aggregate,
    closed_form_grad_norms,
    completion_logps,
    group_advantages,
    hidden_grad_norms,
    k3_kl,
    lopti_masks,
    per_token_loss,
    quartile_means,
    reweight_advantages,
    token_logps,
)
from rankwise.zoo.synthetic import AdditionWorld

WORLD = AdditionWorld()
PROMPTS = ["12+34=", "55+21=", "70+19="]
ANSWERS = ["46", "76", "89"]


def _reward(prompts, completions, answer, **_):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def _random_reward(prompts, completions, **_):  # deterministic in the text, spread over [0, 1]
    return [(sum(map(ord, p + c)) % 7) / 6 for p, c in zip(prompts, completions)]


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = WORLD.tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), tok


def _trainer(model, tok, hooks=(), lr=1e-2, **cfg):
    kw = dict(num_generations=4, max_completion_length=3, seed=0)
    kw.update(cfg)
    return GRPOTrainer(model, tok, _random_reward, GRPOConfig(**kw),
                       optimizer=torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), token_hooks=hooks)


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------ group advantages


def test_group_advantages_sum_to_zero_and_equal_rewards_give_zero():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.3, 0.9, 0.1, 0.4])
    a = group_advantages(r, 4)
    assert torch.allclose(a.view(-1, 4).sum(1), torch.zeros(3), atol=1e-6)
    assert torch.equal(a[4:8], torch.zeros(4))
    g = r[:4]
    assert torch.allclose(a[:4], (g - g.mean()) / (g.std() + 1e-4))  # Bessel std, the spec's floor
    assert torch.allclose(group_advantages(r, 4, "none")[:4], g - g.mean())
    assert torch.allclose(group_advantages(r, 4, "batch"), (r - r.view(-1, 4).mean(1).repeat_interleave(4))
                          / (r.std() + 1e-4))


@pytest.mark.parametrize("G", [0, 1])
def test_num_generations_below_two_is_refused(G):
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.ones(4), G)
    with pytest.raises(ValueError, match="GRPOConfig.num_generations must be an int >= 2"):
        GRPOConfig(num_generations=G)


def test_bad_reward_batches():
    with pytest.raises(ValueError, match="cannot be split into groups"):
        group_advantages(torch.ones(7), 4)
    with pytest.raises(ValueError, match=r"completion 5 \(prompt 1\)"):
        group_advantages(torch.tensor([0.0, 1, 0, 1, 0, float("nan"), 1, 0]), 4)


@pytest.mark.parametrize("kw, match", [
    ({"epsilon": 0.0}, "GRPOConfig.epsilon"), ({"epsilon": -0.1}, "GRPOConfig.epsilon"),
    ({"epsilon_high": 0.0}, "GRPOConfig.epsilon_high"), ({"loss_type": "dapo"}, "GRPOConfig.loss_type"),
    ({"scale_rewards": "sometimes"}, "GRPOConfig.scale_rewards"), ({"beta": -1.0}, "GRPOConfig.beta"),
    ({"num_iterations": 0}, "GRPOConfig.num_iterations"), ({"temperature": 0.0}, "GRPOConfig.temperature"),
])
def test_config_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kw)


@pytest.mark.parametrize("make, match", [
    (lambda: AdvantageReweighting(alpha=-0.1), "AdvantageReweighting.alpha"),
    (lambda: AdvantageReweighting(alpha=1.5), "AdvantageReweighting.alpha"),
    (lambda: Lopti(eta=1.2), "Lopti.eta"), (lambda: Lopti(eta=-0.5), "Lopti.eta"),
    (lambda: Lopti(order="middle"), "Lopti.order"),
])
def test_hook_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_scale_rewards_accepts_trl_bools():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


# ------------------------------------------------------------------ pure math


def test_k3_is_nonnegative_and_zero_at_equality():
    g = torch.Generator().manual_seed(0)
    a, b = -torch.rand(50, generator=g) * 5, -torch.rand(50, generator=g) * 5
    assert (k3_kl(a, b) >= 0).all()
    assert torch.equal(k3_kl(a, a), torch.zeros(50))


def test_ar_alpha_one_multiplies_by_pi_old_and_weights_stay_in_range():
    g = torch.Generator().manual_seed(1)
    logp_old = -torch.rand(4, 5, generator=g) * 4
    adv = torch.randn(4, generator=g)
    out = reweight_advantages(adv, logp_old, 1.0)
    assert torch.equal(out, torch.exp(logp_old) * adv[:, None])
    for alpha in (0.0, 0.3, 0.7, 1.0):
        w = reweight_advantages(torch.ones(4), logp_old, alpha)
        assert (w <= 1).all() and (w >= 1 - alpha).all()
    assert torch.equal(reweight_advantages(adv, logp_old, 0.0), adv[:, None].expand(4, 5))
    pos = reweight_advantages(adv, logp_old, 0.5, positive_only=True)
    neg = adv < 0
    assert torch.equal(pos[neg], adv[:, None].expand(4, 5)[neg])


def test_lopti_masks_partition_and_edges():
    g = torch.Generator().manual_seed(2)
    logp = torch.log(torch.rand(6, 4, generator=g))
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[0, 2:] = 0
    low, high = lopti_masks(logp, mask, 0.5)
    assert torch.equal(low + high, mask) and not (low * high).any()
    assert (torch.exp(logp)[low.bool()] < 0.5).all() and (torch.exp(logp)[high.bool()] >= 0.5).all()
    assert torch.equal(lopti_masks(logp, mask, 1.0)[0], mask)
    assert not lopti_masks(logp, mask, 0.0)[0].any()
    low_q, _ = lopti_masks(logp, mask, 0.25, quantile=True)
    assert abs(int(low_q.sum()) - 0.25 * int(mask.sum())) <= 1
    assert [n for n, _ in Lopti(order="high_first").stages(logp, mask)] == ["high", "low"]


def test_aggregations_match_their_formulas():
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert torch.allclose(aggregate(loss, mask, "bnpo"), (loss * mask).sum() / 7)
    per_seq = [(loss[i] * mask[i]).sum() / mask[i].sum() for i in range(3)]
    assert torch.allclose(aggregate(loss, mask, "grpo"), torch.stack(per_seq).mean())
    assert torch.allclose(aggregate(loss, mask, "dr_grpo", 4), (loss * mask).sum() / 12)
    assert float(aggregate(loss, torch.zeros_like(mask), "bnpo")) == 0.0


def test_nan_logits_raise_naming_the_position():
    logits = torch.randn(2, 3, 5)
    logits[1, 2, 0] = float("nan")
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(NumericalError, match="completion 1, position 2"):
        token_logps(logits, tokens, torch.ones(2, 3))
    token_logps(logits, tokens, torch.tensor([[1, 1, 1], [1, 1, 0]]))  # masked-out position: fine


# ------------------------------------------------------------------ the trainer


def test_rollout_shapes_rewards_and_mu1_ratio_is_one(tiny):
    model, tok = tiny
    tr = _trainer(copy.deepcopy(model), tok)
    r = tr.rollout(PROMPTS)
    B = len(PROMPTS) * 4
    assert r.completion_ids.shape[0] == B and r.logp_old.shape == r.completion_mask.shape
    assert r.rewards.shape == (B,) and torch.allclose(r.advantages.view(-1, 4).sum(1), torch.zeros(3), atol=1e-5)
    # every mask row is a prefix that ends at the first EOS (or runs to the end)
    for ids, m in zip(r.completion_ids, r.completion_mask):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        assert tok.eos_token_id not in ids[:n - 1].tolist()
    tr.model.train()
    logp = completion_logps(tr.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    _, ratio = per_token_loss(logp, r.logp_old, r.advantages)
    assert torch.equal(ratio[r.completion_mask.bool()], torch.ones(r.n_tokens))


def test_ar_alpha_zero_equals_grpo_bitwise(tiny):
    model, tok = tiny
    base = _trainer(copy.deepcopy(model), tok, beta=0.01)
    r = base.rollout(PROMPTS)
    ar = _trainer(copy.deepcopy(model), tok, hooks=[AdvantageReweighting(alpha=0.0)], beta=0.01)
    for tr in (base, ar):
        tr.model.train()
        loss, _ = tr.loss(r, tr.token_advantages(r), r.completion_mask)
        tr.model.zero_grad(set_to_none=True)
        loss.backward()
        tr._loss = loss.detach()
    assert torch.equal(base._loss, ar._loss)
    for a, b in zip(_grads(base.model), _grads(ar.model)):
        assert (a is None and b is None) or torch.equal(a, b)


def _updated(model, tok, rollout, hooks):
    tr = _trainer(copy.deepcopy(model), tok, hooks=hooks)
    out = tr.update(rollout)
    return tr.model, out


def test_lopti_eta_one_and_zero_equal_plain_grpo(tiny):
    model, tok = tiny
    r = _trainer(copy.deepcopy(model), tok).rollout(PROMPTS)
    plain, _ = _updated(model, tok, r, [])
    for eta, skipped in ((1.0, "high"), (0.0, "low")):
        m, out = _updated(model, tok, r, [Lopti(eta=eta)])
        assert [s["stage"] for s in out["stages"] if s.get("skipped")] == [skipped]
        for a, b in zip(plain.parameters(), m.parameters()):
            assert torch.equal(a, b), eta


def test_lopti_stage_two_keeps_the_rollout_logp_old(tiny):
    model, tok = tiny
    # the untrained model's probabilities are all < 0.5: split at their median (the quantile variant)
    tr = _trainer(copy.deepcopy(model), tok, hooks=[Lopti(eta=0.5, quantile=True)], lr=5e-2)
    r = tr.rollout(PROMPTS)
    low, high = lopti_masks(r.logp_old, r.completion_mask, 0.5, quantile=True)
    assert low.sum() > 0 and high.sum() > 0, "the tiny model's rollout must have both kinds of tokens"
    before = r.logp_old.clone()
    seen = []
    orig = tr.loss

    def spy(rollout, adv, mask):
        seen.append(rollout.logp_old.clone())
        return orig(rollout, adv, mask)

    tr.loss = spy
    out = tr.update(r)
    assert [s["stage"] for s in out["stages"]] == ["low", "high"]
    assert all(torch.equal(x, before) for x in seen)  # both stages read the rollout's logp_old
    assert out["stages"][0]["ratio_dev"] == 0.0  # stage 1: the policy has not moved yet
    assert out["stages"][1]["ratio_dev"] > 1e-4  # stage 2: rho != 1 on H tokens (moved by stage 1)
    assert 0 < out["low_share"] < 1


def test_reward_errors_name_the_prompt(tiny):
    model, tok = tiny

    def nan_reward(prompts, completions, **_):
        return [float("nan") if i == 5 else 0.0 for i in range(len(completions))]

    def none_reward(prompts, completions, **_):
        return [None] * len(completions)

    def short_reward(prompts, completions, **_):
        return [0.0]

    for fn, match in ((nan_reward, r"completion 5 of prompt 1"), (none_reward, "completion 0 of prompt 0"),
                      (short_reward, "returned 1 values for 12")):
        tr = GRPOTrainer(copy.deepcopy(model), tok, fn, GRPOConfig(num_generations=4, max_completion_length=2))
        with pytest.raises(ValueError, match=match):
            tr.rollout(PROMPTS)


def test_empty_completions_are_skipped_with_a_warning(tiny):
    model, tok = tiny
    tr = _trainer(copy.deepcopy(model), tok)
    r = tr.rollout(PROMPTS)
    empty = Rollout(r.prompt_ids, r.prompt_mask, r.completion_ids, torch.zeros_like(r.completion_mask),
                    r.completions, r.rewards, r.advantages, r.logp_old, None, 4)
    before = [p.clone() for p in tr.model.parameters()]
    with pytest.warns(RuntimeWarning, match="every completion is empty"):
        out = tr.update(empty)
    assert out["skipped"] and all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_nan_weights_raise_before_any_update(tiny):
    model, tok = tiny
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(NumericalError, match="non-finite logits while sampling"):
        _trainer(m, tok).step(PROMPTS)
    tr = _trainer(copy.deepcopy(model), tok)
    r = tr.rollout(PROMPTS)
    with torch.no_grad():
        tr.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(NumericalError, match="non-finite logits at completion 0, position 0"):
        tr.update(r)


def test_trainer_step_metrics_and_determinism(tiny):
    model, tok = tiny
    outs = []
    for _ in range(2):
        tr = GRPOTrainer(copy.deepcopy(model), tok, _reward, GRPOConfig(num_generations=4, max_completion_length=3,
                         beta=0.001), optimizer=None, token_hooks=[AdvantageReweighting(0.3), Lopti(0.5)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = tr.step(PROMPTS, answer=ANSWERS)
        outs.append((m, [p.clone() for p in tr.model.parameters()]))
    m = outs[0][0]
    assert {"reward", "reward_std", "low_share", "kl", "clip_ratio", "stages", "update_s"} <= set(m)
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    with pytest.raises(ValueError, match="one value per prompt"):
        tr.step(PROMPTS, answer=ANSWERS[:2])
    with pytest.raises(ValueError, match="at most one token hook"):
        GRPOTrainer(model, tok, _reward, token_hooks=[Lopti(), Lopti()])


def test_hidden_gradient_norms_match_the_closed_form(tiny):
    model, tok = tiny
    r = _trainer(copy.deepcopy(model), tok).rollout(PROMPTS)
    g = hidden_grad_norms(model, r)
    assert len(g["grad_norm"]) == r.n_tokens
    for a, b in zip(g["grad_norm"], g["closed_form"]):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    q = quartile_means([1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1])
    assert q == [7.5, 5.5, 3.5, 1.5]
    probs = torch.softmax(torch.randn(3, 5), -1)
    w = torch.randn(5, 4)
    assert torch.allclose(closed_form_grad_norms(probs, torch.tensor([0, 1, 2]), w),
                          torch.stack([(w[t] - probs[i] @ w).norm() for i, t in enumerate([0, 1, 2])]))


def test_lora_policy_uses_the_disabled_adapter_as_reference(tiny):
    peft = pytest.importorskip("peft")
    model, tok = tiny
    policy = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "frozen copy" warning: the adapter is switched off instead
        tr = _trainer(policy, tok, beta=0.1)
    assert tr.ref_model is None and tr._ref_is_adapter
    r = tr.rollout(PROMPTS)
    with torch.no_grad():
        base = completion_logps(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    assert torch.allclose(r.logp_ref, base, atol=1e-6)  # LoRA's B starts at 0; the reference is the base model
    tr.update(r)
    r2 = tr.rollout(PROMPTS)
    with torch.no_grad():
        base2 = completion_logps(model, r2.prompt_ids, r2.prompt_mask, r2.completion_ids, r2.completion_mask)
    assert torch.allclose(r2.logp_ref, base2, atol=1e-6) and not torch.allclose(r2.logp_old, base2, atol=1e-6)


def test_registered():
    from rankwise.core import registry

    assert registry.get("lopti").family == "train"


# ------------------------------------------------------------------ TRL


def test_per_token_loss_equals_trl_compute_loss(tiny, tmp_path):
    pytest.importorskip("trl")
    from rankwise.train.lopti import grpo_trainer, trl_loss, trl_parity_inputs

    model, tok = tiny
    cfg = GRPOConfig(num_generations=4, max_completion_length=3, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                     loss_type="bnpo")
    rows = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS)]
    trainer = grpo_trainer(copy.deepcopy(model), tok, rows, _reward, cfg, prompts_per_step=3, steps=1, lr=1e-3,
                           policy_dir=tmp_path / "policy")
    assert trainer.ref_model is not None and (tmp_path / "policy" / "config.json").is_file()
    ours = GRPOTrainer(trainer.model, tok, _random_reward, cfg)
    r = ours.rollout(PROMPTS)
    g = torch.Generator().manual_seed(0)
    r.logp_old = r.logp_old + 0.3 * torch.randn(r.logp_old.shape, generator=g)  # rho != 1: clipping is exercised
    adv = reweight_advantages(r.advantages, r.logp_old, 0.3)  # (B, T) advantages, as AR's subclass passes
    trainer.model.train()
    logp = completion_logps(trainer.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    mine, _ = per_token_loss(logp, r.logp_old, adv, epsilon_low=0.2, epsilon_high=0.28, beta=0.04, logp_ref=r.logp_ref)
    valid = r.completion_mask.bool().nonzero().tolist()
    for i, t in valid:
        one = torch.zeros_like(r.completion_mask)
        one[i, t] = 1
        theirs = trl_loss(trainer, trl_parity_inputs(r, adv, loss_mask=one))
        assert math.isclose(float(theirs.detach()), float(mine[i, t].detach()), rel_tol=1e-5, abs_tol=1e-6), (i, t)
    # the aggregated bnpo loss and its gradient
    trainer.model.zero_grad(set_to_none=True)
    theirs = trl_loss(trainer, trl_parity_inputs(r, adv))
    theirs.backward()
    g_trl = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    trainer.model.zero_grad(set_to_none=True)
    logp = completion_logps(trainer.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    mine, _ = per_token_loss(logp, r.logp_old, adv, epsilon_low=0.2, epsilon_high=0.28, beta=0.04, logp_ref=r.logp_ref)
    loss = aggregate(mine, r.completion_mask, "bnpo")
    loss.backward()
    g_ours = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    assert math.isclose(float(theirs.detach()), float(loss.detach()), rel_tol=1e-5)
    for a, b in zip(g_trl, g_ours):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_ar_subclass_hands_trl_per_token_advantages(tiny):
    pytest.importorskip("trl")
    from rankwise.train.lopti import grpo_trainer

    model, tok = tiny
    rows = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS)]
    cfg = GRPOConfig(num_generations=4, max_completion_length=3)
    trainer = grpo_trainer(copy.deepcopy(model), tok, rows, _random_reward, cfg, prompts_per_step=3, steps=1,
                           lr=1e-3, reweighting=AdvantageReweighting(alpha=1.0))
    batch = [rows[i // 4] for i in range(12)]
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(batch)
    adv = out["advantages"]
    assert adv.shape == out["completion_ids"].shape
    # alpha = 1: each token's advantage is the sequence's advantage times pi_old, so |A'| <= |A| token-wise
    seq = adv[:, 0] / torch.exp(trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
        torch.cat([out["prompt_mask"], out["completion_mask"]], 1), out["completion_ids"].size(1))[0][:, 0])
    assert torch.all(adv.abs() <= seq.abs()[:, None] + 1e-6)
    trainer.train()  # one real optimiser step through TRL with (B, T) advantages
    assert trainer.state.global_step == 1
