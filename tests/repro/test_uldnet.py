"""repro/uldnet: the modes follow the spec's plan (quick: seed 0 + 1-3 encrypted images of B; full: 3 seeds,
B and C encrypted), thresholds are the spec's, and smoke runs without TenSEAL work."""

from __future__ import annotations

from rankwise.repro import uldnet as R


def test_modes_follow_the_spec_plan():
    s = R.SETTINGS
    assert s["quick"].seeds == (0,) and 1 <= s["quick"].n_enc_b <= 3 and s["quick"].n_enc_c == 0
    assert s["full"].seeds == (0, 1, 2) and s["full"].n_enc_b == 30 and s["full"].n_enc_c == 10
    assert s["smoke"].he is False and s["smoke"].recipe == "smoke"
    assert all(m.scale == 2.0 for m in s.values())


def test_thresholds_are_the_spec_s():
    assert (R.ACC_MARGIN, R.AGREE_MIN, R.DEPTH_RATIO, R.LATENCY_RATIO) == (0.04, 0.97, 0.75, 0.6)
    assert (R.B_LOSS_MAX, R.D_LOSS_MIN, R.D_OVER_B) == (0.03, 0.04, 2.0)
    assert R.LOGIT_TOL == 1e-2


def test_smoke_reports_encrypted_rows_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_he_available", lambda: False)
    res = R.run("smoke", None, tmp_path)
    assert "skipped" in res.notes
    kinds = {c.statement: c.kind for c in res.checks}
    assert kinds["(3) counted depth B / C"] == "claim"
    assert not any("encrypted" in k for k in kinds)
    assert (tmp_path / "uldnet.png").is_file()
