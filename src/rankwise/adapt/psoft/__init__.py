"""PSOFT: orthogonal fine-tuning confined to the principal subspace of each weight (ICLR 2026, arXiv 2505.11235).

For a frozen weight ``W0 (d_out, d_in)`` with truncated SVD ``W0 ≈ U_r S_r V_r^T`` (top ``r``), PSOFT
freezes the principal factors ``B (d_out, r)`` and ``A (r, d_in)`` (``B A = U_r S_r V_r^T``) and the
residual ``W_res = W0 - B A``, and trains a small ``r x r`` transform between them::

    W = W_res + B M A,       M = diag(beta) R diag(alpha),      R = Cayley(Q) = (I - Q)(I + Q)^{-1}

``Q`` is skew-symmetric, stored as its ``r (r - 1) / 2`` free entries ``q`` (init 0); ``alpha``
(input side) and ``beta`` (output side) are relaxation vectors (init 1). The Cayley map is computed
exactly (``torch.linalg.solve``) or with ``t`` Neumann terms for ``(I + Q)^{-1}``::

    R_t = I + 2 sum_{k=1..t} (-Q)^k + (-Q)^{t+1}          (t = 0 gives I - Q)

The series converges only for ``||Q|| < 1``; rankwise warns once per adapter when the spectral norm
of ``Q`` passes 0.9, and ``neumann_eps`` (PEFT's ``cayley_neumann_eps``) optionally rescales ``Q`` to a
Frobenius norm below 1 first. Trainable: ``r (r - 1)/2 + 2 r`` parameters per matrix, independent of
``d_in``, ``d_out``.

Geometry. With ``alpha = beta = 1`` and exact Cayley, ``M`` is orthogonal. Where the singular values
go decides what it preserves (``singular_values_on``):

* ``"output"`` (default; the PSOFT authors' reading, as in PEFT's ``psoft_init``): ``B = U_r S_r``,
  ``A = V_r^T`` with orthonormal rows ("orthogonality constraint on the down-projection"). Then
  ``(M A)(M A)^T = I`` and the principal part keeps its row Gram matrix ``B B^T``: the pairwise
  angles and norms of the neurons' weight vectors (rows of ``W``, columns of the paper's ``W``).
* ``"input"``: ``B = U_r``, ``A = S_r V_r^T``; then ``(B M)^T (B M) = I`` and the column Gram
  matrix ``A^T A`` of the principal part is kept.

Implementation. rankwise keeps ``W0`` untouched and computes the same function as
``W0 x + B (M - I) A x`` (``M = I`` at initialisation, so the output is exactly the pretrained one),
which is how PEFT's PSOFT computes it too; merging adds ``B (M - I) A`` to ``W0``. With
``orth=False`` ``M`` is a free ``r x r`` matrix (init ``I``) and, without the vectors, PSOFT is
LoRA-XS with a residual. The skew entries ``q`` are ordered as PEFT's ``OrthLayer.weight`` (upper
triangle, row-major, transposed into the lower triangle), so that with ``singular_values_on="output"``
the same ``q, alpha, beta`` give the same ``R`` and the same update as PEFT's PSOFT (whose
``num_cayley_neumann_terms = t + 2`` for ``t >= 3``; PEFT's default is the exact solve).

Usage::

    from rankwise.adapt.psoft import PSOFTConfig, adapt, merge, orthogonality_report
    adapt(model, PSOFTConfig(r=38))      # SVD per layer; q, alpha, beta trainable
    ...train...
    orthogonality_report(model)          # ||M^T M - I||_F per layer (drift from orthogonality)
    merge(model)
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module

__all__ = [
    "PSOFTConfig",
    "PSOFTLinear",
    "adapt",
    "adapter_names",
    "apply_psoft",
    "cayley",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "load_adapter",
    "merge",
    "num_parameters",
    "orthogonality_report",
    "principal_factors",
    "psoft_layers",
    "rank_for_budget",
    "save_adapter",
    "set_active",
    "skew_from_params",
    "unload",
    "unmerge",
]

CAYLEY = ("neumann", "exact")
SIDES = ("output", "input")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.psoft"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
_UNSUPPORTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.EmbeddingBag)
#: Above this spectral norm of Q the Neumann series converges slowly (it diverges at 1): a warning suggests "exact".
NEUMANN_WARN_NORM = 0.9
#: Singular values below ``RANK_RTOL * sigma_1`` inside the top r count as zero (rank-deficient W0: warning).
RANK_RTOL = 1e-6


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PSOFTConfig:
    """PSOFT hyper-parameters (defaults: the official GLUE script's, r = 46, t = 5, orth + alpha + beta).

    Attributes:
        r: principal-subspace rank, ``1 <= r <= min(d_in, d_out)`` of every adapted layer.
        target: module-name patterns (the four attention projections of a BERT-style model).
        cayley: ``"neumann"`` (truncated series, ``neumann_terms`` terms) or ``"exact"`` (linear solve).
        neumann_terms: ``t >= 0`` of the truncated Neumann series of ``(I + Q)^{-1}``.
        neumann_eps: optional bound in (0, 1) on ``||Q||_F`` for the Neumann series: a larger ``Q`` is
            rescaled to it before the series (PEFT's ``cayley_neumann_eps``, from OFTv2), which keeps the
            series convergent at the price of capping the rotation angle. None (default): no rescaling.
        orth: Cayley-parametrised orthogonal core; ``False``: a free ``r x r`` matrix (init I, LoRA-XS).
        train_alpha, train_beta: learn the input-side / output-side relaxation vectors (init 1).
        singular_values_on: ``"output"`` (B = U S, A = V^T, default) or ``"input"`` (B = U, A = S V^T).
        dropout: dropout on the adapter's input, in [0, 1).
    """

    r: int = 46
    target: tuple[str, ...] = ("query", "key", "value", "attention.output.dense")
    cayley: str = "neumann"
    neumann_terms: int = 5
    neumann_eps: float | None = None
    orth: bool = True
    train_alpha: bool = True
    train_beta: bool = True
    singular_values_on: str = "output"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not _pos_int(self.r):
            raise ValueError(f"PSOFTConfig.r must be an int >= 1, got {self.r!r}")
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError("PSOFTConfig.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        if self.cayley not in CAYLEY:
            raise ValueError(f"PSOFTConfig.cayley must be one of {CAYLEY}, got {self.cayley!r}")
        if isinstance(self.neumann_terms, bool) or not isinstance(self.neumann_terms, int) or self.neumann_terms < 0:
            raise ValueError(f"PSOFTConfig.neumann_terms must be an int >= 0, got {self.neumann_terms!r}")
        eps = self.neumann_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < eps < 1.0):
            raise ValueError(f"PSOFTConfig.neumann_eps must be None or in (0, 1), got {eps!r}")
        for fname in ("orth", "train_alpha", "train_beta"):
            if not isinstance(getattr(self, fname), bool):
                raise ValueError(f"PSOFTConfig.{fname} must be a bool, got {getattr(self, fname)!r}")
        if self.singular_values_on not in SIDES:
            raise ValueError(f"PSOFTConfig.singular_values_on must be one of {SIDES}, got {self.singular_values_on!r}")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"PSOFTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def trainable_per_matrix(self) -> int:
        return num_parameters(self.r, orth=self.orth, train_alpha=self.train_alpha, train_beta=self.train_beta)


def num_parameters(r: int, *, orth: bool = True, train_alpha: bool = True, train_beta: bool = True) -> int:
    """Trainable parameters per adapted matrix: ``r(r-1)/2`` (or ``r^2`` without ``orth``) ``+ r`` per vector."""
    if not _pos_int(r):
        raise ValueError(f"r must be an int >= 1, got {r!r}")
    return (r * (r - 1) // 2 if orth else r * r) + r * (int(train_alpha) + int(train_beta))


def rank_for_budget(budget: int, *, orth: bool = True, train_alpha: bool = True, train_beta: bool = True,
                    mode: str = "closest") -> int:
    """The ``r`` whose :func:`num_parameters` is closest to ``budget`` (``mode="floor"``: largest not above it).

    Ties between two closest counts go to the smaller ``r``. ``budget`` below the count of ``r = 1`` is a ValueError.
    """
    if not _pos_int(budget):
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if mode not in ("closest", "floor"):
        raise ValueError(f"mode must be 'closest' or 'floor', got {mode!r}")
    kw = dict(orth=orth, train_alpha=train_alpha, train_beta=train_beta)
    if num_parameters(1, **kw) > budget and mode == "floor":
        raise ValueError(f"budget {budget} is below the smallest PSOFT count ({num_parameters(1, **kw)} at r=1)")
    r = 1
    while num_parameters(r + 1, **kw) <= budget:
        r += 1
    if mode == "floor":
        return r
    below, above = num_parameters(r, **kw), num_parameters(r + 1, **kw)
    if below > budget:  # even r = 1 is above the budget
        return 1
    return r if budget - below <= above - budget else r + 1


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------

def skew_from_params(q: torch.Tensor, r: int) -> torch.Tensor:
    """Skew-symmetric ``Q = L - L^T`` (``r x r``) from the ``r(r-1)/2`` entries ``q``.

    ``L`` is strictly lower triangular with ``L[j, i] = q[k]`` where ``(i, j)`` is the k-th pair of
    ``torch.triu_indices(r, r, 1)`` (row-major upper triangle), the order of PEFT's PSOFT parameters.
    """
    if q.ndim != 1 or q.numel() != r * (r - 1) // 2:
        raise ValueError(f"q must hold r(r-1)/2 = {r * (r - 1) // 2} entries for r={r}, got shape {tuple(q.shape)}")
    rows, cols = torch.triu_indices(r, r, 1, device=q.device)
    L = torch.zeros(r, r, dtype=q.dtype, device=q.device).index_put((cols, rows), q)
    return L - L.T


def cayley(Q: torch.Tensor, terms: int | None = 5, eps: float | None = None) -> torch.Tensor:
    """``R = (I - Q)(I + Q)^{-1}`` exactly (``terms=None``) or by the truncated Neumann series with ``terms`` terms.

    ``R_t = I + 2 sum_{k=1..t} (-Q)^k + (-Q)^{t+1}``; its error from the exact map is ``O(||Q||^{t+1})``
    for ``||Q|| < 1``. For skew ``Q`` the exact ``R`` is orthogonal. With ``eps`` (Neumann only), ``Q``
    is first rescaled to Frobenius norm ``eps`` when it is larger.
    """
    r = Q.shape[-1]
    eye = torch.eye(r, dtype=Q.dtype, device=Q.device)
    if terms is None:
        return torch.linalg.solve(eye + Q, eye - Q, left=False)
    if eps is not None:
        norm = torch.linalg.matrix_norm(Q, "fro")
        if bool(torch.isfinite(norm)) and float(norm) > eps:
            Q = Q * (eps / (norm + 1e-12))
    R = eye.clone()
    P = eye
    for _ in range(terms):
        P = P @ (-Q)
        R = R + 2.0 * P
    return R + P @ (-Q)


def principal_factors(W: torch.Tensor, r: int, side: str = "output", *, name: str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``r`` SVD split of ``W (d_out, d_in)`` in float64: returns ``B (d_out, r)``, ``A (r, d_in)``, ``S (r,)``.

    ``side="output"``: ``B = U_r S_r``, ``A = V_r^T``; ``side="input"``: ``B = U_r``, ``A = S_r V_r^T``.
    Non-finite weights raise NumericalError; singular values below ``RANK_RTOL * sigma_1`` inside the
    top ``r`` give a warning (the subspace is then partly arbitrary).
    """
    where = f"layer {name!r}" if name else "PSOFT"
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    W = W.detach().to(torch.float64)
    if not bool(torch.isfinite(W).all()):
        raise NumericalError(f"{where}: the weight holds NaN or inf; cannot compute its SVD")
    d_out, d_in = W.shape
    if not _pos_int(r) or r > min(d_out, d_in):
        raise ValueError(f"PSOFT r={r!r} for {where} must be in [1, min(d_in={d_in}, d_out={d_out}) = "
                         f"{min(d_in, d_out)}]")
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    U, S, Vh = U[:, :r], S[:r], Vh[:r]
    tiny = int((S <= RANK_RTOL * S[0]).sum()) if float(S[0]) > 0 else r
    if tiny:
        warnings.warn(f"{where}: {tiny} of the top-{r} singular values of the weight are (numerically) zero; "
                      "the principal subspace is partly arbitrary there", stacklevel=3)
    if side == "output":
        return U * S, Vh, S
    return U, S[:, None] * Vh, S


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Core(nn.Module):
    """One named PSOFT adapter of a layer: trainable ``q`` (or free ``R``), ``alpha``, ``beta``; frozen ``A``, ``B``."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, *, orth: bool, train_alpha: bool, train_beta: bool,
                 cayley_mode: str, terms: int, eps: float | None = None) -> None:
        super().__init__()
        r = A.shape[0]
        self.r = r
        self.orth = orth
        self.cayley_mode = cayley_mode
        self.terms = terms
        self.eps = eps
        dt, dev = A.dtype, A.device
        self.register_buffer("A", A)
        self.register_buffer("B", B)
        if orth:
            self.q = nn.Parameter(torch.zeros(r * (r - 1) // 2, dtype=dt, device=dev))
            self.R = None
        else:
            self.q = None
            self.R = nn.Parameter(torch.eye(r, dtype=dt, device=dev))
        self.alpha = nn.Parameter(torch.ones(r, dtype=dt, device=dev)) if train_alpha else None
        self.beta = nn.Parameter(torch.ones(r, dtype=dt, device=dev)) if train_beta else None
        self._warned = False

    def skew(self) -> torch.Tensor | None:
        return None if self.q is None else skew_from_params(self.q, self.r)

    def rotation(self) -> torch.Tensor:
        """``R`` (Cayley of ``Q``, or the free matrix without ``orth``)."""
        if self.R is not None:
            return self.R
        Q = self.skew()
        if self.cayley_mode == "neumann" and self.eps is None and not self._warned and self.r > 1:
            with torch.no_grad():
                if float(torch.linalg.matrix_norm(Q, "fro")) > NEUMANN_WARN_NORM:  # cheap bound first
                    norm = float(torch.linalg.matrix_norm(Q.float(), 2))
                    if norm > NEUMANN_WARN_NORM:
                        self._warned = True
                        warnings.warn(f"PSOFT: the spectral norm of Q is {norm:.3f} > {NEUMANN_WARN_NORM}; the "
                                      "truncated Neumann series is inaccurate (and diverges at 1). Use "
                                      "cayley='exact', more neumann_terms, or a smaller learning rate", stacklevel=4)
        if self.cayley_mode == "exact":
            return cayley(Q, None)
        return cayley(Q, self.terms, self.eps)

    def matrix(self) -> torch.Tensor:
        """``M = diag(beta) R diag(alpha)`` (``r x r``)."""
        M = self.rotation()
        if self.beta is not None:
            M = self.beta[:, None] * M
        if self.alpha is not None:
            M = M * self.alpha[None, :]
        return M

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in (self.q, self.R, self.alpha, self.beta) if p is not None]


def _owned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached, contiguous copy on ``device`` (row-major, so results do not depend on the source's strides)."""
    return t.detach().to(device).clone(memory_format=torch.contiguous_format)


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear map with weight stored ``(in, out)``."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None \
        and m.weight.ndim == 2


class PSOFTLinear(AdapterLayer):
    """A linear layer with named PSOFT adapters: ``y = base(x) + sum_active B (M - I) A dropout(x)``.

    ``base_layer`` is an ``nn.Linear`` or a transformers ``Conv1D`` (weight ``(in, out)``, handled by
    transposition). Shapes: ``x (..., in_features) -> y (..., out_features)``; per adapter
    ``psoft[name].A (r, in)``, ``.B (out, r)`` (buffers), ``.q (r(r-1)/2,)`` or ``.R (r, r)``,
    ``.alpha (r,)``, ``.beta (r,)`` (parameters).
    """

    adapter_store = "psoft"
    adapter_fields = ("psoft", "psoft_dropout", "adapter_config")
    adapter_label = "PSOFT adapter"
    family = "PSOFT"

    def __init__(self, base_layer: nn.Module, layer_name: str = "") -> None:
        if isinstance(base_layer, nn.Linear):
            fan_in_fan_out = False
            in_features, out_features = base_layer.in_features, base_layer.out_features
        elif _is_conv1d(base_layer):
            fan_in_fan_out = True
            in_features, out_features = base_layer.weight.shape
        else:
            raise TypeError(f"PSOFTLinear wraps nn.Linear (or transformers Conv1D), got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.fan_in_fan_out = fan_in_fan_out
        self.in_features, self.out_features = in_features, out_features
        self.psoft = nn.ModuleDict()
        self.psoft_dropout = nn.ModuleDict()
        self.train(base_layer.training)

    def dense_weight(self) -> torch.Tensor:
        """The base weight in ``(out, in)`` layout (a view; transposed for Conv1D)."""
        w = self.base_layer.weight
        return w.T if self.fan_in_fan_out else w

    def merge_target(self) -> torch.Tensor:
        return self.dense_weight()

    def add_adapter(self, name: str, A: torch.Tensor, B: torch.Tensor, *, orth: bool = True, train_alpha: bool = True,
                    train_beta: bool = True, cayley_mode: str = "neumann", terms: int = 5, eps: float | None = None,
                    dropout: float = 0.0, config: Mapping[str, Any] | None = None) -> "_Core":
        """Create (or replace) adapter ``name``: frozen ``A (r, in)``, ``B (out, r)`` (copied), core at ``M = I``."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1] or A.shape[1] != self.in_features \
                or B.shape[0] != self.out_features:
            raise ValueError(f"{self._where()}: factors A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                             f"in_features={self.in_features}, out_features={self.out_features}")
        if not A.is_floating_point() or A.dtype != B.dtype:
            raise ValueError(f"{self._where()}: A and B must share one floating dtype")
        if cayley_mode not in CAYLEY:
            raise ValueError(f"cayley_mode must be one of {CAYLEY}, got {cayley_mode!r}")
        dev = self.base_layer.weight.device
        core = _Core(_owned(A, dev), _owned(B, dev), orth=orth, train_alpha=train_alpha,
                     train_beta=train_beta, cayley_mode=cayley_mode, terms=terms, eps=eps)
        self.psoft[name] = core
        self.psoft_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        cfg = dict(config or {})
        cfg.update({"r": int(A.shape[0]), "orth": orth, "train_alpha": train_alpha, "train_beta": train_beta,
                    "cayley": cayley_mode, "neumann_terms": terms, "neumann_eps": eps, "dropout": float(dropout)})
        self.adapter_config[name] = cfg
        return core

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``B (M - I) A``, shape ``(out, in)``, in ``dtype`` (default float32, or float64 for float64 factors)."""
        self._require(name)
        c = self.psoft[name]
        dt = dtype or torch.promote_types(c.A.dtype, torch.float32)
        with torch.no_grad():
            M = c.matrix().to(dt)
            D = M - torch.eye(c.r, dtype=dt, device=M.device)
            return c.B.to(dt) @ D @ c.A.to(dt)

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(p, True) for p in self.psoft[name].trainable()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            c = self.psoft[name]
            xa = self.psoft_dropout[name](x.to(c.A.dtype)) @ c.A.T          # (..., r)
            D = c.matrix() - torch.eye(c.r, dtype=c.A.dtype, device=c.A.device)
            result = result + ((xa @ D.T) @ c.B.T).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        ranks = {n: self.psoft[n].r for n in self.adapters}
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters(r)={ranks}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

def psoft_layers(model: nn.Module) -> list[tuple[str, PSOFTLinear]]:
    """``(qualified name, PSOFTLinear)`` of every PSOFT layer of ``model``, in model order."""
    return adapters.adapted_layers(model, PSOFTLinear)


def adapter_names(model: nn.Module) -> list[str]:
    return adapters.adapter_names(model, PSOFTLinear)


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    return adapters.all_or_nothing(model, PSOFTLinear)


def _sync_trainable(model: nn.Module, freeze_base: bool) -> None:
    """Active adapters' core parameters trainable, inactive ones frozen; the rest frozen if ``freeze_base``."""
    adapters.sync_trainable(model, PSOFTLinear, freeze_base)


def _base_of(mod: nn.Module) -> nn.Module:
    return mod.base_layer if isinstance(mod, PSOFTLinear) else mod


def _in_out(mod: nn.Module) -> tuple[int, int]:
    base = _base_of(mod)
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    return int(base.weight.shape[0]), int(base.weight.shape[1])


def _dense(mod: nn.Module) -> torch.Tensor:
    base = _base_of(mod)
    return base.weight.T if _is_conv1d(base) else base.weight


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    return adapters.target_layers(model, target, PSOFTLinear,
                                  accepts=lambda m: isinstance(m, nn.Linear) or _is_conv1d(m),
                                  rejects=lambda m: isinstance(m, _UNSUPPORTED),
                                  supported="linear layers (nn.Linear, transformers Conv1D)")


def adapt(model: nn.Module, config: PSOFTConfig | None = None, target: Selector = None,
          name: str = "default") -> nn.Module:
    """Add PSOFT adapter ``name`` to the linear layers ``target`` selects (default ``config.target``); in place.

    One SVD per layer (float64) gives the frozen ``A``, ``B``; the core starts at ``M = I`` so the
    model's outputs are unchanged. The new adapter becomes the active (and only trainable) one; every
    other parameter is frozen (unfreeze a task head yourself). ``r`` above ``min(d_in, d_out)`` of a
    layer raises ValueError naming it; ``r = 1`` warns (the skew part is empty, only the vectors
    train). Everything is computed before the model changes; on any error it is unchanged.
    """
    config = PSOFTConfig() if config is None else config
    if not isinstance(config, PSOFTConfig):
        raise TypeError(f"adapt: config must be a PSOFTConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
    validate_adapter_name(name)
    merged = [n for n, layer in psoft_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}; unmerge before adding an adapter")
    hits = _target_layers(model, config.target if target is None else target)
    for lname, mod in hits:
        d_in, d_out = _in_out(mod)
        if config.r > min(d_in, d_out):
            raise ValueError(f"PSOFT r={config.r} for layer {lname!r} exceeds min(in_features={d_in}, "
                             f"out_features={d_out}) = {min(d_in, d_out)}; choose r in [1, {min(d_in, d_out)}]")
        if isinstance(mod, PSOFTLinear) and name in mod.psoft:
            raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                             "or delete it first")
    if config.r == 1 and config.orth:
        warnings.warn("PSOFT with r=1: the skew-symmetric part is empty, only the relaxation vectors train",
                      stacklevel=2)
    plan = []
    for lname, mod in hits:
        W = _dense(mod)
        dtype = W.dtype if W.is_floating_point() else torch.float32
        B, A, _ = principal_factors(W, config.r, config.singular_values_on, name=lname)
        plan.append((lname, mod, A.to(dtype), B.to(dtype)))
    with _all_or_nothing(model):
        for lname, mod, A, B in plan:
            layer = mod if isinstance(mod, PSOFTLinear) else PSOFTLinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.add_adapter(name, A, B, orth=config.orth, train_alpha=config.train_alpha,
                              train_beta=config.train_beta, cayley_mode=config.cayley, terms=config.neumann_terms,
                              eps=config.neumann_eps, dropout=config.dropout, config={"method": "psoft",
                                                              "singular_values_on": config.singular_values_on})
            layer.set_active(name)
        for _, layer in psoft_layers(model):
            if name not in layer.psoft:
                layer.active_adapters = []
        _sync_trainable(model, freeze_base=True)
    return model


apply_psoft = adapt


def _require_adapter(model: nn.Module, name: str) -> list[tuple[str, PSOFTLinear]]:
    return adapters.require_adapter(model, name, PSOFTLinear)


@torch.no_grad()
def orthogonality_report(model: nn.Module, name: str | None = None) -> list[dict[str, Any]]:
    """Per layer and adapter: ``||M^T M - I||_F`` (``orth_error``), ``||R^T R - I||_F`` (``cayley_error``,
    the Neumann truncation's share) and the spectral norm of ``Q`` (``q_norm``; Neumann needs it < 1)."""
    rows = []
    for lname, layer in psoft_layers(model):
        for n in layer.adapters:
            if name is not None and n != name:
                continue
            c = layer.psoft[n]
            eye = torch.eye(c.r, dtype=torch.float64)
            M = c.matrix().double().cpu()
            R = c.rotation().double().cpu()
            Q = c.skew()
            rows.append({"layer": lname, "adapter": n, "r": c.r,
                         "orth_error": float(torch.linalg.matrix_norm(M.T @ M - eye)),
                         "cayley_error": float(torch.linalg.matrix_norm(R.T @ R - eye)),
                         "q_norm": None if Q is None or c.r < 2 else float(torch.linalg.matrix_norm(Q.double(), 2))})
    if name is not None and not rows:
        raise KeyError(f"the model has no PSOFT adapter named {name!r}")
    return rows


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active (trainable) adapter(s) of every PSOFT layer; others inactive (frozen)."""
    adapters.set_active(model, names, PSOFTLinear)


def enable_adapters(model: nn.Module) -> None:
    adapters.enable_adapters(model, PSOFTLinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept). Refused while merged."""
    adapters.disable_adapters(model, PSOFTLinear)


def merge(model: nn.Module) -> nn.Module:
    """Merge the active adapters into the base weights (``W0 += B (M - I) A``); all-or-nothing."""
    adapters.merge_all(model, PSOFTLinear)
    return model


def unmerge(model: nn.Module) -> nn.Module:
    adapters.unmerge_all(model, PSOFTLinear)
    return model


def delete_adapter(model: nn.Module, name: str) -> None:
    adapters.delete_adapter(model, name, PSOFTLinear)


def unload(model: nn.Module, merge_first: bool = True) -> nn.Module:
    """Replace every PSOFTLinear by its base layer (merging the active adapters first if ``merge_first``)."""
    return adapters.unload(model, PSOFTLinear, merge_first)


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------

_PARAM_KEYS = ("q", "R", "alpha", "beta")


def save_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 overwrite: bool | None = None) -> Path:
    """Save adapter ``name`` to ``directory`` atomically (``adapter_model.safetensors`` + ``adapter_config.json``).

    Tensors per module: the trained ``psoft_q`` (or ``psoft_R``), ``psoft_alpha``, ``psoft_beta`` and
    the frozen ``psoft_A``, ``psoft_B`` (stored, not recomputed on load, so that SVD sign conventions
    of another machine cannot change a trained adapter's function). Header: per-module settings, the
    base-model fingerprint and SHA-256 digests.
    """
    layers = _require_adapter(model, name)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}
    for lname, layer in layers:
        c = layer.psoft[name]
        tensors[f"{lname}.psoft_A"] = c.A
        tensors[f"{lname}.psoft_B"] = c.B
        for k in _PARAM_KEYS:
            p = getattr(c, k)
            if p is not None:
                tensors[f"{lname}.psoft_{k}"] = p.detach()
        modules[lname] = dict(layer.adapter_config.get(name, {}))
    meta = {"kind": _KIND, "name": name, "modules": modules, "fingerprint": io.model_fingerprint(model)}
    directory = Path(directory)
    if overwrite is None:
        overwrite = directory.is_dir() and all(p.is_file() and p.name in _OWN_FILES for p in directory.iterdir())
    with io.atomic_dir(directory, overwrite=bool(overwrite)) as tmp:
        io.write_json(tmp / CONFIG_FILE, {"method": "psoft", "name": name, "modules": modules})
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return directory


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 check_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model`` as adapter ``name`` (active, trainable).

    ArtifactError (model unchanged) for a missing, corrupt or truncated file, another artefact kind,
    another base model (fingerprint; skip with ``check_base=False``), or modules that do not fit.
    """
    validate_adapter_name(name)
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    path = directory / WEIGHTS_FILE
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != _KIND:
        raise ArtifactError(f"{path}: not a rankwise PSOFT adapter (kind={meta.get('kind')!r})")
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ArtifactError(f"{path}: metadata lacks the module table")
    expected: set[str] = set()
    for m, cfg in modules.items():
        if not isinstance(cfg, dict) or not _pos_int(cfg.get("r")) or cfg.get("cayley") not in CAYLEY \
                or not isinstance(cfg.get("orth"), bool) or not isinstance(cfg.get("neumann_terms"), int):
            raise ArtifactError(f"{path}: bad metadata for module {m!r}")
        keys = ["A", "B", "q" if cfg["orth"] else "R"] + (["alpha"] if cfg.get("train_alpha") else []) \
            + (["beta"] if cfg.get("train_beta") else [])
        expected |= {f"{m}.psoft_{k}" for k in keys}
    if set(tensors) != expected:
        raise ArtifactError(f"{path}: tensors do not match the module table (missing "
                            f"{sorted(expected - set(tensors))[:4]}, unexpected {sorted(set(tensors) - expected)[:4]})")
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
    if any(layer.merged_adapters for _, layer in psoft_layers(model)):
        raise RankwiseError("unmerge the PSOFT adapters before loading one")
    found: dict[str, nn.Module] = {}
    problems: list[str] = []
    for m, cfg in modules.items():
        try:
            mod = model.get_submodule(m)
        except AttributeError:
            problems.append(f"module {m!r} does not exist in the model")
            continue
        base = _base_of(mod)
        if not (isinstance(base, nn.Linear) or _is_conv1d(base)):
            problems.append(f"module {m!r} is a {type(mod).__name__}, not a linear layer")
            continue
        d_in, d_out = _in_out(mod)
        r = cfg["r"]
        shapes = {"A": (r, d_in), "B": (d_out, r), "q": (r * (r - 1) // 2,), "R": (r, r), "alpha": (r,), "beta": (r,)}
        bad = [k for k in shapes if f"{m}.psoft_{k}" in tensors and tuple(tensors[f"{m}.psoft_{k}"].shape) != shapes[k]]
        dts = {tensors[k].dtype for k in tensors if k.startswith(m + ".psoft_")}
        if bad or len(dts) != 1:
            problems.append(f"module {m!r}: tensors {bad or 'dtypes'} do not fit ({d_out}, {d_in}) with r={r}")
            continue
        found[m] = mod
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    with _all_or_nothing(model):
        for lname, layer in psoft_layers(model):
            if name in layer.psoft and lname not in found:
                layer.delete_adapter(name)
        for m, mod in found.items():
            cfg = modules[m]
            layer = mod if isinstance(mod, PSOFTLinear) else PSOFTLinear(mod, layer_name=m)
            if layer is not mod:
                replace_module(model, m, layer)
            dropout = float(cfg.get("dropout", 0.0) or 0.0)
            if not 0.0 <= dropout < 1.0:
                raise ArtifactError(f"{path}: dropout {dropout!r} of module {m!r} is outside [0, 1)")
            extra = {k: v for k, v in cfg.items() if k in ("method", "singular_values_on")}
            eps = cfg.get("neumann_eps")
            if eps is not None and (not isinstance(eps, (int, float)) or not 0.0 < float(eps) < 1.0):
                raise ArtifactError(f"{path}: neumann_eps {eps!r} of module {m!r} is outside (0, 1)")
            core = layer.add_adapter(name, tensors[f"{m}.psoft_A"], tensors[f"{m}.psoft_B"], orth=cfg["orth"],
                                     train_alpha=bool(cfg.get("train_alpha")), train_beta=bool(cfg.get("train_beta")),
                                     cayley_mode=cfg["cayley"], terms=cfg["neumann_terms"], eps=eps,
                                     dropout=dropout, config=extra)
            with torch.no_grad():
                for k in _PARAM_KEYS:
                    p = getattr(core, k)
                    if p is not None:
                        p.copy_(tensors[f"{m}.psoft_{k}"])
            layer.set_active(name)
        for lname, layer in list(psoft_layers(model)):
            if name not in layer.psoft:
                layer.active_adapters = []
            if not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        _sync_trainable(model, freeze_base=True)
    return model


register("psoft", config=PSOFTConfig, entry=adapt)
