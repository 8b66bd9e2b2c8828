"""The HEAPr reproduction: settings rules and the smoke run's wiring checks (never its verdict)."""

from __future__ import annotations

import pytest

from rankwise.repro import heapr as R


@pytest.mark.parametrize("kw, match", [
    ({"rows": ("heapr", "drop", "magnitude")}, "HEAPrSettings.rows must be among"),
    ({"rows": ("heapr", "energy")}, "must contain \\['drop'\\]"),
    ({"ratios": (0.5,)}, "must contain the claim's ratio 0.25"),
    ({"ratios": (0.25, 1.0)}, "HEAPrSettings.ratios"),
    ({"model": "small"}, "HEAPrSettings.model"),
])
def test_bad_settings(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        R.HEAPrSettings(**kw)


def test_modes_state_the_spec_sizes() -> None:
    full, quick = R.SETTINGS["full"], R.SETTINGS["quick"]
    assert full.model == quick.model == "moe"
    assert full.n_calib == 64 and full.n_eval == 256 and full.ratios == (0.125, 0.25, 0.375)
    assert full.seeds == (0, 1, 2) and set(full.rows) == set(R.ROWS)
    assert quick.n_calib == 16 and quick.ratios == (0.25,) and {"heapr", "drop", "random"} <= set(quick.rows)


def test_smoke_wiring(tmp_path) -> None:
    res = R.run("smoke", None, tmp_path)
    wiring = [c for c in res.checks if c.kind == "wiring"]
    assert len(wiring) == 3 and all(c.holds for c in wiring), [(c.statement, c.measured) for c in wiring]
    claims = [c for c in res.checks if c.kind == "claim"]
    assert any("expert dropping" in c.statement for c in claims)
    rows = res.table.rows
    assert "unpruned" in rows and "HEAPr (global) @ p=0.25" in rows
    # every atom row and expert dropping keep the same parameter count at p = 0.25 (2 of 8 experts)
    assert rows["HEAPr (global) @ p=0.25"]["params kept"] == rows["expert dropping (frequency) @ p=0.25"]["params kept"]
