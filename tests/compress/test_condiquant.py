"""compress/condiquant: the spec's correctness checks (prox, gradient, kappa never increases, lambda = 0,
orthogonal W0, zero overhead, 1x1 conv = Linear over channels) and bad inputs; PTQ against torch.ao."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from rankwise.compress.condiquant import (
    LAMBDA_GRID,
    SPEC_LAMBDA_GRID,
    CondiQuantConfig,
    act_qparams,
    condition_matrix,
    condition_model,
    fake_quant_weight,
    kappa,
    layer_matrix,
    layer_rows,
    load_quantized,
    output_grad,
    output_loss,
    prox_shave,
    prox_spread,
    ptq_quantize,
    rel_output_err,
    singular_values,
    weight_qparams,
)
from rankwise.core.errors import SelectionError


def _lowrank_x(n_tok: int, n: int, seed: int = 0) -> torch.Tensor:
    """Calibration rows whose covariance decays fast (nearly rank-deficient, as in the paper's Fig. 2)."""
    g = torch.Generator().manual_seed(seed)
    decay = torch.logspace(0, -4, n, dtype=torch.float64)
    return torch.randn(n_tok, n, generator=g, dtype=torch.float64) * decay


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Conv1x1Net(nn.Module):
    def __init__(self, mlp: MLP):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(8, 16, 1), nn.Conv2d(16, 8, 1)
        with torch.no_grad():
            for c, lin in ((self.fc1, mlp.fc1), (self.fc2, mlp.fc2)):
                c.weight.copy_(lin.weight[:, :, None, None])
                c.bias.copy_(lin.bias)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _calib(seed: int = 0, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -3, 8)
    return [torch.randn(32, 8, generator=g) * scale for _ in range(n)]


# ------------------------------------------------------------------------------------------ prox


@pytest.mark.parametrize("t", [0.0, 1e-3, 0.3, 5.0])
def test_spread_prox_keeps_mean_and_order_and_shrinks_deviations_exactly(t):
    s = torch.sort(torch.rand(12, dtype=torch.float64) * 3 + 0.01, descending=True).values
    p = prox_spread(s, t)
    assert torch.allclose(p.mean(), s.mean(), rtol=0, atol=1e-12)
    assert torch.allclose(p - s.mean(), (s - s.mean()) / (1 + 2 * t), rtol=0, atol=1e-12)
    assert bool((p[:-1] >= p[1:]).all())
    assert p[0] <= s[0] + 1e-15 and p[-1] >= s[-1] - 1e-15


@pytest.mark.parametrize("t", [0.0, 0.05, 0.5, 3.0])
def test_shave_prox_cuts_the_top_only_and_never_lowers_sigma_min(t):
    s = torch.sort(torch.rand(10, dtype=torch.float64) + 0.1, descending=True).values
    p = prox_shave(s, t, float(s[0]))
    assert bool((p[:-1] >= p[1:]).all()) and bool((p <= s).all())
    assert p[0] <= s[0] and p[-1] == s[-1]


def test_negative_prox_strength_is_refused():
    with pytest.raises(ValueError):
        prox_spread(torch.ones(3), -1.0)


# ------------------------------------------------------------------------------------- gradient


def test_gradient_matches_autograd_and_uses_fixed_target():
    X = _lowrank_x(50, 7)
    W0 = torch.randn(7, 5, dtype=torch.float64)
    W = (W0 + 0.1 * torch.randn(7, 5, dtype=torch.float64)).requires_grad_(True)
    H = X.T @ X
    L = float(torch.linalg.eigvalsh(H)[-1])
    f = 0.5 * ((X @ W - X @ W0) ** 2).sum() / L
    (g_auto,) = torch.autograd.grad(f, W)
    g = output_grad(H, W.detach(), W0, L)
    assert float((g - g_auto).norm() / g_auto.norm()) < 1e-5
    assert torch.allclose(output_loss(H, W.detach(), W0, L), f.detach())
    Y = X @ W0  # Y = X W0 fixed: grad = X^T (X W - Y) / L
    assert torch.allclose(g, X.T @ (X @ W.detach() - Y) / L)


def test_identity_calibration_measures_the_weight_change():
    W0 = torch.randn(6, 4, dtype=torch.float64)
    W = W0 + torch.randn(6, 4, dtype=torch.float64)
    X = torch.eye(6, dtype=torch.float64)
    assert torch.allclose(output_loss(X.T @ X, W, W0), 0.5 * ((W - W0) ** 2).sum())
    assert math.isclose(rel_output_err(X.T @ X, W, W0), float((W - W0).norm() / W0.norm()), rel_tol=1e-12)


# ----------------------------------------------------------------------------------- PGD on one W


@pytest.mark.parametrize("prox", ["spread", "shave"])
@pytest.mark.parametrize("lam", [1e-4, 1e-2, 1.0])
def test_kappa_never_increases_after_the_lambda_search(prox, lam):
    from rankwise.compress.condiquant import condition_weight

    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        X = _lowrank_x(64, 10, seed)
        W0 = torch.randn(10, 6, generator=g, dtype=torch.float64)
        r = condition_weight("w", W0, X.T @ X, CondiQuantConfig(prox=prox, lam=lam))
        assert r.kappa_after <= r.kappa_before
        assert r.rel_err <= 2e-3
        assert math.isclose(kappa(r.W), r.kappa_after, rel_tol=1e-9)


def test_a_rank_deficient_input_buys_more_kappa_for_less_output_error():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(80, 12, generator=g, dtype=torch.float64)
    Xd = X.clone()
    Xd[:, 6:] = 0.0  # X never excites half of the input space: W can move there at no output cost
    W0 = torch.randn(12, 8, generator=g, dtype=torch.float64)
    full = condition_matrix(W0, X.T @ X, 1e-2)
    deficient = condition_matrix(W0, Xd.T @ Xd, 1e-2)
    assert deficient.kappa < full.kappa < kappa(W0)
    assert deficient.rel_err < full.rel_err


def test_lambda_zero_returns_w0_exactly():
    W0 = torch.randn(5, 7, dtype=torch.float64)
    X = _lowrank_x(20, 5)
    r = condition_matrix(W0, X.T @ X, 0.0)
    assert torch.equal(r.W, W0) and r.iters == 0


def test_early_stop_keeps_the_output_budget():
    X = _lowrank_x(64, 10)
    W0 = torch.randn(10, 6, dtype=torch.float64)
    free = condition_matrix(W0, X.T @ X, 1.0, max_iters=100)
    stop = condition_matrix(W0, X.T @ X, 1.0, max_iters=100, max_rel_output_err=1e-2, early_stop=True)
    assert free.rel_err > 1e-2 >= stop.rel_err
    assert stop.iters < 100


def test_target_kappa_stops_the_iterations():
    X = _lowrank_x(64, 10)
    W0 = torch.randn(10, 6, dtype=torch.float64)
    r = condition_matrix(W0, X.T @ X, 1.0, max_iters=100, target_kappa=kappa(W0) * 0.9)
    assert r.kappa <= kappa(W0) * 0.9 and r.iters < 100


def test_default_grid_extends_the_spec_grid():
    assert set(SPEC_LAMBDA_GRID) <= set(LAMBDA_GRID)
    assert SPEC_LAMBDA_GRID == (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    assert CondiQuantConfig().lambdas() == tuple(sorted(LAMBDA_GRID, reverse=True))


# ------------------------------------------------------------------------------------ the model


def test_condition_model_zero_overhead_and_kappa_never_up():
    torch.manual_seed(0)
    m = MLP()
    before = {n: (p.shape, p.dtype, p.detach().clone()) for n, p in m.named_parameters()}
    rep = condition_model(m, _calib(), CondiQuantConfig(max_rel_output_err=1e-2))
    after = dict(m.named_parameters())
    assert set(after) == set(before)
    for n, (shape, dtype, value) in before.items():
        assert after[n].shape == shape and after[n].dtype == dtype
        if n.endswith("bias"):
            assert torch.equal(after[n], value)
    assert sum(p.numel() for p in m.parameters()) == sum(v[2].numel() for v in before.values())
    assert [r.name for r in rep.layers] == ["fc1", "fc2"]
    for r in rep.layers:
        assert r.kappa_after <= r.kappa_before
        assert math.isclose(kappa(layer_matrix(getattr(m, r.name))), r.kappa_after, rel_tol=1e-4)
    assert rep.conditioned and rep.median_kappa() < rep.median_kappa(after=False)
    assert "kappa" in rep.summary() and rep.to_dict()["layers"][0]["name"] == "fc1"


def test_lambda_zero_leaves_the_model_bit_identical():
    torch.manual_seed(1)
    m = MLP()
    ref = copy.deepcopy(m.state_dict())
    condition_model(m, _calib(), CondiQuantConfig(lam=0.0))
    assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())


def test_orthogonal_weight_is_left_alone():
    lin = nn.Linear(6, 6, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.linalg.qr(torch.randn(6, 6))[0])
    w = lin.weight.detach().clone()
    rep = condition_model(nn.Sequential(lin), [torch.randn(10, 6)], CondiQuantConfig())
    assert torch.equal(lin.weight, w) and rep.layers[0].status == "unchanged"


def test_a_1x1_conv_is_a_linear_over_channels():
    torch.manual_seed(2)
    mlp = MLP()
    conv = Conv1x1Net(mlp)
    calib_lin = _calib(3)
    calib_conv = [x.reshape(2, 4, 4, 8).permute(0, 3, 1, 2).contiguous() for x in calib_lin]
    x = calib_conv[0]
    assert torch.equal(layer_rows(conv.fc1, x), x.permute(0, 2, 3, 1).reshape(-1, 8))
    cfg = CondiQuantConfig(max_rel_output_err=1e-2)
    r_lin = condition_model(mlp, calib_lin, cfg)
    r_conv = condition_model(conv, calib_conv, cfg)
    for a, b in zip(r_lin.layers, r_conv.layers):
        assert a.lam == b.lam and math.isclose(a.kappa_after, b.kappa_after, rel_tol=1e-5)
    assert torch.allclose(conv.fc1.weight[:, :, 0, 0], mlp.fc1.weight, atol=1e-6)


def test_kxk_conv_rows_reproduce_the_conv():
    conv = nn.Conv2d(3, 5, 3, padding=1, stride=2)
    x = torch.randn(2, 3, 7, 7)
    y = conv(x).permute(0, 2, 3, 1).reshape(-1, 5)
    assert torch.allclose(layer_rows(conv, x) @ layer_matrix(conv) + conv.bias, y, atol=1e-5)


def test_grouped_convs_are_skipped_or_conditioned_per_group():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(4, 4, 1), nn.Conv2d(4, 8, 1, groups=2))
    calib = [torch.randn(2, 4, 5, 5) * torch.logspace(0, -3, 4)[:, None, None] for _ in range(2)]
    rep = condition_model(copy.deepcopy(net), calib, CondiQuantConfig(max_rel_output_err=1e-2))
    assert rep.layers[1].status.startswith("skipped: grouped")
    rep = condition_model(net, calib, CondiQuantConfig(max_rel_output_err=1e-2, grouped="per_group"))
    assert [r.name for r in rep.layers] == ["0", "1[0]", "1[1]"]
    assert all(r.kappa_after <= r.kappa_before for r in rep.layers)


def test_rank_deficient_weight_is_lifted_within_budget_or_skipped_with_a_warning(caplog):
    lin = nn.Linear(6, 4, bias=False)
    with torch.no_grad():
        lin.weight[2:] = 0.0  # rank 2: kappa = inf
    assert math.isinf(kappa(layer_matrix(lin)))
    with caplog.at_level(logging.WARNING):
        rep = condition_model(nn.Sequential(lin), [torch.randn(16, 6)], CondiQuantConfig())
    r = rep.layers[0]
    if r.status == "conditioned":
        assert math.isfinite(r.kappa_after) and r.rel_err <= 2e-3
    else:
        assert r.status.startswith("skipped: kappa = inf") and "kappa = inf" in caplog.text


def test_the_model_is_unchanged_when_calibration_fails():
    m = MLP()
    ref = copy.deepcopy(m.state_dict())
    bad = [torch.randn(4, 8), torch.full((4, 8), float("nan"))]
    with pytest.raises(ValueError, match="NaN|non-finite"):
        condition_model(m, bad, CondiQuantConfig())
    assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        condition_model(MLP(), [], CondiQuantConfig())
    with pytest.raises(ValueError, match="target_kappa"):
        CondiQuantConfig(target_kappa=0.5)
    with pytest.raises(ValueError, match="lam"):
        CondiQuantConfig(lam=-0.1)
    with pytest.raises(ValueError, match="prox"):
        CondiQuantConfig(prox="nuclear")
    with pytest.raises(ValueError, match="layer_types"):
        CondiQuantConfig(layer_types=(nn.LayerNorm,))
    with pytest.raises(SelectionError, match="fc1"):  # no matching layers: the error lists module names
        condition_model(MLP(), _calib(), CondiQuantConfig(skip=("fc1", "fc2")))
    with pytest.raises(TypeError):
        condition_model("model", _calib())


# ------------------------------------------------------------------------------------------ PTQ


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_activation_qparams_match_torch_ao_minmax_observer(bits):
    from torch.ao.quantization import MinMaxObserver

    x = torch.randn(1000) * 3 + 0.5
    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=2 ** bits - 1)
    obs(x)
    scale, zp = obs.calculate_qparams()
    s, z = act_qparams(float(x.min()), float(x.max()), bits)
    assert math.isclose(s, float(scale), rel_tol=1e-6) and z == int(zp)
    fq = torch.fake_quantize_per_tensor_affine(x, s, z, 0, 2 ** bits - 1)
    assert torch.unique(fq).numel() <= 2 ** bits
    assert float((fq - x).abs().max()) <= s / 2 * (1 + 1e-5)  # MinMax covers the data: error <= scale / 2


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_weight_quantizer_matches_torch_ao_per_channel_observer(bits):
    from torch.ao.quantization import FakeQuantize, PerChannelMinMaxObserver

    w = torch.randn(6, 5)
    q = 2 ** (bits - 1) - 1
    fq_mod = FakeQuantize(observer=PerChannelMinMaxObserver, quant_min=-q, quant_max=q, dtype=torch.qint8,
                          qscheme=torch.per_channel_symmetric, ch_axis=0)
    ref = fq_mod(w)
    scale, _ = weight_qparams(w, bits)
    assert torch.allclose(scale, fq_mod.scale, rtol=1e-6)
    ours = fake_quant_weight(w, bits)
    assert torch.equal(ours, ref)
    assert all(torch.unique(row).numel() <= 2 ** bits for row in ours)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_ptq_quantize_w_a_bits_and_levels(bits):
    torch.manual_seed(4)
    m = MLP()
    ref = copy.deepcopy(m.state_dict())
    q = ptq_quantize(m, _calib(), bits, bits)
    assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())  # the original is untouched
    for ql in q.quant_layers().values():
        assert torch.unique(ql.w_int).numel() <= 2 ** bits
        assert int(ql.w_int.abs().max()) <= 2 ** (bits - 1) - 1
    x = torch.randn(5, 8)
    assert q(x).shape == m(x).shape
    p = ptq_quantize(m, _calib(), bits, bits, observer="percentile", percentile=90.0)
    for n in q.info["ranges"]:
        lo_m, hi_m = q.info["ranges"][n]
        lo_p, hi_p = p.info["ranges"][n]
        assert lo_m <= lo_p <= hi_p <= hi_m


def test_weight_only_and_activation_only():
    m = MLP()
    w_only = ptq_quantize(m, _calib(), 3, None)
    a_only = ptq_quantize(m, _calib(), None, 3)
    assert w_only.info["ranges"] == {} and not hasattr(w_only.model.fc1, "a_scale")
    assert torch.equal(a_only.model.fc1.layer.weight, m.fc1.weight)


def test_ptq_save_load_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(5)
    m = MLP()
    q = ptq_quantize(m, _calib(), 3, 3)
    path = q.save(tmp_path / "q.safetensors")
    q2 = load_quantized(path, m)
    x = torch.randn(7, 8)
    with torch.no_grad():
        assert torch.equal(q(x), q2(x))


@pytest.mark.parametrize("bits", [1, 9, 0, 2.5, True])
def test_bits_outside_2_to_8_are_refused(bits):
    with pytest.raises(ValueError, match="bits"):
        ptq_quantize(MLP(), _calib(), bits, 4)
    with pytest.raises(ValueError, match="bits"):
        ptq_quantize(MLP(), _calib(), 4, bits)


def test_ptq_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        ptq_quantize(MLP(), [], 4, 4)
    with pytest.raises(ValueError, match="NaN"):
        ptq_quantize(MLP(), [torch.full((2, 8), float("inf"))], 4, 4)
    with pytest.raises(ValueError, match="observer"):
        ptq_quantize(MLP(), _calib(), 4, 4, observer="mse")
    with pytest.raises(SelectionError):
        ptq_quantize(MLP(), _calib(), 4, 4, skip=("fc1", "fc2"))


def test_registered():
    from rankwise.core import registry

    e = registry.get("condiquant")
    assert e.config is CondiQuantConfig and e.entry is condition_model
    assert singular_values(torch.eye(3)).tolist() == [1.0, 1.0, 1.0]
