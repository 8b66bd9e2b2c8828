"""The DiffBCP reproduction's settings and kit (the smoke run itself is in test_smoke.py)."""

import pytest

from rankwise.repro import diffbcp as rd
from rankwise.repro.kit import diffusion_priors as kit


def test_modes_are_the_claims_regime_at_smaller_sizes():
    q, f = rd.SETTINGS["quick"], rd.SETTINGS["full"]
    assert q.observed[0] == f.observed[0] == 0.1 and q.sigma == f.sigma == 0.05
    assert q.n_digits <= f.n_digits and q.iters <= f.iters and 0.2 in f.observed
    assert f.burn_in < f.iters and q.burn_in < q.iters
    assert (f.synth_size, f.synth_rank, f.synth_init_rank, f.synth_sweeps) == (20, 3, 16, 300)
    assert q.synth_sweeps == f.synth_sweeps  # the rank-recovery test runs at full size in quick mode too


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="burn_in must be < iters"):
        rd.SETTINGS["quick"].with_overrides({"burn_in": 30})
    with pytest.raises(ValueError, match="recipe"):
        rd.SETTINGS["quick"].with_overrides({"recipe": "big"})


def test_held_out_digits_are_scaled_and_disjoint_from_training():
    tr, te = kit.digits("train"), kit.digits("test")
    assert tuple(te.shape) == (297, 1, 16, 16) and tuple(tr.shape) == (1500, 1, 16, 16)
    assert float(te.min()) >= -1.0 and float(te.max()) <= 1.0
