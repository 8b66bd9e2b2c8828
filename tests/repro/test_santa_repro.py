"""The SANTA reproduction: modes sized as the spec says, cross-field rules, and the smoke run's content.

The harness-level smoke run (every reproduction) is ``tests/repro/test_smoke.py``; here the claim checks,
wiring checks and table rows of the smoke run (operator test + the model test on ``gqa-smoke``) are named.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from rankwise.repro import santa as rs


def test_modes_are_sized_as_the_spec_says() -> None:
    q, f = rs.SETTINGS["quick"], rs.SETTINGS["full"]
    assert q.sizes == (512,) and q.samples == (64,) and q.repeats == 500 and q.seeds == (0, 1) and q.model is None and q.instances == 4
    assert f.sizes == (512, 4096) and f.samples == (16, 64, 256) and f.repeats == 2000 and f.claim_n == 4096 and f.instances == 4
    assert f.seeds == (0, 1, 2, 3, 4) and f.model == "gqa" and f.model_samples == 64 and f.window == 1024
    assert f.model_seeds == 5 and f.tail == 256 and f.n_prompts == 20 and f.new_tokens == 64
    assert rs.SETTINGS["smoke"].model == "gqa-smoke"
    assert (rs.SYS_RATIO, rs.STRAT_RATIO, rs.BIAS_SIGMAS, rs.PPL_FACTOR) == (0.8, 0.85, 4.0, 1.05)


@pytest.mark.parametrize("change, match", [
    ({"claim_n": 100}, "claim_n must be one of sizes"),
    ({"samples": (16,)}, "must contain 64"),
    ({"tail": 1024}, "tail must be < window"),
])
def test_cross_field_rules(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(rs.SETTINGS["quick"], **change)


def test_smoke_run_checks_every_claim(tmp_path) -> None:
    from rankwise.repro.harness import reproduce

    reproduce("santa", mode="smoke", out_dir=tmp_path, use_cache=False)
    data = json.loads((tmp_path / "result.json").read_text())
    kinds = [(c["kind"], c["statement"]) for c in data["checks"]]
    assert sum(k == "claim" and "bias" in s for k, s in kinds) == 3
    assert sum(k == "claim" and "MSE(" in s for k, s in kinds) == 2
    assert sum(k == "claim" and "NLL" in s for k, s in kinds) == 1
    assert sum(k == "wiring" for k, _ in kinds) == 2
    for c in data["checks"]:
        if c["kind"] == "wiring":
            assert c["holds"], c
    rows = data["table"]["rows"]
    assert {"model: dense SDPA", "model: S²ANTA (systematic)", "model: top-k"} <= set(rows)
    assert any(r.startswith("top-k n128") for r in rows)
    assert data["figures"] == ["santa_mse.png"]
