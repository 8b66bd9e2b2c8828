"""Validation of configuration fields and arguments, in one place.

Every config ``__post_init__`` and every public entry point checks its inputs with these functions,
so that a bad value always gives the same kind of message: the field, the value and the allowed
range, e.g. ``"LoraConfig.rank must be an int >= 1, got 0"``. Each function returns the value
converted to a plain Python type (``int``, ``float``, ``str``) so callers can store it directly.

``field`` is the name to show, qualified by the caller where that helps (``"SwiftSVDConfig.ratio"``).
All failures raise :class:`ValueError`; a value of the wrong *type* raises :class:`FieldTypeError`, a
``ValueError`` that is also a ``TypeError``, so that one ``except ValueError`` catches every bad field
while code that expects a ``TypeError`` for a wrong type (as ``torch.optim`` callers do) keeps working.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Collection, TypeVar

T = TypeVar("T")

__all__ = [
    "FieldTypeError",
    "check_int",
    "check_number",
    "check_positive",
    "check_unit",
    "check_choice",
    "check_bool",
    "check_str",
]


class FieldTypeError(ValueError, TypeError):
    """A field whose value has the wrong type (a bool for an int, a string for a number, ...)."""


def _range_text(lo: float | None, hi: float | None, low_open: bool, high_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if low_open else '>='} {lo:g}" if isinstance(lo, float) else
                     f"{'>' if low_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if high_open else '<='} {hi:g}" if isinstance(hi, float) else
                     f"{'<' if high_open else '<='} {hi}")
    return " and ".join(parts)


def _fail(field: str, what: str, value: Any, allow_none: bool, wrong_type: bool = False) -> ValueError:
    none = " or None" if allow_none else ""
    return (FieldTypeError if wrong_type else ValueError)(f"{field} must be {what}{none}, got {value!r}")


def check_int(field: str, value: Any, lo: int | None = None, hi: int | None = None, *,
              allow_none: bool = False) -> int | None:
    """``value`` as an ``int`` in ``[lo, hi]`` (either bound may be None); bools are refused.

    Accepts numpy integers. Raises ``ValueError("<field> must be an int >= lo and <= hi, got v")``.
    """
    if value is None and allow_none:
        return None
    rng = _range_text(lo, hi, False, False)
    what = f"an int {rng}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(field, what, value, allow_none, wrong_type=True)
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _fail(field, what, value, allow_none)
    return v


def check_number(field: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                 low_open: bool = False, high_open: bool = False,
                 allow_none: bool = False) -> float | None:
    """``value`` as a finite ``float`` in the range given by ``lo``/``hi`` (open or closed ends).

    Accepts ints and numpy scalars; refuses bools, NaN and infinities.
    """
    if value is None and allow_none:
        return None
    rng = _range_text(lo, hi, low_open, high_open)
    what = f"a finite number {rng}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(field, what, value, allow_none, wrong_type=True)
    v = float(value)
    if not math.isfinite(v):
        raise _fail(field, what, value, allow_none)
    if lo is not None and (v < lo or (low_open and v == lo)):
        raise _fail(field, what, value, allow_none)
    if hi is not None and (v > hi or (high_open and v == hi)):
        raise _fail(field, what, value, allow_none)
    return v


def check_positive(field: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A finite number > 0."""
    return check_number(field, value, 0.0, None, low_open=True, allow_none=allow_none)


def check_unit(field: str, value: Any, *, low_open: bool = False, high_open: bool = False,
               allow_none: bool = False) -> float | None:
    """A finite number in the unit interval, ``[0, 1]`` by default (each end may be open)."""
    if value is None and allow_none:
        return None
    rng = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    try:
        return check_number(field, value, 0.0, 1.0, low_open=low_open, high_open=high_open)
    except ValueError as e:
        raise _fail(field, f"a number in {rng}", value, allow_none, isinstance(e, FieldTypeError)) from None


def check_choice(field: str, value: Any, choices: Collection[T], *, allow_none: bool = False) -> T | None:
    """``value`` if it is one of ``choices``; the message lists them."""
    if value is None and allow_none:
        return None
    try:
        ok = value in choices
    except TypeError:  # unhashable value against a set
        ok = False
    if not ok:
        listed = ", ".join(repr(c) for c in choices)
        raise _fail(field, f"one of {listed}", value, allow_none)
    return value


def check_bool(field: str, value: Any) -> bool:
    """A real ``bool`` (``0``/``1`` and strings are refused)."""
    if not isinstance(value, bool):
        raise _fail(field, "True or False", value, False, wrong_type=True)
    return value


def check_str(field: str, value: Any, *, allow_empty: bool = False, allow_none: bool = False) -> str | None:
    """A ``str`` (non-empty unless ``allow_empty``)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or (not allow_empty and not value):
        raise _fail(field, "a non-empty string" if not allow_empty else "a string", value, allow_none,
                    wrong_type=not isinstance(value, str))
    return value
