"""The soft threshold on singular values, with the custom backward of the official code.

For a singular value ``s`` and a threshold ``alpha`` (sharpness ``s0``, below-threshold slope ``c``)::

    f(s) = s tanh(s0 (s - alpha))      if s > alpha
         = -c tanh(s0 (s - alpha))     otherwise          (0 for the default c = 0)

Backward, element by element (the derivative of the same expression on each branch)::

    s > alpha:  df/ds = tanh + s0 s (1 - tanh^2),   df/dalpha = -s0 s (1 - tanh^2)
    otherwise:  df/ds = -c s0 (1 - tanh^2),         df/dalpha =  c s0 (1 - tanh^2)

The rank of a group of singular values is ``#{i : s_i > alpha}``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["SoftThreshold", "soft_threshold", "soft_threshold_reference", "threshold_rank"]


class SoftThreshold(torch.autograd.Function):
    """``f(s; alpha)`` with the hand-written backward; ``alpha`` broadcasts against ``s``."""

    @staticmethod
    def forward(ctx, s: Tensor, alpha: Tensor, sharpness: float, c: float) -> Tensor:  # type: ignore[override]
        t = torch.tanh(sharpness * (s - alpha))
        above = s > alpha
        ctx.save_for_backward(s, alpha, t, above)
        ctx.sharpness, ctx.c = float(sharpness), float(c)
        return torch.where(above, s * t, -c * t)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        s, alpha, t, above = ctx.saved_tensors
        s0, c = ctx.sharpness, ctx.c
        sech2 = 1.0 - t * t
        d_s = torch.where(above, t + s0 * s * sech2, -c * s0 * sech2)
        d_a = torch.where(above, -s0 * s * sech2, c * s0 * sech2)
        g_s = g_a = None
        if ctx.needs_input_grad[0]:
            g_s = _unbroadcast(grad * d_s, s.shape)
        if ctx.needs_input_grad[1]:
            g_a = _unbroadcast(grad * d_a, alpha.shape)
        return g_s, g_a, None, None


def _unbroadcast(g: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``g`` down to ``shape`` (the inverse of broadcasting)."""
    while g.ndim > len(shape):
        g = g.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdim=True)
    return g


def soft_threshold(s: Tensor, alpha: Tensor, sharpness: float = 50.0, c: float = 0.0) -> Tensor:
    """``f(s; alpha)`` elementwise (custom backward). ``s``: any shape; ``alpha`` broadcastable to it."""
    return SoftThreshold.apply(s, alpha, sharpness, c)


def soft_threshold_reference(s: Tensor, alpha: Tensor, sharpness: float = 50.0, c: float = 0.0) -> Tensor:
    """The same forward in plain torch ops, so that autograd differentiates it (tests compare the two)."""
    t = torch.tanh(sharpness * (s - alpha))
    return torch.where(s > alpha, s * t, -c * t)


def threshold_rank(s: Tensor, alpha: Tensor) -> Tensor:
    """``#{i : s_i > alpha}`` over the last dimension of ``s`` (``alpha`` of shape ``s.shape[:-1]``)."""
    return (s > alpha.unsqueeze(-1)).sum(-1)
