"""Lopti reproduction: settings rules and the shared reward (the smoke run is in test_smoke.py)."""

import pytest

from rankwise.repro import lopti


def test_settings_need_plain_grpo_and_known_arms():
    with pytest.raises(ValueError, match="LoptiSettings.arms"):
        lopti.LoptiSettings(arms=("ar_lopti",))
    with pytest.raises(ValueError, match="LoptiSettings.arms"):
        lopti.LoptiSettings(arms=("grpo", "ppo"))
    assert set(lopti.SETTINGS["full"].arms) == set(lopti.ARMS) and lopti.SETTINGS["full"].seeds == (0, 1, 2)
    assert lopti.SETTINGS["quick"].steps == 40  # the spec's quick budget


def test_reward_is_exact_match_with_trl_signature():
    r = lopti._reward(prompts=["1+1=", "2+2=", "3+3="], completions=["2", "5", " 6"], answer=["2", "4", "6"],
                      completion_ids=[[1], [2], [3]])
    assert r == [1.0, 0.0, 1.0]
