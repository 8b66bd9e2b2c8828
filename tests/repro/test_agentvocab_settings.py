"""AgentVocab reproduction: the modes are the spec's (quick: 1000 trajectories, 300 steps, K = 64, 200
requests, seed 0, latency reported; full: K = 96 + 32, 600 steps, 3 seeds, latency checked)."""

from __future__ import annotations

import pytest

from rankwise.repro import agentvocab as av


def test_modes_follow_the_spec() -> None:
    q, f = av.SETTINGS["quick"], av.SETTINGS["full"]
    assert (q.n_train, q.steps, q.structural_budget + q.content_budget, q.n_test, q.seeds) == (1000, 300, 64, 200, (0,))
    assert not q.latency_claim and f.latency_claim
    assert (f.n_train, f.n_test, f.steps, f.structural_budget, f.content_budget, f.structural_only_budget) == \
        (5000, 1000, 600, 96, 32, 128)
    assert f.seeds == (0, 1, 2)
    assert (av.MIN_OUT_REDUCTION, av.MIN_LAT_REDUCTION, av.EM_TOLERANCE, av.MIN_STRUCT_SHARE) == (0.30, 0.15, -0.02, 0.70)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="steps"):
        av.AgentVocabSettings(steps=0)
    with pytest.raises(ValueError, match="stage1"):
        av.AgentVocabSettings(stage1="large")
