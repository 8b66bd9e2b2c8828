"""Quadruplet comparison oracles of the R-model: "is d(a, b) <= d(c, d)?", counted, persistent.

:class:`QuadrupletOracle` is the only access the clustering algorithms have to the metric. It is
built from points (simulation: Euclidean distances + persistent random flips at rate ``phi``), from
a distance matrix, or from any user callable ``compare(a, b, c, d) -> bool`` (an embedding model, an
LLM judge, people). Every call is counted (``num_calls``); distinct quadruplets are counted too when
``n <= 2000`` (or when ``track_distinct=True``).

Persistence (spec §1.1) without a memo: the flip bit of a quadruplet is drawn from a keyed 64-bit
hash (splitmix64 finaliser) of its canonical form, which sorts the points inside each pair and then
the two pairs, and of the seed, so asking the same quadruplet again, in any internal order,
returns the same answer; asking it with the two pairs swapped returns the negation (a consistent
strict order). Ties (equal distances, e.g. duplicate points) are broken by the canonical pair
indices, so the oracle's order on edges is a strict total order.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rankwise.core.errors import RankwiseError

__all__ = ["QuadrupletOracle", "OracleError", "OracleInconsistencyError", "OracleBudgetExceeded",
           "canonical_quadruplets", "keyed_uniform", "validate_error_rate"]

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_CHUNK = 1 << 20


class OracleError(RankwiseError):
    """A user oracle raised or returned something other than a bool; the message names the quadruplet."""


class OracleInconsistencyError(OracleError):
    """A user oracle answered a quadruplet inconsistently (not persistent, or both orientations False)."""


class OracleBudgetExceeded(OracleError):
    """The oracle's ``max_calls`` budget would be exceeded by a request."""


def validate_error_rate(phi: float, name: str = "error") -> float:
    """Check the flip probability ``phi``: error when outside [0, 0.5); warning when >= 1/4 (outside the theory)."""
    if isinstance(phi, bool) or not isinstance(phi, (int, float, np.floating)) or not math.isfinite(phi):
        raise ValueError(f"{name} (the flip probability phi) must be a finite number, got {phi!r}")
    if phi < 0 or phi >= 0.5:
        raise ValueError(f"{name} (the flip probability phi) must be in [0, 0.5), got {phi}")
    if phi >= 0.25:
        warnings.warn(f"{name}={phi} >= 1/4 is outside the R-model theory (phi < 1/4); the guarantees do not "
                      "apply (the paper still tests 0.25)", stacklevel=3)
    return float(phi)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    h = (h ^ (h >> _U64(30))) * _M1
    h = (h ^ (h >> _U64(27))) * _M2
    return h ^ (h >> _U64(31))


def keyed_uniform(seed: int, *cols: np.ndarray) -> np.ndarray:
    """Deterministic uniform [0, 1) floats from a keyed hash of integer columns (same shape)."""
    with np.errstate(over="ignore"):
        h = np.full(np.shape(cols[0]), _mix(np.array([int(seed) & 0xFFFFFFFFFFFFFFFF], dtype=_U64) + _GOLDEN)[0],
                    dtype=_U64)
        for c in cols:
            # add the column times the golden gamma (the SplitMix64 increment), then finalise twice:
            # consecutive integers become well-separated inputs, so nearby keys are uncorrelated
            h = _mix(_mix(h + (np.asarray(c).astype(np.int64).astype(_U64) + _U64(1)) * _GOLDEN))
    return (h >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def canonical_quadruplets(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Canonical form ``(p, q, r, s, swapped)``: ``p <= q``, ``r <= s``, ``(p, q) <= (r, s)``; ``swapped``
    is True where the two pairs were exchanged (the answer is then negated)."""
    p, q = np.minimum(a, b), np.maximum(a, b)
    r, s = np.minimum(c, d), np.maximum(c, d)
    swapped = (p > r) | ((p == r) & (q > s))
    P = np.where(swapped, r, p)
    Q = np.where(swapped, s, q)
    R = np.where(swapped, p, r)
    S = np.where(swapped, q, s)
    return P, Q, R, S, swapped


@dataclass
class QuadrupletOracle:
    """Counted access to "is d(a, b) <= d(c, d)?" on ``n`` items ``0 .. n-1``.

    Build it with :meth:`from_points`, :meth:`from_distances` or :meth:`from_callable`; query it with
    :meth:`compare` (arrays, vectorised) or by calling it on four ints.

    Attributes: ``n``, ``error`` (phi of the simulated persistent noise, 0 for a callable),
    ``num_calls`` (requests), ``num_evaluations`` (callable invocations; cache misses for a callable),
    ``max_calls`` (budget or None).
    """

    n: int
    error: float = 0.0
    seed: int = 0
    max_calls: int | None = None
    track_distinct: bool | None = None
    _points: np.ndarray | None = field(default=None, repr=False)
    _dist: np.ndarray | None = field(default=None, repr=False)
    _fn: Callable[..., Any] | None = field(default=None, repr=False)
    _cache: dict[int, bool] | None = field(default=None, repr=False)
    audit_rate: float = 0.0
    num_calls: int = 0
    num_evaluations: int = 0
    _distinct_parts: list[np.ndarray] = field(default_factory=list, repr=False)
    _distinct_len: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, (int, np.integer)) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        self.n = int(self.n)
        self.error = validate_error_rate(self.error)
        if self.max_calls is not None and (not isinstance(self.max_calls, (int, np.integer)) or self.max_calls < 0):
            raise ValueError(f"max_calls must be None or an int >= 0, got {self.max_calls!r}")
        if not (0.0 <= float(self.audit_rate) <= 1.0):
            raise ValueError(f"audit_rate must be in [0, 1], got {self.audit_rate}")
        if self.track_distinct is None:
            self.track_distinct = self.n <= 2000
        if self.track_distinct and self.n > 55_000:
            raise ValueError("track_distinct needs n**4 < 2**63, i.e. n <= 55000")
        self._rng = np.random.default_rng([int(self.seed) & 0xFFFFFFFF, 7])

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_points(cls, X: Any, error: float = 0.0, seed: int = 0, **kw: Any) -> "QuadrupletOracle":
        """Simulated oracle on the Euclidean distances of the rows of ``X`` (n, dim), persistent flips at rate ``error``."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[0] < 1:
            raise ValueError(f"X must have shape (n, dim) with n >= 1, got {X.shape}")
        if not np.all(np.isfinite(X)):
            raise ValueError("X contains non-finite coordinates")
        return cls(n=X.shape[0], error=error, seed=seed, _points=X, **kw)

    @classmethod
    def from_distances(cls, D: Any, error: float = 0.0, seed: int = 0, **kw: Any) -> "QuadrupletOracle":
        """Simulated oracle on a symmetric distance matrix ``D`` (n, n), persistent flips at rate ``error``."""
        D = np.asarray(D, dtype=np.float64)
        if D.ndim != 2 or D.shape[0] != D.shape[1]:
            raise ValueError(f"D must be a square (n, n) matrix, got {D.shape}")
        if not np.all(np.isfinite(D)) or np.any(D < 0):
            raise ValueError("D must contain finite, nonnegative distances")
        if not np.allclose(D, D.T):
            raise ValueError("D must be symmetric")
        return cls(n=D.shape[0], error=error, seed=seed, _dist=D, **kw)

    @classmethod
    def from_callable(cls, compare: Callable[[int, int, int, int], bool], n: int, *, cache: bool = True,
                      audit_rate: float = 0.0, max_calls: int | None = None, seed: int = 0,
                      track_distinct: bool | None = None) -> "QuadrupletOracle":
        """Wrap ``compare(a, b, c, d) -> bool`` ("is d(a,b) <= d(c,d)?").

        ``cache=True`` memoises answers by canonical quadruplet, which makes any judge persistent (the
        R-model's assumption) and saves evaluations; ``audit_rate`` re-asks that fraction of cache hits
        (half of them with the pairs swapped) and raises :class:`OracleInconsistencyError` when the
        judge contradicts itself. A judge that returns a non-bool or raises makes every query raise
        :class:`OracleError` naming the quadruplet.
        """
        if not callable(compare):
            raise TypeError(f"compare must be callable, got {type(compare).__name__}")
        return cls(n=n, error=0.0, seed=seed, _fn=compare, _cache={} if cache else None, audit_rate=audit_rate,
                   max_calls=max_calls, track_distinct=track_distinct)

    @property
    def has_coordinates(self) -> bool:
        return self._points is not None

    # ------------------------------------------------------------------ queries
    def __call__(self, a: int, b: int, c: int, d: int) -> bool:
        return bool(self.compare(np.array([a]), np.array([b]), np.array([c]), np.array([d]))[0])

    def compare(self, a: Any, b: Any, c: Any, d: Any) -> np.ndarray:
        """Vectorised "d(a,b) <= d(c,d)?" for integer arrays of one shape; returns a bool array."""
        a, b, c, d = (np.asarray(v, dtype=np.int64) for v in (a, b, c, d))
        shape = np.broadcast_shapes(a.shape, b.shape, c.shape, d.shape)
        a, b, c, d = (np.broadcast_to(v, shape).ravel() for v in (a, b, c, d))
        m = a.size
        if m == 0:
            return np.zeros(shape, dtype=bool)
        for v in (a, b, c, d):
            if v.min() < 0 or v.max() >= self.n:
                raise IndexError(f"oracle items must be in [0, {self.n - 1}], got values in [{v.min()}, {v.max()}]")
        if self.max_calls is not None and self.num_calls + m > self.max_calls:
            raise OracleBudgetExceeded(f"oracle budget max_calls={self.max_calls} exceeded: {self.num_calls} "
                                       f"calls made, {m} more requested")
        P, Q, R, S, swapped = canonical_quadruplets(a, b, c, d)
        out = np.empty(m, dtype=bool)
        for lo in range(0, m, _CHUNK):
            sl = slice(lo, lo + _CHUNK)
            out[sl] = self._answer_canonical(P[sl], Q[sl], R[sl], S[sl])
        same = (P == R) & (Q == S)
        out = np.where(same, True, np.where(swapped, ~out, out))
        self.num_calls += m
        if self.track_distinct:
            n = self.n
            keys = ((P * n + Q) * n + R) * n + S
            self._distinct_parts.append(keys)
            self._distinct_len += keys.size
            self._compacted = False
            if self._distinct_len > 8_000_000:
                self._compact()
        return out.reshape(shape)

    def _compact(self) -> None:
        if len(self._distinct_parts) == 1 and getattr(self, "_compacted", False):
            return
        a = np.sort(np.concatenate(self._distinct_parts)) if self._distinct_parts else np.zeros(0, np.int64)
        u = a[np.r_[True, a[1:] != a[:-1]]] if a.size else a
        self._distinct_parts = [u]
        self._distinct_len = u.size
        self._compacted = True

    @property
    def num_distinct(self) -> int | None:
        """Number of distinct quadruplets asked (None when not tracked)."""
        if not self.track_distinct:
            return None
        self._compact()
        return self._distinct_len

    def reset_counts(self) -> None:
        self.num_calls = 0
        self.num_evaluations = 0
        self._distinct_parts = []
        self._distinct_len = 0

    def _dist2(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Distances of the pairs (squared for points: same order). Points with n <= 2500 get a cached
        (n, n) table of squared distances on first use (<= 50 MB); larger n computes on the fly."""
        if self._dist is not None:
            return self._dist[i, j]
        X = self._points
        assert X is not None
        if X.shape[0] <= 2500:
            if getattr(self, "_sq", None) is None:
                n, dim = X.shape
                D2 = np.empty((n, n))
                rows = max(1, (1 << 22) // max(1, n * dim))
                for lo in range(0, n, rows):  # exact differences (no Gram-matrix cancellation)
                    diff = X[lo:lo + rows, None, :] - X[None, :, :]
                    D2[lo:lo + rows] = np.einsum("abk,abk->ab", diff, diff)
                self._sq = D2
            return self._sq[i, j]
        diff = X[i] - X[j]
        return np.einsum("ij,ij->i", diff, diff)  # squared: same order as the distance

    def _answer_canonical(self, P: np.ndarray, Q: np.ndarray, R: np.ndarray, S: np.ndarray) -> np.ndarray:
        """Answer in canonical orientation ((P,Q) <= (R,S) lexicographically)."""
        if self._fn is not None:
            return self._ask_callable(P, Q, R, S)
        self.num_evaluations += P.size
        d1, d2 = self._dist2(P, Q), self._dist2(R, S)
        truth = d1 <= d2  # ties -> True: (P,Q) precedes (R,S) in the tie-break order
        if self.error > 0:
            n = self.n
            if n <= 55_000:  # one int64 key for the canonical quadruplet (n**4 < 2**63)
                flip = keyed_uniform(self.seed, ((P * n + Q) * n + R) * n + S) < self.error
            else:
                flip = keyed_uniform(self.seed, P, Q, R, S) < self.error
            truth = truth ^ flip
        return truth

    def _call_user(self, a: int, b: int, c: int, d: int) -> bool:
        try:
            ans = self._fn(a, b, c, d)  # type: ignore[misc]
        except Exception as e:
            raise OracleError(f"the oracle raised on quadruplet ({a}, {b}, {c}, {d}): {type(e).__name__}: {e}") from e
        if not isinstance(ans, (bool, np.bool_)):
            raise OracleError(f"the oracle must return a bool for quadruplet ({a}, {b}, {c}, {d}), got "
                              f"{type(ans).__name__} {ans!r}")
        self.num_evaluations += 1
        return bool(ans)

    def _ask_callable(self, P: np.ndarray, Q: np.ndarray, R: np.ndarray, S: np.ndarray) -> np.ndarray:
        out = np.empty(P.size, dtype=bool)
        n = self.n
        for i, (p, q, r, s) in enumerate(zip(P.tolist(), Q.tolist(), R.tolist(), S.tolist())):
            if p == r and q == s:
                out[i] = True
                continue
            if self._cache is None:
                out[i] = self._call_user(p, q, r, s)
                continue
            key = ((p * n + q) * n + r) * n + s
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = self._call_user(p, q, r, s)
            elif self.audit_rate > 0 and self._rng.random() < self.audit_rate:
                if self._rng.random() < 0.5:
                    again = self._call_user(p, q, r, s)
                    if again != hit:
                        raise OracleInconsistencyError(
                            f"the oracle is not persistent: quadruplet ({p}, {q}, {r}, {s}) answered {hit} then {again}")
                else:
                    rev = self._call_user(r, s, p, q)
                    if not hit and not rev:
                        raise OracleInconsistencyError(
                            f"the oracle is inconsistent: both d({p},{q}) <= d({r},{s}) and d({r},{s}) <= d({p},{q}) "
                            "were answered False, which no metric allows")
            out[i] = hit
        return out
