"""The E²LoRA layer: :class:`E2LoRALinear`, an ``nn.Linear`` whose adapters may share factors with other layers."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from rankwise.adapt.e2lora.plan import E2LoRAPlan
from rankwise.core.adapters import AdapterLayer, ArtifactContext, validate_adapter_name
from rankwise.core.errors import RankwiseError
from rankwise.core.validate import check_number


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Factor(nn.Module):
    """One factor matrix (``weight``), possibly held by several layers' adapters (shared)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class E2LoRALinear(AdapterLayer):
    """A Linear layer with named E²LoRA adapters: ``y = base(x) + sum_active s B A[:r] dropout(x)``.

    Per adapter ``name``: ``e2lora_A[name].weight (r_A, in)`` with ``r_A >= r`` (shared within an interval,
    or across the type for ``sharelora``), ``e2lora_B[name].weight (out, r)``, rank ``r`` and scale
    ``s = alpha / r``. Shapes: ``x (..., in_features) -> y (..., out_features)``.
    """

    adapter_store = "e2lora_B"
    adapter_fields = ("e2lora_A", "e2lora_B", "e2lora_dropout", "rank", "scaling", "adapter_config", "plans")
    adapter_label = "E²LoRA adapter"
    family = "E²LoRA"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"E2LoRALinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.e2lora_A = nn.ModuleDict()
        self.e2lora_B = nn.ModuleDict()
        self.e2lora_dropout = nn.ModuleDict()
        self.rank: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self.plans: dict[str, E2LoRAPlan] = {}
        self.train(base_layer.training)

    def add_adapter(self, name: str, A: _Factor, B: _Factor, rank: int, scaling: float, *, dropout: float = 0.0,
                    config: Mapping[str, Any] | None = None, plan: E2LoRAPlan | None = None) -> None:
        """Install adapter ``name`` from (possibly shared) factor modules ``A`` (``>= rank`` rows) and ``B``."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        a, b = A.weight, B.weight
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != self.in_features or b.shape[0] != self.out_features \
                or b.shape[1] != rank or a.shape[0] < rank:
            raise ValueError(f"{self._where()}: factors A {tuple(a.shape)}, B {tuple(b.shape)} do not fit rank {rank}, "
                             f"in_features={self.in_features}, out_features={self.out_features}")
        self.e2lora_A[name] = A
        self.e2lora_B[name] = B
        self.e2lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank[name] = int(rank)
        self.scaling[name] = float(scaling)
        cfg = dict(config or {})
        cfg.update({"r": int(rank), "scaling": float(scaling), "dropout": float(dropout)})
        self.adapter_config[name] = cfg
        if plan is not None:
            self.plans[name] = plan

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A[:r] (r, in), B (out, r))`` of adapter ``name``."""
        self._require(name)
        r = self.rank[name]
        return self.e2lora_A[name].weight[:r], self.e2lora_B[name].weight

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s B A[:r]``, shape ``(out, in)``, in ``dtype`` (default: float32 or the factors' wider dtype)."""
        A, B = self.factors(name)
        dt = dtype or torch.promote_types(A.dtype, torch.float32)
        with torch.no_grad():
            return (B.to(dt) @ A.to(dt)) * self.scaling[name]

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(self.e2lora_A[name].weight, True), (self.e2lora_B[name].weight, True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            A, B = self.factors(name)
            h = self.e2lora_dropout[name](x.to(A.dtype)) @ A.T
            result = result + ((h @ B.T) * self.scaling[name]).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, ranks={self.rank}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")

    # -- artefact hooks (factor sharing is restored through ``context.shared``) -------------------
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``A`` (the possibly shared factor, ``r_A >= r`` rows) and ``B``; record: rank, scale, dropout, settings."""
        return ({"A": self.e2lora_A[name].weight.detach(), "B": self.e2lora_B[name].weight.detach()},
                dict(self.adapter_config[name]))

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        r = record.get("r")
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1) \
                or not isinstance(record.get("A"), str) or not isinstance(record.get("B"), str):
            raise ValueError("bad record")
        check_number("scaling", record.get("scaling"))
        check_number("dropout", record.get("dropout", 0.0), 0.0, 1.0, high_open=True)
        return {"A": f"factor.{record['A']}", "B": f"factor.{record['B']}"}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        A, B, r = tensors["A"], tensors["B"], record["r"]
        if A.ndim != 2 or B.ndim != 2 or A.dtype != B.dtype or A.shape[1] != base.in_features or A.shape[0] < r \
                or tuple(B.shape) != (base.out_features, r):
            return (f"module {module!r}: factors A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                    f"({base.out_features}, {base.in_features}) with r={r}")
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        dev = self.base_layer.weight.device

        def factor(local: str) -> _Factor:  # one module per stored factor: the sharing comes back
            key = f"factor.{record[local]}"
            if key not in context.shared:
                context.shared[key] = _Factor(tensors[local].to(dev).clone())
            return context.shared[key]

        extra = {k: v for k, v in record.items() if k not in ("A", "B", "r", "scaling", "dropout")}
        self.add_adapter(name, factor("A"), factor("B"), record["r"],
                         float(record["scaling"]), dropout=float(record.get("dropout", 0.0)), config=extra,
                         plan=context.data.get("plan"))
