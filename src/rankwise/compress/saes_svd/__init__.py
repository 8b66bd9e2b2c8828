"""SAES-SVD: low-rank compression that also pulls each layer back toward the full-precision output.

Hu et al., "SAES-SVD: Self-Adaptive Suppression of Accumulated and Local Errors for SVD-based LLM
Compression", ICLR 2026 (arXiv 2602.03051). Spec: ``shared/methods/saes_svd.md``.

Notation (the paper's, columns are tokens): a layer ``y = W x`` with ``W`` ``m x n``; for the same
calibration tokens, ``X`` (``n x N``) are the layer's inputs in the model whose upstream layers are
*already compressed* and ``X_f`` (``n x N``) its inputs in the full-precision (FP) model.

**CEALC** (cumulative-error-aware layer compression, Eqs. 3-12). For ``alpha >= 0``::

    min_{A, B}  ||(A B - W) X||_F^2 + alpha ||A B X - W X_f||_F^2                         (Eq. 3)
      = (1 + alpha) ||A B X - Z||_F^2 + const,   Z = W (X + alpha X_f) / (1 + alpha)        (Eqs. 4-6)

With ``H = X X^T``, ``Delta = (X_f - X) X^T`` (Eq. 9) and ``beta = alpha / (1 + alpha)`` in ``[0, 1)``,
``Z X^T = W (H + beta Delta)``. Whitening with ``H + lambda I = S S^T`` gives the closed form
(Thm. 4.1, Eqs. 10-12)::

    G(beta) = W (H + lambda I + beta Delta) S^{-T},   G = U Sigma V^T,
    A = U_r Sigma_r^{1/2},   B = Sigma_r^{1/2} V_r^T S^{-1}.

**ACES** (adaptive collaborative error suppression, Sec. 4.2, Thm. 4.2, App. A.3, Alg. 3) picks
``beta`` per layer to maximise the retained energy ratio ``RER(beta) = sum_{i<=r} sigma_i^2(G) /
sum_i sigma_i^2(G)`` through the fixed-subspace first-order approximation (FS-FOA, Eqs. 17-19).

Choices where the paper is silent (see ``docs/methods/saes_svd.md``):

* the ridge ``lambda`` is ``ridge * mean(diag H)`` (default ``1e-6``), x10 per failed Cholesky, at most
  ``ridge_retries = 5`` retries; it enters the target too (``W (H + lambda I) S^{-T} = W S``), which
  makes the ridged problem the exact minimiser of ``||A B X - Z||^2 + lambda ||A B - W||^2`` and makes
  ``beta = 0`` (or ``Delta = 0``) *exactly* SVD-LLM's whitening SVD ``[W S]_r S^{-1}`` at the same
  ``lambda``;
* ``beta_bounds = (0.25, 0.75)`` read as a ``beta`` interval (``bounds_on="alpha"`` reads them as
  ``alpha`` bounds, i.e. ``beta`` in ``[0.2, 3/7]``); ``beta_cap = 0.95``, ``shrink = 1.0``;
* candidates are clipped to the interval, capped at ``beta_cap``, multiplied by ``shrink``, and the
  surrogate ``rho~`` is evaluated at the resulting values.

The pure functions (:func:`cealc_factors`, :func:`aces_beta`, :func:`aces_coefficients`,
:func:`retained_energy_ratio`, :class:`PairedAccumulator`) need no model; :class:`SAESMethod` plugs
them into the shared compression pipeline (``paired=True``, ``feed="compressed"``: every layer's
statistics are collected after the layers feeding it were compressed, the paper's closed loop).
"""

from rankwise.compress.api import compress
from rankwise.compress.saes_svd.cealc import (
    AcesCoefficients,
    AcesResult,
    CealcWhitening,
    PairedAccumulator,
    aces_beta,
    aces_coefficients,
    aces_stationary_points,
    aces_surrogate,
    alpha_from_beta,
    beta_from_alpha,
    beta_interval,
    cealc_factors,
    cealc_objective,
    cealc_target,
    cealc_whitening,
    retained_energy_ratio,
    saes_rank,
)
from rankwise.compress.saes_svd.config import SAESConfig, SAESSVDConfig
from rankwise.compress.saes_svd.method import SAESMethod, SAESReport, saes_svd_compress
from rankwise.core.registry import register

__all__ = [
    "SAESSVDConfig", "SAESConfig", "SAESMethod", "PairedAccumulator", "AcesCoefficients", "AcesResult",
    "CealcWhitening", "saes_rank", "beta_from_alpha", "alpha_from_beta", "beta_interval", "cealc_whitening",
    "cealc_target", "cealc_factors", "cealc_objective", "retained_energy_ratio", "aces_coefficients",
    "aces_surrogate", "aces_stationary_points", "aces_beta", "saes_svd_compress", "SAESReport",
]

register("saes_svd", config=SAESConfig, entry=compress, module=__name__)
