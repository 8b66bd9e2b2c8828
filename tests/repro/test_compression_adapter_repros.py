"""Issue 14's experiment fixes of the gfwsvd, saes_svd, psoft and cdka reproductions: their settings per mode,
the overridable settings and their errors, and the helpers the new comparisons rest on (no model is loaded)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.repro import cdka, gfwsvd, psoft, saes_svd


def test_quick_modes_run_the_claims_regime() -> None:
    assert gfwsvd.SETTINGS["quick"].targets is None  # all 36 linears, not the 12 FFN ones
    assert gfwsvd.SETTINGS["full"].targets is None
    q = saes_svd.SETTINGS["quick"]
    assert q.n_calib == saes_svd.SETTINGS["full"].n_calib == 256 and q.seeds == (0,)
    lrs = {row: a for row, a, _ in psoft.SETTINGS["quick"].lrs}
    assert lrs["PSOFT (rankwise)"] == lrs["PSOFT (PEFT)"] == 5e-3 and lrs["LoRA (PEFT)"] == 1e-3  # the spec's
    assert psoft.SETTINGS["quick"].seeds == cdka.SETTINGS["quick"].seeds == (0,)


def _points(losses: list[float], cosines: list[float]) -> list[tuple[int, float, list[float]]]:
    return [(5 * i, loss, [c, c - 0.1]) for i, (loss, c) in enumerate(zip(losses, cosines))]


def test_psoft_claim_b_compares_rows_where_they_reach_the_same_loss() -> None:
    fast = _points([1.4, 0.6, 0.3, 0.2], [1.0, 0.9, 0.8, 0.7])   # PSOFT: ends lower
    slow = _points([1.4, 1.0, 0.8, 0.6], [1.0, 0.95, 0.9, 0.85])  # ends at 0.6
    m = psoft._matched(fast, slow)
    assert m["level"] == pytest.approx(0.6) and m["loss0"] == pytest.approx(1.4)
    assert m["step_psoft"] == pytest.approx(5.0) and m["cos_psoft"] == pytest.approx([0.9, 0.8])
    assert m["step_other"] == pytest.approx(15.0) and m["cos_other"] == pytest.approx([0.85, 0.75])
    # between checkpoints the cosines are interpolated linearly in the loss
    step, cos = psoft._at_level(fast, 0.45)
    assert step == pytest.approx(7.5) and cos == pytest.approx([0.85, 0.75])
    # a level the first checkpoint already meets is taken there
    assert psoft._at_level(fast, 2.0) == (0.0, [1.0, 0.9])


def test_psoft_settings_reject_a_match_set_larger_than_the_training_set() -> None:
    with pytest.raises(ValueError, match="PsoftSettings.n_match must be <= n_train"):
        psoft.SETTINGS["quick"].with_overrides({"n_match": "4000"})
    with pytest.raises(ValueError, match="PsoftSettings.match_every must be an int >= 1"):
        psoft.SETTINGS["quick"].with_overrides({"match_every": "0"})


def test_cdka_budget_formula_and_fixed_row_follow_the_settings() -> None:
    S = cdka.SETTINGS["quick"]
    assert cdka.budget_per_matrix(S, 384) == 4 * (384 + 384)
    assert cdka.fixed_components(S, 384, 384) == 4  # (4, 4, 4): 3 072 parameters
    S8 = S.with_overrides({"lora_rank": "8"})
    assert cdka.budget_per_matrix(S8, 384) == 6144 and cdka.fixed_components(S8, 384, 384) == 8
    assert cdka.budget_per_matrix(S, 1536, 384) == 4 * (1536 + 384)
    assert cdka.budget_per_matrix(S.with_overrides({"budget": "3000"}), 384) == 3000  # within 10 % of 3 072
    with pytest.raises(ValueError, match="CdkaSettings.budget 6144 is not within budget_tolerance"):
        cdka.budget_per_matrix(S.with_overrides({"budget": "6144"}), 384)
    with pytest.raises(ValueError, match="CdkaSettings.lora_rank must be an int >= 1"):
        S.with_overrides({"lora_rank": "0"})
    with pytest.raises(ValueError, match="CdkaSettings.targets must name at least one module"):
        S.with_overrides({"targets": ""})


def test_cdka_target_shape_enforces_one_shape_and_the_square_restriction() -> None:
    S = cdka.SETTINGS["quick"]
    base = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8), "up": nn.Linear(8, 16), "up2": nn.Linear(8, 16)})
    assert cdka._target_shape(base, ["a", "b"], S) == (8, 8)
    with pytest.raises(ValueError, match="must select Linears of one shape"):
        cdka._target_shape(base, ["a", "up"], S)
    with pytest.raises(ValueError, match="square_only is true; set square_only=false"):
        cdka._target_shape(base, ["up", "up2"], S)
    assert cdka._target_shape(base, ["up", "up2"], S.with_overrides({"square_only": "false"})) == (16, 8)


def test_cdka_non_square_lokr_candidates_count_what_peft_builds() -> None:
    from peft import LoKrConfig, inject_adapter_in_model

    d_out, d_in, budget = 48, 24, 4 * (48 + 24)
    cands = cdka.lokr_candidates(d_out, budget, 0.25, d_in)
    assert cands
    for f, r, p in cands:
        model = inject_adapter_in_model(LoKrConfig(r=r, alpha=r, decompose_factor=f, target_modules=["0"]),
                                        nn.Sequential(nn.Linear(d_in, d_out)))
        assert sum(q.numel() for q in model.parameters() if q.requires_grad) == p
        # the alignment's (r1, r2) is a valid CDKA shape of the layer
        r1, r2 = cdka.lokr_shapes(d_out, d_in, f)[0][1], cdka.lokr_shapes(d_out, d_in, f)[1][0]
        assert d_out % r1 == 0 and d_in % r2 == 0
        G = torch.randn(d_out, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(f))
        assert 0.0 < cdka.lokr_alignment(G, r1, r2, r) <= 1.0 + 1e-12
