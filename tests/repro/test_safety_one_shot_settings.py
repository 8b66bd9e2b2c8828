"""The one-shot safety reproduction's settings: the spec's quick and full modes, and bad overrides."""

from __future__ import annotations

import dataclasses

import pytest

from rankwise.repro import safety_one_shot as repro


def test_modes_follow_the_spec():
    q, f = repro.SETTINGS["quick"], repro.SETTINGS["full"]
    assert q.attack_sizes == (100,) and q.seeds == (0,)
    assert f.attack_sizes == (10, 100, 1000) and f.seeds == (0, 1, 2)
    for s in (q, f):
        assert (s.epochs, s.lr, s.rank, s.n_candidates, s.stop_nll) == (10, 1e-3, 8, 20, 0.05)
    assert f.n_multi == 100


@pytest.mark.parametrize("sizes", [(7,), ()])
def test_bad_attack_sizes(sizes):
    with pytest.raises(ValueError, match="attack_sizes"):
        dataclasses.replace(repro.SETTINGS["quick"], attack_sizes=sizes).validate()


def test_thresholds_are_the_specs():
    assert (repro.ASR_MARGIN, repro.UTIL_MARGIN, repro.ENERGY, repro.SHARE_LOW_RANK, repro.PROJ_SHARE,
            repro.MIN_ATTACK) == (0.05, -0.02, 0.9, 0.8, 0.9, 0.5)
