"""Gradient flows: the parameter flow, the intrinsic flow on ``z`` and the Euclidean guess, integrated
with RK4, and their result object.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from rankwise.core.errors import NumericalError
from rankwise.science.intrinsic_dynamics.common import _t
from rankwise.science.intrinsic_dynamics.losses import Loss
from rankwise.science.intrinsic_dynamics.systems import LiftedSystem


# --------------------------------------------------------------------------------------------------
# Config, flows and their result


@dataclass(frozen=True)
class IntrinsicConfig:
    """Integration settings (spec choices): RK4, step ``dt = 1e-3``, horizon ``t_max``.

    ``record_every``: keep ``z`` every this many steps (the final step is always kept).
    ``on_pattern_change``: what to do when the activation pattern of a ReLU loss (or a parameter sign,
    ``sign(a_j)``) changes within a step:

    * ``"stop"`` (spec default): stop; the step that crossed is discarded and its end time reported;
    * ``"locate"``: find the crossing by bisection on the RK4 sub-step (to 1e-13), step onto it and go on with
      the new pattern (the formula holds piecewise; every RK4 stage of a step uses the pattern of the piece
      it starts on, so RK4 keeps its order on each piece). A parameter sign flip,
      or more than 20 crossings in one step (sliding along a kink), still stops the run;
    * ``"ignore"``: plain RK4 through the kinks (loses order at each crossing).
    """

    t_max: float = 1.0
    dt: float = 1e-3
    record_every: int = 1
    on_pattern_change: str = "stop"

    def __post_init__(self) -> None:
        for name in ("t_max", "dt"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) or float(v) <= 0:
                raise ValueError(f"IntrinsicConfig.{name} must be a finite number > 0, got {v!r}")
        if self.dt > self.t_max:
            raise ValueError(f"IntrinsicConfig.dt={self.dt} exceeds t_max={self.t_max}")
        if isinstance(self.record_every, bool) or not isinstance(self.record_every, int) or self.record_every < 1:
            raise ValueError(f"IntrinsicConfig.record_every must be an int >= 1, got {self.record_every!r}")
        if self.on_pattern_change not in ("stop", "locate", "ignore"):
            raise ValueError("IntrinsicConfig.on_pattern_change must be 'stop', 'locate' or 'ignore', got "
                             f"{self.on_pattern_change!r}")

    @property
    def n_steps(self) -> int:
        return max(1, int(round(self.t_max / self.dt)))


@dataclass
class FlowResult:
    """A trajectory of the lifted variable.

    Attributes:
        times: ``(T,)`` recorded times. z: ``(T, *z.shape)``. loss: ``(T,)``.
        invariants: ``(T, H)`` conserved quantities along a parameter flow (None for lifted flows).
        theta: ``(T, D)`` parameters along a parameter flow (None otherwise).
        stopped_at: time at which the run stopped early (first pattern change with ``"stop"``; a sign flip or
            sliding with ``"locate"``), or None; ``stop_reason``: ``"pattern"`` (activation pattern), ``"sign"``
            (a parameter sign such as ``sign(a_j)`` flipped: the flow passed through the non-intrinsic set
            ``a_j = 0``) or ``"sliding"``. events: times of the located pattern changes (``"locate"``).
        kind: ``"parameter"``, ``"intrinsic"`` or ``"euclidean"``. wall_time_s: seconds.
    """

    times: np.ndarray
    z: np.ndarray
    loss: np.ndarray
    kind: str
    invariants: np.ndarray | None = None
    theta: np.ndarray | None = None
    stopped_at: float | None = None
    stop_reason: str | None = None
    events: list[float] = field(default_factory=list)
    wall_time_s: float = 0.0

    def conservation_residual(self) -> np.ndarray:
        """``(T,)`` ``max_i |h_i(t) - h_i(0)|`` (parameter flows)."""
        if self.invariants is None:
            raise ValueError("conservation residuals need a parameter flow (simulate_flow)")
        if self.invariants.shape[1] == 0:
            return np.zeros(len(self.times))
        return np.abs(self.invariants - self.invariants[:1]).max(axis=1)

    def relative_error(self, other: "FlowResult") -> np.ndarray:
        """``||z(t) - z_other(t)||_F / ||z(t)||_F`` on the common recorded times (shortest run)."""
        return compare(self, other)


def compare(a: FlowResult, b: FlowResult) -> np.ndarray:
    """Relative Frobenius error ``||z_a - z_b|| / ||z_a||`` at the times both runs recorded."""
    T = min(len(a.times), len(b.times))
    if T == 0 or not np.allclose(a.times[:T], b.times[:T]):
        raise ValueError("the two flows were not recorded at the same times (use the same dt and record_every)")
    za, zb = a.z[:T].reshape(T, -1), b.z[:T].reshape(T, -1)
    return np.linalg.norm(za - zb, axis=1) / np.maximum(np.linalg.norm(za, axis=1), 1e-300)


def _rk4(f: Callable[[Tensor], Tensor], x: Tensor, dt: float) -> Tensor:
    k1 = f(x)
    k2 = f(x + 0.5 * dt * k1)
    k3 = f(x + 0.5 * dt * k2)
    k4 = f(x + dt * k3)
    return x + (dt / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4)


def _cfg(config: IntrinsicConfig | None, t_max: float | None, dt: float | None) -> IntrinsicConfig:
    c = config or IntrinsicConfig()
    if t_max is not None or dt is not None:
        c = IntrinsicConfig(t_max=c.t_max if t_max is None else t_max, dt=c.dt if dt is None else dt,
                            record_every=c.record_every, on_pattern_change=c.on_pattern_change)
    return c


def _check_loss(loss: Any, z0: Tensor) -> None:
    if not isinstance(loss, Loss):
        if callable(loss):
            raise TypeError("loss must be a rankwise Loss; wrap a plain function with CallableLoss(fn)")
        raise TypeError(f"loss must be a Loss, got {type(loss).__name__}")
    v = loss.value(z0)
    if not torch.isfinite(v):
        raise ValueError(f"the loss is not finite at the initial point (got {float(v)})")


class _Stop(Exception):
    pass


def _integrate(state0: Tensor, velocity: Callable[[Tensor], Tensor], to_z: Callable[[Tensor], Tensor],
               loss: Loss, cfg: IntrinsicConfig, kind: str, extra: Callable[[Tensor], Tensor | None] | None = None,
               state_pattern: Callable[[Tensor], Tensor | None] | None = None,
               keep_state: bool = False) -> FlowResult:
    """Fixed-step RK4 on the grid ``k dt`` with activation-pattern handling (see :class:`IntrinsicConfig`)."""
    t0 = time.perf_counter()
    dt, K = cfg.t_max / cfg.n_steps, cfg.n_steps
    x = state0.clone()
    z = to_z(x)

    def patterns(state: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return loss.pattern(to_z(state)), (state_pattern(state) if state_pattern is not None else None)

    def same(a: tuple[Tensor | None, Tensor | None], b: tuple[Tensor | None, Tensor | None]) -> bool:
        return all(u is None or torch.equal(u, v) for u, v in zip(a, b))

    pat = patterns(x)
    track = cfg.on_pattern_change != "ignore" and (pat[0] is not None or pat[1] is not None)
    events: list[float] = []

    def locate(x: Tensor, t: float, pat: tuple[Any, Any]) -> tuple[Tensor, tuple[Any, Any]]:
        """Advance ``x`` by ``dt`` from time ``t``, stepping exactly onto each pattern change (bisection
        on the RK4 sub-step to 1e-13) and continuing with the new pattern, so that RK4 keeps its order."""
        remaining, n_ev = dt, 0
        while remaining > 0:
            with loss.freeze(pat[0]):
                x_try = _rk4(velocity, x, remaining)
                if same(patterns(x_try), pat):
                    return x_try, pat
                lo, hi = 0.0, remaining
                while hi - lo > 1e-13:
                    mid = 0.5 * (lo + hi)
                    if same(patterns(_rk4(velocity, x, mid)), pat):
                        lo = mid
                    else:
                        hi = mid
                x = _rk4(velocity, x, hi)
            new = patterns(x)
            if new[1] is not None and pat[1] is not None and not torch.equal(new[1], pat[1]):
                raise _Stop(t + dt - remaining + hi, "sign")  # a parameter sign flipped: not a kink of the loss
            events.append(t + dt - remaining + hi)
            n_ev += 1
            if n_ev > 20:
                raise _Stop(t + dt - remaining + hi, "sliding")  # the flow slides along a kink (Filippov)
            pat, remaining = new, remaining - hi
        return x, pat

    times, zs, losses, hs, thetas = [0.0], [z.numpy().copy()], [float(loss.value(z))], [], []
    if extra is not None:
        hs.append(extra(x).numpy().copy())
    if keep_state:
        thetas.append(x.numpy().copy())
    stopped, reason = None, None
    for k in range(1, K + 1):
        with loss.freeze(pat[0] if track else None):
            x_new = _rk4(velocity, x, dt)
        if track:
            p = patterns(x_new)
            if not same(p, pat):
                if cfg.on_pattern_change == "stop":
                    stopped = k * dt
                    reason = "sign" if (p[1] is not None and not torch.equal(p[1], pat[1])) else "pattern"
                    break
                try:
                    x_new, p = locate(x, (k - 1) * dt, pat)
                except _Stop as st:
                    stopped, reason = float(st.args[0]), str(st.args[1])
                    break
            pat = p
        if not torch.isfinite(x_new).all():
            raise NumericalError(f"{kind} flow: non-finite state at t={k * dt:.4g} (step dt={dt}); lower dt")
        x = x_new
        if k % cfg.record_every == 0 or k == K:
            z = to_z(x)
            times.append(k * dt)
            zs.append(z.numpy().copy())
            losses.append(float(loss.value(z)))
            if extra is not None:
                hs.append(extra(x).numpy().copy())
            if keep_state:
                thetas.append(x.numpy().copy())
    return FlowResult(times=np.array(times), z=np.stack(zs), loss=np.array(losses), kind=kind,
                      invariants=np.stack(hs) if extra is not None else None,
                      theta=np.stack(thetas) if keep_state else None, stopped_at=stopped,
                      stop_reason=reason, events=events, wall_time_s=time.perf_counter() - t0)


def simulate_flow(system: LiftedSystem, theta0: Any, loss: Loss, config: IntrinsicConfig | None = None, *,
                  t_max: float | None = None, dt: float | None = None, keep_theta: bool = False,
                  use_closed_form: bool = True) -> FlowResult:
    """The parameter gradient flow ``theta' = -J(theta)^T grad l(phi(theta))`` (RK4), recording ``z = phi(theta)``
    and the conserved quantities. The ground truth against which lifted flows are compared.

    The velocity is the system's closed-form ``param_velocity`` when it has one (tests check it against
    autograd) and an autograd vector-Jacobian product otherwise (``use_closed_form=False`` forces autograd).
    """
    if not isinstance(system, LiftedSystem):
        raise TypeError(f"system must be a LiftedSystem, got {type(system).__name__}")
    cfg = _cfg(config, t_max, dt)
    th0 = system.check_theta(theta0)
    _check_loss(loss, system.phi(th0))

    def velocity_autograd(th: Tensor) -> Tensor:
        th = th.detach().requires_grad_(True)
        z = system.phi(th)
        g = loss.grad(z.detach())
        (v,) = torch.autograd.grad(z, th, grad_outputs=g)
        return -v

    closed = system.param_velocity(th0, loss.grad(system.phi(th0).detach())) if use_closed_form else None

    def velocity_closed(th: Tensor) -> Tensor:
        return system.param_velocity(th, loss.grad(system.phi(th)))

    velocity = velocity_closed if closed is not None else velocity_autograd
    return _integrate(th0, velocity, lambda th: system.phi(th).detach(), loss, cfg, "parameter",
                      extra=lambda th: system.invariants(th).detach(), state_pattern=system.param_pattern,
                      keep_state=keep_theta)


VelocityFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def intrinsic_flow(system: LiftedSystem | VelocityFn, z0: Any, invariants: Any, loss: Loss,
                   config: IntrinsicConfig | None = None, *, t_max: float | None = None,
                   dt: float | None = None) -> FlowResult:
    """The lifted flow ``z' = -F(z, h) grad l(z)`` from ``z(0) = z0`` with the conserved ``h`` (RK4).

    ``system`` is a :class:`LiftedSystem` with a closed-form ``intrinsic_velocity`` or any callable
    ``velocity(z, h, g) -> z'``. ``invariants`` is ``system.invariants(theta0)`` (or an assumed value,
    to test a formula outside its domain)."""
    cfg = _cfg(config, t_max, dt)
    z0 = _t(z0, "z0")
    h = _t(invariants, "invariants").reshape(-1)
    if isinstance(system, LiftedSystem):
        vel = system.velocity_for(h)
    elif callable(system):
        fn = system
        vel = lambda z, g: fn(z, h, g)  # noqa: E731
    else:
        raise TypeError("system must be a LiftedSystem or a callable velocity(z, h, g)")
    _check_loss(loss, z0)
    vel(z0, loss.grad(z0))  # raises NotImplementedError / NotIntrinsicError before integrating
    return _integrate(z0, lambda z: vel(z, loss.grad(z)), lambda z: z, loss, cfg, "intrinsic")


def euclidean_flow(z0: Any, loss: Loss, config: IntrinsicConfig | None = None, *, t_max: float | None = None,
                   dt: float | None = None) -> FlowResult:
    """The naive baseline ``z' = -grad l(z)`` that ignores the parametrisation and the initialisation."""
    cfg = _cfg(config, t_max, dt)
    z0 = _t(z0, "z0")
    _check_loss(loss, z0)
    res = _integrate(z0, lambda z: -loss.grad(z), lambda z: z, loss, cfg, "euclidean")
    return res
