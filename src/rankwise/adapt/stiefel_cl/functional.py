"""EBLoRA's math, no model needed: tangent projections, the polar retraction, the gradient initialisation
on the restricted Stiefel manifold, the GPM-style update of the protected subspace and spectra
(see :mod:`rankwise.adapt.stiefel_cl`). Every function works in float32 or wider and returns float32
unless said otherwise; SVDs run in float64."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from rankwise.core.errors import NumericalError
from rankwise.core.linalg import orthogonalize

__all__ = ["GPMUpdate", "balanced_spectrum", "check_feasible", "empty_basis", "factored_spectrum_ratio", "gpm_update", "gradient_init",
           "polar", "project_out", "project_tangent", "random_directions", "retract", "spectrum_ratio"]


#: ``||G (I - F F^T)||_F <= ZERO_RTOL ||G||_F`` counts as a zero projected gradient (float32 rounding of a
#: gradient that lies in the protected subspace; an exactly zero G too)
ZERO_RTOL = 1e-6


def _where(name: str | None) -> str:
    return f"layer {name!r}" if name else "EBLoRA"


def empty_basis(d_in: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                ) -> torch.Tensor:
    """The empty protected basis ``F`` of shape ``(d_in, 0)``."""
    return torch.zeros(d_in, 0, dtype=dtype, device=device)


def project_out(F: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """``g - F (F^T g)``: ``g`` (d_in, k) without its component in the span of ``F`` (d_in, p), orthonormal columns."""
    if F is None or F.shape[1] == 0:
        return g
    F = F.to(g.dtype)
    return g - F @ (F.T @ g)


def project_tangent(X: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g - X (g^T X)`` (spec step 3a): ``X^T P(g) = X^T g - g^T X`` is skew-symmetric, i.e. tangent at X."""
    return g - X @ (g.T @ X)


def polar(M: torch.Tensor) -> torch.Tensor:
    """``Y Z^T`` from the thin SVD ``M = Y S Z^T`` (``core.linalg.orthogonalize(method="polar")``, float64),
    returned in ``M``'s dtype: the matrix with orthonormal columns nearest to ``M``."""
    return orthogonalize(M, method="polar").to(M.dtype)


def retract(X_old: torch.Tensor, X_new: torch.Tensor, scale: float = 1.0, F: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The EBLoRA retraction (spec step 3c) of one factor after an unconstrained step ``X_old -> X_new``.

    ``δ = scale (X_new - X_old)``; for a V factor (``F`` given) ``δ -= F F^T δ``; ``δ`` projected to the
    tangent space at ``X_old``; ``M = X_old + δ`` (``M -= F F^T M`` for V); returns ``polar(M)``. With a
    zero step and ``X_old`` on the manifold it returns ``X_old`` (to rounding).
    """
    delta = (X_new - X_old) * scale
    delta = project_tangent(X_old, project_out(F, delta))
    return polar(project_out(F, X_old + delta))


def check_feasible(d_in: int, protected: int, rank: int, name: str | None = None) -> None:
    """ValueError unless ``rank <= d_in - protected`` (enough free input directions for V)."""
    free = d_in - protected
    if rank > free:
        raise ValueError(f"{_where(name)}: rank {rank} exceeds the free input directions d_in - rank(F) = "
                         f"{d_in} - {protected} = {free}; choose rank <= {free} or a lower energy_threshold "
                         "(fewer protected directions)")


def random_directions(d_out: int, d_in: int, rank: int, F: torch.Tensor | None, generator: torch.Generator | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``U`` (d_out, r) and ``V`` (d_in, r) with orthonormal columns and ``F^T V = 0`` (float32)."""
    U = torch.randn(d_out, rank, generator=generator, dtype=torch.float64)
    V = torch.randn(d_in, rank, generator=generator, dtype=torch.float64)
    V = project_out(None if F is None else F.double(), V)
    return polar(U).float(), polar(project_out(None if F is None else F.double(), polar(V))).float()


def gradient_init(G: torch.Tensor, F: torch.Tensor | None, rank: int, *, generator_seed: int | None = 0,
                  name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, V)`` of the gradient initialisation (spec step 2), float32.

    ``G`` (d_out, d_in) is the averaged loss gradient; ``G̃ = G (I - F F^T)``; ``torch.svd_lowrank(G̃^T, q=r)``
    gives ``G̃^T ≈ P Σ Q^T``; ``V = P``, ``U = Q`` (cleaned: F removed from V again and both polar-projected, so
    that ``U^T U = V^T V = I`` and ``F^T V = 0`` hold in float32). NaN/inf raises NumericalError naming the
    layer; a zero ``G̃`` (``||G̃||_F <= ZERO_RTOL ||G||_F``) falls back to :func:`random_directions` with a warning. ``generator_seed`` seeds the
    randomised SVD (the caller's RNG is untouched).
    """
    if G.ndim != 2:
        raise ValueError(f"{_where(name)}: the gradient must be a matrix (d_out, d_in), got {tuple(G.shape)}")
    d_out, d_in = G.shape
    Fd = None if F is None or F.shape[1] == 0 else F.double()
    check_feasible(d_in, 0 if Fd is None else Fd.shape[1], rank, name)
    if rank > d_out:
        raise ValueError(f"{_where(name)}: rank {rank} exceeds out_features {d_out}")
    G = G.detach().double()
    if not bool(torch.isfinite(G).all()):
        raise NumericalError(f"{_where(name)}: the initialisation gradient holds NaN or inf")
    Gt = project_out(Fd, G.T)  # G̃^T = (I - F F^T) G^T, (d_in, d_out)
    gen = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    if float(torch.linalg.matrix_norm(Gt)) <= ZERO_RTOL * float(torch.linalg.matrix_norm(G)):
        warnings.warn(f"{_where(name)}: the projected gradient is zero (G (I - F F^T) = 0); EBLoRA starts from "
                      "random orthonormal directions instead", stacklevel=3)
        return random_directions(d_out, d_in, rank, Fd, gen)
    with torch.random.fork_rng(devices=[]):
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        P, S, Q = torch.svd_lowrank(Gt, q=min(rank, min(Gt.shape)), niter=4)
    if not (bool(torch.isfinite(P).all()) and bool(torch.isfinite(Q).all())):
        raise NumericalError(f"{_where(name)}: the SVD of the initialisation gradient returned NaN or inf")
    V = polar(project_out(Fd, P))
    V = polar(project_out(Fd, V))
    return polar(Q).float(), V.float()


class GPMUpdate(NamedTuple):
    """The result of :func:`gpm_update`: the new basis, how many columns were added, the retained energy."""

    F: torch.Tensor
    added: int
    retained: float


def gpm_update(F: torch.Tensor | None, G: torch.Tensor, threshold: float, *, name: str | None = None) -> GPMUpdate:
    """The GPM-style update of the protected input subspace (spec step 4), float32 basis out.

    ``K = G^T`` (d_in, d_out), ``E = ||K||_F^2``, ``K̂ = (I - F F^T) K = Y S Z^T``; adds the fewest leading
    columns ``j`` of ``Y`` with ``(E - ||K̂||_F^2 + Σ_{k<=j} S_k^2) / E >= threshold`` (``j = 0`` when the
    residual already satisfies it), capped at ``d_in`` columns in all. The new columns are orthogonalised
    against ``F`` once more (QR in float64), so ``F^T F = I`` holds to float32 rounding.
    """
    if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0.0 < threshold <= 1.0):
        raise ValueError(f"EBLoRA energy_threshold must be a number in (0, 1], got {threshold!r}")
    d_out, d_in = G.shape
    Fd = torch.zeros(d_in, 0, dtype=torch.float64) if F is None else F.detach().double().cpu()
    K = G.detach().double().cpu().T
    if not bool(torch.isfinite(K).all()):
        raise NumericalError(f"{_where(name)}: the gradient of the subspace update holds NaN or inf")
    E = float(K.square().sum())
    if E == 0.0:
        return GPMUpdate(Fd.float(), 0, 1.0)
    Kh = project_out(Fd, K)
    Y, S, _ = torch.linalg.svd(Kh, full_matrices=False)
    base = (E - float(Kh.square().sum())) / E
    if base >= threshold:
        return GPMUpdate(Fd.float(), 0, base)
    cum = base + torch.cumsum(S.square(), 0) / E
    hit = torch.nonzero(cum >= threshold - 1e-12)
    j = int(hit[0]) + 1 if len(hit) else int(S.numel())
    j = min(j, d_in - Fd.shape[1])
    new = Y[:, :j]
    if j:
        new = project_out(Fd, new)
        new, _ = torch.linalg.qr(new)
    F_new = torch.cat([Fd, new], 1)
    retained = float(cum[j - 1]) if j else base
    return GPMUpdate(F_new.float(), j, retained)


@torch.no_grad()
def spectrum_ratio(delta: torch.Tensor, rank: int) -> float:
    """``σ_1 / σ_r`` of an update (float64 SVD); inf when ``σ_r = 0``."""
    s = torch.linalg.svdvals(delta.detach().double())
    if rank > s.numel():
        raise ValueError(f"rank {rank} exceeds the matrix size {tuple(delta.shape)}")
    top, low = float(s[0]), float(s[rank - 1])
    return float("inf") if low == 0.0 else top / low


@torch.no_grad()
def factored_spectrum_ratio(B: torch.Tensor, A: torch.Tensor) -> float:
    """``σ_1 / σ_r`` of ``B A`` (B (out, r), A (r, in)) from the r x r core ``R_B R_A^T`` of two thin QRs (float64):
    the same singular values as the dense product at O((out + in) r^2) cost; inf when ``σ_r = 0``."""
    _, RB = torch.linalg.qr(B.detach().double())
    _, RA = torch.linalg.qr(A.detach().double().T)
    s = torch.linalg.svdvals(RB @ RA.T)
    top, low = float(s[0]), float(s[-1])
    return float("inf") if low == 0.0 else top / low


@torch.no_grad()
def balanced_spectrum(U: torch.Tensor, V: torch.Tensor, magnitude: float, scaling: float) -> torch.Tensor:
    """The r leading singular values of ``c s U V^T`` (float64); all equal ``|c s|`` on the manifold."""
    delta = scaling * magnitude * (U.double() @ V.double().T)
    return torch.linalg.svdvals(delta)[: U.shape[1]]
