"""The registry of merging methods: one method object per name, with its config class.

Like mergekit's ``merge_methods``, every method has the same interface, so a caller (the
``rankwise merge`` command, :func:`rankwise.merge.dirs.merge_dirs`, a benchmark) looks a method up
by name and never branches on it::

    method = resolve_merge_method("ties")
    config = method.build_config(16, density=0.5)      # a MergeConfig(space="full", rule="ties", ...)
    merged, diagnostics = method.run(adapters, config)   # diagnostics: {"kept_energy": [...]} for CtM

A method registers itself where it is defined (:func:`register_merge_method`):
:mod:`rankwise.merge.mtc` registers the merge-then-compress baselines (``ta``, ``ties``, ``dare``,
``iso_c``, ``mtc``, ``knots``, ``core``), :mod:`rankwise.merge.ctm` registers ``ctm``.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from rankwise.core.errors import UnknownMethodError
from rankwise.core.lora import AdapterState

__all__ = ["MergeMethod", "merge_methods", "register_merge_method", "resolve_merge_method"]

MergeFn = Callable[[Sequence[AdapterState], Any], AdapterState]
ReportFn = Callable[[Sequence[AdapterState], Any], "tuple[AdapterState, dict[str, Any]]"]


@dataclass(frozen=True)
class MergeMethod:
    """One merging method: ``merge(adapters, config) -> AdapterState`` and how to build its config.

    Attributes:
        name: the registered name (``"ties"``), what ``rankwise merge --method`` accepts.
        config_class: the frozen config dataclass (``MergeConfig``, ``CtMConfig``); it validates.
        merge: the method's entry point.
        summary: one line for listings and help.
        preset: config values the method sets over the config class's defaults
            (``{"space": "knots", "rule": "ties"}``); an option given by the user overrides them ...
        fixed: ... except the names listed here (``("rule",)`` for ``ties``: TIES is the rule).
        report: optional ``(adapters, config) -> (state, diagnostics)``; diagnostics may hold
            ``"kept_energy"``: per input adapter, the fraction of its energy the merge kept.
    """

    name: str
    config_class: type
    merge: MergeFn
    summary: str = ""
    preset: Mapping[str, Any] = field(default_factory=dict)
    fixed: tuple[str, ...] = ()
    report: ReportFn | None = None

    def option_names(self) -> tuple[str, ...]:
        """The config fields a caller may set (every field of the config class but ``rank`` and the fixed ones)."""
        return tuple(f.name for f in dataclasses.fields(self.config_class)
                     if f.name != "rank" and f.name not in self.fixed)

    def build_config(self, rank: int, **options: Any) -> Any:
        """The method's config at ``rank``; options left at ``None`` keep the method's defaults.

        Raises ValueError for an option the method does not have (naming the methods that do) and for
        a value that changes a fixed setting.
        """
        given = {k: v for k, v in options.items() if v is not None}
        fields = {f.name for f in dataclasses.fields(self.config_class)}
        for key in given:
            if key not in fields:
                owners = [m.name for m in merge_methods().values()
                          if key in {f.name for f in dataclasses.fields(m.config_class)}]
                where = f"--method {' / '.join(owners)} only" if owners else "no merge method"
                raise ValueError(f"--{key.replace('_', '-')} applies to {where}, not {self.name!r}")
        config = self.config_class(rank=rank, **{**self.preset, **given})
        for key in self.fixed:
            if key in given and getattr(config, key) != self.preset[key]:
                raise ValueError(f"--method {self.name} fixes the {key} to {self.preset[key]!r}; use --method mtc "
                                 f"--{key} {given[key]} for another {key} in full space")
        return config

    def run(self, adapters: Sequence[AdapterState], config: Any) -> tuple[AdapterState, dict[str, Any]]:
        """Merge and return ``(state, diagnostics)`` (empty diagnostics for a method without a report)."""
        if self.report is not None:
            return self.report(adapters, config)
        return self.merge(adapters, config), {}


_METHODS: dict[str, MergeMethod] = {}


def register_merge_method(method: MergeMethod) -> MergeMethod:
    """Make ``method`` available under ``method.name``; a second registration of a name replaces the first."""
    if not isinstance(method, MergeMethod) or not method.name:
        raise ValueError(f"register_merge_method: expected a named MergeMethod, got {method!r}")
    missing = [k for k in method.fixed if k not in method.preset]
    if missing:
        raise ValueError(f"merge method {method.name!r}: fixed settings {missing} need a value in preset")
    _METHODS[method.name] = method
    return method


def merge_methods() -> dict[str, MergeMethod]:
    """Every registered merging method by name, in registration order (imports :mod:`rankwise.merge` first)."""
    importlib.import_module("rankwise.merge")
    return dict(_METHODS)


def resolve_merge_method(name: str) -> MergeMethod:
    """The method registered as ``name`` (case and ``-``/``_`` ignored).

    Raises :class:`~rankwise.core.errors.UnknownMethodError` (a ValueError) listing the available names.
    """
    methods = merge_methods()
    if isinstance(name, str):
        key = name.strip().lower().replace("-", "_")
        if key in methods:
            return methods[key]
    raise UnknownMethodError(f"--method must be one of {list(methods)}, got {name!r}")
