"""rankwise.core.validate: ranges with open/closed ends, bools/NaN/inf refused, allow_none, the message form."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from rankwise.core.validate import (
    FieldTypeError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive,
    check_str,
    check_unit,
)


def test_check_int_ranges_and_conversion():
    assert check_int("C.n", 3, 1, 3) == 3 and type(check_int("C.n", np.int64(2), 1)) is int
    assert check_int("C.n", -5) == -5
    with pytest.raises(ValueError, match=r"^C\.n must be an int >= 1, got 0$"):
        check_int("C.n", 0, 1)
    with pytest.raises(ValueError, match=r"^C\.n must be an int >= 1 and <= 3, got 4$"):
        check_int("C.n", 4, 1, 3)
    with pytest.raises(ValueError, match=r"^C\.n must be an int <= 3, got 9$"):
        check_int("C.n", 9, None, 3)


@pytest.mark.parametrize("bad", [True, False, 2.0, "2", None, float("nan")])
def test_check_int_refuses_other_types_with_a_type_error(bad):
    with pytest.raises(FieldTypeError, match=r"^C\.n must be an int >= 1, got " + re.escape(repr(bad)) + "$"):
        check_int("C.n", bad, 1)
    with pytest.raises(TypeError):  # FieldTypeError is both
        check_int("C.n", bad, 1)


def test_allow_none():
    assert check_int("C.n", None, 1, allow_none=True) is None
    assert check_number("C.x", None, allow_none=True) is None
    assert check_unit("C.p", None, allow_none=True) is None
    assert check_positive("C.x", None, allow_none=True) is None
    assert check_choice("C.c", None, ("a",), allow_none=True) is None
    assert check_str("C.s", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"^C\.n must be an int >= 1 or None, got 0$"):
        check_int("C.n", 0, 1, allow_none=True)
    with pytest.raises(ValueError, match=r"or None, got -1"):
        check_positive("C.x", -1, allow_none=True)


def test_check_number_open_and_closed_ends():
    assert check_number("C.x", 0, 0.0) == 0.0 and type(check_number("C.x", 1, 0.0)) is float
    assert check_number("C.x", np.float32(0.5), 0.0, 1.0) == 0.5
    with pytest.raises(ValueError, match=r"^C\.x must be a finite number > 0 and <= 1, got 0$"):
        check_number("C.x", 0, 0.0, 1.0, low_open=True)
    assert check_number("C.x", 1, 0.0, 1.0, low_open=True) == 1.0
    with pytest.raises(ValueError, match=r"^C\.x must be a finite number >= 0 and < 1, got 1$"):
        check_number("C.x", 1, 0.0, 1.0, high_open=True)
    with pytest.raises(ValueError, match=r"^C\.x must be a finite number >= 0.5, got 0.25$"):
        check_number("C.x", 0.25, 0.5)
    assert check_number("C.x", -1e300) == -1e300


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -math.inf, np.float64("nan")])
def test_check_number_refuses_nan_and_inf(bad):
    with pytest.raises(ValueError, match=r"^C\.x must be a finite number, got"):
        check_number("C.x", bad)
    with pytest.raises(ValueError, match="C.lr must be a finite number > 0"):
        check_positive("C.lr", bad)


@pytest.mark.parametrize("bad", [True, "1.0", None, [1.0], 1j])
def test_check_number_refuses_bools_and_non_numbers(bad):
    with pytest.raises(FieldTypeError, match=r"^C\.x must be a finite number, got"):
        check_number("C.x", bad)


def test_check_positive():
    assert check_positive("C.lr", 1e-9) == 1e-9
    for bad in (0, -0.0, -1):
        with pytest.raises(ValueError, match=rf"^C\.lr must be a finite number > 0, got {bad!r}$"):
            check_positive("C.lr", bad)


@pytest.mark.parametrize("low_open,high_open,rng", [(False, False, "[0, 1]"), (True, False, "(0, 1]"),
                                                    (False, True, "[0, 1)"), (True, True, "(0, 1)")])
def test_check_unit_ends(low_open, high_open, rng):
    kw = dict(low_open=low_open, high_open=high_open)
    assert check_unit("C.p", 0.5, **kw) == 0.5
    for end, is_open in ((0, low_open), (1, high_open)):
        if is_open:
            with pytest.raises(ValueError, match=rf"^C\.p must be a number in \{rng[0]}0, 1\{rng[-1]}, got {end}$"):
                check_unit("C.p", end, **kw)
        else:
            assert check_unit("C.p", end, **kw) == float(end)
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^C\.p must be a number in"):
            check_unit("C.p", bad, **kw)
    with pytest.raises(FieldTypeError, match=r"^C\.p must be a number in"):
        check_unit("C.p", True, **kw)


def test_check_choice_bool_str():
    assert check_choice("C.mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"^C\.mode must be one of 'a', 'b', got 'c'$"):
        check_choice("C.mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match="must be one of"):
        check_choice("C.mode", ["a"], {"a", "b"})  # unhashable against a set
    assert check_bool("C.flag", False) is False
    for bad in (0, 1, "True", None):
        with pytest.raises(FieldTypeError, match=r"^C\.flag must be True or False, got"):
            check_bool("C.flag", bad)
    assert check_str("C.s", "x") == "x" and check_str("C.s", "", allow_empty=True) == ""
    with pytest.raises(ValueError, match=r"^C\.s must be a non-empty string, got ''$"):
        check_str("C.s", "")
    with pytest.raises(FieldTypeError):
        check_str("C.s", 3)


def test_every_failure_is_a_value_error():
    assert issubclass(FieldTypeError, ValueError) and issubclass(FieldTypeError, TypeError)
    for call in (lambda: check_int("f", "x"), lambda: check_number("f", "x"), lambda: check_bool("f", 1),
                 lambda: check_int("f", 0, 1), lambda: check_unit("f", 2)):
        with pytest.raises(ValueError, match=r"^f must be"):
            call()
