"""RACS: Row And Column Scaled SGD (Gong, Scetbon, Ma, Meeds, ICLR 2026, arXiv 2502.07752), and the
parameter-group machinery that RACS and Alice share.

The paper reads an optimizer as ``F^{-1/2} g`` with ``F`` a structured approximation of the empirical
Fisher ``E[vec(G) vec(G)^T]``. RACS takes the structure ``F ~ diag(q) (x) diag(s)`` (a diagonal
Kronecker product, ``s`` over the m rows and ``q`` over the n columns of a weight ``W`` of shape
(m, n)); its Frobenius-optimal fit to ``V = E[G (.) G]`` is the rank-1 fit ``V ~ s q^T``, solved by
the fixed point ``s = V q / ||q||^2``, ``q = V^T s / ||s||^2``. Per step (the spec's steps 1-4):

1. ``s <- beta s + (1-beta) (G (.) G) q / ||q||^2``;
   ``q <- beta q + (1-beta) (G (.) G)^T s / ||s||^2`` (one warm-started fixed-point step; init
   ``s = 0``, ``q = 1``);
2. ``G_hat = diag(s+eps)^{-1/2} G diag(q+eps)^{-1/2}``;
3. norm-growth limiter (from Fira): ``eta_t = min(1, gamma phi_{t-1} / ||G_hat||_F)``, ``eta_1 = 1``,
   ``phi_t = eta_t ||G_hat||_F``;
4. ``W <- W - lr alpha eta_t G_hat`` (decoupled weight decay ``W <- (1 - lr wd) W`` first, optional).

State per matrix: ``s`` (m), ``q`` (n) and ``phi`` (1): exactly m + n + 1 floats.

Parameter routing (:class:`rankwise.train.lowmem_base.LowMemOptimizer`, shared with
:class:`~rankwise.train.racs_alice.alice.Alice`):

* a group with ``use_adamw=True`` is updated by AdamW (bias-corrected, decoupled weight decay,
  ``adamw_betas``, ``adamw_eps``; the group's own ``lr``), bit-compatible with ``torch.optim.AdamW``;
  :func:`split_params_for_lowmem` puts embeddings, the LM head, norms and biases there;
* in the other groups, tensors with ``ndim >= 2`` take the low-memory path (``ndim > 2`` reshaped to
  ``(dim0, -1)``); a 1-D tensor found there is routed to AdamW with a warning (once per tensor).

Bad input: ``ValueError`` for out-of-range hyper-parameters (naming field, value and range),
``TypeError`` for sparse or complex gradients / parameters, :class:`RankwiseError` when a parameter
changes shape between steps. A non-finite gradient skips that tensor's update and is flagged (a
``RuntimeWarning`` and :attr:`nonfinite_skips`); ``nonfinite="raise"`` raises
:class:`~rankwise.core.errors.NumericalError` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rankwise.core.validate import check_bool, check_int, check_number, check_positive, check_unit
from rankwise.train.lowmem_base import (
    TINY,
    LowMemOptimizer,
    check_betas,
    check_racs_fields,
    lowmem_entry,
    norm_growth_limit,
    racs_scale,
    racs_stats_step,
    state_dtype,
)

__all__ = ["RACS", "RACSConfig", "racs_fixed_point"]


# --------------------------------------------------------------------------------------------------
# pure math


def racs_fixed_point(v: torch.Tensor, iters: int = 100, tol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Frobenius-optimal rank-1 non-negative fit ``V ~ s q^T`` by the RACS fixed point.

    ``v``: (m, n) non-negative matrix (e.g. ``E[G (.) G]``). Iterates ``s = V q / ||q||^2``,
    ``q = V^T s / ||s||^2`` from ``q = 1`` (the power iteration of ``V V^T``), in float64.
    Returns ``(s, q)`` of shapes (m,) and (n,) with ``s q^T`` the best rank-1 approximation of V.
    """
    if v.ndim != 2:
        raise ValueError(f"v must be a 2-D matrix, got shape {tuple(v.shape)}")
    check_int("iters", iters, 1)
    vd = v.double()
    q = torch.ones(vd.shape[1], dtype=torch.float64, device=v.device)
    s = torch.zeros(vd.shape[0], dtype=torch.float64, device=v.device)
    for _ in range(iters):
        s_new = vd @ q / max(float(q @ q), TINY)
        q = vd.T @ s_new / max(float(s_new @ s_new), TINY)
        done = tol > 0 and float((s_new - s).norm()) <= tol * float(s_new.norm())
        s = s_new
        if done:
            break
    return s, q


# --------------------------------------------------------------------------------------------------
# RACS


@dataclass(frozen=True)
class RACSConfig:
    """RACS hyper-parameters (paper defaults: beta 0.9, alpha 0.05, gamma 1.01, eps 1e-8).

    ``lr`` has no single paper value (the paper tunes it in about 1e-3 - 2e-2; the step per entry is
    ``lr * alpha``). ``normalize=False`` replaces the fixed-point statistics by the row/column means of
    ``G (.) G`` (the pytorch-optimizer port's rule, which differs by a per-layer scalar).
    ``adamw_*`` apply to the parameters routed to AdamW.
    """

    lr: float = 1e-2
    beta: float = 0.9
    alpha: float = 0.05
    gamma: float = 1.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    normalize: bool = True
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8

    def __post_init__(self) -> None:
        check_racs_fields("", self)
        check_number("weight_decay", self.weight_decay, 0.0)
        check_bool("normalize", self.normalize)
        object.__setattr__(self, "adamw_betas", check_betas("adamw_betas", self.adamw_betas, 2))
        check_number("adamw_eps", self.adamw_eps, 0.0)


class RACS(LowMemOptimizer):
    """Row And Column Scaled SGD (paper Sec. 4, Algorithm "RACS"); ``torch.optim.Optimizer`` interface.

    Args:
        params: parameters or parameter groups. A group may set any hyper-parameter below and
            ``use_adamw=True`` (AdamW for that group: embeddings, LM head, norms, biases).
        lr: learning rate; the matrix update is ``lr * alpha * eta * G_hat``.
        beta: EMA decay of the row/column statistics ``s``, ``q``.
        alpha: update scale (paper 0.05).
        gamma: norm-growth limit (paper 1.01): ``||update_t|| <= gamma ||update_{t-1}||``.
        eps: added to ``s`` and ``q`` before the inverse square roots (floor of the scaling).
        weight_decay: decoupled weight decay ``W <- (1 - lr wd) W``.
        normalize: the fixed-point statistics of the spec (True) or the row/column means of G^2 (False).
        adamw_betas, adamw_eps: AdamW hyper-parameters for the AdamW-routed tensors.
        nonfinite: ``"skip"`` (skip that tensor's update, warn, record in :attr:`nonfinite_skips`) or
            ``"raise"``.

    State per matrix of shape (m, n): ``s`` (m,), ``q`` (n,), ``phi`` () -- m + n + 1 floats -- plus
    the Python ints ``step`` and the recorded ``shape``.
    """

    method_name = "RACS"
    config_class = RACSConfig

    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9, alpha: float = 0.05, gamma: float = 1.01,
                 eps: float = 1e-8, weight_decay: float = 0.0, normalize: bool = True,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 nonfinite: str = "skip"):
        defaults = dict(lr=lr, beta=beta, alpha=alpha, gamma=gamma, eps=eps, weight_decay=weight_decay,
                        normalize=normalize, use_adamw=False,
                        adamw_betas=tuple(adamw_betas) if isinstance(adamw_betas, list) else adamw_betas,
                        adamw_eps=adamw_eps)
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_method(self, group: dict[str, Any], index: int) -> None:
        where = f"param group {index}: "
        check_unit(f"{where}beta", group["beta"], high_open=True)
        check_positive(f"{where}alpha", group["alpha"])
        check_number(f"{where}gamma", group["gamma"], 1.0)
        check_bool(f"{where}normalize", group["normalize"])

    def _matrix_prepare(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                        step: int) -> tuple[torch.Tensor, Any]:
        # The new statistics and G_hat are computed out of place (s and q are m + n floats), so a
        # NaN/Inf entry of G, which always reaches ||G_hat||_F through the elementwise G_hat, is caught
        # by checking that one scalar before s, q or phi is written.
        dtype = state_dtype(p)
        g = grad.reshape(grad.shape[0], -1).to(dtype)
        m, n = g.shape
        if "s" in state:
            s, q = state["s"], state["q"]
        else:
            s = torch.zeros(m, dtype=dtype, device=p.device)
            q = torch.ones(n, dtype=dtype, device=p.device)
        beta = group["beta"]
        g2 = g.square()
        if group["normalize"]:
            # One warm-started step of the fixed point s = V q / ||q||^2, q = V^T s / ||s||^2 (eq. for
            # the Frobenius-optimal diag(q) (x) diag(s) fit), with V replaced by the EMA of G (.) G.
            s_new, q_new = racs_stats_step(s, q, g2, beta)
        else:
            s_new = torch.lerp(s, g2.mean(dim=1), 1 - beta)
            q_new = torch.lerp(q, g2.mean(dim=0), 1 - beta)
        g_hat = racs_scale(g, s_new, q_new, group["eps"], out=g2)  # reuses the G (.) G buffer
        norm = torch.linalg.vector_norm(g_hat)
        return norm, (s_new, q_new, g_hat, norm)

    def _matrix_apply(self, p: torch.Tensor, ctx: Any, state: dict[str, Any], group: dict[str, Any]) -> None:
        s_new, q_new, g_hat, norm = ctx
        if "s" not in state:
            state["s"], state["q"] = s_new, q_new
            state["phi"] = torch.zeros((), dtype=s_new.dtype, device=s_new.device)
        else:
            state["s"].copy_(s_new)
            state["q"].copy_(q_new)
        phi = state["phi"]
        eta = norm_growth_limit(norm, phi, group["gamma"])
        phi.copy_(eta * norm)
        coeff = eta * (-float(group["lr"]) * group["alpha"])
        if g_hat.dtype == p.dtype:
            p.addcmul_(g_hat.view_as(p), coeff.to(p.dtype))
        else:
            p.add_((g_hat * coeff).view_as(p).to(p.dtype))

def _entry(model: nn.Module, config: RACSConfig | None = None, other_lr: float | None = None) -> RACS:
    """RACS on the model's 2-D block weights and AdamW (``other_lr``, default ``config.lr``) elsewhere."""
    return lowmem_entry(RACS, model, config or RACSConfig(), other_lr)
