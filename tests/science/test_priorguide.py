"""PriorGuide: the spec's correctness checks and bad inputs (rankwise.science.priorguide)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rankwise.core.errors import ArtifactError
from rankwise.science import priorguide as pg

D = 2


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # every test draws the same points


class ExactGaussianScore:
    """The exact VE score of p_train(theta | x) for x = theta + N(0, noise^2) under p_train = N(0, s^2 I)."""

    def __init__(self, s: float = 2.0, noise: float = 0.5) -> None:
        self.theta_dim = self.x_dim = D
        self.sigma_min, self.sigma_max = 1e-3, 10.0
        self.prec = 1 / s**2 + 1 / noise**2
        self.noise = noise
        self.init_mean = torch.zeros(D, dtype=torch.float64)
        self.init_std = torch.full((D,), math.sqrt(self.sigma_max**2 + 1 / self.prec), dtype=torch.float64)

    def post(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return (x / self.noise**2) / self.prec, 1 / self.prec

    def score(self, theta_t, sigma, x):
        x = torch.as_tensor(x, dtype=theta_t.dtype).reshape(-1, D)
        mean, var = self.post(x)
        sig = torch.as_tensor(sigma, dtype=theta_t.dtype).reshape(-1, 1)
        return -(theta_t - mean) / (var + sig**2)


def _gauss(mean, var, w=None):
    means = torch.as_tensor(mean, dtype=torch.float64).reshape(-1, D)
    k = means.shape[0]
    covs = torch.stack([var * torch.eye(D, dtype=torch.float64)] * k)
    return pg.GaussianMixture(w if w is not None else [1.0 / k] * k, means, covs)


def _box(a=3.0):
    return pg.BoxUniform(-a * torch.ones(D), a * torch.ones(D))


# --- correctness -------------------------------------------------------------------------------------

def test_equal_priors_give_zero_guidance_and_identical_samples():
    model = ExactGaussianScore()
    ratio = pg.prior_ratio(_box(), _box())
    assert ratio.constant and ratio.method == "constant"
    theta = torch.randn(7, D, dtype=torch.float64)
    term = pg.guidance_term(pg.PriorGuide(ratio), model, theta, torch.tensor(0.7), torch.zeros(D))
    assert torch.equal(term.g, torch.zeros_like(theta))
    x = torch.tensor([0.3, -0.2])
    a = pg.sample(model, x, 64, steps=12, seed=3)
    b = pg.sample(model, x, 64, steps=12, seed=3, guidance=pg.PriorGuide(ratio))
    assert torch.equal(a.samples, b.samples)


def test_guided_score_matches_new_posterior_score_at_small_noise():
    s, noise = 2.0, 0.5
    model = ExactGaussianScore(s, noise)
    m, c = torch.tensor([1.0, -1.0], dtype=torch.float64), 0.3
    # exact ratio of N(m, c I) to N(0, s^2 I): Gaussian with precision 1/c - 1/s^2
    c_r = 1.0 / (1.0 / c - 1.0 / s**2)
    ratio = pg.PriorRatio(_gauss(c_r * m / c, c_r), "exact")
    x = torch.tensor([0.4, 0.1], dtype=torch.float64)
    theta = torch.randn(9, D, dtype=torch.float64) * 0.5
    sigma = torch.tensor(1e-4)
    for jac in (False, True):
        guide = pg.PriorGuide(ratio, jacobian=jac, clip=None)
        got = model.score(theta, sigma, x) + pg.guidance_term(guide, model, theta, sigma, x).g
        post = pg.gaussian_linear_posterior(x, _gauss(m, c), noise)  # the new posterior, exactly
        want = -torch.linalg.solve(post.covs[0], (theta - post.means[0]).T).T
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3), (jac, (got - want).abs().max())


def test_jacobian_variant_is_the_vector_jacobian_product():
    model = ExactGaussianScore()
    ratio = pg.PriorRatio(_gauss([[1.0, 0.0], [-1.0, 0.5]], 0.2), "exact")
    theta = torch.randn(4, D, dtype=torch.float64)
    sigma, x = torch.tensor(0.8), torch.tensor([0.2, 0.2], dtype=torch.float64)
    guide = pg.PriorGuide(ratio, jacobian=True, clip=None)
    term = pg.guidance_term(guide, model, theta, sigma, x)
    identity = pg.guidance_term(pg.PriorGuide(ratio, clip=None), model, theta, sigma, x)
    for i in range(theta.shape[0]):
        f = lambda t: pg.tweedie_mean(t[None], sigma, model.score(t[None], sigma, x))[0]  # noqa: E731
        jac = torch.autograd.functional.jacobian(f, theta[i])
        assert torch.allclose(term.g[i], jac.T @ identity.g[i], atol=1e-10)


def test_gamma_sums_to_one_and_far_away_theta_stays_finite():
    model = ExactGaussianScore()
    ratio = pg.PriorRatio(_gauss([[1.0, 1.0], [-1.0, -1.0], [3.0, 0.0]], 0.05, [0.5, 0.3, 0.2]), "exact")
    theta = torch.tensor([[0.0, 0.0], [1e4, -1e4], [-3e5, 2e5], [40.0, 40.0]], dtype=torch.float64)
    for jac in (False, True):
        term = pg.guidance_term(pg.PriorGuide(ratio, jacobian=jac, clip=None), model, theta, torch.tensor(0.05),
                                torch.zeros(D))
        assert torch.isfinite(term.g).all() and torch.isfinite(term.gamma).all()
        assert torch.allclose(term.gamma.sum(-1), torch.ones(4, dtype=torch.float64))
        # far away, the pull points back towards the mixture (not the zero that underflowing weights give)
        assert (term.g[1:] * (ratio.mixture.mean() - term.mu[1:])).sum(-1).gt(0).all()


def test_far_away_weights_underflow_without_log_sum_exp():
    """What sbi's mixing (exp of log densities, then normalise) gives at a far-away theta: 0/0, while ours is finite."""
    ratio = pg.PriorRatio(_gauss([[1.0, 1.0], [-1.0, -1.0]], 0.05), "exact")
    mu = torch.tensor([[1e4, 1e4]], dtype=torch.float64)
    comp = pg.GaussianMixture(ratio.mixture.weights, ratio.mixture.means,
                              ratio.mixture.covs + 0.01 * torch.eye(D)).component_log_prob(mu)
    naive = torch.exp(comp) * ratio.mixture.weights
    assert float(naive.sum()) == 0.0  # the naive weights are all zero here
    term = pg.guidance_term(pg.PriorGuide(ratio, clip=None), ExactGaussianScore(), mu, torch.tensor(0.1), torch.zeros(D))
    assert torch.isfinite(term.gamma).all() and abs(float(term.gamma.sum()) - 1) < 1e-12


def test_clip_bounds_the_guidance_norm():
    model = ExactGaussianScore()
    ratio = pg.PriorRatio(_gauss([5.0, 5.0], 1e-3), "exact")
    theta = torch.zeros(3, D, dtype=torch.float64)
    sigma = torch.tensor(0.5)
    term = pg.guidance_term(pg.PriorGuide(ratio, clip=1.0), model, theta, sigma, torch.zeros(D))
    assert term.clipped.all()
    assert torch.allclose(term.g.norm(dim=-1), torch.full((3,), 1.0 / 0.5, dtype=torch.float64))


def test_box_ratio_is_the_new_prior_inside_the_box():
    q = _gauss([[1.0, -1.0], [-0.5, 0.5]], 0.09)
    ratio = pg.prior_ratio(q, _box())
    assert ratio.method == "box-exact"
    theta = torch.rand(50, D, dtype=torch.float64) * 4 - 2
    lr = ratio.log_ratio(theta)
    lq = q.log_prob(theta)
    assert torch.allclose(lr - lr[0], lq - lq[0])


def test_weighted_em_recovers_a_gaussian_ratio():
    dist = torch.distributions
    m = torch.tensor([1.0, -0.5])
    q = dist.MultivariateNormal(m, torch.eye(D))
    p = dist.MultivariateNormal(torch.zeros(D), 4 * torch.eye(D))
    ratio = pg.prior_ratio(q, p, n_components=1, n_samples=40_000, seed=1)
    assert ratio.method == "weighted-em"
    # r = q / p ∝ N(4/3 m, 4/3 I)
    assert torch.allclose(ratio.mixture.means[0], 4 / 3 * m.double(), atol=0.1)
    assert torch.allclose(ratio.mixture.covs[0], 4 / 3 * torch.eye(D, dtype=torch.float64), atol=0.15)


def test_fit_gmm_finds_two_separated_components():
    g = torch.Generator().manual_seed(0)
    true = _gauss([[-3.0, 0.0], [3.0, 0.0]], 0.25, [0.3, 0.7])
    res = pg.fit_gmm(true.sample(4000, g), n_components=2, seed=0)
    order = res.mixture.means[:, 0].argsort()
    assert torch.allclose(res.mixture.means[order], true.means, atol=0.1)
    assert torch.allclose(res.mixture.weights[order], true.weights, atol=0.03)


def test_gaussian_linear_posterior_single_component():
    prior = _gauss([1.0, -1.0], 0.09)
    post = pg.gaussian_linear_posterior(torch.tensor([0.5, -0.5]), prior, 0.1)
    prec = 1 / 0.09 + 1 / 0.01
    assert torch.allclose(post.covs[0], torch.eye(D, dtype=torch.float64) / prec)
    assert torch.allclose(post.means[0], (torch.tensor([1.0, -1.0]) / 0.09 + torch.tensor([0.5, -0.5]) / 0.01).double() / prec)


def test_guided_sampling_moves_towards_the_new_posterior():
    model = ExactGaussianScore(2.0, 0.5)
    q = _gauss([1.5, -1.5], 0.1)
    c_r = 1.0 / (1.0 / 0.1 - 1.0 / 4.0)
    ratio = pg.PriorRatio(_gauss(torch.tensor([1.5, -1.5]) * c_r / 0.1, c_r), "exact")
    x = torch.tensor([0.0, 0.0])
    want = pg.gaussian_linear_posterior(x, q, 0.5).means[0]
    plain = pg.sample(model, x, 400, steps=40, seed=0).samples.double().mean(0)
    guided = pg.sample(model, x, 400, steps=40, seed=0, guidance=pg.PriorGuide(ratio, langevin_steps=1)).samples
    assert (guided.double().mean(0) - want).norm() < 0.5 * (plain - want).norm()


def test_importance_resample_with_equal_priors_keeps_full_ess():
    props = torch.rand(100, D, generator=torch.Generator().manual_seed(0)) * 4 - 2  # inside the box
    out = pg.importance_resample(props, _box(), _box(), 50)
    assert out.samples.shape == (50, D) and abs(out.ess - 100) < 1e-6
    outside = torch.cat([props, torch.full((1, D), 5.0)])  # a proposal outside the support gets weight 0
    assert abs(pg.importance_resample(outside, _box(), _box(), 50).ess - 100) < 1e-6


def test_score_diffusion_fit_save_load(tmp_path):
    g = torch.Generator().manual_seed(0)
    theta = _box().sample(256, g).float()
    x = pg.gaussian_linear(theta, 0.1, g)
    m = pg.ScoreDiffusion(D, D, hidden=16, layers=2).fit(theta, x, steps=5, batch_size=32, seed=0)
    assert len(m.fit_result.losses) == 1 and math.isfinite(m.fit_result.final_loss)
    m.save(tmp_path / "m.safetensors")
    m2 = pg.ScoreDiffusion.load(tmp_path / "m.safetensors")
    th = torch.randn(5, D)
    assert torch.equal(m.score(th, torch.tensor(0.3), x[0]), m2.score(th, torch.tensor(0.3), x[0]))
    out = pg.sample(m2, x[0], 8, steps=3, guidance=pg.PriorGuide(pg.prior_ratio(_gauss([1.0, 1.0], 0.1), _box())))
    assert out.samples.shape == (8, D) and out.score_evals == 3
    from rankwise.core import io

    io.save_tensors(tmp_path / "other.safetensors", {"a": torch.zeros(1)}, {"kind": "other"})
    with pytest.raises(ArtifactError, match="not a saved ScoreDiffusion"):
        pg.ScoreDiffusion.load(tmp_path / "other.safetensors")


def test_sbi_adapter_matches_the_estimator():
    pytest.importorskip("sbi")
    from rankwise.science.priorguide import sbi_peer

    theta = torch.randn(64, D)
    est = sbi_peer.empty_npse(theta, theta + 0.1, hidden=16, layers=2)
    ad = pg.SbiScoreAdapter(est)
    assert ad.theta_dim == D and ad.x_dim == D and ad.sigma_max > ad.sigma_min
    th = torch.randn(3, D)
    t = torch.tensor([0.4])
    sigma = est.std_fn(t).reshape(())
    with torch.no_grad():
        want = est(input=th, condition=torch.zeros(3, D), time=t)
        got = ad.score(th, sigma, torch.zeros(D))
    assert torch.allclose(got, want, atol=1e-5)


def _vp_of(model: ExactGaussianScore, bmin: float = 0.1, bmax: float = 20.0):
    """The VP process (sbi's linear beta schedule) whose VE equivalent has ``model``'s exact score."""
    def m(t):
        return torch.exp(-0.25 * t**2 * (bmax - bmin) - 0.5 * t * bmin)

    def s(t):
        return torch.sqrt(1 - m(t) ** 2)

    def vp_score(theta_t, t, x):  # score of theta_t = m theta_0 + s eps, theta_0 | x ~ N(mean, var)
        mean, var = model.post(torch.as_tensor(x, dtype=theta_t.dtype).reshape(-1, D))
        mt, st = m(t).reshape(-1, 1).to(theta_t.dtype), s(t).reshape(-1, 1).to(theta_t.dtype)
        return -(theta_t - mt * mean) / (mt**2 * var + st**2)

    return pg.VPScoreAdapter(vp_score, m, s, t_min=1e-3, t_max=1.0, theta_dim=D, x_dim=D), m, s, vp_score


def test_vp_adapter_is_the_ve_score_and_gives_the_spec_vp_formulas():
    model = ExactGaussianScore(2.0, 0.5)
    vp, m, s, vp_score = _vp_of(model)
    y = torch.randn(6, D, dtype=torch.float64)
    x = torch.tensor([0.3, -0.2], dtype=torch.float64)
    for sig in (0.05, 0.7, 5.0):
        sigma = torch.tensor(sig, dtype=torch.float64)
        assert torch.allclose(vp.score(y, sigma, x), model.score(y, sigma, x), atol=1e-9)
        t = vp.time_of(sigma)
        assert abs(float(vp.sigma_of(t)) - sig) < 1e-9 * max(1.0, sig)
        # spec §6: mu = (theta_t + (1 - abar) s_VP) / sqrt(abar), and g_theta = g_VE / sqrt(abar)
        a = m(t)
        theta_t = a * y
        ratio = pg.PriorRatio(_gauss([1.0, -1.0], 0.2), "exact")
        term = pg.guidance_term(pg.PriorGuide(ratio, clip=None), vp, y, sigma, x)
        mu_vp = (theta_t + (1 - a**2) * vp_score(theta_t, t.reshape(1), x)) / a
        assert torch.allclose(term.mu, mu_vp, atol=1e-9)
        var0 = pg.reverse_variance(sigma)
        c = torch.eye(D, dtype=torch.float64) * (0.2 + var0)
        g_theta = torch.linalg.solve(c, (torch.tensor([1.0, -1.0], dtype=torch.float64) - mu_vp).T).T / a
        assert torch.allclose(term.g / a, g_theta, atol=1e-9)
    # the same start, seed and grid give the same guided samples as the VE model
    vp.init_mean, vp.init_std = model.init_mean, model.init_std
    ratio = pg.prior_ratio(_gauss([1.0, -1.0], 0.1), _box())
    grid = pg.sigma_grid(5.0, 0.01, 30)
    a = pg.sample(vp, x, 50, sigmas=grid, seed=1, guidance=pg.PriorGuide(ratio, jacobian=True))
    b = pg.sample(model, x, 50, sigmas=grid, seed=1, guidance=pg.PriorGuide(ratio, jacobian=True))
    assert (a.samples - b.samples).abs().max() < 1e-4


def test_vp_adapter_checks_its_schedule():
    model = ExactGaussianScore()
    _, m, s, vp_score = _vp_of(model)
    with pytest.raises(ValueError, match="increasing"):
        pg.VPScoreAdapter(vp_score, s, m, t_min=1e-3, t_max=1.0, theta_dim=D, x_dim=D)  # sigma = m / s decreases
    with pytest.raises(ValueError, match="t_max"):
        pg.VPScoreAdapter(vp_score, m, s, t_min=1.0, t_max=0.5, theta_dim=D, x_dim=D)


def test_sbi_vp_estimator_through_the_vp_adapter():
    pytest.importorskip("sbi")
    from sbi.neural_nets import posterior_score_nn

    theta = torch.randn(64, D)
    est = posterior_score_nn(model="mlp", sde_type="vp", hidden_features=16, num_layers=2)(theta, theta + 0.1)
    with pytest.raises(ValueError, match="VPScoreAdapter"):
        pg.SbiScoreAdapter(est)
    ad = pg.VPScoreAdapter.from_sbi(est)
    assert ad.theta_dim == D and ad.x_dim == D and ad.sigma_max > ad.sigma_min
    t = torch.tensor([0.4])
    with torch.no_grad():
        m = est.mean_t_fn(t).reshape(())
        sigma = (est.std_fn(t).reshape(()) / m).double()
        y = torch.randn(3, D)
        want = m * est(input=m * y, condition=torch.zeros(3, D), time=t)
        got = ad.score(y.double(), sigma, torch.zeros(D))
    assert torch.allclose(got.float(), want, atol=1e-4)


def test_mmd2_matches_sbi_and_separates_shifted_samples():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(200, D, generator=g), torch.randn(150, D, generator=g)
    same, shifted = pg.mmd2(a, b), pg.mmd2(a, b + 1.0)
    assert abs(same) < 0.02 and shifted > 10 * abs(same)
    assert abs(pg.mmd2(a, b, scale=1.0) - pg.mmd2(b, a, scale=1.0)) < 1e-12
    with pytest.raises(ValueError, match="mmd2"):
        pg.mmd2(a[:1], b)
    sbi_metrics = pytest.importorskip("sbi.utils.metrics")
    assert abs(pg.mmd2(a, b + 0.3) - float(sbi_metrics.unbiased_mmd_squared(a.double(), (b + 0.3).double()))) < 1e-10


def test_sir_simulator_and_grid_reference():
    box = pg.BoxUniform(torch.tensor([1.0, 0.5]), torch.tensor([4.0, 2.0]))
    theta = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    curve = pg.sir_curve(theta)
    assert curve.shape == (2, 10) and (curve >= 0).all() and (curve <= 1).all()
    assert curve[0].max() > 0.05 and curve[1].max() < 0.01  # R0 = 2 spreads, R0 = 0.5 dies out
    fine = pg.sir_curve(theta, dt=0.005)
    assert (fine - curve).abs().max() < 1e-6  # RK4 at dt = 0.05 is converged
    x = pg.sir(theta[:1], torch.Generator().manual_seed(0))
    assert x.shape == (1, 10)
    with pytest.raises(ValueError, match="theta"):
        pg.sir_curve(torch.zeros(3, 3))
    # the grid reference of a Gaussian likelihood under a Gaussian prior is the conjugate posterior
    q = _gauss([2.5, 1.2], 0.04)

    def loglik(th, xo):
        return -0.5 * ((th - xo) ** 2).sum(-1) / 0.01

    xo = torch.tensor([2.7, 1.0], dtype=torch.float64)
    ref = pg.grid_reference(loglik, xo, q, box, 4000, cells=200, seed=0).double()
    want = (xo / 0.01 + torch.tensor([2.5, 1.2], dtype=torch.float64) / 0.04) / (1 / 0.01 + 1 / 0.04)
    assert (ref.mean(0) - want).abs().max() < 0.01
    assert abs(float(ref.var(0).mean()) - 1 / (1 / 0.01 + 1 / 0.04)) < 0.001


def _moons_q():
    return _gauss([[0.3, -0.3], [-0.3, 0.3]], 0.04)


def test_two_moons_reference_agrees_with_rejection_where_rejection_works():
    """An observation simulated under q itself: rejection from q accepts often; the arc grid gives the same law."""
    box, q = _box(1.0), _moons_q()
    g = torch.Generator().manual_seed(4)
    x = pg.two_moons(q.sample(1, g).float(), g)[0]
    grid = pg.two_moons_reference(x, q, 800, seed=0, box=box).double()
    rej = pg.two_moons_rejection(x, q, 800, seed=10, box=box).double()
    assert torch.isfinite(pg.two_moons_log_likelihood(grid, x)).all() and box.contains(grid).all()
    assert (grid.mean(0) - rej.mean(0)).abs().max() < 0.03
    assert ((grid.std(0) / rej.std(0)) - 1).abs().max() < 0.12
    shifted = rej + 0.25 * rej.std(0)  # the MMD sees a quarter-std shift; equal laws stay well below it
    assert pg.mmd2(grid, rej) < 0.5 * pg.mmd2(grid, shifted)


def test_two_moons_reference_in_the_prior_tail_matches_a_fine_theta_grid():
    """An observation from theta = (-0.8, 0.8), in q's far tail: rejection from q gives up, the arc grid
    agrees with a brute-force exact-likelihood grid on theta around the posterior."""
    box, q = _box(1.0), _moons_q()
    x = pg.two_moons(torch.tensor([[-0.8, 0.8]]), torch.Generator().manual_seed(1))[0]
    with pytest.raises(ValueError, match="two_moons_rejection: only"):
        pg.two_moons_rejection(x, q, 300, batch=20_000, max_batches=2)
    arc = pg.two_moons_reference(x, q, 1000, seed=0, box=box).double()
    lo = (arc.min(0).values - 0.05).clamp(-1, 1)
    hi = (arc.max(0).values + 0.05).clamp(-1, 1)
    brute = pg.grid_reference(pg.two_moons_log_likelihood, x, q, pg.BoxUniform(lo, hi), 1000, cells=600,
                              seed=1).double()
    assert (arc.mean(0) - brute.mean(0)).abs().max() < 0.01
    assert ((arc.std(0) / brute.std(0)) - 1).abs().max() < 0.1
    shifted = brute + 0.25 * brute.std(0)
    assert pg.mmd2(arc, brute) < 0.5 * pg.mmd2(arc, shifted)


def test_two_moons_reference_bad_input():
    with pytest.raises(ValueError, match="x_obs"):
        pg.two_moons_reference(torch.tensor([float("nan"), 0.0]), _moons_q(), 10)
    with pytest.raises(ValueError, match="no theta"):  # x1 beyond the moon's reach: no theta produces it
        pg.two_moons_reference(torch.tensor([0.9, 0.0]), _moons_q(), 10)


# --- bad input ---------------------------------------------------------------------------------------

def test_non_psd_covariance_is_refused():
    with pytest.raises(ValueError, match=r"covs\[0\] must be positive definite"):
        pg.GaussianMixture([1.0], [[0.0, 0.0]], [[[1.0, 2.0], [2.0, 1.0]]])
    with pytest.raises(ValueError, match="symmetric"):
        pg.GaussianMixture([1.0], [[0.0, 0.0]], [[[1.0, 0.5], [0.0, 1.0]]])


def test_mixture_weights_and_shapes_are_checked():
    with pytest.raises(ValueError, match="sum to 1"):
        pg.GaussianMixture([0.5, 0.4], [[0.0, 0.0], [1.0, 1.0]], [torch.eye(D), torch.eye(D)])
    with pytest.raises(ValueError, match="disagree"):
        pg.GaussianMixture([1.0], [[0.0, 0.0, 0.0]], [torch.eye(D)])
    with pytest.raises(ValueError, match="dimension"):
        pg.prior_ratio(_gauss([0.0, 0.0], 1.0), pg.BoxUniform(-torch.ones(3), torch.ones(3)))
    with pytest.raises(ValueError, match="low must be < high"):
        pg.BoxUniform(torch.ones(2), torch.zeros(2))


def test_new_prior_outside_training_support_warns():
    with warnings.catch_warnings(record=True) as far:
        warnings.simplefilter("always")
        pg.prior_ratio(_gauss([2.8, 0.0], 0.25), _box())
    support = [w for w in far if issubclass(w.category, pg.PriorSupportWarning)]
    assert len(support) == 1 and "outside the training prior" in str(support[0].message)
    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        pg.prior_ratio(_gauss([0.0, 0.0], 0.09), _box())
    assert not [w for w in inside if issubclass(w.category, pg.PriorSupportWarning)]


def test_sampler_inputs_are_checked():
    model = ExactGaussianScore()
    with pytest.raises(ValueError, match="NaN"):
        pg.sample(model, torch.tensor([float("nan"), 0.0]), 4)
    with pytest.raises(ValueError, match="x_dim=2"):
        pg.sample(model, torch.zeros(3), 4)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        pg.sample(model, torch.zeros(D), 4, steps=0)
    with pytest.raises(ValueError, match="non-monotone"):
        pg.sample(model, torch.zeros(D), 4, sigmas=torch.tensor([1.0, 2.0, 0.1]))
    with pytest.raises(TypeError, match="PriorGuide"):
        pg.sample(model, torch.zeros(D), 4, guidance="prior_guide")


def test_config_fields_are_validated():
    ratio = pg.prior_ratio(_box(), _box())
    with pytest.raises(ValueError, match="PriorGuide.langevin_steps must be an int >= 0"):
        pg.PriorGuide(ratio, langevin_steps=-1)
    with pytest.raises(ValueError, match="PriorGuide.clip"):
        pg.PriorGuide(ratio, clip=0.0)
    with pytest.raises(TypeError, match="PriorRatio"):
        pg.PriorGuide("ratio")
    with pytest.raises(ValueError, match="sigma_max must be > sigma_min"):
        pg.ScoreDiffusion(D, D, sigma_min=1.0, sigma_max=0.5)
    with pytest.raises(ValueError, match="finite"):
        pg.ScoreDiffusion(D, D).fit(torch.full((4, D), float("nan")), torch.zeros(4, D), steps=1)


def test_registered():
    from rankwise.core import registry

    registry.discover()
    assert registry.get("priorguide").entry is pg.sample
