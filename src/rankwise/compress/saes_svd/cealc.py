"""SAES-SVD's mathematics: paired statistics (Alg. 1), the CEALC closed form (Thm. 4.1) and ACES (Thm. 4.2).

Pure functions of tensors; no model is needed (see the package docstring for the notation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, Sequence

import torch

from rankwise.compress.base import PairedStats
from rankwise.core.errors import NumericalError
from rankwise.core.linalg import LowRankFactors, check_finite, damped_cholesky, factors_from_svd

Tensor = torch.Tensor
Whitener = Literal["cholesky", "symmetric"]
Objective = Literal["ratio", "energy"]

__all__ = [
    "PairedAccumulator", "AcesCoefficients", "AcesResult", "CealcWhitening", "saes_rank", "beta_from_alpha",
    "alpha_from_beta", "beta_interval", "cealc_whitening", "cealc_target", "cealc_factors", "cealc_objective",
    "retained_energy_ratio", "aces_coefficients", "aces_surrogate", "aces_stationary_points", "aces_beta",
]


# ----------------------------------------------------------------------------------------------
# small helpers and validation


def _where(name: str | None) -> str:
    return f" in layer {name!r}" if name else ""


def _finite_number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{field} must be a number, got {type(value).__name__} ({value!r})")
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{field} must be finite, got {value!r}")
    return v


def _check_beta(beta: Any, field: str = "beta") -> float:
    b = _finite_number(beta, field)
    if not 0.0 <= b < 1.0:
        raise ValueError(f"{field}={beta!r} is out of range: beta = alpha/(1+alpha) must lie in [0, 1)")
    return b


def beta_from_alpha(alpha: float) -> float:
    """``beta = alpha / (1 + alpha)`` (Eq. 9) for an alignment weight ``alpha >= 0``."""
    a = _finite_number(alpha, "alpha")
    if a < 0:
        raise ValueError(f"alpha={alpha!r} must be >= 0 (the weight of the alignment term of Eq. 3)")
    return a / (1.0 + a)


def alpha_from_beta(beta: float) -> float:
    """Inverse of :func:`beta_from_alpha`: ``alpha = beta / (1 - beta)`` for ``beta`` in ``[0, 1)``."""
    b = _check_beta(beta)
    return b / (1.0 - b)


def saes_rank(m: int, n: int, compression_ratio: float) -> int:
    """Uniform rank of an ``m x n`` layer at a paper-convention compression ratio.

    ``compression_ratio`` is the fraction of parameters REMOVED (0.2 keeps 80%);
    ``r = floor((1 - ratio) m n / (m + n))`` (the SVD-LLM convention), at least 1 and at most
    ``min(m, n)``.
    """
    for nm, v in (("m", m), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{nm} must be a positive int, got {v!r}")
    ratio = _finite_number(compression_ratio, "compression_ratio")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"compression_ratio={compression_ratio!r} must be in [0, 1): it is the fraction of "
                         "parameters removed (0.2 keeps 80%)")
    return max(1, min(min(m, n), math.floor((1.0 - ratio) * m * n / (m + n))))


def beta_interval(bounds: Sequence[float], bounds_on: Literal["beta", "alpha"] = "beta") -> tuple[float, float]:
    """The ``beta`` search interval of ACES from ``bounds`` given on ``beta`` or on ``alpha``."""
    if len(bounds) != 2:
        raise ValueError(f"beta_bounds must be a pair (low, high), got {bounds!r}")
    lo, hi = (_finite_number(b, "beta_bounds") for b in bounds)
    if lo > hi:
        raise ValueError(f"beta_bounds=({lo}, {hi}): the lower bound exceeds the upper bound")
    if bounds_on == "beta":
        _check_beta(lo, "beta_bounds[0]")
        _check_beta(hi, "beta_bounds[1]")
        return lo, hi
    if bounds_on == "alpha":
        return beta_from_alpha(lo), beta_from_alpha(hi)
    raise ValueError(f"bounds_on must be 'beta' or 'alpha', got {bounds_on!r}")


# ----------------------------------------------------------------------------------------------
# streaming statistics (Alg. 1)


class PairedAccumulator:
    """Streaming ``H`` and ``Delta`` of one layer exactly as Alg. 1 keeps them (float64).

    For each mini-batch of ``k`` tokens (rows ``x`` of the compressed-upstream inputs and ``x_f`` of
    the FP inputs, both ``k x n``): ``gamma = N / (N + k)``, ``H <- gamma H``, ``Delta <- gamma Delta``,
    ``N <- N + k``, ``s = sqrt(2 / N)``, ``H += (s X)(s X)^T``, ``Delta += (s X_f - s X)(s X)^T``.
    After any batch split, ``H = (2/N) X X^T`` and ``Delta = (2/N) (X_f - X) X^T`` (columns = tokens).
    No activation is cached. Padding tokens are dropped with ``mask`` (``1`` = keep).
    """

    def __init__(self, n: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"n must be a positive int, got {n!r}")
        self.n = n
        self.H = torch.zeros(n, n, dtype=dtype, device=device)
        self.Delta = torch.zeros(n, n, dtype=dtype, device=device)
        self.tokens = 0

    def update(self, x: Tensor, x_f: Tensor, mask: Tensor | None = None) -> None:
        """Add one batch: ``x`` and ``x_f`` of identical shape ``(..., n)``; ``mask`` over the leading dims."""
        if not isinstance(x, torch.Tensor) or not isinstance(x_f, torch.Tensor):
            raise TypeError("x and x_f must be tensors")
        if x.shape != x_f.shape:
            raise ValueError(f"x {tuple(x.shape)} and x_f {tuple(x_f.shape)} differ in shape: both passes must "
                             "use identical batches (same tokenisation, padding and attention mask)")
        if x.shape[-1] != self.n:
            raise ValueError(f"last dim of x is {x.shape[-1]}, expected n = {self.n}")
        X = x.reshape(-1, self.n).to(self.H)
        Xf = x_f.reshape(-1, self.n).to(self.H)
        if mask is not None:
            if mask.numel() != X.shape[0]:
                raise ValueError(f"mask has {mask.numel()} entries for {X.shape[0]} tokens")
            keep = mask.reshape(-1).to(X.device) != 0
            X, Xf = X[keep], Xf[keep]
        check_finite(X, "inputs x")
        check_finite(Xf, "full-precision inputs x_f")
        k = X.shape[0]
        if k == 0:
            return
        gamma = self.tokens / (self.tokens + k)
        self.H.mul_(gamma)
        self.Delta.mul_(gamma)
        self.tokens += k
        s = math.sqrt(2.0 / self.tokens)
        sX, sXf = s * X, s * Xf
        self.H.add_(sX.mT @ sX)
        self.Delta.add_((sXf - sX).mT @ sX)

    def paired(self) -> PairedStats:
        """The statistics as :class:`~rankwise.compress.base.PairedStats` (raises on an empty set)."""
        if self.tokens == 0:
            raise ValueError("no calibration token was accumulated (empty calibration set or all tokens masked)")
        return PairedStats(H=self.H.clone(), Delta=self.Delta.clone(), tokens=self.tokens)


# ----------------------------------------------------------------------------------------------
# CEALC closed form (Thm. 4.1, Eqs. 10-12)


class CealcWhitening(NamedTuple):
    """``S`` with ``S S^T = H + lam I`` (lower-triangular Cholesky or symmetric root), ``lam``, attempts."""

    S: Tensor
    lam: float
    attempts: int
    kind: str


def _prep(W: Tensor, H: Tensor, Delta: Tensor | None, name: str | None) -> tuple[Tensor, Tensor, Tensor]:
    for nm, t in (("W", W), ("H", H)) + ((("Delta", Delta),) if Delta is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{nm} must be a tensor, got {type(t).__name__}")
        if t.ndim != 2:
            raise ValueError(f"{nm} must be a matrix, got shape {tuple(t.shape)}")
    W = W.detach().to(torch.float64)
    H = H.detach().to(device=W.device, dtype=torch.float64)
    m, n = W.shape
    if H.shape != (n, n):
        raise ValueError(f"H must be n x n = {n} x {n} for W of shape {(m, n)}, got {tuple(H.shape)}{_where(name)}")
    D = torch.zeros_like(H) if Delta is None else Delta.detach().to(device=W.device, dtype=torch.float64)
    if D.shape != (n, n):
        raise ValueError(f"Delta must be {n} x {n}, got {tuple(D.shape)}{_where(name)}")
    check_finite(W, "weight W", name)
    check_finite(H, "input covariance H", name)
    check_finite(D, "differential covariance Delta", name)
    return W, 0.5 * (H + H.mT), D


def cealc_whitening(
    H: Tensor,
    *,
    ridge: float = 1e-6,
    retries: int = 5,
    whitener: Whitener = "cholesky",
    name: str | None = None,
) -> CealcWhitening:
    """Square root ``S`` of ``H + lam I`` with ``lam = ridge * mean(diag H) * 10^i`` (App. A.6).

    Attempt ``i = 0..retries``; ``ridge = 0`` means one undamped attempt. ``whitener="cholesky"``:
    lower-triangular ``S`` (the paper's choice); ``"symmetric"``: ``S = (H + lam I)^{1/2}`` from an
    eigendecomposition (accepted when every eigenvalue of ``H + lam I`` is positive, i.e. above
    ``1e-14 * lam_max``). Both give the same ``A B`` (``[G]_r S^{-1}`` is invariant to ``S -> S Q``).

    Raises:
        NumericalError: every attempt failed (naming the layer), or ``H`` is zero / not finite.
    """
    ridge = _finite_number(ridge, "ridge")
    if ridge < 0:
        raise ValueError(f"ridge={ridge} must be >= 0")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    H = H.detach().to(torch.float64)
    if whitener == "cholesky":
        try:
            res = damped_cholesky(H, damping=ridge, retries=retries, dtype=torch.float64, name=name)
        except NumericalError as exc:
            raise NumericalError(f"SAES-SVD whitening failed{_where(name)}: {exc}") from None
        return CealcWhitening(res.L, float(res.jitter), res.attempts, "cholesky")
    if whitener != "symmetric":
        raise ValueError(f"whitener must be 'cholesky' or 'symmetric', got {whitener!r}")
    Hs = 0.5 * (H + H.mT)
    check_finite(Hs, "input covariance H", name)
    scale = float(torch.diagonal(Hs).mean())
    if ridge > 0 and scale <= 0:
        raise NumericalError(f"input covariance{_where(name)} has mean diagonal {scale:.3g} <= 0; cannot whiten")
    ev, V = torch.linalg.eigh(Hs)
    lam = ridge * scale
    n_attempts = 1 if ridge == 0 else retries + 1
    for i in range(n_attempts):
        e = ev + lam
        top = float(e.max())
        if top > 0 and float(e.min()) > 1e-14 * top:
            return CealcWhitening((V * e.sqrt()) @ V.mT, lam, i + 1, "symmetric")
        lam *= 10.0
    raise NumericalError(f"SAES-SVD whitening failed{_where(name)}: H + lambda I is not positive definite after "
                         f"{n_attempts} attempt(s) (relative ridge {ridge:g}); raise `ridge` or use more "
                         "calibration tokens")


def _right_solve_T(M: Tensor, S: Tensor, kind: str) -> Tensor:
    """``M S^{-T}`` for a lower-triangular (``cholesky``) or symmetric ``S``."""
    if kind == "cholesky":
        return torch.linalg.solve_triangular(S, M.mT, upper=False).mT
    return torch.linalg.solve(S, M.mT).mT  # S symmetric: M S^{-1} = (S^{-1} M^T)^T


def _right_solve(M: Tensor, S: Tensor, kind: str) -> Tensor:
    """``M S^{-1}``."""
    if kind == "cholesky":
        return torch.linalg.solve_triangular(S, M, upper=False, left=False)
    return torch.linalg.solve(S, M.mT).mT  # S symmetric: M S^{-1} = (S^{-1} M^T)^T


def _targets(W: Tensor, H: Tensor, D: Tensor, wh: CealcWhitening) -> tuple[Tensor, Tensor]:
    """``S_l = W (H + lam I) S^{-T} = W S`` (exactly, as ``H + lam I = S S^T``) and ``D_l = W Delta S^{-T}``.

    ``G(beta) = S_l + beta D_l``; ``D_l`` is zero when ``Delta`` is.
    """
    S_l = W @ wh.S
    D_l = _right_solve_T(W @ D, wh.S, wh.kind) if bool(D.any()) else torch.zeros_like(S_l)
    return S_l, D_l


def _gram_eig(M: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Eigenpairs (descending) of the Gram matrix of ``M`` on its smaller side; ``left`` says which side."""
    left = M.shape[0] <= M.shape[1]
    C = M @ M.mT if left else M.mT @ M
    lam, V = torch.linalg.eigh(0.5 * (C + C.mT))
    return lam.flip(0).clamp_min(0), V.flip(1), left


def _energy_ratio_gram(M: Tensor, rank: int) -> float:
    """``sum_{i<=r} sigma_i^2 / sum sigma_i^2`` from the eigenvalues of the smaller Gram matrix (fast)."""
    left = M.shape[0] <= M.shape[1]
    lam = torch.linalg.eigvalsh(M @ M.mT if left else M.mT @ M).flip(0).clamp_min(0)
    tot = float(lam.sum())
    return 1.0 if tot == 0 else float(lam[:rank].sum()) / tot


def _top_subspace(M: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` singular vectors ``U_r`` (``m x r``), ``V_r^T`` (``r x n``) of ``M``.

    Through an eigendecomposition of the smaller Gram matrix (``O(m n min(m, n))``, several times
    faster than an SVD at LLM shapes); falls back to the SVD when ``sigma_r`` is tiny relative to
    ``sigma_1`` (the Gram route then loses the ``r``-th direction to rounding).
    """
    lam, V, left = _gram_eig(M)
    if float(lam[rank - 1]) <= 1e-10 * float(lam[0]):
        U, _, Vh = torch.linalg.svd(M, full_matrices=False)
        return U[:, :rank], Vh[:rank]
    sig = lam[:rank].sqrt()
    if left:
        U = V[:, :rank]
        return U, (M.mT @ U / sig).mT
    Vr = V[:, :rank]
    return M @ Vr / sig, Vr.mT


def cealc_target(
    W: Tensor, H: Tensor, Delta: Tensor | None, beta: float, *,
    ridge: float = 1e-6, retries: int = 5, whitener: Whitener = "cholesky", name: str | None = None,
) -> tuple[Tensor, CealcWhitening]:
    """The whitened target ``G(beta) = W (H + lam I + beta Delta) S^{-T}`` (``m x n``, Eqs. 10-11) and ``S``."""
    beta = _check_beta(beta)
    W, H, D = _prep(W, H, Delta, name)
    wh = cealc_whitening(H, ridge=ridge, retries=retries, whitener=whitener, name=name)
    S_l, D_l = _targets(W, H, D, wh)
    return S_l + beta * D_l, wh


def _factors_from_target(G: Tensor, wh: CealcWhitening, rank: int, name: str | None) -> tuple[LowRankFactors, Tensor]:
    check_finite(G, "whitened target G", name)
    U, sig, Vh = torch.linalg.svd(G, full_matrices=False)
    B, A = factors_from_svd(U[:, :rank], sig[:rank], Vh[:rank], balance="sqrt")
    B = _right_solve(B, wh.S, wh.kind)  # B = Sigma^{1/2} V_r^T S^{-1}
    check_finite(B, "down factor B", name)
    check_finite(A, "up factor A", name)
    return LowRankFactors(B, A), sig


def _check_rank(rank: Any, m: int, n: int, name: str | None) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__} ({rank!r})")
    if not 0 < rank <= min(m, n):
        raise ValueError(f"rank={rank}{_where(name)} is out of range: need 0 < rank <= min(m, n) = {min(m, n)}")
    return rank


def cealc_factors(
    W: Tensor,
    H: Tensor,
    Delta: Tensor | None,
    beta: float,
    rank: int,
    *,
    ridge: float = 1e-6,
    retries: int = 5,
    whitener: Whitener = "cholesky",
    name: str | None = None,
) -> LowRankFactors:
    """CEALC closed form (Thm. 4.1, Eqs. 10-12; Alg. 2): rank-``rank`` factors ``A`` (``m x r``), ``B`` (``r x n``).

    Args:
        W: ``(m, n)`` weight (out x in).
        H: ``(n, n)`` ``X X^T`` of the compressed-upstream inputs (any positive scale).
        Delta: ``(n, n)`` ``(X_f - X) X^T`` on the same tokens and with the same scale as ``H``
            (``None`` = zeros: then every ``beta`` gives SVD-LLM's whitening SVD).
        beta: ``alpha / (1 + alpha)`` in ``[0, 1)``.
        rank: ``0 < rank <= min(m, n)``.
        ridge, retries, whitener: see :func:`cealc_whitening`.
    Returns:
        ``LowRankFactors(B, A)`` in float64 with ``A B = [G(beta)]_r S^{-1}``.
    """
    beta = _check_beta(beta)
    W, H, D = _prep(W, H, Delta, name)
    _check_rank(rank, *W.shape, name)
    wh = cealc_whitening(H, ridge=ridge, retries=retries, whitener=whitener, name=name)
    S_l, D_l = _targets(W, H, D, wh)
    return _factors_from_target(S_l + beta * D_l, wh, rank, name)[0]


def cealc_objective(W: Tensor, AB: Tensor, X: Tensor, X_f: Tensor, alpha: float) -> float:
    """Eq. 3 evaluated on raw inputs (columns = tokens): ``||(AB - W) X||^2 + alpha ||AB X - W X_f||^2``."""
    a = _finite_number(alpha, "alpha")
    if a < 0:
        raise ValueError(f"alpha={alpha!r} must be >= 0")
    W, AB, X, X_f = (t.to(torch.float64) for t in (W, AB, X, X_f))
    return float(((AB - W) @ X).square().sum() + a * (AB @ X - W @ X_f).square().sum())


def retained_energy_ratio(G: Tensor, rank: int) -> float:
    """``RER = sum_{i<=r} sigma_i^2(G) / sum_i sigma_i^2(G)`` (Eq. 14); 1.0 for the zero matrix."""
    s2 = torch.linalg.svdvals(G.to(torch.float64)).square()
    tot = float(s2.sum())
    return 1.0 if tot == 0 else float(s2[:rank].sum()) / tot


# ----------------------------------------------------------------------------------------------
# ACES (Sec. 4.2, Thm. 4.2, App. A.3, Alg. 3)


@dataclass(frozen=True)
class AcesCoefficients:
    """FS-FOA coefficients of Eq. 18 for ``G(beta) = S + beta D`` with a fixed rank-``r`` subspace.

    ``a = ||S_perp||^2``, ``b = <S_perp, D_perp>``, ``c = ||D_perp||^2``, ``A0 = ||S||^2``,
    ``B0 = <S, D>``, ``C0 = ||D||^2`` where ``X_perp = (I - U_r U_r^T) X (I - V_r V_r^T)``.
    """

    a: float
    b: float
    c: float
    A0: float
    B0: float
    C0: float

    def tail(self, beta: float) -> float:
        """The approximate tail energy ``a + 2 b beta + c beta^2``."""
        return self.a + 2 * self.b * beta + self.c * beta * beta

    def total(self, beta: float) -> float:
        """The total energy ``||S + beta D||^2 = A0 + 2 B0 beta + C0 beta^2`` (exact)."""
        return self.A0 + 2 * self.B0 * beta + self.C0 * beta * beta

    def quadratic(self) -> tuple[float, float, float]:
        """Coefficients ``(q2, q1, q0)`` of the stationarity condition of Eq. 19."""
        return (self.c * self.B0 - self.b * self.C0, self.c * self.A0 - self.a * self.C0,
                self.b * self.A0 - self.a * self.B0)


def aces_coefficients(S: Tensor, D: Tensor, rank: int, *, U: Tensor | None = None, Vh: Tensor | None = None) -> AcesCoefficients:
    """Eq. 18 from the rank-``rank`` singular subspace of ``S`` (or of given ``U`` (``m x r``), ``Vh`` (``r x n``))."""
    S = S.to(torch.float64)
    D = D.to(torch.float64)
    if S.shape != D.shape or S.ndim != 2:
        raise ValueError(f"S and D must be matrices of one shape, got {tuple(S.shape)} and {tuple(D.shape)}")
    _check_rank(rank, *S.shape, None)
    if U is None or Vh is None:
        U_full, _, Vh_full = torch.linalg.svd(S, full_matrices=False)
        U, Vh = U_full[:, :rank], Vh_full[:rank]

    def perp(M: Tensor) -> Tensor:
        M = M - U @ (U.mT @ M)
        return M - (M @ Vh.mT) @ Vh

    Sp, Dp = perp(S), perp(D)
    f = lambda x, y: float((x * y).sum())  # noqa: E731
    return AcesCoefficients(a=f(Sp, Sp), b=f(Sp, Dp), c=f(Dp, Dp), A0=f(S, S), B0=f(S, D), C0=f(D, D))


def aces_surrogate(coef: AcesCoefficients, beta: float | Tensor, objective: Objective = "ratio") -> Any:
    """``rho~(beta)`` of Eq. 17 (``"ratio"``) or the tail energy ``a + 2 b beta + c beta^2`` (``"energy"``)."""
    tail = coef.a + 2 * coef.b * beta + coef.c * beta * beta
    if objective == "energy":
        return tail
    if objective != "ratio":
        raise ValueError(f"aces_objective must be 'ratio' or 'energy', got {objective!r}")
    tot = coef.A0 + 2 * coef.B0 * beta + coef.C0 * beta * beta
    if isinstance(tot, torch.Tensor):
        return torch.where(tot > 0, tail / tot.clamp_min(1e-300), torch.zeros_like(tot))
    return tail / tot if tot > 0 else 0.0


def aces_stationary_points(coef: AcesCoefficients) -> list[float]:
    """Real roots of Eq. 19, ``(cB0 - bC0) beta^2 + (cA0 - aC0) beta + (bA0 - aB0) = 0``, ascending.

    A (numerically) vanishing leading coefficient reduces it to a linear equation; an identically
    zero polynomial (``rho~`` constant) has no isolated stationary point and gives ``[]``.
    """
    q2, q1, q0 = coef.quadratic()
    scale = max(abs(q2), abs(q1), abs(q0))
    if scale == 0:
        return []
    tol = 1e-13 * scale
    if abs(q2) <= tol:
        return [] if abs(q1) <= tol else [-q0 / q1]
    disc = q1 * q1 - 4 * q2 * q0
    if disc < 0:
        return []
    sq = math.sqrt(disc)
    # numerically stable pair of roots
    qq = -0.5 * (q1 + math.copysign(sq, q1)) if q1 != 0 else -0.5 * sq
    roots = [qq / q2] + ([q0 / qq] if qq != 0 else [-qq / q2])
    return sorted(roots)


@dataclass
class AcesResult:
    """Output of :func:`aces_beta`: the chosen ``beta``, the surrogate value there and what led to it."""

    beta: float
    rho_surrogate: float
    interval: tuple[float, float]
    candidates: list[float]
    roots: list[float]
    coefficients: AcesCoefficients | None
    objective: str
    reason: str = "solved"  # "solved" | "delta_zero" | "energy_c_zero" | "refined"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["interval"] = list(self.interval)
        return d


def _aces_pick(coef: AcesCoefficients, lo: float, hi: float, beta_cap: float, shrink: float,
               objective: Objective) -> tuple[float, float, list[float], list[float], str]:
    if objective == "energy":
        if coef.c <= 1e-12 * coef.C0:  # D has no energy outside the kept subspace (c == 0 up to rounding)
            return lo, float(aces_surrogate(coef, lo, "energy")), [lo], [], "energy_c_zero"
        roots = [-coef.b / coef.c]
    else:
        roots = aces_stationary_points(coef)
    raw = [r for r in roots if lo <= r <= hi] + [lo, hi]
    if objective == "energy":  # beta0 = clip(-b/c) to the interval (Alg. 3, energy variant)
        raw = [min(max(roots[0], lo), hi)]
    cands: list[float] = []
    for r in raw:
        v = min(max(r, lo), hi)
        v = min(v, beta_cap) * shrink
        if v not in cands:
            cands.append(v)
    vals = [float(aces_surrogate(coef, v, objective)) for v in cands]
    i = min(range(len(cands)), key=lambda k: (vals[k], cands[k]))
    return cands[i], vals[i], cands, roots, "solved"


def aces_beta(
    W: Tensor,
    H: Tensor,
    Delta: Tensor | None,
    rank: int,
    *,
    bounds: Sequence[float] = (0.25, 0.75),
    bounds_on: Literal["beta", "alpha"] = "beta",
    beta_cap: float = 0.95,
    shrink: float = 1.0,
    objective: Objective = "ratio",
    refine: bool = False,
    ridge: float = 1e-6,
    retries: int = 5,
    whitener: Whitener = "cholesky",
    name: str | None = None,
) -> AcesResult:
    """ACES (Alg. 3): the per-layer ``beta`` that maximises the first-order retained energy ratio.

    Steps: one rank-``r`` SVD of ``S_l = W (H + lam I) S^{-T}`` (the ``beta = 0`` target); Eq. 18
    coefficients with ``D_l = W Delta S^{-T}``; the real roots of Eq. 19 inside the interval plus both
    endpoints are candidates; each is clipped to the interval, capped at ``beta_cap`` and multiplied
    by ``shrink``; the candidate with the smallest ``rho~`` (Eq. 17) wins. ``objective="energy"``
    minimises only the tail ``a + 2 b beta + c beta^2`` (``beta0 = clip(-b/c)``). ``refine`` (App. A.3)
    recomputes the subspace once at ``G(beta*)`` and solves again. ``Delta == 0`` returns the lower
    bound without solving (nothing to compensate); ``c == 0`` with the energy objective as well.
    """
    lo, hi = beta_interval(bounds, bounds_on)
    _check_cap_shrink(beta_cap, shrink)
    if objective not in ("ratio", "energy"):
        raise ValueError(f"aces_objective must be 'ratio' or 'energy', got {objective!r}")
    W, H, D = _prep(W, H, Delta, name)
    _check_rank(rank, *W.shape, name)
    wh = cealc_whitening(H, ridge=ridge, retries=retries, whitener=whitener, name=name)
    S_l, D_l = _targets(W, H, D, wh)
    return _aces_from_targets(S_l, D_l, rank, lo, hi, beta_cap, shrink, objective, refine, delta_zero=not bool(D.any()))


def _check_cap_shrink(beta_cap: Any, shrink: Any) -> None:
    cap = _finite_number(beta_cap, "beta_cap")
    if not 0.0 < cap < 1.0:
        raise ValueError(f"beta_cap={beta_cap!r} must be in (0, 1)")
    s = _finite_number(shrink, "shrink")
    if not 0.0 < s <= 1.0:
        raise ValueError(f"shrink={shrink!r} must be in (0, 1]")


def _aces_from_targets(S_l: Tensor, D_l: Tensor, rank: int, lo: float, hi: float, beta_cap: float, shrink: float,
                       objective: Objective, refine: bool, *, delta_zero: bool,
                       svd_S: tuple[Tensor, Tensor] | None = None) -> AcesResult:
    U, Vh = svd_S if svd_S is not None else _top_subspace(S_l, rank)
    coef = aces_coefficients(S_l, D_l, rank, U=U, Vh=Vh)
    if delta_zero:  # nothing to compensate: the lower bound, without solving Eq. 19
        return AcesResult(beta=lo, rho_surrogate=float(aces_surrogate(coef, lo, objective)), interval=(lo, hi),
                          candidates=[lo], roots=[], coefficients=coef, objective=objective, reason="delta_zero")
    beta, val, cands, roots, reason = _aces_pick(coef, lo, hi, beta_cap, shrink, objective)
    if refine and reason == "solved":
        Ug, Vhg = _top_subspace(S_l + beta * D_l, rank)
        coef = aces_coefficients(S_l, D_l, rank, U=Ug, Vh=Vhg)
        beta, val, cands, roots, reason = _aces_pick(coef, lo, hi, beta_cap, shrink, objective)
        reason = "refined" if reason == "solved" else reason
    return AcesResult(beta=beta, rho_surrogate=val, interval=(lo, hi), candidates=cands, roots=roots,
                      coefficients=coef, objective=objective, reason=reason)

