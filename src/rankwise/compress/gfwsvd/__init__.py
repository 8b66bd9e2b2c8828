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

import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.base import LayerMethod, PairedStats, register_layer_method
from rankwise.core.errors import NumericalError
from rankwise.core.linalg import LowRankFactors, check_finite, damped_cholesky, weighted_lowrank_factors
from rankwise.core.registry import register
from rankwise.core.select import Selector, select
from rankwise.core.stats import CalibrationError, LayerStats, default_forward

log = logging.getLogger(__name__)

Tensor = torch.Tensor
Storage = Literal["tokens", "recompute"]
FactorKind = Literal["mff", "kfac"]

__all__ = [
    "GFWSVDConfig", "GFWSVDMethod", "KroneckerFactors", "SampleFactors", "PerSampleGradientCollector",
    "explicit_fisher", "nearest_kronecker_fisher", "mff", "mff_from_gradients", "kfac_from_samples",
    "gfwsvd_factors", "gfwsvd_objective", "predicted_loss_increase", "kronecker_whiteners", "gfwsvd_rank",
    "collect_kronecker_fisher", "collect_sample_factors", "factors_from_samples", "layer_stats_from_samples",
    "gfwsvd_compress", "save_factors", "load_factors",
]


def _where(name: str | None) -> str:
    return f" in layer {name!r}" if name else ""


def _diagonal(M: Tensor) -> Tensor | None:
    """The diagonal of ``M`` when ``M`` is exactly diagonal (then ``A @ M == A * diag``), else None."""
    d = torch.diagonal(M)
    return d if torch.equal(M, torch.diag_embed(d)) else None


# ----------------------------------------------------------------------------------------------
# the Kronecker factors of one layer


@dataclass
class KroneckerFactors:
    """``F ~ P kron Q`` for one layer: ``P`` (``n x n``, input side), ``Q`` (``m x m``, output side), float64.

    ``sigma`` is the top singular value of the rearranged Fisher found by MFF (``Q`` already carries
    it); ``samples`` the number of per-sample gradients; ``iters`` the power iterations run;
    ``converged`` whether the relative change of ``P`` fell below the tolerance; ``kind`` ``"mff"``
    or ``"kfac"``; ``row_fisher`` the FWSVD row weights ``f_i = sum_s sum_j G_s[i, j]^2 / S`` from
    the same per-sample gradients (``diag((1/S) sum_s G_s G_s^T)``), when computed.
    """

    P: Tensor
    Q: Tensor
    sigma: float = float("nan")
    samples: int = 0
    iters: int = 0
    converged: bool = False
    kind: str = "mff"
    row_fisher: Tensor | None = None

    def kron(self) -> Tensor:
        """Dense ``P kron Q`` (``(mn) x (mn)``, column-stacking convention); small layers / tests only."""
        return torch.kron(self.P, self.Q)


# ----------------------------------------------------------------------------------------------
# per-sample gradient factors (X_s, D_s)


class SampleFactors:
    """The per-sample gradient factors of one layer: ``G_s = D_s^T X_s`` for ``s = 1..S``.

    Only the tokens whose output gradient is non-zero are kept (a token with ``delta_t = 0``, e.g.
    padding, adds nothing to ``G_s``, so dropping it is exact), ragged: chunks of concatenated rows
    ``X`` (``N_c x n``), ``D`` (``N_c x m``) with per-sample token counts. Memory
    ``O(tokens (m + n))`` in the dtype the rows arrive in (the model's).

    The MFF half-steps cost ``O(N (m^2 + n^2) + sum_s T_s^2 (m + n))`` for ``N`` kept tokens: the large
    products run on the concatenated rows, the per-sample ``T_s x T_s`` blocks on padded buckets.
    They are computed in ``compute_dtype`` (float64 by default) and summed over chunks in float64.
    """

    def __init__(self, n: int, m: int, *, name: str | None = None, compute_dtype: torch.dtype = torch.float64):
        self.n, self.m, self.name = n, m, name
        self.compute_dtype = compute_dtype
        self._chunks_: list[tuple[Tensor, Tensor, Tensor]] = []  # (X rows, D rows, lengths)
        self._samples = 0

    @classmethod
    def from_gradients(cls, grads: Tensor) -> "SampleFactors":
        """Wrap explicit per-sample gradients ``(S, m, n)`` as ``G_s = I_m^T G_s`` (``D_s = I``, ``X_s = G_s``)."""
        if grads.ndim != 3:
            raise ValueError(f"grads must be (S, m, n), got shape {tuple(grads.shape)}")
        S, m, n = grads.shape
        sf = cls(n, m)
        eye = torch.eye(m, dtype=grads.dtype, device=grads.device).expand(S, m, m)
        sf.add(grads, eye)  # tokens = m rows: x_t = G_s[t, :], delta_t = e_t
        return sf

    @property
    def samples(self) -> int:
        """Number of samples ``S`` (including samples whose gradient was entirely zero)."""
        return self._samples

    @property
    def tokens(self) -> int:
        """Number of kept tokens ``N``."""
        return sum(x.shape[0] for x, _, _ in self._chunks_)

    def numel(self) -> int:
        return sum(x.numel() + d.numel() for x, d, _ in self._chunks_)

    def add(self, X: Tensor, D: Tensor) -> None:
        """Append ``B`` samples: ``X`` (``B, T, n``) inputs and ``D`` (``B, T, m``) output gradients."""
        if X.ndim != 3 or D.ndim != 3 or X.shape[:2] != D.shape[:2]:
            raise ValueError(f"need X (B, T, n) and D (B, T, m) with equal (B, T); got {tuple(X.shape)}, {tuple(D.shape)}")
        if X.shape[2] != self.n or D.shape[2] != self.m:
            raise ValueError(f"layer {self.name!r}: expected n={self.n}, m={self.m}, got X {tuple(X.shape)}, D {tuple(D.shape)}")
        for t, what in ((X, "inputs"), (D, "output gradients")):
            if not bool(torch.isfinite(t).all()):
                raise NumericalError(f"non-finite values (NaN/Inf) in the {what}{_where(self.name)}")
        B, T = X.shape[:2]
        self._samples += B
        keep = (D != 0).any(-1)  # (B, T)
        lengths = keep.sum(1)
        if int(lengths.sum()) == 0:
            return
        self._chunks_.append((X.detach()[keep], D.detach()[keep], lengths[lengths > 0].cpu()))

    def _iter(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for X, D, lengths in self._chunks_:
            yield X.to(self.compute_dtype), D.to(self.compute_dtype), lengths

    _BUCKET = 8  # samples per padded bucket (sorted by length, so each bucket pads to nearly its own lengths)

    @classmethod
    def _buckets(cls, lengths: Tensor) -> list[tuple[Tensor, Tensor, Tensor, int, int]]:
        """Padded-block layout of a chunk: buckets of samples of similar length, each ``(rows, sample, pos,
        S_b, T_b)`` with the chunk rows of its samples, their bucket-local sample index and position, the
        bucket's sample count and longest sample. Padding each bucket to its own longest sample (instead of
        the chunk's) keeps the per-sample products close to ``sum_s T_s^2``."""
        lengths = lengths.to(torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        order = torch.argsort(lengths, stable=True)
        out = []
        for i in range(0, order.numel(), cls._BUCKET):
            idx = order[i:i + cls._BUCKET]
            ln = lengths[idx]
            local = torch.repeat_interleave(torch.arange(idx.numel()), ln)
            pos = torch.arange(int(ln.sum())) - (torch.cumsum(ln, 0) - ln)[local]
            rows = starts[idx][local] + pos
            out.append((rows, local, pos, idx.numel(), int(ln.max())))
        return out

    _GROUP_ROWS = 128  # rows per group of consecutive samples in the explicit half-steps

    @classmethod
    def _groups(cls, lengths: Tensor) -> list[tuple[int, int, Tensor | None]]:
        """Consecutive samples grouped into row ranges ``[r0, r1)`` of at most ``_GROUP_ROWS`` rows (or one
        longer sample), with the block-diagonal mask of the group (None when it holds a single sample)."""
        out: list[tuple[int, int, Tensor | None]] = []
        ln = [int(v) for v in lengths]
        i, r0 = 0, 0
        while i < len(ln):
            j, rows = i, 0
            while j < len(ln) and (j == i or rows + ln[j] <= cls._GROUP_ROWS):
                rows += ln[j]
                j += 1
            if j - i == 1:
                mask = None
            else:
                sid = torch.repeat_interleave(torch.arange(j - i), torch.tensor(ln[i:j]))
                mask = sid[:, None] == sid[None, :]
            out.append((r0, r0 + rows, mask))
            i, r0 = j, r0 + rows
        return out

    def _layout(self, lengths: Tensor) -> list[tuple[int, int, Tensor | None]]:
        cache = self.__dict__.setdefault("_layouts", {})
        key = id(lengths)
        if key not in cache or cache[key][0] is not lengths:
            cache[key] = (lengths, self._groups(lengths))
        return cache[key][1]

    def _per_sample(self, A: Tensor, Bm: Tensor, C: Tensor, lengths: Tensor) -> Tensor:
        """Rows of ``blockdiag_s(A_s B_s^T) C`` for row blocks ``A_s``, ``B_s``, ``C_s`` of the samples.

        Each group of consecutive samples is one small dense product ``A_g B_g^T`` masked to its
        block diagonal (contiguous slices, no padding copies)."""
        out = C.new_empty(C.shape[0], C.shape[1])
        for r0, r1, mask in self._layout(lengths):
            K = A[r0:r1] @ Bm[r0:r1].mT
            if mask is not None:
                K = K * mask.to(K.device, K.dtype)
            torch.matmul(K, C[r0:r1], out=out[r0:r1])
        return out

    def p_step(self, Q: Tensor) -> Tensor:
        """``sum_s G_s^T Q G_s = sum_s X_s^T (D_s Q D_s^T) X_s`` (``n x n``, float64, not divided by ``S``)."""
        out = torch.zeros(self.n, self.n, dtype=torch.float64, device=Q.device)
        d = _diagonal(Q)  # MFF's start Q0 = I / sqrt(m): a column scaling instead of an N x m x m product
        for X, D, lengths in self._iter():
            DQ = D * d.to(D) if d is not None else D @ Q.to(D)
            Y = self._per_sample(DQ, D, X, lengths)  # rows of (D_s Q D_s^T) X_s
            out += (X.mT @ Y).to(torch.float64)
        return out

    def q_step(self, P: Tensor) -> Tensor:
        """``sum_s G_s P G_s^T = sum_s D_s^T (X_s P X_s^T) D_s`` (``m x m``, float64, not divided by ``S``)."""
        out = torch.zeros(self.m, self.m, dtype=torch.float64, device=P.device)
        d = _diagonal(P)
        for X, D, lengths in self._iter():
            XP = X * d.to(X) if d is not None else X @ P.to(X)
            Z = self._per_sample(XP, X, D, lengths)  # rows of (X_s P X_s^T) D_s
            out += (D.mT @ Z).to(torch.float64)
        return out

    def row_fisher(self) -> Tensor:
        """``sum_s sum_j G_s[i, j]^2`` (``m``): the diagonal of ``sum_s G_s G_s^T`` (= ``q_step(I)``'s diagonal).

        Always computed in float64 (whatever ``compute_dtype``): it costs only ``O(sum_s T_s^2 (m + n))``.
        """
        out = torch.zeros(self.m, dtype=torch.float64)
        for X, D, lengths in self._chunks_:
            X, D = X.to(torch.float64), D.to(torch.float64)
            Z = self._per_sample(X, X, D, lengths)  # rows of (X_s X_s^T) D_s
            out += (D * Z).sum(0).cpu()
        return out

    def input_sums(self) -> tuple[Tensor, Tensor, int]:
        """Forward statistics of the kept tokens, float64: ``sum_t x_t x_t^T`` (``n x n``), ``sum_t |x_t|``
        (``n``) and the token count, i.e. the ``"input_cov"`` / ``"input_abs_mean"`` sums of
        :mod:`rankwise.core.stats` over the tokens that received an output gradient."""
        cached = self.__dict__.get("_input_sums")
        if cached is None or cached[0] != len(self._chunks_):
            xtx = torch.zeros(self.n, self.n, dtype=torch.float64)
            abs_sum = torch.zeros(self.n, dtype=torch.float64)
            count = 0
            for X, _, _ in self._chunks_:
                X = X.to(torch.float64)
                xtx += (X.mT @ X).cpu()
                abs_sum += X.abs().sum(0).cpu()
                count += X.shape[0]
            cached = self.__dict__["_input_sums"] = (len(self._chunks_), xtx, abs_sum, count)
        return cached[1].clone(), cached[2].clone(), cached[3]

    def kfac(self) -> tuple[Tensor, Tensor, int]:
        """K-FAC sums ``sum_t x_t x_t^T`` (``n x n``), ``sum_t delta_t delta_t^T`` (``m x m``) over the kept
        tokens (those with a non-zero output gradient), and their count."""
        A, _, count = self.input_sums()  # float64, shared with the activation statistics
        G = torch.zeros(self.m, self.m, dtype=torch.float64)
        for _, D, _ in self._iter():
            G += (D.mT @ D).to(torch.float64).cpu()
        return A, G, count


# ----------------------------------------------------------------------------------------------
# explicit Fisher and nearest Kronecker product (small layers, tests)


def explicit_fisher(grads: Tensor) -> Tensor:
    """``F = (1/S) sum_s vec(G_s) vec(G_s)^T`` from per-sample gradients ``(S, m, n)`` (``(mn) x (mn)``)."""
    if grads.ndim != 3:
        raise ValueError(f"grads must be (S, m, n), got shape {tuple(grads.shape)}")
    g = grads.to(torch.float64).mT.reshape(grads.shape[0], -1)  # column stacking of each G_s
    return g.mT @ g / grads.shape[0]


def nearest_kronecker_fisher(F: Tensor, m: int, n: int) -> tuple[Tensor, Tensor]:
    """Best ``P kron Q`` (``P``: ``n x n``, ``Q``: ``m x m``) to an explicit Fisher by an SVD of the
    Van Loan-Pitsianis rearrangement; the scale is put on ``Q`` with ``||P||_F = 1`` (MFF's convention)."""
    from rankwise.core.linalg import nearest_kronecker

    A, B = nearest_kronecker(F, (n, n), (m, m))
    P, Q = A[0], B[0]
    s = float(torch.linalg.matrix_norm(P))
    return P / s, Q * s


# ----------------------------------------------------------------------------------------------
# MFF power iteration


class _Operator:
    """What MFF needs from the data, for several layers at once: the two half-steps (un-normalised sums)."""

    def p_step(self, Q: Mapping[str, Tensor]) -> dict[str, Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def q_step(self, P: Mapping[str, Tensor]) -> dict[str, Tensor]:  # pragma: no cover - interface
        raise NotImplementedError


class _StoredOperator(_Operator):
    def __init__(self, samples: Mapping[str, SampleFactors]):
        self.samples = samples

    def p_step(self, Q: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: self.samples[k].p_step(q) for k, q in Q.items()}

    def q_step(self, P: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: self.samples[k].q_step(p) for k, p in P.items()}


def _mff(op: _Operator, dims: Mapping[str, tuple[int, int]], counts: Mapping[str, int], iters: int, tol: float
         ) -> dict[str, KroneckerFactors]:
    """Power iteration of the spec on all layers in ``dims`` (``name -> (m, n)``) simultaneously."""
    Q = {k: torch.eye(m, dtype=torch.float64) / math.sqrt(m) for k, (m, n) in dims.items()}
    P: dict[str, Tensor] = {}
    sigma: dict[str, float] = {}
    done: dict[str, int] = {}
    it = 0
    active = list(dims)
    for it in range(1, iters + 1):
        Praw = op.p_step({k: Q[k] for k in active})
        newP = {}
        for k in active:
            p = 0.5 * (Praw[k] + Praw[k].mT) / counts[k]
            nrm = float(torch.linalg.matrix_norm(p))
            if not math.isfinite(nrm):
                raise NumericalError(f"MFF power iteration produced a non-finite input factor P{_where(k)}")
            if nrm == 0.0:
                raise CalibrationError(f"layer {k!r}: every per-sample gradient is zero, so its Fisher is zero; "
                                       "GFWSVD needs a task loss whose gradient does not vanish (not e.g. a "
                                       "self-distillation loss at its optimum)")
            newP[k] = p / nrm
        Qraw = op.q_step(newP)
        for k in list(active):
            q = 0.5 * (Qraw[k] + Qraw[k].mT) / counts[k]
            s = float(torch.linalg.matrix_norm(q))
            if not math.isfinite(s) or s == 0.0:
                raise NumericalError(f"MFF power iteration produced a zero or non-finite output factor Q{_where(k)}")
            change = float(torch.linalg.matrix_norm(newP[k] - P[k])) if k in P else float("inf")
            P[k], Q[k], sigma[k] = newP[k], q / s, s
            if change < tol:
                done[k] = it
                active.remove(k)
        if not active:
            break
    return {k: KroneckerFactors(P=P[k], Q=sigma[k] * Q[k], sigma=sigma[k], samples=counts[k],
                                iters=done.get(k, it), converged=k in done, kind="mff") for k in dims}


# MFF in the token space: when a layer's kept tokens N are few compared with its sides (N (m + n) well below
# T (m^2 + n^2)), the iterates P = X^T A X and Q = D^T B D are carried by their per-sample T_s x T_s blocks
# A_s, B_s, and every half-step needs only the token Gram matrices G_X = X X^T, G_D = D D^T (N x N, formed
# once): X_s P X_s^T = (G_X A G_X)_ss, D_s Q D_s^T = (G_D B G_D)_ss, ||P||_F^2 = sum_s <A_s, (G_X A G_X)_ss>.
# The same iteration as the explicit half-steps (same start, normalisation, stopping rule), at O(N sum_s T_s^2)
# per half-step instead of O(N (m^2 + n^2)); P and Q are formed explicitly once at the end.

_TOKEN_SPACE_MAX_N = 4096  # memory cap: about four N x N float64 matrices live at once


def _token_space_cost(sf: "SampleFactors", iters: int) -> tuple[float, float]:
    """Rough multiply-add counts ``(explicit, token space)`` of MFF on one layer's samples."""
    N, m, n = sf.tokens, sf.m, sf.n
    sq = sum(float((ln.to(torch.float64) ** 2).sum()) for _, _, ln in sf._chunks_)
    explicit = 2.0 * iters * N * (m * m + n * n)
    token = N * N * (m + n) + N * (m * m + n * n) + iters * (8.0 * N * sq + 6.0 * N * N)
    return explicit, token


def _use_token_space(sf: "SampleFactors", iters: int) -> bool:
    if not 0 < sf.tokens <= _TOKEN_SPACE_MAX_N:
        return False
    explicit, token = _token_space_cost(sf, iters)
    return token < 0.5 * explicit


def _mff_token_space(sf: "SampleFactors", iters: int, tol: float, name: str | None = None) -> KroneckerFactors:
    """MFF on one layer by the token-space recursion above. The Grams, the block products and the final
    ``P``, ``Q`` run in ``sf.compute_dtype``, norms and inner products are summed in float64. Returns the
    same :class:`KroneckerFactors` as the explicit iteration (to rounding; tested)."""
    f64, cd = torch.float64, sf.compute_dtype
    X = torch.cat([x for x, _, _ in sf._chunks_]).to(cd)
    D = torch.cat([d for _, d, _ in sf._chunks_]).to(cd)
    lengths = torch.cat([ln for _, _, ln in sf._chunks_])
    N, S, m = X.shape[0], sf.samples, sf.m
    layout = SampleFactors._buckets(lengths)

    def pad(M: Tensor, rows: Tensor, local: Tensor, pos: Tensor, Sb: int, Tb: int) -> Tensor:
        o = M.new_zeros(Sb, Tb, M.shape[1])
        o[local, pos] = M[rows]
        return o

    GX, GD = X @ X.mT, D @ D.mT
    GXp = [pad(GX, *lay) for lay in layout]
    GDp = [pad(GD, *lay) for lay in layout]
    del GX, GD

    def diag_blocks(Gp: list[Tensor], blocks: list[Tensor]) -> list[Tensor]:
        """Per-sample diagonal blocks of ``G blockdiag(blocks) G`` (zero-padded like ``blocks``)."""
        H = Gp[0].new_empty(N, N)
        for (rows, local, pos, _, _), gp, b in zip(layout, Gp, blocks):
            H[rows] = (b @ gp)[local, pos]  # rows of blockdiag(blocks) G
        Ht = H.mT.contiguous()  # its columns, as rows
        del H
        return [gp @ pad(Ht, *lay).mT for lay, gp in zip(layout, Gp)]

    def inner(a: list[Tensor], b: list[Tensor]) -> float:
        return float(sum((x.to(f64) * y.to(f64)).sum() for x, y in zip(a, b)))

    def sym(bl: list[Tensor]) -> list[Tensor]:
        return [0.5 * (b + b.mT) for b in bl]

    Dp = [pad(D, *lay) for lay in layout]
    A_raw = [dp @ dp.mT / math.sqrt(m) for dp in Dp]  # D_s Q0 D_s^T, Q0 = I / sqrt(m)
    del Dp
    A_prev: list[Tensor] | None = None
    Bq_prev: list[Tensor] = []
    A_bar: list[Tensor] = []
    Bq: list[Tensor] = []
    sigma, done, it = float("nan"), None, 0
    for it in range(1, iters + 1):
        A_raw = sym(A_raw)
        B_raw = diag_blocks(GXp, A_raw)  # X_s (X^T A_raw X) X_s^T
        nrm2 = inner(A_raw, B_raw) / S ** 2  # ||P_raw||_F^2, P_raw = X^T A_raw X / S
        if not math.isfinite(nrm2):
            raise NumericalError(f"MFF power iteration produced a non-finite input factor P{_where(name)}")
        if nrm2 <= 0.0:
            raise CalibrationError(f"layer {name!r}: every per-sample gradient is zero, so its Fisher is zero; "
                                   "GFWSVD needs a task loss whose gradient does not vanish (not e.g. a "
                                   "self-distillation loss at its optimum)")
        c = 1.0 / (S * math.sqrt(nrm2))
        A_bar = [a * c for a in A_raw]  # P = X^T A_bar X, ||P||_F = 1
        Bq = sym([b * c for b in B_raw])  # X_s P X_s^T
        change = float("inf")
        if A_prev is not None:
            # ||P - P_prev||^2 = 2 - 2 <P, P_prev> is cheap but loses digits to cancellation; only when it is
            # small, the exact quadratic form sum_s <dA_s, (G_X dA G_X)_ss> decides
            if 2.0 - 2.0 * inner(A_bar, Bq_prev) < 1e-3:
                dA = [a - b for a, b in zip(A_bar, A_prev)]
                change = math.sqrt(max(0.0, inner(dA, diag_blocks(GXp, dA))))
        C_raw = diag_blocks(GDp, Bq)  # D_s (D^T Bq D) D_s^T
        q2 = inner(Bq, C_raw) / S ** 2  # ||Q_raw||_F^2, Q_raw = D^T Bq D / S
        if not math.isfinite(q2) or q2 <= 0.0:
            raise NumericalError(f"MFF power iteration produced a zero or non-finite output factor Q{_where(name)}")
        sigma = math.sqrt(q2)
        A_raw = [cb / (S * sigma) for cb in C_raw]  # D_s Q_unit D_s^T for the next P step
        A_prev, Bq_prev = A_bar, Bq
        if change < tol:
            done = it
            break
    del GXp, GDp

    def form(M: Tensor, blocks: list[Tensor]) -> Tensor:
        """``M^T blockdiag(blocks) M`` (float64, symmetrised)."""
        Y = M.new_empty(M.shape)
        for lay, b in zip(layout, blocks):
            rows, local, pos = lay[:3]
            Y[rows] = (b @ pad(M, *lay))[local, pos]
        out = (M.mT @ Y).to(f64)
        return 0.5 * (out + out.mT)

    P = form(X, A_bar)
    Q = form(D, Bq) / S
    pn = float(torch.linalg.matrix_norm(P))  # 1 up to the rounding of the explicit products
    P, Q = P / pn, Q * pn  # keep ||P||_F = 1 exactly and P kron Q unchanged
    sigma = float(torch.linalg.matrix_norm(Q))
    return KroneckerFactors(P=P, Q=Q, sigma=sigma, samples=S, iters=done or it, converged=done is not None, kind="mff")


def _mff_samples(samples: Mapping[str, "SampleFactors"], iters: int, tol: float) -> dict[str, KroneckerFactors]:
    """MFF on stored samples: each layer in the token space when that is clearly cheaper, else explicitly."""
    token = {k for k, sf in samples.items() if _use_token_space(sf, iters)}
    out = {k: _mff_token_space(samples[k], iters, tol, name=k) for k in samples if k in token}
    rest = {k: sf for k, sf in samples.items() if k not in token}
    if rest:
        out.update(_mff(_StoredOperator(rest), {k: (sf.m, sf.n) for k, sf in rest.items()},
                        {k: sf.samples for k, sf in rest.items()}, iters, tol))
    return {k: out[k] for k in samples}


def _check_iters(iters: Any, tol: Any) -> None:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"power_iters must be an int >= 1, got {iters!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0 or math.isinf(tol):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")


def mff(samples: SampleFactors, *, iters: int = 10, tol: float = 1e-6) -> KroneckerFactors:
    """MFF (matrix-free power iteration) on one layer's per-sample gradient factors.

    Returns :class:`KroneckerFactors` with ``||P||_F = 1`` and ``Q = sigma Q_unit``, both symmetric
    PSD. ``iters`` is ``T``; it stops early when ``||P_t - P_{t-1}||_F < tol`` (``||P||_F = 1``).
    """
    _check_iters(iters, tol)
    S = samples.samples
    if S == 0:
        raise CalibrationError(f"no per-sample gradient reached layer {samples.name!r}")
    if S < 2:
        warnings.warn(f"layer {samples.name!r}: the Fisher from {S} sample is rank-deficient; use more "
                      "calibration samples", RuntimeWarning, stacklevel=2)
    key = samples.name or "layer"
    return _mff_samples({key: samples}, iters, tol)[key]


def mff_from_gradients(grads: Tensor, *, iters: int = 10, tol: float = 1e-6) -> KroneckerFactors:
    """:func:`mff` on explicit per-sample gradients ``(S, m, n)`` (small layers / tests)."""
    return mff(SampleFactors.from_gradients(grads), iters=iters, tol=tol)


def kfac_from_samples(samples: SampleFactors) -> KroneckerFactors:
    """K-FAC ablation: ``P = mean_t x x^T``, ``Q = mean_t delta delta^T`` over the same tokens."""
    A, G, count = samples.kfac()
    if count == 0:
        raise CalibrationError(f"no token with a gradient reached layer {samples.name!r}")
    return KroneckerFactors(P=A / count, Q=G / count, samples=samples.samples, kind="kfac")


# ----------------------------------------------------------------------------------------------
# closed form


def gfwsvd_rank(m: int, n: int, param_ratio: float, rank_multiple: int = 1) -> int:
    """Uniform rank ``floor(rho m n / (m + n))`` rounded down to a multiple of ``rank_multiple``, at least 1.

    ``param_ratio`` (``rho``) is the fraction of the layer's parameters KEPT, in ``(0, 1]``.
    """
    if isinstance(param_ratio, bool) or not isinstance(param_ratio, (int, float)) or not 0 < param_ratio <= 1:
        raise ValueError(f"param_ratio={param_ratio!r} must be in (0, 1] (the fraction of parameters kept)")
    if isinstance(rank_multiple, bool) or not isinstance(rank_multiple, int) or rank_multiple < 1:
        raise ValueError(f"rank_multiple must be an int >= 1, got {rank_multiple!r}")
    r = math.floor(param_ratio * m * n / (m + n))
    r = (r // rank_multiple) * rank_multiple
    return max(1, min(r, min(m, n)))


def _chol(M: Tensor, damping: float, retries: int, what: str, name: str | None) -> Tensor:
    try:
        return damped_cholesky(M, damping=damping, retries=retries, dtype=torch.float64, name=name).L
    except NumericalError as exc:
        raise NumericalError(f"GFWSVD: the {what} Kronecker factor{_where(name)} is not positive definite "
                             f"after damping retries: {exc}") from None


def gfwsvd_factors(
    W: Tensor,
    P: Tensor,
    Q: Tensor,
    rank: int,
    *,
    damping: float = 1e-4,
    retries: int = 5,
    name: str | None = None,
) -> LowRankFactors:
    """Closed-form GFWSVD: ``argmin_{rank(W_r) <= r} ||L_Q^T (W - W_r) L_P||_F``.

    Args:
        W: ``(m, n)`` weight. P: ``(n, n)`` input-side factor. Q: ``(m, m)`` output-side factor.
        rank: ``0 < rank <= min(m, n)``.
        damping: relative floor, ``P + damping mean(diag P) I = L_P L_P^T`` (same for ``Q``), x10 per
            failed Cholesky up to ``retries`` times; ``0`` = exact (a singular factor then raises).
    Returns:
        ``LowRankFactors(B, A)`` (float64): ``A = L_Q^{-T} U_r S_r^{1/2}``, ``B = S_r^{1/2} V_r^T L_P^{-1}``.
    """
    W = W.detach().to(torch.float64)
    m, n = W.shape
    if P.shape != (n, n) or Q.shape != (m, m):
        raise ValueError(f"need P {n}x{n} and Q {m}x{m} for W {m}x{n}{_where(name)}, got P {tuple(P.shape)}, "
                         f"Q {tuple(Q.shape)}")
    check_finite(W, "weight W", name)
    L_P = _chol(P.to(W), damping, retries, "input-side (P)", name)
    L_Q = _chol(Q.to(W), damping, retries, "output-side (Q)", name)
    return weighted_lowrank_factors(W, rank, left=L_Q.mT, right=L_P, dtype=torch.float64, name=name)


def gfwsvd_objective(W: Tensor, W_r: Tensor, P: Tensor, Q: Tensor, *, damping: float = 1e-4) -> float:
    """``||L_Q^T (W - W_r) L_P||_F`` with the damped Cholesky factors (the quantity GFWSVD minimises)."""
    L_P = damped_cholesky(P, damping=damping, dtype=torch.float64).L
    L_Q = damped_cholesky(Q, damping=damping, dtype=torch.float64).L
    dW = (W.to(torch.float64) - W_r.to(torch.float64))
    return float(torch.linalg.matrix_norm(L_Q.mT @ dW @ L_P))


def kronecker_whiteners(P: Tensor, Q: Tensor, *, damping: float = 1e-4, retries: int = 5,
                        name: str | None = None) -> tuple[Tensor, Tensor]:
    """The damped Cholesky factors ``(L_P, L_Q)`` with ``P + lam_P I = L_P L_P^T``, ``Q + lam_Q I = L_Q L_Q^T``."""
    return (_chol(P, damping, retries, "input-side (P)", name), _chol(Q, damping, retries, "output-side (Q)", name))


def predicted_loss_increase(dW: Tensor, P: Tensor | None = None, Q: Tensor | None = None, *, damping: float = 1e-4,
                            whiteners: tuple[Tensor, Tensor] | None = None) -> float:
    """Second-order prediction ``1/2 ||L_Q^T dW L_P||_F^2 = 1/2 vec(dW)^T (P_d kron Q_d) vec(dW)``.

    Give ``P`` and ``Q`` (damped Cholesky factors computed here) or ``whiteners=(L_P, L_Q)`` from
    :func:`kronecker_whiteners` to evaluate many ``dW`` of one layer cheaply.
    """
    if whiteners is None:
        if P is None or Q is None:
            raise ValueError("give P and Q, or whiteners=(L_P, L_Q)")
        whiteners = kronecker_whiteners(P.to(torch.float64), Q.to(torch.float64), damping=damping)
    L_P, L_Q = whiteners
    return 0.5 * float((L_Q.mT @ dW.to(torch.float64) @ L_P).square().sum())


# ----------------------------------------------------------------------------------------------
# per-sample gradient collection with hooks


class PerSampleGradientCollector:
    """Hooks that hand each target layer's per-sample ``(X_s, D_s)`` of every batch to a sink.

    For each forward call the layer input ``x`` (``(B, ..., n)``; a 2-D input is ``B`` samples of one
    token) is kept until its output gradient ``g = dL/dy`` arrives; after the backward of a batch the
    calls of each layer are concatenated along the token dim per sample (so a layer called twice per
    forward gives ``G_s = sum over both calls``) and handed to ``sink(name, X (B, T, n), D (B, T, m))``.
    Padding tokens (``mask == 0``; shape ``(B, ...)``) get zero rows. The model's parameters and
    ``requires_grad`` flags are never touched: a zero scalar leaf is added to each target output so
    that output gradients exist in a frozen model, and only that leaf is differentiated.
    """

    def __init__(self, model: nn.Module, target: Selector = None, *, types: tuple[type, ...] = (nn.Linear,)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.modules: dict[str, nn.Module] = dict(select(model, target, types))
        self._calls: dict[str, list[list[Tensor | None]]] = {k: [] for k in self.modules}
        self._handles: list[Any] = []
        self._leaf = torch.zeros((), requires_grad=True)
        self._mask: Tensor | None = None
        self.sink: Callable[[str, Tensor, Tensor], None] | None = None
        self.batches = 0

    @property
    def names(self) -> list[str]:
        return list(self.modules)

    def dims(self) -> dict[str, tuple[int, int]]:
        out = {}
        for k, mod in self.modules.items():
            m, n = getattr(mod, "out_features", None), getattr(mod, "in_features", None)
            if not isinstance(m, int) or not isinstance(n, int):
                raise TypeError(f"layer {k!r} ({type(mod).__name__}) has no in_features/out_features")
            out[k] = (m, n)
        return out

    def __enter__(self) -> "PerSampleGradientCollector":
        for k, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(self._hook(k)))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._handles:
            self._handles.pop().remove()
        for k in self._calls:
            self._calls[k] = []

    def _hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None or not isinstance(output, torch.Tensor):
                raise TypeError(f"layer {name!r} must take and return tensors to collect per-sample gradients")
            slot: list[Tensor | None] = [x.detach(), None]
            self._calls[name].append(slot)
            out = output + self._leaf  # exact (+0); gives dL/dy even when nothing requires grad

            def grad_hook(g: Tensor) -> None:
                slot[1] = g.detach()

            out.register_hook(grad_hook)
            return out
        return hook

    def run(self, batch: Any, *, loss_fn: Callable[[Any, Any], Tensor] | None = None,
            forward: Callable[[nn.Module, Any], Any] | None = None, mask: Any = "auto") -> None:
        """Forward + backward of one batch, then hand the per-sample factors of every layer to ``sink``."""
        if not self._handles:
            raise RuntimeError("use the collector as a context manager: `with PerSampleGradientCollector(...) as c:`")
        fwd = forward or default_forward
        if isinstance(mask, str):
            if mask != "auto":
                raise ValueError(f"mask must be 'auto', None, a tensor or a callable, got {mask!r}")
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        elif callable(mask):
            mask = mask(batch)
        for k in self._calls:
            self._calls[k] = []
        try:
            with torch.enable_grad():
                out = fwd(self.model, batch)
                loss = _loss(out, batch, loss_fn)
                if not bool(torch.isfinite(loss.detach())):
                    raise NumericalError(f"calibration loss is not finite ({float(loss.detach()):.3g}) at batch "
                                         f"{self.batches}")
                if loss.requires_grad:
                    torch.autograd.grad(loss, [self._leaf], allow_unused=True)
            self._flush(mask)
        finally:
            for k in self._calls:
                self._calls[k] = []
        self.batches += 1

    def _flush(self, mask: Tensor | None) -> None:
        for k, calls in self._calls.items():
            parts_x, parts_d = [], []
            for x, g in calls:
                if g is None:  # this call's output did not influence the loss
                    continue
                B = x.shape[0] if x.ndim >= 2 else 1
                X = x.reshape(B, -1, x.shape[-1])
                Dg = g.reshape(B, -1, g.shape[-1])
                if mask is not None and mask.numel() == X.shape[0] * X.shape[1]:
                    keep = (mask.reshape(B, -1) != 0).to(X.dtype).unsqueeze(-1)
                    X, Dg = X * keep, Dg * keep.to(Dg.dtype)
                parts_x.append(X)
                parts_d.append(Dg)
            if not parts_x:
                continue
            if len({p.shape[0] for p in parts_x}) > 1:
                raise ValueError(f"layer {k!r}: calls within one batch have different batch sizes; cannot "
                                 "group tokens per sample")
            X = torch.cat(parts_x, 1) if len(parts_x) > 1 else parts_x[0]
            Dg = torch.cat(parts_d, 1) if len(parts_d) > 1 else parts_d[0]
            if self.sink is not None:
                self.sink(k, X, Dg)


def _loss(out: Any, batch: Any, loss_fn: Callable | None) -> Tensor:
    if loss_fn is not None:
        loss = loss_fn(out, batch)
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    elif isinstance(out, torch.Tensor) and out.ndim == 0:
        loss = out
    else:
        raise ValueError("GFWSVD needs a task loss for its gradients: pass loss_fn(output, batch) -> scalar, "
                         "or use a model that returns .loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss.reshape(())


class _RecomputeOperator(_Operator):
    """MFF half-steps computed by re-running the calibration data (memory ``O(m^2 + n^2)`` per layer)."""

    def __init__(self, col: PerSampleGradientCollector, batches: Sequence[Any], run_kw: dict[str, Any],
                 compute_dtype: torch.dtype = torch.float64):
        self.col, self.batches, self.run_kw = col, batches, run_kw
        self.compute_dtype = compute_dtype

    def _pass(self, mats: Mapping[str, Tensor], which: str) -> dict[str, Tensor]:
        acc: dict[str, Tensor] = {}

        def sink(k: str, X: Tensor, Dg: Tensor) -> None:
            if k not in mats:
                return
            sf = SampleFactors(X.shape[-1], Dg.shape[-1], name=k, compute_dtype=self.compute_dtype)
            sf.add(X, Dg)
            v = sf.p_step(mats[k]) if which == "p" else sf.q_step(mats[k])
            acc[k] = v if k not in acc else acc[k] + v

        self.col.sink = sink
        for b in self.batches:
            self.col.run(b, **self.run_kw)
        return acc

    def p_step(self, Q: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self._pass(Q, "p")

    def q_step(self, P: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self._pass(P, "q")


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class GFWSVDConfig:
    """GFWSVD settings (spec defaults).

    Attributes:
        param_ratio: fraction of each target layer's parameters KEPT, ``rho`` in ``(0, 1]``; the uniform
            rank is ``floor(rho m n / (m + n))`` (0.8 = the paper's "20% compression").
        power_iters: ``T``, MFF power iterations (10).
        tol: early stop when the relative change of ``P`` falls below it (1e-6).
        damping: relative floor ``lam = damping * mean(diag)`` for ``P`` and ``Q`` (1e-4), x10 per failed
            Cholesky, at most ``damping_retries`` (5) times.
        rank_multiple: ranks rounded down to a multiple of it (1 = no rounding; 8 = the official
            pipeline's hardware-friendly rounding), at least 1.
        approximation: ``"mff"`` (nearest Kronecker product, the method) or ``"kfac"`` (the K-FAC ablation
            ``P = E[x x^T]``, ``Q = E[delta delta^T]``).
        storage: ``"tokens"`` keeps each sample's ``(X_s, D_s)`` (one backward pass; memory
            ``O(tokens (m + n))`` per layer) or ``"recompute"`` re-runs the data for every half-step
            (``2 T + 1`` passes; memory ``O(m^2 + n^2)``; needs re-iterable calibration data).
        layers_per_pass: with ``"tokens"``, collect at most this many layers per backward pass (``None``
            = all at once) to bound memory.
        targets: module-name patterns to compress (``None`` = every ``nn.Linear`` the selector allows).
        compute_dtype: dtype of the MFF contractions (float64; float32 halves their time on CPU); the
            sums over chunks of samples and the factors are float64 either way.
    """

    param_ratio: float = 0.8
    power_iters: int = 10
    tol: float = 1e-6
    damping: float = 1e-4
    damping_retries: int = 5
    rank_multiple: int = 1
    approximation: FactorKind = "mff"
    storage: Storage = "tokens"
    layers_per_pass: int | None = None
    targets: tuple[str, ...] | None = None
    compute_dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        if not (isinstance(self.compute_dtype, torch.dtype) and self.compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype={self.compute_dtype!r} must be a floating torch.dtype")
        gfwsvd_rank(2, 2, self.param_ratio, self.rank_multiple)  # validates both
        _check_iters(self.power_iters, self.tol)
        for nm in ("damping",):
            v = getattr(self, nm)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
                raise ValueError(f"{nm}={v!r} must be a finite number >= 0")
        if isinstance(self.damping_retries, bool) or not isinstance(self.damping_retries, int) or self.damping_retries < 0:
            raise ValueError(f"damping_retries={self.damping_retries!r} must be an int >= 0")
        if self.approximation not in ("mff", "kfac"):
            raise ValueError(f"approximation={self.approximation!r} must be 'mff' or 'kfac'")
        if self.storage not in ("tokens", "recompute"):
            raise ValueError(f"storage={self.storage!r} must be 'tokens' or 'recompute'")
        lpp = self.layers_per_pass
        if lpp is not None and (isinstance(lpp, bool) or not isinstance(lpp, int) or lpp < 1):
            raise ValueError(f"layers_per_pass={lpp!r} must be None or an int >= 1")
        if self.targets is not None:
            if isinstance(self.targets, str):
                object.__setattr__(self, "targets", (self.targets,))
            elif not all(isinstance(t, str) for t in self.targets) or not self.targets:
                raise ValueError(f"targets={self.targets!r} must be None or a non-empty sequence of name patterns")
            else:
                object.__setattr__(self, "targets", tuple(self.targets))

    def rank(self, m: int, n: int) -> int:
        """The uniform rank of an ``m x n`` layer under this config."""
        return gfwsvd_rank(m, n, self.param_ratio, self.rank_multiple)

    def method_options(self) -> dict[str, Any]:
        """The fields that configure :class:`GFWSVDMethod` (everything but the targets)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "targets"}

    def to_compress_config(self) -> Any:
        """The equivalent :class:`~rankwise.compress.pipeline.CompressConfig` (the method's own rank rule)."""
        from rankwise.compress.pipeline import CompressConfig

        return CompressConfig(method="gfwsvd", ratio=self.param_ratio,
                              allocation="method" if self.rank_multiple > 1 else "uniform",
                              options=self.method_options())


# ----------------------------------------------------------------------------------------------
# collecting the factors of a model


def collect_kronecker_fisher(
    model: nn.Module,
    calib: Iterable[Any],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    config: GFWSVDConfig | None = None,
    *,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    row_fisher: bool = True,
) -> dict[str, KroneckerFactors]:
    """Kronecker-factored Fisher ``(P, Q)`` of every target linear layer, by MFF (or K-FAC).

    Args:
        model: any module; it is put in eval mode for the duration (flags restored) and never modified.
        calib: batches (``dict`` -> ``model(**batch)``, tuple -> ``model(*batch)``, or ``forward(model, batch)``).
            ``storage="recompute"`` needs a re-iterable (e.g. a list), not a one-shot generator.
        loss_fn: ``loss_fn(output, batch) -> scalar``, the task loss whose per-sample gradients define
            the Fisher (default: ``output.loss``). Its scale does not matter (``P kron Q`` scales, the
            compression does not).
        config: :class:`GFWSVDConfig` (``power_iters``, ``tol``, ``approximation``, ``storage``, ...).
        target: selector of the layers; default ``config.targets`` or every ``nn.Linear``.
        mask: token mask of each batch (``"auto"`` = its ``attention_mask``).
        row_fisher: also compute FWSVD's row Fisher from the same per-sample gradients.
    Returns:
        ``{layer name: KroneckerFactors}`` in model order.
    Raises:
        CalibrationError: empty ``calib``, a layer no gradient reached, or an all-zero Fisher.
    """
    cfg = config or GFWSVDConfig()
    sel = target if target is not None else (list(cfg.targets) if cfg.targets else None)
    col = PerSampleGradientCollector(model, sel)
    dims = col.dims()
    run_kw = dict(loss_fn=loss_fn, forward=forward, mask=mask)
    if cfg.storage == "recompute":
        if iter(calib) is calib:  # type: ignore[comparison-overlap]
            raise ValueError("storage='recompute' re-runs the calibration data 2T+1 times; pass a list (or any "
                             "re-iterable), not a one-shot iterator")
        batches: Sequence[Any] = calib if isinstance(calib, Sequence) else list(calib)
    else:
        batches = calib if isinstance(calib, Sequence) else list(calib)
    if len(batches) == 0:
        raise CalibrationError("the calibration data is empty: `calib` yielded no batch")
    names = col.names
    out: dict[str, KroneckerFactors] = {}
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with col:
            if cfg.storage == "tokens":
                step = cfg.layers_per_pass or len(names)
                for i in range(0, len(names), step):
                    samples = _collect_samples(col, names[i:i + step], dims, batches, run_kw, cfg.compute_dtype)
                    out.update(_factors_from_samples(samples, cfg, row_fisher))
            else:
                out.update(_recompute(col, batches, run_kw, dims, cfg, row_fisher))
    finally:
        for mod, f in flags.items():
            mod.training = f
    return {k: out[k] for k in names}


def _collect_samples(col: PerSampleGradientCollector, group: Sequence[str], dims: Mapping[str, tuple[int, int]],
                     batches: Sequence[Any], run_kw: dict[str, Any], compute_dtype: torch.dtype
                     ) -> dict[str, SampleFactors]:
    """One forward + backward of every batch, keeping the per-sample ``(X_s, D_s)`` of the layers in ``group``."""
    samples = {k: SampleFactors(dims[k][1], dims[k][0], name=k, compute_dtype=compute_dtype) for k in group}

    def sink(k: str, X: Tensor, Dg: Tensor) -> None:
        if k in samples:
            samples[k].add(X, Dg)

    col.sink = sink
    for b in batches:
        col.run(b, **run_kw)
    _check_reached(samples)
    return samples


def collect_sample_factors(
    model: nn.Module,
    calib: Iterable[Any],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    compute_dtype: torch.dtype = torch.float64,
) -> dict[str, SampleFactors]:
    """The per-sample gradient factors ``(X_s, D_s)`` of every target linear, from ONE backward pass per batch.

    The shared-pass entry point: the returned :class:`SampleFactors` give GFWSVD's factors
    (:func:`factors_from_samples`), the K-FAC ablation (``approximation="kfac"``), FWSVD's row Fisher
    (:meth:`SampleFactors.row_fisher`) and the forward statistics of the same tokens
    (:func:`layer_stats_from_samples`, e.g. SVD-LLM(W)'s ``X^T X``) without re-running the data.
    Arguments as in :func:`collect_kronecker_fisher` (``compute_dtype``: dtype of the later MFF
    contractions). Memory ``O(tokens (m + n))`` per layer. Returns ``{layer name: SampleFactors}`` in
    model order; raises :class:`CalibrationError` for empty data or a layer no gradient reached.
    """
    if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype={compute_dtype!r} must be a floating torch.dtype")
    col = PerSampleGradientCollector(model, target)
    dims = col.dims()
    batches = calib if isinstance(calib, Sequence) else list(calib)
    if len(batches) == 0:
        raise CalibrationError("the calibration data is empty: `calib` yielded no batch")
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with col:
            return _collect_samples(col, col.names, dims, batches, dict(loss_fn=loss_fn, forward=forward, mask=mask),
                                    compute_dtype)
    finally:
        for mod, f in flags.items():
            mod.training = f


def factors_from_samples(samples: Mapping[str, SampleFactors], config: GFWSVDConfig | None = None, *,
                         row_fisher: bool = True) -> dict[str, KroneckerFactors]:
    """GFWSVD's Kronecker factors (MFF, or K-FAC with ``approximation="kfac"``) of collected samples.

    Equal to :func:`collect_kronecker_fisher` with ``storage="tokens"`` on the same data (the MFF
    contractions run in each :class:`SampleFactors`' ``compute_dtype``); ``row_fisher`` adds FWSVD's
    row Fisher from the same per-sample gradients. The samples can serve several configs.
    """
    cfg = config or GFWSVDConfig()
    if not isinstance(cfg, GFWSVDConfig):
        raise TypeError(f"config must be a GFWSVDConfig, got {type(cfg).__name__}")
    if not samples:
        raise ValueError("samples is empty: collect them with collect_sample_factors(...) first")
    bad = [k for k, s in samples.items() if not isinstance(s, SampleFactors)]
    if bad:
        raise TypeError(f"samples must map layer names to SampleFactors; not for {bad[:5]}")
    _check_reached(samples)
    return _factors_from_samples(samples, cfg, row_fisher)


def layer_stats_from_samples(samples: Mapping[str, SampleFactors]) -> dict[str, LayerStats]:
    """:class:`~rankwise.core.stats.LayerStats` with the ``"input_cov"`` and ``"input_abs_mean"`` sums of the
    kept tokens (those with a non-zero output gradient; with a token mask and a loss that reaches every
    token, exactly the non-padding tokens), so that activation-based baselines (SVD-LLM(W), ASVD,
    the pipeline's output-error report) share GFWSVD's one pass over the calibration data."""
    out = {}
    for k, s in samples.items():
        xtx, abs_sum, count = s.input_sums()
        out[k] = LayerStats(name=k, in_features=s.n, out_features=s.m, n_tokens=count, xtx=xtx, x_abs_sum=abs_sum)
    return out


def _check_reached(samples: Mapping[str, SampleFactors]) -> None:
    silent = [k for k, s in samples.items() if s.samples == 0]
    if silent:
        raise CalibrationError(f"no gradient reached {len(silent)} target layer(s): {silent[:10]} (frozen branch, "
                               "unused layer, or a loss that does not depend on them)")
    S = next(iter(samples.values())).samples
    if S < 2:
        warnings.warn(f"only {S} calibration sample: the empirical Fisher is rank-deficient; use more samples",
                      RuntimeWarning, stacklevel=3)


def _factors_from_samples(samples: Mapping[str, SampleFactors], cfg: GFWSVDConfig, row_fisher: bool
                          ) -> dict[str, KroneckerFactors]:
    if cfg.approximation == "kfac":
        res = {k: kfac_from_samples(s) for k, s in samples.items()}
    else:
        res = _mff_samples(samples, cfg.power_iters, cfg.tol)
    if row_fisher:
        for k, s in samples.items():
            res[k].row_fisher = s.row_fisher() / s.samples
    return res


def _recompute(col: PerSampleGradientCollector, batches: Sequence[Any], run_kw: dict[str, Any],
               dims: Mapping[str, tuple[int, int]], cfg: GFWSVDConfig, row_fisher: bool) -> dict[str, KroneckerFactors]:
    counts = {k: 0 for k in dims}
    rows = {k: torch.zeros(dims[k][0], dtype=torch.float64) for k in dims}
    kfac = {k: [torch.zeros(dims[k][1], dims[k][1], dtype=torch.float64),
                torch.zeros(dims[k][0], dims[k][0], dtype=torch.float64), 0] for k in dims}

    def sink(k: str, X: Tensor, Dg: Tensor) -> None:  # pass 0: counts, row Fisher, K-FAC sums
        sf = SampleFactors(X.shape[-1], Dg.shape[-1], name=k)
        sf.add(X, Dg)
        counts[k] += sf.samples
        if row_fisher:
            rows[k] += sf.row_fisher()
        if cfg.approximation == "kfac":
            A, G, c = sf.kfac()
            kfac[k][0] += A
            kfac[k][1] += G
            kfac[k][2] += c

    col.sink = sink
    for b in batches:
        col.run(b, **run_kw)
    silent = [k for k, c in counts.items() if c == 0]
    if silent:
        raise CalibrationError(f"no gradient reached {len(silent)} target layer(s): {silent[:10]}")
    if min(counts.values()) < 2:
        warnings.warn(f"only {min(counts.values())} calibration sample: the empirical Fisher is rank-deficient; use "
                      "more samples", RuntimeWarning, stacklevel=3)
    if cfg.approximation == "kfac":
        res = {k: KroneckerFactors(P=kfac[k][0] / kfac[k][2], Q=kfac[k][1] / kfac[k][2], samples=counts[k], kind="kfac")
               for k in dims}
    else:
        res = _mff(_RecomputeOperator(col, batches, run_kw, cfg.compute_dtype), dims, counts, cfg.power_iters, cfg.tol)
    if row_fisher:
        for k in dims:
            res[k].row_fisher = rows[k] / counts[k]
    return res


# ----------------------------------------------------------------------------------------------
# saving and loading factors (safetensors + JSON metadata)


def save_factors(factors: Mapping[str, KroneckerFactors], path: Any) -> Any:
    """Save ``{name: KroneckerFactors}`` to a safetensors file atomically (re-use for other ratios)."""
    from rankwise.core import io

    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {}
    for k, f in factors.items():
        tensors[f"{k}::P"] = f.P.contiguous()
        tensors[f"{k}::Q"] = f.Q.contiguous()
        if f.row_fisher is not None:
            tensors[f"{k}::row_fisher"] = f.row_fisher.contiguous()
        meta[k] = {"sigma": f.sigma if math.isfinite(f.sigma) else None, "samples": f.samples, "iters": f.iters,
                   "converged": f.converged, "kind": f.kind}
    return io.save_tensors(path, tensors, metadata={"kind": "gfwsvd-kronecker-factors", "layers": meta})


def load_factors(path: Any) -> dict[str, KroneckerFactors]:
    """Load factors written by :func:`save_factors` (validating shapes and metadata)."""
    from rankwise.core import io
    from rankwise.core.errors import ArtifactError

    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != "gfwsvd-kronecker-factors":
        raise ArtifactError(f"{path} does not hold GFWSVD Kronecker factors (kind={meta.get('kind')!r})")
    out: dict[str, KroneckerFactors] = {}
    for k, info in meta.get("layers", {}).items():
        try:
            P, Q = tensors[f"{k}::P"], tensors[f"{k}::Q"]
        except KeyError:
            raise ArtifactError(f"{path}: factors of layer {k!r} are missing") from None
        if P.ndim != 2 or P.shape[0] != P.shape[1] or Q.ndim != 2 or Q.shape[0] != Q.shape[1]:
            raise ArtifactError(f"{path}: factors of layer {k!r} are not square matrices")
        sigma = info.get("sigma")
        out[k] = KroneckerFactors(P=P, Q=Q, sigma=float("nan") if sigma is None else float(sigma),
                                  samples=int(info.get("samples", 0)), iters=int(info.get("iters", 0)),
                                  converged=bool(info.get("converged", False)), kind=str(info.get("kind", "mff")),
                                  row_fisher=tensors.get(f"{k}::row_fisher"))
    return out


# ----------------------------------------------------------------------------------------------
# the per-layer method and the in-place entry point


@register_layer_method
class GFWSVDMethod(LayerMethod):
    """GFWSVD as a per-layer method of the shared pipeline (``compress(..., method="gfwsvd")``).

    The Kronecker factors are whole-model statistics (one backward of a task loss through every
    target), so they are collected once by :meth:`prepare` (or given as ``factors=``) before the
    layers are fitted; ``feed = "original"`` (gradients of the unmodified model).
    """

    name = "gfwsvd"
    needs = ()
    feed = "original"
    paired = False
    needs_grad = True

    def __init__(self, config: GFWSVDConfig | None = None, factors: Mapping[str, KroneckerFactors] | None = None,
                 **overrides: Any):
        if config is not None and not isinstance(config, GFWSVDConfig):
            raise TypeError(f"config must be a GFWSVDConfig, got {type(config).__name__}")
        cfg = config or GFWSVDConfig()
        if overrides:
            from dataclasses import replace

            unknown = sorted(set(overrides) - set(GFWSVDConfig.__dataclass_fields__))
            if unknown:
                raise TypeError(f"unknown GFWSVD option(s) {unknown}; valid: {sorted(GFWSVDConfig.__dataclass_fields__)}")
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self.factors: dict[str, KroneckerFactors] = dict(factors or {})
        self._info: dict[str, Any] = {}

    def rank_for(self, m: int, n: int) -> int:
        return self.config.rank(m, n)

    def prepare(self, model: nn.Module, calib: Iterable[Any], *, target: Selector = None,
                loss_fn: Callable[[Any, Any], Tensor] | None = None,
                forward: Callable[[nn.Module, Any], Any] | None = None, mask: Any = "auto") -> None:
        """Collect the factors of the targets (skipping layers whose factors were given)."""
        if isinstance(target, (list, tuple)) and all(isinstance(t, str) for t in target):
            wanted = {t for t in target if t not in self.factors}
            if not wanted:
                return
            target = lambda n, m, _w=frozenset(wanted): n in _w  # noqa: E731  (exact names, no pattern matching)
        fac = collect_kronecker_fisher(model, calib, loss_fn, self.config, target=target, forward=forward, mask=mask)
        for k, v in fac.items():
            self.factors.setdefault(k, v)

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        if name not in self.factors:
            raise CalibrationError(f"GFWSVD has no Kronecker factors for layer {name!r}: collect them with "
                                   "collect_kronecker_fisher(...) / GFWSVDMethod.prepare(...) on a task loss first")
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, GFWSVD compresses nn.Linear layers")
        kf = self.factors[name]
        t0 = time.perf_counter()
        W = layer.weight.detach().to(torch.float64)
        m, n = W.shape
        if kf.P.shape != (n, n) or kf.Q.shape != (m, m):
            raise ValueError(f"need P {n}x{n} and Q {m}x{m} for W {m}x{n}{_where(name)}, got P {tuple(kf.P.shape)}, "
                             f"Q {tuple(kf.Q.shape)}")
        check_finite(W, "weight W", name)
        # one pair of damped Cholesky factors serves the closed form (= gfwsvd_factors) and the predicted increase
        L_P, L_Q = kronecker_whiteners(kf.P.to(W), kf.Q.to(W), damping=self.config.damping,
                                       retries=self.config.damping_retries, name=name)
        f = weighted_lowrank_factors(W, rank, left=L_Q.mT, right=L_P, dtype=torch.float64, name=name)
        B, A = f.B.to(torch.float64), f.A.to(torch.float64)
        resid = L_Q.mT @ W @ L_P - (L_Q.mT @ A) @ (B @ L_P)  # L_Q^T (W - A B) L_P, in factored form
        self._info = {"predicted_loss_increase": 0.5 * float(resid.square().sum()),
                      "mff_iters": kf.iters, "mff_converged": kf.converged, "samples": kf.samples,
                      "factor_kind": kf.kind, "seconds": time.perf_counter() - t0}
        return f

    def info(self) -> dict[str, Any]:
        return dict(self._info)


def _is_factor_map(x: Any) -> bool:
    return isinstance(x, Mapping) and bool(x) and all(isinstance(v, KroneckerFactors) for v in x.values())


def gfwsvd_compress(
    model: nn.Module,
    factors_or_calib: Mapping[str, KroneckerFactors] | Iterable[Any],
    config: GFWSVDConfig | None = None,
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    ranks: Mapping[str, int] | None = None,
    progress: bool = False,
) -> Any:
    """Compress ``model`` in place with GFWSVD; returns a :class:`~rankwise.compress.base.CompressionReport`.

    Two ways to call it:

    * ``gfwsvd_compress(model, factors, config)`` with ``factors`` from :func:`collect_kronecker_fisher`
      (or :func:`load_factors`): every layer named in ``factors`` is replaced by its GFWSVD
      ``LowRankLinear`` (all or nothing); the same factors serve any ratio. ``ranks`` overrides the
      uniform rank per layer (e.g. an ASVD-style sensitivity allocation).
    * ``gfwsvd_compress(model, calib, config, loss_fn=...)``: the shared pipeline
      (:func:`rankwise.compress.pipeline.compress`) collects the factors (one backward pass of the
      task loss, :meth:`GFWSVDMethod.prepare`) and the input covariances used to report each layer's
      relative output error, then compresses ``target`` (default ``config.targets``, or every linear
      inside the transformer blocks).

    Per-layer ``info`` holds the predicted loss increase ``1/2 ||L_Q^T dW L_P||^2`` and MFF's iterations.
    """
    cfg = config or GFWSVDConfig()
    if not isinstance(cfg, GFWSVDConfig):
        raise TypeError(f"config must be a GFWSVDConfig, got {type(cfg).__name__}")
    if isinstance(factors_or_calib, Mapping) and not factors_or_calib:
        raise ValueError("factors is empty: collect them with collect_kronecker_fisher(...) first")
    if not _is_factor_map(factors_or_calib):
        from dataclasses import replace as _replace

        from rankwise.compress.pipeline import CompressConfig, compress

        cc = cfg.to_compress_config()
        if ranks is not None:
            cc = _replace(cc, allocation=dict(ranks))
        return compress(model, cc, factors_or_calib, target=target if target is not None else cfg.targets,
                        mode="whole", forward=forward, loss_fn=loss_fn, mask=mask, progress=progress)
    factors = factors_or_calib
    from dataclasses import asdict


    from rankwise.compress.base import CompressionReport, LayerReport
    from rankwise.core.layers import LowRankLinear
    from rankwise.core.surgery import count_parameters, get_submodule, replace_module, transaction

    method = GFWSVDMethod(cfg, factors=factors)
    report = CompressionReport(method="gfwsvd", config=asdict(cfg), params_before=count_parameters(model))
    mods = {}
    for name in factors:
        try:
            mod = get_submodule(model, name)
        except AttributeError:
            raise ValueError(f"factors name a layer {name!r} that the model does not have") from None
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"{name!r} is a {type(mod).__name__}, not an nn.Linear")
        mods[name] = mod
    if ranks is not None:
        unknown = sorted(set(ranks) - set(mods))
        if unknown:
            raise ValueError(f"ranks given for layers without factors: {unknown[:5]}")
    t_all = time.perf_counter()
    new: dict[str, nn.Module] = {}
    for name, mod in mods.items():  # fit everything first: a failure leaves the model untouched
        m, n = mod.weight.shape
        r = ranks[name] if ranks is not None and name in ranks else cfg.rank(m, n)
        t0 = time.perf_counter()
        f = method.fit(name, mod, r)
        new[name] = LowRankLinear.from_linear(mod, factors=f)
        report.layers.append(LayerReport(name=name, shape=(m, n), rank=r, params_before=mod.weight.numel() + (
            0 if mod.bias is None else mod.bias.numel()), params_after=sum(p.numel() for p in new[name].parameters()),
            seconds=time.perf_counter() - t0, info=method.info()))
    with transaction(model):
        for name, layer in new.items():
            replace_module(model, name, layer)
    report.seconds_decomposition = time.perf_counter() - t_all
    report.params_after = count_parameters(model)
    return report


register("gfwsvd", config=GFWSVDConfig, entry=gfwsvd_compress)
