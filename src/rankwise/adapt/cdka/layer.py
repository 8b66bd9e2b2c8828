"""The CDKA layer: :class:`CDKALinear`, an ``nn.Linear`` with named Kronecker adapters."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from rankwise.adapt.cdka.functional import kron_apply, kron_delta
from rankwise.core.adapters import AdapterLayer, ArtifactContext, validate_adapter_name
from rankwise.core.errors import RankwiseError
from rankwise.core.validate import check_number


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Components(nn.Module):
    """One named adapter of a layer: trainable ``A``, ``B``; optional frozen offset ``A0``, ``B0``."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, A0: torch.Tensor | None, B0: torch.Tensor | None) -> None:
        super().__init__()
        self.A = nn.Parameter(A)
        self.B = nn.Parameter(B)
        self.register_buffer("A0", A0)
        self.register_buffer("B0", B0)

    @property
    def has_offset(self) -> bool:
        return self.A0 is not None


def _owned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached, contiguous copy on ``device`` (row-major, so results do not depend on the source's strides)."""
    return t.detach().to(device).clone(memory_format=torch.contiguous_format)


class CDKALinear(AdapterLayer):
    """An ``nn.Linear`` with named CDKA adapters: ``y = base(x) + sum_active s_k K_k(dropout(x))``.

    ``K(x) = x (sum B_k ⊗ A_k)^T - x (sum B0_k ⊗ A0_k)^T`` (the second term only with a gradient
    initialisation). Shapes: ``x (..., in_features) -> y (..., out_features)``; per adapter
    ``cdka[name].A (r, r1, in/r2)``, ``cdka[name].B (r, out/r1, r2)`` (parameters) and ``A0``, ``B0``
    (buffers, same shapes, or None). State-dict keys ``<layer>.cdka.<name>.{A,B,A0,B0}``.
    """

    adapter_store = "cdka"
    adapter_fields = ("cdka", "cdka_dropout", "scaling", "adapter_config")
    adapter_label = "CDKA adapter"
    family = "CDKA"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"CDKALinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.cdka = nn.ModuleDict()
        self.cdka_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.train(base_layer.training)

    def shape_of(self, name: str) -> tuple[int, int, int]:
        """``(r1, r2, r)`` of adapter ``name``."""
        self._require(name)
        c = self.cdka[name]
        return int(c.A.shape[1]), int(c.B.shape[2]), int(c.A.shape[0])

    def set_components(self, name: str, B: torch.Tensor, A: torch.Tensor, scaling: float, *,
                       B0: torch.Tensor | None = None, A0: torch.Tensor | None = None, dropout: float = 0.0,
                       config: Mapping[str, Any] | None = None) -> None:
        """Create (or replace) adapter ``name`` from stacks ``B (r, out/r1, r2)``, ``A (r, r1, in/r2)`` (copied)."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        if B.ndim != 3 or A.ndim != 3 or B.shape[0] != A.shape[0]:
            raise ValueError(f"{self._where()}: need stacks B (r, out/r1, r2) and A (r, r1, in/r2), got "
                             f"B {tuple(B.shape)}, A {tuple(A.shape)}")
        r, m1, r2 = B.shape
        _, r1, n2 = A.shape
        if m1 * r1 != self.out_features or r2 * n2 != self.in_features:
            raise ValueError(f"{self._where()}: B {tuple(B.shape)} ⊗ A {tuple(A.shape)} gives "
                             f"({m1 * r1}, {r2 * n2}), the layer is ({self.out_features}, {self.in_features})")
        if (B0 is None) != (A0 is None):
            raise ValueError(f"{self._where()}: give both offset factors B0 and A0 or neither")
        if B0 is not None and (B0.shape != B.shape or A0.shape != A.shape):
            raise ValueError(f"{self._where()}: offset shapes B0 {tuple(B0.shape)}, A0 {tuple(A0.shape)} must "
                             f"equal B {tuple(B.shape)}, A {tuple(A.shape)}")
        if not A.is_floating_point() or A.dtype != B.dtype or (B0 is not None and
                                                               (B0.dtype != B.dtype or A0.dtype != B.dtype)):
            raise ValueError(f"{self._where()}: factors must share one floating dtype")
        dev = self.base_layer.weight.device
        comp = _Components(_owned(A, dev), _owned(B, dev), None if A0 is None else _owned(A0, dev),
                           None if B0 is None else _owned(B0, dev))
        self.cdka[name] = comp
        self.cdka_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling[name] = float(scaling)
        self.adapter_config[name] = dict(config or {})
        self.adapter_config[name]["dropout"] = float(dropout)
        if name not in self.active_adapters and not self.active_adapters:
            self.active_adapters = [name]

    # -- math ---------------------------------------------------------------------------------
    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s (sum B_k ⊗ A_k - sum B0_k ⊗ A0_k)``, shape ``(out, in)``, in ``dtype`` (default float32/64)."""
        self._require(name)
        c = self.cdka[name]
        dt = dtype or torch.promote_types(c.A.dtype, torch.float32)
        d = kron_delta(c.B.detach().to(dt), c.A.detach().to(dt))
        if c.has_offset:
            d = d - kron_delta(c.B0.to(dt), c.A0.to(dt))
        return d * self.scaling[name]

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        c = self.cdka[name]
        return [(c.A, True), (c.B, True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            c = self.cdka[name]
            xd = self.cdka_dropout[name](x.to(c.A.dtype))
            update = kron_apply(c.B, c.A, xd)
            if c.has_offset:
                update = update - kron_apply(c.B0, c.A0, xd)
            result = result + (update * self.scaling[name]).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        shapes = {n: self.shape_of(n) for n in self.adapters}
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters(r1,r2,r)={shapes}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")

    # -- artefact hooks -------------------------------------------------------------------------
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``cdka_A (r, r1, in/r2)``, ``cdka_B (r, out/r1, r2)`` (and the offset ``cdka_A0``/``cdka_B0`` after a
        gradient initialisation); record ``{scaling, offset, config}``."""
        c = self.cdka[name]
        tensors = {"cdka_A": c.A.detach(), "cdka_B": c.B.detach()}
        if c.has_offset:
            tensors.update(cdka_A0=c.A0, cdka_B0=c.B0)
        return tensors, {"scaling": self.scaling[name], "offset": c.has_offset,
                         "config": dict(self.adapter_config.get(name, {}))}

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        check_number("scaling", record.get("scaling"))
        keys = ("cdka_A", "cdka_B") + (("cdka_A0", "cdka_B0") if record.get("offset") else ())
        return {k: f"{module}.{k}" for k in keys}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        B, A = tensors["cdka_B"], tensors["cdka_A"]
        if B.ndim != 3 or A.ndim != 3 or B.shape[0] != A.shape[0] \
                or B.shape[1] * A.shape[1] != base.out_features or B.shape[2] * A.shape[2] != base.in_features:
            return (f"module {module!r}: factors B {tuple(B.shape)}, A {tuple(A.shape)} do not fit "
                    f"({base.out_features}, {base.in_features})")
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        cfg = record.get("config") if isinstance(record.get("config"), dict) else {}
        dropout = float(cfg.get("dropout", 0.0) or 0.0)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout {dropout!r} of module {self.layer_name!r} is outside [0, 1)")
        self.set_components(name, tensors["cdka_B"], tensors["cdka_A"], float(record["scaling"]),
                            B0=tensors.get("cdka_B0"), A0=tensors.get("cdka_A0"), dropout=dropout, config=cfg)
