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

Parameter routing (shared with :class:`rankwise.train.alice.Alice`):

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

import math
import numbers
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rankwise.core.errors import NumericalError, RankwiseError

__all__ = [
    "RACS",
    "RACSConfig",
    "norm_growth_limit",
    "optimizer_state_bytes",
    "racs_fixed_point",
    "racs_scale",
    "split_params_for_lowmem",
]

_TINY = 1e-30  # floor of ||q||^2 and ||s||^2 in the fixed-point step (only hit by an all-zero gradient)


# --------------------------------------------------------------------------------------------------
# validation helpers (shared with Alice)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be finite")
    return value


def _positive(name: str, value: Any) -> float:
    v = _real(name, value)
    if v <= 0:
        raise ValueError(f"{name}={value} must be > 0")
    return v


def _non_negative(name: str, value: Any) -> float:
    v = _real(name, value)
    if v < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return v


def _beta(name: str, value: Any) -> float:
    v = _real(name, value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name}={value} must lie in [0, 1)")
    return v


def _betas(name: str, value: Any, n: int) -> tuple[float, ...]:
    if not isinstance(value, (tuple, list)) or len(value) != n:
        raise ValueError(f"{name}={value!r} must be a tuple of {n} floats in [0, 1)")
    return tuple(_beta(f"{name}[{i}]", v) for i, v in enumerate(value))


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name}={value} must be a positive int (>= 1)")
    return int(value)


def _gamma(value: Any) -> float:
    v = _real("gamma", value)
    if v < 1.0:
        raise ValueError(f"gamma={value} must be >= 1 (the allowed growth factor of the update norm)")
    return v


def _user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel that points at the first frame outside rankwise.train and torch.optim."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/rankwise/train/" not in name and "/torch/optim/" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return level


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


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


def racs_fixed_point(v: torch.Tensor, iters: int = 100, tol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Frobenius-optimal rank-1 non-negative fit ``V ~ s q^T`` by the RACS fixed point.

    ``v``: (m, n) non-negative matrix (e.g. ``E[G (.) G]``). Iterates ``s = V q / ||q||^2``,
    ``q = V^T s / ||s||^2`` from ``q = 1`` (the power iteration of ``V V^T``), in float64.
    Returns ``(s, q)`` of shapes (m,) and (n,) with ``s q^T`` the best rank-1 approximation of V.
    """
    if v.ndim != 2:
        raise ValueError(f"v must be a 2-D matrix, got shape {tuple(v.shape)}")
    _pos_int("iters", iters)
    vd = v.double()
    q = torch.ones(vd.shape[1], dtype=torch.float64, device=v.device)
    s = torch.zeros(vd.shape[0], dtype=torch.float64, device=v.device)
    for _ in range(iters):
        s_new = vd @ q / max(float(q @ q), _TINY)
        q = vd.T @ s_new / max(float(s_new @ s_new), _TINY)
        done = tol > 0 and float((s_new - s).norm()) <= tol * float(s_new.norm())
        s = s_new
        if done:
            break
    return s, q


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


# --------------------------------------------------------------------------------------------------
# the shared base


class LowMemOptimizer(torch.optim.Optimizer):
    """Base of RACS and Alice: group validation, AdamW routing, non-finite policy, shape checks.

    Subclasses implement ``_validate_method(group, index)``, ``_check_param(p, group, index)`` and
    ``_matrix_step(p, grad, state, group)``.
    """

    method_name = "lowmem"

    def __init__(self, params: Any, defaults: dict[str, Any], nonfinite: str = "skip", strict: bool = False):
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite={nonfinite!r} must be 'skip' or 'raise'")
        self.nonfinite = nonfinite
        self.strict = _bool("strict", strict)
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
                                  UserWarning, stacklevel=_user_stacklevel())

    def _validate_common(self, group: dict[str, Any], index: int) -> None:
        where = f"param group {index}: "
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{where}lr must be a scalar")
            lr = float(lr)
        _positive(f"{where}lr", lr)
        _non_negative(f"{where}weight_decay", group["weight_decay"])
        _non_negative(f"{where}eps", group["eps"])
        _bool(f"{where}use_adamw", group["use_adamw"])
        _betas(f"{where}adamw_betas", group["adamw_betas"], 2)
        _non_negative(f"{where}adamw_eps", group["adamw_eps"])

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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                # one reduction instead of an elementwise isfinite pass: NaN/Inf propagate into the sum
                # (a finite gradient whose sum overflows float range is treated as non-finite too)
                if not bool(torch.isfinite(grad.sum())):
                    step = int(state.get("step", 0)) + 1
                    msg = (f"{self.method_name}: non-finite gradient (NaN/Inf) for parameter {pi} of param group "
                           f"{gi}, shape {shape}, at its step {step}")
                    if self.nonfinite == "raise":
                        raise NumericalError(msg)
                    self.nonfinite_skips.append((step, gi, pi, shape))
                    warnings.warn(msg + "; its update is skipped", RuntimeWarning, stacklevel=_user_stacklevel())
                    continue
                state["shape"] = shape
                state["step"] = int(state.get("step", 0)) + 1
                lr = float(group["lr"])
                if group["weight_decay"] != 0:
                    p.mul_(1.0 - lr * group["weight_decay"])
                if group["use_adamw"] or p.ndim < 2:
                    self._adamw_step(p, grad, state, group)
                else:
                    self._matrix_step(p, grad, state, group)
        return loss

    def _adamw_step(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """AdamW as ``torch.optim.AdamW`` computes it (weight decay already applied by :meth:`step`)."""
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


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    """Optimizer statistics are kept in float32 for half/bfloat16 parameters, else in the parameter's dtype."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


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
        _positive("lr", self.lr)
        _beta("beta", self.beta)
        _positive("alpha", self.alpha)
        _gamma(self.gamma)
        _non_negative("eps", self.eps)
        _non_negative("weight_decay", self.weight_decay)
        _bool("normalize", self.normalize)
        object.__setattr__(self, "adamw_betas", _betas("adamw_betas", self.adamw_betas, 2))
        _non_negative("adamw_eps", self.adamw_eps)


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

    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9, alpha: float = 0.05, gamma: float = 1.01,
                 eps: float = 1e-8, weight_decay: float = 0.0, normalize: bool = True,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 nonfinite: str = "skip"):
        defaults = dict(lr=lr, beta=beta, alpha=alpha, gamma=gamma, eps=eps, weight_decay=weight_decay,
                        normalize=normalize, use_adamw=False,
                        adamw_betas=tuple(adamw_betas) if isinstance(adamw_betas, list) else adamw_betas,
                        adamw_eps=adamw_eps)
        super().__init__(params, defaults, nonfinite=nonfinite)

    @classmethod
    def from_config(cls, params: Any, config: RACSConfig, **kwargs: Any) -> "RACS":
        if not isinstance(config, RACSConfig):
            raise TypeError(f"config must be a RACSConfig, got {type(config).__name__}")
        return cls(params, **asdict(config), **kwargs)

    def _validate_method(self, group: dict[str, Any], index: int) -> None:
        where = f"param group {index}: "
        _beta(f"{where}beta", group["beta"])
        _positive(f"{where}alpha", group["alpha"])
        v = _real(f"{where}gamma", group["gamma"])
        if v < 1.0:
            raise ValueError(f"{where}gamma={v} must be >= 1")
        _bool(f"{where}normalize", group["normalize"])

    def _matrix_step(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        dtype = _state_dtype(p)
        g = grad.reshape(grad.shape[0], -1).to(dtype)
        m, n = g.shape
        if "s" not in state:
            state["s"] = torch.zeros(m, dtype=dtype, device=p.device)
            state["q"] = torch.ones(n, dtype=dtype, device=p.device)
            state["phi"] = torch.zeros((), dtype=dtype, device=p.device)
        s, q, phi = state["s"], state["q"], state["phi"]
        beta = group["beta"]
        g2 = g.square()
        if group["normalize"]:
            # One warm-started step of the fixed point s = V q / ||q||^2, q = V^T s / ||s||^2 (eq. for
            # the Frobenius-optimal diag(q) (x) diag(s) fit), with V replaced by the EMA of G (.) G.
            s.mul_(beta).add_((g2 @ q) / (q @ q).clamp_min(_TINY), alpha=1 - beta)
            q.mul_(beta).add_((g2.T @ s) / (s @ s).clamp_min(_TINY), alpha=1 - beta)
        else:
            s.lerp_(g2.mean(dim=1), 1 - beta)
            q.lerp_(g2.mean(dim=0), 1 - beta)
        g_hat = racs_scale(g, s, q, group["eps"], out=g2)  # reuses the G (.) G buffer
        norm = torch.linalg.vector_norm(g_hat)
        eta = norm_growth_limit(norm, phi, group["gamma"])
        phi.copy_(eta * norm)
        coeff = eta * (-float(group["lr"]) * group["alpha"])
        if g_hat.dtype == p.dtype:
            p.addcmul_(g_hat.view_as(p), coeff.to(p.dtype))
        else:
            p.add_((g_hat * coeff).view_as(p).to(p.dtype))


def _entry(model: nn.Module, config: RACSConfig | None = None, other_lr: float | None = None) -> RACS:
    """RACS on the model's 2-D block weights and AdamW (``other_lr``, default ``config.lr``) elsewhere."""
    config = config or RACSConfig()
    groups = split_params_for_lowmem(model)
    spec = [{"params": groups["matrix"]}]
    if groups["other"]:
        spec.append({"params": groups["other"], "use_adamw": True,
                     "lr": config.lr if other_lr is None else other_lr})
    return RACS.from_config(spec, config)
