"""The mtLoRA layer: :class:`MtLoRALinear`, a linear layer carrying routed adapters (its own or a block's)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.adapt.mtlora.config import BASES, _number, _pos_int
from rankwise.adapt.mtlora.functional import routing_weights
from rankwise.core.adapters import AdapterLayer, ArtifactContext
from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.surgery import replace_module


# ------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------

class _Adapter(nn.Module):
    """One named mtLoRA adapter at one place: ``A (r, d_in)``, ``B (E, d_out, r)``, ``router (E G, d_in)``."""

    def __init__(self, d_in: int, d_out: int, rank: int, num_experts: int, group_size: int, scaling: float,
                 dropout: float, generator: torch.Generator | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d_in, self.d_out, self.rank, self.num_experts = d_in, d_out, rank, num_experts
        self.group_size, self.groups, self.scaling = group_size, d_out // group_size, float(scaling)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt 5) on a (., d_in) weight
        A = (torch.rand(rank, d_in, generator=generator) * 2 - 1) * bound
        self.A = nn.Parameter(A.to(dtype=dtype, device=device))
        self.B = nn.Parameter(torch.zeros(num_experts, d_out, rank, dtype=dtype, device=device))
        if num_experts > 1:
            R = (torch.rand(num_experts * self.groups, d_in, generator=generator) * 2 - 1) * bound
            self.router: nn.Parameter | None = nn.Parameter(R.to(dtype=dtype, device=device))
        else:
            self.router = None
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.last_routing: torch.Tensor | None = None
        self.where = ""

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """Routing weights ``(..., G, E)`` of inputs ``x (..., d_in)`` (all ones when E = 1)."""
        if self.router is None:
            return x.new_ones((*x.shape[:-1], 1, 1))
        return routing_weights(x @ self.router.T, self.groups, self.num_experts, where=self.where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.A.dtype)
        z = self.drop(x) @ self.A.T                                   # (..., r)
        u = torch.einsum("...r,edr->...ed", z, self.B)                # (..., E, d_out)
        if self.router is None:
            out = u[..., 0, :]
        else:
            g = self.routing(x)                                       # (..., G, E)
            self.last_routing = g if torch.is_grad_enabled() else g.detach()
            u = u.reshape(*u.shape[:-1], self.groups, self.group_size)
            out = (u * g.transpose(-1, -2).unsqueeze(-1)).sum(-3).reshape(*x.shape[:-1], self.d_out)
        out = out * self.scaling
        if not bool(torch.isfinite(out).all()):
            raise NumericalError(f"{self.where}: the mtLoRA adapter output holds NaN or inf")
        return out


def _owned_base(base: nn.Module) -> nn.Linear:
    if not isinstance(base, nn.Linear):
        raise TypeError(f"mtLoRA wraps nn.Linear layers, got {type(base).__name__}")
    return base


class MtLoRALinear(AdapterLayer):
    """A linear layer that may carry mtLoRA adapters and/or pass its input on to other layers' adapters.

    ``forward(x (..., in)) -> (..., out)`` is ``base(x) + sum_active adapter(u)`` where ``u`` is ``x`` for
    adapters placed on this layer itself ("component") and the input last seen by the block's input
    layer for block-level adapters (that layer is an :class:`MtLoRALinear` too, which records its input
    for its *sinks*). Adapters live in ``self.mtlora`` (an ``nn.ModuleDict`` by name).
    """

    adapter_store = "mtlora"
    adapter_fields = ("mtlora", "adapter_config")
    adapter_label = "mtLoRA adapter"
    family = "mtLoRA"
    mergeable = False

    def __init__(self, base_layer: nn.Module, layer_name: str = "") -> None:
        super().__init__(_owned_base(base_layer), layer_name)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.mtlora = nn.ModuleDict()
        object.__setattr__(self, "_sinks", [])   # plain list: sinks are not submodules of this layer
        object.__setattr__(self, "_tapped", None)
        self.train(base_layer.training)

    def add_sink(self, sink: "MtLoRALinear") -> None:
        if not any(s is sink for s in self._sinks):
            self._sinks.append(sink)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self._sinks:
            object.__setattr__(s, "_tapped", x)
        result = self.base_layer(x)
        if self.disabled or not self.active_adapters:
            object.__setattr__(self, "_tapped", None)
            return result
        tapped = self._tapped
        object.__setattr__(self, "_tapped", None)
        for name in self.active_adapters:
            src = self.adapter_config[name]["input_from"]
            if src is None:
                u = x
            else:
                if tapped is None:
                    raise RankwiseError(f"mtLoRA adapter {name!r} at {self.layer_name!r} reads the input of "
                                        f"{src!r}, which did not run before it in this forward pass")
                u = tapped
            result = result + self.mtlora[name](u).to(result.dtype)
        return result

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(p, True) for p in self.mtlora[name].parameters()]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters={self.adapters}, "
                f"active={self.active_adapters}, sinks={len(self._sinks)}, disabled={self.disabled}")

    def _snapshot(self) -> dict[str, Any]:
        snap = super()._snapshot()
        snap["sinks"] = list(self._sinks)
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        super()._restore(snap)
        object.__setattr__(self, "_sinks", snap["sinks"])

    # -- artefact hooks -------------------------------------------------------------------------
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        ad = self.mtlora[name]
        tensors = {"mtlora_A": ad.A.detach(), "mtlora_B": ad.B.detach()}
        if ad.router is not None:
            tensors["mtlora_router"] = ad.router.detach()
        return tensors, dict(self.adapter_config[name])

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        ok = (_pos_int(record.get("rank")) and _pos_int(record.get("num_experts"))
              and _pos_int(record.get("routing_group_size")) and _number(record.get("scaling"))
              and _number(record.get("dropout")) and 0.0 <= float(record["dropout"]) < 1.0
              and (record.get("input_from") is None or isinstance(record.get("input_from"), str))
              and _number(record.get("balance_alpha")) and _number(record.get("spectral_lambda"))
              and _pos_int(record.get("spectral_every")) and record.get("spectral_basis") in BASES
              and _pos_int(record.get("spectral_max_matrices")))
        if not ok:
            raise ValueError("bad record")
        keys = ("mtlora_A", "mtlora_B") + (("mtlora_router",) if record["num_experts"] > 1 else ())
        return {k: f"{module}.{k}" for k in keys}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        tap = record["input_from"]
        if tap is not None and _linear_at(model, tap) is None:
            return f"input layer {tap!r} of {module!r} is not a Linear layer of this model"
        d_in = _base_linear(_linear_at(model, tap)).in_features if tap else base.in_features
        d_out = base.out_features
        r, e, gs = record["rank"], record["num_experts"], record["routing_group_size"]
        shapes = {"A": (r, d_in), "B": (e, d_out, r), "router": ((d_out // gs) * e, d_in)}
        bad = [k for k in shapes if f"mtlora_{k}" in tensors and tuple(tensors[f"mtlora_{k}"].shape) != shapes[k]]
        if d_out % gs or bad or len({t.dtype for t in tensors.values()}) != 1:
            return (f"module {module!r}: tensors {bad or 'dtypes/group size'} do not fit d_in={d_in}, "
                    f"d_out={d_out}, r={r}, E={e}, group size {gs}")
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        A, B = tensors["mtlora_A"], tensors["mtlora_B"]
        rec = {k: v for k, v in record.items() if k not in ("input_from", "scaling")}
        ad = _install(context.model, name, record["input_from"], self.layer_name, A.shape[1], B.shape[1],
                      record["routing_group_size"], record["rank"], record["num_experts"], float(record["scaling"]),
                      float(record["dropout"]), torch.Generator().manual_seed(0), A.dtype,
                      self.base_layer.weight.device, rec)
        with torch.no_grad():
            ad.A.copy_(A)
            ad.B.copy_(B)
            if ad.router is not None:
                ad.router.copy_(tensors["mtlora_router"])


def _linear_at(model: nn.Module, name: str) -> nn.Module | None:
    try:
        m = model.get_submodule(name)
    except AttributeError:
        return None
    return m if isinstance(m, (nn.Linear, MtLoRALinear)) else None


def _base_linear(m: nn.Module) -> nn.Linear:
    return m.base_layer if isinstance(m, MtLoRALinear) else m


def _wrap(model: nn.Module, lname: str) -> MtLoRALinear:
    mod = model.get_submodule(lname)
    if isinstance(mod, MtLoRALinear):
        return mod
    layer = MtLoRALinear(mod, layer_name=lname)
    replace_module(model, lname, layer)
    return layer


def _install(model: nn.Module, name: str, tap: str | None, out: str, d_in: int, d_out: int, gs: int, rank: int,
             num_experts: int, scaling: float, dropout: float, gen: torch.Generator | None, dtype: torch.dtype,
             device: torch.device, record: dict[str, Any]) -> _Adapter:
    out_layer = _wrap(model, out)
    if tap is not None:
        _wrap(model, tap).add_sink(out_layer)
    ad = _Adapter(d_in, d_out, rank, num_experts, gs, scaling, dropout, gen, dtype, device)
    ad.where = f"{out} [{name}]"
    out_layer.mtlora[name] = ad
    out_layer.adapter_config[name] = dict(record, input_from=tap, scaling=scaling)
    out_layer.active_adapters = [name]
    return ad
