"""WinQ and the QAT baselines: the spec's correctness checks and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rankwise.core.errors import NumericalError, RankwiseError, SelectionError
from rankwise.train.qat import (
    QATConfig,
    QuantLinear,
    WinQCallback,
    WinQConfig,
    distance_to_grid,
    distinct_levels,
    export_quantized,
    fake_quant,
    interpolation_reset,
    load_quantized,
    perturbed_gradient,
    prepare_qat,
    quant_layers,
    winq,
)
from rankwise.train.qat.baselines import init_scale, resolve

ALL = [("seq", 2), ("seq", 3), ("ternary", 1.58), ("sign", 1), ("lsq", 2), ("lsq", 4), ("minmax", 2),
       ("minmax", 3), ("paretoq", 1), ("paretoq", 1.58), ("paretoq", 2), ("paretoq", 3), ("paretoq", 4),
       ("lsq", 8)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _data(seed=1):
    g = _gen(seed)
    return torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _layer(quantizer, bits, seed=0, shape=(6, 20)):
    g = _gen(seed)
    lin = nn.Linear(shape[1], shape[0])
    with torch.no_grad():
        lin.weight.copy_(torch.randn(shape, generator=g) * 0.3)
    return QuantLinear.from_linear(lin, quantizer, bits)


# --------------------------------------------------------------------------------------------------
# quantizers


@pytest.mark.parametrize("quantizer,bits", ALL)
def test_at_most_2_pow_b_levels_per_channel(quantizer, bits):
    layer = _layer(quantizer, bits)
    w_hat = layer.quantized_weight(noisy=False)
    limit = 3 if bits == 1.58 else 2 ** int(bits)
    assert distinct_levels(w_hat) <= limit
    if bits <= 2:
        assert distinct_levels(w_hat) >= 2


def test_seq_levels_match_paretoq():
    layer = _layer("seq", 2)
    alpha = layer.clip.detach()
    levels = torch.unique((layer.quantized_weight(noisy=False) / alpha).round(decimals=5))
    assert set(levels.tolist()) <= {-0.75, -0.25, 0.25, 0.75}
    t = _layer("ternary", 1.58)
    lv = torch.unique((t.quantized_weight(noisy=False) / t.clip.detach()).round(decimals=4))
    assert set(lv.tolist()) <= set(torch.tensor([-2 / 3, 0.0, 2 / 3]).round(decimals=4).tolist())


def test_init_scales_follow_the_spec():
    w = torch.randn(5, 12, generator=_gen(2))
    a = w.abs()
    assert torch.allclose(init_scale(w, "sign", 1), a.mean(1, keepdim=True))
    assert torch.allclose(init_scale(w, "seq", 2), a.amax(1, keepdim=True))
    assert torch.allclose(init_scale(w, "lsq", 4, "paretoq"), a.amax(1, keepdim=True) / 7)
    assert torch.allclose(init_scale(w, "lsq", 4), 2 * a.mean(1, keepdim=True) / math.sqrt(7))
    assert init_scale(w, "minmax", 2) is None


def test_lsq_gradients_match_the_formulas_and_torch_learnable_fake_quant():
    g = _gen(3)
    w = (torch.randn(4, 10, generator=g) * 2).requires_grad_(True)
    s = (torch.rand(4, 1, generator=g) * 0.3 + 0.2).requires_grad_(True)
    bits, qn, qp = 3, 4, 3
    upstream = torch.randn(4, 10, generator=g)
    out = fake_quant(w, s, "lsq", bits)
    out.backward(upstream)
    v = (w / s).detach()
    inside = (v >= -qn) & (v <= qp)
    ds_elem = torch.where(inside, torch.round(v) - v, torch.where(v < -qn, -float(qn), float(qp)))
    gscale = 1 / math.sqrt(w.numel() * qp)
    assert torch.allclose(w.grad, upstream * inside)
    assert torch.allclose(s.grad, (ds_elem * upstream).sum(1, keepdim=True) * gscale, atol=1e-6)
    # torch's learnable per-channel fake quant (zero point 0, range [-Q_N, Q_P]) as a cross-check
    w2, s2 = w.detach().clone().requires_grad_(True), s.detach().view(-1).clone().requires_grad_(True)
    ref = torch._fake_quantize_learnable_per_channel_affine(w2, s2, torch.zeros(4), 0, -qn, qp, gscale)
    ref.backward(upstream)
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.allclose(w.grad, w2.grad) and torch.allclose(s.grad.view(-1), s2.grad, atol=1e-5)


def test_minmax_ste_gradient_is_identity_and_scale_is_not_learned():
    w = torch.randn(3, 9, generator=_gen(4)).requires_grad_(True)
    out = fake_quant(w, None, "minmax", 2)
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))  # max|W| sits on Q_P: nothing is clipped
    s = w.detach().abs().amax(1, keepdim=True)
    assert torch.allclose(out, s * torch.clamp(torch.round(w.detach() / s), -2, 1))


def test_sign_gradients():
    w = torch.tensor([[0.5, -2.0, 0.1, -0.3]], requires_grad=True)
    a = torch.tensor([[1.0]], requires_grad=True)
    out = fake_quant(w, a, "sign", 1)
    assert torch.equal(out.detach(), torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    out.sum().backward()
    assert torch.equal(w.grad, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    assert float(a.grad) == pytest.approx(0.0 / math.sqrt(4))  # sum of signs * 1/sqrt(numel)


def test_hessian_vector_products_work_through_the_quantizer():
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    w = quant_layers(model)[1][1].weight
    loss = _loss(model, _data())
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    v = torch.randn_like(w)
    (hv,) = torch.autograd.grad((g * v).sum(), w)
    assert hv.shape == w.shape and torch.isfinite(hv).all() and float(hv.abs().sum()) > 0


# --------------------------------------------------------------------------------------------------
# interpolation reset


@pytest.mark.parametrize("quantizer,bits", ALL)
def test_reset_keeps_the_quantized_weights_and_shrinks_the_distance(quantizer, bits):
    for alpha in (0.0, 0.2, 0.7, 1.0):
        layer = _layer(quantizer, bits, seed=5)
        model = nn.Sequential(layer)
        q_before = layer.quantized_weight(noisy=False).detach().clone()
        d_before = distance_to_grid(model)
        interpolation_reset(model, alpha)
        q_after = layer.quantized_weight(noisy=False).detach()
        assert torch.allclose(q_after, q_before, atol=1e-6), (alpha, quantizer, bits)
        assert distance_to_grid(model) == pytest.approx(alpha * d_before, rel=1e-4, abs=1e-6)
        if alpha == 0.0:
            assert torch.allclose(layer.weight, q_before, atol=1e-6)


def test_reset_leaves_optimizer_state_and_lr_schedule_unchanged():
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20)
    cb = WinQCallback(total_steps=20, reset_every=2, sigma_w=0.0, sigma_c=0.0)
    batch = _data()
    for step in (1, 2):
        cb.training_step(model, batch, _loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step == 2:
            before = {k: v.clone() if torch.is_tensor(v) else v for k, v in
                      ((f"{i}.{n}", t) for i, st in opt.state_dict()["state"].items() for n, t in st.items())}
            lr_before = sched.get_last_lr()
            w_before = quant_layers(model)[0][1].weight.detach().clone()
        assert cb.on_step_end(model, step) == (step == 2)
    after = {f"{i}.{n}": t for i, st in opt.state_dict()["state"].items() for n, t in st.items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sched.get_last_lr() == lr_before
    assert not torch.equal(quant_layers(model)[0][1].weight, w_before)  # the weights did move
    assert cb.resets[0][0] == 2 and cb.resets[0][2] == pytest.approx(0.2 * cb.resets[0][1], rel=1e-4)


def test_reset_at_the_final_step_is_skipped():
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    cb = WinQCallback(total_steps=8, reset_every=4)
    w = quant_layers(model)[0][1].weight.detach().clone()
    assert cb.on_step_end(model, 8) is False
    assert torch.equal(quant_layers(model)[0][1].weight, w)
    assert cb.on_step_end(model, 4) is True


# --------------------------------------------------------------------------------------------------
# noise and full trajectories


def _train(model, steps, cb=None, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = _data()
    for step in range(1, steps + 1):
        if cb is None:
            _loss(model, batch).backward()
        else:
            cb.training_step(model, batch, _loss)
        opt.step()
        opt.zero_grad()
        if cb is not None:
            cb.on_step_end(model, step)
    return [p.detach().clone() for p in model.parameters()]


def test_alpha_one_sigma_zero_is_bit_identical_to_plain_qat():
    base = _train(prepare_qat(_mlp(), QATConfig(w_bits=2)), 12)
    for symmetric in (True, False):
        cb = WinQCallback(12, reset_every=3, alpha=1.0, sigma_w=0.0, sigma_c=0.0, symmetric=symmetric)
        ours = _train(prepare_qat(_mlp(), QATConfig(w_bits=2)), 12, cb)
        assert all(torch.equal(a, b) for a, b in zip(base, ours))


def test_winq_changes_the_trajectory_and_is_deterministic():
    runs = [_train(prepare_qat(_mlp(), QATConfig(w_bits=2)), 8, WinQCallback(8, reset_every=4, seed=3))
            for _ in range(2)]
    base = _train(prepare_qat(_mlp(), QATConfig(w_bits=2)), 8)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not all(torch.equal(a, b) for a, b in zip(base, runs[0]))


def test_symmetric_estimator_is_exact_on_a_quadratic():
    g = _gen(6)
    a = torch.randn(5, 5, generator=g)
    a = a @ a.T
    b = torch.randn(5, generator=g)
    theta = torch.randn(5, generator=g)

    def f(ps):
        (x,) = ps
        return 0.5 * x @ a @ x + b @ x

    _, (grad,) = perturbed_gradient(f, [theta], sigma=0.5, generator=_gen(7), symmetric=True, num_perturbs=3)
    assert torch.allclose(grad, a @ theta + b, atol=1e-5)
    _, (one,) = perturbed_gradient(f, [theta], sigma=0.5, generator=_gen(7), symmetric=False)
    assert not torch.allclose(one, a @ theta + b, atol=1e-3)
    _, (zero,) = perturbed_gradient(f, [theta], sigma=0.0, generator=_gen(7), symmetric=False)
    assert torch.allclose(zero, a @ theta + b, atol=1e-6)


def test_callback_gradient_is_the_average_over_plus_and_minus_noise():
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    batch = _data()
    cb = WinQCallback(10, sigma_w=0.05, sigma_c=0.01, symmetric=True, seed=11)
    cb.training_step(model, batch, _loss)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the same draws by hand
    gen = torch.Generator().manual_seed(11)
    layers = [m for _, m in quant_layers(model)]
    noise = []
    for layer in layers:
        u = torch.randn(layer.weight.shape, generator=gen) * 0.05
        uc = torch.randn(layer.clip.shape, generator=gen) * 0.01
        noise.append((u, uc))
    want = [torch.zeros_like(p) for p in model.parameters()]
    for sgn in (1, -1):
        for layer, (u, uc) in zip(layers, noise):
            layer.noise_w, layer.noise_c = sgn * u, sgn * uc
        grads = torch.autograd.grad(_loss(model, batch), list(model.parameters()))
        want = [w + g / 2 for w, g in zip(want, grads)]
    for layer in layers:
        layer.noise_w = layer.noise_c = None
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    assert all(layer.noise_w is None for layer in layers)  # noise removed after the step


def test_sigma_zero_noisy_path_equals_clean_path():
    m1, m2 = prepare_qat(_mlp(), QATConfig(w_bits=2)), prepare_qat(_mlp(), QATConfig(w_bits=2))
    batch = _data()
    WinQCallback(10, sigma_w=0.0, sigma_c=0.0).training_step(m1, batch, _loss)
    _loss(m2, batch).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(m1.parameters(), m2.parameters()))


def test_export_round_trip(tmp_path):
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    _train(model, 3, WinQCallback(3, sigma_w=1e-3))
    path = export_quantized(model, tmp_path / "q.safetensors")
    loaded = load_quantized(path)
    for name, layer in quant_layers(model):
        assert torch.allclose(loaded[name], layer.quantized_weight(noisy=False).detach(), atol=1e-6)


def test_registry_entry_prepares_and_returns_a_callback():
    from rankwise.core.registry import get

    entry = get("winq")
    assert entry.config is WinQConfig
    model = _mlp()
    cb = entry.entry(model, WinQConfig(), total_steps=40)
    assert isinstance(cb, WinQCallback) and cb.reset_every == 10
    assert len(quant_layers(model)) == 3  # nn.Sequential has no output embedding: every Linear


def test_prepare_qat_skips_the_lm_head_of_a_causal_lm():
    from rankwise.zoo.models import tiny_llama

    model = tiny_llama(0, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2)
    prepare_qat(model, QATConfig(w_bits=2))
    names = [n for n, _ in quant_layers(model)]
    assert len(names) == 7 and not any("lm_head" in n for n in names)
    ids = torch.randint(0, 256, (2, 8), generator=_gen(8))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


# --------------------------------------------------------------------------------------------------
# bad input


def test_unsupported_bits_for_quantizer():
    with pytest.raises(ValueError, match="not supported by quantizer 'seq'"):
        QATConfig(w_bits=4, quantizer="seq")
    with pytest.raises(ValueError, match="w_bits"):
        QATConfig(w_bits=5)
    with pytest.raises(ValueError, match="quantizer"):
        QATConfig(w_bits=2, quantizer="gptq")
    with pytest.raises(ValueError, match="minmax"):
        resolve("minmax", 1.0)
    assert QATConfig(w_bits="ternary").w_bits == 1.58


@pytest.mark.parametrize("kwargs,match", [
    (dict(alpha=1.5), "alpha"), (dict(alpha=-0.1), "alpha"), (dict(reset_every=0), "reset_every"),
    (dict(sigma_w=-1e-3), "sigma_w"), (dict(sigma_c=-1.0), "sigma_c"), (dict(num_perturbs=0), "num_perturbs"),
])
def test_winq_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WinQConfig(**kwargs)


def test_reset_every_above_total_steps():
    with pytest.raises(ValueError, match="reset_every=50 must be <= total_steps=40"):
        WinQCallback(40, reset_every=50)


def test_no_matching_linear_lists_candidates():
    model = _mlp()
    with pytest.raises(SelectionError, match="Available Linear modules: 0, 2, 4"):
        prepare_qat(model, QATConfig(target="re:.*attention.*"))
    assert not quant_layers(model)


def test_prepare_twice_is_an_error_and_changes_nothing():
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    before = [type(m) for m in model]
    with pytest.raises(RankwiseError, match="already quantized"):
        prepare_qat(model, QATConfig(w_bits=2))
    assert [type(m) for m in model] == before


def test_nonfinite_weights_stop_with_the_layer_name_and_scales_are_clamped():
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    cb = WinQCallback(10)
    with torch.no_grad():
        model[2].clip[0] = -3.0
    cb.on_step_end(model, 1)
    assert bool((model[2].clip.detach() >= torch.tensor(1e-5)).all())
    with torch.no_grad():
        model[4].weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="'4'"):
        cb.on_step_end(model, 2)


def test_training_step_needs_a_prepared_model():
    with pytest.raises(RankwiseError, match="prepare_qat"):
        WinQCallback(10).training_step(_mlp(), _data(), _loss)


def test_callback_checkpoint_resumes_the_same_noise():
    batch = _data()
    model = prepare_qat(_mlp(), QATConfig(w_bits=2))
    cb = WinQCallback(6, sigma_w=0.05, seed=4)
    for _ in range(2):
        cb.training_step(model, batch, _loss)
    state = cb.state_dict()

    def grads_of(callback):
        model.zero_grad()
        callback.training_step(model, batch, _loss)  # params are untouched: only the noise differs
        return [p.grad.clone() for p in model.parameters()]

    third = grads_of(cb)
    restored = WinQCallback(6, sigma_w=0.05, seed=4)
    restored.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(third, grads_of(restored)))
    fresh = grads_of(WinQCallback(6, sigma_w=0.05, seed=4))  # its first draw, not the third
    assert not all(torch.equal(a, b) for a, b in zip(third, fresh))
    with pytest.raises(RankwiseError, match="differ"):
        WinQCallback(6, sigma_w=0.1, seed=4).load_state_dict(state)
