"""PriorGuide's sampling overhead: guided vs unguided reverse diffusion, and ours vs sbi's PriorGuide.

* ``priorguide_overhead``: 1000 posterior samples, 100 Euler-Maruyama steps, on a ``ScoreDiffusion`` with
  the reproduction's architecture (MLP 4 x 64; seeded random weights: timing needs no training), the
  off-centre Gaussian new prior of the reproduction. Anchor: unguided sampling. Rows: PriorGuide with
  ``J = I`` (the spec: < 2x the unguided sampler), with the autograd Jacobian, with 2 Langevin
  corrector steps per level (about 3x the score evaluations, by design).
* ``priorguide_vs_sbi`` (only when sbi is installed): one sbi NPSE estimator of the reproduction's
  architecture (untrained, seeded); anchor sbi's unguided ``posterior.sample``; sbi's
  ``guidance_method="prior_guide"`` (its GMM ratio fit is cached before timing) and our PriorGuide
  through ``SbiScoreAdapter`` on the same estimator, 1000 samples, 100 steps, no rejection.

``SMOKE_CASES`` are 50 samples x 5 steps. Run ``python -m benchmarks.run priorguide``.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any, Callable

import torch

from benchmarks.harness import Case, Goal

N, STEPS = 1000, 100
X_OBS = torch.tensor([0.8, -0.7])


def _setup() -> tuple[Any, Any, Any, Any]:
    from rankwise.science import priorguide as pg

    torch.manual_seed(0)
    model = pg.ScoreDiffusion(2, 2, hidden=64, layers=4)
    box = pg.BoxUniform(-3 * torch.ones(2), 3 * torch.ones(2))
    q = pg.GaussianMixture([1.0], [[1.0, -1.0]], [0.09 * torch.eye(2)])
    return pg, model, box, q


def _ours(kind: str, n: int, steps: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        pg, model, box, q = _setup()
        ratio = pg.prior_ratio(q, box)
        guide = {"unguided": None, "PriorGuide J=I": pg.PriorGuide(ratio),
                 "PriorGuide Jacobian": pg.PriorGuide(ratio, jacobian=True),
                 "PriorGuide + 2 Langevin": pg.PriorGuide(ratio, langevin_steps=2)}[kind]
        return lambda: pg.sample(model, X_OBS, n, guidance=guide, steps=steps, seed=0)
    return factory


def _sbi(kind: str, n: int, steps: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science.priorguide import sbi_peer

        pg, _, box, q = _setup()
        gen = torch.Generator().manual_seed(0)
        theta = box.sample(512, gen).float()
        est = sbi_peer.empty_npse(theta, pg.gaussian_linear(theta, 0.1, gen), hidden=64, layers=3).eval()
        post = sbi_peer.build_sbi_posterior(est, box)
        tq, tbox = sbi_peer.to_torch_distribution(q), sbi_peer.to_torch_distribution(box)
        if kind == "rankwise PriorGuide on sbi":
            ad, guide = pg.SbiScoreAdapter(est), pg.PriorGuide(pg.prior_ratio(q, box))
            return lambda: pg.sample(ad, X_OBS, n, guidance=guide, steps=steps, seed=0)
        kw: dict[str, Any] = {}
        if kind == "sbi PriorGuide":
            kw = {"new_prior": tq, "train_prior": tbox, "K": 1, "fit_steps": 2000}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sbi_peer.sbi_sample(post, X_OBS, 2, steps=1, **kw)  # fit (and cache) sbi's GMM ratio

        def run() -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return sbi_peer.sbi_sample(post, X_OBS, n, steps=steps, **kw)
        return run
    return factory


_OURS = ("unguided", "PriorGuide J=I", "PriorGuide Jacobian", "PriorGuide + 2 Langevin")
_SBI = ("sbi unguided", "sbi PriorGuide", "rankwise PriorGuide on sbi")
_HAS_SBI = importlib.util.find_spec("sbi") is not None


def _cases(n: int, steps: int, repeats: int) -> list[Case]:
    cases = [Case("priorguide_overhead", {k: _ours(k, n, steps) for k in _OURS}, anchor="unguided",
                  params={"n": n, "steps": steps, "model": "ScoreDiffusion MLP 4x64"}, repeats=repeats, warmup=1,
                  goals=(Goal("PriorGuide (J = I) costs < 2x the unguided sampler", impl="PriorGuide J=I",
                              max_ratio=2.0),))]
    if _HAS_SBI:
        cases.append(Case("priorguide_vs_sbi", {k: _sbi(k, n, steps) for k in _SBI}, anchor="sbi unguided",
                          params={"n": n, "steps": steps, "estimator": "sbi NPSE VE, MLP 3x64"}, repeats=repeats,
                          warmup=1, goals=(Goal("our PriorGuide on sbi's estimator costs < 2x sbi's unguided sampler",
                                                impl="rankwise PriorGuide on sbi", max_ratio=2.0),)))
    return cases


CASES = _cases(N, STEPS, 5)
SMOKE_CASES = _cases(50, 5, 1)[:1]
