"""The family base of the low-memory matrix optimizers: RACS, Alice and the LoRA-S optimizers.

What these optimizers share, public so that every paper of the family imports it from here (never
from another paper's module):

* :class:`LowMemOptimizer` -- a ``torch.optim.Optimizer`` base: group validation (a bad group leaves
  the optimizer unchanged), AdamW routing (groups with ``use_adamw=True``, and 1-D tensors found in a
  matrix group, with a warning), the non-finite gradient policy (``nonfinite="skip"`` records and
  warns, ``"raise"`` raises :class:`~rankwise.core.errors.NumericalError`), shape checks between
  steps, decoupled weight decay. A subclass implements ``_validate_method(group, index)``,
  ``_matrix_prepare(p, grad, state, group, step)`` (returns a small reduction that is non-finite when the
  gradient is, checked before anything is written: no separate pass over the gradient) with
  ``_matrix_apply(p, ctx, state, group)`` -- or only ``_matrix_step(p, grad, state, group)``, checked by
  ``grad.sum()`` -- and optionally ``_check_param(p, group, index)``;
* :func:`adamw_step` -- one bias-corrected AdamW update, bit-compatible with ``torch.optim.AdamW``;
* the RACS pieces that LoRA-S's lifted RACS reuses: :func:`racs_stats_step_` (one warm-started step of
  the row/column fixed point), :func:`racs_scale` (``diag(s+eps)^{-1/2} G diag(q+eps)^{-1/2}``) and the
  Fira norm-growth limiter :func:`norm_growth_limit`;
* parameter routing and accounting: :func:`split_params_for_lowmem`, :func:`lowmem_entry`,
  :func:`optimizer_state_bytes`, :func:`state_dtype`;
* :func:`check_betas` -- a tuple of EMA decays in ``[0, 1)`` (other hyper-parameters are checked with
  :mod:`rankwise.core.validate` directly); :func:`user_stacklevel` for warnings.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict
from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.validate import check_bool, check_choice, check_number, check_positive, check_unit

__all__ = [
    "TINY",
    "FromConfig",
    "LowMemOptimizer",
    "adamw_step",
    "check_betas",
    "check_racs_fields",
    "closure_loss",
    "lowmem_entry",
    "norm_growth_limit",
    "optimizer_state_bytes",
    "racs_scale",
    "racs_stats_step",
    "racs_stats_step_",
    "split_params_for_lowmem",
    "state_dtype",
    "user_stacklevel",
]

#: floor of ||q||^2 and ||s||^2 in the RACS fixed-point step (only hit by an all-zero gradient)
TINY = 1e-30


# --------------------------------------------------------------------------------------------------
# validation and warnings


def check_betas(field: str, value: Any, n: int) -> tuple[float, ...]:
    """A tuple (or list) of ``n`` EMA decays, each in ``[0, 1)``; returned as a tuple of floats.

    Each entry is checked as ``field[i]`` (``"betas[1] must be a number in [0, 1), got 1.0"``).
    """
    if not isinstance(value, (tuple, list)) or len(value) != n:
        raise ValueError(f"{field} must be a tuple of {n} numbers in [0, 1), got {value!r}")
    return tuple(check_unit(f"{field}[{i}]", v, high_open=True) for i, v in enumerate(value))  # type: ignore[misc]


def check_racs_fields(owner: str, config: Any) -> None:
    """RACS's own hyper-parameters, shared by :class:`RACSConfig` and ``LRACSConfig``: ``lr > 0``,
    ``beta`` in [0, 1), ``alpha > 0``, ``gamma >= 1``, ``eps >= 0``; messages name ``<owner>.<field>``
    (the bare field when ``owner`` is empty)."""
    p = f"{owner}." if owner else ""
    check_positive(f"{p}lr", config.lr)
    check_unit(f"{p}beta", config.beta, high_open=True)
    check_positive(f"{p}alpha", config.alpha)
    check_number(f"{p}gamma", config.gamma, 1.0)
    check_number(f"{p}eps", config.eps, 0.0)


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel that points at the first frame outside rankwise.train and torch.optim."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/rankwise/train/" not in name and "/torch/optim/" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return level


# --------------------------------------------------------------------------------------------------
# pure math


def norm_growth_limit(norm: torch.Tensor, prev: torch.Tensor, gamma: float) -> torch.Tensor:
    """The norm-growth limiter factor ``eta = min(1, gamma * prev / norm)`` (0-d tensor).

    ``prev`` is the limited norm of the previous step (``phi_{t-1}``); ``prev == 0`` means "no
    previous update" (the first step, or a previous all-zero update) and gives ``eta = 1``, so a
    single zero gradient cannot freeze the update forever. ``norm == 0`` gives ``eta = 1``.
    Guarantees ``eta * norm <= gamma * prev`` whenever ``prev > 0``.
    """
    ratio = gamma * prev / norm.clamp_min(torch.finfo(norm.dtype).tiny)
    eta = torch.clamp(ratio, max=1.0)
    return torch.where((prev > 0) & (norm > 0), eta, torch.ones_like(eta))


def racs_stats_step_(s: torch.Tensor, q: torch.Tensor, g2: torch.Tensor, beta: float) -> None:
    """One warm-started step of the RACS fixed point on ``V = G (.) G`` (``g2`` (m, n)), in place:
    ``s <- beta s + (1-beta) V q / ||q||^2``, then ``q <- beta q + (1-beta) V^T s / ||s||^2`` (the new s).

    The fixed point ``s = V q / ||q||^2``, ``q = V^T s / ||s||^2`` is the Frobenius-optimal
    ``diag(q) (x) diag(s)`` fit of the Fisher (RACS spec step 1); ``s`` (m,), ``q`` (n,).
    """
    s.mul_(beta).add_((g2 @ q) / (q @ q).clamp_min(TINY), alpha=1 - beta)
    q.mul_(beta).add_((g2.T @ s) / (s @ s).clamp_min(TINY), alpha=1 - beta)


def racs_stats_step(s: torch.Tensor, q: torch.Tensor, g2: torch.Tensor,
                    beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`racs_stats_step_` out of place: returns the new ``(s, q)`` and leaves ``s`` and ``q``
    untouched (bit-identical results), so that a step can be checked before its statistics are stored."""
    s_new = s.mul(beta).add_((g2 @ q) / (q @ q).clamp_min(TINY), alpha=1 - beta)
    q_new = q.mul(beta).add_((g2.T @ s_new) / (s_new @ s_new).clamp_min(TINY), alpha=1 - beta)
    return s_new, q_new


def racs_scale(g: torch.Tensor, s: torch.Tensor, q: torch.Tensor, eps: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``G_hat = diag(s+eps)^{-1/2} G diag(q+eps)^{-1/2}`` (spec step 2); g (m, n), s (m,), q (n,).

    ``out`` (m, n) may be given to reuse a buffer (it may not alias ``g``).
    """
    scale = torch.outer(torch.rsqrt(s + eps), torch.rsqrt(q + eps), out=out) if out is not None else \
        torch.outer(torch.rsqrt(s + eps), torch.rsqrt(q + eps))
    return scale.mul_(g)


# --------------------------------------------------------------------------------------------------
# parameter selection and state accounting


def split_params_for_lowmem(model: nn.Module, exclude: Iterable[str] = ("lm_head", "embed")) -> dict[str, list[nn.Parameter]]:
    """Split a model's trainable parameters into ``{"matrix": [...], "other": [...]}``.

    ``matrix``: the weights (``ndim >= 2``) of every module that is not an ``nn.Embedding``, not the
    model's output embedding (``get_output_embeddings()``, the LM head) and whose qualified name
    contains none of the ``exclude`` substrings. ``other``: everything else (embeddings, LM head,
    norms, biases), meant for AdamW (``use_adamw=True``), the GaLore-family protocol the paper
    follows. Tied parameters appear once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    exclude = tuple(exclude)
    skip: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        head = get_out()
        if isinstance(head, nn.Module):
            skip.update(id(p) for p in head.parameters())
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            skip.update(id(p) for p in mod.parameters())
    matrix: list[nn.Parameter] = []
    other: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        low = p.ndim >= 2 and id(p) not in skip and not any(e in name for e in exclude)
        (matrix if low else other).append(p)
    if not matrix:
        raise RankwiseError("split_params_for_lowmem: the model has no trainable 2-D weight outside the "
                            f"embeddings / LM head (exclude={exclude})")
    return {"matrix": matrix, "other": other}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors of ``optimizer.state`` (sum of numel x itemsize).

    Works for any ``torch.optim.Optimizer``: walks dicts, lists, tuples and plain objects (e.g.
    galore-torch's projector, whose ``ortho_matrix`` is counted). Each tensor storage counts once.
    """
    seen: set[int] = set()

    def walk(x: Any, depth: int = 0) -> int:
        if depth > 6:
            return 0
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(walk(v, depth + 1) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v, depth + 1) for v in x)
        if hasattr(x, "__dict__") and not isinstance(x, (type, nn.Module)):
            return sum(walk(v, depth + 1) for v in vars(x).values())
        return 0

    return sum(walk(s) for s in optimizer.state.values())


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """Optimizer statistics are kept in float32 for half/bfloat16 parameters, else in the parameter's dtype."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def lowmem_entry(cls: Any, model: nn.Module, config: Any, other_lr: float | None = None) -> Any:
    """``cls.from_config`` on the model's 2-D block weights (:func:`split_params_for_lowmem`) with AdamW
    on the rest (learning rate ``other_lr``, default ``config.lr``)."""
    groups = split_params_for_lowmem(model)
    spec: list[dict[str, Any]] = [{"params": groups["matrix"]}]
    if groups["other"]:
        spec.append({"params": groups["other"], "use_adamw": True,
                     "lr": config.lr if other_lr is None else other_lr})
    return cls.from_config(spec, config)


def adamw_step(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """One AdamW update of ``p`` in place, as ``torch.optim.AdamW`` computes it (bias-corrected).

    ``state`` holds ``step`` (already incremented for this step) and gets ``exp_avg`` / ``exp_avg_sq``;
    ``group`` gives ``lr``, ``adamw_betas`` and ``adamw_eps``. Decoupled weight decay is the caller's
    (``p.mul_(1 - lr * wd)`` before this call).
    """
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    beta1, beta2 = group["adamw_betas"]
    t = state["step"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1 = 1 - beta1 ** t
    bc2_sqrt = math.sqrt(1 - beta2 ** t)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(group["adamw_eps"])
    p.addcdiv_(exp_avg, denom, value=-float(group["lr"]) / bc1)


# --------------------------------------------------------------------------------------------------
# the shared base


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What an optimizer's ``step(closure)`` returns: ``closure()`` run with gradients on, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FromConfig:
    """Mixin of the family's optimizers: ``cls.from_config(params, config, **kwargs)`` builds the optimizer
    from its frozen config dataclass (``config_class``), i.e. ``cls(params, **asdict(config), **kwargs)``."""

    config_class: ClassVar[type]

    @classmethod
    def from_config(cls, params: Any, config: Any, **kwargs: Any) -> Any:
        if not isinstance(config, cls.config_class):
            raise TypeError(f"config must be an instance of {cls.config_class.__name__}, got {type(config).__name__}")
        return cls(params, **asdict(config), **kwargs)  # type: ignore[call-arg]



class LowMemOptimizer(FromConfig, torch.optim.Optimizer):
    """Base of RACS and Alice: group validation, AdamW routing, non-finite policy, shape checks.

    Subclasses set ``config_class`` and implement ``_validate_method(group, index)``,
    ``_check_param(p, group, index)`` and either ``_matrix_prepare`` / ``_matrix_apply`` (the finiteness
    check folded into the step) or ``_matrix_step(p, grad, state, group)`` (checked by ``grad.sum()``).
    """

    method_name = "lowmem"

    def __init__(self, params: Any, defaults: dict[str, Any], nonfinite: str = "skip", strict: bool = False):
        self.nonfinite = check_choice("nonfinite", nonfinite, ("skip", "raise"))
        self.strict = check_bool("strict", strict)
        #: (step, group index, parameter index, shape) of every update skipped for a non-finite gradient.
        self.nonfinite_skips: list[tuple[int, int, int, tuple[int, ...]]] = []
        self._warned: set[int] = set()
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            self._validate_common(group, index)
            self._validate_method(group, index)
            for p in group["params"]:
                self._check_tensor(p, index)
                if not group["use_adamw"] and p.ndim >= 2:
                    self._check_param(p, group, index)
        except Exception:
            self.param_groups.pop()  # bad input loses nothing: the optimizer is unchanged
            raise
        if not group["use_adamw"]:
            for p in group["params"]:
                if p.ndim < 2 and id(p) not in self._warned:
                    self._warned.add(id(p))
                    warnings.warn(f"{self.method_name}: a {p.ndim}-D parameter of shape {tuple(p.shape)} in "
                                  f"param group {index} is routed to AdamW (the {self.method_name} update needs a "
                                  "matrix); put it in a group with use_adamw=True to silence this",
                                  UserWarning, stacklevel=user_stacklevel())

    def _validate_common(self, group: dict[str, Any], index: int) -> None:
        where = f"param group {index}: "
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{where}lr must be a scalar")
            lr = float(lr)
        check_positive(f"{where}lr", lr)
        check_number(f"{where}weight_decay", group["weight_decay"], 0.0)
        check_number(f"{where}eps", group["eps"], 0.0)
        check_bool(f"{where}use_adamw", group["use_adamw"])
        check_betas(f"{where}adamw_betas", group["adamw_betas"], 2)
        check_number(f"{where}adamw_eps", group["adamw_eps"], 0.0)

    def _validate_method(self, group: dict[str, Any], index: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_param(self, p: torch.Tensor, group: dict[str, Any], index: int) -> None:
        pass

    def _check_tensor(self, p: torch.Tensor, index: int) -> None:
        if p.is_complex():
            raise TypeError(f"{self.method_name}: param group {index} holds a complex parameter of shape "
                            f"{tuple(p.shape)}; only real floating-point parameters are supported")
        if not p.is_floating_point():
            raise TypeError(f"{self.method_name}: param group {index} holds a {p.dtype} parameter; "
                            "only floating-point parameters can be optimised")

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step over every parameter with a gradient; returns ``closure()``'s loss."""
        loss = closure_loss(closure)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise TypeError(f"{self.method_name} does not support sparse gradients (param group {gi}, "
                                    f"parameter {pi}, shape {tuple(p.shape)}); use dense gradients "
                                    "(e.g. nn.Embedding(sparse=False)) or torch.optim.SparseAdam")
                if grad.is_complex():
                    raise TypeError(f"{self.method_name} does not support complex gradients (param group {gi}, "
                                    f"parameter {pi})")
                state = self.state[p]
                shape = tuple(p.shape)
                if "shape" in state and tuple(state["shape"]) != shape:
                    raise RankwiseError(f"{self.method_name}: parameter {pi} of param group {gi} changed shape "
                                        f"from {tuple(state['shape'])} to {shape} between steps; create a new "
                                        "optimizer after resizing parameters")
                step = int(state.get("step", 0)) + 1
                matrix = not group["use_adamw"] and p.ndim >= 2
                if matrix:
                    # the finiteness check is folded into the update: the method reduces the gradient
                    # anyway, NaN/Inf propagate into that small reduction, and nothing is written yet
                    check, ctx = self._matrix_prepare(p, grad, state, group, step)
                else:
                    # one reduction instead of an elementwise isfinite pass (a finite gradient whose
                    # sum overflows float range is treated as non-finite too)
                    check, ctx = grad.sum(), None
                if not bool(torch.isfinite(check).all()):
                    msg = (f"{self.method_name}: non-finite gradient (NaN/Inf) for parameter {pi} of param group "
                           f"{gi}, shape {shape}, at its step {step}")
                    if self.nonfinite == "raise":
                        raise NumericalError(msg)
                    self.nonfinite_skips.append((step, gi, pi, shape))
                    warnings.warn(msg + "; its update is skipped", RuntimeWarning, stacklevel=user_stacklevel())
                    continue
                state["shape"] = shape
                state["step"] = step
                lr = float(group["lr"])
                if group["weight_decay"] != 0:
                    p.mul_(1.0 - lr * group["weight_decay"])
                if matrix:
                    self._matrix_apply(p, ctx, state, group)
                else:
                    self._adamw_step(p, grad, state, group)
        return loss

    def _adamw_step(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        adamw_step(p, grad, state, group)

    def _matrix_prepare(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                        step: int) -> tuple[torch.Tensor, Any]:
        """The part of the matrix update that reads the gradient, before anything is written.

        Returns ``(check, ctx)``: ``check`` a small tensor (a reduction the update needs anyway) that is
        non-finite whenever ``grad`` holds a NaN or Inf; ``ctx`` what :meth:`_matrix_apply` needs. It must
        not modify ``p`` or ``state`` (a skipped step leaves both bit-identical); ``step`` is the step
        number this update would get. The default is the plain ``grad.sum()`` check around
        :meth:`_matrix_step`, for subclasses that implement only that.
        """
        return grad.sum(), grad

    def _matrix_apply(self, p: torch.Tensor, ctx: Any, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Write the update prepared by :meth:`_matrix_prepare` (``state["step"]`` is already incremented
        and the decoupled weight decay applied)."""
        self._matrix_step(p, ctx, state, group)

    def _matrix_step(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                     group: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ reporting
    def state_bytes(self) -> int:
        """Bytes of optimizer state held now (sum of numel x itemsize over every state tensor)."""
        return optimizer_state_bytes(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # restore tuples that serialisation may have turned into lists
            group["adamw_betas"] = tuple(group["adamw_betas"])
            if "betas" in group:
                group["betas"] = tuple(group["betas"])
