"""mtLoRA's math, no model needed: routing weights, the balance loss, the spectral penalty and its schedule."""

from __future__ import annotations

import torch

from rankwise.adapt.mtlora.config import BASES, CV_EPS, _pos_int
from rankwise.core.errors import NumericalError


# ------------------------------------------------------------------------------------------------
# the pure math
# ------------------------------------------------------------------------------------------------

def routing_weights(logits: torch.Tensor, num_groups: int, num_experts: int, *, where: str = "router") -> torch.Tensor:
    """FGR routing weights: ``logits (..., E G)`` -> ``(..., G, E)``, softmax over E within each group.

    Non-finite logits raise :class:`NumericalError` naming ``where``.
    """
    if logits.shape[-1] != num_groups * num_experts:
        raise ValueError(f"{where}: logits have {logits.shape[-1]} entries, expected G*E = {num_groups * num_experts}")
    if not bool(torch.isfinite(logits).all()):
        raise NumericalError(f"{where}: routing logits hold NaN or inf")
    return torch.softmax(logits.reshape(*logits.shape[:-1], num_groups, num_experts).float(), dim=-1).to(logits.dtype)


def balance_loss(routing: torch.Tensor) -> torch.Tensor:
    """HydraLoRA's load-balance term: ``Var(p_bar) / (mean(p_bar)^2 + eps)`` over the E experts.

    ``routing (..., E)``: routing weights of every token (and group); ``p_bar`` is their mean over all
    leading dimensions. The variance is the unbiased one (``torch.var``, as HydraLoRA's ``cv_squared``);
    0 when the mean routing is uniform. A single expert gives 0.
    """
    e = routing.shape[-1]
    if e < 2:
        return routing.new_zeros(())
    p_bar = routing.reshape(-1, e).float().mean(0)
    return p_bar.var() / (p_bar.mean().square() + CV_EPS)


def spectral_weights(sigma: torch.Tensor) -> torch.Tensor:
    """``w_k = exp(-sigma_k / mean(sigma))``; uniform weights (1) when ``mean(sigma)`` is 0 or not finite."""
    m = sigma.mean()
    if not bool(torch.isfinite(sigma).all()) or float(m) <= 0.0:
        return torch.ones_like(sigma)
    return torch.exp(-sigma / m)


def spectral_penalty(B: torch.Tensor, basis: str = "singular") -> torch.Tensor:
    """Spectral-aware orthogonality penalty of one expert ``B (d_out, r)`` (scalar, >= 0).

    ``sum_{k,l} (w_k w_l (Gram - c^2 I)_{kl})^2`` with ``Gram = B^T B`` (in B's right-singular basis for
    ``basis="singular"``, on its column indices for ``"column"``), ``w`` from :func:`spectral_weights` of
    the singular values (descending) and ``c = ||B||_F / sqrt(r)``; ``w``, ``c`` and the basis are
    detached, so the gradient reaches ``B`` only through the Gram matrix. An SVD failure (degenerate
    ``B``) falls back to uniform weights and the column basis. Computed in float32 or wider.
    """
    if basis not in BASES:
        raise ValueError(f"spectral_penalty: basis must be one of {BASES}, got {basis!r}")
    if B.ndim != 2:
        raise ValueError(f"spectral_penalty: B must be 2-D (d_out, r), got shape {tuple(B.shape)}")
    Bw = B if B.dtype in (torch.float32, torch.float64) else B.float()
    r = Bw.shape[1]
    V = None
    with torch.no_grad():
        try:
            _, sigma, Vh = torch.linalg.svd(Bw.detach().double(), full_matrices=False)
            w = spectral_weights(sigma).to(Bw.dtype)
            V = Vh.T.to(Bw.dtype)
        except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
            w = torch.ones(r, dtype=Bw.dtype, device=Bw.device)
        c2 = Bw.detach().square().sum() / r
    gram = Bw.T @ Bw
    if basis == "singular" and V is not None:
        gram = V.T @ gram @ V
    D = gram - c2 * torch.eye(r, dtype=Bw.dtype, device=Bw.device)
    return (w[:, None] * w[None, :] * D).square().sum()


def spectral_due(step: int, every: int) -> bool:
    """Whether the spectral term is added at ``step`` (0-based): ``step > 0`` and ``step % every == 0``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not _pos_int(every):
        raise ValueError(f"spectral_every must be an int >= 1, got {every!r}")
    return step > 0 and step % every == 0
