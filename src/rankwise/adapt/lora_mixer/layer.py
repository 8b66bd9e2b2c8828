"""The LoRA-Mixer layer: :class:`LoRAMixerLinear`, a linear layer with router-weighted LoRA experts."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from rankwise.adapt.lora_mixer.config import F_DEFINITIONS, _number, _pos_int
from rankwise.adapt.lora_mixer.functional import topk_gate
from rankwise.core.adapters import AdapterLayer, ArtifactContext
from rankwise.core.errors import NumericalError, RankwiseError


# ------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------

class _Mixer(nn.Module):
    """One named LoRA-Mixer adapter of one projection: experts ``A[e] (r_e, d_in)``, ``B[e] (d_out, r_e)``,
    router ``(E, d_in)``, per-expert scalings."""

    def __init__(self, d_in: int, d_out: int, ranks: Sequence[int], scalings: Sequence[float], dropout: float,
                 router_std: float, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d_in, self.d_out, self.num_experts = d_in, d_out, len(ranks)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt 5), PEFT's lora_A init
        self.A = nn.ParameterList([nn.Parameter(((torch.rand(r, d_in, generator=generator) * 2 - 1) * bound)
                                                .to(dtype=dtype, device=device)) for r in ranks])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(d_out, r, dtype=dtype, device=device)) for r in ranks])
        self.router = nn.Parameter((torch.randn(len(ranks), d_in, generator=generator) * router_std)
                                   .to(dtype=dtype, device=device))
        self.scalings = [float(s) for s in scalings]
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.frozen: list[bool] = [False] * len(ranks)
        self.reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # theta^(0) of preserved experts
        self.last_p: torch.Tensor | None = None
        self.where = ""

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.router.T
        if not bool(torch.isfinite(logits).all()):
            raise NumericalError(f"{self.where}: router logits hold NaN or inf")
        return torch.softmax(logits.float(), dim=-1).to(x.dtype)

    def forward(self, x: torch.Tensor, mode: str, k: int, renormalize: bool,
                hard: torch.Tensor | None) -> torch.Tensor:
        x = x.to(self.router.dtype)
        p = self.probabilities(x)
        self.last_p = p if torch.is_grad_enabled() else p.detach()
        if mode == "hard":
            if hard is None:
                raise RankwiseError(f"{self.where}: hard routing needs expert labels (use hard_routing(model, labels))")
            if hard.shape[0] != x.shape[0]:
                raise ValueError(f"{self.where}: {hard.shape[0]} hard-routing labels for a batch of {x.shape[0]}")
            gate = nn.functional.one_hot(hard, self.num_experts).to(x.dtype)
            gate = gate.reshape(gate.shape[0], *([1] * (x.ndim - 2)), self.num_experts).expand(*x.shape[:-1], -1)
        elif mode == "soft":
            gate = p
        else:
            gate = topk_gate(p, k, renormalize)
        xd = self.drop(x)
        out = None
        for e in range(self.num_experts):
            ge = gate[..., e:e + 1]
            if mode == "hard" and not bool(ge.any()):
                continue  # no example of the batch uses this expert (skips its compute; same result)
            u = (xd @ self.A[e].T) @ self.B[e].T * self.scalings[e]
            out = ge * u if out is None else out + ge * u
        if out is None:
            out = x.new_zeros((*x.shape[:-1], self.d_out))
        if not bool(torch.isfinite(out).all()):
            raise NumericalError(f"{self.where}: the LoRA-Mixer output holds NaN or inf")
        return out


class LoRAMixerLinear(AdapterLayer):
    """A linear layer with named LoRA-Mixer adapters: ``y = base(x) + sum_active mixer(x)``.

    Shapes: ``x (..., in_features) -> (..., out_features)``. Fusion: "soft" in training mode, "topk" in
    eval mode, unless forced by :func:`fusion`; "hard" inside :func:`hard_routing`.
    """

    adapter_store = "mixer"
    adapter_fields = ("mixer", "adapter_config")
    adapter_label = "LoRA-Mixer adapter"
    family = "LoRA-Mixer"
    mergeable = False

    def __init__(self, base_layer: nn.Module, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRA-Mixer wraps nn.Linear layers, got {type(base_layer).__name__} at {layer_name!r}")
        super().__init__(base_layer, layer_name)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.mixer = nn.ModuleDict()
        self.forced_fusion: str | None = None
        self.hard_labels: torch.Tensor | None = None
        self.train(base_layer.training)

    def fusion_mode(self) -> str:
        if self.hard_labels is not None:
            return "hard"
        if self.forced_fusion is not None:
            return self.forced_fusion
        return "soft" if self.training else "topk"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled:
            return result
        mode = self.fusion_mode()
        for name in self.active_adapters:
            cfg = self.adapter_config[name]
            result = result + self.mixer[name](x, mode, cfg["top_k_infer"], cfg["renormalize"],
                                               self.hard_labels).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters={self.adapters}, "
                f"active={self.active_adapters}, disabled={self.disabled}")

    def _snapshot(self) -> dict[str, Any]:
        snap = super()._snapshot()
        snap["frozen"] = {n: list(m.frozen) for n, m in self.mixer.items()}
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        super()._restore(snap)
        for n, fr in snap["frozen"].items():
            self.mixer[n].frozen = fr

    # -- artefact hooks -------------------------------------------------------------------------
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Experts ``mixer_A.<e>``, ``mixer_B.<e>`` and ``mixer_router``; record: the settings and frozen flags.
        The preservation reference of loaded experts is not saved: after loading, the loaded weights are it."""
        mx = self.mixer[name]
        tensors = {f"mixer_{k}.{e}": getattr(mx, k)[e].detach() for e in range(mx.num_experts) for k in ("A", "B")}
        tensors["mixer_router"] = mx.router.detach()
        return tensors, dict(self.adapter_config[name], frozen=list(mx.frozen))

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: ArtifactContext) -> dict[str, str]:
        ok = (isinstance(record.get("ranks"), list) and record["ranks"]
              and all(_pos_int(r) for r in record["ranks"]) and isinstance(record.get("scalings"), list)
              and len(record["scalings"]) == len(record["ranks"]) and all(_number(s) for s in record["scalings"])
              and isinstance(record.get("frozen"), list) and len(record["frozen"]) == len(record["ranks"])
              and all(isinstance(f, bool) for f in record["frozen"]) and _pos_int(record.get("top_k_infer"))
              and isinstance(record.get("renormalize"), bool) and _number(record.get("dropout"))
              and 0.0 <= float(record["dropout"]) < 1.0 and record.get("entropy_sign") in (1, -1)
              and record.get("f_definition") in F_DEFINITIONS
              and all(_number(record.get(k)) and float(record[k]) >= 0
                      for k in ("rsl_alpha", "rsl_lambda", "preserve_beta"))
              and _number(record.get("router_std")))
        if not ok:
            raise ValueError("bad record")
        keys = ["mixer_router"] + [f"mixer_{k}.{e}" for k in ("A", "B") for e in range(len(record["ranks"]))]
        return {k: f"{module}.{k}" for k in keys}

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: ArtifactContext) -> str | None:
        want = {"mixer_router": (len(record["ranks"]), base.in_features)}
        for e, r in enumerate(record["ranks"]):
            want[f"mixer_A.{e}"] = (r, base.in_features)
            want[f"mixer_B.{e}"] = (base.out_features, r)
        bad = [f"{module}.{k}" for k, s in want.items() if tuple(tensors[k].shape) != s]
        if bad or len({t.dtype for t in tensors.values()}) != 1:
            return f"module {module!r}: tensors {bad[:3] or 'dtypes'} do not fit ({base.out_features}, {base.in_features})"
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: ArtifactContext) -> None:
        router = tensors["mixer_router"]
        mx = _Mixer(self.in_features, self.out_features, record["ranks"], record["scalings"], float(record["dropout"]),
                    float(record["router_std"]), torch.Generator().manual_seed(0), router.dtype,
                    self.base_layer.weight.device)
        mx.where = f"{self.layer_name} [{name}]"
        with torch.no_grad():
            mx.router.copy_(router)
            for e in range(mx.num_experts):
                mx.A[e].copy_(tensors[f"mixer_A.{e}"])
                mx.B[e].copy_(tensors[f"mixer_B.{e}"])
                if record.get("sources"):
                    mx.reference[e] = (mx.A[e].detach().clone(), mx.B[e].detach().clone())
        mx.frozen = list(record["frozen"])
        group = record.get("router_group")
        if isinstance(group, str):  # Q/K/V of one layer shared one router: tie them again
            tied = context.shared.setdefault("routers", {})
            if group in tied and tied[group].router.shape == mx.router.shape:
                if not torch.equal(tied[group].router.detach(), mx.router.detach()):
                    raise ValueError(f"module {self.layer_name!r} shares the router of group {group!r} but its "
                                     "stored router differs")
                mx.router = tied[group].router
            else:
                tied[group] = mx
        self.mixer[name] = mx
        self.adapter_config[name] = {k: v for k, v in record.items() if k != "frozen"}
