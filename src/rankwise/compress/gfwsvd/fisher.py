"""The Kronecker-factored Fisher of one layer: per-sample factors ``(X_s, D_s)``, MFF and K-FAC.

``F ~ P kron Q`` found matrix-free by the power iteration of the package docstring (MFF), from
per-sample gradient factors ``G_s = D_s^T X_s`` that are never formed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from rankwise.core.errors import NumericalError
from rankwise.core.stats import CalibrationError

Tensor = torch.Tensor

__all__ = ["KroneckerFactors", "SampleFactors", "explicit_fisher", "nearest_kronecker_fisher", "mff",
           "mff_from_gradients", "kfac_from_samples"]


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
