"""DiffBCP: Bayesian CP decomposition with a cumulative-shrinkage rank prior and a diffusion-model data
prior, sampled by split Gibbs.

Paper: "Bayesian Tensor Decomposition with Diffusion Model Prior" (Tao & Zhao, ICML 2026, arXiv
2606.03212; spec ``shared/methods/diffbcp.md``). An image is cut into overlapping patches and stacked into
a tensor (:class:`PatchMap`); a Bayesian CP model with a CUSP prior on its component weights selects the
rank (:mod:`.cusp`); an auxiliary image ``x`` coupled to the CP reconstruction by ``N(X | x, rho^2 I)``
carries a pretrained diffusion prior. The split Gibbs sampler alternates one CP sweep (observations +
``x`` at precision ``1/rho^2``) and a diffusion block that denoises the CP reconstruction from the first
scheduler step whose noise level is below ``rho``; ``rho`` follows the estimated noise
(``clip(sqrt(c / tau), rho_min, rho_max)``).

Layout: :mod:`.tensorize` (patches), :mod:`.cusp` (the Gibbs sweep, truncation, rank read-outs),
:mod:`.bcp` (:class:`BayesianCP` for any tensor), :mod:`.prior` (:class:`TinyVPDiffusion` on diffusers),
:mod:`.method` (:class:`DiffBCP`, :func:`pnp_dm`), :mod:`.baselines` (CP-ALS through tensorly).

Example::

    from rankwise.science import diffbcp
    prior = diffbcp.TinyVPDiffusion.train(images, steps=3000, seed=0)   # [N, 1, 16, 16] in [-1, 1]
    prior.save("prior.safetensors")
    cfg = diffbcp.DiffBCPConfig(init_rank=32, patch=4, stride=2, iters=60, burn_in=24, n_samples=12)
    res = diffbcp.DiffBCP(cfg).fit(Y, mask, prior=prior, seed=0)        # Y [16, 16], mask 1 = observed
    res.mean, res.std, res.rho_trace, res.tau_trace, res.rank_trace
    # a tensor without images: diffbcp.BayesianCP(diffbcp.CUSPConfig(init_rank=16)).fit(T, mask)
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.science.diffbcp.baselines import ALSResult, cp_als_complete
from rankwise.science.diffbcp.bcp import BayesianCP, CPResult, check_observations
from rankwise.science.diffbcp.cusp import (
    CPState,
    CUSPConfig,
    active_rank,
    contribution_rank,
    cp_full,
    khatri_rao,
    omega_from_v,
    row_posterior,
    sweep,
    weight_posterior,
)
from rankwise.science.diffbcp.method import (
    DiffBCP,
    DiffBCPConfig,
    DiffBCPResult,
    complete,
    pnp_dm,
    psnr,
    rho_annealed,
    rho_noise_adaptive,
)
from rankwise.science.diffbcp.prior import DiffusionPrior, PriorTrainResult, TinyVPDiffusion
from rankwise.science.diffbcp.tensorize import PatchMap

__all__ = [
    "ALSResult",
    "BayesianCP",
    "CPResult",
    "CPState",
    "CUSPConfig",
    "DiffBCP",
    "DiffBCPConfig",
    "DiffBCPResult",
    "DiffusionPrior",
    "PatchMap",
    "PriorTrainResult",
    "TinyVPDiffusion",
    "active_rank",
    "check_observations",
    "complete",
    "contribution_rank",
    "cp_als_complete",
    "cp_full",
    "khatri_rao",
    "omega_from_v",
    "pnp_dm",
    "psnr",
    "rho_annealed",
    "rho_noise_adaptive",
    "row_posterior",
    "sweep",
    "weight_posterior",
]

register("diffbcp", config=DiffBCPConfig, entry=complete)
