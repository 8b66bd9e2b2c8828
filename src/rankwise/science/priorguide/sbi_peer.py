"""sbi (0.27) as a peer: train an NPSE estimator, sample it unguided or with sbi's own PriorGuide.

sbi is imported inside the functions (an optional extra). ``sbi_prior_guide_sample`` calls
``posterior.sample(..., guidance_method="prior_guide", guidance_params={train_prior, test_prior, K,
...})`` on the posterior built from the same estimator that :class:`SbiScoreAdapter` wraps, so the
two PriorGuides share one trained network. sbi needs its priors as ``torch.distributions``:
:func:`to_torch_distribution` converts ours.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from rankwise.science.priorguide.priors import BoxUniform, GaussianMixture

__all__ = ["build_sbi_posterior", "sbi_available", "sbi_sample", "to_torch_distribution", "train_npse"]


def sbi_available() -> bool:
    try:
        import sbi  # noqa: F401
    except ImportError:
        return False
    return True


def to_torch_distribution(prior: Any) -> Any:
    """Our :class:`BoxUniform` / :class:`GaussianMixture` as sbi-compatible torch distributions (float32)."""
    if isinstance(prior, BoxUniform):
        from sbi.utils import BoxUniform as SbiBox

        return SbiBox(prior.low.float(), prior.high.float())
    if isinstance(prior, GaussianMixture):
        D = torch.distributions
        comp = D.MultivariateNormal(prior.means.float(), covariance_matrix=prior.covs.float())
        if prior.n_components == 1:
            return D.MultivariateNormal(prior.means[0].float(), covariance_matrix=prior.covs[0].float())
        return D.MixtureSameFamily(D.Categorical(probs=prior.weights.float()), comp)
    return prior


class _NoTracker:
    """sbi's tracker interface, doing nothing: sbi's default writes TensorBoard logs to ./sbi-logs."""

    log_dir = ""

    def log_metric(self, name: str, value: float, step: int | None = None) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def add_figure(self, name: str, figure: Any, step: int | None = None) -> None:
        pass

    def flush(self) -> None:
        pass


def _builder(hidden: int, layers: int) -> Any:
    from sbi.neural_nets import posterior_score_nn

    return posterior_score_nn(model="mlp", sde_type="ve", hidden_features=hidden, num_layers=layers)


def train_npse(theta: Tensor, x: Tensor, train_prior: Any, *, epochs: int = 40, batch_size: int = 200,
               hidden: int = 64, layers: int = 3, seed: int = 0) -> Any:
    """Train sbi's NPSE (VE SDE, MLP score network) on simulated pairs; returns the estimator.

    sbi takes no generator: this seeds torch's global generator with ``seed`` (``torch.manual_seed``)."""
    from sbi.inference import NPSE

    torch.manual_seed(seed)
    inf = NPSE(prior=to_torch_distribution(train_prior), vf_estimator=_builder(hidden, layers),
               show_progress_bars=False, tracker=_NoTracker())
    est = inf.append_simulations(theta.float(), x.float()).train(
        max_num_epochs=epochs, stop_after_epochs=epochs, training_batch_size=batch_size,
        show_train_summary=False)
    return est.eval()


def empty_npse(theta: Tensor, x: Tensor, *, hidden: int = 64, layers: int = 3) -> Any:
    """An untrained estimator of the same architecture (z-scoring from ``theta``/``x``), to load weights into."""
    return _builder(hidden, layers)(theta.float(), x.float())


def build_sbi_posterior(estimator: Any, train_prior: Any) -> Any:
    """sbi's ``VectorFieldPosterior`` (SDE sampling) around a trained estimator."""
    from sbi.inference import NPSE

    prior = to_torch_distribution(train_prior)
    return NPSE(prior=prior, show_progress_bars=False, tracker=_NoTracker()).build_posterior(estimator, prior=prior, sample_with="sde")


def sbi_sample(posterior: Any, x_obs: Tensor, n: int, *, steps: int = 100, seed: int = 0,
               new_prior: Any = None, train_prior: Any = None, K: int = 1, fit_steps: int = 2000) -> tuple[Tensor, float]:
    """``n`` samples from sbi's posterior at ``x_obs``: unguided, or with sbi's PriorGuide when
    ``new_prior`` is given (``guidance_params`` = train/test prior, ``K`` and the ratio-fit steps).
    Returns ``(samples [n, D], CPU seconds of this process)``; no rejection outside the prior (as in our
    sampler). Seeds torch's global generator with ``seed`` (sbi takes no generator)."""
    kw: dict[str, Any] = {}
    if new_prior is not None:
        kw = {"guidance_method": "prior_guide",
              "guidance_params": {"train_prior": to_torch_distribution(train_prior),
                                  "test_prior": to_torch_distribution(new_prior), "K": K,
                                  "num_steps": fit_steps}}
    torch.manual_seed(seed)
    c0 = time.process_time()
    s = posterior.sample((n,), x=torch.as_tensor(x_obs, dtype=torch.float32), steps=steps,
                         show_progress_bars=False, reject_outside_prior=False, **kw)
    return s.detach().float(), time.process_time() - c0
