"""The PSOFT layer: :class:`PSOFTLinear`, a linear layer (or GPT-2 ``Conv1D``) with named adapters."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.adapt.psoft.config import CAYLEY, NEUMANN_WARN_NORM
from rankwise.adapt.psoft.functional import cayley, skew_from_params
from rankwise.core.adapters import AdapterLayer, ArtifactContext, validate_adapter_name
from rankwise.core.errors import RankwiseError


#: run the Neumann-accuracy check (:meth:`_Core.check_neumann`, one host sync per adapter) in every
#: forward pass until it warns, as before; for debugging (off: the check runs on ``eval()`` and merges)
SYNC_CHECKS = False


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
        """``R`` (Cayley of ``Q``, or the free matrix without ``orth``). No host synchronisation: the
        Neumann-accuracy check runs off the forward path (:meth:`check_neumann`) unless
        :data:`SYNC_CHECKS` is set."""
        if self.R is not None:
            return self.R
        Q = self.skew()
        if SYNC_CHECKS:
            self.check_neumann(Q, stacklevel=5)
        if self.cayley_mode == "exact":
            return cayley(Q, None, check=False)
        return cayley(Q, self.terms, self.eps)

    def check_neumann(self, Q: torch.Tensor | None = None, stacklevel: int = 3) -> bool:
        """Warn (once per adapter) when the truncated Neumann series is inaccurate: ``||Q||_2 > 0.9`` with
        ``cayley="neumann"`` and no ``neumann_eps``. Reads the norm back to the host, so it runs when the
        model is switched to eval mode, on :meth:`PSOFTLinear.delta_weight` (merge, reports) and from
        :func:`~rankwise.adapt.psoft.check_neumann`, not in every forward. Returns whether it warned now."""
        if self.q is None or self.cayley_mode != "neumann" or self.eps is not None or self._warned or self.r < 2:
            return False
        with torch.no_grad():
            Q = (self.skew() if Q is None else Q).detach()
            if float(torch.linalg.matrix_norm(Q, "fro")) <= NEUMANN_WARN_NORM:  # cheap bound first
                return False
            norm = float(torch.linalg.matrix_norm(Q.float(), 2))
        if norm <= NEUMANN_WARN_NORM:
            return False
        self._warned = True
        warnings.warn(f"PSOFT: the spectral norm of Q is {norm:.3f} > {NEUMANN_WARN_NORM}; the truncated Neumann "
                      "series is inaccurate (and diverges at 1). Use cayley='exact', more neumann_terms, or a "
                      "smaller learning rate", stacklevel=stacklevel)
        return True

    def train(self, mode: bool = True) -> "_Core":
        if not mode and self.training:  # end of a training phase (evaluation follows): check once here
            self.check_neumann(stacklevel=4)
        return super().train(mode)

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
        c.check_neumann()
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

    # -- artefact hooks -------------------------------------------------------------------------
    base_kind = "a linear layer"

    @classmethod
    def wraps(cls, base: nn.Module) -> bool:
        return isinstance(base, nn.Linear) or _is_conv1d(base)

    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trained ``psoft_q`` (or ``psoft_R``), ``psoft_alpha``, ``psoft_beta`` and the frozen ``psoft_A``,
        ``psoft_B`` (stored, not recomputed on load, so that another machine's SVD sign conventions cannot change a
        trained adapter's function); record: the adapter's settings."""
        c = self.psoft[name]
        tensors = {"psoft_A": c.A, "psoft_B": c.B}
        for k in _PARAM_KEYS:
            p = getattr(c, k)
            if p is not None:
                tensors[f"psoft_{k}"] = p.detach()
        return tensors, dict(self.adapter_config.get(name, {}))

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        r = record.get("r")
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1) or record.get("cayley") not in CAYLEY \
                or not isinstance(record.get("orth"), bool) or not isinstance(record.get("neumann_terms"), int):
            raise ValueError("bad record")
        keys = ["A", "B", "q" if record["orth"] else "R"] + (["alpha"] if record.get("train_alpha") else []) \
            + (["beta"] if record.get("train_beta") else [])
        return {f"psoft_{k}": f"{module}.psoft_{k}" for k in keys}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        d_in, d_out = (base.in_features, base.out_features) if isinstance(base, nn.Linear) else tuple(base.weight.shape)
        r = record["r"]
        shapes = {"A": (r, d_in), "B": (d_out, r), "q": (r * (r - 1) // 2,), "R": (r, r), "alpha": (r,), "beta": (r,)}
        bad = [k for k in shapes if f"psoft_{k}" in tensors and tuple(tensors[f"psoft_{k}"].shape) != shapes[k]]
        if bad or len({t.dtype for t in tensors.values()}) != 1:
            return f"module {module!r}: tensors {bad or 'dtypes'} do not fit ({d_out}, {d_in}) with r={r}"
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        dropout = float(record.get("dropout", 0.0) or 0.0)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout {dropout!r} of module {self.layer_name!r} is outside [0, 1)")
        eps = record.get("neumann_eps")
        if eps is not None and (not isinstance(eps, (int, float)) or not 0.0 < float(eps) < 1.0):
            raise ValueError(f"neumann_eps {eps!r} of module {self.layer_name!r} is outside (0, 1)")
        extra = {k: v for k, v in record.items() if k in ("method", "singular_values_on")}
        core = self.add_adapter(name, tensors["psoft_A"], tensors["psoft_B"], orth=record["orth"],
                                train_alpha=bool(record.get("train_alpha")), train_beta=bool(record.get("train_beta")),
                                cayley_mode=record["cayley"], terms=record["neumann_terms"], eps=eps, dropout=dropout,
                                config=extra)
        with torch.no_grad():
            for k in _PARAM_KEYS:
                p = getattr(core, k)
                if p is not None:
                    p.copy_(tensors[f"psoft_{k}"])


#: the trained tensors of a PSOFT core (``q`` or ``R``, and the relaxation vectors)
_PARAM_KEYS = ("q", "R", "alpha", "beta")
