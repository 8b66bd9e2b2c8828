"""``RiemannianAdamW``: AdamW whose Stiefel parameters stay on the (restricted) Stiefel manifold (spec step 3)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from rankwise.adapt.stiefel_cl.functional import project_out, project_tangent, retract
from rankwise.core.validate import check_number, check_positive


class RiemannianAdamW(torch.optim.Optimizer):
    """AdamW with a tangent projection before and a polar retraction after the step of Stiefel parameters.

    ``params``: parameters or groups as for ``torch.optim.AdamW``. A group with ``stiefel=True`` holds
    matrices ``X`` (d, r) with orthonormal columns (EBLoRA's U and V); each step does, per such ``X``:

    a. ``g <- g - F (F^T g)`` when ``X`` has a protected basis ``F`` (``protected={param: F}``), then
       ``g <- g - X (g^T X)`` (tangent projection);
    b. the ordinary AdamW update on ``g`` (moments, bias correction, decoupled weight decay) giving ``X'``;
    c. the retraction :func:`~rankwise.adapt.stiefel_cl.functional.retract` of ``δ = X' - X`` scaled by the
       group's ``direction_lr_scale``: ``X <- polar(X + P_X(δ'))`` with F removed, so ``X^T X = I`` and
       ``F^T X = 0`` hold after every step.

    Other groups (the magnitudes, task heads) get plain AdamW. ``protected`` is not optimizer state: it is
    the model's (the continual driver passes each layer's basis); ``state_dict`` / ``load_state_dict`` carry
    the moments, step counts and hyper-parameters of every group, as torch's optimizers do.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, direction_lr_scale: float = 1.0, *,
                 protected: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
        c = "RiemannianAdamW"
        check_number(f"{c}.lr", lr, 0.0)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{c}.betas must be a pair of numbers in [0, 1), got {betas!r}")
        for i, b in enumerate(betas):
            check_number(f"{c}.betas[{i}]", b, 0.0, 1.0, high_open=True)
        check_positive(f"{c}.eps", eps)
        check_number(f"{c}.weight_decay", weight_decay, 0.0)
        check_positive(f"{c}.direction_lr_scale", direction_lr_scale)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        direction_lr_scale=direction_lr_scale, stiefel=False)
        super().__init__(params, defaults)
        self._protected: dict[int, torch.Tensor] = {}
        for p, F in (protected or {}).items():
            self.set_protected(p, F)
        for group in self.param_groups:
            if group["stiefel"]:
                for p in group["params"]:
                    if p.ndim != 2 or p.shape[1] > p.shape[0]:
                        raise ValueError(f"{c}: a Stiefel parameter must be a tall matrix (d, r) with r <= d, "
                                         f"got shape {tuple(p.shape)}")

    def set_protected(self, param: torch.Tensor, F: torch.Tensor | None) -> None:
        """Constrain ``param`` (d, r) to ``F^T param = 0`` (``F`` (d, p), orthonormal columns); None removes it."""
        if F is None or F.shape[1] == 0:
            self._protected.pop(id(param), None)
            return
        if F.ndim != 2 or F.shape[0] != param.shape[0]:
            raise ValueError(f"RiemannianAdamW: protected basis {tuple(F.shape)} does not fit a parameter of shape "
                             f"{tuple(param.shape)}")
        self._protected[id(param)] = F.detach()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("RiemannianAdamW does not support sparse gradients")
                F = self._protected.get(id(p)) if group["stiefel"] else None
                if group["stiefel"]:
                    g = project_tangent(p, project_out(F, g))
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                old = p.detach().clone() if group["stiefel"] else None
                if wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                if group["stiefel"]:
                    p.copy_(retract(old, p, group["direction_lr_scale"], F))
        return loss

    def orthogonality_errors(self) -> dict[str, float]:
        """Worst ``||X^T X - I||_max`` and ``||F^T X||_max`` over the Stiefel parameters (float64)."""
        orth, feas = 0.0, 0.0
        for group in self.param_groups:
            if not group["stiefel"]:
                continue
            for p in group["params"]:
                X = p.detach().double()
                orth = max(orth, float((X.T @ X - torch.eye(X.shape[1], dtype=X.dtype, device=X.device)).abs().max()))
                F = self._protected.get(id(p))
                if F is not None:
                    feas = max(feas, float((F.double().T @ X).abs().max()))
        return {"orthogonality": orth, "feasibility": feas if math.isfinite(feas) else float("inf")}
