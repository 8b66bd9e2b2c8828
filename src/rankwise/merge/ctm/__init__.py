"""Compress-then-Merge (CtM): merge T LoRAs into ONE rank-r LoRA by fixing shared subspaces first.

He, Ding, Huang, Yang, Li, Huang, "Compress then Merge: From Multiple LoRAs into One Low-Rank
Adapter", ICML 2026 (arXiv 2606.03723). Official code: github.com/ZhengbaoHe/compress-then-merge
(``merge_space=low_rank_core``). Equation numbers below refer to the steps of the method as written
in the spec (the paper's own numbering could not be retrieved).

Per adapted linear layer, independently and data-free (``ΔW_t = s_t B_t A_t``, ``B_t (m, r_t)``,
``A_t (r_t, n)``, R = Σ r_t; ``s_t`` folded into ``B_t``):

1. core bases ``U_B (m, R)`` / ``V_A (n, R)``: orthonormal bases of ``[B_1 ... B_T]`` and
   ``[A_1; ...; A_T]ᵀ`` (thin SVDs) — :func:`rankwise.merge.common.core_bases`;
2. core matrices ``M_t = (U_Bᵀ B_t)(A_t V_A)`` ``(R, R)``; ``ΔW_t = U_B M_t V_Aᵀ`` exactly;
3. norm balancing (only for choosing the subspaces): ``M̃_t = M_t (β ν_t + (1-β) ν̄) / ν_t`` with
   ``ν_t = ||M_t||_F``, ``ν̄`` their mean — :func:`balance_norms`;
4. shared subspaces: Tucker-2 of the ``R x R x T`` tensor of the ``M̃_t`` with ranks (r, r),
   i.e. ``max_{PᵀP = SᵀS = I_r} Σ_t ||Pᵀ M̃_t S||_F²``, by HOOI from the HOSVD initialisation —
   :func:`tucker2`;
5. lift ``U_r = U_B P (m, r)``, ``V_r = V_A S (n, r)`` (orthonormal columns);
6. coordinates of each adapter from its RAW factors: ``C_t = (U_rᵀ B_t)(A_t V_r)`` ``(r, r)``;
7. merge in the reduced space with a rule (TIES, TA, DARE, ...; :func:`rankwise.merge.rules.merge_tensors`
   on the flattened ``C_t``), then scale by λ: ``ΔW = λ U_r C V_rᵀ``;
8. output a rank-r LoRA, alpha = r (scaling 1): ``B = λ U_r X Σ^{1/2}``, ``A = Σ^{1/2} Yᵀ V_rᵀ`` with
   ``C = X Σ Yᵀ`` (the balanced split is our choice; ``balance=False`` gives ``B = λ U_r C``, ``A = V_rᵀ``).

Nothing ``m x n`` is ever formed: cost O((m + n) R²) for step 1, O(T R r_t r) per HOOI sweep's products,
memory O((m + n) R + T R²). ``rank(ΔW) <= r`` by construction.

Usage::

    from rankwise.merge import CtMConfig, ctm_merge
    from rankwise.core.peft_format import import_peft, write_adapter_dir
    merged = ctm_merge([import_peft(d) for d in dirs], CtMConfig(rank=16, rule="ties"))
    write_adapter_dir(merged, "merged")      # PeftModel.from_pretrained(base, "merged") loads it
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from rankwise.core.errors import NumericalError
from rankwise.core.lora import AdapterState
from rankwise.core.registry import register
from rankwise.core.validate import check_bool, check_int, check_number, check_unit
from rankwise.merge.base import MergeMethod, register_merge_method
from rankwise.merge.common import (
    FP,
    adapter_seed,
    check_adapters,
    check_rank_fits,
    core_space,
    lowrank_factors,
    map_modules,
    module_factors,
    out_state,
    sign_fix,
)
from rankwise.merge.rules import canonical_rule, merge_tensors, needs_seeds

__all__ = [
    "CtMConfig",
    "CtMReport",
    "HOOIResult",
    "balance_norms",
    "ctm_merge",
    "ctm_merge_layer",
    "merge",
    "merge_with_report",
    "search",
    "tucker2",
    "tucker_objective",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CtMConfig:
    """Compress-then-Merge settings (defaults: the official README command: TIES, β = 0.25, λ = 0.75, topK = 25 %).

    Attributes:
        rank: output rank r per module (the paper: 16, the adapters' rank); must be <= Σ r_t and <= min(m, n).
        rule: reduced-space merge rule, one of :data:`rankwise.merge.rules.RULES`
            (``"ties"`` is the paper's main rule; ``"ta"``, ``"mean"``, ``"dare"``, ``"dare_ties"``, ``"iso_c"``).
        density: TIES top-k fraction kept per task, in (0, 1] (the code's topK / 100).
        drop_rate: DARE drop probability p, in [0, 1).
        scale: global scale λ (``scaling_coeffs``).
        beta: norm-balancing β in [0, 1] for the subspace choice (1: raw norms; 0: all tasks at the mean norm).
        hooi_iters: maximum HOOI sweeps (the code: tensorly ``n_iter_max=1000``).
        hooi_tol: stop when the relative reconstruction error changes by less than this (``tol=1e-6``).
        balance: split the merged core's singular values evenly between B and A (our choice; same product).
        seed: seeds DARE's masks (the code's seed 420).
    """

    rank: int = 16
    rule: str = "ties"
    density: float = 0.25
    drop_rate: float = 0.05
    scale: float = 0.75
    beta: float = 0.25
    hooi_iters: int = 1000
    hooi_tol: float = 1e-6
    balance: bool = True
    seed: int = 420

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", check_int("CtMConfig.rank", self.rank, 1))
        object.__setattr__(self, "rule", canonical_rule(self.rule, "CtMConfig.rule"))
        object.__setattr__(self, "density", check_unit("CtMConfig.density", self.density, low_open=True))
        object.__setattr__(self, "drop_rate", check_unit("CtMConfig.drop_rate", self.drop_rate, high_open=True))
        object.__setattr__(self, "beta", check_unit("CtMConfig.beta", self.beta))
        object.__setattr__(self, "scale", check_number("CtMConfig.scale", self.scale))
        object.__setattr__(self, "hooi_iters", check_int("CtMConfig.hooi_iters", self.hooi_iters, 0))
        object.__setattr__(self, "hooi_tol", check_number("CtMConfig.hooi_tol", self.hooi_tol, 0.0))
        check_bool("CtMConfig.balance", self.balance)
        object.__setattr__(self, "seed", check_int("CtMConfig.seed", self.seed))


# ------------------------------------------------------------------------------------------------
# steps 3-4: norm balancing and Tucker-2 by HOOI
# ------------------------------------------------------------------------------------------------

def _balance_scale(M: Tensor, beta: float) -> Tensor:
    """The per-task factors ``(β ν_t + (1 - β) ν̄) / ν_t`` of :func:`balance_norms`, ``(T,)``."""
    nu = M.reshape(M.shape[0], -1).norm(dim=1)
    if bool((nu <= 0).any()):
        raise ValueError("balance_norms: a core matrix has zero norm (zero adapters must be skipped first)")
    return (beta * nu + (1.0 - beta) * nu.mean()) / nu


def balance_norms(M: Tensor, beta: float) -> Tensor:
    """Step 3: ``M̃_t = M_t (β ν_t + (1 - β) ν̄) / ν_t`` for ``M (T, R, R)``; ``ν_t = ||M_t||_F > 0`` required."""
    return M * _balance_scale(M, beta)[:, None, None]


def tucker_objective(M: Tensor, P: Tensor, S: Tensor) -> float:
    """``Σ_t ||Pᵀ M_t S||_F²`` for ``M (T, R, R)``, ``P, S (R, r)``."""
    return float((P.T @ M @ S).square().sum())


@dataclass
class HOOIResult:
    """Tucker-2 subspaces ``P, S (R, r)`` with the objective at the HOSVD init and at the end."""

    P: Tensor
    S: Tensor
    objective_init: float
    objective: float
    iterations: int
    converged: bool
    rel_error: float


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the enclosed (R x R, R = sum of ranks: ~10^2) factorisations on one intra-op thread.

    At this size waking and synchronising a thread pool costs more than the arithmetic: thousands of
    tiny calls per merge made 2-thread wall time tens of times the 1-thread time on a busy machine.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _top_eigvecs(G: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``r`` eigenvectors of the symmetric PSD Gram matrix ``G (R, R)`` (largest first; signs as eigh
    gives them: :func:`tucker2` fixes them once at the end), the sum of their eigenvalues (0-dim) and
    the eigenvalues themselves (largest first).

    The top-``r`` left singular vectors of ``X`` are the top-``r`` eigenvectors of ``G = X Xᵀ``: one
    ``R x R`` ``eigh`` instead of the SVD of the ``R x (T r)`` matrix ``X``.
    """
    w, V = torch.linalg.eigh(G)                      # ascending
    return V[:, -r:].flip(1).contiguous(), w[-r:].sum(), w[-r:].flip(0)


#: Relative residual ``||G Q - Q (Qᵀ G Q)||_F <= WARM_RESIDUAL * w_1`` at which a warm-started update
#: accepts its subspace ``span(Q)`` as the top-``r`` eigenspace of ``G`` (eigh itself leaves ~1e-15 * w_1).
WARM_RESIDUAL = 1e-11
#: Most applications of ``G`` one warm-started update may spend before it gives up (the caller runs eigh).
WARM_STEPS = 12
#: Smallest ``R`` at which :func:`tucker2` tries warm starts at all.
WARM_MIN_R = 64


class _Warm:
    """One factor's warm-started HOOI updates: an orthonormal basis of the top-``r`` eigenspace of
    ``G = Xtᵀ Xt`` (``Xt (T r, R)``: the rows of ``X = [Y_1 ... Y_T]ᵀ``, in any order), started from the
    previous sweep's basis ``Q0`` and never forming ``G``; with ``sym=True`` the argument is the symmetric
    PSD matrix ``G`` itself (one product per application: :class:`_Coords`). The accepted subspace's
    ``H = Qᵀ G Q`` is kept as :attr:`H`.

    HOOI only needs the *subspace* in every sweep (the next Gram matrix and the objective depend on
    ``span(P)``, ``span(S)`` only), so an update is plain subspace iteration: ``Z = G^k Q0``, ``Q =
    orth(Z)``, accepted once ``||G Q - Q H||_F <= WARM_RESIDUAL * w_1`` with ``H = Qᵀ G Q`` (``span(Q)`` is
    then the top-``r`` eigenspace to that accuracy and ``tr H`` the kept energy). The eigenvector basis
    itself is computed once, after the last sweep (:func:`_ritz`).

    The number of applications ``k`` before the first check is the previous update's (the start's
    distance changes little from sweep to sweep), one fewer when the previous check passed with room for
    one more factor ``q ≈ λ_{r+1} / λ_r`` (the residual's decrease per application, measured whenever a
    check misses). A check that misses continues from ``G Q`` with ``⌈log(tol / res) / log q⌉ - 1``
    more; one check per update is the usual case. Returns None when the residual does not decrease or
    :data:`WARM_STEPS` applications are spent (early sweeps that still move far, or a small gap at
    ``λ_r``); the caller then runs eigh (:class:`_Updater`).
    """

    def __init__(self, sym: bool = False) -> None:
        self.sym = sym   # Xt is G itself (symmetric), not a factor of it: one product per application
        self.rate = 0.0  # measured residual decrease per application of G (0: not known yet)
        self.need = 1    # applications of G before the first check
        self.H: Tensor | None = None  # the accepted subspace's Qᵀ G Q

    def __call__(self, Xt: Tensor, Q0: Tensor) -> tuple[Tensor, Tensor] | None:
        if WARM_STEPS < 1:
            return None
        # the bases are kept transposed, (r, R) rows: MKL's float64 products with the short side
        # first, (r, R) @ (R, R), take ~60 % of the time of (R, R) @ (R, r) at R = 128, r = 16
        Zt, used, need, last, first = Q0.mT, 0, min(self.need, WARM_STEPS), None, True
        while True:
            for _ in range(need):
                Zt = Zt @ Xt if self.sym else (Zt @ Xt.mT) @ Xt  # (G Z)ᵀ = (Xt Z)ᵀ Xt
            used += need
            Q = torch.linalg.qr(Zt.mT).Q
            Qt = Q.mT
            if self.sym:
                Zt = Qt @ Xt                             # (G Q)ᵀ: the residual's product, and the next power
                H = Zt @ Q
            else:
                Bt = Qt @ Xt.mT                          # (Xt Q)ᵀ
                H = Bt @ Bt.mT
                Zt = Bt @ Xt                             # (G Q)ᵀ: the residual's product, and the next power
            top = float(H.diagonal().max())              # a lower bound of λ_1
            if top <= 0.0:
                return None
            res = float(torch.linalg.matrix_norm(Zt - H @ Qt)) / top  # ||G Q - Q H||_F (H symmetric)
            if last is not None:
                rate = (res / last) ** (1.0 / (need + 1)) if res > 0.0 else 0.0  # G Q and need more
                if rate >= 1.0:
                    return None
                self.rate = rate
            if res <= WARM_RESIDUAL:
                # next time as many applications, less the j that were spare: the residual j applications
                # earlier, about res / rate^j, was already below the tolerance (measured on a first check only)
                spare = 0
                if first and used > 1 and 0.0 < self.rate < 1.0 and 0.0 < res:
                    spare = min(used - 1, int(math.log(WARM_RESIDUAL / res) / -math.log(self.rate)))
                self.need = used - spare
                self.H = H
                return Q, H.trace()
            if used >= WARM_STEPS:
                self.need = 1  # the next try (after the caller's back-off) measures afresh
                return None
            used += 1                                    # Z = G Q is one application already
            last, first = res, False
            need = self._need(res) - 1 if 0.0 < self.rate < 1.0 else 0
            need = max(0, min(need, WARM_STEPS - used))

    def _need(self, res: float) -> int:
        ratio = max(WARM_RESIDUAL, 1e-300) / res  # < 1: called only above the tolerance
        return max(1, min(WARM_STEPS, math.ceil(math.log(ratio) / math.log(self.rate))))


def _ritz(Xt: Tensor, Q: Tensor) -> Tensor:
    """The eigenvectors of ``G = Xtᵀ Xt`` inside ``span(Q)`` (``Q`` orthonormal, an invariant subspace),
    largest eigenvalue first: ``Q Y`` with ``Y`` the eigenvectors of ``Qᵀ G Q``."""
    B = Xt @ Q
    Y = torch.linalg.eigh(B.T @ B)[1]
    return Q @ Y.flip(1)


def _unfold(Y: Tensor) -> Tensor:
    """``[Y_1 ... Y_T]`` ``(R, T k)`` for ``Y (T, R, k)``."""
    T, R, k = Y.shape
    return Y.permute(1, 0, 2).reshape(R, T * k)


def _gram(Y: Tensor) -> Tensor:
    """``Σ_t Y_t Y_tᵀ`` for ``Y (T, R, k)``: the Gram matrix of ``[Y_1 ... Y_T]`` ``(R, T k)``."""
    X = _unfold(Y)
    return X @ X.T


def _factored_gram(L: Tensor, K: Tensor) -> Tensor:
    """``Σ_t M_t M_tᵀ`` for ``M_t = L_t K_tᵀ`` (``L``, ``K`` each ``(T, R, k)``), as one ``(R, T k) @ (T k, R)`` product."""
    T, R, k = L.shape
    Y = L @ (K.mT @ K)                                   # (T, R, k): L_t K_tᵀ K_t
    return Y.permute(1, 0, 2).reshape(R, T * k) @ L.permute(1, 0, 2).reshape(R, T * k).T


class _Updater:
    """HOOI factor updates of one factor: a basis of the top-``r`` left singular subspace of
    ``X = [Y_1 ... Y_T]`` and its energy (the sum of the top-``r`` eigenvalues of ``X Xᵀ``),
    warm-started (:class:`_Warm`) when that has been paying off, else ``eigh`` (which gives
    eigenvectors; ``exact`` says whether the last update came from it).

    A warm start that does not converge costs its products on top of the ``eigh``; it happens while the
    factors still move far between sweeps, and on some problems throughout. So after a failure the next
    1, 2, 4, ... updates go straight to ``eigh`` (the wait doubles with each failure and resets on a
    success): a problem where warm starts never converge pays for about ``log2(sweeps)`` failed
    attempts, not one per update.
    """

    def __init__(self, r: int, warm: bool, R: int, sym: bool = False):
        # below WARM_MIN_R the R x R eigh costs less than a few small products and a QR
        self.r, self.warm, self.sym = r, warm and R >= WARM_MIN_R, sym
        # the first update starts from the HOSVD factor, not from a HOOI iterate: far from the answer and
        # (on random LoRA cores) with λ_{r+1} / λ_r ~ 0.99 in that first sweep, so a warm start fails
        # after its WARM_STEPS products and eigh runs anyway; it goes to eigh at once (skip = 1)
        self.skip, self.wait = 1, 1
        self.warm_ok = self.warm_failed = 0
        self.exact = True
        self.H: Tensor | None = None  # Qᵀ G Q of the last update: (r, r), or its eigenvalues (r,) after eigh
        self._warm = _Warm(sym)

    def __call__(self, Xt: Tensor, V0: Tensor) -> tuple[Tensor, Tensor]:
        """``Xt (T r, R)``: the rows of ``X = [Y_1 ... Y_T]`` transposed (any order), or ``G`` itself when
        ``sym``; ``V0``: the last basis (need not be orthonormal)."""
        if self.warm and self.skip == 0:
            got = self._warm(Xt, V0)
            if got is not None:
                self.warm_ok += 1
                self.wait = 1
                self.exact = False
                self.H = self._warm.H
                return got
            self.warm_failed += 1
            self.skip, self.wait = self.wait, 2 * self.wait
        elif self.skip:
            self.skip -= 1
        self.exact = True
        V, top, self.H = _top_eigvecs(Xt if self.sym else Xt.T @ Xt, self.r)
        return V, top


def _products(M: Tensor, factors: tuple[Tensor, Tensor] | None) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """``S -> [M_1 S ... M_T S]ᵀ`` and ``P -> [M_1ᵀ P ... M_Tᵀ P]ᵀ``, each ``(T r, R)`` with its rows in
    whatever order needs no copy (the Gram matrix does not depend on it); through the factors
    ``M_t = L_t K_tᵀ`` when given (``O(T R k r)`` instead of ``O(T R² r)``) and ``R >= WARM_MIN_R`` (below
    it the batched small products cost more than they save: measured 10-20 % slower at R = 20-32)."""
    T, R, _ = M.shape
    if factors is not None and R >= WARM_MIN_R:
        L, K = factors
        k = L.shape[2]
        Lt, Kt = L.mT.contiguous(), K.mT.contiguous()
        Lc, Kc = (f.permute(1, 0, 2).reshape(R, T * k) for f in (L, K))  # [L_1 ... L_T], [K_1 ... K_T]
        # (M_t S)ᵀ = (Sᵀ K_t) L_tᵀ, (M_tᵀ P)ᵀ = (Pᵀ L_t) K_tᵀ: (T, r, R), rows (t, i); the T products
        # Sᵀ K_t as one (r, R) @ (R, T k) product (a broadcast batched one copies Sᵀ T times)

        def times(Vt: Tensor, Fc: Tensor, Gt: Tensor) -> Tensor:
            return ((Vt @ Fc).view(-1, T, k).transpose(0, 1) @ Gt).view(-1, R)

        return (lambda S: times(S.mT, Kc, Lt)), (lambda P: times(P.mT, Lc, Kt))
    # (Sᵀ M_tᵀ)[i, j] = Σ_a S[a, i] M_t[j, a] and (Pᵀ M_t)[i, j] = Σ_a P[a, i] M_t[a, j]: one product each
    # with the (R, T R) layouts below; rows (i, t)
    Ncol = M.permute(2, 0, 1).reshape(R, T * R)
    Nrow = M.permute(1, 0, 2).reshape(R, T * R)
    return (lambda S: (S.T @ Ncol).view(-1, R)), (lambda P: (P.T @ Nrow).view(-1, R))


#: Largest condition number of ``H = Uᵀ F U`` (the kept eigenvalues' ``λ_1 / λ_r``, or after a warm start
#: the upper bound ``||H||_F ||H⁻¹||_F``) at which :class:`_Coords` maps its subspace back: orthonormality
#: of the mapped basis degrades as ``κ ε`` (~1e-9 here); above it :func:`_hooi` reruns in ``R``-space,
#: where ``eigh`` gives orthonormal bases whatever the spectrum.
COORDS_MAX_COND = 1e7


class _Degenerate(Exception):
    """An update's kept eigenvalues are too spread (or zero) to map it out of :class:`_Coords`."""


class _Coords:
    """One factor's HOOI updates in the adapters' own coordinates, for ``M_t = L_t K_tᵀ`` (``L`` is this
    factor's side: ``L`` for ``P``, ``K`` for ``S``; ``(T, R, k)``).

    With the other factor ``S`` fixed, ``X = [M_1 S ... M_T S] = Lc Cᵀ``: ``Lc = [L_1 ... L_T] (R, T k)``
    and ``C = blockdiag(C_t)``, ``C_t = Sᵀ K_t (r, k)``. The update needs the top-``r`` eigenspace of
    ``G = X Xᵀ (R, R)``; ``F = Xᵀ X = C N Cᵀ (T r, T r)`` with ``N = Lcᵀ Lc`` (once per HOOI) has the same
    nonzero eigenvalues and ``X`` maps its top eigenspace to ``G``'s: ``P = X U W`` (``U``: an orthonormal
    basis of ``F``'s top eigenspace, ``H = Uᵀ F U = (X U)ᵀ X U``, ``W`` its inverse Cholesky factor, so
    ``P`` is orthonormal). ``F`` costs two block-diagonal
    products with ``N``; then every application of the operator is one ``(r, T r) @ (T r, T r)`` product
    instead of two with ``X`` (and ``X`` itself is never formed). Accepting on ``F``'s residual is at least as
    strict as on ``G``'s: a component of ``U`` outside ``F``'s top eigenspace maps to ``G`` shrunk by
    ``sqrt(λ_{r+1} / λ_r)``.

    Nothing in ``R``-space is needed between sweeps: ``P`` enters the other factor's update only as
    ``Z_P = Lcᵀ P (T k, r)`` (its ``C'_t = Pᵀ L_t``; kept as rows) and in the warm start
    ``Xᵀ P_0 = C Z_{P_0}``; ``Z_P = N Cᵀ U W``. Spectra whose kept eigenvalues span more than
    :data:`COORDS_MAX_COND` (zeros among them: ``G`` of rank below ``r``) raise :class:`_Degenerate`
    and :func:`_hooi` reruns the sweeps in ``R``-space. :meth:`basis` gives ``P`` itself
    (eigenvector basis, ``R x r``) once, after the last sweep.
    """

    def __init__(self, Ls: Tensor, r: int):
        T, R, k = Ls.shape
        self.T, self.k, self.r = T, k, r
        self.Lc = Ls.permute(1, 0, 2).reshape(R, T * k)  # [L_1 ... L_T]
        self.N = self.Lc.T @ self.Lc                     # (T k, T k): blocks L_sᵀ L_t (symmetric)
        self.Nb = self.N.view(T, k, T * k)               # its block rows
        self.update = _Updater(r, True, R, sym=True)
        self.eye = torch.eye(r, dtype=Ls.dtype)
        self.C: Tensor | None = None
        self.U: Tensor | None = None

    def coords(self, P: Tensor) -> Tensor:
        """``Pᵀ Lc (r, T k)`` of an ``R``-space basis ``P`` (the coordinates are kept as rows)."""
        return P.T @ self.Lc

    def __call__(self, Zt_other: Tensor, Zt_prev: Tensor) -> tuple[Tensor, Tensor]:
        """``(Zt_new, energy)``: ``Zt_other`` the other factor's coordinates, ``Zt_prev`` this factor's last
        (rows: ``(r, T k)``; products with the short side first are the fast layout, see :class:`_Warm`)."""
        T, k, r = self.T, self.k, self.r
        C = Zt_other.view(r, T, k).transpose(0, 1).contiguous()        # (T, r, k): C_t = Sᵀ K_t
        Y = (C @ self.Nb).view(T * r, T * k)                          # C N: rows (t, i), columns (s, b)
        # block s of the product: C_s (Y's columns (s, ·))ᵀ, read in place (no transposed copy of Y), = rows
        # (s, j) of (C N Cᵀ)ᵀ = F (F is symmetric)
        F = (C @ Y.view(T * r, T, k).permute(1, 2, 0)).view(T * r, T * r)
        # Xᵀ P_0 (rows (t, i)): blocks C_t L_tᵀ P_0 = (Z_t C_tᵀ)ᵀ with Z_t = P_0ᵀ L_t
        U0t = (Zt_prev.view(r, T, k).transpose(0, 1) @ C.mT).transpose(0, 1).reshape(r, T * r)
        U, top = self.update(F, U0t.T)
        H = self.update.H
        assert H is not None
        NV = U.T @ Y                                                   # (Lcᵀ X U)ᵀ = Uᵀ C N (X U = Lc Cᵀ U)
        if H.ndim == 1:                                                # eigh: U eigenvectors, H = diag(λ)
            if not float(H[0]) < float(H[-1]) * COORDS_MAX_COND:
                raise _Degenerate
            Zt = NV / H.sqrt()[:, None]
        else:
            Rh, info = torch.linalg.cholesky_ex(H, upper=True)
            W = torch.linalg.solve_triangular(Rh, self.eye, upper=True)  # Rh⁻¹; H⁻¹ = W Wᵀ
            # ||H||_F ||H⁻¹||_F >= λ_1 / λ_r, and ||H⁻¹||_F <= ||W||_F²; NaN (a failed Cholesky) also refuses
            kappa = float(torch.linalg.matrix_norm(H) * torch.linalg.matrix_norm(W).square())
            if int(info) != 0 or not kappa < COORDS_MAX_COND:
                raise _Degenerate
            Zt = W.mT @ NV                                              # (X U W)ᵀ Lc = Wᵀ NV
        self.C, self.U = C, U
        return Zt, top

    def basis(self) -> Tensor:
        """The last update's subspace as ``R``-space eigenvectors (largest first): ``X U_e λ^{-1/2}``."""
        T, k, r = self.T, self.k, self.r
        assert self.C is not None and self.U is not None
        H = self.update.H
        assert H is not None
        if H.ndim == 1:
            U, w = self.U, H
        else:
            w, Y = torch.linalg.eigh(H)
            U, w = self.U @ Y.flip(1), w.flip(0)
        P = (self.Lc @ (self.C.mT @ U.view(T, r, r)).reshape(T * k, r)) / w.sqrt()
        # orthonormal to ~κ ε <= ~1e-9 (COORDS_MAX_COND); one Gram-Schmidt pass when visibly less
        if float((P.T @ P - torch.eye(r, dtype=P.dtype)).abs().max()) > 1e-12:
            Q, Rq = torch.linalg.qr(P)
            P = Q * torch.sign(Rq.diagonal())
        return P


def _check_factors(M: Tensor, factors: Any) -> tuple[Tensor, Tensor]:
    if not (isinstance(factors, tuple) and len(factors) == 2 and all(isinstance(f, Tensor) for f in factors)):
        raise TypeError("tucker2: factors must be a pair of tensors (L, K) with M_t = L_t K_tᵀ")
    T, R, _ = M.shape
    L, K = (f.to(FP) for f in factors)
    if L.ndim != 3 or L.shape[:2] != (T, R) or K.shape != L.shape:
        raise ValueError(f"tucker2: factors must be (T, R, k) = ({T}, {R}, k) each with M_t = L_t K_tᵀ, got "
                         f"{tuple(L.shape)} and {tuple(K.shape)}")
    gap = float((L @ K.mT - M).norm())
    if not gap <= 1e-10 * max(float(M.norm()), 1e-300):
        raise ValueError(f"tucker2: factors do not reproduce M (||L Kᵀ - M||_F / ||M||_F = {gap / float(M.norm()):.3g})")
    return L, K


def tucker2(M: Tensor, rank: int, *, iters: int = 1000, tol: float = 1e-6, warm: bool = True,
            factors: tuple[Tensor, Tensor] | None = None) -> HOOIResult:
    """Step 4: partial Tucker of ``M (T, R, R)`` on modes 0, 1 with ranks (r, r), the task mode kept.

    HOSVD init: ``P`` = top-r left singular vectors of ``[M_1 ... M_T]`` ``(R, T R)``, ``S`` = those
    of ``[M_1ᵀ ... M_Tᵀ]``. HOOI sweep: ``P ← lsv_r([M_1 S ... M_T S])``, ``S ← lsv_r([M_1ᵀ P ... M_Tᵀ P])``.
    Each update maximises the objective over one factor with the other fixed, so the objective never
    decreases. The returned singular vectors are sign-fixed.

    Computation (float64, one intra-op thread: :func:`_one_thread`): each ``lsv_r`` is the top-``r``
    eigenspace of the ``R x R`` Gram matrix ``G = X Xᵀ`` of ``X = [M_1 S ... M_T S]``, and the objective
    after a sweep is the sum of its top-``r`` eigenvalues (no extra product). The HOSVD init runs
    ``eigh``, and so does each factor's first update (it starts from the HOSVD factor, not from a HOOI
    iterate). A sweep only needs the subspaces, so each later update starts from the previous factor and
    runs subspace iteration on ``X`` to a residual of :data:`WARM_RESIDUAL` ``* λ_1`` (:class:`_Warm`:
    the exact eigenspace to that accuracy; ``eigh`` when it does not converge, with a back-off:
    :class:`_Updater`); the eigenvector bases are computed once, after the last sweep. ``warm=False``
    runs ``eigh`` every time (the same iterates to ~1e-10; the tests compare them). ``factors=(L, K)``
    (each ``(T, R, k)``, ``M_t = L_t K_tᵀ``, checked), as :func:`ctm_merge_layer` has them for LoRA
    cores of rank ``k = r_t``, make the sweep's products ``O(T R k r)`` instead of ``O(T R² r)``; where
    also ``T r <= R`` the sweeps run in the adapters' coordinates (:class:`_Coords`: the same updates on
    the ``T r x T r`` matrix ``Xᵀ X``, one product per application instead of two).

    Stopping rule (tensorly's ``partial_tucker`` criterion): the relative reconstruction error
    ``e = sqrt(1 - obj / ||M||_F²)`` is computed after every sweep; stop when it changes by less than
    ``tol`` (absolute, default ``1e-6``), or after ``iters`` sweeps (``converged=False``).
    """
    if M.ndim != 3 or M.shape[1] != M.shape[2]:
        raise ValueError(f"tucker2: M must be (T, R, R), got {tuple(M.shape)}")
    R = M.shape[1]
    if rank > R:
        raise ValueError(f"tucker2: rank {rank} > R = {R}")
    M = M.to(FP)
    if factors is not None:
        factors = _check_factors(M, factors)
    return _hooi(M, rank, iters, tol, warm, factors)


def _hooi(M: Tensor, rank: int, iters: int, tol: float, warm: bool,
          factors: tuple[Tensor, Tensor] | None) -> HOOIResult:
    """:func:`tucker2` on checked inputs: float64 ``M (T, R, R)``, ``rank <= R``, ``factors`` (float64)
    reproducing ``M`` (the caller's guarantee; :func:`ctm_merge_layer` builds ``M`` from them)."""
    R = M.shape[1]
    with _one_thread():
        total = float(M.square().sum())
        if total == 0.0:
            eye = torch.eye(R, rank, dtype=FP)
            return HOOIResult(eye, eye.clone(), 0.0, 0.0, 0, True, 0.0)
        if factors is not None and R >= WARM_MIN_R:
            L, K = factors  # Σ_t M_t M_tᵀ = Σ_t L_t (K_tᵀ K_t) L_tᵀ: O(T R² k) instead of O(T R³)
            P = _top_eigvecs(_factored_gram(L, K), rank)[0]
            S = _top_eigvecs(_factored_gram(K, L), rank)[0]
        else:
            P = _top_eigvecs(_gram(M), rank)[0]
            S = _top_eigvecs(_gram(M.mT), rank)[0]
        obj0 = obj = tucker_objective(M, P, S)
        err = math.sqrt(max(0.0, 1.0 - obj / total))
        if rank == R:
            return HOOIResult(sign_fix(P)[0], sign_fix(S)[0], obj0, obj, 0, True, err)
        if warm and iters >= 1 and factors is not None and R >= WARM_MIN_R and M.shape[0] * rank <= R:
            try:
                Pc, Sc, *rest = _sweeps_in_coords(factors, P, S, rank, iters, tol, total, obj, err)
                return HOOIResult(sign_fix(Pc)[0], sign_fix(Sc)[0], obj0, *rest)
            except _Degenerate:
                pass  # the R-space sweeps below, from the same start
        times_S, times_P = _products(M, factors)
        # inside the loop P and S are any orthonormal bases of the iterates (the Gram matrices depend on
        # span(P), span(S) only); eigenvector bases and signs are fixed once at the end
        update_P, update_S = _Updater(rank, warm, R), _Updater(rank, warm, R)
        XP = XS = None  # the last sweep's products, transposed (T r, R)

        def sweep() -> float:
            nonlocal P, S, XP, XS
            XP = times_S(S)
            P = update_P(XP, P)[0]
            XS = times_P(P)
            S, top = update_S(XS, S)
            return float(top)

        obj, it, converged, err = _sweep_until(sweep, iters, tol, total, obj, err)
        if XP is not None and not update_P.exact:
            P = _ritz(XP, P)
        if XS is not None and not update_S.exact:
            S = _ritz(XS, S)
    return HOOIResult(sign_fix(P)[0], sign_fix(S)[0], obj0, obj, it, converged, err)


def _sweeps_in_coords(factors: tuple[Tensor, Tensor], P: Tensor, S: Tensor, rank: int, iters: int, tol: float,
                      total: float, obj: float, err: float) -> tuple[Tensor, Tensor, float, int, bool, float]:
    """:func:`_hooi`'s sweeps through :class:`_Coords` (the same updates, the same stopping rule), from
    the HOSVD bases ``P``, ``S``. Raises :class:`_Degenerate` when an update cannot be mapped."""
    L, K = factors
    side_P, side_S = _Coords(L, rank), _Coords(K, rank)
    ZP, ZS = side_P.coords(P), side_S.coords(S)

    def sweep() -> float:
        nonlocal ZP, ZS
        ZP = side_P(ZS, ZP)[0]
        ZS, top = side_S(ZP, ZS)
        return float(top)

    obj, it, converged, err = _sweep_until(sweep, iters, tol, total, obj, err)
    return side_P.basis(), side_S.basis(), obj, it, converged, err


def _sweep_until(sweep: Callable[[], float], iters: int, tol: float, total: float, obj: float, err: float
                 ) -> tuple[float, int, bool, float]:
    """HOOI's stopping rule around ``sweep`` (one sweep; returns the objective after it), from the
    objective ``obj`` and error ``err`` at the start: stop when ``e = sqrt(1 - obj / total)`` changes by less
    than ``tol`` (converged) or after ``iters`` sweeps. Returns ``(obj, sweeps, converged, err)``."""
    for it in range(1, iters + 1):
        obj = sweep()
        new_err = math.sqrt(max(0.0, 1.0 - obj / total))
        if abs(err - new_err) < tol:
            return obj, it, True, new_err
        err = new_err
    return obj, iters, False, err


# ------------------------------------------------------------------------------------------------
# one layer
# ------------------------------------------------------------------------------------------------

@dataclass
class LayerResult:
    """One module's CtM output and diagnostics (all float64)."""

    B: Tensor
    A: Tensor
    U_r: Tensor
    V_r: Tensor
    C: Tensor                       # (T, r, r) coordinates of the (kept) adapters
    kept_energy: list[float]        # ||C_t||_F / ||ΔW_t||_F per kept adapter
    hooi: HOOIResult
    kept: list[int]                 # indices of the adapters used (zero adapters are skipped)


def ctm_merge_layer(Bs: Sequence[Tensor], As: Sequence[Tensor], config: CtMConfig, *,
                    seeds: Sequence[int] | None = None, name: str = "layer") -> LayerResult:
    """CtM steps 1-8 on one layer: ``Bs[t] (m, r_t)`` (scaling folded in), ``As[t] (r_t, n)`` -> rank-r factors.

    Returns ``B (m, r)``, ``A (r, n)`` with ``B A = λ U_r C V_rᵀ`` and the diagnostics. ``seeds``: one per
    adapter for DARE (default: derived from the factors). Raises ValueError if ``r > R`` or ``r > min(m, n)``.
    """
    T = len(Bs)
    if T == 0 or len(As) != T:
        raise ValueError(f"ctm_merge_layer ({name}): need as many B as A factors, at least one; got {len(Bs)}, {len(As)}")
    m, n = Bs[0].shape[0], As[0].shape[1]
    R = sum(int(b.shape[1]) for b in Bs)
    r = config.rank
    if r > min(m, n):
        raise ValueError(f"CtM: rank={r} exceeds min(out, in) = {min(m, n)} at {name}")
    if r > R:
        raise ValueError(f"CtM: rank={r} exceeds R = Σ r_t = {R} at {name}; choose rank <= {R}")
    Bs = [b.to(FP) for b in Bs]
    As = [a.to(FP) for a in As]
    U_B, V_A, L, K = core_space(Bs, As)                             # steps 1-2: M_t = L_t K_tᵀ
    M = L @ K.mT
    c = _balance_scale(M, config.beta)                              # step 3
    Lb = L * c[:, None, None]
    # step 4 (M c and (L c, K) are built here, so tucker2's check of the factors is skipped)
    hooi = _hooi(M * c[:, None, None], r, config.hooi_iters, config.hooi_tol, True, (Lb, K))
    U_r, V_r = U_B @ hooi.P, V_A @ hooi.S                           # step 5
    C = (hooi.P.T @ L) @ (K.mT @ hooi.S)                            # step 6: U_rᵀ B_t A_t V_r = Pᵀ M_t S
    if seeds is None and needs_seeds(config.rule):  # hashing the factors costs; only DARE's masks use them
        seeds = [adapter_seed(config.seed, name, b, a) for b, a in zip(Bs, As)]
    Cm = merge_tensors(C, config.rule, density=config.density, drop_rate=config.drop_rate, seeds=seeds)  # step 7
    if config.balance or config.rule == "iso_c":
        X, Sig, Yh = torch.linalg.svd(Cm, full_matrices=False)
        Bc, Ac = lowrank_factors(X, Sig, Yh, r, config.rule == "iso_c")        # (r, r) each
        B = config.scale * (U_r @ Bc)
        A = Ac @ V_r.T
    else:
        B = config.scale * (U_r @ Cm)
        A = V_r.T.contiguous()
    if not (bool(torch.isfinite(B).all()) and bool(torch.isfinite(A).all())):
        raise NumericalError(f"CtM produced non-finite factors at {name}")
    # ||ΔW_t||_F = ||M_t||_F (U_B, V_A orthonormal and their spans hold every adapter)
    nrm = M.reshape(T, -1).norm(dim=1)
    energy = (C.reshape(T, -1).norm(dim=1) / nrm).tolist()
    return LayerResult(B, A, U_r, V_r, C, energy, hooi, list(range(T)))


# ------------------------------------------------------------------------------------------------
# whole adapters
# ------------------------------------------------------------------------------------------------

@dataclass
class CtMReport:
    """Per-module diagnostics of a CtM merge.

    ``kept_energy[module][i]`` = ``||U_rᵀ ΔW_i V_r||_F / ||ΔW_i||_F`` for adapter i (None where it was
    skipped as zero); ``hooi[module]`` = iterations, convergence, objective at init and at the end.
    """

    kept_energy: dict[str, list[float | None]] = field(default_factory=dict)
    hooi: dict[str, dict[str, Any]] = field(default_factory=dict)

    def mean_kept_energy(self) -> list[float]:
        """Per adapter, the mean kept-energy fraction over modules."""
        if not self.kept_energy:
            return []
        T = len(next(iter(self.kept_energy.values())))
        out = []
        for i in range(T):
            vals = [v[i] for v in self.kept_energy.values() if v[i] is not None]
            out.append(sum(vals) / len(vals) if vals else float("nan"))
        return out


def merge_with_report(adapters: Sequence[AdapterState], config: CtMConfig | None = None
                      ) -> tuple[AdapterState, CtMReport]:
    """CtM on every module of ``adapters``; returns the merged rank-r LoRA and a :class:`CtMReport`.

    The output has alpha = r (scaling 1) on every module, the adapters' common (promoted) dtype, the
    shared base-model fingerprint, and records the settings in ``config["merge"]``. Adapters that are
    zero at a module are skipped there with a warning; a module where every adapter is zero gets a
    zero rank-r LoRA. Errors (ValueError/TypeError/RankwiseError) name the adapter and module.
    """
    cfg = config or CtMConfig()
    if not isinstance(cfg, CtMConfig):
        raise TypeError(f"ctm merge: config must be a CtMConfig, got {type(cfg).__name__}")
    inputs = check_adapters(adapters, "ctm merge")
    R_total = {mod: sum(a.rank(mod) for a in inputs.adapters) for mod in inputs.modules}
    check_rank_fits(inputs, cfg.rank, "ctm merge")
    for mod in inputs.modules:
        if cfg.rank > R_total[mod]:
            raise ValueError(f"ctm merge: rank={cfg.rank} exceeds the total input rank R = Σ r_t = {R_total[mod]} "
                             f"at module {mod!r}; choose rank <= {R_total[mod]}")
    report = CtMReport()
    factors: dict[str, dict[str, Tensor]] = {}
    T = len(inputs.adapters)

    def one(mod: str) -> tuple[list[int], LayerResult | None]:
        Bs, As, kept = module_factors(inputs, mod)
        if not Bs:
            return kept, None
        R = sum(int(b.shape[1]) for b in Bs)
        # zero adapters skipped: fewer directions than asked; the output is padded with zeros below
        return kept, ctm_merge_layer(Bs, As, replace(cfg, rank=R) if R < cfg.rank else cfg, name=mod)

    # the modules are independent: merged on the available threads, one module per thread
    # (map_modules), so only a few modules' float64 factors live at once
    for mod, (kept, res) in zip(inputs.modules, map_modules(one, inputs.modules)):
        m, n = inputs.shapes[mod]
        if res is None:
            factors[mod] = {"lora_A": torch.zeros(cfg.rank, n, dtype=FP), "lora_B": torch.zeros(m, cfg.rank, dtype=FP)}
            report.kept_energy[mod] = [None] * T
            report.hooi[mod] = {"iterations": 0, "converged": True, "skipped": "all adapters are zero"}
            continue
        B, A = res.B, res.A
        got = B.shape[1]
        if got < cfg.rank:
            B = torch.cat([B, B.new_zeros(m, cfg.rank - got)], 1)
            A = torch.cat([A, A.new_zeros(cfg.rank - got, n)], 0)
        factors[mod] = {"lora_A": A, "lora_B": B}
        energy: list[float | None] = [None] * T
        for j, i in enumerate(kept):
            energy[i] = res.kept_energy[j]
        report.kept_energy[mod] = energy
        report.hooi[mod] = {"iterations": res.hooi.iterations, "converged": res.hooi.converged,
                            "objective_init": res.hooi.objective_init, "objective": res.hooi.objective,
                            "rel_error": res.hooi.rel_error}
    state = out_state(inputs, factors, cfg.rank, {"method": "ctm", "merge": asdict(cfg)})
    return state, report


LAMBDA_GRID: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
DENSITY_GRID: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
BETA_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)


def search(adapters: Sequence[AdapterState], score: Callable[[AdapterState], float], base: CtMConfig | None = None,
           *, lambdas: Sequence[float] = LAMBDA_GRID, densities: Sequence[float] = DENSITY_GRID,
           betas: Sequence[float] = BETA_GRID) -> tuple[CtMConfig, float, list[tuple[dict[str, float], float]]]:
    """The paper's sequential hyper-parameter search on a validation callback (higher ``score`` is better).

    Starting from ``base`` (default :class:`CtMConfig`), tune λ over ``lambdas``, then the TIES/DARE
    density over ``densities`` (rules ``ties``/``dare_ties`` only), then β over ``betas``, each at the best
    setting so far; ties keep the earlier candidate. ``score(merged)`` is called once per distinct
    setting, e.g. mean normalized validation accuracy. Returns the best config, its score and the
    history ``[(setting, score), ...]``.
    """
    cfg = base or CtMConfig()
    if not callable(score):
        raise TypeError(f"search: score must be a callable AdapterState -> float, got {type(score).__name__}")
    history: list[tuple[dict[str, float], float]] = []
    seen: dict[tuple[float, float, float], float] = {}

    def evaluate(c: CtMConfig) -> float:
        key = (c.scale, c.density, c.beta)
        if key not in seen:
            val = float(score(merge(adapters, c)))
            if not math.isfinite(val):
                raise NumericalError(f"search: score returned {val} for scale={c.scale}, density={c.density}, "
                                     f"beta={c.beta}")
            seen[key] = val
            history.append(({"scale": c.scale, "density": c.density, "beta": c.beta}, val))
        return seen[key]

    best, best_score = cfg, evaluate(cfg)
    stages = [("scale", lambdas), ("density", densities if cfg.rule in ("ties", "dare_ties") else ()),
              ("beta", betas)]
    for knob, grid in stages:
        for v in grid:
            cand = replace(best, **{knob: v})
            s = evaluate(cand)
            if s > best_score:
                best, best_score = cand, s
    return best, best_score, history


def merge(adapters: Sequence[AdapterState], config: CtMConfig | None = None) -> AdapterState:
    """Compress-then-Merge: ONE rank-``config.rank`` LoRA from ``adapters`` (see the module docstring)."""
    return merge_with_report(adapters, config)[0]


ctm_merge = merge


def _merge_with_diagnostics(adapters: Sequence[AdapterState], config: CtMConfig) -> tuple[AdapterState, dict[str, Any]]:
    state, report = merge_with_report(adapters, config)
    return state, {"kept_energy": report.mean_kept_energy(), "report": report}


register("ctm", config=CtMConfig, entry=merge)
register_merge_method(MergeMethod("ctm", CtMConfig, merge, "Compress-then-Merge: shared rank-r subspaces, then "
                                  "merge the r x r coordinates with --rule", report=_merge_with_diagnostics))
