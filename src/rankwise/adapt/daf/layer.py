"""The DAF layer: :class:`DAFLinear`, an ``nn.Linear`` that is a candidate of named DAF adapters."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from rankwise.adapt.daf.config import ROLES
from rankwise.adapt.daf.functional import unit_cost
from rankwise.core.adapters import AdapterLayer, ArtifactContext, validate_adapter_name
from rankwise.core.errors import RankwiseError
from rankwise.core.validate import check_number


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Unit(nn.Module):
    """One LoRA unit: ``A (r, d_in)``, ``B (d_out, r)``; the update is ``s · B A x``."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor) -> None:
        super().__init__()
        self.A = nn.Parameter(A.contiguous())
        self.B = nn.Parameter(B.contiguous())


class DAFLinear(AdapterLayer):
    """An ``nn.Linear`` that is a DAF candidate of one or more named adapters.

    ``y = base(x) + Σ_{active adapters with a unit} s · B A dropout(x)``; shapes ``x (..., d_in) -> y (..., d_out)``.
    Per adapter the layer has a *role*: ``"candidate"`` (no unit), ``"training"`` (a trainable unit that
    counts against the budget) or ``"frozen"`` (a unit kept in the forward pass, not trained, free).
    ``score[name]`` is the smoothed sensitivity ``S_j`` of the last analysis (None before any).
    State-dict keys ``<layer>.daf.<name>.{A,B}``.
    """

    adapter_store = "role"
    adapter_fields = ("daf", "daf_dropout", "role", "score", "scaling", "adapter_config")
    adapter_label = "DAF adapter"
    family = "DAF"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"DAFLinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.daf = nn.ModuleDict()
        self.daf_dropout = nn.ModuleDict()
        self.role: dict[str, str] = {}
        self.score: dict[str, float | None] = {}
        self.scaling: dict[str, float] = {}
        self.train(base_layer.training)

    def cost(self, rank: int) -> int:
        return unit_cost(self.in_features, self.out_features, rank)

    # -- adapters -----------------------------------------------------------------------------
    def add_candidate(self, name: str, scaling: float, dropout: float, config: Mapping[str, Any]) -> None:
        validate_adapter_name(name)
        if name in self.role:
            raise ValueError(f"{self._where()} already has an adapter named {name!r}")
        self.role[name] = "candidate"
        self.score[name] = None
        self.scaling[name] = float(scaling)
        self.daf_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.daf_dropout[name].train(self.training)
        self.adapter_config[name] = dict(config)

    def attach_unit(self, name: str, A: torch.Tensor, B: torch.Tensor) -> None:
        """Install a unit (copied, moved to the base's device) for adapter ``name``; its role becomes training."""
        self._require(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge first")
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != self.in_features or B.shape[0] != self.out_features \
                or A.shape[0] != B.shape[1] or not A.is_floating_point() or A.dtype != B.dtype:
            raise ValueError(f"{self._where()}: unit A {tuple(A.shape)}, B {tuple(B.shape)} does not fit "
                             f"(d_out={self.out_features}, d_in={self.in_features}); expected A (r, in), B (out, r) "
                             "of one floating dtype")
        dev = self.base_layer.weight.device
        unit = _Unit(A.detach().to(dev, copy=True), B.detach().to(dev, copy=True))
        unit.train(self.training)
        self.daf[name] = unit
        self.role[name] = "training"

    # -- math -----------------------------------------------------------------------------------
    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """``s · B A`` of adapter ``name`` (``(d_out, d_in)``, float32 or wider), None without a unit."""
        self._require(name)
        if name not in self.daf:
            return None
        u = self.daf[name]
        dt = dtype or torch.promote_types(u.A.dtype, torch.float32)
        return (u.B.detach().to(dt) @ u.A.detach().to(dt)) * self.scaling[name]

    def mergeable_adapters(self) -> list[str]:
        """The active adapters that have a unit (candidates without one contribute nothing)."""
        return [n for n in self.active_adapters if n in self.daf]

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        """The unit's ``A``, ``B`` (none for a candidate), trainable only in the "training" role."""
        if name not in self.daf:
            return []
        u, training = self.daf[name], self.role[name] == "training"
        return [(u.A, training), (u.B, training)]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            u = self.daf[name] if name in self.daf else None
            if u is None:
                continue
            xa = self.daf_dropout[name](x.to(u.A.dtype))
            update = (xa @ u.A.T) @ u.B.T * self.scaling[name]
            result = result + update.to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, roles={self.role}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")

    # -- artefact hooks -------------------------------------------------------------------------
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The unit ``daf_A (r, in)``, ``daf_B (out, r)`` (none for a candidate); record: role, smoothed
        score (it drives the next round's smoothing), scaling and the layer's shape."""
        tensors = {"daf_A": self.daf[name].A.detach(), "daf_B": self.daf[name].B.detach()} if name in self.daf else {}
        return tensors, {"role": self.role[name], "score": self.score[name], "scaling": self.scaling[name],
                         "in_features": self.in_features, "out_features": self.out_features}

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        if record.get("role") not in ROLES:
            raise ValueError(f"role {record.get('role')!r}")
        check_number("scaling", record.get("scaling"))
        if record.get("score") is not None:
            check_number("score", record.get("score"))
        return {} if record["role"] == "candidate" else {k: f"{module}.{k}" for k in ("daf_A", "daf_B")}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        if not tensors:
            return None
        A, B, rank = tensors["daf_A"], tensors["daf_B"], context.data["cfg"].rank
        if A.ndim != 2 or B.ndim != 2 or A.shape != (rank, base.in_features) \
                or B.shape != (base.out_features, rank) or A.dtype != B.dtype:
            return (f"module {module!r}: unit A {tuple(A.shape)}, B {tuple(B.shape)} does not fit "
                    f"({base.out_features}, {base.in_features}) with rank {rank}")
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        self.add_candidate(name, float(record["scaling"]), context.data["cfg"].dropout, context.data["config"])
        self.score[name] = None if record["score"] is None else float(record["score"])
        if record["role"] != "candidate":
            self.attach_unit(name, tensors["daf_A"], tensors["daf_B"])
            self.role[name] = record["role"]
