"""Regret-matching family as stateful, batched local regret minimisers (numpy, float64).

Every algorithm is described by a frozen config (:class:`RM`, :class:`RMPlus`, :class:`PRMPlus`,
:class:`SPRMPlus`, :class:`SEGRMPlus`, :class:`MISPRMPlus`). ``config.make(num_actions, batch)``
returns a :class:`RegretMinimizer`, a torch.optim-like object with two methods:

* ``next_strategy() -> x``: the mixed strategy to play now, shape ``(*batch, d)`` (rows on the simplex);
* ``observe_loss(loss)``: the loss vector ``l`` observed for that strategy, shape ``(*batch, d)``.

A batch dimension lets one object drive many independent decision points at once (20 matrix
games, or every information set with ``d`` actions of a poker game under CFR).

Notation of the spec (``shared/methods/mi_sprm.md``): instantaneous regret ``r = <l, x> 1 - l``,
normalisation ``g(R) = R / ||R||_1`` (uniform when ``R = 0``), regret domain
``D_B = {R >= 0, ||R||_1 >= B}`` and its Euclidean projection :func:`project_regret_domain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

import numpy as np

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_choice, check_positive

__all__ = [
    "normalize", "project_regret_domain", "project_scaled_simplex", "instant_regret",
    "RegretMinimizer", "RegretAlgorithm", "RM", "RMPlus", "PRMPlus", "SPRMPlus", "SEGRMPlus", "MISPRMPlus",
]


# --------------------------------------------------------------------------------------------- math


def normalize(R: np.ndarray) -> np.ndarray:
    """``g(R) = R / ||R||_1`` row-wise for nonnegative ``R`` of shape ``(..., d)``; uniform rows where ``R = 0``."""
    R = np.asarray(R, dtype=np.float64)
    s = R.sum(axis=-1, keepdims=True)
    d = R.shape[-1]
    safe = s > 0.0
    out = np.where(safe, R / np.where(safe, s, 1.0), 1.0 / d)
    return out


def project_scaled_simplex(y: np.ndarray, B: np.ndarray | float) -> np.ndarray:
    """Euclidean projection of each row of ``y`` (shape ``(..., d)``) onto ``{R >= 0, sum R = B}``.

    Sort-based (Held-Wolfe-Crowder / Duchi et al. 2008), O(d log d) per row. ``B`` broadcasts
    against ``y.shape[:-1]`` and must be > 0.
    """
    y = np.asarray(y, dtype=np.float64)
    d = y.shape[-1]
    B = np.broadcast_to(np.asarray(B, dtype=np.float64), y.shape[:-1])[..., None]
    u = -np.sort(-y, axis=-1)  # descending
    css = np.cumsum(u, axis=-1) - B
    j = np.arange(1, d + 1, dtype=np.float64)
    cond = u - css / j > 0.0
    # rho = last index where cond holds (cond is true at index 0 whenever B > 0)
    rho = d - 1 - np.argmax(cond[..., ::-1], axis=-1)
    theta = np.take_along_axis(css, rho[..., None], axis=-1) / (rho[..., None] + 1.0)
    return np.maximum(y - theta, 0.0)


def project_regret_domain(y: np.ndarray, B: np.ndarray | float) -> np.ndarray:
    """Euclidean projection ``Π_{D_B}(y)`` onto ``D_B = {R >= 0, ||R||_1 >= B}`` row-wise.

    ``p = [y]^+``; rows with ``sum(p) >= B`` are returned as ``p`` (the orthant projection is then
    feasible, hence optimal); the others are projected onto the scaled simplex ``{R >= 0, sum R = B}``
    (the ``||R||_1 >= B`` constraint is active there). ``y``: ``(..., d)``; ``B``: scalar or ``(...)``, > 0.
    """
    y = np.asarray(y, dtype=np.float64)
    Bb = np.broadcast_to(np.asarray(B, dtype=np.float64), y.shape[:-1])
    p = np.maximum(y, 0.0)
    inside = p.sum(axis=-1) >= Bb
    if np.all(inside):
        return p
    q = project_scaled_simplex(y, Bb)
    return np.where(inside[..., None], p, q)


def instant_regret(loss: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``r = <l, x> 1 - l`` row-wise; ``loss`` and ``x`` of shape ``(..., d)``."""
    return np.sum(loss * x, axis=-1, keepdims=True) - loss


# --------------------------------------------------------------------------------------- minimisers


class RegretMinimizer:
    """Stateful batched local regret minimiser (base class).

    Attributes: ``num_actions`` (d), ``batch`` (tuple), ``t`` (number of observed losses).
    ``in_average`` says whether the strategy returned by the latest :meth:`next_strategy` belongs to
    the average (always true except for the exploration half-step of extragradient methods).
    """

    name: ClassVar[str] = "base"

    def __init__(self, num_actions: int, batch: tuple[int, ...] = ()) -> None:
        if int(num_actions) < 1:
            raise ValueError(f"num_actions must be >= 1, got {num_actions}")
        self.num_actions = int(num_actions)
        self.batch = tuple(int(b) for b in batch)
        self.shape = self.batch + (self.num_actions,)
        self.t = 0
        self._x: np.ndarray | None = None
        self.in_average = True

    # subclasses implement _strategy() and _update(loss, x)
    def _strategy(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def next_strategy(self) -> np.ndarray:
        """The strategy to play now, shape ``(*batch, d)``; calling it twice returns the same array."""
        if self._x is None:
            self._x = self._strategy()
        return self._x

    def observe_loss(self, loss: np.ndarray) -> None:
        """Feed the loss vector of the strategy just played, shape ``(*batch, d)``."""
        loss = np.asarray(loss, dtype=np.float64)
        if loss.shape != self.shape:
            raise ValueError(f"loss has shape {loss.shape}, expected {self.shape}")
        if not np.all(np.isfinite(loss)):
            raise ValueError("loss contains non-finite values")
        x = self.next_strategy()
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught by _check -> NumericalError
            self._update(loss, x)
        self._x = None
        self.t += 1

    @property
    def eta_eff(self) -> np.ndarray | float:
        """Effective step size of the update (1 for the parameter-free RM variants)."""
        return 1.0

    def _check(self, arr: np.ndarray, what: str) -> None:
        if not np.all(np.isfinite(arr)):
            raise NumericalError(f"{self.name}: {what} became non-finite at step {self.t}")


class _RM(RegretMinimizer):
    name = "RM"

    def __init__(self, num_actions: int, batch: tuple[int, ...] = ()) -> None:
        super().__init__(num_actions, batch)
        self.R = np.zeros(self.shape)

    def _strategy(self) -> np.ndarray:
        return normalize(np.maximum(self.R, 0.0))

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:
        self.R += instant_regret(loss, x)
        self._check(self.R, "regret")


class _RMPlus(_RM):
    name = "RM+"

    def _strategy(self) -> np.ndarray:
        return normalize(self.R)

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:
        self.R = np.maximum(self.R + instant_regret(loss, x), 0.0)
        self._check(self.R, "regret")


class _PRMPlus(_RM):
    name = "PRM+"

    def __init__(self, num_actions: int, batch: tuple[int, ...] = ()) -> None:
        super().__init__(num_actions, batch)
        self.m = np.zeros(self.shape)

    def _strategy(self) -> np.ndarray:
        return normalize(np.maximum(self.R + self.m, 0.0))

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:
        r = instant_regret(loss, x)
        self.R = np.maximum(self.R + r, 0.0)
        self.m = r
        self._check(self.R, "regret")


class _SmoothRM(RegretMinimizer):
    """What SPRM+ and SEG-RM+ share: steps ``R <- Pi_D(R + eta r)`` on ``D = {R >= 0, ||R||_1 >= r0}``,
    starting at ``R = r0 / n`` per action."""

    def __init__(self, num_actions: int, batch: tuple[int, ...], eta: float, r0: float) -> None:
        super().__init__(num_actions, batch)
        self.eta, self.r0 = float(eta), float(r0)
        self.R = np.full(self.shape, self.r0 / self.num_actions)

    def _stepped(self, r: np.ndarray) -> np.ndarray:
        return project_regret_domain(self.R + self.eta * r, self.r0)

    @property
    def eta_eff(self) -> float:
        return self.eta


class _SPRMPlus(_SmoothRM):
    name = "SPRM+"

    def __init__(self, num_actions: int, batch: tuple[int, ...], eta: float, r0: float) -> None:
        super().__init__(num_actions, batch, eta, r0)
        self.m = np.zeros(self.shape)

    def _strategy(self) -> np.ndarray:
        return normalize(self._stepped(self.m))

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:
        r = instant_regret(loss, x)
        self.R = self._stepped(r)
        self.m = r
        self._check(self.R, "regret")


class _SEGRMPlus(_SmoothRM):
    """Smooth extragradient RM+: two loss observations per update (exploration, then update)."""

    name = "SEG-RM+"

    def __init__(self, num_actions: int, batch: tuple[int, ...], eta: float, r0: float) -> None:
        super().__init__(num_actions, batch, eta, r0)
        self.W: np.ndarray | None = None  # the extrapolated point, set during the second half-step
        self.in_average = False

    def _strategy(self) -> np.ndarray:
        return normalize(self.R if self.W is None else self.W)

    def next_strategy(self) -> np.ndarray:
        x = super().next_strategy()
        self.in_average = self.W is not None
        return x

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:
        r = instant_regret(loss, x)
        if self.W is None:
            self.W = self._stepped(r)
            self._check(self.W, "extrapolated regret")
        else:
            self.R = self._stepped(r)
            self.W = None
            self._check(self.R, "regret")


class _MISPRMPlus(RegretMinimizer):
    """MI-SPRM+ (spec steps 1-4): step size 1, adaptive regret domain ``D_{B_t}`` with non-decreasing ``B_t``."""

    name = "MI-SPRM+"

    def __init__(self, num_actions: int, batch: tuple[int, ...], ard: str, eps: float) -> None:
        super().__init__(num_actions, batch)
        self.ard, self.eps = ard, float(eps)
        self.R: np.ndarray | None = None  # set from the first observed regret (scale-free B_1)
        self.B = np.zeros(self.batch)
        self.m = np.zeros(self.shape)
        self.b_decreases = 0  # number of (row, step) pairs where B_{t+1} < B_t; 0 by construction
        self.min_b_increment = math.inf

    def _strategy(self) -> np.ndarray:
        if self.R is None:
            return np.full(self.shape, 1.0 / self.num_actions)
        return normalize(project_regret_domain(self.R + self.m, self.B))

    def _update(self, loss: np.ndarray, x: np.ndarray) -> None:
        r = instant_regret(loss, x)
        if self.R is None:
            # Step 1: B_1 = max(||r_1||_1, eps), R_1 = (B_1 / d) 1. r_1 is the regret of the uniform
            # strategy (played first) against the opponent's first strategy: no extra query, scale-free.
            self.B = np.maximum(np.abs(r).sum(axis=-1), self.eps)
            self.R = np.repeat((self.B / self.num_actions)[..., None], self.num_actions, axis=-1)
        y = self.R + r
        if self.ard == "max_norm":
            B_new = np.maximum(self.B, self.R.sum(axis=-1))
        else:  # "norm"
            B_new = np.maximum(self.B, np.maximum(y, 0.0).sum(axis=-1))
        inc = B_new - self.B
        self.b_decreases += int(np.count_nonzero(~(inc >= 0.0)))
        if inc.size:
            self.min_b_increment = min(self.min_b_increment, float(inc.min()))
        self.B = B_new
        self.R = project_regret_domain(y, self.B)
        self.m = r
        self._check(self.R, "regret")
        self._check(self.B, "regret-domain bound B_t")

    @property
    def eta_eff(self) -> np.ndarray:
        """``1 / B_t`` per row: MI-SPRM+ equals SPRM+ on the unit domain with step ``1/B_t`` (spec step 4)."""
        if self.R is None:
            return np.full(self.batch, np.inf)
        return 1.0 / self.B


# ------------------------------------------------------------------------------------------ configs


@dataclass(frozen=True)
class RegretAlgorithm:
    """Base of the algorithm configs; ``make`` builds a fresh minimiser.

    A parameter-free algorithm only names its minimiser class and label (``_minimizer``, ``_label``);
    one with parameters overrides :meth:`make` and :attr:`label`.
    """

    _minimizer: ClassVar[Callable[[int, tuple[int, ...]], RegretMinimizer] | None] = None
    _label: ClassVar[str | None] = None

    def make(self, num_actions: int, batch: tuple[int, ...] | int = ()) -> RegretMinimizer:
        if self._minimizer is None:
            raise NotImplementedError
        return type(self)._minimizer(num_actions, _batch(batch))  # type: ignore[misc]

    @property
    def label(self) -> str:
        return self._label or type(self).__name__


def _batch(batch: tuple[int, ...] | int) -> tuple[int, ...]:
    return (int(batch),) if isinstance(batch, (int, np.integer)) else tuple(batch)


@dataclass(frozen=True)
class RM(RegretAlgorithm):
    """Regret Matching: ``R <- R + r``, ``x = g([R]^+)``. Parameter-free, O(1/sqrt T)."""

    _minimizer = _RM
    _label = "RM"


@dataclass(frozen=True)
class RMPlus(RegretAlgorithm):
    """Regret Matching+: ``R <- [R + r]^+``, ``x = g(R)``. Parameter-free (CFR+'s local minimiser)."""

    _minimizer = _RMPlus
    _label = "RM+"


@dataclass(frozen=True)
class PRMPlus(RegretAlgorithm):
    """Predictive RM+: ``R <- [R + r]^+``, prediction ``m = r``, ``x = g([R + m]^+)`` (PCFR+'s local minimiser)."""

    _minimizer = _PRMPlus
    _label = "PRM+"


@dataclass(frozen=True)
class SPRMPlus(RegretAlgorithm):
    """Smooth Predictive RM+ (Farina et al. 2023) on ``D = {R >= 0, ||R||_1 >= r0}`` with step ``eta``.

    The O(1/T) proof needs ``eta <= 1/(8L)``, ``L = ||A||_2``; use :meth:`for_matrix` to set it.
    """

    eta: float = 0.1
    r0: float = 1.0

    def __post_init__(self) -> None:
        check_positive("SPRMPlus.eta", self.eta)
        check_positive("SPRMPlus.r0", self.r0)

    @classmethod
    def for_matrix(cls, A: np.ndarray, scale: float = 1.0, r0: float = 1.0) -> "SPRMPlus":
        """``eta = scale / (8 ||A||_2)`` (the theory's step for a payoff matrix ``A`` (m, n) or a batch (G, m, n) -> max over G)."""
        L = float(np.max(np.linalg.norm(np.asarray(A, dtype=np.float64), ord=2, axis=(-2, -1))))
        if not L > 0:
            raise ValueError("SPRMPlus.for_matrix: ||A||_2 is 0 (constant-zero game); any eta works")
        return cls(eta=scale / (8.0 * L), r0=r0)

    def make(self, num_actions: int, batch: tuple[int, ...] | int = ()) -> RegretMinimizer:
        return _SPRMPlus(num_actions, _batch(batch), self.eta, self.r0)

    @property
    def label(self) -> str:
        return f"SPRM+(eta={self.eta:.3g})"


@dataclass(frozen=True)
class SEGRMPlus(RegretAlgorithm):
    """Smooth extragradient RM+ (Farina et al. 2023): same domain as SPRM+, extragradient instead of optimism.

    Each update uses two loss observations; solvers count iterations as loss observations, so at
    equal ``iters`` SEG-RM+ makes half as many updates (equal-gradient budget).
    """

    eta: float = 0.1
    r0: float = 1.0

    def __post_init__(self) -> None:
        check_positive("SEGRMPlus.eta", self.eta)
        check_positive("SEGRMPlus.r0", self.r0)

    def make(self, num_actions: int, batch: tuple[int, ...] | int = ()) -> RegretMinimizer:
        return _SEGRMPlus(num_actions, _batch(batch), self.eta, self.r0)

    @property
    def label(self) -> str:
        return f"SEG-RM+(eta={self.eta:.3g})"


@dataclass(frozen=True)
class MISPRMPlus(RegretAlgorithm):
    """MI-SPRM+: parameter-free smooth PRM+ with an Adaptive Regret Domain (spec, Method steps 1-4).

    ``ard``: rule of the non-decreasing lower bound ``B_t`` of ``||R||_1``:
    ``"max_norm"`` (default): ``B_{t+1} = max(B_t, ||R_t||_1)``;
    ``"norm"``: ``B_{t+1} = max(B_t, ||[R_t + r_t]^+||_1)``.
    ``eps``: floor of ``B_1 = max(||r_1||_1, eps)`` (only matters when the first regret is 0).
    """

    ard: Literal["max_norm", "norm"] = "max_norm"
    eps: float = 1e-12

    def __post_init__(self) -> None:
        check_choice("MISPRMPlus.ard", self.ard, ("max_norm", "norm"))
        check_positive("MISPRMPlus.eps", self.eps)

    def make(self, num_actions: int, batch: tuple[int, ...] | int = ()) -> RegretMinimizer:
        return _MISPRMPlus(num_actions, _batch(batch), self.ard, self.eps)

    @property
    def label(self) -> str:
        return "MI-SPRM+" if self.ard == "max_norm" else "MI-SPRM+(ard=norm)"
