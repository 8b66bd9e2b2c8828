"""LoRA-S (Zheng & Wu, ICLR 2026): LoRA optimizers through the horizontal lift of an X-space direction.

A LoRA increment ``X = M N^T`` (``M`` (m, r), ``N`` (n, r)) is unchanged by ``(M, N) -> (M R, N R^{-T})``
for any ``R`` in GL(r). LoRA-S lets a base optimizer choose a direction ``D`` (m, n) on ``X`` from the
gradient ``G_X = dL/dX`` and maps ``D`` back to the factors by the horizontal lift of the quotient
``R_*^{m x r} x R_*^{n x r} / GL(r)`` (paper Alg. 1, Def. 2, Prop. 1, Thm. 1)::

    Gm = M^T M,  Gn = N^T N,  C = M^T D N,  P = Gm Gn                                  (all r x r)
    P K + K P = C                                                  (the Sylvester "decay" equation)
    dM = (D N - M Gn K) Gn^{-1},     dN = (D^T M - N Gm K^T) Gm^{-1}                    (the lift)
    M <- M - lr dM,   N <- N - lr dN                                               (simultaneous)

The lifted pair satisfies ``dM N^T + M dN^T = P_T(D) = P_U D + D P_V - P_U D P_V`` (first-order move of
X is the Riemannian step with the embedded metric), ``M^T dM = K Gm``, ``dN^T N = Gn K`` and is
equivariant: lifting at ``(M R, N R^{-T})`` gives ``(dM R, dN R^{-T})``. Because ``D`` is computed from
``G_X`` alone, the X trajectory does not depend on how X is factorised (Thm. 1).

Two instances (both are ``torch.optim.Optimizer`` subclasses):

* :class:`AdamS` -- ``D = m_hat / (sqrt(v_hat) + eps)`` with Euclidean Adam moments of ``G_X`` (the
  paper's Eq. 35 reading; state 2 m n floats per adapted matrix); no weight decay.
* :class:`LRACS` -- ``D = alpha * eta * diag(s+eps)^{-1/2} G_X diag(q+eps)^{-1/2}`` with the RACS
  row/column statistics ``s`` (m), ``q`` (n) and RACS's norm-growth limiter ``eta`` (state m + n + 1).

Mapping to a LoRA layer ``delta_W = s_l B A`` (rankwise :class:`~rankwise.core.lora.LoraLinear` or a PEFT
LoRA layer; ``A`` (r, in), ``B`` (out, r), ``s_l = alpha / r``): ``M = s_l B`` (m = out), ``N = A^T``
(n = in). ``G_X = sum_tokens grad_out^T x_in`` is captured by forward hooks on ``lora_A``/``lora_B`` and a
tensor hook on ``lora_B``'s output (see :class:`GradXCapture`); after the lift ``B <- B - lr dM / s_l``
and ``A <- A - lr dN^T``. Non-LoRA trainable parameters (head, biases) passed as ``other_params`` are
updated by Adam/AdamW (torch semantics).

Numerics (floors): the r x r algebra (Grams, ``C``, Sylvester, Gram inverses) runs in float64; the
(m, n) products in ``lift_dtype`` (default float32, float64 for float64 parameters). A Gram whose
smallest eigenvalue is ``<= rcond * largest`` (default ``rcond = 1e-10``) or zero makes the lift
undefined (rank-deficient factors, e.g. PEFT's ``B = 0``): :class:`~rankwise.core.errors.NumericalError`
suggesting :func:`offset_init_` or ``ridge > 0``. With ``ridge = delta > 0`` the Grams become
``Gm + delta tr(Gn)/r I`` and ``Gn + delta tr(Gm)/r I`` (the spec's "peft" option, 1e-3; invariance is
then approximate). A non-finite ``K`` skips that pair's step with a warning (once per pair).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.registry import register
from rankwise.core.validate import check_bool, check_choice, check_number, check_positive, check_unit
from rankwise.train.lowmem_base import (FromConfig, adamw_step, check_betas, check_racs_fields, closure_loss,
                                         norm_growth_limit, racs_scale, racs_stats_step_)

__all__ = [
    "AdamS",
    "AdamSConfig",
    "GradXCapture",
    "LRACS",
    "LRACSConfig",
    "LoraPair",
    "horizontal_lift",
    "lora_factor_pairs",
    "offset_init_",
    "solve_gram_sylvester",
    "tangent_projection",
]

_TINY = 1e-30  # floor of a Gram's smallest eigenvalue when its largest is 0


# --------------------------------------------------------------------------------------------------
# pure math


def _gram_eigh(g: torch.Tensor, rcond: float, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric PSD Gram (float64) with the rank-deficiency floor."""
    lam, u = torch.linalg.eigh(0.5 * (g + g.T))
    top = float(lam[-1]) if lam.numel() else 0.0
    if not math.isfinite(top) or float(lam[0]) <= max(rcond * top, _TINY):
        raise NumericalError(
            f"{what} is rank-deficient or not finite (eigenvalues in [{float(lam[0]):.3e}, {top:.3e}], floor "
            f"rcond={rcond:g} x largest): the horizontal lift needs full-rank factors. Use offset_init_ "
            "(balanced full-rank factors, output unchanged) or a Gram ridge (ridge=1e-3)")
    return lam, u


def solve_gram_sylvester(gm: torch.Tensor, gn: torch.Tensor, c: torch.Tensor, rcond: float = 1e-10) -> torch.Tensor:
    """Solve ``P K + K P = C`` with ``P = Gm Gn`` (Alg. 1 step 2); all r x r, Gm and Gn SPD.

    O(r^3) eigen solver: ``S = Gm^{1/2}``; ``S Gn S = U diag(lam) U^T``; ``T = S U`` and
    ``T^{-1} = U^T S^{-1}`` diagonalise ``P = T diag(lam) T^{-1}``, so
    ``K = T [(T^{-1} C T) / (lam_i + lam_j)] T^{-1}``. Computed in float64 and returned in ``c``'s dtype.
    ``P`` is similar to an SPD matrix, so ``lam > 0`` and K is unique. A Gram with eigenvalues at or below
    ``rcond x`` its largest raises :class:`NumericalError`.
    """
    for name, t in (("Gm", gm), ("Gn", gn), ("C", c)):
        if t.ndim != 2 or t.shape[0] != t.shape[1]:
            raise ValueError(f"{name} must be a square r x r matrix, got shape {tuple(t.shape)}")
    if not (gm.shape == gn.shape == c.shape):
        raise ValueError(f"Gm {tuple(gm.shape)}, Gn {tuple(gn.shape)} and C {tuple(c.shape)} must have one shape")
    gm64, gn64, c64 = gm.double(), gn.double(), c.double()
    mu, w = _gram_eigh(gm64, rcond, "Gm = M^T M")
    sq = mu.sqrt()
    s_half = (w * sq) @ w.T
    s_inv_half = (w / sq) @ w.T
    _gram_eigh(gn64, rcond, "Gn = N^T N")
    lam, u = torch.linalg.eigh(s_half @ gn64 @ s_half)
    t = s_half @ u
    t_inv = u.T @ s_inv_half
    kt = (t_inv @ c64 @ t) / (lam[:, None] + lam[None, :])
    return (t @ kt @ t_inv).to(c.dtype)


def horizontal_lift(m: torch.Tensor, n: torch.Tensor, d: torch.Tensor, *, rcond: float = 1e-10,
                    ridge: float = 0.0, dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Horizontal lift of an X-space direction ``D`` (m, n) at ``(M, N)`` (Alg. 1 steps 1-3).

    Args:
        m: M, shape (m, r). n: N, shape (n, r). d: D, shape (m, n).
        rcond: relative eigenvalue floor of the Grams (below it: :class:`NumericalError`).
        ridge: Gram ridge ``delta``: ``Gm + delta tr(Gn)/r I``, ``Gn + delta tr(Gm)/r I`` (0: exact lift).
        dtype: dtype of the (m, n)-sized products (default: promote(M.dtype, float32)).
    Returns:
        ``(dM (m, r), dN (n, r), K (r, r))`` with ``dM = (D N - M Gn K) Gn^{-1}``,
        ``dN = (D^T M - N Gm K^T) Gm^{-1}``; ``K`` in float64.
    """
    if m.ndim != 2 or n.ndim != 2 or d.ndim != 2 or m.shape[1] != n.shape[1] \
            or d.shape != (m.shape[0], n.shape[0]):
        raise ValueError(f"horizontal_lift: M {tuple(m.shape)}, N {tuple(n.shape)}, D {tuple(d.shape)} do not fit "
                         "(expected M (m, r), N (n, r), D (m, n))")
    dt = dtype or torch.promote_types(m.dtype, torch.float32)
    m_, n_, d_ = m.to(dt), n.to(dt), d.to(dt)
    r = m.shape[1]
    gm = (m_.T @ m_).double()
    gn = (n_.T @ n_).double()
    if ridge > 0:
        tm, tn = float(torch.trace(gm)), float(torch.trace(gn))
        eye = torch.eye(r, dtype=torch.float64, device=gm.device)
        gm, gn = gm + (ridge * tn / r) * eye, gn + (ridge * tm / r) * eye
    dn = d_ @ n_           # D N      (m, r)
    dtm = d_.T @ m_        # D^T M    (n, r)
    c = m_.double().T @ dn.double()  # C = M^T D N  (r, r)
    k = solve_gram_sylvester(gm, gn, c, rcond)
    # dM = (D N - M Gn K) Gn^{-1}  ->  solve Gn Z^T = (...)^T (Gn symmetric)
    rhs_m = dn.double() - m_.double() @ (gn @ k)
    rhs_n = dtm.double() - n_.double() @ (gm @ k.T)
    d_m = torch.linalg.solve(gn, rhs_m.T).T
    d_n = torch.linalg.solve(gm, rhs_n.T).T
    return d_m.to(dt), d_n.to(dt), k


def tangent_projection(m: torch.Tensor, n: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``P_T(D) = P_U D + D P_V - P_U D P_V`` with ``P_U = M Gm^{-1} M^T``, ``P_V = N Gn^{-1} N^T`` (float64)."""
    m64, n64, d64 = m.double(), n.double(), d.double()
    pu = m64 @ torch.linalg.solve(m64.T @ m64, m64.T)
    pv = n64 @ torch.linalg.solve(n64.T @ n64, n64.T)
    return pu @ d64 + d64 @ pv - pu @ d64 @ pv


# --------------------------------------------------------------------------------------------------
# LoRA factor pairs and the G_X hooks


@dataclass(eq=False)
class LoraPair:
    """One adapted matrix: ``delta_W = scale * B @ A`` with ``A`` (r, in), ``B`` (out, r).

    ``module`` is the LoRA layer (rankwise ``LoraLinear`` or PEFT ``LoraLayer``), ``adapter`` the
    adapter name, ``name`` the layer's qualified name (used in messages and in :attr:`AdamS.last_K`).
    """

    name: str
    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scale: float
    module: nn.Module | None = None
    adapter: str = "default"

    def check(self) -> None:
        a, b = self.lora_A, self.lora_B
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            raise TypeError(f"LoRA pair {self.name!r}: lora_A and lora_B must be tensors")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA pair {self.name!r}: shape mismatch, lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; expected A (r, in) and B (out, r) with the same r")
        if not a.is_floating_point() or not b.is_floating_point():
            raise TypeError(f"LoRA pair {self.name!r}: factors must be floating point, got {a.dtype}, {b.dtype}")
        if not math.isfinite(float(self.scale)) or float(self.scale) == 0.0:
            raise ValueError(f"LoRA pair {self.name!r}: scale must be finite and non-zero, got {self.scale!r}")


def lora_factor_pairs(model: nn.Module, adapter: str | None = None) -> list[LoraPair]:
    """``LoraPair`` of every LoRA layer of ``model`` (rankwise ``LoraLinear`` or PEFT ``LoraLayer``).

    A LoRA layer is any module with ``lora_A``/``lora_B`` ``nn.ModuleDict`` attributes and a ``scaling``
    dict (the layout rankwise and PEFT share). ``adapter``: the adapter to optimise (default: each
    layer's active adapters). Unpaired factors (an adapter in ``lora_A`` but not ``lora_B`` or vice
    versa), shape mismatches and DoRA layers raise ``ValueError`` naming the module; no LoRA layer at
    all raises :class:`RankwiseError`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"lora_factor_pairs: model must be an nn.Module, got {type(model).__name__}")
    pairs: list[LoraPair] = []
    for mname, mod in model.named_modules():
        la, lb = getattr(mod, "lora_A", None), getattr(mod, "lora_B", None)
        if not isinstance(la, nn.ModuleDict) and not isinstance(lb, nn.ModuleDict):
            continue
        if not isinstance(la, nn.ModuleDict) or not isinstance(lb, nn.ModuleDict):
            raise ValueError(f"module {mname!r} has only one of lora_A / lora_B: unpaired LoRA factors")
        if set(la.keys()) != set(lb.keys()):
            raise ValueError(f"module {mname!r}: unpaired LoRA factors, lora_A has {sorted(la.keys())} and "
                             f"lora_B has {sorted(lb.keys())}")
        if adapter is not None:
            names = [adapter] if adapter in la else []
        else:
            active = getattr(mod, "active_adapters", None)
            active = [active] if isinstance(active, str) else list(active or [])
            names = [a for a in active if a in la]
        if getattr(mod, "disabled", False) or getattr(mod, "disable_adapters", False) is True:
            names = []
        for a in names:
            if getattr(mod, "use_dora", {}).get(a, False):
                raise ValueError(f"module {mname!r}, adapter {a!r}: DoRA layers are not plain LoRA pairs; "
                                 "the LoRA-S lift applies to delta_W = s B A only")
            wa, wb = getattr(la[a], "weight", None), getattr(lb[a], "weight", None)
            if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor):
                raise ValueError(f"module {mname!r}, adapter {a!r}: lora_A/lora_B are not Linear-like "
                                 "(no .weight); only Linear LoRA layers are supported")
            pair = LoraPair(mname or "<root>", wa, wb, float(mod.scaling[a]), mod, a)
            pair.check()
            if pair.lora_B.shape[0] != getattr(mod, "out_features", wb.shape[0]) \
                    or pair.lora_A.shape[1] != getattr(mod, "in_features", wa.shape[1]):
                raise ValueError(f"module {mname!r}: factors A {tuple(wa.shape)}, B {tuple(wb.shape)} do not fit "
                                 f"the layer (in={getattr(mod, 'in_features', '?')}, "
                                 f"out={getattr(mod, 'out_features', '?')})")
            pairs.append(pair)
    if not pairs:
        raise RankwiseError("lora_factor_pairs: the model has no active LoRA layer (rankwise LoraLinear or PEFT "
                            f"LoraLayer){'' if adapter is None else f' with adapter {adapter!r}'}")
    return pairs


@torch.no_grad()
def offset_init_(model: nn.Module, pairs: Sequence[LoraPair] | None = None, seed: int = 0, std: float = 0.02) -> None:
    """The spec's "offset init": ``A, B ~ N(0, std^2)`` i.i.d. (balanced, full rank), and
    ``W0 <- W0 - s B0 A0`` so that the model output is unchanged at step 0.

    The base weight is ``module.base_layer.weight`` (rankwise and PEFT layers both have it). Factors are
    drawn on CPU from ``torch.Generator().manual_seed(seed)`` in pair order. All-or-nothing.
    """
    pairs = list(lora_factor_pairs(model) if pairs is None else pairs)
    check_positive("std", std)
    gen = torch.Generator().manual_seed(int(seed))
    plan = []
    for p in pairs:
        base = getattr(p.module, "base_layer", None)
        w = getattr(base, "weight", None)
        if not isinstance(w, torch.Tensor) or w.shape != (p.lora_B.shape[0], p.lora_A.shape[1]):
            raise ValueError(f"offset_init_: module {p.name!r} has no base_layer.weight of shape "
                             f"{(p.lora_B.shape[0], p.lora_A.shape[1])}")
        if getattr(p.module, "merged_adapters", None) or getattr(p.module, "merged", False) is True:
            raise RankwiseError(f"offset_init_: module {p.name!r} has merged adapters; unmerge first")
        a0 = torch.randn(p.lora_A.shape, generator=gen, dtype=torch.float64) * std
        b0 = torch.randn(p.lora_B.shape, generator=gen, dtype=torch.float64) * std
        plan.append((p, w, a0, b0))
    for p, w, a0, b0 in plan:
        w.copy_((w.double() - p.scale * (b0 @ a0)).to(w.dtype))
        p.lora_A.copy_(a0.to(p.lora_A.dtype))
        p.lora_B.copy_(b0.to(p.lora_B.dtype))


class GradXCapture:
    """Forward/backward hooks that accumulate ``G_X = dL/d(delta_W)`` (out, in) for each LoRA pair.

    ``delta_W = s B A`` enters the layer as ``y += s B (A x)``: a forward hook on ``lora_A`` keeps its
    input ``x`` (after dropout), a forward hook on ``lora_B`` registers a tensor hook on its output
    ``u = B A x`` whose gradient is ``s grad_y``, so ``G_X += (1/s) sum_tokens grad_u^T x`` (accumulated
    in float32 or wider, like ``.grad``). :meth:`clear` resets (the optimizers call it in ``zero_grad``).
    """

    def __init__(self, pairs: Sequence[LoraPair]):
        self.pairs = list(pairs)
        self.grads: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        for i, p in enumerate(self.pairs):
            if p.module is None:
                raise ValueError(f"LoRA pair {p.name!r} has no module: G_X capture needs the LoRA layer")
            la, lb = p.module.lora_A[p.adapter], p.module.lora_B[p.adapter]
            self._handles.append(la.register_forward_hook(self._fwd_a(i)))
            self._handles.append(lb.register_forward_hook(self._fwd_b(i)))

    def _fwd_a(self, i: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, inputs: tuple[Any, ...], _out: Any) -> None:
            self._inputs[i] = inputs[0].detach()
        return hook

    def _fwd_b(self, i: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            x = self._inputs.pop(i, None)
            if x is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            scale = self.pairs[i].scale

            def grad_hook(g: torch.Tensor) -> None:
                dt = torch.promote_types(g.dtype, torch.float32)
                gx = g.reshape(-1, g.shape[-1]).to(dt).T @ x.reshape(-1, x.shape[-1]).to(dt)
                gx.div_(scale)
                prev = self.grads.get(i)
                self.grads[i] = gx if prev is None else prev.add_(gx)
            out.register_hook(grad_hook)
        return hook

    def clear(self) -> None:
        self.grads.clear()
        self._inputs.clear()

    def remove(self) -> None:
        """Remove the hooks (the optimizer stops receiving G_X)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()


# --------------------------------------------------------------------------------------------------
# the optimizers


class _LiftedOptimizer(FromConfig, torch.optim.Optimizer):
    """Shared machinery of AdamS and LRACS: pair groups, G_X capture, lift, Adam on other parameters.

    Param groups: one per LoRA pair (``kind="lora"``, ``params=[A, B]``, ``pair``: name, ``scale``) and
    at most one ``kind="other"`` group updated by Adam (``other_weight_decay``: decoupled, AdamW).
    """

    method_name = "lifted"

    def __init__(self, params: nn.Module | Sequence[LoraPair], defaults: dict[str, Any],
                 other_params: Iterable[nn.Parameter] | None, other_lr: float | None,
                 other_weight_decay: float, nonfinite: str, capture: bool):
        check_choice("nonfinite", nonfinite, ("raise", "skip"))
        check_positive("lr", defaults["lr"])
        check_number("rcond", defaults["rcond"], 0.0)
        check_number("ridge", defaults["ridge"], 0.0)
        check_number("other_weight_decay", other_weight_decay, 0.0)
        check_positive("other_lr", other_lr, allow_none=True)
        if defaults["lift_dtype"] not in (None, torch.float32, torch.float64):
            raise ValueError(f"lift_dtype={defaults['lift_dtype']!r} must be None, torch.float32 or torch.float64")
        if isinstance(params, nn.Module):
            model = params
            pairs = lora_factor_pairs(model)
            if other_params is None:
                ids = {id(t) for p in pairs for t in (p.lora_A, p.lora_B)}
                other_params = [t for t in model.parameters() if t.requires_grad and id(t) not in ids]
        else:
            pairs = list(params)
            if not pairs:
                raise ValueError(f"{self.method_name}: got an empty list of LoRA pairs")
            for p in pairs:
                if not isinstance(p, LoraPair):
                    raise TypeError(f"{self.method_name}: expected LoraPair items (from lora_factor_pairs) or a "
                                    f"model, got {type(p).__name__}")
                p.check()
        seen: set[int] = set()
        for p in pairs:
            for t in (p.lora_A, p.lora_B):
                if id(t) in seen:
                    raise ValueError(f"{self.method_name}: a factor of pair {p.name!r} appears in two pairs")
                seen.add(id(t))
        self.pairs = pairs
        groups: list[dict[str, Any]] = [{"params": [p.lora_A, p.lora_B], "kind": "lora", "pair": p.name,
                                         "scale": float(p.scale)} for p in pairs]
        others = [t for t in (other_params or []) if id(t) not in seen]
        if others:
            for t in others:
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise TypeError(f"{self.method_name}: other_params must be floating-point tensors")
            groups.append({"params": others, "kind": "other",
                           "lr": defaults["lr"] if other_lr is None else other_lr,
                           "weight_decay": other_weight_decay})
        self.nonfinite = nonfinite
        #: per pair name: the last r x r decay matrix K (float64), for logging.
        self.last_K: dict[str, torch.Tensor] = {}
        self.skipped: list[tuple[int, str, str]] = []  # (step, pair, reason)
        self._warned: set[str] = set()
        super().__init__(groups, defaults)
        self._frozen_pairs = True
        self.capture = GradXCapture(pairs) if capture else None
        self._manual: dict[int, torch.Tensor] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("kind", "other")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        try:
            lr = g["lr"]
            check_positive(f"param group {len(self.param_groups) - 1}: lr", float(lr) if isinstance(lr, torch.Tensor) else lr)
            if g["kind"] not in ("lora", "other"):
                raise ValueError(f"param group kind={g['kind']!r} must be 'lora' or 'other'")
            if g["kind"] == "lora" and getattr(self, "_frozen_pairs", False):
                raise ValueError("LoRA pair groups are fixed at construction (they carry G_X hooks); build a new "
                                 "optimizer to add pairs, or add non-LoRA parameters with kind='other'")
            if g["kind"] == "lora" and len(g["params"]) != 2:
                raise ValueError(f"a LoRA group must hold exactly [lora_A, lora_B], got {len(g['params'])} tensors")
            self._validate_group(g)
        except Exception:
            self.param_groups.pop()
            raise

    def _validate_group(self, g: dict[str, Any]) -> None:  # pragma: no cover - overridden
        pass

    def set_grad_x(self, pair: int | str, grad_x: torch.Tensor) -> None:
        """Provide ``G_X`` (out, in) for a pair by index or name (instead of / in addition to the hooks)."""
        i = pair if isinstance(pair, int) else [p.name for p in self.pairs].index(pair)
        prev = self._manual.get(i)
        self._manual[i] = grad_x.detach().clone() if prev is None else prev + grad_x.detach()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self.capture is not None:
            self.capture.clear()
        self._manual.clear()

    def _grad_x(self, i: int) -> torch.Tensor | None:
        g = self._manual.get(i)
        if g is None and self.capture is not None:
            g = self.capture.grads.get(i)
        return g

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: Adam on ``other`` groups, lifted updates on every LoRA pair with a captured ``G_X``."""
        loss = closure_loss(closure)
        pi = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise TypeError(f"{self.method_name} does not support sparse gradients (parameter of shape "
                                    f"{tuple(p.shape)}); use dense gradients")
            if group["kind"] == "other":
                self._other_step(group)
                continue
            i, pi = pi, pi + 1
            pair = self.pairs[i]
            a, b = group["params"]
            gx = self._grad_x(i)
            if gx is None:
                if a.grad is not None or b.grad is not None:
                    raise RankwiseError(
                        f"{self.method_name}: pair {pair.name!r} has factor gradients but no captured G_X; the "
                        "layer's LoRA branch must run through lora_A/lora_B modules (not merged) after the optimizer "
                        "was created, or call set_grad_x")
                continue
            if gx.is_sparse:
                raise TypeError(f"{self.method_name}: sparse G_X for pair {pair.name!r} is not supported")
            if gx.shape != (b.shape[0], a.shape[1]):
                raise ValueError(f"{self.method_name}: G_X for pair {pair.name!r} has shape {tuple(gx.shape)}, "
                                 f"expected {(b.shape[0], a.shape[1])}")
            state = self.state[a]
            step = int(state.get("step", 0)) + 1
            # one reduction instead of an elementwise pass: NaN/Inf propagate into the sum
            if not bool(torch.isfinite(gx.sum())):
                msg = f"{self.method_name}: non-finite gradient (NaN/Inf) for LoRA pair {pair.name!r} at step {step}"
                if self.nonfinite == "raise":
                    raise NumericalError(msg + " (pass nonfinite='skip' to skip such steps)")
                self.skipped.append((step, pair.name, "nonfinite gradient"))
                self._warn_once("g" + pair.name, msg + "; its update is skipped")
                continue
            dt = group["lift_dtype"] or torch.promote_types(a.dtype, torch.float32)
            state["step"] = step
            direction = self._direction(gx.to(dt), state, group)
            scale = float(group["scale"])
            m_ = b.to(dt) * scale            # M = s B  (out, r)
            n_ = a.to(dt).T                  # N = A^T  (in, r)
            d_m, d_n, k = horizontal_lift(m_, n_, direction, rcond=group["rcond"], ridge=group["ridge"], dtype=dt)
            if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(d_m).all())
                    and bool(torch.isfinite(d_n).all())):
                self.skipped.append((step, pair.name, "nonfinite K"))
                self._warn_once("k" + pair.name, f"{self.method_name}: non-finite Sylvester solution K for pair "
                                                 f"{pair.name!r} at step {step}; the lift is skipped for this pair")
                continue
            self.last_K[pair.name] = k
            lr = float(group["lr"])
            b.sub_((d_m * (lr / scale)).to(b.dtype))
            a.sub_((d_n.T * lr).to(a.dtype))
        return loss

    def _direction(self, gx: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    def _other_step(self, group: dict[str, Any]) -> None:
        """Adam/AdamW (torch semantics) for non-LoRA parameters (:func:`~rankwise.train.lowmem_base.adamw_step`)."""
        g = {"lr": group["lr"], "adamw_betas": group["other_betas"], "adamw_eps": group["other_eps"]}
        for p in group["params"]:
            if p.grad is None:
                continue
            if not bool(torch.isfinite(p.grad).all()):
                msg = f"{self.method_name}: non-finite gradient (NaN/Inf) for a non-LoRA parameter of shape {tuple(p.shape)}"
                if self.nonfinite == "raise":
                    raise NumericalError(msg)
                self._warn_once(f"o{id(p)}", msg + "; its update is skipped")
                continue
            st = self.state[p]
            st["step"] = int(st.get("step", 0)) + 1
            if group.get("weight_decay", 0.0):
                p.mul_(1.0 - float(group["lr"]) * group["weight_decay"])
            adamw_step(p, p.grad, st, g)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key in ("betas", "other_betas"):
                if key in group:
                    group[key] = tuple(group[key])

    def remove_hooks(self) -> None:
        """Detach the G_X hooks from the model (call when done training)."""
        if self.capture is not None:
            self.capture.remove()


@dataclass(frozen=True)
class AdamSConfig:
    """AdamS hyper-parameters. Defaults are a choice (the paper gives no table): Adam's b1 = 0.9,
    b2 = 0.999, eps = 1e-8, bias correction on; no weight decay (the Sylvester term replaces it).
    ``lr`` is a per-entry step on X (spec: sweep {1e-3, 3e-3, 1e-2}). ``ridge`` and ``rcond``: the Gram
    floors of :func:`horizontal_lift`."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    bias_correction: bool = True
    rcond: float = 1e-10
    ridge: float = 0.0

    def __post_init__(self) -> None:
        check_positive("AdamSConfig.lr", self.lr)
        object.__setattr__(self, "betas", check_betas("AdamSConfig.betas", self.betas, 2))
        check_number("AdamSConfig.eps", self.eps, 0.0)
        check_bool("AdamSConfig.bias_correction", self.bias_correction)
        check_number("AdamSConfig.rcond", self.rcond, 0.0)
        check_number("AdamSConfig.ridge", self.ridge, 0.0)


class AdamS(_LiftedOptimizer):
    """Adam-Sylvester: Adam's direction on X = s B A, lifted horizontally to (B, A) (LoRA-S, Alg. 1 + Eq. 35).

    Per pair and step: ``m <- b1 m + (1-b1) G_X``, ``v <- b2 v + (1-b2) G_X^2`` (state (out, in) each),
    ``D = m_hat / (sqrt(v_hat) + eps)``, ``(dM, dN) = lift(D)``, ``B <- B - lr dM / s``, ``A <- A - lr dN^T``.

    Args:
        params: a model (its LoRA pairs are found with :func:`lora_factor_pairs`, every other trainable
            parameter goes to Adam unless ``other_params`` is given) or a list of :class:`LoraPair`.
        lr, betas, eps, bias_correction, rcond, ridge: see :class:`AdamSConfig`.
        other_params: non-LoRA parameters, updated by Adam(W) with ``other_lr`` (default ``lr``),
            ``other_betas``, ``other_eps``, ``other_weight_decay``.
        lift_dtype: dtype of the (m, n) work (None: promote(param, float32)).
        nonfinite: ``"raise"`` (NumericalError naming the pair) or ``"skip"`` (skip, warn once, record in
            :attr:`skipped`) for NaN/Inf gradients.
        capture: install the :class:`GradXCapture` hooks (False: feed ``G_X`` with :meth:`set_grad_x`).
    """

    method_name = "AdamS"
    config_class = AdamSConfig

    def __init__(self, params: nn.Module | Sequence[LoraPair], lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, bias_correction: bool = True,
                 rcond: float = 1e-10, ridge: float = 0.0, *, other_params: Iterable[nn.Parameter] | None = None,
                 other_lr: float | None = None, other_betas: tuple[float, float] = (0.9, 0.999),
                 other_eps: float = 1e-8, other_weight_decay: float = 0.0, lift_dtype: torch.dtype | None = None,
                 nonfinite: str = "raise", capture: bool = True):
        AdamSConfig(check_number("lr", lr), tuple(betas) if isinstance(betas, (list, tuple)) else betas,  # type: ignore[arg-type]
                    eps, bias_correction, rcond, ridge)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, bias_correction=bias_correction, rcond=rcond,
                        ridge=ridge, lift_dtype=lift_dtype, other_betas=check_betas("other_betas", other_betas, 2),
                        other_eps=check_number("other_eps", other_eps, 0.0))
        super().__init__(params, defaults, other_params, other_lr, other_weight_decay, nonfinite, capture)

    def _validate_group(self, g: dict[str, Any]) -> None:
        check_betas("betas", g["betas"], 2)
        check_number("eps", g["eps"], 0.0)

    def _direction(self, gx: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(gx)
            state["exp_avg_sq"] = torch.zeros_like(gx)
        b1, b2 = group["betas"]
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(gx, 1 - b1)
        v.mul_(b2).addcmul_(gx, gx, value=1 - b2)
        if group["bias_correction"]:
            return (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(group["eps"]))
        return m / v.sqrt().add_(group["eps"])


@dataclass(frozen=True)
class LRACSConfig:
    """LRACS hyper-parameters: the RACS defaults (beta 0.9, alpha 0.05, gamma 1.01, eps 1e-8, limiter on,
    no momentum: RACS has none) with the X-space step ``lr * alpha``; the lift's ``rcond``/``ridge``."""

    lr: float = 3e-2
    beta: float = 0.9
    alpha: float = 0.05
    gamma: float = 1.01
    eps: float = 1e-8
    limiter: bool = True
    rcond: float = 1e-10
    ridge: float = 0.0

    def __post_init__(self) -> None:
        check_racs_fields("LRACSConfig", self)
        check_bool("LRACSConfig.limiter", self.limiter)
        check_number("LRACSConfig.rcond", self.rcond, 0.0)
        check_number("LRACSConfig.ridge", self.ridge, 0.0)


class LRACS(_LiftedOptimizer):
    """Lifted RACS: RACS's row/column-scaled direction on X, lifted horizontally to (B, A) (LoRA-S).

    Per pair and step (RACS steps 1-3 on ``G_X`` (m, n), then the lift):
    ``s <- beta s + (1-beta) (G (.) G) q / ||q||^2``, ``q <- beta q + (1-beta) (G (.) G)^T s / ||s||^2``;
    ``G_hat = diag(s+eps)^{-1/2} G diag(q+eps)^{-1/2}``; ``eta = min(1, gamma phi / ||G_hat||)`` (limiter);
    ``D = alpha eta G_hat``; lift; ``B <- B - lr dM / s_l``, ``A <- A - lr dN^T``. State m + n + 1 floats.
    Arguments as :class:`AdamS` plus ``beta``, ``alpha``, ``gamma``, ``limiter`` (:class:`LRACSConfig`).
    """

    method_name = "LRACS"
    config_class = LRACSConfig

    def __init__(self, params: nn.Module | Sequence[LoraPair], lr: float = 3e-2, beta: float = 0.9,
                 alpha: float = 0.05, gamma: float = 1.01, eps: float = 1e-8, limiter: bool = True,
                 rcond: float = 1e-10, ridge: float = 0.0, *, other_params: Iterable[nn.Parameter] | None = None,
                 other_lr: float | None = None, other_betas: tuple[float, float] = (0.9, 0.999),
                 other_eps: float = 1e-8, other_weight_decay: float = 0.0, lift_dtype: torch.dtype | None = None,
                 nonfinite: str = "raise", capture: bool = True):
        LRACSConfig(check_number("lr", lr), beta, alpha, gamma, eps, limiter, rcond, ridge)
        defaults = dict(lr=lr, beta=beta, alpha=alpha, gamma=gamma, eps=eps, limiter=limiter, rcond=rcond,
                        ridge=ridge, lift_dtype=lift_dtype, other_betas=check_betas("other_betas", other_betas, 2),
                        other_eps=check_number("other_eps", other_eps, 0.0))
        super().__init__(params, defaults, other_params, other_lr, other_weight_decay, nonfinite, capture)

    def _validate_group(self, g: dict[str, Any]) -> None:
        check_unit("beta", g["beta"], high_open=True)
        check_positive("alpha", g["alpha"])

    def _direction(self, gx: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        m, n = gx.shape
        if "s" not in state:
            state["s"] = torch.zeros(m, dtype=gx.dtype, device=gx.device)
            state["q"] = torch.ones(n, dtype=gx.dtype, device=gx.device)
            state["phi"] = torch.zeros((), dtype=gx.dtype, device=gx.device)
        s, q, phi = state["s"], state["q"], state["phi"]
        racs_stats_step_(s, q, gx.square(), group["beta"])
        g_hat = racs_scale(gx, s, q, group["eps"])
        if group["limiter"]:
            norm = torch.linalg.vector_norm(g_hat)
            eta = norm_growth_limit(norm, phi, group["gamma"])
            phi.copy_(eta * norm)
            return g_hat.mul_(eta * group["alpha"])
        return g_hat.mul_(group["alpha"])


def _entry(model: nn.Module, config: AdamSConfig | LRACSConfig | None = None, **kwargs: Any) -> _LiftedOptimizer:
    """AdamS (default) or LRACS over the model's LoRA pairs; other trainable parameters go to Adam."""
    config = AdamSConfig() if config is None else config
    if isinstance(config, LRACSConfig):
        return LRACS.from_config(model, config, **kwargs)
    return AdamS.from_config(model, config, **kwargs)


register("riemannian_lora", config=AdamSConfig, entry=_entry)
