"""GFWSVD: Kronecker-factored Fisher-weighted SVD with a closed form (matrix-free Fisher factorisation).

"Scalable Kronecker-Factored Fisher Approximation for Neural Network Parameter Sensitivity", ICML
2026 (arXiv 2505.17974, earlier "Generalized Fisher-Weighted SVD"). Spec: ``shared/methods/gfwsvd.md``.

For a linear layer ``W`` (``m x n``, out x in) and calibration samples ``s = 1..S`` with per-sample
weight gradients ``G_s = dL_s/dW = sum_t delta_t x_t^T`` (``m x n``), the empirical Fisher of
``vec(W)`` (column stacking) is ``F = (1/S) sum_s vec(G_s) vec(G_s)^T``, ``(mn) x (mn)``. GFWSVD
approximates it by the nearest Kronecker product ``F ~ P kron Q`` (``P``: ``n x n``, input side;
``Q``: ``m x m``, output side) in Frobenius norm (Van Loan-Pitsianis), found *matrix-free* (MFF) by
the power iteration (alternating least squares on the rearranged Fisher)::

    Q <- I_m / sqrt(m)
    repeat T times:   P <- (1/S) sum_s G_s^T Q G_s;   P <- P / ||P||_F
                      Q <- (1/S) sum_s G_s P G_s^T;   sigma <- ||Q||_F;   Q <- Q / sigma
    return P, sigma Q

``G_s`` is never formed: ``G_s^T Q G_s = X_s^T (D_s Q D_s^T) X_s`` with ``X_s`` (``T_s x n``) the
inputs and ``D_s`` (``T_s x m``) the output gradients of sample ``s``'s tokens, captured by hooks.

Loss model: ``dL ~ 1/2 vec(dW)^T F vec(dW) ~ 1/2 ||L_Q^T dW L_P||_F^2`` with ``P + lam_P I = L_P L_P^T``,
``Q + lam_Q I = L_Q L_Q^T`` (``lam = damping * mean diag``). Its unique minimiser over rank-``r``
``W_r`` (closed form): ``Wt = L_Q^T W L_P = U S V^T``, ``W_r = L_Q^{-T} U_r S_r V_r^T L_P^{-1}``,
``A = L_Q^{-T} U_r S_r^{1/2}``, ``B = S_r^{1/2} V_r^T L_P^{-1}``. ``P = I, Q = diag(f)`` gives FWSVD;
``Q = I, P = X^T X`` gives SVD-LLM(W).

Choices (see ``docs/methods/gfwsvd.md``): a *sample* is one sequence (the leading dim of the
layer input), and ``G_s`` is the part of the batch loss's weight gradient that flows through that
sequence's tokens (exact per-sample gradients for losses that are sums over sequences; for an
in-batch contrastive loss it is the sequence's share of the batch gradient); the per-sample factors
are kept in the layer's own dtype (``storage="tokens"``, memory ``O(tokens (m + n))`` per layer, one
backward pass), or the data are re-run for each half-step (``storage="recompute"``, memory
``O(m^2 + n^2)``, ``2 T + 1`` passes); sums are accumulated in float64. With stored tokens, a layer
whose kept tokens ``N`` are few for its width is iterated in the token space (per-sample ``T_s x T_s``
blocks of ``P = X^T A X``, ``Q = D^T B D`` and the Grams ``X X^T``, ``D D^T``; same iterates), and
:func:`collect_sample_factors` lets other statistics share the one backward pass.
"""

from __future__ import annotations


from rankwise.compress.api import compress
from rankwise.compress.gfwsvd.collect import (
    PerSampleGradientCollector,
    collect_kronecker_fisher,
    collect_sample_factors,
    factors_from_samples,
    layer_stats_from_samples,
    load_factors,
    save_factors,
)
from rankwise.compress.gfwsvd.config import FactorKind, GFWSVDConfig, Storage
from rankwise.compress.gfwsvd.decompose import (
    gfwsvd_factors,
    gfwsvd_objective,
    gfwsvd_rank,
    kronecker_whiteners,
    predicted_loss_increase,
)
from rankwise.compress.gfwsvd.fisher import (
    KroneckerFactors,
    SampleFactors,
    explicit_fisher,
    kfac_from_samples,
    mff,
    mff_from_gradients,
    nearest_kronecker_fisher,
)
from rankwise.compress.gfwsvd.method import GFWSVDMethod, gfwsvd_compress
from rankwise.core.registry import register

__all__ = [
    "GFWSVDConfig", "GFWSVDMethod", "KroneckerFactors", "SampleFactors", "PerSampleGradientCollector",
    "explicit_fisher", "nearest_kronecker_fisher", "mff", "mff_from_gradients", "kfac_from_samples",
    "gfwsvd_factors", "gfwsvd_objective", "predicted_loss_increase", "kronecker_whiteners", "gfwsvd_rank",
    "collect_kronecker_fisher", "collect_sample_factors", "factors_from_samples", "layer_stats_from_samples",
    "gfwsvd_compress", "save_factors", "load_factors", "Storage", "FactorKind",
]

register("gfwsvd", config=GFWSVDConfig, entry=compress, module=__name__)
