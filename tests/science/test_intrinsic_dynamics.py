"""Tests of rankwise.science.intrinsic_dynamics: the spec's correctness checks, formulas and bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rankwise.core.errors import RankwiseError
from rankwise.science.intrinsic_dynamics import (
    CallableLoss,
    CustomLift,
    DeepLinear,
    DeepReLUPathLift,
    FrobeniusLoss,
    IntrinsicConfig,
    LeastSquaresLoss,
    LinearFactorization,
    LinearODE,
    NotIntrinsicError,
    ReLUNet,
    check_criterion,
    compare,
    conservation_law_count,
    euclidean_flow,
    intrinsic_flow,
    level_set_counterexample,
    psd_power,
    run_comparison,
    simulate_flow,
)

F64 = torch.float64


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed), dtype=F64)


def _autograd_vjp(system, theta, g):
    th = theta.clone().requires_grad_(True)
    (v,) = torch.autograd.grad(system.phi(th), th, grad_outputs=g)
    return -v


def _relu_problem(seed: int = 0, d: int = 5, k: int = 8, n: int = 64):
    X = _randn(seed, n, d)
    tw, ta = _randn(seed + 1, 2, d) / math.sqrt(d), _randn(seed + 2, 2)
    y = (ta[:, None] * torch.relu(tw @ X.mT)).sum(0)
    net = ReLUNet(d, k)
    th = net.random_init(seed=seed)
    return net, th, net.loss(X, y, th)


# --------------------------------------------------------------------------------------------------
# Metric and parameter velocity


def test_linear_metric_autograd_equals_closed_form():
    sys_ = LinearFactorization(4, 3, 5)
    th = sys_.random_init(seed=0)
    M = sys_.metric(th)
    assert M.shape == (12, 12)
    assert float((M - sys_.metric_closed_form(th)).abs().max()) <= 1e-10


def test_relu_metric_autograd_equals_intrinsic_closed_form():
    net = ReLUNet(4, 3)
    th = net.random_init(seed=1)
    M = net.metric(th)
    Mc = net.metric_closed_form(net.phi(th), net.invariants(th))
    assert float((M - Mc).abs().max()) <= 1e-10


@pytest.mark.parametrize("system", [LinearFactorization(3, 4, 2), DeepLinear([3, 4, 5, 2]), ReLUNet(4, 3),
                                    LinearODE(3, 5)])
def test_closed_form_parameter_velocity_matches_autograd(system):
    th = system.random_init(seed=2)
    g = _randn(3, *system.phi(th).shape)
    assert float((system.param_velocity(th, g) - _autograd_vjp(system, th, g)).abs().max()) <= 1e-12


def test_parameter_flow_closed_form_and_autograd_agree():
    sys_ = LinearFactorization(3, 2, 3)
    th = sys_.random_init(seed=4)
    loss = FrobeniusLoss(_randn(5, 3, 2))
    a = simulate_flow(sys_, th, loss, t_max=0.05, dt=1e-3)
    b = simulate_flow(sys_, th, loss, t_max=0.05, dt=1e-3, use_closed_form=False)
    assert compare(a, b).max() <= 1e-13


# --------------------------------------------------------------------------------------------------
# Conservation and intrinsic flows


def test_invariants_are_conserved_by_the_parameter_flow():
    sys_ = LinearFactorization(4, 3, 4)
    res = simulate_flow(sys_, sys_.random_init(seed=6), FrobeniusLoss(_randn(7, 4, 3)), t_max=0.5, dt=1e-3)
    assert res.conservation_residual().max() <= 1e-10
    # RK4: the drift shrinks like dt^4 (halving dt divides it by ~16) until rounding dominates
    coarse = simulate_flow(sys_, sys_.random_init(seed=6), FrobeniusLoss(_randn(7, 4, 3)), t_max=0.5, dt=0.05)
    fine = simulate_flow(sys_, sys_.random_init(seed=6), FrobeniusLoss(_randn(7, 4, 3)), t_max=0.5, dt=0.025)
    ratio = coarse.conservation_residual().max() / fine.conservation_residual().max()
    assert ratio > 8


@pytest.mark.parametrize("n,m,r,lam", [(4, 3, 4, 0.7), (4, 8, 4, 2.0), (4, 3, 6, 0.0), (3, 4, 4, -0.5),
                                       (4, 3, 4, 0.0)])
def test_lambda_balanced_intrinsic_flow_matches_parameter_flow(n, m, r, lam):
    sys_ = LinearFactorization(n, m, r)
    th = sys_.relaxed_balanced_init(lam, seed=8)
    C = sys_.invariants(th).reshape(r, r)
    assert float((C - lam * torch.eye(r, dtype=F64)).abs().max()) <= 1e-12
    out = run_comparison(sys_, th, FrobeniusLoss(_randn(9, n, m)), IntrinsicConfig(t_max=0.3, dt=1e-3))
    assert out["max_rel_error"] <= 1e-9
    assert out["euclidean_rel_error"] >= 1e-2
    assert out["criterion"].inclusion


def test_least_squares_loss_and_gradient():
    X, Y = _randn(10, 3, 7), _randn(11, 4, 7)
    loss = LeastSquaresLoss(X, Y)
    Z = _randn(12, 4, 3)
    torch.testing.assert_close(loss.grad(Z), CallableLoss(lambda z: 0.5 * (z @ X - Y).pow(2).sum()).grad(Z))
    sys_ = LinearFactorization(4, 3, 4)
    th = sys_.relaxed_balanced_init(0.3, seed=1)
    p = simulate_flow(sys_, th, loss, t_max=0.2, dt=1e-3)
    i = intrinsic_flow(sys_, sys_.phi(th), sys_.invariants(th), loss, t_max=0.2, dt=1e-3)
    assert compare(p, i).max() <= 1e-9


def test_lambda_zero_formula_is_the_arora_two_layer_formula():
    n, m, r = 4, 3, 5
    lf = LinearFactorization(n, m, r)
    dl = DeepLinear([m, r, n])  # W_1 = V^T, W_2 = U
    Z, G = _randn(13, n, m), _randn(14, n, m)
    v_lf = lf.intrinsic_velocity(Z, torch.zeros(r * r, dtype=F64), G)
    v_dl = dl.intrinsic_velocity(Z, torch.zeros(0, dtype=F64), G)
    assert float((v_lf - v_dl).abs().max()) <= 1e-12


@pytest.mark.parametrize("a,w_scale", [(1.3, 0.5), (0.4, 2.0)])  # lambda = a^2 - |w|^2 > 0 and < 0
def test_relu_formula_reduces_to_the_one_neuron_linear_case(a, w_scale):
    d = 4
    w = _randn(15, d) * w_scale
    net = ReLUNet(d, 1)
    th = net.join(w[None, :], torch.tensor([a], dtype=F64))
    z, delta = net.phi(th), net.invariants(th)
    g = _randn(16, 1, d)
    lf = LinearFactorization(1, d, 1)
    lam = -float(delta[0])
    v_lin = lf.intrinsic_velocity(z, torch.tensor([lam], dtype=F64), g)
    assert float((net.intrinsic_velocity(z, delta, g) - v_lin).abs().max()) <= 1e-12


def test_rescaling_symmetry_changes_delta_and_the_metric():
    net = ReLUNet(3, 2)
    th = net.random_init(seed=17)
    W, a = net.split(th)
    c = 1.7
    th2 = net.join(W * c, a / c)
    torch.testing.assert_close(net.phi(th2), net.phi(th))
    assert float((net.invariants(th2) - net.invariants(th)).abs().min()) > 1e-3
    M1, M2 = net.metric(th), net.metric(th2)
    assert float((M1 - M2).abs().max()) > 1e-3
    # each metric is the intrinsic one for its own delta
    assert float((M2 - net.metric_closed_form(net.phi(th2), net.invariants(th2))).abs().max()) <= 1e-10


def test_relu_intrinsic_flow_until_and_through_pattern_changes():
    net, th, loss = _relu_problem(1)
    cfg = IntrinsicConfig(t_max=0.3, dt=1e-3)
    p = simulate_flow(net, th, loss, cfg)
    i = intrinsic_flow(net, net.phi(th), net.invariants(th), loss, cfg)
    assert p.stopped_at is not None and p.stopped_at < 0.3 and p.stop_reason == "pattern"  # stopped, reported
    assert compare(p, i).max() <= 1e-9
    loc = IntrinsicConfig(t_max=0.3, dt=1e-3, on_pattern_change="locate")
    pl = simulate_flow(net, th, loss, loc)
    il = intrinsic_flow(net, net.phi(th), net.invariants(th), loss, loc)
    assert len(pl.events) >= 1 and pl.times[-1] > p.times[-1]
    assert compare(pl, il).max() <= 1e-8
    assert pl.conservation_residual().max() <= 1e-10
    # the pattern at the end differs from the start: the comparison really crossed kinks
    assert not torch.equal(loss.pattern(torch.from_numpy(pl.z[-1])), loss.pattern(net.phi(th)))
    # an output weight crossing zero (the non-intrinsic set a_j = 0) stops the run in both modes
    net0, th0, loss0 = _relu_problem(0)
    p0 = simulate_flow(net0, th0, loss0, loc)
    assert p0.stop_reason == "sign" and p0.stopped_at < 0.3


def test_deep_linear_balanced_flow_matches_arora():
    dl = DeepLinear([3, 4, 4, 3])
    th = dl.balanced_init(seed=18)
    assert float(dl.invariants(th).abs().max()) <= 1e-12
    out = run_comparison(dl, th, FrobeniusLoss(_randn(19, 3, 3)), IntrinsicConfig(t_max=0.3, dt=1e-3))
    assert out["max_rel_error"] <= 1e-9 and out["conservation_residual"] <= 1e-10


def test_linear_ode_discretised_formula_and_limit():
    ode = LinearODE(3, 8)
    th = ode.balanced_init(seed=20)
    assert float(ode.invariants(th).abs().max()) <= 1e-12
    loss = FrobeniusLoss(torch.linalg.matrix_exp(_randn(21, 3, 3) / 3))
    cfg = IntrinsicConfig(t_max=0.2, dt=1e-3)
    p = simulate_flow(ode, th, loss, cfg)
    i = intrinsic_flow(ode, ode.phi(th), ode.invariants(th), loss, cfg)
    assert compare(p, i).max() <= 1e-9
    # the finite-N velocity converges to the N -> infinity formula like 1/N
    Z, G = ode.phi(th), _randn(22, 3, 3)
    lim = LinearODE.limit_velocity(Z, None, G)
    errs = [float((LinearODE(3, N).intrinsic_velocity(Z, torch.zeros(0, dtype=F64), G) - lim).norm()) for N in (8, 16, 32)]
    assert 1.7 < errs[0] / errs[1] < 2.3 and 1.7 < errs[1] / errs[2] < 2.3


def test_custom_lift_and_callable_velocity():
    # phi(theta) = theta_0 * theta_1 (scalar two-layer net); conserved theta_0^2 - theta_1^2
    lift = CustomLift(lambda t: (t[0] * t[1]).reshape(1, 1), 2, invariants=lambda t: t[:1] ** 2 - t[1:] ** 2)
    th = torch.tensor([1.2, 0.7], dtype=F64)
    loss = FrobeniusLoss(torch.tensor([[2.0]], dtype=F64))
    p = simulate_flow(lift, th, loss, t_max=0.3, dt=1e-3)
    lf = LinearFactorization(1, 1, 1)
    i = intrinsic_flow(lambda z, h, g: lf.intrinsic_velocity(z, h, g), lift.phi(th), lift.invariants(th), loss,
                       t_max=0.3, dt=1e-3)
    assert compare(p, i).max() <= 1e-10
    with pytest.raises(NotImplementedError):
        intrinsic_flow(lift, lift.phi(th), lift.invariants(th), loss, t_max=0.1)


# --------------------------------------------------------------------------------------------------
# Non-balanced inits, criterion, counterexample, conservation laws


def test_non_balanced_init_has_no_lambda_formula():
    sys_ = LinearFactorization(4, 3, 4)
    C = torch.diag(torch.tensor([0.3, 0.6, 0.9, 1.2], dtype=F64))
    th = sys_.init_with_invariant(C, seed=23)
    torch.testing.assert_close(sys_.invariants(th).reshape(4, 4), C)
    loss = FrobeniusLoss(_randn(24, 4, 3))
    with pytest.raises(NotImplementedError, match="not a multiple of the identity"):
        intrinsic_flow(sys_, sys_.phi(th), sys_.invariants(th), loss, t_max=0.1)
    # forcing the isotropic fit lambda = tr(C)/r gives a wrong flow
    p = simulate_flow(sys_, th, loss, t_max=0.5, dt=1e-3)
    i = intrinsic_flow(sys_, sys_.phi(th), (0.75 * torch.eye(4, dtype=F64)).reshape(-1), loss, t_max=0.5, dt=1e-3)
    assert compare(p, i).max() >= 1e-2
    assert not check_criterion(sys_, th).inclusion


def test_criterion_table():
    for n, m, r in [(4, 3, 4), (4, 1, 4), (3, 2, 4)]:
        lf = LinearFactorization(n, m, r)
        assert check_criterion(lf, lf.relaxed_balanced_init(0.0, seed=25)).inclusion
        assert check_criterion(lf, lf.relaxed_balanced_init(0.7, seed=25)).inclusion if n >= r else True
        rep = check_criterion(lf, lf.random_init(seed=26))
        assert r < n + m and not rep.inclusion and rep.leakage > 1e-6
    net = ReLUNet(3, 4)
    assert check_criterion(net, net.random_init(seed=27)).inclusion
    deep = DeepReLUPathLift([2, 3, 2])
    rep = check_criterion(deep, deep.random_init(seed=28))
    assert rep.n_invariants == 3 and rep.rank_phi_h <= rep.rank_with_M


def test_same_z_and_same_c_but_different_velocity():
    """The spec's necessity test: two inits with the same Z(0) and the same C give different Z'(0)."""
    lf = LinearFactorization(4, 3, 4)
    th = lf.random_init(seed=29)
    ce = level_set_counterexample(lf, th)
    th2 = ce["theta2"]
    assert ce["residual"] <= 1e-10 and ce["distance"] > 1e-2
    torch.testing.assert_close(lf.phi(th2), lf.phi(th), atol=1e-10, rtol=0)
    torch.testing.assert_close(lf.invariants(th2), lf.invariants(th), atol=1e-10, rtol=0)
    g = _randn(30, 12)
    v1, v2 = lf.metric(th) @ g, lf.metric(th2) @ g
    assert float((v1 - v2).norm() / v1.norm()) > 1e-3
    # for a balanced init no such direction changes M
    bal = lf.relaxed_balanced_init(0.7, seed=31)
    assert level_set_counterexample(lf, bal)["metric_change"] <= 1e-6


def test_conservation_law_count():
    lf = LinearFactorization(2, 2, 2)
    assert conservation_law_count(lf, lf.random_init(seed=32))["n_laws"] == 3  # r (r + 1) / 2
    net = ReLUNet(3, 2)
    assert conservation_law_count(net, net.random_init(seed=33))["n_laws"] == 2  # one per neuron
    out = conservation_law_count(lambda t: t.sum().reshape(1), torch.ones(3, dtype=F64))
    assert out["n_laws"] == 2 and out["saturated"]


def test_psd_power_zero_is_identity_on_singular_matrices():
    S = torch.diag(torch.tensor([2.0, 0.0], dtype=F64))
    torch.testing.assert_close(psd_power(S, 0.0), torch.eye(2, dtype=F64))
    torch.testing.assert_close(psd_power(S, 0.5), torch.diag(torch.tensor([math.sqrt(2), 0.0], dtype=F64)))


# --------------------------------------------------------------------------------------------------
# Bad inputs and edge cases


def test_lambda_nonzero_with_r_not_in_shapes_raises_but_parameter_flow_runs():
    lf = LinearFactorization(5, 3, 4)  # r != n, r != m
    th = lf.relaxed_balanced_init(0.7, seed=34)
    loss = FrobeniusLoss(_randn(35, 5, 3))
    with pytest.raises(NotImplementedError, match="r = n"):
        intrinsic_flow(lf, lf.phi(th), lf.invariants(th), loss, t_max=0.1)
    assert simulate_flow(lf, th, loss, t_max=0.05).conservation_residual().max() <= 1e-10
    with pytest.raises(ValueError, match="n >= r"):
        LinearFactorization(3, 5, 4).relaxed_balanced_init(0.5)


def test_relu_zero_output_weight_is_rejected():
    net = ReLUNet(3, 2)
    W = _randn(36, 2, 3)
    th = net.join(W, torch.tensor([0.0, 1.0], dtype=F64))
    with pytest.raises(NotIntrinsicError):
        net.loss(_randn(37, 5, 3), _randn(38, 5), th)
    with pytest.raises(NotIntrinsicError, match="a_j = 0"):
        net.intrinsic_velocity(net.phi(th), net.invariants(th), torch.ones(2, 3, dtype=F64))
    assert issubclass(NotIntrinsicError, RankwiseError)


@pytest.mark.parametrize("kw", [dict(dt=0.0), dict(dt=-1e-3), dict(dt=float("nan")), dict(t_max=float("inf")),
                                dict(dt=2.0, t_max=1.0), dict(record_every=0), dict(on_pattern_change="skip")])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        IntrinsicConfig(**kw)


def test_bad_losses_and_parameters():
    lf = LinearFactorization(2, 3, 2)
    th = lf.random_init(seed=39)
    with pytest.raises(ValueError, match="shape"):
        simulate_flow(lf, th, FrobeniusLoss(torch.zeros(3, 2, dtype=F64)), t_max=0.1)
    with pytest.raises(ValueError, match="non-finite"):
        FrobeniusLoss(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="not finite"):
        simulate_flow(lf, th, CallableLoss(lambda z: z.sum() * float("inf")), t_max=0.1)
    with pytest.raises(ValueError, match="scalar"):
        simulate_flow(lf, th, CallableLoss(lambda z: z), t_max=0.1)
    with pytest.raises(TypeError, match="CallableLoss"):
        simulate_flow(lf, th, lambda z: z.sum(), t_max=0.1)
    with pytest.raises(ValueError, match="length"):
        simulate_flow(lf, th[:-1], FrobeniusLoss(torch.zeros(2, 3, dtype=F64)), t_max=0.1)
    bad = th.clone()
    bad[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        simulate_flow(lf, bad, FrobeniusLoss(torch.zeros(2, 3, dtype=F64)), t_max=0.1)
    with pytest.raises(ValueError):
        LinearFactorization(0, 2, 2)
    with pytest.raises(ValueError):
        LeastSquaresLoss(torch.zeros(3, 4), torch.zeros(2, 5))


def test_results_are_reproducible():
    lf = LinearFactorization(3, 3, 3)
    a, b = lf.relaxed_balanced_init(0.5, seed=40), lf.relaxed_balanced_init(0.5, seed=40)
    assert torch.equal(a, b)
    loss = FrobeniusLoss(_randn(41, 3, 3))
    r1 = simulate_flow(lf, a, loss, t_max=0.05)
    r2 = simulate_flow(lf, b, loss, t_max=0.05)
    assert np.array_equal(r1.z, r2.z)
    e = euclidean_flow(lf.phi(a), loss, t_max=0.05)
    assert e.kind == "euclidean" and e.z.shape == r1.z.shape


def test_registered():
    from rankwise.core import registry

    e = registry.get("intrinsic_dynamics")
    assert e.config is IntrinsicConfig and e.entry is run_comparison
