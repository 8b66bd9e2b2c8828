"""E²LoRA on a whole model: calibration, planning, installing a plan, and the adapter API
(:data:`E2LORA`, an :class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.adapt.e2lora.config import DEFAULT_DEPTH_REGEX, E2LoRAConfig, LossFn, SIGMA_SIGN_CHANGE, _pos_int
from rankwise.adapt.e2lora.functional import adaptive_thresholds, allocate_ranks, partition, similarity_matrix
from rankwise.adapt.e2lora.layer import E2LoRALinear, _Factor
from rankwise.adapt.e2lora.plan import E2LoRAPlan, TypePlan
from rankwise.core.adapters import AdapterMethod
from rankwise.core.calibration import default_loss, given_gradients, gradient_pass, mean_gradients  # noqa: F401 (default_loss re-exported)
from rankwise.core.errors import NumericalError
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module


# ------------------------------------------------------------------------------------------------
# model-level helpers
# ------------------------------------------------------------------------------------------------

class _E2LoRAMethod(AdapterMethod):
    """E²LoRA's artefact stores each distinct (possibly shared) factor once, as ``factor.<i>``; a layer's
    record names its ``A``/``B`` factor ids; the plan goes into the metadata."""

    def calibration_batches(self, config: E2LoRAConfig) -> int:
        return config.calib_batches

    def export(self, model: nn.Module, name: str, layers: Sequence[tuple[str, Any]]
               ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        ids: dict[int, str] = {}
        tensors: dict[str, torch.Tensor] = {}
        modules: dict[str, dict[str, Any]] = {}
        for lname, layer in layers:
            record = dict(layer.adapter_config[name])
            for key, f in (("A", layer.e2lora_A[name]), ("B", layer.e2lora_B[name])):
                if id(f) not in ids:
                    ids[id(f)] = str(len(ids))
                    tensors[f"factor.{ids[id(f)]}"] = f.weight.detach()
                record[key] = ids[id(f)]
            modules[lname] = record
        return tensors, modules

    def extra_metadata(self, model: nn.Module, name: str, layers: Sequence[tuple[str, Any]]) -> dict[str, Any]:
        plan = next((layer.plans[name] for _, layer in layers if name in layer.plans), None)
        return {"plan": plan.to_dict() if plan is not None else None}

    def read_context(self, meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
        return {"plan": E2LoRAPlan.from_dict(meta["plan"]) if isinstance(meta.get("plan"), dict) else None}


#: E²LoRA's model-level adapter API (set_active, merge, save_adapter, load_adapter, ...).
E2LORA = _E2LoRAMethod(E2LoRALinear, "rankwise.e2lora", default_lr=1e-3)

e2lora_layers = E2LORA.layers
adapter_names = E2LORA.adapter_names
set_active = E2LORA.set_active
enable_adapters = E2LORA.enable
disable_adapters = E2LORA.disable
merge = E2LORA.merge
unmerge = E2LORA.unmerge
delete_adapter = E2LORA.delete_adapter
unload = E2LORA.unload
save_adapter = E2LORA.save_adapter
load_adapter = E2LORA.load_adapter
_require_adapter = E2LORA.require_adapter


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, E2LoRALinear) else mod  # type: ignore[return-value]


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    conv_or_embedding = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
    return E2LORA.target_layers(model, target,
                                  rejects=lambda m: isinstance(m, conv_or_embedding) or type(m).__name__ == "Conv1D")


def group_layers(names: Sequence[str], depth_regex: str | None = DEFAULT_DEPTH_REGEX
                 ) -> dict[str, list[tuple[int, str]]]:
    """Group module names into types: ``{type key: [(depth, name), ...] sorted by depth}``.

    The layer index is group 1 of the first match of ``depth_regex``; the type key is the name with that
    index replaced by ``*``. A name without a match (or ``depth_regex=None``) is a type of its own.
    """
    rx = re.compile(depth_regex) if depth_regex is not None else None
    groups: dict[str, list[tuple[int, str]]] = {}
    for n in names:
        m = rx.search(n) if rx is not None else None
        if m is None:
            groups.setdefault(n, []).append((0, n))
        else:
            key = n[:m.start(1)] + "*" + n[m.end(1):]
            groups.setdefault(key, []).append((int(m.group(1)), n))
    return {k: sorted(v) for k, v in groups.items()}


def _types_of(hits: Sequence[tuple[str, nn.Module]], config: E2LoRAConfig
              ) -> dict[str, tuple[list[str], tuple[int, int]]]:
    """``{type key: (layer names by depth, (d_out, d_in))}``; different shapes inside one type raise ValueError."""
    mods = dict(hits)
    out = {}
    for key, members in group_layers([n for n, _ in hits], config.depth_regex).items():
        names = [n for _, n in members]
        shapes = {n: (_base_of(mods[n]).out_features, _base_of(mods[n]).in_features) for n in names}
        if len(set(shapes.values())) != 1:
            shown = ", ".join(f"{n} {s[0]}x{s[1]}" for n, s in list(shapes.items())[:6])
            raise ValueError(f"E²LoRA cannot share factors across layers of different shapes: type {key!r} holds "
                             f"{shown}. Narrow the target, or set depth_regex=None (no sharing across modules)")
        d_out, d_in = next(iter(shapes.values()))
        if config.rank > min(d_in, d_out):
            raise ValueError(f"E²LoRA rank={config.rank} exceeds min(in_features={d_in}, "
                             f"out_features={d_out}) = {min(d_in, d_out)} of type {key!r}; choose rank in "
                             f"[1, {min(d_in, d_out)}]")
        out[key] = (names, (d_out, d_in))
    if config.granularity == "block":
        groups = group_layers([n for n, _ in hits], config.depth_regex)
        depth_sets = {k: tuple(d for d, _ in v) for k, v in groups.items()}
        if len(set(depth_sets.values())) != 1:
            raise ValueError(f"granularity='block' needs every module type at the same depths, got {depth_sets}")
    return out


# ------------------------------------------------------------------------------------------------
# calibration and planning
# ------------------------------------------------------------------------------------------------

def collect_gradients(model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Iterable[Any] | None,
                      loss_fn: LossFn | None = None, n_batches: int = 1) -> dict[str, torch.Tensor]:
    """Gradients ``G_l = dL/dW_l`` of the base weights of ``layers``, averaged over the first ``n_batches`` batches.

    Returns ``{name: G (d_out, d_in) float64}`` (step 1). Runs in eval mode (deterministic), with every
    E²LoRA adapter switched off (the plan belongs to the pretrained model) and only the targeted weights
    requiring gradients; modes, flags and ``.grad`` fields are restored afterwards. An empty loader
    (ValueError), a non-finite loss or gradient (NumericalError) and an all-zero gradient (ValueError,
    e.g. a frozen head or a detached graph) are reported naming the layer. The pass is
    :func:`rankwise.core.calibration.gradient_pass`.
    """
    if batches is None:
        raise ValueError("E²LoRA needs calibration batches (calib=...) to compute the gradient proxy entropies, "
                         "or a precomputed plan=")
    if not _pos_int(n_batches):
        raise ValueError(f"n_batches must be an int >= 1, got {n_batches!r}")
    weights = {n: _base_of(m).weight for n, m in layers}
    sums, count = gradient_pass(model, weights, batches, loss_fn, max_batches=n_batches,
                                disable=[layer for _, layer in e2lora_layers(model)],
                                needs="the entropies are undefined", who="E²LoRA")
    return mean_gradients(sums, count, who="E²LoRA", zero_hint="(sigma = 0, H = -inf): the loss does not depend on "
                          "this layer (frozen or missing task head, detached graph?)")


def _type_plan(key: str, names: list[str], shape: tuple[int, int], grads: Sequence[torch.Tensor],
               config: E2LoRAConfig) -> TypePlan:
    """Steps 2-6 for one module type (or, for ``granularity="block"``, for the concatenated blocks)."""
    where = f"type {key!r}: "
    H, S = similarity_matrix(grads, config.similarity)
    N = len(names)
    if N >= 2 and not all(h < 0 for h in H):
        bad = [names[i] for i, h in enumerate(H) if h >= 0]
        raise NumericalError(
            f"{where}proxy entropies {[round(h, 3) for h in H]} are not all negative (element std >= "
            f"{SIGMA_SIGN_CHANGE:.3f} in {bad[:3]}): RMI is then no similarity and the HRA factors change sign. "
            "Scale the calibration loss down (e.g. by 1e-3); every entropy shifts by the same log factor")
    if not bool(torch.isfinite(S).all()):
        raise NumericalError(f"{where}the similarity matrix holds non-finite values")
    if config.threshold == "adaptive":
        tau = adaptive_thresholds(S)
    else:
        tau = [float(config.threshold)] * N if N > 1 else [None]
    intervals = partition(S, tau) if config.lss else [[i] for i in range(N)]
    if config.hra:
        ranks, Hk, F = allocate_ranks(H, intervals, config.rank, score=config.hra_score,
                                      rounding=config.rounding, max_rank=min(shape), where=where)
    else:
        ranks, Hk, F = [config.rank] * len(intervals), None, None
    return TypePlan(key=key, layers=list(names), shape=shape, intervals=intervals, ranks=ranks, entropies=list(H),
                    similarity=S.tolist(), thresholds=tau, interval_entropies=Hk, factors=F)


def _settings(config: E2LoRAConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("rank", "alpha", "threshold", "hra_score", "rounding", "granularity",
                                            "calib_batches", "lss", "hra", "similarity", "sharing")}


def plan_e2lora(model: nn.Module, calib: Iterable[Any] | None, loss_fn: LossFn | None = None,
                config: E2LoRAConfig | None = None, target: Selector = None, *,
                gradients: Mapping[str, torch.Tensor] | None = None) -> E2LoRAPlan:
    """The one-shot plan (steps 1-6): entropies, similarity matrix, thresholds, intervals and ranks per type.

    ``calib`` (an iterable of batches) and ``loss_fn(model, batch) -> scalar`` give the calibration
    gradients (or pass ``gradients={layer name: G (d_out, d_in)}``). The model is not modified.
    """
    config = E2LoRAConfig() if config is None else config
    if not isinstance(config, E2LoRAConfig):
        raise TypeError(f"config must be an E2LoRAConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    hits = _target_layers(model, config.target if target is None else target)
    types = _types_of(hits, config)
    if gradients is not None:
        grads = given_gradients(gradients, {n: (_base_of(m).out_features, _base_of(m).in_features) for n, m in hits},
                                check=True, zero_hint="(sigma = 0, H = -inf)")
    else:
        grads = collect_gradients(model, hits, calib, loss_fn, config.calib_batches)
    out: dict[str, TypePlan] = {}
    if config.granularity == "type":
        for key, (names, shape) in types.items():
            out[key] = _type_plan(key, names, shape, [grads[n] for n in names], config)
    else:
        N = len(next(iter(types.values()))[0])
        blocks = [torch.cat([grads[names[d]].reshape(-1) for names, _ in types.values()]) for d in range(N)]
        smallest = min((shape for _, shape in types.values()), key=min)
        shared = _type_plan("block", [f"block{d}" for d in range(N)], smallest, blocks, config)
        for key, (names, shape) in types.items():
            ranks = [min(r, min(shape)) for r in shared.ranks]
            out[key] = TypePlan(key=key, layers=list(names), shape=shape, intervals=shared.intervals, ranks=ranks,
                                entropies=shared.entropies, similarity=shared.similarity,
                                thresholds=shared.thresholds, interval_entropies=shared.interval_entropies,
                                factors=shared.factors)
    return E2LoRAPlan(types=out, sharing=config.sharing, settings=_settings(config))


def uniform_plan(model: nn.Module, config: E2LoRAConfig | None = None, target: Selector = None, *,
                 intervals: str | int = "each", rank: int | None = None) -> E2LoRAPlan:
    """A plan without calibration: ``intervals="each"`` (one per layer), ``"all"`` (one per type) or an int
    block size (fixed-size blocks), every interval at ``rank`` (default ``config.rank``).

    With ``sharing="lora"`` and ``"each"`` this is plain LoRA; ``"all"`` is naive all-layer sharing; with
    ``sharing="sharelora"`` and ``"each"`` it is ShareLoRA (one ``A`` per type, per-layer ``B``).
    """
    config = E2LoRAConfig() if config is None else config
    rank = config.rank if rank is None else rank
    if not _pos_int(rank):
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    if not (intervals in ("each", "all") or _pos_int(intervals)):
        raise ValueError(f"intervals must be 'each', 'all' or a block size >= 1, got {intervals!r}")
    hits = _target_layers(model, config.target if target is None else target)
    out = {}
    for key, (names, shape) in _types_of(hits, config).items():
        if rank > min(shape):
            raise ValueError(f"rank {rank} exceeds min(d_in, d_out) = {min(shape)} of type {key!r}")
        N = len(names)
        size = 1 if intervals == "each" else N if intervals == "all" else int(intervals)
        ivs = [list(range(s, min(N, s + size))) for s in range(0, N, size)]
        out[key] = TypePlan(key=key, layers=list(names), shape=shape, intervals=ivs, ranks=[rank] * len(ivs))
    return E2LoRAPlan(types=out, sharing=config.sharing, settings=dict(_settings(config), uniform=str(intervals)))


# ------------------------------------------------------------------------------------------------
# installing a plan
# ------------------------------------------------------------------------------------------------

def _kaiming(rows: int, cols: int, gen: torch.Generator | None, dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
    A = torch.empty(rows, cols, dtype=torch.float32)
    nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=gen)
    return A.to(dtype=dtype, device=device)


def _build_factors(plan: E2LoRAPlan, mods: Mapping[str, nn.Module], gen: torch.Generator | None
                   ) -> list[tuple[str, _Factor, _Factor, int, dict[str, Any]]]:
    """``(layer name, A factor, B factor, rank, per-layer config)`` for every layer of the plan (shared objects)."""
    out = []
    for key, t in plan.types.items():
        w = _base_of(mods[t.layers[0]]).weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        d_out, d_in = t.shape
        if plan.sharing == "lora":
            for k, iv in enumerate(t.intervals):
                A = _Factor(_kaiming(t.ranks[k], d_in, gen, dtype, w.device))
                B = _Factor(torch.zeros(d_out, t.ranks[k], dtype=dtype, device=w.device))
                for pos in iv:
                    out.append((t.layers[pos], A, B, t.ranks[k], {"type": key, "position": pos, "interval": k}))
        else:
            A = _Factor(_kaiming(max(t.ranks), d_in, gen, dtype, w.device))
            for pos, lname in enumerate(t.layers):
                k = t.interval_of(pos)
                B = _Factor(torch.zeros(d_out, t.ranks[k], dtype=dtype, device=w.device))
                out.append((lname, A, B, t.ranks[k], {"type": key, "position": pos, "interval": k}))
    return out


def _check_plan_fits(model: nn.Module, plan: E2LoRAPlan, name: str) -> dict[str, nn.Module]:
    plan.validate()
    mods: dict[str, nn.Module] = {}
    for t in plan.types.values():
        for lname in t.layers:
            try:
                mod = model.get_submodule(lname)
            except AttributeError:
                raise ValueError(f"the plan's layer {lname!r} does not exist in the model") from None
            base = _base_of(mod)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"the plan's layer {lname!r} is a {type(mod).__name__}, not a Linear layer")
            if (base.out_features, base.in_features) != tuple(t.shape):
                raise ValueError(f"the plan's layer {lname!r} is {base.out_features}x{base.in_features}, the plan "
                                 f"says {t.shape[0]}x{t.shape[1]}")
            if max(t.ranks) > min(t.shape):
                raise ValueError(f"the plan's rank {max(t.ranks)} exceeds min(d_in, d_out) = {min(t.shape)} of "
                                 f"type {t.key!r}")
            if isinstance(mod, E2LoRALinear) and name in mod.adapters:
                raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name or "
                                 "delete it first")
            mods[lname] = mod
    return mods


def apply_e2lora(model: nn.Module, plan: E2LoRAPlan, config: E2LoRAConfig | None = None,
                 name: str = "default") -> nn.Module:
    """Install ``plan`` as adapter ``name`` (step 7): shared pairs per interval, ``A`` Kaiming-uniform, ``B = 0``.

    The new adapter becomes the active (and only trainable) one; every other parameter is frozen
    (unfreeze a task head yourself). On any error the model is unchanged.
    """
    if not isinstance(plan, E2LoRAPlan):
        raise TypeError(f"plan must be an E2LoRAPlan, got {type(plan).__name__}")
    config = E2LORA.start_adapt(model, config, E2LoRAConfig, name)
    mods = _check_plan_fits(model, plan, name)
    gen = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    built = _build_factors(plan, mods, gen)
    _install(model, plan, built, mods, name, config.alpha, config.dropout)
    return model


def _install(model: nn.Module, plan: E2LoRAPlan, built: Sequence[tuple[str, _Factor, _Factor, int, dict[str, Any]]],
             mods: Mapping[str, nn.Module], name: str, alpha: float, dropout: float) -> None:
    with E2LORA.all_or_nothing(model):
        for lname, A, B, r, cfg in built:
            mod = mods[lname]
            layer = mod if isinstance(mod, E2LoRALinear) else E2LoRALinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.add_adapter(name, A, B, r, alpha / r, dropout=dropout,
                              config=dict(cfg, method="e2lora", alpha=alpha), plan=plan)
            layer.set_active(name)
        for _, layer in e2lora_layers(model):
            if name not in layer.adapters:
                layer.active_adapters = []
        E2LORA.sync_trainable(model, freeze_base=True)


def adapt(model: nn.Module, config: E2LoRAConfig | None = None, target: Selector = None, name: str = "default", *,
          calib: Iterable[Any] | None = None, loss_fn: LossFn | None = None, plan: E2LoRAPlan | None = None,
          gradients: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Add E²LoRA adapter ``name`` to the Linear layers ``target`` selects (default ``config.target``); in place.

    The plan comes from ``plan`` if given, else from calibration: ``calib`` (batches) with ``loss_fn(model,
    batch) -> scalar loss`` (default: the output's ``.loss``), or precomputed ``gradients``. Include a freshly
    initialised task head in the loss, as for normal fine-tuning. Everything is computed and checked before the
    model changes; on any error the model is unchanged. Returns the model.
    """
    config = E2LORA.start_adapt(model, config, E2LoRAConfig, name)
    if plan is None:
        hits = _target_layers(model, config.target if target is None else target)
        _types_of(hits, config)  # shapes and ranks checked before any gradient is computed
        for lname, mod in hits:
            if isinstance(mod, E2LoRALinear) and name in mod.adapters:
                raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                                 "or delete it first")
        plan = plan_e2lora(model, calib, loss_fn, config, target, gradients=gradients)
    return apply_e2lora(model, plan, config, name)


def get_plan(model: nn.Module, name: str = "default") -> E2LoRAPlan:
    """The plan adapter ``name`` was built from."""
    for _, layer in _require_adapter(model, name):
        if name in layer.plans:
            return layer.plans[name]
    raise KeyError(f"adapter {name!r} carries no plan")


def trainable_parameters(model: nn.Module, name: str = "default") -> int:
    """Distinct adapter parameters of adapter ``name`` (shared factors counted once)."""
    seen: dict[int, int] = {}
    for _, layer in _require_adapter(model, name):
        for p, _ in layer.adapter_parameters(name):
            seen[id(p)] = p.numel()
    return sum(seen.values())


register("e2lora", config=E2LoRAConfig, entry=adapt, adapter=E2LORA)
