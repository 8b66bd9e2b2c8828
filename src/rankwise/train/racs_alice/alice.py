"""Alice: adaptive low-dimensional subspace estimation (Gong, Scetbon, Ma, Meeds, ICLR 2026,
arXiv 2502.07752), the low-rank extension of the SOAP / eigen-Adam structure of the empirical Fisher.

For a weight with gradient ``G`` of shape (m, n) (transposed first when m > n, so that the tracked
side is the smaller one), Alice keeps Adam statistics only in a rank-r eigen-subspace ``U`` (m, r) of
``E[G G^T]`` and compensates the discarded complement with a cheap diagonal scaling. Per step t
(the spec's steps 1-4):

1. switch, at t = 1 and every ``T`` steps: ``Q~ = beta3 U Q U^T + (1-beta3) G G^T``; one step of
   subspace iteration ``U' = QR(Q~ U)``; eigendecompose ``U'^T Q~ U'`` and keep the top-l eigenvectors
   ``U1`` (the leading basis); fill the other r - l columns with ``U2`` = the first r - l columns of
   ``QR(I - U1 U1^T)``; ``U = [U1, U2]``;
2. ``sigma = U^T G`` (r, n); ``Q <- beta3 Q + (1-beta3) sigma sigma^T``; ``M <- beta1 M + (1-beta1) sigma``;
   ``V <- beta2 V + (1-beta2) sigma (.) sigma``;
3. compensation of the residual ``G - U sigma``: ``p <- beta1 p + (1-beta1) colsum((G - U sigma)^2)``
   (= colsum(G^2) - colsum(sigma^2) for orthonormal U), clamped at 1e-8;
   ``C = sqrt(m - r) (G - U sigma) diag(p)^{-1/2}``, limited by the norm-growth limiter (gamma);
4. ``D = U (M / (sqrt(V) + eps)) + alpha_c C``; ``W <- W - lr alpha D``. No bias correction.

Choices (documented in docs/methods/racs_alice.md):

* t = 1 uses the exact top eigenvectors of ``G G^T`` (the converged subspace iteration; there is
  no previous ``U`` to iterate from) when the tracked side m <= 1024; for larger m, 4 steps of block
  subspace iteration on ``G G^T`` (block max(r, l + 10)) from a Gaussian start drawn from a fixed-seed
  generator, then Rayleigh-Ritz (O(m n r) instead of an m x m eigendecomposition). Later switches never form the m x m matrix ``Q~``: ``Q~ U`` and
  ``U'^T Q~ U'`` are computed from U, Q and G in O(m n r), which is the same arithmetic.
* Deterministic sign conventions: eigenvectors have their largest-magnitude entry positive, QR
  factors a positive diagonal of R. ``U2`` is computed as the Gram-Schmidt completion of
  ``[U1, e_1 .. e_{r-l}]`` (identical to the first r - l columns of QR(I - U1 U1^T)); when that
  basis is degenerate (some e_j nearly inside span(U1)), standard basis vectors are taken in order
  and skipped while their residual is below 0.5 / sqrt(m), which always completes the basis.
* ``p`` accumulates ``colsum((G - U sigma)^2)`` computed from the explicit residual (equal to the
  spec's ``colsum(G^2) - colsum(sigma^2)`` for orthonormal U, without its cancellation when a column
  is almost fully captured by U); the update is accumulated into the weight in place (``addmm_``).
* At a switch, ``Q`` is re-expressed in the new basis (``Q <- R Q R^T``, ``R = U_new^T U_old``), so
  ``U Q U^T`` stays the EMA of the tracked covariance; ``M`` and ``V`` are kept (not rotated, not
  reset), as in the reference port.

State per matrix: U (m r), Q (r^2), M, V (r n each), p (n), phi (1): m r + r^2 + 2 r n + n + 1 floats.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rankwise.core.validate import check_bool, check_int, check_number, check_positive
from rankwise.train.lowmem_base import (
    LowMemOptimizer,
    check_betas,
    lowmem_entry,
    norm_growth_limit,
    state_dtype,
    user_stacklevel,
)

__all__ = ["Alice", "AliceConfig", "alice_switch", "complement_basis", "top_eigvecs"]

_P_FLOOR = 1e-8  # clamp of the complement second moment p (spec step 3)
EXACT_INIT_MAX = 1024  # t = 1: exact eigh of G G^T up to this side length
INIT_POWER_ITERS = 4  # above it: block subspace-iteration steps from a fixed-seed Gaussian start


# --------------------------------------------------------------------------------------------------
# pure math


def _fix_columns_sign(u: torch.Tensor) -> torch.Tensor:
    """Flip each column so that its largest-magnitude entry (first one on ties) is positive."""
    if u.numel() == 0:
        return u
    idx = u.abs().argmax(dim=0, keepdim=True)
    sign = torch.sign(torch.gather(u, 0, idx))
    sign[sign == 0] = 1
    return u * sign


def _qr_pos(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced QR with the convention diag(R) >= 0 (deterministic signs)."""
    q, r = torch.linalg.qr(a)
    d = torch.sign(torch.diagonal(r))
    d[d == 0] = 1
    return q * d, r * d.unsqueeze(1)


def top_eigvecs(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k eigenpairs of a symmetric matrix ``a`` (s, s), in descending order, signs fixed.

    Computed in float64 (``eigh``); returns ``(values (k,), vectors (s, k))`` in ``a``'s dtype.
    """
    sym = a.double()
    sym = 0.5 * (sym + sym.T)
    vals, vecs = torch.linalg.eigh(sym)
    order = torch.argsort(vals, descending=True, stable=True)[:k]
    return vals[order].to(a.dtype), _fix_columns_sign(vecs[:, order]).to(a.dtype)


def complement_basis(u1: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` orthonormal columns orthogonal to the orthonormal columns of ``u1`` (m, l).

    The first k columns of ``QR(I - U1 U1^T)`` (computed as the Gram-Schmidt completion of
    ``[U1, e_1..e_k]`` with a positive diagonal of R). Degenerate case (a pivot below 1e-3): greedy
    Gram-Schmidt over ``e_1, e_2, ...`` accepting a vector when its residual exceeds 0.5/sqrt(m),
    which always finds k vectors when ``l + k <= m``. Shape (m, k).
    """
    m, l = u1.shape
    if k < 0 or l + k > m:
        raise ValueError(f"complement_basis: cannot complete {l} columns with k={k} more in dimension {m}")
    if k == 0:
        return u1.new_zeros(m, 0)
    e = torch.eye(m, k, dtype=u1.dtype, device=u1.device)
    a = e - u1 @ u1[:k].T
    a = a - u1 @ (u1.T @ a)  # second orthogonalisation pass against U1
    q, r = _qr_pos(a)
    if float(torch.diagonal(r).min()) > 1e-3:
        q = q - u1 @ (u1.T @ q)
        return _qr_pos(q)[0]
    # degenerate: greedy completion in the standard basis, in order (deterministic)
    tau = 0.5 / math.sqrt(m)
    basis = u1
    found: list[torch.Tensor] = []
    for j in range(m):
        v = torch.zeros(m, dtype=u1.dtype, device=u1.device)
        v[j] = 1
        for _ in range(2):
            v = v - basis @ (basis.T @ v)
        nv = float(v.norm())
        if nv > tau:
            v = v / nv
            found.append(v)
            basis = torch.cat([basis, v.unsqueeze(1)], dim=1)
            if len(found) == k:
                break
    return torch.stack(found, dim=1)


def alice_switch(g: torch.Tensor, u: torch.Tensor | None, q: torch.Tensor | None, beta3: float,
                 leading: int, rank: int) -> torch.Tensor:
    """The subspace switch (spec step 1). Returns the new orthonormal basis ``U`` (m, rank).

    ``g``: gradient (m, n) with m <= n; ``u`` (m, rank) and ``q`` (rank, rank): the current basis and
    projected covariance, or ``None`` at t = 1 (then the top eigenvectors of ``G G^T`` are exact).
    ``Q~ = beta3 U Q U^T + (1-beta3) G G^T`` is never formed: ``Q~ U`` and ``U'^T Q~ U'`` are
    evaluated as products of thin matrices.
    """
    m = g.shape[0]
    if not 1 <= leading <= rank <= m:
        raise ValueError(f"alice_switch: need 1 <= leading ({leading}) <= rank ({rank}) <= m ({m})")
    if u is None and m <= EXACT_INIT_MAX:
        _, u1 = top_eigvecs(g @ g.T, leading)
    elif u is None:
        # large m: block subspace iteration on G G^T from a fixed-seed Gaussian start (O(m n k), no m x m matrix)
        k = min(m, max(rank, leading + 10))
        y = torch.randn(m, k, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(g)
        for _ in range(INIT_POWER_ITERS):
            y = _qr_pos(g @ (g.T @ y))[0]
        gy = g.T @ y
        _, vecs = top_eigvecs(gy.T @ gy, leading)
        u1 = _fix_columns_sign(_qr_pos(y @ vecs)[0])
    else:
        def apply(x: torch.Tensor) -> torch.Tensor:  # Q~ x for x (m, k)
            return beta3 * (u @ (q @ (u.T @ x))) + (1 - beta3) * (g @ (g.T @ x))

        u_prime, _ = _qr_pos(apply(u))
        small = u_prime.T @ apply(u_prime)
        _, vecs = top_eigvecs(small, leading)
        u1 = _fix_columns_sign(u_prime @ vecs)
        u1 = _qr_pos(u1)[0]  # re-orthonormalise (float error of the products)
        u1 = _fix_columns_sign(u1)
    u2 = complement_basis(u1, rank - leading)
    return torch.cat([u1, u2], dim=1)


# --------------------------------------------------------------------------------------------------
# config and optimizer


@dataclass(frozen=True)
class AliceConfig:
    """Alice hyper-parameters, defaults from the paper's settings as ported by pytorch-optimizer.

    lr 0.02, betas (beta1, beta2, beta3) = (0.9, 0.9, 0.999) (beta3 = 0 is Alice-0), alpha 0.3,
    alpha_c 0.4, update_interval T = 200, rank r = 256, leading_basis l = 40, gamma 1.01, eps 1e-8.
    ``strict``: a rank larger than min(m, n) raises instead of being clipped with a warning.
    """

    lr: float = 0.02
    betas: tuple[float, float, float] = (0.9, 0.9, 0.999)
    alpha: float = 0.3
    alpha_c: float = 0.4
    update_interval: int = 200
    rank: int = 256
    leading_basis: int = 40
    gamma: float = 1.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    strict: bool = False

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        object.__setattr__(self, "betas", check_betas("betas", self.betas, 3))
        check_positive("alpha", self.alpha)
        check_number("alpha_c", self.alpha_c, 0.0)
        check_int("update_interval", self.update_interval, 1)
        check_int("rank", self.rank, 1)
        check_int("leading_basis", self.leading_basis, 1, self.rank)
        check_number("gamma", self.gamma, 1.0)
        check_number("eps", self.eps, 0.0)
        check_number("weight_decay", self.weight_decay, 0.0)
        object.__setattr__(self, "adamw_betas", check_betas("adamw_betas", self.adamw_betas, 2))
        check_number("adamw_eps", self.adamw_eps, 0.0)
        check_bool("strict", self.strict)


class Alice(LowMemOptimizer):
    """Alice (paper Algorithm "Alice"); ``torch.optim.Optimizer`` interface.

    Args:
        params: parameters or groups; a group may override every hyper-parameter below (``rank``,
            ``leading_basis``, ``update_interval``, ...) and set ``use_adamw=True``.
        lr, betas, alpha, alpha_c, update_interval, rank, leading_basis, gamma, eps, weight_decay:
            see :class:`AliceConfig` and the module docstring.
        adamw_betas, adamw_eps: AdamW hyper-parameters for AdamW-routed tensors.
        strict: raise (``ValueError``) when ``rank`` exceeds ``min(m, n)`` of a matrix instead of
            clipping it to ``min(m, n)`` with a warning.
        nonfinite: ``"skip"`` or ``"raise"`` on a NaN/Inf gradient (see :class:`~rankwise.train.racs_alice.racs.RACS`).

    The matrix path works on ``G`` (m, n) = ``grad.reshape(dim0, -1)``, transposed when m > n.
    """

    method_name = "Alice"
    config_class = AliceConfig

    def __init__(self, params: Any, lr: float = 0.02, betas: tuple[float, float, float] = (0.9, 0.9, 0.999),
                 alpha: float = 0.3, alpha_c: float = 0.4, update_interval: int = 200, rank: int = 256,
                 leading_basis: int = 40, gamma: float = 1.01, eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8, strict: bool = False,
                 nonfinite: str = "skip"):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, alpha=alpha,
                        alpha_c=alpha_c, update_interval=update_interval, rank=rank, leading_basis=leading_basis,
                        gamma=gamma, eps=eps, weight_decay=weight_decay, use_adamw=False,
                        adamw_betas=tuple(adamw_betas) if isinstance(adamw_betas, list) else adamw_betas,
                        adamw_eps=adamw_eps)
        super().__init__(params, defaults, nonfinite=nonfinite, strict=strict)

    def _validate_method(self, group: dict[str, Any], index: int) -> None:
        where = f"param group {index}: "
        check_betas(f"{where}betas", group["betas"], 3)
        check_positive(f"{where}alpha", group["alpha"])
        check_number(f"{where}alpha_c", group["alpha_c"], 0.0)
        check_int(f"{where}update_interval", group["update_interval"], 1)
        rank = check_int(f"{where}rank", group["rank"], 1)
        check_int(f"{where}leading_basis", group["leading_basis"], 1, rank)
        check_number(f"{where}gamma", group["gamma"], 1.0)

    def _check_param(self, p: torch.Tensor, group: dict[str, Any], index: int) -> None:
        rows = p.shape[0]
        cols = p.numel() // max(rows, 1)
        small = min(rows, cols)
        if group["rank"] > small:
            msg = (f"Alice: param group {index}: rank={group['rank']} exceeds min(m, n)={small} of a parameter "
                   f"of shape {tuple(p.shape)}")
            if self.strict:
                raise ValueError(msg + f"; use rank <= {small} (or strict=False to clip)")
            warnings.warn(msg + f"; it is clipped to {small} for that parameter", UserWarning, stacklevel=user_stacklevel())

    @staticmethod
    def _ranks(group: dict[str, Any], m: int) -> tuple[int, int]:
        r = min(group["rank"], m)
        return r, min(group["leading_basis"], r)

    def _matrix_prepare(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                        step: int) -> tuple[torch.Tensor, Any]:
        # Nothing is written here. The finiteness check rides on reductions the step needs anyway: the
        # column energies of the residual G - U sigma (elementwise in G, so every NaN/Inf entry reaches
        # them) when r < m, else the trace of sigma sigma^T (U square orthogonal: every entry of G
        # reaches sigma). A switch step (t = 1, then every T steps; eigendecompositions that must not
        # see a NaN) checks G itself first: one extra pass every T steps instead of every step.
        dtype = state_dtype(p)
        g = grad.reshape(grad.shape[0], -1).to(dtype)
        transposed = g.shape[0] > g.shape[1]
        if transposed:
            g = g.T
        m, n = g.shape
        r, lead = self._ranks(group, m)
        beta3 = group["betas"][2]
        first = "U" not in state
        switch = first or step % group["update_interval"] == 0
        if switch:
            total = g.sum()
            if not bool(torch.isfinite(total)):
                return total, None
        if first:
            u, qmat = alice_switch(g, None, None, beta3, lead, r), None
        elif switch:
            u_old = state["U"]
            u = alice_switch(g, u_old, state["Q"], beta3, lead, r)
            rot = u.T @ u_old
            qmat = rot @ state["Q"] @ rot.T
        else:
            u, qmat = state["U"], state["Q"]
        sigma = u.T @ g
        ssq = sigma @ sigma.T
        resid = colsum = None
        if m > r:
            # Compensation (spec step 3) from the explicit residual R = G - U sigma: its column energies
            # colsum(R^2) equal colsum(G^2) - colsum(sigma^2) for orthonormal U, but the direct form does
            # not lose the small residual of a well-captured column to cancellation.
            resid = g - u @ sigma
            colsum = resid.square().sum(dim=0)
            check = colsum.sum()
        else:
            check = torch.trace(ssq)
        return check, (g, transposed, first, switch, u, qmat, sigma, ssq, resid, colsum)

    def _matrix_apply(self, p: torch.Tensor, ctx: Any, state: dict[str, Any], group: dict[str, Any]) -> None:
        g, transposed, first, switch, u_new, qmat, sigma, ssq, resid, colsum = ctx
        dtype = g.dtype
        m, n = g.shape
        r = u_new.shape[1]
        beta1, beta2, beta3 = group["betas"]
        if first:
            state["Q"] = torch.zeros(r, r, dtype=dtype, device=p.device)
            state["M"] = torch.zeros(r, n, dtype=dtype, device=p.device)
            state["V"] = torch.zeros(r, n, dtype=dtype, device=p.device)
            state["p"] = torch.zeros(n, dtype=dtype, device=p.device)
            state["phi"] = torch.zeros((), dtype=dtype, device=p.device)
            state["U"] = u_new
        elif switch:
            state["Q"] = qmat
            state["U"] = u_new
        u, q, mom, var, pc, phi = (state[k] for k in ("U", "Q", "M", "V", "p", "phi"))
        q.mul_(beta3).add_(ssq, alpha=1 - beta3)
        mom.lerp_(sigma, 1 - beta1)
        var.mul_(beta2).addcmul_(sigma, sigma, value=1 - beta2)
        k = math.sqrt(m - r) if m > r else 0.0
        scale = -float(group["lr"]) * group["alpha"]
        inner = mom / (var.sqrt() + group["eps"]) * scale  # (r, n)
        pv = p.view(p.shape[0], -1) if p.is_contiguous() and p.dtype == dtype else None
        if pv is not None and transposed:
            pv = pv.T
        if k > 0:
            pc.mul_(beta1).add_(colsum, alpha=1 - beta1).clamp_(min=_P_FLOOR)
            d = torch.rsqrt(pc)
            resid.mul_(d.unsqueeze(0))  # R D
            norm = k * torch.linalg.vector_norm(resid)
            eta = norm_growth_limit(norm, phi, group["gamma"])
            phi.copy_(eta * norm)
            coeff = eta * (k * group["alpha_c"] * scale)  # C = eta k R D enters the update with alpha_c
        else:  # r = min(m, n): the compensation is exactly zero
            pc.mul_(beta1).clamp_(min=_P_FLOOR)
            phi.zero_()
        if pv is not None:
            pv.addmm_(u, inner)  # W <- W - lr alpha U (M / (sqrt(V) + eps)), in place
            if k > 0:
                pv.add_(resid.mul_(coeff))  # ... - lr alpha alpha_c C
        else:
            update = u @ inner
            if k > 0:
                update.add_(resid.mul_(coeff))
            if transposed:
                update = update.T
            p.add_(update.reshape(p.shape).to(p.dtype))


def _entry(model: nn.Module, config: AliceConfig | None = None, other_lr: float | None = None) -> Alice:
    """Alice on the model's 2-D block weights and AdamW (``other_lr``, default ``config.lr``) elsewhere."""
    return lowmem_entry(Alice, model, config or AliceConfig(), other_lr)
