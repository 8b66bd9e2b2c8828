"""Numerical linear algebra shared by the compression, adaptation and optimisation methods.

Conventions used throughout this module:

* A weight ``W`` has the PyTorch layout ``(out, in) = (m, n)``; a low-rank approximation is
  ``W ~ A @ B`` with ``A`` (``m x r``, the *up* factor, applied second) and ``B`` (``r x n``, the
  *down* factor, applied first), as in the Swift-SVD / SAES-SVD / GFWSVD papers.
* ``dtype`` arguments name the *computation* dtype (default ``torch.float64``); results are
  returned in that dtype. Pass ``dtype=None`` to compute in the input's own floating dtype.
* ``vec`` is **column stacking** (the convention of the Kronecker-factored Fisher literature):
  ``vec(X) = X.mT.reshape(-1)``, and ``(A kron B) vec(X) = vec(B X A^T)``.
  :class:`~rankwise.core.layers.KroneckerLinear` uses the row-major identity instead:
  ``kron(A, B) @ x = (A X B^T).reshape(-1)`` with ``X = x.reshape(n_A, n_B)``; both are provided.
* Every floor, damping or jitter is *relative* to a scale of the input (the mean of the diagonal or
  the largest eigenvalue) and is stated in the docstring; failures raise
  :class:`~rankwise.core.errors.NumericalError` naming the ``name`` argument (a layer name).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Sequence

import torch

from rankwise.core.errors import NumericalError

Tensor = torch.Tensor
Balance = Literal["sqrt", "left", "right"]

__all__ = [
    "CholeskyResult", "LowRankFactors", "damped_cholesky", "whiten", "eigh_desc", "sqrtm_psd",
    "inv_sqrtm_psd", "truncated_svd", "randomized_svd", "lowrank_factors", "factors_from_svd",
    "weighted_lowrank_factors", "effective_rank", "normalized_effective_rank", "stable_rank",
    "orthogonalize", "newton_schulz", "vec", "unvec", "kron", "kron_matvec", "kron_sum_matvec",
    "kron_rowmajor_apply", "kron_rearrange", "nearest_kronecker", "check_finite",
]


# ----------------------------------------------------------------------------------------------
# checks


def _where(name: str | None) -> str:
    return f" in layer {name!r}" if name else ""


def _as_float(x: Tensor, dtype: torch.dtype | None, what: str) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if dtype is None:
        return x if x.is_floating_point() else x.to(torch.get_default_dtype())
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    return x.to(dtype)


def _matrix(x: Tensor, dtype: torch.dtype | None, what: str, *, square: bool = False) -> Tensor:
    x = _as_float(x, dtype, what)
    if x.ndim != 2:
        raise ValueError(f"{what} must be a 2-D matrix, got shape {tuple(x.shape)}")
    if square and x.shape[0] != x.shape[1]:
        raise ValueError(f"{what} must be square, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{what} is empty (shape {tuple(x.shape)})")
    return x


def check_finite(x: Tensor, what: str, name: str | None = None) -> Tensor:
    """Raise :class:`NumericalError` naming ``what`` (and the layer ``name``) if ``x`` has NaN/Inf."""
    if not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        raise NumericalError(f"{what}{_where(name)} has {n_bad} non-finite value(s) (NaN or Inf)")
    return x


def _check_rank(rank: int, m: int, n: int, name: str | None = None) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 < rank <= min(m, n):
        raise ValueError(f"rank={rank}{_where(name)} is out of range: need 0 < rank <= min(m, n) = {min(m, n)}"
                         f" for a {m} x {n} matrix")
    return rank


def _sym(x: Tensor) -> Tensor:
    return 0.5 * (x + x.mT)


# ----------------------------------------------------------------------------------------------
# Cholesky whitening and symmetric square roots


class CholeskyResult(NamedTuple):
    """``L`` lower-triangular with ``L @ L.T = H + jitter * I``; ``attempts`` Cholesky calls made."""

    L: Tensor
    jitter: float
    attempts: int


def damped_cholesky(
    H: Tensor,
    *,
    damping: float = 1e-6,
    retries: int = 5,
    growth: float = 10.0,
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> CholeskyResult:
    """Cholesky factor of a symmetric PSD matrix with a relative diagonal floor and jitter retries.

    Attempt ``i = 0..retries`` factors ``H + lam_i I`` with ``lam_i = damping * mean(diag H) *
    growth**i``: the first attempt already adds ``damping * mean(diag H)`` (the SVD-LLM recipe:
    ``1e-6 * mean(diag)``, x10 per retry; SAES-SVD: at most 5 retries). ``damping=0`` means an
    exact, undamped Cholesky (one attempt; a singular ``H`` then raises).

    Args:
        H: ``(n, n)`` symmetric positive semi-definite matrix (e.g. ``X^T X``); symmetrised first.
    Returns:
        :class:`CholeskyResult` with ``L`` ``(n, n)`` lower triangular, the absolute jitter used.
    Raises:
        NumericalError: non-finite ``H``, ``mean(diag H) <= 0`` with damping, or every attempt failed.
    """
    if damping < 0 or not math.isfinite(damping):
        raise ValueError(f"damping must be a finite number >= 0, got {damping}")
    if retries < 0 or growth <= 1.0:
        raise ValueError(f"need retries >= 0 and growth > 1, got retries={retries}, growth={growth}")
    H = _sym(_matrix(H, dtype, "H", square=True))
    check_finite(H, "covariance H", name)
    n = H.shape[0]
    scale = float(torch.diagonal(H).mean())
    if damping > 0 and scale <= 0:
        raise NumericalError(f"covariance{_where(name)} has mean diagonal {scale:.3g} <= 0: it is zero "
                             "(the layer saw no signal) or not PSD; cannot whiten")
    eye = torch.eye(n, dtype=H.dtype, device=H.device)
    n_attempts = 1 if damping == 0 else retries + 1
    lam = damping * scale
    for i in range(n_attempts):
        L, info = torch.linalg.cholesky_ex(H + lam * eye if lam > 0 else H)
        if int(info) == 0 and bool(torch.isfinite(L).all()) and bool((torch.diagonal(L) > 0).all()):
            return CholeskyResult(L, lam, i + 1)
        lam *= growth
    raise NumericalError(
        f"Cholesky of the {n}x{n} covariance{_where(name)} failed after {n_attempts} attempt(s) "
        f"(relative damping {damping:g}, last absolute jitter {lam / growth:.3g}); the covariance is "
        "singular or indefinite: raise `damping`, use more calibration tokens, or an eigh-based whitener")


def eigh_desc(
    C: Tensor,
    *,
    floor: float | None = 0.0,
    rel_floor: float = 0.0,
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of a symmetric matrix, eigenvalues sorted descending and floored.

    ``C`` is symmetrised; eigenvalues are clamped from below to ``max(floor, rel_floor * lam_max)``
    (``floor=0`` clamps the small negative eigenvalues rounding produces for a PSD matrix;
    ``floor=None`` with ``rel_floor=0`` disables clamping). Returns ``(lam (n,), V (n, n))`` with
    ``C ~ V diag(lam) V^T`` and ``lam[0] >= lam[1] >= ...``.
    """
    C = _sym(_matrix(C, dtype, "C", square=True))
    check_finite(C, "symmetric matrix", name)
    lam, V = torch.linalg.eigh(C)
    lam, V = lam.flip(0), V.flip(1)
    if floor is not None or rel_floor > 0:
        lo = max(floor or 0.0, rel_floor * float(lam[0].clamp_min(0)))
        lam = lam.clamp_min(lo)
    return lam, V


def sqrtm_psd(C: Tensor, *, dtype: torch.dtype | None = torch.float64, name: str | None = None) -> Tensor:
    """Symmetric PSD square root ``C^{1/2} = V diag(sqrt(max(lam, 0))) V^T`` of an ``(n, n)`` matrix."""
    lam, V = eigh_desc(C, floor=0.0, dtype=dtype, name=name)
    return (V * lam.sqrt()) @ V.mT


def inv_sqrtm_psd(
    C: Tensor,
    *,
    rel_floor: float = 1e-6,
    abs_floor: float = 0.0,
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> Tensor:
    """Symmetric inverse square root ``V diag(max(lam, f)^{-1/2}) V^T`` with a documented floor.

    Eigenvalues are floored at ``f = max(rel_floor * lam_max, abs_floor)`` so directions the data
    never excites are scaled by ``f^{-1/2}`` rather than infinity.
    Raises :class:`NumericalError` if ``C`` is zero (``lam_max <= 0``) and ``abs_floor == 0``.
    """
    if rel_floor < 0 or abs_floor < 0 or (rel_floor == 0 and abs_floor == 0):
        raise ValueError(f"need a positive floor: rel_floor={rel_floor}, abs_floor={abs_floor}")
    lam, V = eigh_desc(C, floor=None, dtype=dtype, name=name)
    f = max(rel_floor * float(lam[0]), abs_floor)
    if f <= 0:
        raise NumericalError(f"matrix{_where(name)} has largest eigenvalue {float(lam[0]):.3g} <= 0; "
                             "its inverse square root is undefined (zero covariance?)")
    return (V * lam.clamp_min(f).rsqrt()) @ V.mT


def whiten(
    H: Tensor,
    *,
    method: Literal["cholesky", "eigh"] = "cholesky",
    damping: float = 1e-6,
    retries: int = 5,
    rel_floor: float = 1e-6,
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> Tensor:
    """A whitening square root ``S`` with ``S S^T ~ H`` (``n x n``), for SVD-LLM-style whitening.

    ``method="cholesky"``: ``S`` lower triangular from :func:`damped_cholesky` (``S S^T = H + jitter I``).
    ``method="eigh"``: ``S = V diag(sqrt(max(lam, rel_floor * lam_max))) V^T`` (symmetric; always
    succeeds for a non-zero PSD ``H``). Both give the same truncated product ``[W S]_r S^{-1}`` when
    ``H`` is well conditioned.
    """
    if method == "cholesky":
        return damped_cholesky(H, damping=damping, retries=retries, dtype=dtype, name=name).L
    if method == "eigh":
        if rel_floor <= 0:
            raise ValueError(f"rel_floor must be > 0 for the eigh whitener, got {rel_floor}")
        lam, V = eigh_desc(H, floor=None, dtype=dtype, name=name)
        if float(lam[0]) <= 0:
            raise NumericalError(f"covariance{_where(name)} is zero; cannot whiten")
        return (V * lam.clamp_min(rel_floor * float(lam[0])).sqrt()) @ V.mT
    raise ValueError(f"method must be 'cholesky' or 'eigh', got {method!r}")


# ----------------------------------------------------------------------------------------------
# SVD


def truncated_svd(
    M: Tensor, rank: int, *, dtype: torch.dtype | None = torch.float64, name: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``rank`` SVD ``M ~ U diag(S) Vh`` of an ``(m, n)`` matrix (exact, via ``torch.linalg.svd``).

    Returns ``U (m, r)``, ``S (r,)`` descending, ``Vh (r, n)``. By Eckart-Young the error
    ``||M - U diag(S) Vh||_F^2`` is the sum of the discarded ``S_i^2``.
    """
    M = _matrix(M, dtype, "M")
    check_finite(M, "matrix", name)
    _check_rank(rank, *M.shape, name=name)
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    return U[:, :rank], S[:rank], Vh[:rank]


def randomized_svd(
    M: Tensor,
    rank: int,
    *,
    oversample: int = 10,
    power_iters: int = 2,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Randomized top-``rank`` SVD (Halko, Martinsson & Tropp 2011, Alg. 4.4 with QR re-orthonormalisation).

    A Gaussian test matrix of ``rank + oversample`` columns (drawn from ``generator``, or a fresh one
    seeded with ``seed`` (default 0) on ``M``'s device) sketches the range of ``M``; ``power_iters``
    subspace iterations sharpen it. Exact (to rounding) when ``rank(M) <= rank + oversample``.
    Returns ``U (m, r)``, ``S (r,)``, ``Vh (r, n)`` like :func:`truncated_svd`.
    """
    M = _matrix(M, dtype, "M")
    check_finite(M, "matrix", name)
    m, n = M.shape
    _check_rank(rank, m, n, name=name)
    if oversample < 0 or power_iters < 0:
        raise ValueError(f"oversample and power_iters must be >= 0, got {oversample}, {power_iters}")
    if generator is None:
        generator = torch.Generator(device=M.device)
        generator.manual_seed(0 if seed is None else int(seed))
    elif seed is not None:
        raise ValueError("give either generator or seed, not both")
    ell = min(rank + oversample, min(m, n))
    omega = torch.randn(n, ell, generator=generator, device=M.device, dtype=M.dtype)
    Q = torch.linalg.qr(M @ omega).Q
    for _ in range(power_iters):
        Q = torch.linalg.qr(M.mT @ Q).Q
        Q = torch.linalg.qr(M @ Q).Q
    Ub, S, Vh = torch.linalg.svd(Q.mT @ M, full_matrices=False)
    return (Q @ Ub)[:, :rank], S[:rank], Vh[:rank]


class LowRankFactors(NamedTuple):
    """A rank-``r`` factorisation ``W ~ A @ B``: ``B`` (``r x n``, down, applied first), ``A`` (``m x r``, up).

    The order ``(B, A)`` matches :meth:`rankwise.core.layers.LowRankLinear.from_factors`.
    """

    B: Tensor
    A: Tensor

    def product(self) -> Tensor:
        """The ``(m, n)`` matrix ``A @ B``."""
        return self.A @ self.B

    @property
    def rank(self) -> int:
        return self.B.shape[0]


def factors_from_svd(U: Tensor, S: Tensor, Vh: Tensor, *, balance: Balance = "sqrt") -> LowRankFactors:
    """Split ``U diag(S) Vh`` into ``(B, A)``.

    ``balance="sqrt"``: ``A = U S^{1/2}``, ``B = S^{1/2} Vh`` (SVD-LLM / SAES-SVD / GFWSVD);
    ``"left"``: ``A = U S``, ``B = Vh`` (all singular values on the up factor);
    ``"right"``: ``A = U``, ``B = S Vh`` (all on the down factor, as Swift-SVD's ``B = V_k^T W``).
    """
    if U.ndim != 2 or Vh.ndim != 2 or S.ndim != 1 or not (U.shape[1] == S.shape[0] == Vh.shape[0]):
        raise ValueError(f"inconsistent SVD shapes U {tuple(U.shape)}, S {tuple(S.shape)}, Vh {tuple(Vh.shape)}")
    if balance == "sqrt":
        r = S.clamp_min(0).sqrt()
        return LowRankFactors(r[:, None] * Vh, U * r)
    if balance == "left":
        return LowRankFactors(Vh.clone(), U * S)
    if balance == "right":
        return LowRankFactors(S[:, None] * Vh, U.clone())
    raise ValueError(f"balance must be 'sqrt', 'left' or 'right', got {balance!r}")


def lowrank_factors(
    W: Tensor,
    rank: int,
    *,
    balance: Balance = "sqrt",
    method: Literal["exact", "randomized"] = "exact",
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> LowRankFactors:
    """Best rank-``rank`` factors ``(B, A)`` of ``W`` (``m x n``) in Frobenius norm (Eckart-Young)."""
    if method == "exact":
        U, S, Vh = truncated_svd(W, rank, dtype=dtype, name=name)
    elif method == "randomized":
        U, S, Vh = randomized_svd(W, rank, generator=generator, dtype=dtype, name=name)
    else:
        raise ValueError(f"method must be 'exact' or 'randomized', got {method!r}")
    return factors_from_svd(U, S, Vh, balance=balance)


def weighted_lowrank_factors(
    W: Tensor,
    rank: int,
    *,
    left: Tensor | None = None,
    right: Tensor | None = None,
    balance: Balance = "sqrt",
    dtype: torch.dtype | None = torch.float64,
    name: str | None = None,
) -> LowRankFactors:
    """Closed-form minimiser of ``||left (W - A B) right||_F`` over rank-``rank`` products ``A B``.

    With invertible ``left`` (``m x m``) and ``right`` (``n x n``): ``A B = left^{-1} [left W right]_r
    right^{-1}`` (the GFWSVD closed form with ``left = L_Q^T``, ``right = L_P``; SVD-LLM(W) is
    ``left = None, right = S`` with ``S S^T = X^T X``; FWSVD is ``left = diag(sqrt(f))``). ``None``
    means identity. Inverses are applied by (triangular) solves, never formed. The singular
    values of the weighted matrix are split as in :func:`factors_from_svd`.
    """
    W = _matrix(W, dtype, "W")
    m, n = W.shape
    _check_rank(rank, m, n, name=name)
    M = W
    if left is not None:
        left = _matrix(left, W.dtype, "left", square=True).to(W.device)
        if left.shape[0] != m:
            raise ValueError(f"left must be {m} x {m} for W of shape {(m, n)}, got {tuple(left.shape)}")
        M = left @ M
    if right is not None:
        right = _matrix(right, W.dtype, "right", square=True).to(W.device)
        if right.shape[0] != n:
            raise ValueError(f"right must be {n} x {n} for W of shape {(m, n)}, got {tuple(right.shape)}")
        M = M @ right
    U, S, Vh = truncated_svd(M, rank, dtype=None, name=name)
    B, A = factors_from_svd(U, S, Vh, balance=balance)
    if right is not None:  # B <- B right^{-1}  <=>  solve right^T X^T = B^T
        B = _solve(right.mT, B.mT, "right", name).mT
    if left is not None:  # A <- left^{-1} A
        A = _solve(left, A, "left", name)
    check_finite(A, "up factor A", name)
    check_finite(B, "down factor B", name)
    return LowRankFactors(B, A)


def _solve(M: Tensor, rhs: Tensor, what: str, name: str | None) -> Tensor:
    """Solve ``M X = rhs``, using a triangular solve when ``M`` is triangular."""
    if bool((torch.triu(M, 1) == 0).all()):
        return torch.linalg.solve_triangular(M, rhs, upper=False)
    if bool((torch.tril(M, -1) == 0).all()):
        return torch.linalg.solve_triangular(M, rhs, upper=True)
    X, info = torch.linalg.solve_ex(M, rhs)
    if int(info) != 0:
        raise NumericalError(f"weight matrix {what!r}{_where(name)} is singular")
    return X


# ----------------------------------------------------------------------------------------------
# spectra


def _spectrum(x: Tensor) -> Tensor:
    x = _as_float(x, torch.float64, "input")
    if x.ndim == 1:
        if bool((x < 0).any()):
            raise ValueError("singular values must be >= 0")
        return x
    if x.ndim == 2:
        check_finite(x, "matrix")
        return torch.linalg.svdvals(x)
    raise ValueError(f"give a matrix or a 1-D vector of singular values, got shape {tuple(x.shape)}")


def effective_rank(x: Tensor) -> float:
    """Entropy effective rank (Roy & Vetterli 2007): ``exp(-sum p_i log p_i)``, ``p_i = s_i / sum s``.

    ``x`` is a matrix (its singular values are used) or a 1-D vector of singular values. Lies in
    ``[1, len(s)]`` for a non-zero input; the zero matrix has effective rank 0.
    """
    s = _spectrum(x)
    total = float(s.sum())
    if total <= 0:
        return 0.0
    p = s[s > 0] / total
    return float(torch.exp(-(p * p.log()).sum()))


def normalized_effective_rank(x: Tensor) -> float:
    """Effective rank divided by the number of singular values (Swift-SVD's NER), in ``[0, 1]``."""
    s = _spectrum(x)
    return effective_rank(s) / s.numel()


def stable_rank(x: Tensor) -> float:
    """Stable rank ``||M||_F^2 / ||M||_2^2 = sum s_i^2 / s_1^2`` (0 for the zero matrix)."""
    s = _spectrum(x)
    top = float(s.max()) if s.numel() else 0.0
    return 0.0 if top <= 0 else float((s ** 2).sum()) / top ** 2


# ----------------------------------------------------------------------------------------------
# orthogonalisation


def newton_schulz(M: Tensor, *, steps: int = 30, dtype: torch.dtype | None = torch.float64) -> Tensor:
    """Orthogonal polar factor of ``M`` by the cubic Newton-Schulz iteration ``X <- 1.5 X - 0.5 X X^T X``.

    ``M`` is first scaled by its Frobenius norm (so every singular value is <= 1, the basin of
    convergence); singular values converge quadratically once close to 1, but tiny ones need
    ``~log2(1/s_min)`` steps, so use :func:`orthogonalize` with ``method="polar"`` for
    ill-conditioned inputs. Returns a matrix of ``M``'s shape.
    """
    M = _matrix(M, dtype, "M")
    tall = M.shape[0] >= M.shape[1]
    X = M if tall else M.mT
    norm = torch.linalg.matrix_norm(X)
    if float(norm) == 0:
        raise NumericalError("cannot orthogonalise the zero matrix")
    X = X / norm
    for _ in range(steps):
        X = 1.5 * X - 0.5 * X @ (X.mT @ X)
    return X if tall else X.mT


def orthogonalize(
    M: Tensor,
    *,
    method: Literal["qr", "polar", "newton_schulz"] = "qr",
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """A matrix of ``M``'s shape with orthonormal columns (``m >= n``) or rows (``m < n``).

    ``"qr"``: the Q of a reduced QR, signs fixed so that ``diag(R) >= 0`` (unique for full-rank
    ``M``; spans the same space as ``M``'s columns). ``"polar"``: ``U Vh`` from the SVD, the
    orthogonal matrix nearest to ``M`` in Frobenius norm. ``"newton_schulz"``: iterative polar
    factor (:func:`newton_schulz`).
    """
    M = _matrix(M, dtype, "M")
    check_finite(M, "matrix")
    if method == "qr":
        tall = M.shape[0] >= M.shape[1]
        X = M if tall else M.mT
        Q, R = torch.linalg.qr(X)
        d = torch.diagonal(R)
        sign = torch.where(d < 0, -torch.ones_like(d), torch.ones_like(d))
        Q = Q * sign
        return Q if tall else Q.mT
    if method == "polar":
        U, _, Vh = torch.linalg.svd(M, full_matrices=False)
        return U @ Vh
    if method == "newton_schulz":
        return newton_schulz(M, dtype=None)
    raise ValueError(f"method must be 'qr', 'polar' or 'newton_schulz', got {method!r}")


# ----------------------------------------------------------------------------------------------
# Kronecker products


def vec(X: Tensor) -> Tensor:
    """Column-stacking vectorisation of a ``(r, c)`` matrix: ``vec(X)[j * r + i] = X[i, j]``."""
    if X.ndim != 2:
        raise ValueError(f"vec takes a 2-D matrix, got shape {tuple(X.shape)}")
    return X.mT.reshape(-1)


def unvec(v: Tensor, rows: int, cols: int) -> Tensor:
    """Inverse of :func:`vec`: the ``(rows, cols)`` matrix whose column-stacking is ``v``."""
    if v.ndim != 1 or v.numel() != rows * cols:
        raise ValueError(f"unvec needs a vector of {rows * cols} entries, got shape {tuple(v.shape)}")
    return v.reshape(cols, rows).mT


def kron(A: Tensor, B: Tensor) -> Tensor:
    """Dense Kronecker product ``A kron B`` (``(p r) x (q s)``); only for small factors / tests."""
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"kron takes two matrices, got shapes {tuple(A.shape)}, {tuple(B.shape)}")
    return torch.kron(A, B)


def kron_matvec(A: Tensor, B: Tensor, x: Tensor) -> Tensor:
    """``(A kron B) x`` without forming the Kronecker product (column-stacking convention).

    ``A`` is ``(p, q)``, ``B`` is ``(r, s)``; ``x`` is ``(q s,)`` or ``(q s, k)`` (k vectors). Uses
    ``(A kron B) vec(X) = vec(B X A^T)`` with ``X = unvec(x, s, q)``; cost ``O(k (r s q + r q p))``.
    """
    p, q = A.shape
    r, s = B.shape
    single = x.ndim == 1
    Xs = x[:, None] if single else x
    if Xs.ndim != 2 or Xs.shape[0] != q * s:
        raise ValueError(f"x must have {q * s} rows for A {tuple(A.shape)} kron B {tuple(B.shape)}, "
                         f"got shape {tuple(x.shape)}")
    k = Xs.shape[1]
    X = Xs.mT.reshape(k, q, s).mT  # (k, s, q): column j of vector t is X[t][:, j]
    Y = B @ X @ A.mT  # (k, r, p)
    out = Y.mT.reshape(k, p * r).mT  # column-stack each (r, p) result
    return out[:, 0] if single else out


def kron_sum_matvec(As: Sequence[Tensor], Bs: Sequence[Tensor], x: Tensor) -> Tensor:
    """``(sum_k A_k kron B_k) x`` without forming any Kronecker product (see :func:`kron_matvec`)."""
    if len(As) != len(Bs) or not As:
        raise ValueError(f"need equally many (>= 1) A and B factors, got {len(As)} and {len(Bs)}")
    out = kron_matvec(As[0], Bs[0], x)
    for A, B in zip(As[1:], Bs[1:]):
        out = out + kron_matvec(A, B, x)
    return out


def kron_rowmajor_apply(A: Tensor, B: Tensor, x: Tensor) -> Tensor:
    """``x @ kron(A, B)^T`` for a batch ``x`` of shape ``(..., q s)`` (row-major flattening).

    ``A`` is ``(K, p, q)`` or ``(p, q)``, ``B`` is ``(K, r, s)`` or ``(r, s)`` (a sum of ``K``
    Kronecker products). With ``X = x.reshape(..., q, s)``: ``y = sum_k A_k X B_k^T`` flattened
    to ``(..., p r)``; this is how a linear layer with weight ``sum_k kron(A_k, B_k)`` acts.
    """
    if A.ndim == 2:
        A = A[None]
    if B.ndim == 2:
        B = B[None]
    if A.ndim != 3 or B.ndim != 3 or A.shape[0] != B.shape[0]:
        raise ValueError(f"A and B must be (K, p, q) and (K, r, s), got {tuple(A.shape)}, {tuple(B.shape)}")
    _, p, q = A.shape
    _, r, s = B.shape
    if x.shape[-1] != q * s:
        raise ValueError(f"last dim of x must be {q * s}, got shape {tuple(x.shape)}")
    X = x.reshape(*x.shape[:-1], q, s)
    T = torch.einsum("...js,krs->...kjr", X, B)  # X B_k^T : (..., K, q, r)
    Y = torch.einsum("kij,...kjr->...ir", A, T)  # sum_k A_k (X B_k^T) : (..., p, r)
    return Y.reshape(*x.shape[:-1], p * r)


def kron_rearrange(M: Tensor, shape_A: tuple[int, int], shape_B: tuple[int, int]) -> Tensor:
    """Van Loan-Pitsianis rearrangement ``R`` of ``M`` (``(p r) x (q s)``) with ``A (p,q)``, ``B (r,s)``.

    ``R[i1 * q + j1, i2 * s + j2] = M[i1 * r + i2, j1 * s + j2]`` so that
    ``||M - kron(A, B)||_F = ||R - a b^T||_F`` with ``a = A.reshape(-1)``, ``b = B.reshape(-1)``.
    """
    p, q = shape_A
    r, s = shape_B
    if M.ndim != 2 or M.shape != (p * r, q * s):
        raise ValueError(f"M must have shape {(p * r, q * s)} for factors {shape_A} and {shape_B}, "
                         f"got {tuple(M.shape)}")
    return M.reshape(p, r, q, s).permute(0, 2, 1, 3).reshape(p * q, r * s)


def nearest_kronecker(
    M: Tensor,
    shape_A: tuple[int, int],
    shape_B: tuple[int, int],
    *,
    terms: int = 1,
    dtype: torch.dtype | None = torch.float64,
) -> tuple[Tensor, Tensor]:
    """Nearest sum of ``terms`` Kronecker products ``sum_k kron(A_k, B_k)`` to ``M`` in Frobenius norm.

    Van Loan & Pitsianis (1993): the rank-``terms`` SVD of :func:`kron_rearrange`\\ (M). The
    singular value is split evenly (``sqrt``) between the two factors; each pair's sign is fixed
    so that ``A_k`` has a non-negative sum (for a PSD ``M`` with ``terms=1`` both factors are then
    PSD). Returns ``A (terms, p, q)`` and ``B (terms, r, s)``.
    """
    M = _matrix(M, dtype, "M")
    check_finite(M, "matrix")
    R = kron_rearrange(M, shape_A, shape_B)
    if not 0 < terms <= min(R.shape):
        raise ValueError(f"terms must be in [1, {min(R.shape)}], got {terms}")
    U, S, Vh = torch.linalg.svd(R, full_matrices=False)
    U, S, Vh = U[:, :terms], S[:terms], Vh[:terms]
    sign = torch.where(U.sum(0) < 0, -1.0, 1.0).to(U.dtype)
    root = S.sqrt() * sign
    A = (U * root).mT.reshape(terms, *shape_A)
    B = (Vh * (S.sqrt() * sign)[:, None]).reshape(terms, *shape_B)
    return A, B
