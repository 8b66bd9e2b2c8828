"""CondiQuant's conditioning: proximal gradient descent on each weight's singular values.

Notation (the spec's): a layer maps calibration inputs ``X`` (``N x n``) through ``W`` (``n x m``, input x
output: the transpose of ``nn.Linear.weight``; a conv kernel ``(c_out, c_in, k_h, k_w)`` becomes
``(c_in k_h k_w) x c_out`` over unfolded patches, so a 1x1 conv is a Linear over channels). ``W0`` is the
original weight, ``Y = X W0`` its fixed output, ``H = X^T X`` (``n x n``, from :mod:`rankwise.core.stats`),
``kappa(W) = sigma_max / sigma_min`` over the ``min(n, m)`` singular values.

Objective (Eq. 7): ``min_W f(W) + lambda G(W)`` with the output term normalised by ``L = ||H||_2``::

    f(W) = ||X W - Y||_F^2 / (2 L),   grad f(W) = H (W - W0) / L = X^T (X W - Y) / L

so that the step ``eta = 1 / Lipschitz(f) = 1`` and ``lambda`` does not depend on the scale of the
activations (with the paper's unnormalised ``f`` this is ``lambda_paper = lambda L``; the choice is ours).
Each of the ``K`` steps is a gradient step then the prox of ``lambda mu G`` (``mu = eta = 1``) on the
singular values of the half step: ``U S V^T = SVD(W_half)``, ``W = W_half + U (prox(S) - S) V^T`` (equal
to ``U prox(S) V^T``, and exactly ``W_half`` when the prox changes nothing).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from rankwise.compress.condiquant.config import CondiQuantConfig

Tensor = torch.Tensor

__all__ = ["LayerResult", "MatrixResult", "condition_matrix", "condition_weight", "kappa", "output_grad",
           "output_loss", "prox_shave", "prox_spread", "rel_output_err", "singular_values"]

# a singular value below this fraction of sigma_max counts as zero (kappa = inf)
ZERO_SV = 1e-12
# a matrix with kappa <= 1 + this is already orthogonal up to float32 rounding: left alone
KAPPA_ONE = 1e-5


def singular_values(W: Tensor) -> Tensor:
    """The singular values of ``W`` in float64, descending."""
    return torch.linalg.svdvals(W.detach().to(torch.float64))


def kappa(W: Tensor) -> float:
    """``sigma_max / sigma_min`` of ``W`` (``inf`` for a rank-deficient or zero matrix)."""
    s = singular_values(W)
    if s.numel() == 0 or float(s[0]) == 0.0 or float(s[-1]) <= ZERO_SV * float(s[0]):
        return math.inf
    return float(s[0] / s[-1])


def prox_spread(s: Tensor, t: float) -> Tensor:
    """Prox of ``t * sum_i (sigma_i - mean sigma)^2``: ``mean + (sigma_i - mean) / (1 + 2 t)``.

    Keeps the mean and the order, never raises ``sigma_max`` nor lowers ``sigma_min``; ``t = 0`` returns ``s``."""
    if t < 0:
        raise ValueError(f"prox_spread: t must be >= 0, got {t}")
    m = s.mean()
    return m + (s - m) / (1.0 + 2.0 * t)


def prox_shave(s: Tensor, t: float, scale: float) -> Tensor:
    """The "shave" variant: ``sigma_i <- min(sigma_i, sigma_1 - t * scale)``, the cut floored at ``sigma_min``
    (so that ``sigma_min`` never drops); cuts only the top of the spectrum and keeps the order."""
    if t < 0:
        raise ValueError(f"prox_shave: t must be >= 0, got {t}")
    if s.numel() == 0:
        return s
    cut = torch.clamp(s[0] - t * scale, min=float(s[-1]))
    return torch.minimum(s, cut)


def output_loss(H: Tensor, W: Tensor, W0: Tensor, L: float = 1.0) -> Tensor:
    """``f(W) = ||X (W - W0)||_F^2 / (2 L) = tr(D^T H D) / (2 L)`` with ``D = W - W0``."""
    D = W - W0
    return (D * (H @ D)).sum() / (2.0 * L)


def output_grad(H: Tensor, W: Tensor, W0: Tensor, L: float = 1.0) -> Tensor:
    """``grad f(W) = H (W - W0) / L = X^T (X W - Y) / L`` with ``Y = X W0`` fixed."""
    return H @ (W - W0) / L


def rel_output_err(H: Tensor, W: Tensor, W0: Tensor) -> float:
    """``||X W - Y||_F / ||Y||_F`` from ``H = X^T X`` alone (0 when ``Y = 0``)."""
    den = float((W0 * (H @ W0)).sum())
    if den <= 0.0:
        return 0.0
    D = W - W0
    return math.sqrt(max(float((D * (H @ D)).sum()), 0.0) / den)


@dataclasses.dataclass
class MatrixResult:
    """One PGD run: the final weight, its error and kappa, and the steps taken."""

    W: Tensor
    lam: float
    rel_err: float
    kappa: float
    iters: int


def condition_matrix(W0: Tensor, H: Tensor, lam: float, *, prox: str = "spread", max_iters: int = 100,
                     max_rel_output_err: float | None = None, early_stop: bool = False,
                     target_kappa: float | None = None) -> MatrixResult:
    """Run ``max_iters`` proximal gradient steps from ``W0`` (``n x m``) with ``H = X^T X`` (``n x n``).

    ``lam = 0`` returns ``W0`` unchanged (exactly). With ``early_stop`` the run ends at the first step whose
    relative output error exceeds ``max_rel_output_err`` and returns the iterate before it; with
    ``target_kappa`` it ends once kappa <= target. Computes in float64; returns float64.
    """
    W0 = W0.detach().to(torch.float64)
    H = H.detach().to(torch.float64)
    if H.shape != (W0.shape[0], W0.shape[0]):
        raise ValueError(f"H must be {W0.shape[0]} x {W0.shape[0]} for W of shape {tuple(W0.shape)}, got {tuple(H.shape)}")
    L = float(torch.linalg.eigvalsh(H)[-1]) if H.numel() else 0.0
    if lam == 0.0 or L <= 0.0:
        return MatrixResult(W0.clone(), float(lam), 0.0, kappa(W0), 0)
    Hn = H / L
    scale = float(singular_values(W0)[0])
    W, it = W0.clone(), 0
    for it in range(1, max_iters + 1):
        half = W - Hn @ (W - W0)
        U, S, Vh = torch.linalg.svd(half, full_matrices=False)
        S2 = prox_spread(S, lam) if prox == "spread" else prox_shave(S, lam, scale)
        new = half + (U * (S2 - S)) @ Vh
        if early_stop and max_rel_output_err is not None and rel_output_err(H, new, W0) > max_rel_output_err:
            it -= 1
            break
        W = new
        if target_kappa is not None and kappa(W) <= target_kappa:
            break
    return MatrixResult(W, float(lam), rel_output_err(H, W, W0), kappa(W), it)


@dataclasses.dataclass
class LayerResult:
    """Per-layer outcome of :func:`condition_weight` (one matrix, or one group of a grouped conv)."""

    name: str
    shape: tuple[int, int]
    kappa_before: float
    kappa_after: float
    lam: float
    rel_err: float
    iters: int
    status: str                      #: "conditioned", "unchanged" or "skipped: <why>"
    trace: list[dict[str, Any]] = dataclasses.field(default_factory=list)  #: (lam, rel_err, kappa) tried
    W: Tensor | None = dataclasses.field(default=None, repr=False)  #: the kept weight (n x m, float64)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "W"}
        d["shape"] = list(self.shape)
        d["trace"] = [dict(t) for t in self.trace]
        for k in ("kappa_before", "kappa_after"):
            d[k] = None if math.isinf(d[k]) else d[k]
        return d


def condition_weight(name: str, W0: Tensor, H: Tensor, cfg: CondiQuantConfig) -> LayerResult:
    """Search ``cfg.lambdas()`` (largest first) for one matrix and keep the first admissible result.

    Admissible: relative output error <= ``cfg.max_rel_output_err`` and kappa not above ``kappa(W0)``
    (and finite). None admissible: ``W0`` is kept (``status="unchanged"``, or ``"skipped: kappa = inf"`` for a
    rank-deficient ``W0`` whose lift would leave the budget). The result's weight is ``result.W`` (float64).
    """
    k0 = kappa(W0)
    res = LayerResult(name, (int(W0.shape[0]), int(W0.shape[1])), k0, k0, 0.0, 0.0, 0, "unchanged",
                      W=W0.detach().to(torch.float64).clone())
    if k0 <= 1.0 + KAPPA_ONE or float(singular_values(W0)[0]) == 0.0:
        return res
    for lam in cfg.lambdas():
        r = condition_matrix(W0, H, lam, prox=cfg.prox, max_iters=cfg.max_iters,
                             max_rel_output_err=cfg.max_rel_output_err, early_stop=cfg.early_stop,
                             target_kappa=cfg.target_kappa)
        res.trace.append({"lam": lam, "rel_err": r.rel_err, "kappa": r.kappa if math.isfinite(r.kappa) else None})
        if r.rel_err <= cfg.max_rel_output_err and math.isfinite(r.kappa) and r.kappa <= k0 and r.iters > 0:
            res.W, res.lam, res.rel_err, res.kappa_after, res.iters = r.W, lam, r.rel_err, r.kappa, r.iters
            res.status = "conditioned"
            return res
    if math.isinf(k0):
        res.status = "skipped: kappa = inf (rank-deficient W0; no lift within the output budget)"
    return res
