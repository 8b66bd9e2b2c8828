"""repro/condiquant and its kit: the modes follow the spec's plan, thresholds are the spec's, the SR net and
data have the spec's shapes and splits, and smoke runs end to end with every wiring check passing."""

from __future__ import annotations

import torch

from rankwise.repro import condiquant as R
from rankwise.repro.kit import artefacts
from rankwise.repro.kit import condiquant_sr as sr


def test_modes_follow_the_spec_plan():
    s = R.SETTINGS
    assert s["quick"].recipe == "quick" and s["quick"].bits == (3,) and s["quick"].seeds == (0,)
    assert s["quick"].observers == ("minmax",) and "spread" in s["quick"].proxes
    assert s["full"].recipe == "full" and s["full"].bits == (4, 3, 2) and s["full"].seeds == (0, 1, 2)
    assert set(s["full"].observers) == {"minmax", "percentile"} and set(s["full"].proxes) == {"spread", "shave"}
    assert all(m.n_calib == 64 and m.max_rel_output_err == 2e-3 and not m.spec_grid for k, m in s.items() if k != "smoke")
    assert sr.RECIPES["quick"].hr == 16 and sr.RECIPES["quick"].blocks == 2 and sr.RECIPES["quick"].steps == 300
    f = sr.RECIPES["full"]
    assert (f.hr, f.n_images, f.channels, f.blocks, f.steps, f.batch, f.lr) == (32, 3000, 48, 3, 1500, 32, 2e-3)


def test_thresholds_are_the_spec_s():
    assert R.GAIN == {3: 0.2, 2: 0.4} and R.FP_TOL == 0.1 and R.STUDY_BITS == 3


def test_builder_is_registered_and_smoke_is_never_cached():
    assert artefacts.BUILDERS["condiquant"] == "rankwise.repro.kit.condiquant_sr:build"
    assert sr.RECIPES["smoke"].seeds == ()


def test_net_and_data_shapes():
    net = sr.SRNet(8, 2)
    x = torch.rand(3, 1, 8, 8)
    assert net(x).shape == (3, 1, 16, 16)
    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)]
    assert names == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    d = sr.data(sr.SRRecipe(hr=16, n_images=40), cache=False)
    assert (len(d.hr_train), len(d.hr_calib), len(d.hr_test)) == (32, 4, 4)
    assert d.lr_test.shape == (4, 1, 8, 8) and float(d.hr_train.min()) >= 0 and float(d.hr_train.max()) <= 1
    assert float(sr.psnr(d.hr_test, d.hr_test).min()) > 100
    assert torch.equal(sr.synthetic_images(3, 16, 1), sr.synthetic_images(3, 16, 1))


def test_smoke_runs_with_wiring_checks_passing(tmp_path):
    res = R.run("smoke", None, tmp_path)
    kinds = {c.statement: c for c in res.checks}
    assert kinds["CondiQuant(spread) + MinMax - MinMax at W3A3 (dB)"].kind == "claim"
    for c in res.checks:
        if c.kind == "wiring":
            assert c.holds, c.statement
    assert (tmp_path / "condiquant.png").is_file()
    assert "MinMax W3A3" in res.table.rows and "FP conditioned (spread)" in res.table.rows
