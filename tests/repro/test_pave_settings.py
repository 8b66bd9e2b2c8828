"""The PAVE reproduction's settings: modes are valid, cross-field rules refuse what cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from rankwise.repro import pave


def test_modes_are_valid_and_sized_as_the_spec_says() -> None:
    for s in pave.SETTINGS.values():
        s.validate()
    q, f = pave.SETTINGS["quick"], pave.SETTINGS["full"]
    assert len(q.tasks) == 4 and q.spec_steps == 30 and q.max_length == 32 and q.layers == (4, 5) and q.top1_min == 0.75
    assert len(f.tasks) == 6 and f.spec_steps >= q.spec_steps and f.dev_models and f.n_corrupt == 2 and f.top1_min == 0.80


@pytest.mark.parametrize("change, match", [
    ({"tasks": ("dunder",)}, ">= 2 distinct tasks"),
    ({"layers": (3, 5)}, "top layers"),
    ({"n_corrupt": 1, "dev_models": False}, "needs dev_models"),
    ({"ft_shots": 40}, "ft_shots must be <= n_user"),
])
def test_cross_field_rules(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(pave.SETTINGS["quick"], **change).validate()
