"""PriorGuide: swap the prior of a trained diffusion-based amortized SBI model at test time.

Paper: "PriorGuide: Test-Time Prior Adaptation for Simulation-Based Inference" (ICLR 2026,
arXiv 2510.13763; spec ``shared/methods/priorguide.md``).

A conditional score model trained on pairs simulated under ``p_train(theta)`` samples
``p_train(theta | x)``. For a new prior ``q``, ``q(theta | x) ∝ r(theta) p_train(theta | x)`` with
``r = q / p_train``. PriorGuide adds ``g = grad_{theta_t} log E[r(theta_0) | theta_t, x]`` to the
learned score, in closed form once ``r`` is a Gaussian mixture and the reverse kernel is Gaussian
around the Tweedie mean (spec §3-§5). Nothing is retrained.

Layout: :mod:`.priors` (``GaussianMixture``, ``BoxUniform``, weighted EM, :func:`prior_ratio`),
:mod:`.diffusion` (the :class:`ScoreModel` protocol, our :class:`ScoreDiffusion`, sbi's estimator via
:class:`SbiScoreAdapter`, VP models via :class:`VPScoreAdapter`), :mod:`.guidance` (:class:`PriorGuide`, :func:`guidance_term`),
:mod:`.sampling` (:func:`sample`, :func:`importance_resample`), :mod:`.tasks` (simulators: Gaussian-linear, two moons, SIR; reference
posteriors, C2ST, MMD), :mod:`.sbi_peer` (sbi's NPSE and its own PriorGuide, imported lazily).

Example::

    from rankwise.science import priorguide as pg
    box = pg.BoxUniform(-3 * torch.ones(2), 3 * torch.ones(2))
    theta = box.sample(20_000); x = pg.gaussian_linear(theta)
    model = pg.ScoreDiffusion(theta_dim=2, x_dim=2).fit(theta, x, steps=3000, seed=0)
    q = pg.GaussianMixture(weights=[1.0], means=[[1.0, -1.0]], covs=[0.09 * torch.eye(2)])
    ratio = pg.prior_ratio(q, train_prior=box)
    out = pg.sample(model, x_obs, n=1000, guidance=pg.PriorGuide(ratio), steps=100, seed=0)
    out.samples  # [1000, 2]
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.science.priorguide.diffusion import (
    FitResult,
    SbiScoreAdapter,
    ScoreDiffusion,
    ScoreModel,
    ScoreNet,
    VPScoreAdapter,
    sigma_grid,
)
from rankwise.science.priorguide.guidance import (
    GuidanceTerm,
    PriorGuide,
    guidance_term,
    reverse_variance,
    tweedie_mean,
)
from rankwise.science.priorguide.priors import (
    BoxUniform,
    EMResult,
    GaussianMixture,
    PriorRatio,
    PriorSupportWarning,
    fit_gmm,
    prior_ratio,
)
from rankwise.science.priorguide.sampling import SampleResult, SIRResult, importance_resample, sample
from rankwise.science.priorguide.tasks import (
    c2st,
    gaussian_linear,
    gaussian_linear_box_reference,
    gaussian_linear_posterior,
    grid_reference,
    mean_rmse,
    mmd2,
    sir,
    sir_curve,
    sir_log_likelihood,
    sir_reference,
    two_moons,
    two_moons_log_likelihood,
    two_moons_reference,
    two_moons_rejection,
)

__all__ = [
    "BoxUniform",
    "EMResult",
    "FitResult",
    "GaussianMixture",
    "GuidanceTerm",
    "PriorGuide",
    "PriorRatio",
    "PriorSupportWarning",
    "SIRResult",
    "SampleResult",
    "SbiScoreAdapter",
    "ScoreDiffusion",
    "ScoreModel",
    "ScoreNet",
    "VPScoreAdapter",
    "c2st",
    "fit_gmm",
    "gaussian_linear",
    "gaussian_linear_box_reference",
    "gaussian_linear_posterior",
    "grid_reference",
    "guidance_term",
    "importance_resample",
    "mean_rmse",
    "mmd2",
    "prior_ratio",
    "reverse_variance",
    "sample",
    "sigma_grid",
    "sir",
    "sir_curve",
    "sir_log_likelihood",
    "sir_reference",
    "tweedie_mean",
    "two_moons",
    "two_moons_log_likelihood",
    "two_moons_reference",
    "two_moons_rejection",
]

register("priorguide", config=PriorGuide, entry=sample)
