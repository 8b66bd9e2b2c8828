"""DiffBCP: the spec's correctness checks and bad inputs (rankwise.science.diffbcp)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rankwise.core.errors import ArtifactError
from rankwise.science import diffbcp as db
from rankwise.science.diffbcp import cusp


class FakePrior:
    """A diffusion prior stand-in (no diffusers): shrinks z towards 0 and reports a step count from a grid."""

    def __init__(self, shape=(1, 8, 8)) -> None:
        self.image_shape = shape
        self.grid = torch.logspace(2, -2, 20).double()
        self.calls: list[tuple[float, ...]] = []

    def steps_for(self, rho: float) -> int:
        return int((self.grid < rho).sum())

    def denoise(self, z, rho, generator=None):
        self.calls.append(tuple(float(r) for r in rho))
        return 0.9 * z, [self.steps_for(float(r)) for r in rho]


def _rank3(n=10, R=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    U = [torch.randn(n, R, generator=g, dtype=torch.float64) for _ in range(3)]
    return torch.einsum("ir,jr,kr->ijk", *U), g


# ------------------------------------------------------------------------------------ tensorisation
@pytest.mark.parametrize("shape,patch,stride", [((1, 16, 16), 4, 2), ((3, 12, 10), 4, 2), ((1, 9, 9), 3, 3)])
def test_patch_round_trip_is_exact(shape, patch, stride) -> None:
    img = torch.rand(shape, dtype=torch.float64) * 2 - 1
    pm = db.PatchMap(*shape, patch=patch, stride=stride)
    t = pm.to_tensor(img)
    assert tuple(t.shape) == pm.tensor_shape
    assert torch.equal(pm.to_image(t), img) or float((pm.to_image(t) - img).abs().max()) <= 1e-15


def test_patch_tensor_of_16x16_digit_is_4x4x49() -> None:
    assert db.PatchMap(1, 16, 16, 4, 2).tensor_shape == (4, 4, 49)


@pytest.mark.parametrize("kw,msg", [({"patch": 20}, "patch must be <= the image size"),
                                    ({"patch": 4, "stride": 5}, "must divide height - patch")])
def test_patch_bad_sizes_name_them(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        db.PatchMap(1, 16, 16, **kw)


# ------------------------------------------------------------------------------------ CP block
@pytest.mark.parametrize("update", ["component", "block"])
def test_plain_bcp_recovers_fully_observed_noise_free_rank3(update) -> None:
    X, _ = _rank3(10)
    res = db.BayesianCP(db.CUSPConfig(init_rank=8, weight_update=update)).fit(X, torch.ones_like(X), sweeps=200, seed=0)
    assert res.relative_error(X) < 1e-3


def test_weight_update_by_component_uses_the_conditional_of_each_weight() -> None:
    """With one component the per-component and the block conditionals coincide: same draw for one seed."""
    X, g = _rank3(6, R=1)
    M = (torch.rand(X.shape, generator=g) < 0.5).double()
    out = []
    for update in ("component", "block"):
        rng = np.random.default_rng(0)
        cfg = db.CUSPConfig(init_rank=1, weight_update=update, adaptive=False)
        st = cusp.init_state(tuple(X.shape), cfg, rng)
        st.tau = 50.0
        T = cusp.khatri_rao(st.factors)
        if update == "component":
            out.append(cusp._weights_by_component(st, T, (X * M).reshape(-1), M.reshape(-1), None, 0.0, rng))
        else:
            prec, rhs = cusp.weight_posterior((X * M).reshape(-1), M.reshape(-1), T, st.theta, st.tau)
            out.append(cusp.draw_gaussian(prec, rhs, rng))
    assert torch.allclose(out[0], out[1], rtol=1e-9, atol=1e-12)


def test_row_update_mean_is_the_ridge_solution_and_precision_is_spd() -> None:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(1)
    factors = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 7)]
    lam = torch.rand(4, generator=g, dtype=torch.float64) + 0.5
    Y = torch.randn(5, 6, 7, generator=g, dtype=torch.float64)
    M = (torch.rand(5, 6, 7, generator=g) < 0.5).double()
    x = torch.randn(5, 6, 7, generator=g, dtype=torch.float64)
    tau, kappa = 3.0, 0.7
    B = cusp.khatri_rao(factors, 1, lam)
    Yn, Mn, Xn = (t.movedim(1, 0).reshape(6, -1) for t in (Y, M, x))
    prec, rhs = cusp.row_posterior(Yn, Mn, B, tau, Xn, kappa)
    assert torch.allclose(prec, prec.transpose(-1, -2))
    assert bool((torch.linalg.eigvalsh(prec) > 0).all())
    mean = cusp.draw_gaussian(prec, rhs, None)
    for i in range(6):  # the ridge solution written out for row i
        obs = Mn[i].bool()
        A = torch.eye(4, dtype=torch.float64) + tau * B[obs].T @ B[obs] + kappa * B.T @ B
        b = tau * B[obs].T @ Yn[i, obs] + kappa * B.T @ Xn[i]
        assert torch.allclose(mean[i], torch.linalg.solve(A, b), atol=1e-10)
    # the mode-1 design rows match the unfolding: the reconstruction's unfolding is factor_1 @ B^T
    full = cusp.cp_full(factors, lam)
    assert torch.allclose(full.movedim(1, 0).reshape(6, -1), factors[1] @ B.T)
    draw = cusp.draw_gaussian(prec, rhs, rng)
    assert draw.shape == mean.shape and not torch.equal(draw, mean)


def test_cusp_weights_spike_theta_and_ranks() -> None:
    rng = np.random.default_rng(0)
    cfg = db.CUSPConfig(init_rank=12)
    X, g = _rank3(8)
    M = (torch.rand(X.shape, generator=g) < 0.6).double()
    st = cusp.init_state(tuple(X.shape), cfg, rng)
    for _ in range(15):
        cusp.sweep(st, X * M, M, cfg, rng)
        omega = cusp.omega_from_v(st.v)
        assert abs(omega.sum() - 1.0) < 1e-12
        assert bool((np.diff(np.cumsum(omega)) >= -1e-15).all())  # spike probability pi_r non-decreasing
        spike = st.z <= np.arange(st.rank)
        assert bool((st.theta.numpy()[spike] == cfg.theta_inf).all())
        assert cusp.active_rank(st.z) <= st.rank
        assert cusp.contribution_rank(st.factors, st.lam) <= st.rank
        assert st.rank <= cfg.rank_cap


def test_truncation_removing_everything_keeps_the_largest_component() -> None:
    rng = np.random.default_rng(0)
    cfg = db.CUSPConfig(init_rank=5, drop_tol=10.0)
    st = cusp.init_state((4, 4, 4), cfg, rng)
    st.lam = torch.tensor([0.1, -0.5, 0.2, 0.0, 0.3], dtype=torch.float64)
    cusp.truncate(st, cfg, rng)
    assert st.rank == 2 and float(st.lam[0]) == -0.5 and float(st.lam[1]) == 0.0  # the kept one + a fresh one
    assert len(st.v) == 2 and st.v[-1] == 1.0 and all(U.shape[1] == 2 for U in st.factors)


def test_seeded_runs_are_reproducible_and_images_keep_their_shape() -> None:
    X, g = _rank3(8)
    img = X[0]  # an 8 x 8 "image"
    mask = (torch.rand(8, 8, generator=g) < 0.5).double()
    cfg = db.DiffBCPConfig(init_rank=6, iters=8, burn_in=3, n_samples=3)
    a, b = (db.DiffBCP(cfg).fit(img, mask, prior=FakePrior(), seed=3) for _ in range(2))
    assert torch.equal(a.mean, b.mean) and a.rank_trace == b.rank_trace and a.tau_trace == b.tau_trace
    assert a.mean.shape == (8, 8) and a.std.shape == (8, 8) and bool((a.std >= 0).all())
    c = db.DiffBCP(cfg).fit(img, mask, prior=FakePrior(), seed=4)
    assert not torch.equal(a.mean, c.mean)


# ---------------------------------------------------------------------------------- rho schedules
def test_rho_trace_is_the_clipped_noise_adaptive_schedule_exactly() -> None:
    X, g = _rank3(8)
    mask = (torch.rand(8, 8, generator=g) < 0.4).double()
    cfg = db.DiffBCPConfig(init_rank=6, iters=10, burn_in=2, n_samples=3, rho_const=0.05, rho_min=0.05, rho_max=3.0)
    prior = FakePrior()
    r = db.DiffBCP(cfg).fit(X[0] / 10, mask, prior=prior, seed=0)
    want = [min(max(cfg.rho_const if k == 0 else math.sqrt(cfg.rho_const / r.tau_trace[k - 1]), cfg.rho_min),
                cfg.rho_max) for k in range(cfg.iters)]
    assert r.rho_trace == want
    assert [c[0] for c in prior.calls] == want  # the diffusion block ran at those rho
    assert r.steps_trace == [prior.steps_for(v) for v in want]
    a = db.DiffBCP(db.DiffBCPConfig(init_rank=6, iters=10, burn_in=2, n_samples=3, schedule="annealed", rho0=10.0,
                                    gamma=0.9, rho_min=0.3)).fit(X[0], mask, prior=FakePrior(), seed=0)
    assert a.rho_trace == [max(10.0 * 0.9**k, 0.3) for k in range(10)]


def test_no_coupling_is_plain_bcp_and_needs_no_prior() -> None:
    X, g = _rank3(8)
    mask = (torch.rand(8, 8, generator=g) < 0.5).double()
    r = db.DiffBCP(db.DiffBCPConfig(init_rank=6, iters=5, burn_in=1, n_samples=2, schedule="none")).fit(X[0], mask)
    assert r.method == "bcp_cusp" and r.steps_trace == [] and torch.equal(r.mean, r.z_mean)


def test_pnp_dm_keeps_unobserved_pixels_from_the_prior_side() -> None:
    img = torch.zeros(8, 8, dtype=torch.float64)
    mask = torch.zeros(8, 8)
    mask[0, 0] = 1
    res = db.pnp_dm([img], [mask], FakePrior(), sigma=0.05,
                    config=db.DiffBCPConfig(iters=4, burn_in=1, n_samples=2))[0]
    assert res.method == "pnp_dm" and res.rho_trace[1] == pytest.approx(math.sqrt(100.0) * 0.05)
    assert float(res.mean.abs().max()) < 0.1  # zeros in, shrunk zeros plus one noisy pixel out


# ---------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("kw,msg", [({"rho_min": 0.0}, "rho_min must be"), ({"rho_min": 5.0, "rho_max": 1.0}, "rho_min must be <="),
                                    ({"rho_const": 0.0}, "rho_const must be"), ({"init_rank": 0}, "init_rank must be"),
                                    ({"burn_in": 60}, "burn_in must be"), ({"schedule": "cosine"}, "schedule must be")])
def test_bad_config_fields_are_named(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        db.DiffBCPConfig(**kw)


def test_bad_observations_raise_clear_errors() -> None:
    img = torch.zeros(8, 8)
    cfg = db.DiffBCPConfig(init_rank=4, iters=3, burn_in=1, n_samples=1, schedule="none")
    with pytest.raises(ValueError, match=r"mask shape \[8, 7\] does not match"):
        db.DiffBCP(cfg).fit(img, torch.ones(8, 7))
    with pytest.raises(ValueError, match="observes no entry"):
        db.DiffBCP(cfg).fit(img, torch.zeros(8, 8))
    bad = img.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        db.DiffBCP(cfg).fit(bad, torch.ones(8, 8))
    mask = torch.ones(8, 8)
    mask[0, 0] = 0
    db.DiffBCP(cfg).fit(bad, mask)  # NaN at an unobserved pixel is fine
    with pytest.raises(ValueError, match="only 0/1"):
        db.DiffBCP(cfg).fit(img, torch.full((8, 8), 0.5))
    with pytest.raises(ValueError, match="needs a diffusion prior"):
        db.DiffBCP(db.DiffBCPConfig(init_rank=4, iters=3, burn_in=1)).fit(img, mask)
    with pytest.raises(ValueError, match=r"prior's image size \[1, 16, 16\] differs"):
        db.DiffBCP(db.DiffBCPConfig(init_rank=4, iters=3, burn_in=1)).fit(img, mask, prior=FakePrior((1, 16, 16)))
    with pytest.raises(ValueError, match="stride=2 must divide"):
        db.DiffBCP(db.DiffBCPConfig(init_rank=4, iters=3, burn_in=1, schedule="none")).fit(torch.zeros(9, 9), torch.ones(9, 9))
    with pytest.raises(ValueError, match="as many masks as images"):
        db.DiffBCP(cfg).fit_many([img, img], [mask])


def test_tensor_mode_on_a_four_way_tensor() -> None:
    g = torch.Generator().manual_seed(0)
    U = [torch.randn(n, 2, generator=g, dtype=torch.float64) for n in (3, 4, 5, 6)]
    X = torch.einsum("ir,jr,kr,lr->ijkl", *U)
    M = (torch.rand(X.shape, generator=g) < 0.7).double()
    res = db.BayesianCP(db.CUSPConfig(init_rank=6)).fit(X, M, sweeps=120, seed=0)
    assert res.relative_error(X) < 0.05 and len(res.rank_trace) == 120 and res.std.shape == X.shape


# ---------------------------------------------------------------------------------- peers
def test_diffusion_block_steps_and_identity_below_the_grid(tmp_path) -> None:
    pytest.importorskip("diffusers")
    p = db.TinyVPDiffusion.build(8, 1, (8, 8), grid_steps=10, seed=0)
    rhos = torch.logspace(2, -3, 40).tolist()
    steps = [p.steps_for(r) for r in rhos]
    assert all(b <= a for a, b in zip(steps, steps[1:])) and steps[0] == 10 and steps[-1] == 0
    z = torch.rand(2, 1, 8, 8) * 2 - 1
    x, st = p.denoise(z, torch.tensor([1e-3, 0.5]), torch.Generator().manual_seed(0))
    assert st == [0, p.steps_for(0.5)] and torch.equal(x[0], z[0]) and not torch.equal(x[1], z[1])
    path = p.save(tmp_path / "prior.safetensors")
    q = db.TinyVPDiffusion.load(path)
    x2, _ = q.denoise(z, torch.tensor([1e-3, 0.5]), torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and q.image_shape == (1, 8, 8)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ArtifactError):
        db.TinyVPDiffusion.load(path)


def test_cp_als_through_tensorly_reports_iterations() -> None:
    pytest.importorskip("tensorly")
    X, g = _rank3(8)
    img = X[:, :, 0] / 10  # an 8 x 8 image
    mask = (torch.rand(8, 8, generator=g) < 0.8).double()
    r = db.cp_als_complete(img, mask, rank=2, n_iter_max=50, restarts=1, seed=0)
    assert r.image.shape == (8, 8) and len(r.all_iterations) == 2 and 1 <= r.iterations <= 50
    assert r.observed_rmse < float(img.std())
