"""What the intrinsic-dynamics modules share: the float64 dtype, numerical floors, the error for states
outside the intrinsic set, seeded draws, Jacobians and PSD powers.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from rankwise.core.errors import RankwiseError


DTYPE = torch.float64
# Eigenvalues of a PSD matrix below EIG_FLOOR_REL * (largest eigenvalue) are set to exactly 0
# before fractional powers: rounding noise of size 1e-16 would otherwise become 1e-16^(1/N).
EIG_FLOOR_REL = 1e-13
# Relative tolerance of the rank tests of the kernel-inclusion criterion (spec: SVD, 1e-8).
CRITERION_TOL = 1e-8


class NotIntrinsicError(RankwiseError, ValueError):
    """The state is outside the set where the lifted flow is intrinsic (e.g. a ReLU neuron with a_j = 0)."""


def _t(x: Any, name: str = "tensor") -> Tensor:
    t = torch.as_tensor(x, dtype=DTYPE).detach().clone() if not isinstance(x, Tensor) else x.detach().to(DTYPE)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} holds non-finite values")
    return t


def _gen(seed: int | torch.Generator | None) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator().manual_seed(0 if seed is None else int(seed))


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=DTYPE)


def _orthonormal_columns(g: torch.Generator, n: int, k: int) -> Tensor:
    q, r = torch.linalg.qr(_randn(g, n, k))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(k, dtype=DTYPE))


def _eigh(S: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric eigendecomposition (numpy LAPACK: far less per-call overhead than torch for the small
    matrices of these flows; no gradient is ever taken through it)."""
    lam, V = np.linalg.eigh(0.5 * (S + S.mT).detach().numpy())
    return torch.from_numpy(lam), torch.from_numpy(V)


def _jacobian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``(P, D)`` Jacobian of ``f: R^D -> R^P`` by reverse-mode autograd, one backward pass per output.

    (Plain autograd rather than ``torch.func``: the first ``torch.func`` call costs seconds of set-up.)"""
    x = x.detach().requires_grad_(True)
    y = f(x).reshape(-1)
    rows = []
    for i in range(y.numel()):
        (gi,) = torch.autograd.grad(y[i], x, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros_like(x) if gi is None else gi)
    return torch.stack(rows) if rows else torch.zeros(0, x.numel(), dtype=DTYPE)


def _jacobian_and_hessians(f: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """``J (P, D)`` and ``H (P, D, D)``, ``H[p] = Hessian of f_p``, by double backward."""
    x = x.detach().requires_grad_(True)
    y = f(x).reshape(-1)
    P, D = y.numel(), x.numel()
    J = torch.zeros(P, D, dtype=DTYPE)
    H = torch.zeros(P, D, D, dtype=DTYPE)
    for p in range(P):
        (gp,) = torch.autograd.grad(y[p], x, retain_graph=True, create_graph=True, allow_unused=True)
        if gp is None:
            continue
        J[p] = gp.detach()
        if not gp.requires_grad:
            continue
        for d in range(D):
            (hd,) = torch.autograd.grad(gp[d], x, retain_graph=True, allow_unused=True)
            if hd is not None:
                H[p, d] = hd
    return J, H


def psd_power(S: Tensor, p: float) -> Tensor:
    """``S^p`` of a symmetric PSD matrix via ``eigh``; ``p = 0`` gives the identity (also on the kernel).

    Eigenvalues below ``EIG_FLOOR_REL * lambda_max`` are set to 0 (documented floor)."""
    lam, V = _eigh(S)
    lam = _floor_eigs(lam)
    if p == 0:
        return torch.eye(S.shape[-1], dtype=S.dtype)
    return (V * lam.pow(p)) @ V.mT


def _floor_eigs(lam: Tensor) -> Tensor:
    top = lam.abs().max().clamp_min(1e-300)
    return torch.where(lam > EIG_FLOOR_REL * top, lam, torch.zeros_like(lam))


def _sqrtm_shift(S: Tensor, c: float) -> Tensor:
    """``(S + c I)^{1/2}`` for symmetric PSD ``S`` and ``c >= 0``; eigenvalues of ``S`` below
    ``EIG_FLOOR_REL * lambda_max`` count as 0 (the square root would turn 1e-17 rounding into 3e-9)."""
    lam, V = _eigh(S)
    return (V * (_floor_eigs(lam) + c).sqrt()) @ V.mT
