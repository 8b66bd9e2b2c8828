"""mtLoRA: the spec's correctness checks (identity at init, coarse router = HydraLoRA, routing on the
simplex, spectral and balance terms, the schedule, the parameter formula, block placement) and bad inputs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.adapt import mtlora
from rankwise.adapt.mtlora import MtLoRAConfig
from rankwise.core.errors import NumericalError, RankwiseError, SelectionError


def _bert(hidden: int = 32, layers: int = 2, seed: int = 0) -> nn.Module:
    return contract.tiny_model("bert", seed=seed, hidden=hidden)


def _perturb(model: nn.Module, seed: int = 1, std: float = 0.2) -> None:
    contract.perturb_trainable(model, seed, std)


def _adapters(model):
    return [(n, layer.mtlora[a]) for n, layer in mtlora.mtlora_layers(model) for a in layer.adapters]


def test_identity_at_init_and_change_after_training():
    y0 = contract.forward(_bert(), "bert")
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=16, num_experts=4, dropout=0.0))
    torch.testing.assert_close(contract.forward(model, "bert"), y0, atol=0, rtol=0)
    _perturb(model)
    assert not torch.allclose(contract.forward(model, "bert"), y0, atol=1e-4)


def test_ffn_block_placement_adds_to_the_ffn_output():
    """FFN(x) + Adapter(x), x = input of intermediate.dense, added before dropout/residual/LayerNorm."""
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3, dropout=0.0))
    _perturb(model)
    layer = model.encoder.layer[0]
    seen = {}
    layer.intermediate.register_forward_hook(lambda m, i, o: seen.update(x=i[0], act=o))
    layer.output.register_forward_hook(lambda m, i, o: seen.update(out=o))
    contract.forward(model, "bert")
    ad = layer.output.dense.mtlora["default"]
    with torch.no_grad():
        ffn = layer.output.dense.base_layer(seen["act"])
        expect = layer.output.LayerNorm(ffn + ad(seen["x"]) + seen["x"])
    torch.testing.assert_close(seen["out"], expect, atol=1e-6, rtol=0)
    # the attention output projection is not adapted with placement="ffn"
    assert not isinstance(layer.attention.output.dense, mtlora.MtLoRALinear)


def _hydra_reference(x, A, B, W_r, scaling):
    g = torch.softmax(x @ W_r.T, dim=-1)                       # (N, E)
    outs = torch.stack([(x @ A.T) @ B[i].T for i in range(B.shape[0])], dim=-2)  # (N, E, d)
    return scaling * (g[..., None] * outs).sum(-2)


def test_coarse_group_equals_hydralora_router():
    torch.manual_seed(0)
    d, r, e = 32, 4, 3
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=r, alpha=8, num_experts=e, routing_group_size=d, dropout=0.0))
    _perturb(model)
    ad = model.encoder.layer[0].output.dense.mtlora["default"]
    assert ad.groups == 1
    x = torch.randn(5, d)
    with torch.no_grad():
        torch.testing.assert_close(ad(x), _hydra_reference(x, ad.A, ad.B, ad.router, ad.scaling), atol=1e-6, rtol=0)


def test_fgr_with_identical_group_routers_equals_coarse():
    d, e = 32, 3
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=e, routing_group_size=4, dropout=0.0))
    _perturb(model)
    ad = model.encoder.layer[0].output.dense.mtlora["default"]
    assert ad.groups == 8
    with torch.no_grad():  # every group gets the same router rows -> same weights in every group
        rows = ad.router[:e].clone()
        ad.router.copy_(rows.repeat(ad.groups, 1))
    x = torch.randn(6, d)
    with torch.no_grad():
        torch.testing.assert_close(ad(x), _hydra_reference(x, ad.A, ad.B, rows, ad.scaling), atol=1e-6, rtol=0)


def test_dimension_specific_routing_differs_per_group():
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3, routing_group_size=8, dropout=0.0))
    _perturb(model, std=1.0)
    ad = model.encoder.layer[0].output.dense.mtlora["default"]
    g = ad.routing(torch.randn(7, 32))
    assert g.shape == (7, 4, 3)
    assert (g >= 0).all()
    torch.testing.assert_close(g.sum(-1), torch.ones(7, 4))
    assert not torch.allclose(g[:, 0], g[:, 1])


def test_routing_weights_on_simplex_and_nan_raises():
    logits = torch.randn(2, 5, 12) * 10
    g = mtlora.routing_weights(logits, num_groups=3, num_experts=4)
    assert g.shape == (2, 5, 3, 4) and (g >= 0).all()
    torch.testing.assert_close(g.sum(-1), torch.ones(2, 5, 3))
    logits[0, 0, 0] = float("nan")
    with pytest.raises(NumericalError, match="my.layer"):
        mtlora.routing_weights(logits, 3, 4, where="my.layer")


def test_nan_router_in_model_raises_naming_the_layer():
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3))
    with torch.no_grad():
        model.encoder.layer[1].output.dense.mtlora["default"].router.fill_(float("nan"))
    with pytest.raises(NumericalError, match="encoder.layer.1.output.dense"):
        contract.forward(model, "bert")


@pytest.mark.parametrize("basis", mtlora.BASES)
def test_spectral_penalty_zero_for_orthogonal_equal_norm_columns(basis):
    q, _ = torch.linalg.qr(torch.randn(20, 5, dtype=torch.float64))
    assert float(mtlora.spectral_penalty(3.0 * q, basis)) < 1e-20
    for seed in range(5):
        B = torch.randn(20, 5, generator=torch.Generator().manual_seed(seed))
        assert float(mtlora.spectral_penalty(B, basis)) >= 0.0


@pytest.mark.parametrize("basis", mtlora.BASES)
def test_spectral_gradient_treats_weights_and_norm_as_constants(basis):
    B = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    mtlora.spectral_penalty(B, basis).backward()
    with torch.no_grad():
        U, s, Vh = torch.linalg.svd(B, full_matrices=False)
        w = torch.exp(-s / s.mean())
        c2 = B.square().sum() / 4
        V = Vh.T if basis == "singular" else torch.eye(4, dtype=torch.float64)
    Bc = B.detach().clone().requires_grad_(True)
    D = V.T @ (Bc.T @ Bc) @ V - c2 * torch.eye(4, dtype=torch.float64)
    (w[:, None] * w[None, :] * D).square().sum().backward()
    torch.testing.assert_close(B.grad, Bc.grad, atol=1e-10, rtol=1e-8)


def test_spectral_weights_favour_low_singular_values_and_degenerate_fallback():
    w = mtlora.spectral_weights(torch.tensor([4.0, 2.0, 0.5]))
    assert w[0] < w[1] < w[2] <= 1.0
    torch.testing.assert_close(mtlora.spectral_weights(torch.zeros(3)), torch.ones(3))
    zero = torch.zeros(10, 3, requires_grad=True)
    val = mtlora.spectral_penalty(zero)
    assert float(val.detach()) == 0.0
    val.backward()
    assert torch.isfinite(zero.grad).all()


def test_balance_loss():
    uniform = torch.full((4, 6, 2, 5), 0.2)
    assert float(mtlora.balance_loss(uniform)) == pytest.approx(0.0, abs=1e-12)
    peaked = torch.softmax(torch.tensor([5.0, 0, 0, 0]), 0).expand(8, 4)
    p = peaked[0]
    assert float(mtlora.balance_loss(peaked)) == pytest.approx(float(p.var() / p.mean() ** 2), rel=1e-6)
    assert float(mtlora.balance_loss(torch.ones(3, 1))) == 0.0


def test_regularizer_schedule_and_gradients():
    cfg = MtLoRAConfig(rank=4, alpha=8, num_experts=3, dropout=0.0, spectral_every=5, spectral_lambda=0.5,
                       balance_alpha=0.01)
    model = mtlora.adapt(_bert(), cfg)
    _perturb(model)
    contract.forward(model, "bert")  # no_grad forward records detached routing
    with torch.enable_grad():
        model(contract.inputs("bert"))
    bal = sum(0.01 * mtlora.balance_loss(ad.last_routing) for _, ad in _adapters(model))
    for step in (0, 1, 4, 6):
        assert float(mtlora.mtlora_regularizers(model, step)) == pytest.approx(float(bal), rel=1e-6)
    spec = torch.stack([mtlora.spectral_penalty(ad.B[i]) for _, ad in _adapters(model) for i in range(3)]).mean()
    for step in (5, 10):
        total = mtlora.mtlora_regularizers(model, step)
        assert float(total) == pytest.approx(float(bal + 0.5 * spec), rel=1e-5)
    assert [s for s in range(12) if mtlora.spectral_due(s, 5)] == [5, 10]
    total.backward()
    ads = _adapters(model)
    assert all(ad.B.grad is not None and ad.B.grad.abs().sum() > 0 for _, ad in ads)
    assert all(ad.router.grad is not None for _, ad in ads)


def test_spectral_sample_limit():
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3, spectral_every=1,
                                               spectral_max_matrices=2, balance_alpha=0.0))
    _perturb(model)
    a = mtlora.mtlora_regularizers(model, 3)
    b = mtlora.mtlora_regularizers(model, 3)
    assert float(a) == float(b) > 0


def test_parameter_formula():
    d, r, e, gs = 32, 4, 3, 8
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=r, alpha=8, num_experts=e, routing_group_size=gs))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = 2
    assert trainable == blocks * (d * r + e * r * d + e * (d // gs) * d)
    assert trainable == blocks * mtlora.num_parameters(d, d, r, e, d // gs)
    # the spec's MiniLM check: HydraLoRA on query+value vs block-FFN with G = 2
    hydra = 12 * mtlora.num_parameters(384, 384, 8, 4, 1)
    block = 6 * mtlora.num_parameters(384, 384, 8, 4, 2)
    assert (hydra, block) == (202_752, 110_592)


def test_hydralora_config_is_component_coarse_without_spectral():
    cfg = mtlora.hydralora_config(rank=4, alpha=8, num_experts=3)
    model = mtlora.adapt(_bert(), cfg)
    names = [n for n, _ in mtlora.mtlora_layers(model)]
    assert names == [f"encoder.layer.{i}.attention.self.{p}" for i in range(2) for p in ("query", "value")]
    assert all(ad.groups == 1 for _, ad in _adapters(model))
    assert cfg.spectral_lambda == 0.0


def test_single_expert_has_no_router_and_no_balance():
    with pytest.warns(UserWarning, match="router"):
        MtLoRAConfig(num_experts=1, routing_group_size=8)
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=1))
    assert all(ad.router is None for _, ad in _adapters(model))
    model(contract.inputs("bert"))
    assert float(mtlora.mtlora_regularizers(model, 1)) == 0.0


def test_merge_raises_with_reason():
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3))
    with pytest.raises(RankwiseError, match="cannot be merged"):
        mtlora.merge(model)
    with pytest.raises(RankwiseError):
        mtlora.unmerge(model)


def test_delete_and_unload_restore_base_modules():
    base = _bert()
    y0 = contract.forward(base, "bert")
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3, placement="both"))
    _perturb(model)
    mtlora.delete_adapter(model, "default")
    assert not mtlora.mtlora_layers(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in base.modules()]
    torch.testing.assert_close(contract.forward(model, "bert"), y0, atol=0, rtol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank"), (dict(num_experts=0), "num_experts"), (dict(alpha=-1), "alpha"),
    (dict(placement="mlp"), "placement"), (dict(routing_group_size=0), "routing_group_size"),
    (dict(dropout=1.0), "dropout"), (dict(spectral_every=0), "spectral_every"),
    (dict(spectral_basis="eig"), "spectral_basis"), (dict(balance_alpha=float("nan")), "balance_alpha"),
    (dict(block_pairs=(("a",),)), "block_pairs"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MtLoRAConfig(**kwargs)


def _assert_untouched(model, before):
    assert [(n, type(m)) for n, m in model.named_modules()] == before


def test_bad_inputs_leave_model_unchanged():
    model = _bert()
    before = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError, match="does not divide d_out=32"):
        mtlora.adapt(model, MtLoRAConfig(rank=4, num_experts=3, routing_group_size=5))
    _assert_untouched(model, before)
    with pytest.raises(ValueError, match="exceeds min"):
        mtlora.adapt(model, MtLoRAConfig(rank=33, num_experts=3))
    _assert_untouched(model, before)
    mlp = contract.tiny_model("mlp")
    with pytest.raises(SelectionError, match="no transformer block") as info:
        mtlora.adapt(mlp, MtLoRAConfig(rank=2, num_experts=2))
    assert "Linear layers found: 0, 2, 4" in str(info.value)
    with pytest.raises(SelectionError, match="matched no Linear"):
        mtlora.adapt(model, MtLoRAConfig(placement="component", target=("nope",)))
    _assert_untouched(model, before)


def test_custom_block_pairs_and_block_target():
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=2, num_experts=2, block_pairs=(("attention.self.key", "attention.output.dense"),),
                                               placement="attention"), target="encoder.layer.1")
    names = [n for n, layer in mtlora.mtlora_layers(model) if layer.adapters]
    assert names == ["encoder.layer.1.attention.output.dense"]
    assert mtlora.mtlora_layers(model)[0][0] == "encoder.layer.1.attention.self.key"


def test_save_load_keeps_placement(tmp_path):
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3, placement="both", dropout=0.0))
    _perturb(model)
    y = contract.forward(model, "bert")
    mtlora.save_adapter(model, tmp_path / "a")
    fresh = mtlora.load_adapter(_bert(), tmp_path / "a")
    torch.testing.assert_close(contract.forward(fresh, "bert"), y, atol=0, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mtlora.adapter_names(fresh) == ["default"]


def test_spectrum_report():
    model = mtlora.adapt(_bert(), MtLoRAConfig(rank=4, alpha=8, num_experts=3))
    rows = mtlora.spectrum_report(model)
    assert len(rows) == 2 * 3 and all(r["singular_values"] == [0.0] * 4 for r in rows)
    assert all(r["weights"] == [1.0] * 4 for r in rows)  # degenerate B: uniform weights
    _perturb(model)
    s = mtlora.spectrum_report(model)[0]["singular_values"]
    assert s == sorted(s, reverse=True) and s[0] > 0
