"""Two-player zero-sum normal-form games ``min_x max_y x^T A y`` solved by self-play of regret minimisers.

Player x (rows) observes the loss ``A y``, player y (columns) the loss ``-A^T x``. The metric is the
duality gap of the average strategies, ``gap(x̄, ȳ) = max_j (A^T x̄)_j - min_i (A ȳ)_i`` (>= 0, = 0 at
a Nash equilibrium; the NashConv of the pair). A batch of games ``A`` of shape ``(G, m, n)`` is
solved in one vectorised run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_choice, check_int
from rankwise.science.mi_sprm.regret import MISPRMPlus, RegretAlgorithm, _MISPRMPlus

__all__ = ["duality_gap", "solve_matrix_game", "MatrixGameResult", "fit_loglog_slope", "log_schedule",
           "as_payoff_matrix"]

Averaging = Literal["uniform", "linear", "quadratic"]
_AVG_POWER = {"uniform": 0, "linear": 1, "quadratic": 2}


def as_payoff_matrix(A: object) -> np.ndarray:
    """Validate and convert a payoff matrix (numpy array, torch tensor or nested list) to float64.

    Shape ``(m, n)`` or a batch ``(G, m, n)``; entries finite; ``m, n >= 1``.
    """
    try:
        import torch

        if isinstance(A, torch.Tensor):
            A = A.detach().cpu().double().numpy()
    except ImportError:  # pragma: no cover
        pass
    arr = np.asarray(A, dtype=np.float64)
    if arr.ndim not in (2, 3):
        raise ValueError(f"payoff matrix A must have shape (m, n) or (G, m, n), got shape {arr.shape}")
    if arr.shape[-1] < 1 or arr.shape[-2] < 1 or (arr.ndim == 3 and arr.shape[0] < 1):
        raise ValueError(f"payoff matrix A has an empty action set: shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("payoff matrix A contains non-finite entries (nan or inf)")
    return arr


def duality_gap(A: object, x: object, y: object) -> np.ndarray | float:
    """``max_j (A^T x)_j - min_i (A y)_i`` for ``A`` (m, n), ``x`` (m,), ``y`` (n,) or batched (G, ...).

    Raises ``ValueError`` when the strategy shapes do not match ``A``.
    """
    A = as_payoff_matrix(A)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != A.shape[:-1] or y.shape != A.shape[:-2] + A.shape[-1:]:
        raise ValueError(f"strategy shapes x {x.shape}, y {y.shape} do not match A {A.shape}: "
                         f"expected x {A.shape[:-1]} and y {A.shape[:-2] + A.shape[-1:]}")
    Aty = np.einsum("...mn,...m->...n", A, x)
    Ay = np.einsum("...mn,...n->...m", A, y)
    g = Aty.max(axis=-1) - Ay.min(axis=-1)
    return float(g) if np.ndim(g) == 0 else g


def log_schedule(iters: int, points: int = 60) -> np.ndarray:
    """About ``points`` log-spaced iteration counts in ``[1, iters]`` (unique ints, ``iters`` included)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    pts = np.unique(np.round(np.logspace(0, math.log10(iters), points)).astype(np.int64))
    pts = pts[(pts >= 1) & (pts <= iters)]
    for t in (10, 100, 1000, 10_000, 100_000, 1_000_000, iters):
        if t <= iters:
            pts = np.append(pts, t)
    return np.unique(pts)


def fit_loglog_slope(ts: Sequence[float], values: Sequence[float], lo: float, hi: float) -> float:
    """Least-squares slope of ``log(value)`` vs ``log(t)`` over points with ``lo <= t <= hi`` and value > 0."""
    t = np.asarray(ts, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    sel = (t >= lo) & (t <= hi) & (v > 0) & np.isfinite(v)
    if sel.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(t[sel]), np.log(v[sel]), 1)[0])


@dataclass
class MatrixGameResult:
    """Outcome of :func:`solve_matrix_game`.

    Shapes use ``G`` for the batch of games (absent for a single ``(m, n)`` game), ``L`` for the
    number of logged iterations:

    - ``x_bar`` (G, m), ``y_bar`` (G, n): average strategies (weights per ``averaging``);
    - ``x_last``, ``y_last``: last iterates;
    - ``log_iters`` (L,): iteration counts at which ``gap_curve`` (G, L) was measured;
    - ``eta_eff`` dict ``{"x": (G, L), "y": (G, L)}``: effective step size of each player at the
      log points (``1/B_t`` for MI-SPRM+, ``eta`` for SPRM+, 1 for RM/RM+/PRM+);
    - ``b_decreases``: steps where MI-SPRM+'s ``B_t`` decreased (0 by construction; None for others).
    """

    algo: str
    iters: int
    averaging: str
    alternating: bool
    x_bar: np.ndarray
    y_bar: np.ndarray
    x_last: np.ndarray
    y_last: np.ndarray
    log_iters: np.ndarray
    gap_curve: np.ndarray
    eta_eff: dict[str, np.ndarray] = field(default_factory=dict)
    b_decreases: int | None = None
    wall_time_s: float = 0.0

    @property
    def gap(self) -> np.ndarray | float:
        """Duality gap of the final average strategies."""
        g = self.gap_curve[..., -1]
        return float(g) if np.ndim(g) == 0 else g

    def gap_at(self, t: int) -> np.ndarray | float:
        """Gap at logged iteration ``t`` (must be one of ``log_iters``)."""
        idx = np.nonzero(self.log_iters == t)[0]
        if idx.size == 0:
            raise KeyError(f"iteration {t} was not logged; logged: {self.log_iters.tolist()}")
        g = self.gap_curve[..., idx[0]]
        return float(g) if np.ndim(g) == 0 else g

    def slope(self, lo: float | None = None, hi: float | None = None) -> np.ndarray | float:
        """Fitted log-log slope of the gap over ``[lo, hi]`` (default: the last two decades ``[T/100, T]``)."""
        hi = self.iters if hi is None else hi
        lo = max(1.0, hi / 100.0) if lo is None else lo
        curves = np.atleast_2d(self.gap_curve)
        s = np.array([fit_loglog_slope(self.log_iters, c, lo, hi) for c in curves])
        return float(s[0]) if self.gap_curve.ndim == 1 else s


def solve_matrix_game(
    A: object,
    algo: RegretAlgorithm | None = None,
    iters: int = 10_000,
    *,
    algo_y: RegretAlgorithm | None = None,
    averaging: Averaging = "uniform",
    alternating: bool = False,
    log_every: int | None = None,
    log_at: Sequence[int] | None = None,
) -> MatrixGameResult:
    """Self-play of two regret minimisers on ``min_x max_y x^T A y``.

    Args:
        A: payoff matrix ``(m, n)`` or a batch ``(G, m, n)`` (numpy / torch / list); finite.
        algo: regret-minimiser config for both players (default :class:`MISPRMPlus`); ``algo_y``
            overrides player y's.
        iters: number of iterations T (loss observations per player).
        averaging: weights of the average strategy: ``uniform`` (1, the O(1/T) theory), ``linear`` (t),
            ``quadratic`` (t^2).
        alternating: False = simultaneous updates (both players see the other's current strategy);
            True = player y sees player x's *updated* strategy (CFR+ convention).
        log_every / log_at: iterations at which the gap is recorded (default: ~60 log-spaced points
            plus every power of 10).

    Returns:
        :class:`MatrixGameResult`.
    """
    A = as_payoff_matrix(A)
    algo = MISPRMPlus() if algo is None else algo
    algo_y = algo if algo_y is None else algo_y
    for a, nm in ((algo, "algo"), (algo_y, "algo_y")):
        if not isinstance(a, RegretAlgorithm):
            raise TypeError(f"{nm} must be a RegretAlgorithm config (e.g. MISPRMPlus()), got {type(a).__name__}")
    check_int("iters", iters, 1)
    check_choice("averaging", averaging, tuple(_AVG_POWER))
    if log_at is not None:
        logs = np.unique(np.asarray(list(log_at), dtype=np.int64))
        if logs.size == 0 or logs.min() < 1 or logs.max() > iters:
            raise ValueError(f"log_at must be iterations within [1, {iters}], got {list(log_at)[:5]}...")
    elif log_every is not None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        logs = np.unique(np.append(np.arange(log_every, iters + 1, log_every), iters))
    else:
        logs = log_schedule(iters)
    single = A.ndim == 2
    A3 = A[None] if single else A
    G, m, n = A3.shape
    AT = np.ascontiguousarray(np.swapaxes(A3, 1, 2))
    X = algo.make(m, (G,))
    Y = algo_y.make(n, (G,))
    power = _AVG_POWER[averaging]
    sx = np.zeros((G, m))
    sy = np.zeros((G, n))
    wx = wy = 0.0
    kx = ky = 0  # number of averaged steps (SEG-RM+ averages only its update half-steps)
    gaps = np.zeros((G, logs.size))
    etas = {"x": np.zeros((G, logs.size)), "y": np.zeros((G, logs.size))}
    li = 0
    t0 = time.perf_counter()
    for t in range(1, iters + 1):
        x = X.next_strategy()
        y = Y.next_strategy()
        if X.in_average:
            kx += 1
            w = float(kx) ** power
            sx += w * x
            wx += w
        if Y.in_average:
            ky += 1
            w = float(ky) ** power
            sy += w * y
            wy += w
        X.observe_loss(np.matmul(A3, y[..., None])[..., 0])
        if alternating:
            x_new = X.next_strategy()
            Y.observe_loss(-np.matmul(AT, x_new[..., None])[..., 0])
        else:
            Y.observe_loss(-np.matmul(AT, x[..., None])[..., 0])
        if t == logs[li]:
            xb = sx / wx if wx > 0 else x
            yb = sy / wy if wy > 0 else y
            g = np.matmul(AT, xb[..., None])[..., 0].max(-1) - np.matmul(A3, yb[..., None])[..., 0].min(-1)
            if not np.all(np.isfinite(g)):
                raise NumericalError(f"{algo.label}: duality gap became non-finite at iteration {t}")
            gaps[:, li] = g
            etas["x"][:, li] = np.broadcast_to(X.eta_eff, (G,))
            etas["y"][:, li] = np.broadcast_to(Y.eta_eff, (G,))
            li += 1
    wall = time.perf_counter() - t0
    xb = sx / wx if wx > 0 else X.next_strategy()
    yb = sy / wy if wy > 0 else Y.next_strategy()
    x_last, y_last = X.next_strategy(), Y.next_strategy()
    bdec = None
    if isinstance(X, _MISPRMPlus) or isinstance(Y, _MISPRMPlus):
        bdec = sum(int(P.b_decreases) for P in (X, Y) if isinstance(P, _MISPRMPlus))
    sq = (lambda a: a[0]) if single else (lambda a: a)
    return MatrixGameResult(
        algo=algo.label if algo_y is algo else f"{algo.label} vs {algo_y.label}", iters=int(iters),
        averaging=averaging, alternating=bool(alternating), x_bar=sq(xb), y_bar=sq(yb),
        x_last=sq(x_last), y_last=sq(y_last), log_iters=logs, gap_curve=sq(gaps),
        eta_eff={k: sq(v) for k, v in etas.items()}, b_decreases=bdec, wall_time_s=wall)
