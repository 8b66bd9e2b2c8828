"""Adapter management shared by every adapted-Linear layer family (LoRA, CDKA, PSOFT, E²LoRA, DAF, ...).

Each adapter method wraps the layers it adapts in a layer class of its own that holds any number of
*named* adapters. What is the same across families lives here:

* :class:`AdapterLayer`, the base class of those layer classes: the wrapped ``base_layer``, the adapter
  bookkeeping (``adapter_config``, ``active_adapters``, ``disabled``, ``merged_adapters``), selecting,
  enabling, deleting, merging into / unmerging from the base weight, and the snapshot / restore that
  makes model-level operations all-or-nothing. A family declares where its adapters live with class
  attributes (:attr:`AdapterLayer.adapter_store`, :attr:`AdapterLayer.adapter_fields`, labels), lists
  each adapter's parameters (``adapter_parameters(name)``) and supplies ``delta_weight(name, dtype)``
  (the dense update ``ΔW (out, in)``) if it can be merged.
* model-level functions parametrised by the layer class: :func:`adapted_layers`,
  :func:`adapter_names`, :func:`all_or_nothing`, :func:`require_adapter`, :func:`target_layers`,
  :func:`sync_trainable`, :func:`set_active`, :func:`enable_adapters`, :func:`disable_adapters`,
  :func:`merge_all`, :func:`unmerge_all`, :func:`delete_adapter` and :func:`unload`; and
  :func:`validate_adapter_name`.
* :class:`AdapterMethod`, one instance per family (``CDKA = AdapterMethod(CDKALinear, "rankwise.cdka")``):
  the whole model-level API built on the above (``set_active``, ``enable``, ``disable``, ``merge``,
  ``unmerge``, ``delete_adapter``, ``unload(merge=...)``, ``save_adapter``, ``load_adapter``) from two
  per-layer hooks, :meth:`AdapterLayer.export_adapter` (tensors + JSON record out) and
  :meth:`AdapterLayer.import_adapter` (install from them), plus what a training run needs from the
  family. Each adapter package binds its public names to its instance's methods.
* :func:`deprecated_fields` / :func:`deprecated_kwargs` (renamed names, one release); :func:`default_loss`.

Merging is all-or-nothing across layers (:func:`merge_all`); within a layer the updates are summed in
float32 or wider and rounded once (:meth:`AdapterLayer._merge`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import warnings
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence, TypeVar

import torch
from torch import nn

from rankwise.core import io
from rankwise.core.calibration import default_loss  # noqa: F401 (its former home; re-exported)
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError, SelectionError
from rankwise.core.select import Selector, available_names, select
from rankwise.core.surgery import replace_module, transaction

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AdapterLayer",
    "AdapterMethod",
    "ArtifactContext",
    "deprecated_fields",
    "deprecated_kwargs",
    "adapted_layers",
    "adapter_names",
    "all_or_nothing",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "merge_all",
    "require_adapter",
    "set_active",
    "sync_trainable",
    "target_layers",
    "unload",
    "unmerge_all",
    "validate_adapter_name",
]

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def validate_adapter_name(name: str) -> str:
    """Adapter names are identifiers (letters, digits, ``_``, ``-``; no dots: they become module keys)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"adapter name must match {_NAME_RE.pattern} (no dots or spaces), got {name!r}")
    if hasattr(nn.ModuleDict(), name):
        raise ValueError(f"adapter name {name!r} clashes with an nn.ModuleDict attribute; choose another")
    return name


class AdapterLayer(nn.Module):
    """Base class of a layer that wraps ``base_layer`` and holds named adapters.

    Subclasses set the class attributes below, call ``super().__init__(base_layer, layer_name)``
    first (after validating ``base_layer``), create their per-adapter containers, and implement
    ``forward``, ``adapter_parameters(name)`` (for :func:`sync_trainable`) and, when :attr:`mergeable`,
    ``delta_weight(name, dtype) -> (out, in)``. :meth:`merge_target` (the weight in ``(out, in)``
    layout) and :meth:`mergeable_adapters` may be overridden (PSOFT's transposed Conv1D weight, DAF's
    candidates without a unit).

    Attributes (per instance): ``base_layer``; ``adapter_config`` ``{name: dict}``;
    ``active_adapters`` (ordered, no repeats); ``disabled`` (all adapters off, the base layer alone);
    ``merged_adapters`` (names whose updates are currently added into the base weight);
    ``layer_name`` (qualified name, for messages); ``fingerprint_values`` (value samples of the base
    parameters taken when wrapping, read by :func:`rankwise.core.io.model_fingerprint`).
    """

    is_rankwise_wrapper = True
    #: attribute (a dict, ModuleDict or ParameterDict keyed by adapter name) whose keys are the adapters
    adapter_store: ClassVar[str] = ""
    #: every per-adapter container keyed by adapter name (ModuleDict, ParameterDict or dict): cleared on delete,
    #: saved by :meth:`_snapshot` (``adapter_config`` is deep-copied, other dicts copied shallowly)
    adapter_fields: ClassVar[tuple[str, ...]] = ()
    #: how messages name one adapter of this family ("CDKA adapter") and the family ("CDKA")
    adapter_label: ClassVar[str] = "adapter"
    family: ClassVar[str] = "adapter"
    #: whether the adapters' updates can be folded into the base weight (``delta_weight`` exists)
    mergeable: ClassVar[bool] = True

    def __init__(self, base_layer: nn.Module, layer_name: str = "") -> None:
        super().__init__()
        self.base_layer = base_layer
        self.adapter_config: dict[str, dict[str, Any]] = {}
        self.active_adapters: list[str] = []
        self.disabled = False
        self.merged_adapters: list[str] = []
        self.layer_name = layer_name
        self.fingerprint_values = {n: io.value_sample(p) for n, p in base_layer.named_parameters()
                                   if not p.is_meta}

    # -- queries ------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"layer {self.layer_name!r}" if self.layer_name else type(self).__name__

    @property
    def weight(self) -> torch.Tensor:
        """The base weight (so code reading ``layer.weight`` keeps working)."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def adapters(self) -> list[str]:
        """Adapter names, in insertion order."""
        return list(getattr(self, self.adapter_store))

    @property
    def merged(self) -> bool:
        return bool(self.merged_adapters)

    def _require(self, name: str) -> None:
        if name not in getattr(self, self.adapter_store):
            raise KeyError(f"{self._where()} has no {self.adapter_label} {name!r} (it has {self.adapters})")

    # -- adapter bookkeeping --------------------------------------------------------------------
    def _drop_adapter(self, name: str) -> None:
        """Remove ``name`` from every per-adapter container and from the active list (no checks)."""
        for field in self.adapter_fields:
            store = getattr(self, field)
            if name in store:
                del store[name]
        if name in self.active_adapters:
            self.active_adapters = [n for n in self.active_adapters if n != name]

    def delete_adapter(self, name: str) -> None:
        """Remove adapter ``name`` from this layer; refused while it is merged."""
        self._require(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before deleting it")
        self._drop_adapter(name)

    def set_active(self, names: str | Sequence[str]) -> None:
        """Make exactly ``names`` the active adapters (their updates are summed; repeats dropped)."""
        names = [names] if isinstance(names, str) else list(names)
        for n in names:
            self._require(n)
        if self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapters {self.merged_adapters} are merged; unmerge before "
                                "changing the active adapters")
        self.active_adapters = list(dict.fromkeys(names))

    def set_enabled(self, enabled: bool) -> None:
        """Switch all adapters on or off (off: the base layer alone). Disabling is refused while merged."""
        if not enabled and self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapters {self.merged_adapters} are merged into the base weight; "
                                "unmerge before disabling them")
        self.disabled = not enabled

    # -- merging ----------------------------------------------------------------------------------
    def merge_target(self) -> torch.Tensor:
        """The base weight in ``(out, in)`` layout that merging writes to (a view of the parameter)."""
        return self.base_layer.weight

    def mergeable_adapters(self) -> list[str]:
        """The adapters :meth:`merge` folds in by default: the active ones."""
        return list(self.active_adapters)

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not define delta_weight")

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        """The parameters of adapter ``name``, each with whether it trains while the adapter is active."""
        raise NotImplementedError(f"{type(self).__name__} does not define adapter_parameters")

    def _merge(self, names: Sequence[str] | None = None) -> list[str]:
        """Add the updates of ``names`` (default :meth:`mergeable_adapters`) into the base weight.

        Refuses to merge twice or while disabled. Returns the merged names (``[]``: nothing to merge).
        The sum is formed in float32 or wider and written back once in the weight's dtype; a non-finite
        result raises :class:`NumericalError` and leaves the weight unchanged.
        """
        if not self.mergeable:
            raise RankwiseError(f"{self._where()}: {self.family} adapters cannot be merged into the base weight")
        if self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapters {self.merged_adapters} are already merged; "
                                "unmerge before merging again")
        if self.disabled:
            raise RankwiseError(f"{self._where()}: adapters are disabled; enable them before merging")
        names = self.mergeable_adapters() if names is None else list(names)
        for n in names:
            self._require(n)
        if not names:
            return []
        w, new = self._shifted_weight(names, +1)
        if not bool(torch.isfinite(new).all()):
            raise NumericalError(f"{self._where()}: merging {names} gives non-finite weights "
                                 f"(an adapter holds NaN or inf, or the sum overflows {w.dtype})")
        with torch.no_grad():
            w.copy_(new)
        self.merged_adapters = names
        return names

    @torch.no_grad()
    def _shifted_weight(self, names: Sequence[str], sign: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W, W + sign * sum_n ΔW_n)``: the merge target and the new weight (summed in float32 or wider,
        rounded once to W's dtype; subtraction runs through ``names`` in reverse order)."""
        w = self.merge_target()
        dt = torch.promote_types(w.dtype, torch.float32)
        total = w.detach().to(dt)
        for n in (names if sign > 0 else reversed(names)):
            total = total + sign * self.delta_weight(n, dt).to(w.device, dt)
        return w, total.to(w.dtype)

    def _unmerge(self) -> list[str]:
        """Subtract the merged updates from the base weight (reverse order); returns their names."""
        names = list(self.merged_adapters)
        if not names:
            return []
        w, new = self._shifted_weight(names, -1)
        with torch.no_grad():
            w.copy_(new)
        self.merged_adapters = []
        return names

    def merge(self) -> bool:
        """Merge the active adapters' updates into the base weight; returns whether anything was merged."""
        return bool(self._merge())

    def unmerge(self) -> None:
        """Undo :meth:`merge` (nothing happens when nothing is merged)."""
        self._unmerge()

    # -- artefact hooks (used by AdapterMethod.save_adapter / load_adapter) ----------------------
    #: what a module must be to receive this family's adapter from an artefact (for messages)
    base_kind: ClassVar[str] = "nn.Linear"

    @classmethod
    def wraps(cls, base: nn.Module) -> bool:
        """Whether ``base`` (a model's module, wrapper removed) can carry this family's adapters."""
        return isinstance(base, nn.Linear)

    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Adapter ``name`` as artefact data: ``(tensors by local key, JSON-able per-layer record)``.

        The artefact stores tensor ``key`` of layer ``m`` as ``"<m>.<key>"`` and the record under
        ``modules[m]`` of its metadata; :meth:`import_adapter` is the inverse.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define export_adapter")

    @classmethod
    def artifact_keys(cls, module: str, record: Mapping[str, Any], context: "ArtifactContext") -> dict[str, str]:
        """``{local key: stored tensor name}`` that the record of ``module`` says the artefact holds.

        Raises ``ValueError`` (reported as "bad metadata for module") when the record is malformed.
        """
        raise NotImplementedError(f"{cls.__name__} does not define artifact_keys")

    @classmethod
    def artifact_fit(cls, model: nn.Module, module: str, base: nn.Module, tensors: Mapping[str, torch.Tensor],
                     record: Mapping[str, Any], context: "ArtifactContext") -> str | None:
        """Why ``tensors``/``record`` cannot be installed on ``base`` (the module's base layer), or None.

        Checked for every module before the model changes; the message follows ``"module 'm': ..."``.
        """
        return None

    def import_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any],
                       context: "ArtifactContext") -> None:
        """Install adapter ``name`` from artefact data (inverse of :meth:`export_adapter`; tensors copied).

        ``context`` carries the model, the module name and a ``shared`` dict for state that several
        layers share (tied routers, shared factors). A misfit raises ``ValueError``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define import_adapter")

    # -- snapshot / restore (all-or-nothing model operations) ----------------------------------
    def _snapshot(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for field in self.adapter_fields:
            store = getattr(self, field)
            if isinstance(store, (nn.ModuleDict, nn.ParameterDict)):
                fields[field] = dict(store.items())
            elif field == "adapter_config":
                fields[field] = copy.deepcopy(store)
            else:
                fields[field] = dict(store)
        return {"fields": fields, "active": list(self.active_adapters), "disabled": self.disabled,
                "merged": list(self.merged_adapters),
                "flags": {id(p): (p, p.requires_grad) for p in self.parameters()}}

    def _restore(self, snap: dict[str, Any]) -> None:
        for field, saved in snap["fields"].items():
            current = getattr(self, field)
            if isinstance(current, (nn.ModuleDict, nn.ParameterDict)):
                setattr(self, field, type(current)(saved))
            else:
                setattr(self, field, saved)
        self.active_adapters = snap["active"]
        self.disabled = snap["disabled"]
        self.merged_adapters = snap["merged"]
        for p, flag in snap["flags"].values():
            p.requires_grad_(flag)


L = TypeVar("L", bound=AdapterLayer)


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

def _shown(names: Sequence[str]) -> str:
    return f"{list(names[:3])}{' ...' if len(names) > 3 else ''}"


def adapted_layers(model: nn.Module, cls: type[L]) -> list[tuple[str, L]]:
    """``(qualified name, layer)`` of every ``cls`` layer of ``model``, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def adapter_names(model: nn.Module, cls: type[AdapterLayer]) -> list[str]:
    """Names of the adapters the ``cls`` layers of ``model`` hold (in order of first appearance)."""
    out: dict[str, None] = {}
    for _, layer in adapted_layers(model, cls):
        out.update(dict.fromkeys(layer.adapters))
    return list(out)


@contextlib.contextmanager
def all_or_nothing(model: nn.Module, cls: type[AdapterLayer]) -> Iterator[None]:
    """On an error inside the block, undo module replacements, ``requires_grad`` changes and the adapter
    state of every ``cls`` layer present on entry (base weights modified in place are the caller's)."""
    snaps = [(layer, layer._snapshot()) for _, layer in adapted_layers(model, cls)]
    with transaction(model):
        try:
            yield
        except BaseException:
            for layer, snap in snaps:
                layer._restore(snap)
            raise


def sync_trainable(model: nn.Module, cls: type[AdapterLayer], freeze_base: bool) -> None:
    """Set ``requires_grad`` of every adapter parameter of the ``cls`` layers: on for the trainable
    parameters (:meth:`AdapterLayer.adapter_parameters`) of active adapters, off for the rest (a parameter
    shared by several layers trains if any of them trains it). With ``freeze_base`` every other parameter
    of ``model`` is frozen; without, the others keep their flags."""
    own: dict[int, nn.Parameter] = {}
    on: set[int] = set()
    for _, layer in adapted_layers(model, cls):
        for name in layer.adapters:
            active = name in layer.active_adapters
            for p, trainable in layer.adapter_parameters(name):
                own[id(p)] = p
                if active and trainable:
                    on.add(id(p))
    for i, p in own.items():
        p.requires_grad_(i in on)
    if freeze_base:
        for p in model.parameters():
            if id(p) not in own:
                p.requires_grad_(False)


def target_layers(model: nn.Module, target: Selector, cls: type[AdapterLayer], *, typed: bool = False,
                  accepts: Callable[[nn.Module], bool] | None = None,
                  rejects: Callable[[nn.Module], bool] | None = None,
                  supported: str = "nn.Linear layers") -> list[tuple[str, nn.Module]]:
    """The layers ``target`` selects for adaptation, in model order: ``(name, module)``.

    A module counts if ``accepts(module)`` (default: it is an ``nn.Linear``) or it is a ``cls`` wrapper
    already (a hit on a wrapper's ``base_layer`` counts as the wrapper; other wrapper internals never
    count). ``typed`` restricts the selection itself to ``nn.Linear``/``cls`` modules (so ``target=None``
    means every Linear layer, see :func:`rankwise.core.select.select`). Selected modules that
    ``rejects`` raise ``NotImplementedError`` (``"<family> adapts <supported> only"``); an empty result
    raises :class:`SelectionError` listing the Linear layers there are.
    """
    accepts = accepts or (lambda m: isinstance(m, nn.Linear))
    wrappers = {n for n, _ in adapted_layers(model, cls)}
    out: dict[str, nn.Module] = {}
    unsupported: list[str] = []
    for n, m in select(model, target, types=(nn.Linear, cls) if typed else None, allow_empty=True):
        owner = next((w for w in wrappers if n.startswith(w + ".")), None)
        if owner is not None:
            if n == owner + ".base_layer":
                out.setdefault(owner, model.get_submodule(owner))
        elif isinstance(m, cls) or accepts(m):
            out.setdefault(n, m)
        elif rejects is not None and rejects(m):
            unsupported.append(f"{n} ({type(m).__name__})")
    if unsupported:
        raise NotImplementedError(f"{cls.family} adapts {supported} only; target {target!r} selects "
                                  f"{', '.join(unsupported[:5])}{' ...' if len(unsupported) > 5 else ''}")
    if not out:
        names = [n for n in available_names(model, (nn.Linear, cls))
                 if not any(n.startswith(w + ".") for w in wrappers)]
        shown = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
        raise SelectionError(f"target {target!r} matched no Linear layer. Available Linear layers: {shown or 'none'}")
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(out.items(), key=lambda kv: order[kv[0]])


def require_adapter(model: nn.Module, name: str, cls: type[L]) -> list[tuple[str, L]]:
    """The ``cls`` layers holding adapter ``name``; ``KeyError`` (listing the adapters there are) if none."""
    layers = [(n, m) for n, m in adapted_layers(model, cls) if name in m.adapters]
    if not layers:
        raise KeyError(f"the model has no {cls.adapter_label} named {name!r}; "
                       f"it has {adapter_names(model, cls) or 'none'}")
    return layers


def set_active(model: nn.Module, names: str | Sequence[str], cls: type[AdapterLayer],
               sync: Callable[..., None] | None = None) -> None:
    """Make ``names`` the active adapter(s) of every ``cls`` layer (a layer activates those it has).

    Unknown names raise ``KeyError`` before anything changes; then the trainable flags follow (active
    adapters trainable, the others frozen, other parameters untouched): :func:`sync_trainable`, or
    ``sync(model, freeze_base=False)`` when given. All-or-nothing.
    """
    names = [names] if isinstance(names, str) else list(names)
    have = adapter_names(model, cls)
    missing = [n for n in names if n not in have]
    if missing:
        raise KeyError(f"no {cls.adapter_label} named {missing} in the model; it has {have or 'none'}")
    with all_or_nothing(model, cls):
        for _, layer in adapted_layers(model, cls):
            layer.set_active([n for n in names if n in layer.adapters])
        if sync is not None:
            sync(model, freeze_base=False)
        else:
            sync_trainable(model, cls, freeze_base=False)


def enable_adapters(model: nn.Module, cls: type[AdapterLayer]) -> None:
    """Turn the adapters of every ``cls`` layer back on (after :func:`disable_adapters`)."""
    for _, layer in adapted_layers(model, cls):
        layer.set_enabled(True)


def disable_adapters(model: nn.Module, cls: type[AdapterLayer]) -> None:
    """Make every ``cls`` layer compute its base layer alone (adapters kept). Refused while merged."""
    layers = adapted_layers(model, cls)
    merged = [n for n, layer in layers if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged into {_shown(merged)}; unmerge before disabling")
    for _, layer in layers:
        layer.set_enabled(False)


def merge_all(model: nn.Module, cls: type[AdapterLayer]) -> list[str]:
    """Merge the active adapters of every ``cls`` layer into its base weight; returns the merged layers' names.

    All-or-nothing: refuses when no layer exists or any layer is already merged, and if one layer fails
    (disabled, non-finite result, ...) the layers merged before it are unmerged before the error propagates.
    """
    layers = adapted_layers(model, cls)
    if not layers:
        raise RankwiseError(f"the model has no {cls.family} layers to merge")
    already = [n for n, layer in layers if layer.merged_adapters]
    if already:
        raise RankwiseError(f"adapters are already merged in {_shown(already)}; unmerge before merging again")
    done: list[tuple[str, AdapterLayer]] = []
    try:
        for lname, layer in layers:
            if layer._merge():
                done.append((lname, layer))
    except BaseException:
        for _, layer in reversed(done):
            layer._unmerge()
        raise
    return [n for n, _ in done]


def unmerge_all(model: nn.Module, cls: type[AdapterLayer]) -> list[str]:
    """Undo :func:`merge_all` on every merged ``cls`` layer; returns their names (none merged: RankwiseError)."""
    layers = [(n, layer) for n, layer in adapted_layers(model, cls) if layer.merged_adapters]
    if not layers:
        raise RankwiseError(f"no {cls.adapter_label} is merged in this model")
    for _, layer in layers:
        layer._unmerge()
    return [n for n, _ in layers]


def delete_adapter(model: nn.Module, name: str, cls: type[AdapterLayer], *, unwrap_empty: bool = True,
                   after: Callable[[nn.Module], None] | None = None) -> None:
    """Remove adapter ``name`` from every ``cls`` layer; all-or-nothing.

    Unknown names raise ``KeyError``; a merged adapter ``RankwiseError``. With ``unwrap_empty`` a layer
    left without adapters gets its base layer back; ``after(model)`` runs last inside the transaction
    (e.g. to prune wrappers by a family's own rule).
    """
    layers = require_adapter(model, name, cls)
    merged = [n for n, layer in layers if name in layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapter {name!r} is merged in {_shown(merged)}; unmerge before deleting it")
    with all_or_nothing(model, cls):
        for lname, layer in layers:
            layer.delete_adapter(name)
            if unwrap_empty and not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        if after is not None:
            after(model)


def unload(model: nn.Module, cls: type[AdapterLayer], merge_first: bool = True) -> nn.Module:
    """Replace every ``cls`` layer by its base layer, merging the active adapters first if ``merge_first``
    (skipped when something is merged already: that merge is kept). Returns ``model`` (changed in place).

    All-or-nothing: a failure unmerges what this call merged and puts the wrappers back.
    """
    layers = adapted_layers(model, cls)
    done: list[str] = []
    if merge_first and layers and not any(layer.merged_adapters for _, layer in layers):
        done = merge_all(model, cls)
    try:
        with all_or_nothing(model, cls):
            for lname, layer in layers:
                replace_module(model, lname, layer.base_layer)
    except BaseException:
        merged_here = set(done)
        for lname, layer in reversed(layers):
            if lname in merged_here:
                layer._unmerge()
        raise
    return model



# ------------------------------------------------------------------------------------------------
# deprecated names (one release)
# ------------------------------------------------------------------------------------------------

def _warn_renamed(owner: str, old: str, new: str, stacklevel: int = 4) -> None:
    warnings.warn(f"{owner}: {old!r} is deprecated, use {new!r} (the old name goes away in the next release)",
                  DeprecationWarning, stacklevel=stacklevel)


def _rename(owner: str, kwargs: dict[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    for old, new in renamed.items():
        if old in kwargs:
            if new in kwargs:
                raise TypeError(f"{owner} got both {old!r} (deprecated) and {new!r}")
            _warn_renamed(owner, old, new)
            kwargs[new] = kwargs.pop(old)
    return kwargs


def deprecated_kwargs(**renamed: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: accept old keyword names ``old=new`` with a DeprecationWarning (both given: TypeError)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **_rename(f"{fn.__name__}()", kwargs, renamed))
        return inner
    return wrap


def deprecated_fields(**renamed: str) -> Callable[[type], type]:
    """Class decorator for a (frozen) dataclass config: old field names ``old=new`` stay accepted by the
    constructor and readable as attributes for one release, each with a DeprecationWarning."""
    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **_rename(cls.__name__, kwargs, renamed))

        cls.__init__ = __init__  # type: ignore[misc]
        for old, new in renamed.items():
            def getter(self: Any, _old: str = old, _new: str = new) -> Any:
                _warn_renamed(cls.__name__, _old, _new, stacklevel=3)
                return getattr(self, _new)
            setattr(cls, old, property(getter, doc=f"Deprecated alias of ``{new}``."))
        cls.deprecated_fields = dict(getattr(cls, "deprecated_fields", {}), **renamed)  # type: ignore[attr-defined]
        return cls
    return wrap


# ------------------------------------------------------------------------------------------------
# artefact directories and one adapter family's model-level API
# ------------------------------------------------------------------------------------------------

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class ArtifactContext:
    """What a layer's artefact hooks may read while an adapter is loaded.

    ``model``: the model being loaded into; ``source``: the file, for messages; ``meta``: the artefact's
    metadata; ``data``: what :meth:`AdapterMethod.read_context` derived from it (a parsed config, a
    plan, ...); ``shared``: scratch space shared by the layers of one load (tied or shared tensors).
    """

    model: nn.Module | None
    source: str
    meta: Mapping[str, Any]
    data: dict[str, Any] = dc_field(default_factory=dict)
    shared: dict[str, Any] = dc_field(default_factory=dict)


class AdapterMethod:
    """The model-level API of one adapter family, built from its layer class ``layer_cls``.

    One instance per family (``CDKA = AdapterMethod(CDKALinear, "rankwise.cdka")``) provides
    ``layers``, ``adapter_names``, ``require_adapter``, ``set_active``, ``enable``, ``disable``,
    ``merge``, ``unmerge``, ``delete_adapter``, ``unload(merge=...)``, ``save_adapter`` and
    ``load_adapter``; the family's module exposes them under its public names. Everything model-level
    is all-or-nothing (see :func:`all_or_nothing`, :func:`merge_all`).

    Artefact format (one directory, written atomically): ``adapter_model.safetensors`` with tensor
    ``<module>.<key>`` for every tensor a layer's :meth:`AdapterLayer.export_adapter` gives, and header
    metadata ``{"kind": kind, "name", "modules": {module: record}, "fingerprint", **extra}``; and
    ``adapter_config.json`` ``{"method", "name", "modules", **extra}`` for people. ``extra`` comes from
    :meth:`extra_metadata`. Loading checks, before the model changes: the kind, the module table and
    records, that the tensors are exactly those the records name, the base-model fingerprint, that
    nothing is merged, and that every module exists and fits (:meth:`AdapterLayer.artifact_fit`);
    then it installs all layers inside one transaction (:meth:`AdapterLayer.import_adapter`), makes
    the adapter the active one and freezes the rest.

    What a training run needs from the family is declared here too (:meth:`calibration_batches`,
    :meth:`training_hook`, :meth:`auxiliary_loss`, ``default_lr``, ``factor_pairs``).
    """

    #: adapter learning rate a training run uses when none is given
    default_lr: float = 1e-3
    #: the adapters are plain LoRA factor pairs (optimizers acting on (A, B) pairs apply)
    factor_pairs: bool = False

    def __init__(self, layer_cls: type[AdapterLayer], kind: str, *, method: str | None = None,
                 no_merge: str | None = None, default_lr: float | None = None) -> None:
        self.layer_cls = layer_cls
        self.kind = kind
        self.method = method or kind.rsplit(".", 1)[-1]
        self.label = layer_cls.family
        self.no_merge = no_merge or f"{layer_cls.family} adapters cannot be merged into the base weights"
        if default_lr is not None:
            self.default_lr = default_lr

    def __repr__(self) -> str:
        return f"AdapterMethod({self.layer_cls.__name__}, {self.kind!r})"

    # -- queries ------------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> list[tuple[str, Any]]:
        """``(qualified name, layer)`` of every layer of this family in ``model``, in model order."""
        return adapted_layers(model, self.layer_cls)

    def adapter_names(self, model: nn.Module) -> list[str]:
        """Names of the adapters in ``model``, in order of first appearance."""
        return adapter_names(model, self.layer_cls)

    def require_adapter(self, model: nn.Module, name: str) -> list[tuple[str, Any]]:
        return require_adapter(model, name, self.layer_cls)

    def all_or_nothing(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return all_or_nothing(model, self.layer_cls)

    def sync_trainable(self, model: nn.Module, freeze_base: bool) -> None:
        sync_trainable(model, self.layer_cls, freeze_base)

    def target_layers(self, model: nn.Module, target: Selector, **kwargs: Any) -> list[tuple[str, nn.Module]]:
        return target_layers(model, target, self.layer_cls, **kwargs)

    # -- switching ------------------------------------------------------------------------------
    def set_active(self, model: nn.Module, names: str | Sequence[str]) -> None:
        """Make ``names`` the active (trainable) adapter(s) of every layer; the others inactive (frozen)."""
        set_active(model, names, self.layer_cls, sync=lambda m, freeze_base: self.sync_trainable(m, freeze_base))

    def enable(self, model: nn.Module) -> None:
        """Turn the adapters back on (after :meth:`disable`)."""
        enable_adapters(model, self.layer_cls)

    def disable(self, model: nn.Module) -> None:
        """Make the model compute the base model's outputs (adapters kept). Refused while merged."""
        disable_adapters(model, self.layer_cls)

    def merge(self, model: nn.Module) -> nn.Module:
        """Merge the active adapters into the base weights, all-or-nothing; returns the model."""
        if not self.layer_cls.mergeable:
            raise RankwiseError(self.no_merge)
        merge_all(model, self.layer_cls)
        return model

    def unmerge(self, model: nn.Module) -> nn.Module:
        """Subtract the merged adapters from the base weights (exact up to float rounding)."""
        if not self.layer_cls.mergeable:
            raise RankwiseError(f"no {self.label} adapter is merged ({self.label} adapters cannot be merged)")
        unmerge_all(model, self.layer_cls)
        return model

    def prune(self, model: nn.Module) -> None:
        """Give layers left without adapters their base layer back (run inside a transaction)."""
        for lname, layer in self.layers(model):
            if not layer.adapters:
                replace_module(model, lname, layer.base_layer)

    def delete_adapter(self, model: nn.Module, name: str) -> None:
        """Remove adapter ``name`` everywhere (layers left without adapters get their base layer back)."""
        delete_adapter(model, name, self.layer_cls, unwrap_empty=False, after=self.prune)

    @deprecated_kwargs(merge_first="merge")
    def unload(self, model: nn.Module, merge: bool = True) -> nn.Module:
        """Replace every layer of this family by its base layer; with ``merge`` (mergeable families only)
        the active adapters are merged first (``merge_first``: deprecated name)."""
        return unload(model, self.layer_cls, bool(merge) and self.layer_cls.mergeable)

    def start_adapt(self, model: nn.Module, config: Any, config_cls: type, name: str | None = "default") -> Any:
        """What every ``adapt`` checks first: ``config`` (None: ``config_cls()``) and ``model`` types, the
        adapter ``name``, and that nothing is merged. Returns the config."""
        config = config_cls() if config is None else config
        if not isinstance(config, config_cls):
            raise TypeError(f"adapt: config must be a {config_cls.__name__}, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
        if name is not None:
            validate_adapter_name(name)
        merged = [n for n, layer in self.layers(model) if layer.merged_adapters]
        if merged:
            raise RankwiseError(f"adapters are merged in {_shown(merged)}; unmerge before adding an adapter")
        return config

    # -- training-run declarations ----------------------------------------------------------------
    def calibration_batches(self, config: Any) -> int:
        """How many calibration batches ``adapt(model, config, calib=...)`` reads (0: none)."""
        return 0

    def training_hook(self, model: nn.Module, config: Any, calib: Sequence[Any] | None,
                      total_steps: int) -> Callable[[Any, int], None] | None:
        """A callback ``f(trainer, steps_done)`` run after every optimizer step, or None."""
        return None

    def auxiliary_loss(self, model: nn.Module, config: Any) -> Callable[[nn.Module, Any, Any, int], torch.Tensor] | None:
        """The method's training-loss term beside the task loss, as ``f(model, batch, outputs, step) -> scalar``
        (``rankwise.train.finetune.Trainer``'s ``extra_loss``: called after each forward pass), or None."""
        return None

    # -- save ---------------------------------------------------------------------------------------
    def extra_metadata(self, model: nn.Module, name: str, layers: Sequence[tuple[str, Any]]) -> dict[str, Any]:
        """Model-level entries added to the metadata and the config file (a plan, a config, ...)."""
        return {}

    def export(self, model: nn.Module, name: str, layers: Sequence[tuple[str, Any]]
               ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """``(tensors by stored name, {module: record})`` of adapter ``name``."""
        tensors: dict[str, torch.Tensor] = {}
        modules: dict[str, dict[str, Any]] = {}
        for lname, layer in layers:
            local, record = layer.export_adapter(name)
            tensors.update({f"{lname}.{k}": t for k, t in local.items()})
            modules[lname] = record
        return tensors, modules

    def save_adapter(self, model: nn.Module, directory: str | Path, name: str = "default", *,
                     overwrite: bool | None = None) -> Path:
        """Save adapter ``name`` to ``directory`` atomically (see the class docstring for the format)."""
        layers = self.require_adapter(model, name)
        tensors, modules = self.export(model, name, layers)
        extra = self.extra_metadata(model, name, layers)
        meta = {"kind": self.kind, "name": name, "modules": modules, "fingerprint": io.model_fingerprint(model),
                **extra}

        def files(tmp: Path) -> None:
            io.write_json(tmp / CONFIG_FILE, {"method": self.method, "name": name, "modules": modules, **extra})
            io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
        return io.write_dir(directory, files, overwrite=overwrite, own_files=(CONFIG_FILE, WEIGHTS_FILE))

    # -- load ---------------------------------------------------------------------------------------
    def read_context(self, meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
        """Model-level data parsed from the metadata (ArtifactError naming ``path`` if malformed)."""
        return {}

    def split(self, tensors: Mapping[str, torch.Tensor], modules: Mapping[str, Any], context: ArtifactContext,
              path: Path) -> dict[str, dict[str, torch.Tensor]]:
        """Check every record and that the file holds exactly the tensors they name; per module
        ``{local key: tensor}``."""
        keys: dict[str, dict[str, str]] = {}
        for m, record in modules.items():
            try:
                if not isinstance(record, dict):
                    raise ValueError("not an object")
                keys[m] = self.layer_cls.artifact_keys(m, record, context)
            except (ValueError, TypeError, KeyError) as e:
                raise ArtifactError(f"{path}: bad metadata for module {m!r}") from e
        expected = {k for ks in keys.values() for k in ks.values()}
        if set(tensors) != expected:
            raise ArtifactError(f"{path}: tensors do not match the module table (missing "
                                f"{sorted(expected - set(tensors))[:4]}, unexpected {sorted(set(tensors) - expected)[:4]})")
        return {m: {local: tensors[stored] for local, stored in ks.items()} for m, ks in keys.items()}

    def check_fits(self, model: nn.Module, per_module: Mapping[str, Mapping[str, torch.Tensor]],
                   modules: Mapping[str, Any], context: ArtifactContext, source: str) -> None:
        """Every module exists, can carry this family's adapter and fits its tensors; else ArtifactError."""
        problems: list[str] = []
        for m, tensors in per_module.items():
            try:
                mod = model.get_submodule(m)
            except AttributeError:
                problems.append(f"module {m!r} does not exist in the model")
                continue
            base = mod.base_layer if isinstance(mod, self.layer_cls) else mod
            if not self.layer_cls.wraps(base):
                problems.append(f"module {m!r} is a {type(mod).__name__}, not {self.layer_cls.base_kind}")
                continue
            problem = self.layer_cls.artifact_fit(model, m, base, tensors, modules[m], context)
            if problem:
                problems.append(problem)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} problems)" if len(problems) > 5 else "")
            raise ArtifactError(f"{source} does not fit this model: {shown}")

    def wrap(self, model: nn.Module, module: str) -> Any:
        """The family's wrapper at ``module`` (created and swapped in if the module is still plain)."""
        mod = model.get_submodule(module)
        if isinstance(mod, self.layer_cls):
            return mod
        layer = self.layer_cls(mod, layer_name=module)
        replace_module(model, module, layer)
        return layer

    def load_adapter(self, model: nn.Module, directory: str | Path, name: str = "default", *,
                     check_base: bool = True) -> nn.Module:
        """Load an adapter written by :meth:`save_adapter` into ``model`` as adapter ``name`` (active, trainable).

        Replaces an adapter of that name. ArtifactError (model unchanged) for a missing, corrupt or
        truncated file, another artefact kind, another base model (fingerprint; skip with
        ``check_base=False``), or modules that do not fit. Tensors load bit-exactly.
        """
        validate_adapter_name(name)
        directory = Path(directory)
        if not directory.is_dir():
            raise ArtifactError(f"{directory}: no such adapter directory")
        path = directory / WEIGHTS_FILE
        tensors, meta = io.load_tensors(path)
        if meta.get("kind") != self.kind:
            raise ArtifactError(f"{path}: not a rankwise {self.label} adapter (kind={meta.get('kind')!r})")
        modules = meta.get("modules")
        if not isinstance(modules, dict) or not modules:
            raise ArtifactError(f"{path}: metadata lacks the module table")
        context = ArtifactContext(model, str(path), meta)
        context.data = self.read_context(meta, path)
        per_module = self.split(tensors, modules, context, path)
        if check_base:
            io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
        if self.layer_cls.mergeable and any(layer.merged_adapters for _, layer in self.layers(model)):
            raise RankwiseError(f"unmerge the {self.label} adapters before loading one")
        self.check_fits(model, per_module, modules, context, str(path))
        with self.all_or_nothing(model):
            for _, layer in self.layers(model):
                if name in layer.adapters:
                    layer._drop_adapter(name)
            for m, local in per_module.items():
                layer = self.wrap(model, m)
                try:
                    layer.import_adapter(name, local, modules[m], context)
                except ValueError as e:
                    raise ArtifactError(f"{path}: {e}") from e
            for _, layer in self.layers(model):
                layer.active_adapters = [name] if name in layer.adapters else []
            self.prune(model)
            self.sync_trainable(model, freeze_base=True)
        return model
