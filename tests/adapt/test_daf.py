"""DAF: the spec's correctness checks and bad inputs (the adapter contract is in test_adapter_contract.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rankwise.adapt import daf
from rankwise.core.errors import ArtifactError, RankwiseError, SelectionError
from rankwise.train.finetune import Batch, FinetuneConfig, Trainer, lockstep

RANK = 2
CANDIDATES = ["0", "2", "4", "6"]
COSTS = {"0": RANK * (8 + 16), "2": RANK * 32, "4": RANK * 32, "6": RANK * (16 + 4)}  # 48, 64, 64, 40


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)).eval()


def data(n: int = 4, seed: int = 0, bs: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 8, generator=g), torch.randint(0, 4, (bs,), generator=g)) for _ in range(n)]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def config(**kw) -> daf.DAFConfig:
    base = dict(rank=RANK, alpha=4.0, budget_params=112, calib_batches=2, analysis_every=2,
                analysis_train_mode=False)
    base.update(kw)
    return daf.DAFConfig(**base)


def adapted(seed: int = 0, **kw) -> nn.Module:
    return daf.adapt(mlp(seed), config(**kw), target=nn.Linear, calib=data(), loss_fn=loss_fn)


def roles(model: nn.Module, name: str = "default") -> dict[str, str]:
    return {r["layer"]: r["role"] for r in daf.report(model, name)}


@torch.no_grad()
def perturb(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(99))


# ------------------------------------------------------------------------------------------------
# the pure math
# ------------------------------------------------------------------------------------------------

def test_unit_cost_and_budget_resolution():
    assert daf.unit_cost(8, 16, 2) == 48
    costs = dict(COSTS)
    assert daf.resolve_budget(config(budget_params=100), costs) == 100
    assert daf.resolve_budget(config(budget_params=None, budget_fraction=0.5), costs) == int(0.5 * sum(costs.values()))


def test_allocate_greedy_by_score_per_cost_within_budget():
    scores = {"a": 10.0, "b": 9.0, "c": 1.0, "d": 0.5}
    costs = {"a": 100, "b": 30, "c": 10, "d": 10}
    # score per cost: b 0.3, a 0.1, c 0.1, d 0.05 -> b (30), a (130 > 120: skip), c (40), d (50)
    assert daf.allocate(scores, costs, 120) == ["b", "c", "d"]
    assert daf.allocate(scores, costs, 120, fill="stop") == ["b"]
    assert daf.allocate(scores, costs, 140, rank_by="score", fill="stop") == ["a", "b", "c"]
    for budget in (10, 35, 77, 150):
        sel = daf.allocate(scores, costs, budget)
        assert sum(costs[s] for s in sel) <= budget


def test_allocate_rejects_negative_or_nan_scores():
    with pytest.raises(RankwiseError, match="finite"):
        daf.allocate({"a": float("nan")}, {"a": 1}, 5)
    with pytest.raises(ValueError, match="same matrices"):
        daf.allocate({"a": 1.0}, {"b": 1}, 5)


def test_change_fraction_counts_mask_entries_over_candidates():
    assert daf.change_fraction(["a", "b"], ["a", "c"], ["a", "b", "c", "d"]) == 0.5
    assert daf.change_fraction(["a"], ["a"], ["a", "b"]) == 0.0


def test_smooth_is_ema_and_first_round_raw():
    assert daf.smooth(None, {"a": 2.0}) == {"a": 2.0}
    out = daf.smooth({"a": 1.0, "b": 4.0}, {"a": 3.0, "b": 0.0}, 0.7)
    assert out["a"] == pytest.approx(0.7 * 1.0 + 0.3 * 3.0) and out["b"] == pytest.approx(2.8)


# ------------------------------------------------------------------------------------------------
# sensitivity (spec step 1)
# ------------------------------------------------------------------------------------------------

def test_taylor_sensitivity_matches_manual_sum_of_abs_g_theta():
    model = mlp()
    batches = data(3)
    layers = [(n, model.get_submodule(n)) for n in CANDIDATES]
    got = daf.taylor_sensitivity(model, batches, loss_fn, layers=layers, train_mode=False)
    ref = {n: 0.0 for n in CANDIDATES}
    for b in batches:
        model.zero_grad()
        loss_fn(model, b).backward()
        for n in CANDIDATES:
            w = model.get_submodule(n).weight
            ref[n] += float((w.grad.double() * w.detach().double()).abs().sum())
    model.zero_grad(set_to_none=True)
    for n in CANDIDATES:
        assert got[n] == pytest.approx(ref[n], rel=1e-6)


def test_sensitivity_pass_restores_flags_and_leaves_no_grad_on_peft_params():
    model = adapted()
    head_like = model[6] if not isinstance(model[6], daf.DAFLinear) else model[6].base_layer
    head_like.bias.requires_grad_(True)  # a trainable non-adapter parameter
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    model.train()
    modes = {n: m.training for n, m in model.named_modules()}
    ctl = daf.DAFController(model, data(), loss_fn, total_steps=10)
    ctl.update(2)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters()), "the analysis must leave no .grad anywhere"
    assert any(p.requires_grad for n, p in model.named_parameters() if ".daf." in n)


def test_round0_measures_the_base_model_other_adapters_off():
    model = adapted()
    perturb(model)
    ref = mlp()
    base_scores = daf.taylor_sensitivity(ref, data()[:2], loss_fn,
                                         layers=[(n, ref.get_submodule(n)) for n in CANDIDATES], train_mode=False)
    daf.adapt(model, config(), target=nn.Linear, name="second", calib=data(), loss_fn=loss_fn)
    got = {r["layer"]: r["score"] for r in daf.report(model, "second")}
    for n in CANDIDATES:
        assert got[n] == pytest.approx(base_scores[n], rel=1e-9)


# ------------------------------------------------------------------------------------------------
# rebuild-and-refocus (spec step 5) and the controller
# ------------------------------------------------------------------------------------------------

def _force_change(model: nn.Module, name: str = "default") -> list[str]:
    """Make the previous smoothed scores favour the currently unselected matrices."""
    chosen = []
    for lname, layer in daf.daf_layers(model):
        if layer.role[name] == "training":
            layer.score[name] = 0.0
        else:
            layer.score[name] = 1e12
            chosen.append(lname)
    return chosen


def test_rebuild_does_not_change_outputs_and_budget_holds():
    model = adapted()
    perturb(model)
    y0 = model(X)
    before = roles(model)
    _force_change(model)
    ctl = daf.DAFController(model, data(), loss_fn, total_steps=10)
    rnd = ctl.update(2)
    assert rnd.applied and rnd.added and rnd.frozen
    after = roles(model)
    assert after != before
    assert all(after[n] == "frozen" for n in rnd.frozen)
    torch.testing.assert_close(model(X), y0, atol=1e-6, rtol=0)
    assert daf.active_parameter_count(model) <= ctl.budget == 112
    # frozen units receive no gradient; fresh ones start at B = 0
    model(X).square().mean().backward()
    for lname, layer in daf.daf_layers(model):
        u = layer.daf["default"] if "default" in layer.daf else None
        if lname in rnd.frozen:
            assert u.A.grad is None and u.B.grad is None and not u.A.requires_grad
        if lname in rnd.added:
            assert u.B.requires_grad and u.B.grad is not None


def test_change_below_threshold_keeps_configuration():
    model = adapted()
    perturb(model)
    before = roles(model)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    ctl = daf.DAFController(model, data(), loss_fn, config=config(change_thresholds=(1.0, 1.0)), total_steps=10)
    rnd = ctl.update(2)
    assert not rnd.applied and roles(model) == before
    assert all(torch.equal(model.state_dict()[k], v) for k, v in snapshot.items())


def test_ema_second_round_scores():
    model = adapted()
    old = {r["layer"]: r["score"] for r in daf.report(model)}
    perturb(model)
    ctl = daf.DAFController(model, data(), loss_fn, total_steps=10)
    rnd = ctl.update(2)
    layers = [(n, model.get_submodule(n)) for n in CANDIDATES]
    raw = daf.taylor_sensitivity(model, data()[:2], loss_fn, layers=layers, seed=0, train_mode=False)
    for n in CANDIDATES:
        assert rnd.raw_scores[n] == pytest.approx(raw[n], rel=1e-12)
        assert rnd.scores[n] == pytest.approx(0.7 * old[n] + 0.3 * raw[n], rel=1e-12)
        assert daf.report(model)[CANDIDATES.index(n)]["score"] == rnd.scores[n]


def test_reselected_frozen_unit_trains_again():
    model = adapted()
    perturb(model)
    first = [n for n, r in roles(model).items() if r == "training"]
    daf.apply_allocation(model, "default", [n for n in CANDIDATES if n not in first][:1], torch.Generator())
    frozen_before = model.get_submodule(first[0]).daf["default"].A.detach().clone()
    diff = daf.apply_allocation(model, "default", [first[0]], torch.Generator())
    assert diff["reactivated"] == [first[0]]
    unit = model.get_submodule(first[0]).daf["default"]
    assert unit.A.requires_grad and torch.equal(unit.A.detach(), frozen_before)


def test_refocus_optimizer_keeps_survivor_moments_and_drops_removed():
    a, b, c, head = (nn.Parameter(torch.randn(3)) for _ in range(4))
    opt = torch.optim.AdamW([{"params": [a, b], "lr": 1e-2}, {"params": [head], "lr": 1e-3}])
    for p in (a, b, head):
        p.grad = torch.ones(3)
    opt.step()
    moments = opt.state[a]["exp_avg"].clone()
    daf.refocus_optimizer(opt, removed=[b], added=[c], keep=[a])
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(a), id(c)]
    assert b not in opt.state and torch.equal(opt.state[a]["exp_avg"], moments)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_shared_loop_with_controller_callback_and_budget_trace():
    model = adapted(budget_params=112)
    for p in model.get_submodule("6").base_layer.parameters():
        p.requires_grad_(True)  # a task head outside the budget
    batches = [Batch({"x": x}, y) for x, y in data(6, seed=3)]

    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    wrapped = Wrap(model)
    trainer = Trainer(wrapped, FinetuneConfig(lr=1e-2, steps=6, batch_size=8), 6)
    ctl = daf.DAFController(wrapped, [(b.inputs["x"], b.labels) for b in batches],
                            lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), total_steps=6,
                            config=config(change_thresholds=(0.0, 0.0)))
    cb = ctl.callback(trainer)
    trace = []

    def callback(i, losses):
        cb(i, losses)
        trace.append(daf.active_parameter_count(wrapped))
    _force_change(model)
    lockstep({"daf": trainer}, batches, callback)
    assert [r.step for r in ctl.history] == [2, 4]
    assert max(trace) <= 112 and all(math.isfinite(v) for v in trainer.losses)
    trainable = {id(p) for p in wrapped.parameters() if p.requires_grad}
    assert {id(p) for p in trainer.params} == trainable
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == trainable


def _train_plain(model, steps, controller=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step, batch in enumerate(data(steps, seed=5)):
        if controller is not None:
            controller.maybe_update(step, opt)
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_analysis_only_at_step0_equals_static_bit_for_bit():
    static, dynamic = adapted(), adapted()
    _train_plain(static, 6)
    ctl = daf.DAFController(dynamic, data(), loss_fn, config=config(analysis_every=1000), total_steps=6)
    _train_plain(dynamic, 6, ctl)
    assert not ctl.history
    a, b = static.state_dict(), dynamic.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_daf_trainer_fit_history_and_factory():
    model = mlp()
    trainer = daf.DAFTrainer(model, config(analysis_every=3, change_thresholds=(0.0, 0.0)), data(4), loss_fn,
                             make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), target=nn.Linear)
    trainer.fit(7)
    assert [r.step for r in trainer.history] == [3, 6] and len(trainer.losses) == 7
    assert all(r.active_params <= 112 for r in trainer.history)
    assert max(trainer.budget_trace) <= 112
    with pytest.raises(TypeError, match="make_optimizer"):
        daf.DAFTrainer(mlp(), config(), data(), loss_fn, make_optimizer=None)


def test_save_load_keeps_roles_scores_and_frozen_units(tmp_path):
    model = adapted()
    perturb(model)
    _force_change(model)
    daf.DAFController(model, data(), loss_fn, total_steps=10).update(2)
    daf.save_adapter(model, tmp_path / "a")
    other = mlp()
    daf.load_adapter(other, tmp_path / "a")
    assert roles(other) == roles(model)
    assert [r["score"] for r in daf.report(other)] == [r["score"] for r in daf.report(model)]
    assert torch.equal(other(X), model(X))
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert {n: p.requires_grad for n, p in other.named_parameters()} == flags


# ------------------------------------------------------------------------------------------------
# bad input and edge cases
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(rank=0), dict(alpha=-1.0), dict(budget_params=0),
                                dict(budget_fraction=0.0), dict(budget_fraction=1.5), dict(calib_batches=0),
                                dict(analysis_every=0), dict(analysis_every=1.5), dict(ema=1.0),
                                dict(change_thresholds=(0.1,)), dict(rank_by="x"), dict(fill="x"),
                                dict(dropout=1.0), dict(seed=-1), dict(target=())])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError, match="DAFConfig"):
        daf.DAFConfig(**kw)


def test_budget_below_one_unit_names_cheapest_cost():
    model = mlp()
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="costs 40 parameters"):
        daf.adapt(model, config(budget_params=39), target=nn.Linear, calib=data(), loss_fn=loss_fn)
    assert list(model.state_dict()) == list(snap) and not daf.daf_layers(model)


def test_analysis_batches_larger_than_loader_warns_and_zero_batches_errors():
    with pytest.warns(UserWarning, match="only 2 batch"):
        daf.adapt(mlp(), config(calib_batches=5), target=nn.Linear, calib=data(2), loss_fn=loss_fn)
    model = mlp()
    with pytest.raises(ValueError, match="empty"):
        daf.adapt(model, config(), target=nn.Linear, calib=[], loss_fn=loss_fn)
    assert not daf.daf_layers(model)
    with pytest.raises(ValueError, match="batches"):
        daf.adapt(model, config(), target=nn.Linear)
    with pytest.raises(ValueError, match="empty"):
        daf.DAFController(adapted(), [], loss_fn)


def test_non_finite_loss_skips_round_and_keeps_configuration():
    model = adapted()
    perturb(model)
    before = roles(model)
    scores = [r["score"] for r in daf.report(model)]
    bad = [(torch.full((8, 8), float("nan")), torch.zeros(8, dtype=torch.long))]
    ctl = daf.DAFController(model, bad, loss_fn, total_steps=10)
    with pytest.warns(UserWarning, match="skipping this round"):
        rnd = ctl.update(2)
    assert rnd.skipped and not rnd.applied and roles(model) == before
    assert [r["score"] for r in daf.report(model)] == scores
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_without_param_groups_requires_factory():
    model = adapted()
    _force_change(model)

    class NotTorch:
        def step(self):
            pass

    ctl = daf.DAFController(model, data(), loss_fn, total_steps=10)
    snap = roles(model)
    with pytest.raises(RankwiseError, match="make_optimizer"):
        ctl.update(2, NotTorch())
    assert roles(model) == snap and not ctl.history  # refused before anything changed
    model2 = adapted()
    _force_change(model2)
    made = []
    ctl2 = daf.DAFController(model2, data(), loss_fn, total_steps=10,
                             make_optimizer=lambda ps: made.append(ps) or torch.optim.SGD(ps, lr=0.1))
    rnd = ctl2.update(2, NotTorch())
    assert rnd.applied and isinstance(ctl2.optimizer, torch.optim.SGD)
    assert {id(p) for p in made[0]} == {id(p) for p in model2.parameters() if p.requires_grad}


def test_selection_and_target_errors_leave_model_unchanged():
    model = mlp()
    with pytest.raises(SelectionError):
        daf.adapt(model, config(), target="nothing_here", calib=data(), loss_fn=loss_fn)
    with pytest.raises(SelectionError):
        daf.adapt(model, config(), target=nn.Linear, selection=["9"])
    with pytest.raises(ValueError, match="above the budget"):
        daf.adapt(model, config(), target=nn.Linear, selection=CANDIDATES)
    with pytest.raises(ValueError, match="rank=5"):
        daf.adapt(model, config(rank=5), target=nn.Linear, calib=data(), loss_fn=loss_fn)
    assert not daf.daf_layers(model)
    daf.adapt(model, config(), target=nn.Linear, selection=["2"])
    assert [n for n, r in roles(model).items() if r == "training"] == ["2"]


def test_merge_twice_raises_and_analysis_refuses_merged_model():
    model = adapted()
    perturb(model)
    y = model(X)
    daf.merge(model)
    torch.testing.assert_close(model(X), y, atol=1e-5, rtol=0)
    with pytest.raises(RankwiseError):
        daf.merge(model)
    with pytest.raises(RankwiseError, match="unmerge"):
        daf.DAFController(model, data(), loss_fn, total_steps=10).update(2)
    daf.unmerge(model)


def test_load_rejects_other_kind(tmp_path):
    from rankwise.adapt import lora

    m = lora.adapt(mlp(), lora.LoraConfig(rank=2), target=nn.Linear)
    lora.save_adapter(m, tmp_path / "l")
    other = adapted()
    with pytest.raises(ArtifactError, match="not a rankwise DAF adapter"):
        daf.load_adapter(other, tmp_path / "l")


def test_registered():
    from rankwise.core import registry

    assert registry.get("daf").entry is daf.adapt and registry.get("daf").config is daf.DAFConfig
