"""STAR-KV's reproduction: the settings of each mode, bad overrides, and the wiring checks of a smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwise.repro import star_kv


def test_modes_run_the_claims_regime() -> None:
    q, f = star_kv.SETTINGS["quick"], star_kv.SETTINGS["full"]
    assert (q.target_compression, q.steps, q.seeds, q.claim_ratio) == (0.5, 60, (0,), 1.0)  # the spec's quick
    assert (f.target_compression, f.seeds, f.claim_ratio) == (0.6, (0, 1, 2), 0.8)  # the spec's full
    # KD budget and evaluation cut to fit 10 minutes (docs/methods/star_kv.md: the spec's 300 + 20 steps at
    # batch 8 on 200 windows was 20-25 CPU minutes)
    assert (f.steps, f.phase3_steps, f.batch_size, f.n_eval) == (150, 20, 4, 100)
    assert f.model == q.model == "gqa" and f.n_train == 400
    assert set(f.presses) == set(star_kv.PRESSES)


@pytest.mark.parametrize("over,needle", [({"presses": ("nope",)}, "presses"), ({"context_len": 200}, "context_len"),
                                         ({"model": "other"}, "model")])
def test_bad_settings(over: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        star_kv.StarKVReproduction.settings_for("full", over)


def test_rank_measures_skip_rank_zero_heads() -> None:
    rec = {"ranks": [{"compressed": False, "k": [8, 8]}, {"compressed": True, "k": [0, 4, 6]}],
           "accounting": {"cache_removed_k": 0.7, "cache_removed_v": 0.5}}
    assert star_kv.StarKVReproduction._k_ratio(rec) == 1.5
    assert star_kv.StarKVReproduction._v_minus_k(rec) == pytest.approx(0.2)


def test_smoke_wiring_holds(tmp_path: Path) -> None:
    pytest.importorskip("kvpress")
    res = star_kv.run("smoke", None, tmp_path)
    wiring = [c for c in res.checks if c.kind == "wiring"]
    assert len(wiring) == 3 and all(c.holds for c in wiring), [(c.statement, c.measured) for c in wiring]
    rows = set(res.table.rows)
    assert {"STAR-KV", "uniform rank (+KD)", "kvpress Knorm", "kvpress ThinK"} <= rows
