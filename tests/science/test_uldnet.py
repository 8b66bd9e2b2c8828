"""ULD-Net: PolyNorm's quadratic, per-sample axis, conversion, training switch, depth counting and the
CKKS export's parameter choice and bad inputs (HE runs on a tiny context)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from rankwise.science import uldnet as U


def _trained(sizes=(8, 8, 4), epochs=3, axis="per_sample", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (64,), generator=g)
    cfg = U.ULDConfig(axis=axis, warmup_frac=0.34, blend_frac=0.0, act_dropout=0.0)
    m = U.convert(U.mlp(sizes, seed=seed), cfg)
    res = U.train(m, [(x[:32], y[:32]), (x[32:], y[32:])], epochs=epochs, config=cfg)
    return m, x, res


def test_g_matches_inverse_sqrt_at_the_anchor_and_suppresses():
    for k in (2.438, 3.0, 4.0, 4.9):
        for mu in (0.5, 2.0, 3.0):
            a, b, c = U.g_coefficients(k, mu)
            assert U.g_value(mu, k, mu) == pytest.approx(mu**-0.5, abs=1e-9)
            assert 2 * a * (mu - b) == pytest.approx(-0.5 * mu**-1.5, abs=1e-9)  # g'(mu)
            s = np.linspace(1e-4, k * mu, 2000)[:-1]
            assert np.all(U.g_value(s, k, mu) <= 1 / np.sqrt(s) + 1e-12)
    a, b, c = U.g_coefficients(4.0, 2.0)
    assert (a, b, c) == pytest.approx((0.014731, 8.0, 0.176777), abs=1e-6)


@pytest.mark.parametrize("k", [1.0, 5.0, 0.5, 7.0])
def test_k_outside_open_interval_rejected(k):
    with pytest.raises(ValueError, match="ULDConfig.k"):
        U.ULDConfig(k=k)


def test_bad_config_fields():
    with pytest.raises(ValueError, match="ULDConfig.act_degree"):
        U.ULDConfig(act_degree=4)
    with pytest.raises(ValueError, match="ULDConfig.axis"):
        U.ULDConfig(axis="token")


def test_polynorm_equals_exact_normalisation_when_v_is_one():
    n = U.PolyNorm(16, U.ULDConfig())
    x = torch.randn(5, 16, dtype=torch.float64)
    n.running_var = x.var(1, unbiased=False)[0].clone()  # V-bar = Var of sample 0 -> v = 1 there
    n.num_batches_tracked += 1
    n.eval()
    out = n.double()(x)[0]
    ref = (x[0] - x[0].mean()) / x[0].var(unbiased=False).sqrt()
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.filterwarnings("ignore::rankwise.science.uldnet.PolyNormRangeWarning")
def test_per_sample_axis_ignores_other_samples():
    m, x, _ = _trained()
    m.eval()
    a = m(x[:8])[0]
    b = m(torch.cat([x[:1], 10 * torch.randn(7, x.shape[1])]))[0]
    c = m(x[:8].flip(0))[-1]
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)


def test_convert_makes_everything_polynomial_and_polyact_starts_as_identity():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.ReLU(), nn.Linear(8, 2))
    assert U.non_polynomial_modules(model)
    U.convert(model, U.ULDConfig(act_dropout=0.0))
    assert U.non_polynomial_modules(model) == []
    act = model[2]
    x = torch.randn(3, 8)
    assert isinstance(act, U.PolyAct) and torch.equal(act.eval()(x), x)
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.MaxPool2d(2))
    U.convert(cnn)
    assert isinstance(cnn[3], nn.AvgPool2d) and cnn[1].normalized_shape == (2, 1, 1)
    assert cnn.eval()(torch.randn(2, 1, 8, 8)).shape == (2, 2, 3, 3)


def test_training_switches_and_penalises():
    m, _, res = _trained(epochs=3)
    assert res.mix == [0.0, 1.0, 1.0] and res.switch_epoch == 1
    assert res.penalty[0] == 0.0 and res.penalty[1] > 0.0
    assert all(float(n.mix) == 1.0 and n.estimated for n in U.polynorms(m))
    assert U.mix_schedule(10, 0.2, 0.2) == [0, 0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1]


def test_out_of_range_variance_warns():
    m, x, _ = _trained()
    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        m(x)
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        m(100 * x)
    def flagged(ws: list) -> int:  # samples the warnings name as outside the approximation's range
        return sum(int(str(w.message).split("PolyNorm: ")[1].split(" sample")[0]) for w in ws
                   if issubclass(w.category, U.PolyNormRangeWarning))

    assert flagged(outside) > flagged(inside)
    assert flagged(outside) >= len(x)


def test_running_vbar_is_the_mean_of_the_per_sample_variances():
    """V-bar is the spec's running mean of Var[x] over training samples (cumulative average over the first
    1/momentum batches), not a per-batch or a max statistic: so E[mu v] = mu on the training data."""
    n = U.PolyNorm(16, U.ULDConfig()).train()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 16, generator=g) * (0.5 + 3 * torch.rand(8, 1, generator=g)) for _ in range(5)]
    for b in batches:
        n(b)
    var = torch.cat(batches).var(1, unbiased=False)
    assert torch.allclose(n.running_var, var.mean(), rtol=1e-6)
    assert float(n.running_var) < 0.5 * float(var.max())


def test_range_warning_flags_exactly_the_samples_beyond_k_times_vbar():
    """On the training inputs, the samples the warning counts are those whose own variance exceeds k V-bar
    (mu v >= k mu): a real tail of the per-sample variances (8 features), not a mis-estimated V-bar."""
    m, x, _ = _trained()
    norm = U.polynorms(m)[0]
    seen = []
    hook = norm.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].detach()))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        m(x)
    hook.remove()
    var = seen[0].var(1, unbiased=False)
    beyond = int((var >= norm.config.k * norm.running_var).sum())
    flagged = sum(int(str(w.message).split("PolyNorm: ")[1].split(" sample")[0]) for w in ws
                  if issubclass(w.category, U.PolyNormRangeWarning))
    assert flagged == beyond
    assert abs(float(var.mean() / norm.running_var) - 1) < 0.1  # V-bar is the mean variance of these inputs


def test_depth_counting_per_operator():
    m, _, _ = _trained()
    d = U.count_depth(m.eval())
    assert [(o.kind, o.depth) for o in d.ops] == [("linear", 1), ("polynorm", 3), ("act", 2), ("linear", 1)]
    assert d.total == 7 and max(o.depth for o in d.ops) <= 3


def test_parameter_choice_under_128_bit_security():
    assert U.choose_parameters(4) == (8192, [40, 30, 30, 30, 30, 40])
    n, bits = U.choose_parameters(11)
    assert n == 16384 and sum(bits) == 410 <= 438
    assert U.choose_parameters(12)[0] == 32768  # 440 bits > 438
    assert U.choose_parameters(26)[0] == 32768
    with pytest.raises(U.DepthError, match=r"depth 27 .*largest supported N = 32768 \(depth <= 26\)"):
        U.choose_parameters(27)


def test_depth_beyond_largest_n_errors_on_export():
    layers = []
    for _ in range(7):  # 7 x (1 + 3) = 28 levels > 26
        layers += [nn.Linear(8, 8), U.PolyFitAct([0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.1])]
    with pytest.raises(U.DepthError, match="depth"):
        U.export_ckks(nn.Sequential(*layers).eval())


@pytest.mark.parametrize("bad", [nn.Softmax(-1), nn.LayerNorm(8), nn.ReLU()])
def test_unsupported_op_named(bad):
    m = nn.Sequential(nn.Linear(8, 8), bad, nn.Linear(8, 4))
    with pytest.raises(U.UnsupportedOpError, match=f"module '1' \\({type(bad).__name__}\\)"):
        U.export_ckks(m)


def test_untrained_polynorm_refused():
    m = U.convert(U.mlp((8, 8, 4)))
    with pytest.raises(U.UnsupportedOpError, match="V-bar not yet estimated"):
        U.export_ckks(m.eval())


def test_batch_axis_refused_at_export():
    m, _, _ = _trained(axis="batch")
    with pytest.raises(U.UnsupportedOpError, match="per-sample"):
        U.export_ckks(m.eval())


def test_posthoc_replaces_relu_and_layernorm():
    torch.manual_seed(0)
    m = U.mlp((8, 8, 4))
    x = torch.randn(64, 8)
    ref = m(x)
    U.posthoc(m, x)
    assert U.non_polynomial_modules(m) == []
    assert (m(x) - ref).abs().max() < 0.2
    assert [o.kind for o in U.count_depth(m).ops] == ["linear", "chebnorm", "act", "linear"]
    assert U.count_depth(m).total == 11


def test_plan_matches_the_module_in_plain_arithmetic():
    from rankwise.science.uldnet import he as H

    m, x, _ = _trained()
    m.eval()
    steps, _, _ = H._plan(m)
    v = x[:3].double().numpy()
    for s in steps:
        d = s.data
        if s.kind == "linear":
            v = v @ d["M"] + d["c"]
        elif s.kind == "polynorm":
            v = v * (((v**2).sum(1, keepdims=True) + d["shift"]) ** 2 + d["c"])
        elif s.kind == "act":
            v = sum(d["B"][j] * v**j for j in range(len(d["B"])))
    with torch.no_grad():
        assert np.abs(v - m(x[:3]).double().numpy()).max() < 1e-5


def test_seal_primes_are_ntt_friendly():
    ps = U.seal_primes(8192, [40, 30, 30, 40])
    assert [p.bit_length() for p in ps] == [40, 30, 30, 40]
    assert all((p - 1) % 16384 == 0 for p in ps) and ps[1] < ps[2]


def test_encrypted_matches_plaintext_on_a_tiny_context():
    pytest.importorskip("tenseal")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    cfg = U.ULDConfig(warmup_frac=0.0, blend_frac=0.0)
    m = U.convert(U.mlp((8, 8, 4), seed=0), cfg)
    m[2] = nn.Identity()  # Linear -> PolyNorm -> Linear: depth 1 + 3 + 1
    U.train(m, [(x, y)], epochs=2, config=cfg)
    # 28-bit inner / 36-bit outer primes keep depth 5 inside N = 8192 (212 <= 218 bits; keys in about a second)
    he = U.export_ckks(m, inner_bits=28, outer_bits=36)
    assert he.poly_modulus_degree == 8192 and he.depth == 5
    with torch.no_grad():
        ref = m(x[:2]).double()
    out = he.infer_encrypted(x[:2])
    assert (out - ref).abs().max() < 1e-2
    assert he.levels_used == he.depth and he.decryptions == 2


def test_encrypted_polyact_at_the_prime_policy_fits_n_8192():
    pytest.importorskip("tenseal")
    torch.manual_seed(0)
    act = U.PolyAct(U.ULDConfig(act_dropout=0.0))
    with torch.no_grad():
        act.alpha.copy_(torch.tensor([0.5, 0.8, -1.5]))
    m = nn.Sequential(nn.Linear(8, 8), act, nn.Linear(8, 3)).eval()
    he = U.export_ckks(m)
    assert (he.poly_modulus_degree, he.coeff_mod_bit_sizes) == (8192, [40, 30, 30, 30, 30, 40])
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert (he.infer_encrypted(x) - m(x).double()).abs().max() < 1e-2


@pytest.mark.slow
def test_encrypted_digits_model_at_the_prime_policy():
    pytest.importorskip("tenseal")
    m, x, _ = _trained(sizes=(64, 64, 10))
    m.eval()
    he = U.export_ckks(m)
    assert he.poly_modulus_degree == 16384 and he.coeff_mod_bit_sizes == [40] + [30] * 7 + [40]
    with torch.no_grad():
        ref = m(x[:1]).double()
    assert (he.infer_encrypted(x[:1]) - ref).abs().max() < 1e-2
    assert he.levels_used == 7


def test_tenseal_missing_gives_install_hint(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "tenseal":
            raise ImportError("no tenseal")
        return real(name, *a, **k)

    m, _, _ = _trained()
    he = U.export_ckks(m.eval())
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"rankwise\[he\]"):
        he.context
