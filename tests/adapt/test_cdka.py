"""CDKA: the spec's correctness checks (shapes, Van Loan rearrangement, alignment, LoRA as a special
case, identity at init, merge, rank bound, parameter count) and its bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.adapt import cdka
from rankwise.core.errors import NumericalError, RankwiseError, SelectionError


def _factors(r: int, d_out: int, d_in: int, r1: int, r2: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(r, d_out // r1, r2, generator=g, dtype=torch.float64),
            torch.randn(r, r1, d_in // r2, generator=g, dtype=torch.float64))


def _snapshot(model: nn.Module) -> dict:
    return {"types": [(n, type(m)) for n, m in model.named_modules()],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad": {n: p.requires_grad for n, p in model.named_parameters()}}


def _assert_unchanged(model: nn.Module, snap: dict) -> None:
    now = _snapshot(model)
    assert now["types"] == snap["types"] and now["grad"] == snap["grad"]
    assert all(torch.equal(now["state"][k], v) for k, v in snap["state"].items())


def _mlp_calib(seed: int = 0):
    return contract._calibration("mlp", seed)


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d_out,d_in,r1,r2,r", [(12, 8, 3, 2, 2), (24, 36, 4, 6, 3), (16, 16, 1, 1, 5),
                                                (10, 15, 10, 15, 1), (18, 12, 2, 12, 4), (6, 9, 6, 1, 2)])
def test_fast_forward_equals_dense_kron(d_out, d_in, r1, r2, r):
    B, A = _factors(r, d_out, d_in, r1, r2)
    B, A = B.float(), A.float()
    dense = sum(torch.kron(B[k], A[k]) for k in range(r))
    torch.testing.assert_close(cdka.kron_delta(B, A), dense, atol=1e-5, rtol=0)
    x = torch.randn(3, 5, d_in, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(cdka.kron_apply(B, A, x), x @ dense.T, atol=1e-5, rtol=1e-5)


def test_rearrangement_of_a_kronecker_product_is_an_outer_product():
    B, A = _factors(1, 12, 20, 3, 4)
    R = cdka.rearrange(torch.kron(B[0], A[0]), 3, 4)
    assert R.shape == (12 // 3 * 4, 3 * 20 // 4)
    torch.testing.assert_close(R, torch.outer(B[0].reshape(-1), A[0].reshape(-1)), atol=1e-12, rtol=0)


def test_alignment_is_a_fraction_non_decreasing_in_r_and_one_at_full_rank():
    G = torch.randn(24, 18, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for r1, r2 in [(1, 1), (2, 3), (4, 2), (24, 1)]:
        curve = cdka.alignment_curve(G, r1, r2)
        assert bool((curve >= 0).all() and (curve <= 1).all())
        assert bool((curve[1:] >= curve[:-1] - 1e-15).all())
        assert curve[-1] == pytest.approx(1.0, abs=1e-12)  # all components reproduce G exactly
        assert cdka.alignment(G, r1, r2, 1) == pytest.approx(float(curve[0]))


def test_rank_of_the_update_is_bounded_by_r_r1_r2():
    d_out, d_in = 48, 36
    for r1, r2, r in [(2, 3, 2), (4, 2, 3), (3, 3, 1), (1, 1, 5)]:
        B, A = _factors(r, d_out, d_in, r1, r2, seed=r1 + 10 * r2)
        rank = int(torch.linalg.matrix_rank(cdka.kron_delta(B, A)))
        bound = min(r * r1 * r2, d_out, d_in)
        assert rank <= bound
        assert rank == bound  # random factors reach the bound


def test_parameter_count_formula_matches_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 36))
    cfg = cdka.CDKAConfig(config_mode="fixed", r1=4, r2=3, r=2, init="zero", target=("0", "2"))
    cdka.adapt(model, cfg)
    expected = cdka.num_parameters(48, 24, 4, 3, 2) + cdka.num_parameters(36, 48, 4, 3, 2)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    assert [row["params"] for row in cdka.report(model)] == [cdka.num_parameters(48, 24, 4, 3, 2),
                                                              cdka.num_parameters(36, 48, 4, 3, 2)]


def test_unit_component_shapes_reproduce_lora_exactly():
    """r1 = r2 = 1: the same factors give the rankwise LoRA layer's and PEFT LoRA's outputs."""
    from peft import LoraConfig, inject_adapter_in_model

    from rankwise.core.lora import LoraLinear

    torch.manual_seed(0)
    base = nn.Linear(20, 12)
    r, alpha = 4, 64.0
    B, A = _factors(r, 12, 20, 1, 1, seed=5)
    B, A = B.float() * 0.1, A.float() * 0.1
    layer = cdka.CDKALinear(base)
    layer.set_components("default", B, A, alpha / math.sqrt(r))
    lora = LoraLinear(base)
    lora.set_factors("default", A[:, 0, :], B[:, :, 0].T, alpha / math.sqrt(r))
    lora.set_active("default")
    peft_model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, use_rslora=True, target_modules=["0"]),
                                         nn.Sequential(nn.Linear(20, 12)))
    with torch.no_grad():
        peft_model[0].base_layer.load_state_dict(base.state_dict())
        peft_model[0].lora_A["default"].weight.copy_(A[:, 0, :])
        peft_model[0].lora_B["default"].weight.copy_(B[:, :, 0].T)
    x = torch.randn(7, 20, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, lora(x), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(y, peft_model(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.delta_weight("default"), lora.delta_weight("default"), atol=1e-6, rtol=0)


def test_official_storage_layout_round_trip():
    B, A = _factors(3, 12, 20, 4, 5)
    Bo, Ao = cdka.to_official_layout(B, A)
    assert Bo.shape == (3, 5 * 3) and Ao.shape == (4 * 3, 4)
    torch.testing.assert_close(Bo[:, 1::3], B[1])  # component i in columns i::r
    torch.testing.assert_close(Ao[2::3], A[2])     # component i in rows i::r
    B2, A2 = cdka.from_official_layout(Bo, Ao, 3)
    assert torch.equal(B2, B) and torch.equal(A2, A)


# ------------------------------------------------------------------------------------------------
# budget-aware design and the gradient initialisation
# ------------------------------------------------------------------------------------------------

def test_candidates_respect_divisibility_rank_bound_and_budget_window():
    cands = cdka.candidates(24, 18, 200, 0.1)
    assert cands
    for r1, r2, r, p in cands:
        assert 24 % r1 == 0 and 18 % r2 == 0
        assert r <= min(24 // r1 * r2, r1 * 18 // r2)
        assert p == cdka.num_parameters(24, 18, r1, r2, r) and 180 <= p <= 220
    brute = {(r1, r2, r) for r1 in cdka.divisors(24) for r2 in cdka.divisors(18)
             for r in range(1, min(24 // r1 * r2, r1 * 18 // r2) + 1)
             if 180 <= cdka.num_parameters(24, 18, r1, r2, r) <= 220}
    assert brute == {(a, b, c) for a, b, c, _ in cands}


def test_aligned_choice_is_the_argmax_and_never_below_lora_at_the_same_budget():
    g = torch.Generator().manual_seed(4)
    # a gradient with Kronecker structure (a 2x3 factor pattern) plus noise: CDKA should find the shape
    G = torch.kron(torch.randn(12, 3, generator=g, dtype=torch.float64),
                   torch.randn(2, 6, generator=g, dtype=torch.float64))
    G = G + 0.01 * torch.randn(G.shape, generator=g, dtype=torch.float64)
    budget = 4 * (24 + 18)
    choice = cdka.choose_configuration(G, budget, 0.1)
    scores = {(r1, r2, r): cdka.alignment(G, r1, r2, r) for r1, r2, r, _ in cdka.candidates(24, 18, budget, 0.1)}
    assert choice.align == pytest.approx(max(scores.values()), abs=1e-12)
    assert choice.align >= cdka.alignment(G, 1, 1, 4) - 1e-12  # the same-budget LoRA is a candidate
    assert choice.align > 0.99 > cdka.alignment(G, 1, 1, 4) + 0.01  # rank(G) = 6 > 4: LoRA cannot


def test_ties_go_to_more_components():
    G = torch.zeros(8, 8, dtype=torch.float64)
    G[0, 0] = 1.0  # rank one: every candidate with r >= 1 reaches alignment 1
    choice = cdka.choose_configuration(G, 64, 0.1)
    assert choice.align == pytest.approx(1.0)
    top_r = max(r for a, b, r, _ in cdka.candidates(8, 8, 64, 0.1))
    assert choice.r == top_r


def test_gradient_init_is_the_scaled_top_r_approximation_of_minus_g():
    G = torch.randn(12, 20, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    r1, r2, r, c = 3, 4, 3, 0.25
    B, A = cdka.gradient_init(G, r1, r2, r, c)
    U, S, Vh = torch.linalg.svd(cdka.rearrange(-G, r1, r2), full_matrices=False)
    expected = c * c * (U[:, :r] * (S[:r] / S[0])) @ Vh[:r]
    torch.testing.assert_close(cdka.rearrange(cdka.kron_delta(B, A), r1, r2), expected, atol=1e-12, rtol=0)
    assert float((cdka.kron_delta(B, A) * -G).sum()) > 0  # points downhill


def test_output_at_step_zero_equals_the_pretrained_output_with_gradient_init():
    model = contract.tiny_model("bert")
    y0 = contract.forward(model, "bert")
    calib, loss_fn = contract._calibration("bert", 0)
    cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2"), target=("query", "key", "value", "attention.output.dense"),
               calib=calib, loss_fn=loss_fn)
    assert all(layer.cdka["default"].has_offset for _, layer in cdka.cdka_layers(model))
    assert any(float(layer.cdka["default"].B.detach().abs().sum()) > 0 for _, layer in cdka.cdka_layers(model))
    torch.testing.assert_close(contract.forward(model, "bert"), y0, atol=1e-5, rtol=0)
    # the adapter is live: its factors receive gradients and one step changes the outputs
    calib2, _ = contract._calibration("bert", 1)
    loss_fn(model, calib2[0]).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)


def test_merged_model_equals_unmerged_after_training_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    calib, loss_fn = _mlp_calib()
    cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2", alpha=8.0), target=nn.Linear, calib=calib, loss_fn=loss_fn)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for b in calib * 5:
        loss = loss_fn(model, b)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0]
    x = torch.randn(5, 16)
    with torch.no_grad():
        y = model(x)
        cdka.merge(model)
        torch.testing.assert_close(model(x), y, atol=1e-5, rtol=1e-5)
        cdka.unmerge(model)
        torch.testing.assert_close(model(x), y, atol=1e-5, rtol=1e-5)
        plain = cdka.unload(model)
    assert not cdka.cdka_layers(plain) and isinstance(plain[0], nn.Linear)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), y, atol=1e-5, rtol=1e-5)


def test_collect_gradients_restores_flags_modes_and_grads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 8)).train()
    model[2].weight.requires_grad_(False)
    calib, loss_fn = _mlp_calib()
    layers = [("0", model[0]), ("2", model[2])]
    G = cdka.collect_gradients(model, layers, calib, loss_fn, max_batches=1)
    assert set(G) == {"0", "2"} and G["0"].dtype == torch.float64 and G["0"].shape == (32, 16)
    assert model.training and model[1].training
    assert model[0].weight.requires_grad and not model[2].weight.requires_grad
    assert model[0].weight.grad is None
    # eval mode inside: two calls give identical gradients despite the dropout layer
    G2 = cdka.collect_gradients(model, layers, calib, loss_fn, max_batches=1)
    assert torch.equal(G["0"], G2["0"])
    # the same as autograd on batch 0 alone
    model.eval()
    model[2].weight.requires_grad_(True)
    loss_fn(model, calib[0]).backward()
    torch.testing.assert_close(G["2"], model[2].weight.grad.double(), atol=1e-6, rtol=1e-6)


def test_report_lists_choice_per_layer():
    model = contract.tiny_model("mlp")
    calib, loss_fn = _mlp_calib()
    cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear, calib=calib, loss_fn=loss_fn)
    rows = cdka.report(model)
    assert [r["layer"] for r in rows] == ["0", "2", "4"]
    base = contract.tiny_model("mlp")
    G = cdka.collect_gradients(base, [(n, base.get_submodule(n)) for n in ("0", "2", "4")], calib, loss_fn)
    for row in rows:
        budget = 2 * (row["d_in"] + row["d_out"])
        assert row["budget"] == budget and abs(row["params"] - budget) <= 0.1 * budget
        assert 0.0 <= row["align"] <= 1.0
        assert row["align"] == pytest.approx(cdka.alignment(G[row["layer"]], row["r1"], row["r2"], row["r"]))
        assert row["align"] >= cdka.alignment(G[row["layer"]], 1, 1, 2) - 1e-12


def test_precomputed_gradients_give_the_same_adapter_as_calibration():
    calib, loss_fn = _mlp_calib()
    a = cdka.adapt(contract.tiny_model("mlp"), cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear,
                   calib=calib, loss_fn=loss_fn)
    base = contract.tiny_model("mlp")
    G = cdka.collect_gradients(base, [(n, m) for n, m in base.named_modules() if isinstance(m, nn.Linear)],
                               calib, loss_fn)
    b = cdka.adapt(base, cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear, gradients=G)
    for (_, la), (_, lb) in zip(cdka.cdka_layers(a), cdka.cdka_layers(b)):
        assert la.shape_of("default") == lb.shape_of("default")
        assert torch.equal(la.cdka["default"].B, lb.cdka["default"].B)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(config_mode="sideways"), "config_mode"),
    (dict(config_mode="fixed", r1=2), "positive ints r1, r2, r"),
    (dict(r1=2, r2=2, r=2), "only used with config_mode='fixed'"),
    (dict(budget="lora_8"), "lora_r<k>"),
    (dict(budget=0), "budget"),
    (dict(budget_tolerance=1.0), "budget_tolerance"),
    (dict(init="orthogonal"), "init"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(dropout=1.0), "dropout"),
    (dict(calib_batches=0), "calib_batches"),
    (dict(target=()), "target"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cdka.CDKAConfig(**kwargs)


def test_r1_not_dividing_d_out_names_layer_and_divisors_and_keeps_model():
    model = contract.tiny_model("mlp")
    snap = _snapshot(model)
    msg = r"r1=5 does not divide d_out=32 for layer '0'.*valid r1: \[1, 2, 4, 8, 16, 32\]"
    with pytest.raises(ValueError, match=msg):
        cdka.adapt(model, cdka.CDKAConfig(config_mode="fixed", r1=5, r2=1, r=1, init="zero"), target=nn.Linear)
    _assert_unchanged(model, snap)
    with pytest.raises(ValueError, match=r"r2=3 does not divide d_in=16"):
        cdka.adapt(model, cdka.CDKAConfig(config_mode="fixed", r1=1, r2=3, r=1, init="zero"), target=nn.Linear)
    _assert_unchanged(model, snap)


def test_budget_below_the_cheapest_configuration_reports_the_minimum():
    model = contract.tiny_model("mlp")
    snap = _snapshot(model)
    cheapest = min(cdka.num_parameters(32, 16, a, b, 1) for a in cdka.divisors(32) for b in cdka.divisors(16))
    calib, loss_fn = _mlp_calib()
    msg = rf"smaller than the cheapest configuration.*minimum feasible budget is {cheapest}"
    with pytest.raises(ValueError, match=msg):
        cdka.adapt(model, cdka.CDKAConfig(budget=3), target="0", calib=calib, loss_fn=loss_fn)
    _assert_unchanged(model, snap)


def test_no_matching_target_lists_linear_layers():
    model = contract.tiny_model("bert")
    with pytest.raises(SelectionError, match="Available Linear layers: .*query") as e:
        cdka.adapt(model, cdka.CDKAConfig(init="zero", config_mode="fixed", r1=1, r2=1, r=1), target="nope")
    assert isinstance(e.value, ValueError)


def test_empty_calibration_zero_and_nan_gradients_are_rejected():
    model = contract.tiny_model("mlp")
    snap = _snapshot(model)
    _, loss_fn = _mlp_calib()
    with pytest.raises(ValueError, match="no batch"):
        cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear, calib=[], loss_fn=loss_fn)
    with pytest.raises(ValueError, match="calibration batches"):
        cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear)
    with pytest.raises(ValueError, match="exactly zero"):
        cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear, calib=[torch.zeros(2, 16)],
                   loss_fn=lambda m, b: m(b).sum() * 0.0)
    with pytest.raises(NumericalError, match="calibration loss is nan"):
        cdka.adapt(model, cdka.CDKAConfig(budget="lora_r2"), target=nn.Linear, calib=[torch.zeros(2, 16)],
                   loss_fn=lambda m, b: m(b).sum() * float("nan"))
    with pytest.raises(NumericalError, match="NaN or inf"):
        cdka.alignment(torch.full((4, 4), float("nan")), 1, 1, 1)
    _assert_unchanged(model, snap)


def test_non_linear_targets_are_not_implemented():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Conv1d(8, 8, 1), nn.Linear(8, 8))
    for target in (nn.Embedding, nn.Conv1d, "1"):
        with pytest.raises(NotImplementedError, match="nn.Linear layers only"):
            cdka.adapt(model, cdka.CDKAConfig(config_mode="fixed", r1=1, r2=1, r=1, init="zero"), target=target)
    assert isinstance(model[2], nn.Linear)


def test_duplicate_name_merged_state_and_unknown_adapter_errors():
    model = contract.tiny_model("mlp")
    cfg = cdka.CDKAConfig(config_mode="fixed", r1=2, r2=2, r=1, init="zero")
    cdka.adapt(model, cfg, target=nn.Linear)
    with pytest.raises(ValueError, match="already has an adapter named 'default'"):
        cdka.adapt(model, cfg, target=nn.Linear)
    cdka.merge(model)
    with pytest.raises(RankwiseError, match="merged"):
        cdka.adapt(model, cfg, target=nn.Linear, name="other")
    with pytest.raises(RankwiseError, match="unmerge before disabling"):
        cdka.disable_adapters(model)
    cdka.unmerge(model)
    with pytest.raises(RankwiseError, match="no CDKA adapter is merged"):
        cdka.unmerge(model)
    with pytest.raises(KeyError, match="no CDKA adapter named"):
        cdka.set_active(model, "missing")
    cdka.delete_adapter(model, "default")
    assert not cdka.cdka_layers(model)
    with pytest.raises(TypeError, match="CDKAConfig"):
        cdka.adapt(model, object())  # type: ignore[arg-type]


def test_load_rejects_another_kind_of_artefact(tmp_path):
    from rankwise.adapt import lora
    from rankwise.core.errors import ArtifactError

    model = lora.adapt(contract.tiny_model("mlp"), lora.LoraConfig(rank=2), target=nn.Linear)
    lora.save_adapter(model, tmp_path / "lora")
    other = contract.tiny_model("mlp")
    with pytest.raises(ArtifactError, match="not a rankwise CDKA adapter"):
        cdka.load_adapter(other, tmp_path / "lora")
    with pytest.raises(ArtifactError, match="no such adapter directory"):
        cdka.load_adapter(other, tmp_path / "missing")


def test_registered():
    from rankwise.core.registry import get

    entry = get("cdka")
    assert entry.config is cdka.CDKAConfig and entry.entry is cdka.adapt


# ------------------------------------------------------------------------------------------------
# the reproduction's baselines at equal budget
# ------------------------------------------------------------------------------------------------

def test_lokr_budget_candidates_count_what_peft_builds():
    from peft import LoKrConfig, inject_adapter_in_model

    from rankwise.repro.cdka import lokr_candidates

    d, budget = 48, 4 * 96
    cands = lokr_candidates(d, budget, 0.25)
    assert cands
    for f, r, p in cands:
        model = inject_adapter_in_model(LoKrConfig(r=r, alpha=r, decompose_factor=f, target_modules=["0"]),
                                        nn.Sequential(nn.Linear(d, d)))
        assert sum(q.numel() for q in model.parameters() if q.requires_grad) == p
        assert abs(p - budget) <= 0.25 * budget


def test_lokr_alignment_is_bounded_by_the_unconstrained_kronecker_energy():
    from rankwise.repro.cdka import lokr_alignment

    G = torch.randn(24, 24, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    r1, r2 = 6, 4  # W1 (4, 4), W2 (6, 6)
    full = cdka.alignment(G, r1, r2, 1)
    assert lokr_alignment(G, r1, r2, None) == pytest.approx(full, rel=1e-12)
    values = [lokr_alignment(G, r1, r2, k) for k in (1, 2, 3, 6)]
    assert all(v <= full + 1e-12 for v in values)
    assert all(b >= a - 1e-9 for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(full, rel=1e-9)
    # an exactly representable gradient is captured completely
    W1 = torch.randn(4, 4, dtype=torch.float64)
    W2 = torch.outer(torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64))
    assert lokr_alignment(torch.kron(W1, W2), r1, r2, 1) == pytest.approx(1.0, abs=1e-9)


def test_negation_task_is_balanced_disjoint_and_labelled_by_the_rule():
    from rankwise.repro.kit.negation import FOODS, NEGATIVE, negation_task

    train, test = negation_task(3, 200, 100)
    assert len(train) == 200 and len(test) == 100
    assert not {t for t, _ in train} & {t for t, _ in test}
    assert [sum(y == k for _, y in train) for k in range(4)] == [50] * 4
    for text, y in train[:50]:
        topic = int(any(text.startswith(s + " ") for s in FOODS))
        negated = " was not " in text
        negative = any(f" {a} " in f" {text} " for a in NEGATIVE)
        assert y == 2 * topic + (int(not negative) ^ int(negated))
    assert negation_task(3, 200, 100) == (train, test)
