"""Losses as functions of the intrinsic variable ``z`` (``grad(z)`` is dl/dz; ``pattern(z)`` the
activation pattern or None).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from rankwise.science.intrinsic_dynamics.common import DTYPE, _t


# --------------------------------------------------------------------------------------------------
# Losses (functions of z). grad(z) is dl/dz; pattern(z) returns the activation pattern or None.


class Loss:
    """A differentiable loss of the lifted variable. Subclasses give ``value`` and ``grad``.

    Piecewise-smooth losses (ReLU) also give ``pattern(z)``; inside ``with loss.freeze(p):`` their value
    and gradient use the pattern ``p`` instead of the one of ``z`` (the smooth extension of one piece),
    which the integrator uses so that every RK4 stage of a step sees the same piece.
    """

    _frozen: Tensor | None = None

    @contextmanager
    def freeze(self, pattern: Tensor | None) -> Iterator[None]:
        old, self._frozen = self._frozen, pattern
        try:
            yield
        finally:
            self._frozen = old

    def value(self, z: Tensor) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def grad(self, z: Tensor) -> Tensor:
        zz = z.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(self.value(zz), zz)
        return g

    def pattern(self, z: Tensor) -> Tensor | None:
        return None

    def __call__(self, z: Tensor) -> Tensor:
        return self.value(z)


class FrobeniusLoss(Loss):
    """``l(Z) = 0.5 ||Z - Y||_F^2``; ``grad = Z - Y``."""

    def __init__(self, Y: Any) -> None:
        self.Y = _t(Y, "Y")

    def _check(self, z: Tensor) -> None:
        if z.shape != self.Y.shape:
            raise ValueError(f"Y has shape {tuple(self.Y.shape)} but z has shape {tuple(z.shape)}")

    def value(self, z: Tensor) -> Tensor:
        self._check(z)
        return 0.5 * (z - self.Y).pow(2).sum()

    def grad(self, z: Tensor) -> Tensor:
        self._check(z)
        return z - self.Y


class LeastSquaresLoss(Loss):
    """``l(Z) = 0.5 ||Z X - Y||_F^2`` with ``X (m, N)``, ``Y (n, N)``; ``grad = (Z X - Y) X^T``."""

    def __init__(self, X: Any, Y: Any) -> None:
        self.X, self.Y = _t(X, "X"), _t(Y, "Y")
        if self.X.ndim != 2 or self.Y.ndim != 2 or self.X.shape[1] != self.Y.shape[1]:
            raise ValueError(f"X (m, N) and Y (n, N) must share N; got {tuple(self.X.shape)} and {tuple(self.Y.shape)}")

    def _check(self, z: Tensor) -> None:
        if z.ndim != 2 or z.shape != (self.Y.shape[0], self.X.shape[0]):
            raise ValueError(f"Z must have shape {(self.Y.shape[0], self.X.shape[0])}, got {tuple(z.shape)}")

    def value(self, z: Tensor) -> Tensor:
        self._check(z)
        return 0.5 * (z @ self.X - self.Y).pow(2).sum()

    def grad(self, z: Tensor) -> Tensor:
        self._check(z)
        return (z @ self.X - self.Y) @ self.X.mT


class ReLURegressionLoss(Loss):
    """Mean squared error of the one-hidden-layer ReLU net written in its path-lifting ``z (k, d)``.

    ``f(x) = sum_j a_j relu(w_j . x) = sum_j s_j relu(s_j z_j . x)`` with ``s_j = sign(a_j)``, constant along
    the flow while ``z_j != 0``; ``l(z) = 0.5 mean_i (f(x_i) - y_i)^2``. ``pattern(z)`` is the activation
    pattern ``s_j z_j . x_i > 0`` of shape ``(k, N)``. ``X (N, d)``, ``y (N,)``.
    """

    def __init__(self, X: Any, y: Any, signs: Any) -> None:
        self.X, self.y, self.s = _t(X, "X"), _t(y, "y"), _t(signs, "signs")
        if self.X.ndim != 2 or self.y.shape != (self.X.shape[0],):
            raise ValueError(f"X must be (N, d) and y (N,); got {tuple(self.X.shape)} and {tuple(self.y.shape)}")
        if self.s.ndim != 1 or not torch.all(self.s.abs() == 1):
            raise ValueError("signs must be a 1-D tensor of +1/-1 (the signs of the output weights a_j)")

    def _check(self, z: Tensor) -> None:
        if z.ndim != 2 or z.shape != (self.s.shape[0], self.X.shape[1]):
            raise ValueError(f"z must have shape (k, d) = {(self.s.shape[0], self.X.shape[1])}, got {tuple(z.shape)}")

    def pattern(self, z: Tensor) -> Tensor:
        self._check(z)
        return (self.s[:, None] * (z @ self.X.mT)) > 0

    def _mask(self, z: Tensor) -> Tensor:
        return (self._frozen if self._frozen is not None else self.pattern(z)).to(DTYPE)

    def predict(self, z: Tensor) -> Tensor:
        """``f(x_i) = sum_j m_ij z_j . x_i`` with the activation mask ``m`` (``s_j^2 = 1``), shape ``(N,)``."""
        self._check(z)
        return (self._mask(z) * (z @ self.X.mT)).sum(0)

    def value(self, z: Tensor) -> Tensor:
        return 0.5 * (self.predict(z) - self.y).pow(2).mean()

    def grad(self, z: Tensor) -> Tensor:
        r = (self.predict(z) - self.y) / self.y.shape[0]  # (N,)
        return (self._mask(z) * r[None, :]) @ self.X  # (k, d)


class CallableLoss(Loss):
    """Wrap any torch function ``fn(z) -> scalar`` (gradient by autograd)."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        if not callable(fn):
            raise TypeError("CallableLoss needs a callable fn(z) -> scalar tensor")
        self.fn = fn

    def value(self, z: Tensor) -> Tensor:
        v = self.fn(z)
        if not isinstance(v, Tensor) or v.numel() != 1:
            raise ValueError("the loss function must return a scalar tensor")
        return v.reshape(())
