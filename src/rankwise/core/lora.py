"""The LoRA layer and :class:`AdapterState`, shared by adapters, merging, federated training and optimizers.

LoRA (Hu et al., 2021, Eq. 3) adds a trainable low-rank update to a frozen linear layer::

    h = W0 x + s * B A x,      A: (r, in),  B: (out, r),  s = alpha / r      (alpha / sqrt(r) for rsLoRA)

:class:`LoraLinear` wraps an ``nn.Linear`` (``base_layer``) and holds any number of *named* adapters
(``lora_A[name]``, ``lora_B[name]``: ``nn.Linear`` modules, so parameter names follow PEFT:
``<layer>.lora_A.<name>.weight``), with per-adapter scaling and dropout. One or several adapters are
*active* (their updates are summed); all can be disabled at once (the base layer alone), and the
active ones can be merged into ``base_layer.weight`` (``W0 += s B A``) and unmerged again.

:class:`AdapterState` is the plain-data form of one named adapter of a whole model: per module
``{"lora_A": A, "lora_B": B}``, the scaling per module (so ranks and scalings may differ per module,
as after merging), a JSON config and the base model's fingerprint. It is what merging methods,
federated clients/servers and LoRA optimizers exchange; :func:`get_state` / :func:`set_state` move it
out of / into a model, :meth:`AdapterState.save` / :meth:`AdapterState.load` store it as one
safetensors file (keys ``<module>.lora_A`` / ``<module>.lora_B``, metadata in the header, see
:mod:`rankwise.core.io`).

Model-level operations (:func:`add_lora`, :func:`set_active`, :func:`merge_adapters`, ...) are
all-or-nothing: on an error the model is left as it was.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module

__all__ = [
    "AdapterState",
    "LoraLinear",
    "add_lora",
    "adapter_names",
    "base_module_names",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "get_state",
    "lora_layers",
    "lora_scaling",
    "merge_adapters",
    "set_active",
    "set_state",
    "unload",
    "unmerge_adapters",
    "check_state_fits",
    "validate_adapter_name",
]

INITS = ("kaiming", "gaussian")
_STATE_KIND = "rankwise.adapter_state"


def lora_scaling(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """``alpha / r`` (LoRA, Hu et al. Eq. 3 text) or ``alpha / sqrt(r)`` (rsLoRA, Kalajdzievski 2023)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    alpha = float(alpha)
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha!r}")
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Products of low-precision factors are formed in float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class LoraLinear(AdapterLayer):
    """An ``nn.Linear`` with named LoRA adapters: ``y = base(x) + sum_active s_k B_k A_k dropout_k(x)``.

    Shapes: ``x (..., in_features) -> y (..., out_features)``; ``lora_A[k].weight (r_k, in)``,
    ``lora_B[k].weight (out, r_k)``. Adapter factors keep their own dtype; the input is cast to it
    and the update cast back to the base output's dtype.

    ``is_rankwise_wrapper`` and ``fingerprint_values`` (value samples of the base parameters taken
    when wrapping) let :func:`rankwise.core.io.model_fingerprint` see the unadapted base model.
    Selecting, enabling, deleting and snapshotting come from :class:`rankwise.core.adapters.AdapterLayer`.
    """

    adapter_store = "lora_A"
    adapter_fields = ("lora_A", "lora_B", "lora_dropout", "scaling", "adapter_config")
    adapter_label = "adapter"
    family = "LoRA"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoraLinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.train(base_layer.training)  # a wrapper inherits train/eval mode from the layer it wraps

    def rank(self, name: str) -> int:
        self._require(name)
        return int(self.lora_A[name].weight.shape[0])

    # -- adapters -----------------------------------------------------------------------------
    def add_adapter(
        self,
        name: str,
        rank: int,
        alpha: float,
        *,
        use_rslora: bool = False,
        dropout: float = 0.0,
        init: str = "kaiming",
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Add adapter ``name`` with fresh factors: B = 0, A by ``init`` (so the layer output is unchanged).

        ``init="kaiming"``: A ~ kaiming_uniform(a=sqrt(5)) (the reference/PEFT default);
        ``init="gaussian"``: A ~ N(0, 1/r^2) (PEFT's "gaussian"). Drawn on CPU from ``generator``.
        """
        validate_adapter_name(name)
        if name in self.lora_A:
            raise ValueError(f"{self._where()} already has an adapter named {name!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"rank must be a positive int for {self._where()}, got {rank!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        w = self.base_layer.weight
        dtype = dtype or (w.dtype if w.is_floating_point() else torch.float32)
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        if init == "kaiming":
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        else:
            nn.init.normal_(a, mean=0.0, std=1.0 / rank, generator=generator)
        b = torch.zeros(self.out_features, rank, dtype=torch.float32)
        self._install(name, a.to(w.device, dtype), b.to(w.device, dtype),
                      lora_scaling(alpha, rank, use_rslora), dropout,
                      {"rank": rank, "alpha": float(alpha), "use_rslora": bool(use_rslora),
                       "dropout": float(dropout), "init": init})

    def set_factors(self, name: str, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, *,
                    dropout: float = 0.0, config: Mapping[str, Any] | None = None) -> None:
        """Create (or replace) adapter ``name`` from given factors (copied; dtype kept, moved to the base's device)."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[1] != self.in_features \
                or lora_B.shape[0] != self.out_features or lora_A.shape[0] != lora_B.shape[1]:
            raise ValueError(f"{self._where()}: factors lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)} "
                             f"do not fit in_features={self.in_features}, out_features={self.out_features} "
                             "(expected A (r, in), B (out, r))")
        if not math.isfinite(float(scaling)):
            raise ValueError(f"{self._where()}: scaling must be finite, got {scaling!r}")
        was_active = name in self.active_adapters
        if name in self.lora_A:
            self._drop_adapter(name)
        dev = self.base_layer.weight.device
        cfg = dict(config or {})
        cfg.setdefault("rank", int(lora_A.shape[0]))
        cfg["dropout"] = float(dropout)
        self._install(name, lora_A.detach().to(dev, copy=True), lora_B.detach().to(dev, copy=True),
                      float(scaling), dropout, cfg)
        if was_active:
            self.active_adapters.append(name)

    def _install(self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float,
                 cfg: dict[str, Any]) -> None:
        if not (isinstance(dropout, (int, float)) and 0.0 <= float(dropout) < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        r = a.shape[0]
        la = nn.Linear(self.in_features, r, bias=False, device="meta")
        lb = nn.Linear(r, self.out_features, bias=False, device="meta")
        la.weight = nn.Parameter(a.contiguous())
        lb.weight = nn.Parameter(b.contiguous())
        self.lora_A[name] = la
        self.lora_B[name] = lb
        self.lora_dropout[name] = nn.Dropout(float(dropout)) if dropout > 0 else nn.Identity()
        for m in (la, lb, self.lora_dropout[name]):
            m.train(self.training)  # new adapters follow the layer's train/eval mode
        self.scaling[name] = float(scaling)
        self.adapter_config[name] = cfg

    # -- math -----------------------------------------------------------------------------------
    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s * B @ A``, shape (out, in), in ``dtype`` (default float32, float64 if the factors are float64)."""
        self._require(name)
        a = self.lora_A[name].weight
        b = self.lora_B[name].weight
        dt = dtype or _compute_dtype(a.dtype)
        return (b.detach().to(dt) @ a.detach().to(dt)) * self.scaling[name]

    def merge(self, names: Sequence[str] | None = None) -> list[str]:  # type: ignore[override]
        """Add the updates of ``names`` (default: the active adapters) into ``base_layer.weight``; returns them.

        Refuses to merge twice or while disabled. The sum is formed in float32 or wider and written back
        in place in the base weight's dtype; a non-finite result raises NumericalError and leaves the
        weight unchanged.
        """
        return self._merge(names)

    def unmerge(self) -> list[str]:  # type: ignore[override]
        """Subtract the merged updates from ``base_layer.weight`` (exact up to float rounding); returns their names."""
        if not self.merged_adapters:
            raise RankwiseError(f"{self._where()}: nothing is merged")
        return self._unmerge()

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(self.lora_A[name].weight, True), (self.lora_B[name].weight, True)]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disabled:
            return result
        for name in self.active_adapters:
            if name in self.merged_adapters:
                continue
            a = self.lora_A[name]
            xa = x.to(a.weight.dtype)
            update = self.lora_B[name](a(self.lora_dropout[name](xa))) * self.scaling[name]
            result = result + update.to(result.dtype)
        return result

    def extra_repr(self) -> str:
        ranks = {n: self.rank(n) for n in self.adapters}
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters={ranks}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

def lora_layers(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """``(qualified name, LoraLinear)`` of every LoRA layer of ``model``, in model order."""
    return adapters.adapted_layers(model, LoraLinear)


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the adapters present in ``model`` (in order of first appearance)."""
    return adapters.adapter_names(model, LoraLinear)


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active adapter(s) of every LoRA layer (trainable); others inactive (frozen).

    A layer that lacks some of the names activates those it has.
    """
    adapters.set_active(model, names, LoraLinear)


def enable_adapters(model: nn.Module) -> None:
    """Turn the active adapters back on (after :func:`disable_adapters`)."""
    adapters.enable_adapters(model, LoraLinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept). Refused while merged."""
    adapters.disable_adapters(model, LoraLinear)


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name`` from every layer (a layer left without adapters gets its plain Linear back)."""
    adapters.delete_adapter(model, name, LoraLinear)


@adapters.deprecated_kwargs(merge_first="merge")
def unload(model: nn.Module, merge: bool = True) -> nn.Module:
    """Replace every LoraLinear by its base Linear, merging the active adapters first if ``merge``.

    The result is a plain model (no LoRA modules), e.g. to save with ``save_pretrained``.
    """
    return adapters.unload(model, LoraLinear, merge)


def base_module_names(model: nn.Module) -> list[str]:
    """Module names as PEFT sees the base model (LoRA wrappers replaced by their base layers)."""
    wrappers = [n for n, _ in lora_layers(model)]
    return [n for n, _ in model.named_modules() if n and not any(n.startswith(w + ".") for w in wrappers)]


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Undo module replacements, requires_grad changes and LoraLinear state changes on error."""
    return adapters.all_or_nothing(model, LoraLinear)


def _require_adapter(model: nn.Module, name: str) -> list[tuple[str, LoraLinear]]:
    return adapters.require_adapter(model, name, LoraLinear)


def _sync_trainable(model: nn.Module, freeze_base: bool) -> None:
    """Active adapters' factors trainable, inactive ones frozen; the base frozen when ``freeze_base``."""
    adapters.sync_trainable(model, LoraLinear, freeze_base)


def _resolve(value: Any, name: str, module: nn.Module, what: str) -> Any:
    if callable(value) and not isinstance(value, (int, float)):
        return value(name, module)
    if isinstance(value, Mapping):
        if name not in value:
            raise ValueError(f"{what} mapping has no entry for layer {name!r}")
        return value[name]
    return value


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    """Linear layers (or existing LoraLinear wrappers) that ``target`` selects, never LoRA internals."""
    return adapters.target_layers(model, target, LoraLinear, typed=True)


def add_lora(
    model: nn.Module,
    target: Selector,
    name: str = "default",
    *,
    rank: int | Mapping[str, int] | Callable[[str, nn.Module], int] = 8,
    alpha: float | Mapping[str, float] | Callable[[str, nn.Module], float] = 16.0,
    use_rslora: bool = False,
    dropout: float = 0.0,
    init: str = "kaiming",
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    activate: bool = True,
    freeze_base: bool = True,
    max_rank: bool = True,
) -> list[str]:
    """Add a fresh LoRA adapter ``name`` to the Linear layers ``target`` selects; returns their names.

    Layers are wrapped in :class:`LoraLinear` (or the existing wrapper gets one more adapter).
    ``rank``/``alpha`` may be per layer (a dict by qualified name, or ``f(name, module)``). With
    ``max_rank`` a rank above ``min(in_features, out_features)`` is rejected (a larger rank adds
    parameters without adding expressiveness). With ``activate`` the new adapter becomes the only
    active one (and the only trainable one); ``freeze_base`` freezes every non-LoRA parameter.
    Everything is validated before the model is touched; a failure leaves the model unchanged.
    Factors are initialised in model order from ``generator`` (the global RNG if None).
    """
    validate_adapter_name(name)
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if not (isinstance(dropout, (int, float)) and 0.0 <= float(dropout) < 1.0):
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    merged = [n for n, layer in lora_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}{' ...' if len(merged) > 3 else ''}; "
                            "unmerge before adding an adapter")
    hits = _target_layers(model, target)
    plan: list[tuple[str, nn.Module, int, float]] = []
    for lname, mod in hits:
        base = mod.base_layer if isinstance(mod, LoraLinear) else mod
        r = _resolve(rank, lname, base, "rank")
        a = _resolve(alpha, lname, base, "alpha")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"rank must be a positive int, got {r!r} for layer {lname!r}")
        limit = min(base.in_features, base.out_features)
        if max_rank and r > limit:
            raise ValueError(f"rank {r} for layer {lname!r} exceeds min(in_features={base.in_features}, "
                             f"out_features={base.out_features}) = {limit}; choose rank in [1, {limit}]")
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(float(a)):
            raise ValueError(f"alpha must be a finite number, got {a!r} for layer {lname!r}")
        if isinstance(mod, LoraLinear):
            if name in mod.lora_A:
                raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; "
                                 "choose another name or delete it first")
        plan.append((lname, mod, r, float(a)))

    with _all_or_nothing(model):
        for lname, mod, r, a in plan:
            layer = mod if isinstance(mod, LoraLinear) else LoraLinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.add_adapter(name, r, a, use_rslora=use_rslora, dropout=float(dropout), init=init,
                              generator=generator, dtype=dtype)
            if activate:
                layer.set_active(name)
        if activate:
            for _, layer in lora_layers(model):
                if name not in layer.lora_A:
                    layer.set_active([])
        _sync_trainable(model, freeze_base)
    return [n for n, *_ in plan]


def merge_adapters(model: nn.Module) -> list[str]:
    """Merge the active adapters of every LoRA layer into its base weight; returns the layer names.

    All-or-nothing: refuses when any layer is already merged, and undoes partial merges on error.
    """
    return adapters.merge_all(model, LoraLinear)


def unmerge_adapters(model: nn.Module) -> list[str]:
    """Undo :func:`merge_adapters` on every merged layer; returns the layer names."""
    return adapters.unmerge_all(model, LoraLinear)


# ------------------------------------------------------------------------------------------------
# AdapterState
# ------------------------------------------------------------------------------------------------

_FACTOR_KEYS = ("lora_A", "lora_B")


@dataclass(eq=False)  # tensors have no truth value: compare with allclose()
class AdapterState:
    """One named LoRA adapter of a model, as plain data.

    Attributes:
        config: JSON-serialisable dict describing the adapter. Written by :func:`get_state` with keys
            ``method``, ``rank`` (the default rank), ``alpha``, ``use_rslora``, ``dropout``, ``init``,
            ``targets`` (module names); other producers may add keys.
        factors: ``{module: {"lora_A": A (r_m, in_m), "lora_B": B (out_m, r_m)}}``; ranks may differ
            per module; both factors of a module share one floating dtype.
        scaling: ``{module: s_m}``; the update of module ``m`` is ``s_m * B_m @ A_m``.
        fingerprint: the base model's :func:`rankwise.core.io.model_fingerprint`, or None if unknown.

    Bad contents raise ``ValueError`` at construction (:class:`ArtifactError` when read from a file).
    """

    config: dict[str, Any]
    factors: dict[str, dict[str, torch.Tensor]]
    scaling: dict[str, float]
    fingerprint: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    # -- queries ------------------------------------------------------------------------------
    def modules(self) -> list[str]:
        """Module names, in insertion (model) order."""
        return list(self.factors)

    def rank(self, module: str) -> int:
        return int(self._get(module)["lora_A"].shape[0])

    def ranks(self) -> dict[str, int]:
        return {m: self.rank(m) for m in self.factors}

    def shape(self, module: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of ``module``."""
        f = self._get(module)
        return int(f["lora_B"].shape[0]), int(f["lora_A"].shape[1])

    def num_parameters(self) -> int:
        return sum(t.numel() for f in self.factors.values() for t in f.values())

    def delta_weight(self, module: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s_m * B_m @ A_m``, shape ``(out, in)``, in ``dtype`` (default: float32, or float64 for float64 factors)."""
        f = self._get(module)
        dt = dtype or _compute_dtype(f["lora_A"].dtype)
        return (f["lora_B"].to(dt) @ f["lora_A"].to(dt)) * self.scaling[module]

    def _get(self, module: str) -> dict[str, torch.Tensor]:
        if module not in self.factors:
            raise KeyError(f"adapter state has no module {module!r}; it has {self.modules()[:10]}")
        return self.factors[module]

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Check names, shapes, dtypes, finiteness and metadata types; raise ValueError on the first problem."""
        if not isinstance(self.config, dict):
            raise ValueError(f"AdapterState.config must be a dict, got {type(self.config).__name__}")
        try:
            json.dumps(self.config, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"AdapterState.config must be JSON-serialisable: {e}") from e
        if not isinstance(self.factors, dict) or not self.factors:
            raise ValueError("AdapterState.factors must be a non-empty dict {module: {'lora_A': A, 'lora_B': B}}")
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise ValueError(f"AdapterState.fingerprint must be a str or None, got {self.fingerprint!r}")
        if not isinstance(self.scaling, dict) or set(self.scaling) != set(self.factors):
            got = set(self.scaling) if isinstance(self.scaling, dict) else self.scaling
            raise ValueError(f"AdapterState.scaling must have one entry per module: modules "
                             f"{sorted(self.factors)[:5]}, scaling keys {sorted(got)[:5] if isinstance(got, set) else got}")
        for m, f in self.factors.items():
            if not isinstance(m, str) or not m or m.startswith(".") or m.endswith("."):
                raise ValueError(f"AdapterState: invalid module name {m!r}")
            if not isinstance(f, dict) or set(f) != set(_FACTOR_KEYS):
                raise ValueError(f"AdapterState: module {m!r} must hold exactly {list(_FACTOR_KEYS)}, "
                                 f"got {sorted(f) if isinstance(f, dict) else type(f).__name__}")
            a, b = f["lora_A"], f["lora_B"]
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                raise ValueError(f"AdapterState: factors of {m!r} must be tensors")
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
                raise ValueError(f"AdapterState: module {m!r} has lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)}; expected A (r, in) and B (out, r) with r >= 1")
            if not a.is_floating_point() or a.dtype != b.dtype:
                raise ValueError(f"AdapterState: module {m!r} factors must share one floating dtype, "
                                 f"got {a.dtype} and {b.dtype}")
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                raise ValueError(f"AdapterState: module {m!r} holds NaN or inf")
            s = self.scaling[m]
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(float(s)):
                raise ValueError(f"AdapterState: scaling of {m!r} must be a finite number, got {s!r}")

    # -- conversion ---------------------------------------------------------------------------
    def clone(self) -> "AdapterState":
        return AdapterState(copy.deepcopy(self.config),
                            {m: {k: t.detach().clone() for k, t in f.items()} for m, f in self.factors.items()},
                            dict(self.scaling), self.fingerprint)

    def to(self, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> "AdapterState":
        """A copy with factors cast/moved."""
        return AdapterState(copy.deepcopy(self.config),
                            {m: {k: t.detach().to(device=device, dtype=dtype, copy=True) for k, t in f.items()}
                             for m, f in self.factors.items()},
                            dict(self.scaling), self.fingerprint)

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Flat tensors ``{"<module>.lora_A": A, "<module>.lora_B": B}`` and JSON metadata."""
        tensors = {f"{m}.{k}": t for m, f in self.factors.items() for k, t in f.items()}
        meta = {"kind": _STATE_KIND, "config": self.config, "modules": self.modules(),
                "scaling": {m: float(s) for m, s in self.scaling.items()}, "fingerprint": self.fingerprint}
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any],
                     source: str = "adapter state") -> "AdapterState":
        """Inverse of :meth:`to_tensors`; inconsistencies raise ArtifactError naming ``source``."""
        if metadata.get("kind") != _STATE_KIND:
            raise ArtifactError(f"{source}: not a rankwise adapter state (kind={metadata.get('kind')!r})")
        modules = metadata.get("modules")
        scaling = metadata.get("scaling")
        if not isinstance(modules, list) or not isinstance(scaling, dict):
            raise ArtifactError(f"{source}: metadata lacks 'modules'/'scaling'")
        expected = {f"{m}.{k}" for m in modules for k in _FACTOR_KEYS}
        if set(tensors) != expected:
            missing = sorted(expected - set(tensors))[:5]
            extra = sorted(set(tensors) - expected)[:5]
            raise ArtifactError(f"{source}: tensors do not match the module list (missing {missing}, "
                                f"unexpected {extra})")
        factors = {m: {k: tensors[f"{m}.{k}"] for k in _FACTOR_KEYS} for m in modules}
        try:
            return cls(dict(metadata.get("config") or {}), factors, dict(scaling), metadata.get("fingerprint"))
        except ValueError as e:
            raise ArtifactError(f"{source}: {e}") from e

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (atomically); see :mod:`rankwise.core.io` for the header format."""
        tensors, meta = self.to_tensors()
        return io.save_tensors(path, tensors, meta)

    @classmethod
    def load(cls, path: str | Path, *, model: nn.Module | None = None) -> "AdapterState":
        """Read a file written by :meth:`save` (checksums verified; with ``model``: fingerprint and shapes checked)."""
        tensors, meta = io.load_tensors(path)
        state = cls.from_tensors(tensors, meta, source=str(path))
        if model is not None:
            io.check_fingerprint(state.fingerprint, model, source=str(path))
            check_state_fits(model, state, str(path))
        return state

    def allclose(self, other: "AdapterState", rtol: float = 0.0, atol: float = 0.0) -> bool:
        """Same modules, equal scalings, and factors equal within tolerance (exact by default)."""
        if self.modules() != other.modules() or self.scaling != other.scaling:
            return False
        return all(f[k].shape == other.factors[m][k].shape and f[k].dtype == other.factors[m][k].dtype
                   and torch.allclose(f[k], other.factors[m][k], rtol=rtol, atol=atol)
                   for m, f in self.factors.items() for k in _FACTOR_KEYS)


def check_state_fits(model: nn.Module, state: AdapterState, source: str) -> dict[str, nn.Module]:
    """Resolve the state's modules in ``model``; each must be a Linear/LoraLinear of matching shape."""
    found: dict[str, nn.Module] = {}
    problems: list[str] = []
    for m in state.modules():
        try:
            mod = model.get_submodule(m)
        except AttributeError:
            problems.append(f"module {m!r} does not exist in the model")
            continue
        base = mod.base_layer if isinstance(mod, LoraLinear) else mod
        if not isinstance(base, nn.Linear):
            problems.append(f"module {m!r} is a {type(mod).__name__}, not nn.Linear")
            continue
        out_f, in_f = state.shape(m)
        if (base.out_features, base.in_features) != (out_f, in_f):
            problems.append(f"module {m!r}: adapter is for (out={out_f}, in={in_f}), the layer is "
                            f"(out={base.out_features}, in={base.in_features})")
            continue
        found[m] = mod
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} problems)" if len(problems) > 5 else "")
        raise ArtifactError(f"{source} does not fit this model: {shown}")
    return found


def get_state(model: nn.Module, name: str = "default") -> AdapterState:
    """The adapter ``name`` of ``model`` as an :class:`AdapterState` (factors copied, fingerprint computed)."""
    layers = _require_adapter(model, name)
    first = layers[0][1].adapter_config.get(name, {})
    ranks = Counter(layer.rank(name) for _, layer in layers)
    config = {"method": first.get("method", "lora"), "rank": ranks.most_common(1)[0][0],
              "alpha": first.get("alpha"), "use_rslora": bool(first.get("use_rslora", False)),
              "dropout": float(first.get("dropout", 0.0)), "init": first.get("init"),
              "targets": [n for n, _ in layers]}
    factors = {n: {"lora_A": layer.lora_A[name].weight.detach().clone(),
                   "lora_B": layer.lora_B[name].weight.detach().clone()} for n, layer in layers}
    scaling = {n: layer.scaling[name] for n, layer in layers}
    return AdapterState(config, factors, scaling, io.model_fingerprint(model))


def set_state(model: nn.Module, state: AdapterState, name: str = "default", *, check_base: bool = True,
              activate: bool = True, freeze_base: bool = True, source: str = "adapter state") -> list[str]:
    """Install ``state`` into ``model`` as adapter ``name`` (replacing an adapter of that name).

    Checks first (fingerprint unless ``check_base=False``; module existence, type and shapes), then
    changes the model all-or-nothing. Factors keep the state's dtype (bit-exact round trips). Returns
    the module names. ``activate``/``freeze_base`` as in :func:`add_lora`.
    """
    if not isinstance(state, AdapterState):
        raise TypeError(f"set_state: expected an AdapterState, got {type(state).__name__}")
    validate_adapter_name(name)
    state.validate()
    if check_base:
        io.check_fingerprint(state.fingerprint, model, source=source)
    found = check_state_fits(model, state, source)
    existing = [(n, layer) for n, layer in lora_layers(model) if name in layer.lora_A]
    merged = [n for n, layer in lora_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}; unmerge before loading an adapter")
    dropout = float(state.config.get("dropout", 0.0) or 0.0)
    if not 0.0 <= dropout < 1.0:
        raise ArtifactError(f"{source}: dropout {dropout!r} is outside [0, 1)")
    with _all_or_nothing(model):
        for lname, layer in existing:
            if lname not in found:
                layer.delete_adapter(name)
        for m, mod in found.items():
            layer = mod if isinstance(mod, LoraLinear) else LoraLinear(mod, layer_name=m)
            if layer is not mod:
                replace_module(model, m, layer)
            f = state.factors[m]
            cfg = {k: state.config[k] for k in ("method", "alpha", "use_rslora", "init") if k in state.config}
            layer.set_factors(name, f["lora_A"], f["lora_B"], state.scaling[m], dropout=dropout, config=cfg)
            if activate:
                layer.set_active(name)
        if activate:
            for _, layer in lora_layers(model):
                if name not in layer.lora_A:
                    layer.set_active([])
        # drop wrappers left without any adapter
        for lname, layer in existing:
            if lname not in found and not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        _sync_trainable(model, freeze_base)
    return list(found)

