"""The EBLoRA layer: :class:`EBLoRALinear`, an ``nn.Linear`` with named balanced adapters ``c s U V^T``."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.adapt.stiefel_cl.functional import empty_basis
from rankwise.core.adapters import ArtifactContext, LinearAdapterLayer, validate_adapter_name
from rankwise.core.errors import RankwiseError
from rankwise.core.validate import check_number


class EBLoRALinear(LinearAdapterLayer):
    """A linear layer with named EBLoRA adapters: ``y = base(x) + sum_active c s (x V) U^T``.

    Per adapter: ``eblora_U[name]`` (out, r) and ``eblora_V[name]`` (in, r) with orthonormal columns (kept
    on the Stiefel manifold by :class:`~rankwise.adapt.stiefel_cl.RiemannianAdamW`), the magnitude
    ``eblora_s[name]`` (a 0-d parameter) and ``scaling[name] = c = alpha / r``; ``ΔW = c s U V^T`` has all r
    singular values equal to ``|c s|``. The layer's protected input basis ``protected`` (in, p) (a
    non-persistent buffer; the continual driver saves it) constrains new adapters to ``F^T V = 0``.
    """

    adapter_store = "eblora_U"
    adapter_fields = ("eblora_U", "eblora_V", "eblora_s", "scaling", "adapter_config")
    adapter_label = "EBLoRA adapter"
    family = "EBLoRA"
    scaling: dict[str, float]

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        super().__init__(base_layer, layer_name)
        self.eblora_U = nn.ParameterDict()
        self.eblora_V = nn.ParameterDict()
        self.eblora_s = nn.ParameterDict()
        self.register_buffer("protected", empty_basis(self.in_features, device=base_layer.weight.device),
                             persistent=False)

    # -- adapters -----------------------------------------------------------------------------
    def set_factors(self, name: str, U: torch.Tensor, V: torch.Tensor, s: float | torch.Tensor, scaling: float, *,
                    config: Mapping[str, Any] | None = None) -> None:
        """Create (or replace) adapter ``name`` from ``U`` (out, r), ``V`` (in, r), magnitude ``s`` and ``c`` (copied)."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        if U.ndim != 2 or V.ndim != 2 or U.shape[0] != self.out_features or V.shape[0] != self.in_features \
                or U.shape[1] != V.shape[1] or U.shape[1] < 1:
            raise ValueError(f"{self._where()}: factors U {tuple(U.shape)}, V {tuple(V.shape)} do not fit "
                             f"out_features={self.out_features}, in_features={self.in_features} "
                             "(expected U (out, r), V (in, r))")
        if not U.is_floating_point() or U.dtype != V.dtype:
            raise ValueError(f"{self._where()}: U and V must share one floating dtype")
        if not math.isfinite(float(scaling)):
            raise ValueError(f"{self._where()}: scaling must be finite, got {scaling!r}")
        dev = self.base_layer.weight.device
        s_t = torch.as_tensor(s, dtype=U.dtype).detach().reshape(()).to(dev)
        self.eblora_U[name] = nn.Parameter(U.detach().to(dev).clone(memory_format=torch.contiguous_format))
        self.eblora_V[name] = nn.Parameter(V.detach().to(dev).clone(memory_format=torch.contiguous_format))
        self.eblora_s[name] = nn.Parameter(s_t.clone())
        self.scaling[name] = float(scaling)
        cfg = dict(config or {})
        cfg["rank"] = int(U.shape[1])
        self.adapter_config[name] = cfg
        if not self.active_adapters:
            self.active_adapters = [name]

    def rank(self, name: str) -> int:
        self._require(name)
        return int(self.eblora_U[name].shape[1])

    def set_protected(self, F: torch.Tensor) -> None:
        """Replace the protected input basis ``F`` (in, p), orthonormal columns (stored as float32)."""
        if F.ndim != 2 or F.shape[0] != self.in_features or F.shape[1] > self.in_features:
            raise ValueError(f"{self._where()}: protected basis {tuple(F.shape)} does not fit in_features="
                             f"{self.in_features}")
        self.protected = F.detach().to(self.base_layer.weight.device, torch.float32).contiguous()

    # -- math -----------------------------------------------------------------------------------
    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``c s U V^T``, shape (out, in), in ``dtype`` (default float32, float64 for float64 factors)."""
        self._require(name)
        U, V = self.eblora_U[name].detach(), self.eblora_V[name].detach()
        dt = dtype or torch.promote_types(U.dtype, torch.float32)
        return (self.scaling[name] * self.eblora_s[name].detach().to(dt)) * (U.to(dt) @ V.to(dt).T)

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(self.eblora_U[name], True), (self.eblora_V[name], True), (self.eblora_s[name], True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            U, V = self.eblora_U[name], self.eblora_V[name]
            update = ((x.to(V.dtype) @ V) @ U.T) * (self.eblora_s[name] * self.scaling[name])
            result = result + update.to(result.dtype)
        return result

    def extra_repr(self) -> str:
        ranks = {n: self.rank(n) for n in self.adapters}
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters(r)={ranks}, "
                f"protected={self.protected.shape[1]}, active={self.active_adapters}, merged={self.merged_adapters}, "
                f"disabled={self.disabled}")

    # -- artefact hooks -------------------------------------------------------------------------
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``eblora_U`` (out, r), ``eblora_V`` (in, r), ``eblora_s`` (); record ``{scaling, config}``."""
        self._require(name)
        tensors = {"eblora_U": self.eblora_U[name].detach(), "eblora_V": self.eblora_V[name].detach(),
                   "eblora_s": self.eblora_s[name].detach()}
        return tensors, {"scaling": self.scaling[name], "config": dict(self.adapter_config.get(name, {}))}

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        check_number("scaling", record.get("scaling"))
        return {k: f"{module}.{k}" for k in ("eblora_U", "eblora_V", "eblora_s")}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        U, V, s = tensors["eblora_U"], tensors["eblora_V"], tensors["eblora_s"]
        if U.ndim != 2 or V.ndim != 2 or s.ndim != 0 or U.shape[0] != base.out_features \
                or V.shape[0] != base.in_features or U.shape[1] != V.shape[1]:
            return (f"module {module!r}: factors U {tuple(U.shape)}, V {tuple(V.shape)}, s {tuple(s.shape)} do not "
                    f"fit ({base.out_features}, {base.in_features})")
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        cfg = record.get("config") if isinstance(record.get("config"), dict) else {}
        self.set_factors(name, tensors["eblora_U"], tensors["eblora_V"], tensors["eblora_s"],
                         float(record["scaling"]), config=cfg)
