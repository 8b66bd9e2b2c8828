"""AgentVocab reproduction: the modes are the spec's (quick: 1000 trajectories, 300 steps, K = 64, seed 0,
latency reported; full: K = 96 + 32, 600 steps, 3 seeds, latency checked), scored on fewer test requests
than the spec's (150 / 600 instead of 200 / 1000) to fit the time budgets (docs/methods/agentvocab.md)."""

from __future__ import annotations

import pytest

from rankwise.repro import agentvocab as av


def test_modes_follow_the_spec() -> None:
    q, f = av.SETTINGS["quick"], av.SETTINGS["full"]
    assert (q.n_train, q.steps, q.structural_budget + q.content_budget, q.n_test, q.seeds) == (1000, 300, 64, 150, (0,))
    assert not q.latency_claim and f.latency_claim
    assert (f.n_train, f.n_test, f.steps, f.structural_budget, f.content_budget, f.structural_only_budget) == \
        (5000, 600, 600, 96, 32, 128)
    assert f.seeds == (0, 1, 2)
    assert (av.MIN_OUT_REDUCTION, av.MIN_LAT_REDUCTION, av.EM_TOLERANCE, av.MIN_STRUCT_SHARE) == (0.30, 0.15, -0.02, 0.70)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="steps"):
        av.AgentVocabSettings(steps=0)
    with pytest.raises(ValueError, match="stage1"):
        av.AgentVocabSettings(stage1="large")


def test_each_mode_reads_the_arms_zoo_build_caches() -> None:
    """The trained arms of every mode are the recipes ``rankwise zoo build`` builds (warm runs never train)."""
    from rankwise.repro.kit import agentvocab_models as kit

    repro = av.AgentVocabReproduction
    for mode in ("smoke", "quick", "full"):
        assert repro._recipe(av.SETTINGS[mode]) == kit.ARM_RECIPES[mode], mode
    built = {(name, seed) for sets in kit.BUILD_SETS.values() for name, seeds in sets for seed in seeds}
    for mode in ("smoke", "quick", "full"):
        assert {(mode, seed) for seed in av.SETTINGS[mode].seeds} <= built, mode
    assert kit.RECIPES["small"].lm == "gqa"  # trained at context 1024: the ~470-token traces fit its positions


@pytest.mark.slow  # ~75 s on the shared 2-core machine (mostly imports and the zoo's smoke LM, built in the temporary cache)
def test_smoke_runs_from_cached_arms_without_training(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path / "cache"))
    from rankwise.infer import agentvocab
    from rankwise.infer.agentvocab import train
    from rankwise.repro.kit import agentvocab_models as kit
    from rankwise.repro.kit import artefacts

    built = artefacts.build_all(only=("agentvocab",), size="smoke")["agentvocab"]
    assert built["smoke-s0-vanilla"]["built_now"] and built["smoke-s0-agentvocab"]["built_now"]
    again = artefacts.build_all(only=("agentvocab",), size="smoke")["agentvocab"]
    assert not again["smoke-s0-vanilla"]["built_now"] and not again["smoke-s0-agentvocab"]["built_now"]

    def no_training(*a, **k):
        raise AssertionError("the reproduction trained although its arms are cached")

    monkeypatch.setattr(train, "sft_train", no_training)
    monkeypatch.setattr(agentvocab, "sft_train", no_training)
    monkeypatch.setattr(kit, "_build_arm", no_training)
    monkeypatch.setattr(kit, "stage1", no_training)  # a warm run neither trains nor mines
    res = av.run("smoke", None, tmp_path / "out")
    wiring = [c for c in res.checks if c.kind == "wiring"]
    assert wiring and all(c.holds for c in wiring), [(c.statement, c.measured) for c in wiring]
