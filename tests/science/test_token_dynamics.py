"""Tests of rankwise.science.token_dynamics: the spec's correctness checks, theory and bad inputs."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from rankwise.core.errors import NumericalError, SelectionError
from rankwise.science import token_dynamics as td
from rankwise.science.token_dynamics import (
    PhaseDiagram,
    SphereTransformer,
    StochasticValueInit,
    TokenDynamicsConfig,
    antipodal_boundary_beta,
    attention_average,
    count_clusters,
    coupled_refinement,
    has_antipodal_pair,
    hidden_state_grams,
    lyapunov_exponents,
    phase_diagram,
    simulate,
    two_token_drift_diffusion,
    two_token_phase_diagram,
)


def _unit(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# --------------------------------------------------------------------------------------------------
# Correctness checks of the spec


def test_tokens_stay_on_the_sphere_after_every_layer():
    r = simulate(n_tokens=5, dim=6, beta=3.0, horizon=2.0, step=0.05, runs=20, keep_traj=True, record_every=1)
    assert r.traj.shape == (20, r.n_layers + 1, 5, 6)
    np.testing.assert_allclose(np.linalg.norm(r.traj, axis=-1), 1.0, atol=1e-6)
    diag = np.diagonal(r.gram_path, axis1=-2, axis2=-1)
    np.testing.assert_allclose(diag, 1.0, atol=1e-6)
    assert r.max_norm_error < 1e-12


def test_common_noise_keeps_identical_tokens_identical():
    rng = np.random.default_rng(0)
    u = _unit(rng, 6)
    init = np.stack([u, u])
    r = simulate(n_tokens=2, dim=6, beta=2.0, horizon=3.0, step=0.05, runs=10, init=init, keep_traj=True,
                 record_every=1)
    assert np.array_equal(r.traj[:, :, 0], r.traj[:, :, 1])  # exactly the same V_k for both tokens
    assert np.abs(r.rho_path() - 1.0).max() < 1e-12
    # and the tokens did move (the noise is on)
    assert np.abs(r.traj[:, -1, 0] - u).max() > 0.1


@pytest.mark.parametrize("beta", [0.0, 2.0, 1e3])
def test_antipodal_pair_stays_antipodal(beta):
    rng = np.random.default_rng(1)
    u = _unit(rng, 5)
    r = simulate(n_tokens=2, dim=5, beta=beta, horizon=3.0, step=0.05, runs=8, init=np.stack([u, -u]),
                 record_every=1)
    assert np.abs(r.rho_path() + 1.0).max() < 1e-6


def test_beta_zero_attention_is_the_mean_and_update_is_permutation_equivariant():
    rng = np.random.default_rng(2)
    u = _unit(rng, 3, 4, 5)
    np.testing.assert_allclose(attention_average(u, 0.0), np.broadcast_to(u.mean(1, keepdims=True), u.shape),
                               atol=1e-15)
    perm = np.array([2, 0, 3, 1])
    cfg = TokenDynamicsConfig(n_tokens=4, dim=5, beta=0.0, noise=False, horizon=1.0, step=0.1, runs=3)
    a = simulate(cfg, init=u)
    b = simulate(cfg, init=u[:, perm])
    np.testing.assert_allclose(b.final, a.final[:, perm], atol=1e-13)
    # with noise too (same seed -> same value matrices)
    cfg = TokenDynamicsConfig(n_tokens=4, dim=5, beta=1.5, horizon=1.0, step=0.1, runs=3)
    np.testing.assert_allclose(simulate(cfg, init=u[:, perm]).final, simulate(cfg, init=u).final[:, perm],
                               atol=1e-13)


def test_noise_covariance_is_h_norm_a_squared_over_d():
    rng = np.random.default_rng(3)
    d, h, N = 4, 0.01, 60000
    u = np.broadcast_to(_unit(rng, 1, 2, d), (N, 2, d)).copy()
    A = attention_average(u[:1], 1.7)[0]
    Z = rng.standard_normal((N, d, d))
    xi = td._increment(u, np.full(N, 1.7), Z, h, 1.0, 0.0, "discrete") - u  # sqrt(h) V A, per token
    for i in range(2):
        cov = xi[:, i].T @ xi[:, i] / N
        expected = h * (A[i] @ A[i]) / d
        assert np.abs(cov - expected * np.eye(d)).max() <= 0.05 * expected
    cross = xi[:, 0].T @ xi[:, 1] / N  # common noise: cross-covariance (A_1 . A_2 / d) h I
    expected = h * (A[0] @ A[1]) / d
    scale = h * np.linalg.norm(A[0]) * np.linalg.norm(A[1]) / d  # Monte-Carlo error is relative to this
    assert np.abs(cross - expected * np.eye(d)).max() <= 0.05 * scale


def test_halving_the_step_changes_the_antipodal_fraction_little():
    coarse, fine = coupled_refinement(TokenDynamicsConfig(dim=4, beta=4.0, horizon=20.0, step=0.04, runs=200))
    assert abs(coarse["antipodal"] - fine["antipodal"]) <= 0.05
    assert coarse["antipodal"] > 0.1  # the quantity is not trivially zero


# --------------------------------------------------------------------------------------------------
# Two-token theory


@pytest.mark.parametrize("rho", [-0.6, 0.0, 0.5])
def test_ito_drift_and_diffusion_match_one_layer_moments(rho):
    """E[d rho]/h and Var[d rho]/h of the discrete network vs the spec's Ito formula (antithetic draws)."""
    rng = np.random.default_rng(4)
    d, beta, h, N = 4, 2.0, 1e-3, 40000
    u1 = np.zeros(d); u1[0] = 1.0
    u2 = np.zeros(d); u2[0] = rho; u2[1] = math.sqrt(1 - rho * rho)
    u = np.broadcast_to(np.stack([u1, u2]), (N, 2, d)).copy()
    Z = rng.standard_normal((N, d, d))
    drho = []
    for sgn in (1.0, -1.0):
        y = td._increment(u, np.full(N, beta), sgn * Z, h, 1.0, 0.0, "discrete")
        y /= np.linalg.norm(y, axis=-1, keepdims=True)
        drho.append(np.sum(y[:, 0] * y[:, 1], axis=-1) - rho)
    b, s2 = two_token_drift_diffusion(rho, beta, d)
    mean = 0.5 * (drho[0] + drho[1]).mean() / h
    var = np.var(drho[0]) / h
    assert abs(mean - b) <= 0.03 * max(abs(b), 0.1)
    assert abs(var - s2) <= 0.03 * s2


def test_drift_diffusion_vanish_at_both_ends_and_closed_form_lyapunov_agrees():
    for beta in (0.0, 1.0, 5.0):
        b, s2 = two_token_drift_diffusion(np.array([-1.0, 1.0]), beta, 6)
        np.testing.assert_allclose(b, 0.0, atol=1e-14)
        np.testing.assert_allclose(s2, 0.0, atol=1e-14)
        for d in (3, 4, 8, 12):
            for m in (0.0, 0.5):
                num = lyapunov_exponents(beta, d, drift=m)
                cl = lyapunov_exponents(beta, d, drift=m, method="closed")
                np.testing.assert_allclose(num, cl, atol=1e-6)


def test_phase_boundary():
    for d in (4, 8, 12):
        bc = antipodal_boundary_beta(d)
        assert abs(lyapunov_exponents(bc, d)[0]) < 1e-6
        assert lyapunov_exponents(bc - 0.1, d)[0] > 0 > lyapunov_exponents(bc + 0.1, d)[0]
    assert antipodal_boundary_beta(3) == 0.0
    # larger d needs a larger beta
    assert antipodal_boundary_beta(4) < antipodal_boundary_beta(8) < antipodal_boundary_beta(12)


def test_deterministic_flow_collapses_and_noise_gives_antipodes():
    det = simulate(dim=4, beta=1.0, noise=False, horizon=20.0, step=0.05, runs=50).summary()
    assert det["collapsed"] == 1.0
    sto = simulate(dim=4, beta=8.0, horizon=20.0, step=0.05, runs=100).summary()
    assert sto["antipodal"] > 0.1


def test_sde_integrator_runs_and_reports_norm_drift():
    r = simulate(dim=4, beta=4.0, horizon=2.0, step=0.01, runs=50, integrator="sde")
    assert 0 < r.max_norm_error < 0.5
    np.testing.assert_allclose(np.linalg.norm(r.final, axis=-1), 1.0, atol=1e-12)


def test_large_beta_does_not_overflow():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = simulate(n_tokens=4, dim=3, beta=1e3, horizon=1.0, step=0.05, runs=5)
    assert np.isfinite(r.gram).all()


def test_degenerate_update_is_redrawn_and_counted():
    d, h = 2, 0.02
    calls = {"n": 0}

    def draw(rng, batch, dim):
        calls["n"] += 1
        if calls["n"] == 1:  # V = -I / sqrt(h): y = u + sqrt(h) V u = 0 for every run
            return np.broadcast_to(-math.sqrt(dim / h) * np.eye(dim), (batch, dim, dim)).copy()
        return rng.standard_normal((batch, dim, dim))

    u0 = np.tile(np.array([[[1.0, 0.0]]]), (3, 1, 1))
    out = td._simulate_core(u0, np.zeros(3), h, 5, 1.0, 0.0, np.random.default_rng(0), "discrete", 1, False, draw=draw)
    assert out["resampled"] == 3
    assert np.isfinite(out["final"]).all()
    with pytest.raises(NumericalError, match="origin"):
        simulate(n_tokens=1, dim=2, beta=0.0, noise=False, drift=-1 / h, step=h, horizon=0.1, runs=2)


def test_seeded_runs_are_reproducible():
    a = simulate(dim=3, beta=2.0, horizon=1.0, step=0.05, runs=10, seed=7)
    b = simulate(dim=3, beta=2.0, horizon=1.0, step=0.05, runs=10, seed=7)
    c = simulate(dim=3, beta=2.0, horizon=1.0, step=0.05, runs=10, seed=8)
    assert np.array_equal(a.final, b.final)
    assert not np.array_equal(a.final, c.final)


# --------------------------------------------------------------------------------------------------
# Clusters, phase diagram, export


def test_cluster_counting_up_to_sign():
    e = np.eye(3)
    u = np.stack([e[0], -e[0], e[1], e[1]])
    g = u @ u.T
    assert count_clusters(g)[0] == 2
    assert has_antipodal_pair(g)[0]
    u = np.stack([e[0], e[1], e[2]])
    assert count_clusters(u @ u.T)[0] == 3
    assert not has_antipodal_pair(u @ u.T)[0]


def test_phase_diagram_cells_and_export(tmp_path):
    g = two_token_phase_diagram([3, 4], [0.0, 4.0], runs=30, horizon=2.0, step=0.05)
    assert g.antipodal.shape == (2, 2)
    np.testing.assert_allclose(g.antipodal + g.collapsed + g.other, 1.0)
    # a cell does not depend on the other dims of the grid
    g4 = two_token_phase_diagram([4], [0.0, 4.0], runs=30, horizon=2.0, step=0.05)
    assert g4.get(4, 4.0) == g.get(4, 4.0)
    assert g.lyapunov[1, 0] > 0 > g.lyapunov[1, 1]  # d=4: beta=0 repels, beta=4 attracts
    cols = g.to_dict()
    assert len(cols["dim"]) == 4
    p = g.to_csv(tmp_path / "grid.csv")
    lines = p.read_text().strip().splitlines()
    assert lines[0].startswith("dim,beta,antipodal") and len(lines) == 5
    from safetensors.numpy import load_file

    st = load_file(str(g.to_safetensors(tmp_path / "grid.safetensors")))
    np.testing.assert_array_equal(st["antipodal"], g.antipodal)
    assert list(tmp_path.iterdir()) and not any(x.name.startswith(".") for x in tmp_path.iterdir())
    multi = phase_diagram([4], [8.0], n_tokens=4, runs=20, horizon=2.0, step=0.05)
    assert isinstance(multi, PhaseDiagram) and multi.mean_clusters[0, 0] >= 1


# --------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize("kw,exc", [
    (dict(dim=1), ValueError), (dict(n_tokens=0), ValueError), (dict(step=0.0), ValueError),
    (dict(step=-0.1), ValueError), (dict(step=0.6), ValueError), (dict(step=float("nan")), ValueError),
    (dict(beta=float("inf")), ValueError), (dict(horizon=0.0), ValueError), (dict(runs=0), ValueError),
    (dict(noise_scale=1.5), ValueError), (dict(integrator="rk4"), ValueError), (dict(threshold=1.0), ValueError),
    (dict(dim=3.0), TypeError), (dict(beta="2"), TypeError), (dict(drift=float("nan")), ValueError),
    (dict(record_every=0), ValueError),
])
def test_config_rejects_bad_values(kw, exc):
    with pytest.raises(exc):
        TokenDynamicsConfig(**kw)


def test_negative_beta_warns():
    with pytest.warns(UserWarning, match="beta") as caught:
        cfg = TokenDynamicsConfig(beta=-1.0)
    assert cfg.beta == -1.0  # accepted (repulsive interaction), only flagged
    assert sum("beta" in str(w.message) for w in caught) == 1


def test_bad_init_is_rejected():
    cfg = TokenDynamicsConfig(n_tokens=2, dim=3, runs=2, horizon=0.1, step=0.05)
    bad = np.ones((2, 3))
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        simulate(cfg, init=bad)
    z = np.ones((2, 3))
    z[1] = 0.0
    with pytest.raises(ValueError, match="zero norm"):
        simulate(cfg, init=z)
    with pytest.raises(ValueError, match="shape"):
        simulate(cfg, init=np.ones((3, 3)))
    with pytest.raises(TypeError):
        simulate("not a config")


def test_theory_functions_reject_bad_inputs():
    with pytest.raises(ValueError):
        two_token_drift_diffusion(1.5, 1.0, 4)
    with pytest.raises(ValueError):
        two_token_drift_diffusion(0.0, 1.0, 1)
    with pytest.raises(ValueError):
        lyapunov_exponents(float("nan"), 4)
    with pytest.raises(ValueError):
        phase_diagram([], [1.0])


# --------------------------------------------------------------------------------------------------
# Torch side


def test_sphere_transformer_states_on_sphere_and_value_init():
    m = SphereTransformer(vocab=5, dim=16, depth=4, value_scale=0.0, value_mean=1.0)
    assert torch.equal(m.layers[0].value.weight, torch.eye(16))
    ids = torch.randint(0, 5, (3, 7))
    for h in m.hidden_states(ids):
        torch.testing.assert_close(h.norm(dim=-1), torch.full((3, 7), 4.0), atol=1e-5, rtol=0)
    assert m(ids).shape == (3, 2)
    init = StochasticValueInit(m, scale=1.0, seed=0)
    assert len(init.names) == 4
    w = torch.stack([layer.value.weight.detach() for layer in m.layers])
    assert abs(float(w.std()) - 16 ** -0.5) < 0.03
    g = hidden_state_grams(m, ids)
    assert g.shape == (5, 3, 7, 7)
    torch.testing.assert_close(torch.diagonal(g, dim1=-2, dim2=-1), torch.ones(5, 3, 7, dtype=torch.float64))


def test_stochastic_value_init_on_gpt2_and_multihead_attention():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    before = [blk.attn.c_attn.weight.detach().clone() for blk in model.h]
    init = StochasticValueInit(model, scale=0.0, mean=1.0)
    assert len(init.names) == 2
    for blk, w0 in zip(model.h, before):
        w = blk.attn.c_attn.weight
        torch.testing.assert_close(w[:, 32:], torch.eye(16))          # value block = identity
        torch.testing.assert_close(w[:, :32], w0[:, :32])              # queries and keys untouched
        assert torch.all(blk.attn.c_attn.bias[32:] == 0)
    g = hidden_state_grams(model, input_ids=torch.randint(0, 50, (2, 6)))
    assert g.shape == (3, 2, 6, 6)

    mha = nn.Sequential(nn.MultiheadAttention(8, 2))
    q_before = mha[0].in_proj_weight[:16].detach().clone()
    StochasticValueInit(mha, scale=1.0, seed=1)
    torch.testing.assert_close(mha[0].in_proj_weight[:16], q_before)


def test_stochastic_value_init_errors():
    with pytest.raises(SelectionError):
        StochasticValueInit(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError):
        StochasticValueInit(SphereTransformer(vocab=3, dim=4, depth=1), scale=float("nan"))
    with pytest.raises(TypeError):
        StochasticValueInit("model")

    class Rect(nn.Module):
        def __init__(self):
            super().__init__()
            self.value = nn.Linear(4, 6)

    m = Rect()
    w0 = m.value.weight.detach().clone()
    with pytest.raises(ValueError, match="square"):
        StochasticValueInit(m, mean=1.0)
    assert torch.equal(m.value.weight, w0)  # nothing half-written


def test_registered():
    from rankwise.core import registry

    e = registry.get("token_dynamics")
    assert e.config is TokenDynamicsConfig and e.entry is simulate
