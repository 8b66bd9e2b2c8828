"""Choose the modules a method targets, and say what matched.

A target is given as any of:

* a module type or tuple of types (``nn.Linear``): every module of that type;
* a string: a glob on the qualified module name (``"*.attention.*.query"``), or a regular
  expression (matched against the whole name) when prefixed by ``re:`` (``"re:.*\\.(query|value)"``); a bare name like ``"query"``
  matches modules whose last name component equals it (as PEFT's ``target_modules`` does);
* a sequence of such strings (any of them);
* a callable ``(name, module) -> bool``.

``select`` returns ``[(name, module)]`` in model order. When nothing matches it raises
:class:`~rankwise.core.errors.SelectionError` listing the module names that exist, so that the
user can fix the selector.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Callable, Iterable, Sequence, Union

from torch import nn

from rankwise.core.errors import SelectionError

Selector = Union[
    type, tuple[type, ...], str, Sequence[str], Callable[[str, nn.Module], bool], None
]


def _name_matcher(pattern: str) -> Callable[[str], bool]:
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return lambda name: rx.fullmatch(name) is not None
    if any(ch in pattern for ch in "*?["):
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    return lambda name: name == pattern or name.endswith("." + pattern)


def matcher(target: Selector, types: tuple[type, ...] | None = None) -> Callable[[str, nn.Module], bool]:
    """Turn a selector into a predicate ``(name, module) -> bool``.

    ``types`` restricts name-based selectors to modules of those types (e.g. ``(nn.Linear,)``);
    ``None`` as target then means "every module of ``types``".
    """
    type_ok = (lambda m: isinstance(m, types)) if types else (lambda m: True)
    if target is None:
        if not types:
            raise SelectionError("a target is required (a module type, a name pattern or a callable)")
        return lambda name, m: name != "" and type_ok(m)
    if isinstance(target, type) or (isinstance(target, tuple) and target and all(isinstance(t, type) for t in target)):
        return lambda name, m: name != "" and isinstance(m, target)
    if isinstance(target, str):
        f = _name_matcher(target)
        return lambda name, m: name != "" and type_ok(m) and f(name)
    if callable(target):
        return lambda name, m: name != "" and bool(target(name, m))
    if isinstance(target, Iterable):
        pats = list(target)
        if not pats or not all(isinstance(p, str) for p in pats):
            raise SelectionError(f"a sequence target must hold name patterns (strings), got {pats!r}")
        fs = [_name_matcher(p) for p in pats]
        return lambda name, m: name != "" and type_ok(m) and any(f(name) for f in fs)
    raise SelectionError(f"unsupported target {target!r}: give a module type, a name pattern, a list of patterns or a callable")


def select(
    model: nn.Module,
    target: Selector,
    types: tuple[type, ...] | None = None,
    *,
    allow_empty: bool = False,
) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, module)`` pairs of ``model`` that ``target`` selects, in model order.

    ``types`` restricts every selector (types, names, callables) to modules of those types;
    ``target=None`` then selects every module of ``types``. Raises ``SelectionError`` listing the
    available names when nothing matches (unless ``allow_empty``), and naming the offending types
    when every matched module is of a type outside ``types``.
    """
    pred = matcher(target, types if target is None else None)
    hits = [(n, m) for n, m in model.named_modules() if pred(n, m)]
    if types and target is not None:
        wrong = [(n, type(m).__name__) for n, m in hits if not isinstance(m, types)]
        # Name patterns may also hit parents (e.g. "attention"); keep only supported types, but if
        # every hit is of an unsupported type, tell the user instead of silently doing nothing.
        hits = [(n, m) for n, m in hits if isinstance(m, types)]
        if not hits and wrong:
            allowed = ", ".join(t.__name__ for t in types)
            raise SelectionError(
                f"target {target!r} matched only modules of unsupported types {wrong[:5]}; "
                f"supported: {allowed}")
    if not hits and not allow_empty:
        names = available_names(model, types)
        shown = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
        raise SelectionError(f"target {target!r} matched no module. Available"
                             f"{' ' + '/'.join(t.__name__ for t in types) if types else ''} modules: {shown}")
    return hits


def available_names(model: nn.Module, types: tuple[type, ...] | None = None) -> list[str]:
    """Qualified names of the modules of ``model`` (of ``types`` if given), for error messages."""
    return [n for n, m in model.named_modules() if n and (types is None or isinstance(m, types))]


def describe(hits: Sequence[tuple[str, nn.Module]]) -> str:
    """A short human-readable report of a selection: count and names (for logs and the CLI)."""
    names = [n for n, _ in hits]
    head = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    return f"{len(names)} module(s): {head}"
