"""LoRA-Mixer: the spec's correctness checks (identity at init, soft vs top-K vs hard fusion, equivalence
with single LoRAs and with PEFT LoRAs loaded as frozen experts, the RSL pieces and their gradients, the
preservation term, SSM names) and bad inputs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.adapt import lora_mixer as lm
from rankwise.adapt.lora_mixer import LoRAMixerConfig
from rankwise.core.errors import NumericalError, RankwiseError, SelectionError

QKVO = ("query", "key", "value", "attention.output.dense")


def _cfg(**kw) -> LoRAMixerConfig:
    base = dict(num_experts=3, rank=4, alpha=8, dropout=0.0, top_k_infer=2)
    base.update(kw)
    return LoRAMixerConfig(**base)


def _bert(seed: int = 0) -> nn.Module:
    return contract.tiny_model("bert", seed=seed)


def _mixers(model):
    return [(n, layer.mixer[a]) for n, layer in lm.mixer_layers(model) for a in layer.adapters]


def _layer(d_in=16, d_out=12, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_out))
    lm.adapt(model, _cfg(**kw), target=nn.Linear)
    contract.perturb_trainable(model, 3, std=0.5)
    return model, model[0].mixer["default"]


def _expert_outputs(mx, x):
    return torch.stack([(x @ mx.A[e].T) @ mx.B[e].T * mx.scalings[e] for e in range(mx.num_experts)], -2)


def test_identity_at_init():
    y0 = contract.forward(_bert(), "bert")
    model = lm.adapt(_bert(), _cfg(), target=QKVO)
    assert len(lm.mixer_layers(model)) == 8
    torch.testing.assert_close(contract.forward(model, "bert"), y0, atol=0, rtol=0)


def test_training_mode_uses_all_experts_with_softmax_weights():
    model, mx = _layer()
    x = torch.randn(5, 7, 16)
    model.train()
    y = model(x)
    p = torch.softmax(x @ mx.router.T, -1)
    expect = model[0].base_layer(x) + (p[..., None] * _expert_outputs(mx, x)).sum(-2)
    torch.testing.assert_close(y, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k, renorm", [(1, True), (2, True), (2, False)])
def test_eval_mode_keeps_exactly_k_experts(k, renorm):
    model, mx = _layer(top_k_infer=k, renormalize=renorm)
    x = torch.randn(4, 6, 16)
    p = torch.softmax(x @ mx.router.T, -1)
    gate = lm.topk_gate(p, k, renorm)
    assert ((gate > 0).sum(-1) == k).all()
    if renorm:
        torch.testing.assert_close(gate.sum(-1), torch.ones(4, 6))
    else:
        assert (gate.sum(-1) < 1).all()
    model.eval()
    with torch.no_grad():
        expect = model[0].base_layer(x) + (gate[..., None] * _expert_outputs(mx, x)).sum(-2)
        torch.testing.assert_close(model(x), expect, atol=1e-5, rtol=1e-5)


def test_topk_ties_go_to_lowest_index():
    p = torch.tensor([[0.2, 0.3, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    g = lm.topk_gate(p, 2, renormalize=False)
    assert torch.equal(g > 0, torch.tensor([[False, True, True, False], [True, True, False, False]]))
    g1 = lm.topk_gate(p, 1)
    assert torch.equal(g1.argmax(-1), torch.tensor([1, 0]))


def test_k_equal_e_in_eval_equals_soft_fusion_exactly():
    model = lm.adapt(_bert(), _cfg(top_k_infer=3), target=QKVO)
    contract.perturb_trainable(model, 1, std=0.3)
    y_topk = contract.forward(model, "bert")
    with lm.fusion(model, "soft"):
        y_soft = contract.forward(model, "bert")
    assert torch.equal(y_topk, y_soft)
    # with K < E the sparse gate differs from the soft one (same weights)
    model2 = lm.adapt(_bert(), _cfg(top_k_infer=2), target=QKVO)
    contract.perturb_trainable(model2, 1, std=0.3)
    with lm.fusion(model2, "soft"):
        torch.testing.assert_close(contract.forward(model2, "bert"), y_soft, atol=0, rtol=0)
    assert not torch.allclose(contract.forward(model2, "bert"), y_soft, atol=1e-6)


def test_hard_routing_equals_the_single_lora():
    from rankwise.adapt import lora

    model = lm.adapt(_bert(), _cfg(), target=("query", "value"))
    contract.perturb_trainable(model, 2, std=0.3)
    ids = contract.inputs("bert")
    for e in range(3):
        with torch.no_grad(), lm.hard_routing(model, torch.full((ids.shape[0],), e)):
            y = model(ids).last_hidden_state
        single = lora.adapt(_bert(), lora.LoraConfig(rank=4, alpha=8, target=("query", "value")))
        with torch.no_grad():
            for (n, mx), (n2, ll) in zip(_mixers(model), lora.lora_layers(single)):
                assert n == n2
                ll.lora_A["default"].weight.copy_(mx.A[e])
                ll.lora_B["default"].weight.copy_(mx.B[e])
            torch.testing.assert_close(single(ids).last_hidden_state, y, atol=1e-6, rtol=0)
    # mixed labels in one batch: each example gets its own expert
    with torch.no_grad(), lm.hard_routing(model, torch.tensor([2, 0])):
        both = model(ids).last_hidden_state
    with torch.no_grad(), lm.hard_routing(model, torch.tensor([2, 2])):
        two = model(ids).last_hidden_state
    torch.testing.assert_close(both[0], two[0], atol=1e-6, rtol=0)


def _peft_lora(tmp, seed: int):
    import peft

    torch.manual_seed(seed)
    pm = peft.get_peft_model(_bert(), peft.LoraConfig(r=2 + seed, lora_alpha=4, target_modules=["query", "value"],
                                                      init_lora_weights=False))
    pm.eval()
    path = tmp / f"peft{seed}"
    pm.save_pretrained(path)
    with torch.no_grad():
        y = pm(contract.inputs("bert")).last_hidden_state
    return path, y


def test_frozen_peft_loras_as_experts_with_one_hot_routing(tmp_path):
    (p0, y0), (p1, y1) = _peft_lora(tmp_path, 0), _peft_lora(tmp_path, 1)
    model = lm.adapt(_bert(), _cfg(num_experts=2, top_k_infer=1), target=("query", "value"), experts=[p0, p1])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("router" in n for n in trainable)  # plug-and-play: only routers train
    ids = contract.inputs("bert")
    for e, y in ((0, y0), (1, y1)):
        with torch.no_grad(), lm.hard_routing(model, torch.full((2,), e)):
            torch.testing.assert_close(model(ids).last_hidden_state, y, atol=1e-5, rtol=0)
    assert float(lm.preserve_loss(model)) == 0.0


def test_preserve_loss_gradient(tmp_path):
    p0, _ = _peft_lora(tmp_path, 0)
    model = lm.adapt(_bert(), _cfg(num_experts=2, preserve_beta=0.1), target=("query", "value"),
                     experts=[p0, p0], freeze_experts=False)
    assert float(lm.preserve_loss(model).detach()) == 0.0
    mx = _mixers(model)[0][1]
    with torch.no_grad():
        delta = torch.randn_like(mx.B[1])
        mx.B[1].add_(delta)
    loss = lm.preserve_loss(model)
    assert float(loss) == pytest.approx(0.1 * float(delta.square().sum()), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(mx.B[1].grad, 2 * 0.1 * delta, atol=1e-6, rtol=1e-5)
    assert float(mx.A[0].grad.abs().max()) == 0.0


def test_aux_loss_equals_alpha_at_uniform_and_f_has_no_gradient():
    e = 4
    p = torch.eye(e).repeat(3, 1).requires_grad_(True)  # each expert top-1 for a quarter of the tokens
    t = lm.rsl_terms(p, k=1)
    torch.testing.assert_close(t["p_bar"], torch.full((e,), 0.25), atol=1e-7, rtol=0)
    torch.testing.assert_close(t["f_bar"], torch.full((e,), 0.25))
    assert not t["f_bar"].requires_grad and t["p_bar"].requires_grad
    assert float(0.01 * e * (t["p_bar"] * t["f_bar"]).sum()) == pytest.approx(0.01)
    # per-token entropy, not the entropy of the batch mean (which would be log E here)
    assert float(t["entropy"]) == pytest.approx(0.0, abs=1e-9)
    assert lm.normalized_entropy(p) == pytest.approx(0.0, abs=1e-9)
    assert lm.normalized_entropy(torch.full((5, e), 0.25)) == pytest.approx(1.0)
    # top-k slot share / k
    t2 = lm.rsl_terms(torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 2), k=2)
    torch.testing.assert_close(t2["f_bar"], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    t3 = lm.rsl_terms(torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 2), k=2, f_definition="top1")
    torch.testing.assert_close(t3["f_bar"], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_entropy_gradient_matches_autograd_of_p_log_p():
    z = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    lm.rsl_terms(torch.softmax(z, -1))["entropy"].backward()
    z2 = z.detach().clone().requires_grad_(True)
    p = torch.softmax(z2, -1)
    (-(p * p.log()).sum(-1).mean()).backward()
    torch.testing.assert_close(z.grad.double(), z2.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sign", [1, -1])
def test_router_step_on_rsl_moves_entropy_by_sign(sign):
    model, mx = _layer(entropy_sign=sign, rsl_lambda=1.0, rsl_alpha=0.0)
    lm.set_stage(model, "router")
    x = torch.randn(64, 16)
    model.train()
    model(x)
    before = lm.normalized_entropy(mx.last_p)
    loss = lm.rsl_loss(model)
    loss.backward()
    with torch.no_grad():
        mx.router.sub_(0.5 * mx.router.grad)
        model(x)
    after = lm.normalized_entropy(mx.last_p)
    assert (after < before) if sign == 1 else (after > before)


def test_padding_is_excluded():
    p = torch.softmax(torch.randn(2, 5, 3), -1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    t = lm.rsl_terms(p, mask, k=2)
    flat = p.reshape(-1, 3)[mask.reshape(-1).bool()]
    ref = lm.rsl_terms(flat, k=2)
    for key in ("p_bar", "f_bar", "entropy"):
        torch.testing.assert_close(t[key], ref[key])
    with pytest.raises(ValueError, match="does not match"):
        lm.rsl_terms(p, mask[:, :4])


def test_rsl_loss_sums_layers_and_uses_the_mask():
    model = lm.adapt(_bert(), _cfg(), target=("query", "value"))
    contract.perturb_trainable(model, 4, std=0.5)
    model.train()
    ids = contract.inputs("bert")
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    model(ids, attention_mask=mask)
    total = lm.rsl_loss(model, mask)
    manual = 0.0
    for _, mx in _mixers(model):
        t = lm.rsl_terms(mx.last_p, mask, k=2)
        manual += 0.01 * 3 * float((t["p_bar"] * t["f_bar"]).sum()) + 0.01 * float(t["entropy"])
    assert float(total) == pytest.approx(manual, rel=1e-5)
    aux = lm.rsl_loss(model, mask, rsl_lambda=0.0)
    assert float(aux) < float(total)
    stats = lm.routing_stats(model, mask)
    assert len(stats) == 4 and all(0.0 <= s["entropy"] <= 1.0 for s in stats)
    assert all(abs(sum(s["top1_load"]) - 1) < 1e-9 for s in stats)


def test_ssm_style_names_are_targeted_by_default():
    class Mamba(nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj = nn.Linear(8, 16)
            self.conv = nn.Conv1d(16, 16, 3)
            self.out_proj = nn.Linear(16, 8)

        def forward(self, x):
            return self.out_proj(self.in_proj(x))

    model = nn.Sequential(Mamba(), Mamba())
    lm.adapt(model, LoRAMixerConfig(num_experts=2, rank=2, top_k_infer=1))
    assert [n for n, _ in lm.mixer_layers(model)] == ["0.in_proj", "0.out_proj", "1.in_proj", "1.out_proj"]


def test_set_stage_chooses_what_trains():
    model = lm.adapt(_bert(), _cfg(), target=("query",))
    lm.set_stage(model, "experts")
    assert all(("router" in n) != p.requires_grad for n, p in model.named_parameters() if "mixer" in n)
    lm.set_stage(model, "router")
    assert all(("router" in n) == p.requires_grad for n, p in model.named_parameters() if "mixer" in n)
    with pytest.raises(ValueError, match="stage"):
        lm.set_stage(model, "head")


def test_merge_raises_with_reason():
    model = lm.adapt(_bert(), _cfg(), target=("query",))
    with pytest.raises(RankwiseError, match="cannot be merged"):
        lm.merge(model)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

def test_config_bad_values_and_warnings():
    with pytest.raises(ValueError, match="top_k_infer"):
        LoRAMixerConfig(top_k_infer=0)
    with pytest.warns(UserWarning, match="capped"):
        assert LoRAMixerConfig(num_experts=2, top_k_infer=3).top_k_infer == 2
    with pytest.warns(UserWarning, match="plain LoRA"):
        LoRAMixerConfig(num_experts=1, top_k_infer=1)
    for kw in (dict(rank=0), dict(num_experts=0), dict(entropy_sign=0), dict(f_definition="mean"),
               dict(dropout=1.0), dict(rsl_lambda=-1.0), dict(alpha=0), dict(renormalize=1)):
        with pytest.raises(ValueError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            LoRAMixerConfig(**kw)


def test_expert_shape_mismatch_names_file_and_module(tmp_path):
    import peft

    p0, _ = _peft_lora(tmp_path, 0)
    other = contract.tiny_model("bert", hidden=48)
    pm = peft.get_peft_model(other, peft.LoraConfig(r=2, target_modules=["query", "value"]))
    pm.save_pretrained(tmp_path / "wide")
    model = _bert()
    before = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError, match=r"wide.*encoder\.layer\.0\.attention\.self\.query"):
        lm.adapt(model, _cfg(num_experts=2), target=("query", "value"), experts=[p0, tmp_path / "wide"])
    with pytest.raises(ValueError, match="expert"):
        lm.adapt(model, _cfg(num_experts=3), target=("query", "value"), experts=[p0, p0])
    with pytest.raises(ValueError, match="beyond the target"):
        lm.adapt(model, _cfg(num_experts=2), target=("query",), experts=[p0, p0])
    assert [(n, type(m)) for n, m in model.named_modules()] == before


def test_hard_routing_label_out_of_range():
    model = lm.adapt(_bert(), _cfg(), target=("query",))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        with lm.hard_routing(model, torch.tensor([0, 3])):
            pass
    with pytest.raises(ValueError):
        with lm.hard_routing(model, torch.tensor([-1, 0])):
            pass
    assert all(layer.hard_labels is None for _, layer in lm.mixer_layers(model))


def test_nan_router_logits_raise_naming_the_layer():
    model = lm.adapt(_bert(), _cfg(), target=("query",))
    with torch.no_grad():
        model.encoder.layer[1].attention.self.query.mixer["default"].router.fill_(float("nan"))
    with pytest.raises(NumericalError, match="encoder.layer.1.attention.self.query"):
        contract.forward(model, "bert")


def test_empty_target_lists_linear_layers():
    with pytest.raises(SelectionError, match="Available Linear layers: .*query"):
        lm.adapt(_bert(), _cfg(), target=("nothing_here",))


def test_rank_too_large_leaves_model_unchanged():
    model = _bert()
    before = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError, match="exceeds"):
        lm.adapt(model, _cfg(rank=64), target=("query",))
    assert [(n, type(m)) for n, m in model.named_modules()] == before
    assert math.isfinite(float(contract.forward(model, "bert").sum()))


def test_shared_router_per_layer(tmp_path):
    model = lm.adapt(_bert(), _cfg(share_router="layer"), target=QKVO)
    layer0 = model.encoder.layer[0].attention
    q, k, v = (getattr(layer0.self, n).mixer["default"] for n in ("query", "key", "value"))
    o = layer0.output.dense.mixer["default"]
    assert q.router is k.router is v.router and o.router is not q.router
    own = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "router" in n)
    assert own == 2 * 2 * 3 * 32  # two routers (QKV, O) per layer, E = 3, d = 32
    contract.perturb_trainable(model, 5, std=0.3)
    y = contract.forward(model, "bert")
    lm.save_adapter(model, tmp_path / "s")
    fresh = lm.load_adapter(_bert(), tmp_path / "s")
    fq = fresh.encoder.layer[0].attention.self.query.mixer["default"]
    assert fq.router is fresh.encoder.layer[0].attention.self.value.mixer["default"].router
    assert torch.equal(contract.forward(fresh, "bert"), y)
    with pytest.raises(ValueError, match="share_router"):
        LoRAMixerConfig(share_router="model")
