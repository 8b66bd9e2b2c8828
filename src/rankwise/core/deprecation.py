"""Renamed public names kept for one release: keyword arguments and dataclass config fields.

``deprecated_kwargs(old="new")`` decorates a function, ``deprecated_fields(old="new")`` a (frozen)
dataclass config; the old name keeps working with a :class:`DeprecationWarning`, both at once is a
``TypeError``. (Formerly in :mod:`rankwise.core.adapters`, which re-exports them.)
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping

__all__ = ["deprecated_fields", "deprecated_kwargs"]


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
