"""Server-side defences against malicious clients (in-process backend; each run ~1-2 s).

The attacks of the issue: a client replying 1e30-scale values (or a boosted model-replacement
update), a client claiming 10^18 examples, NaN/inf replies. Without defences they wreck the global
model (checked here, so the tests can fail); with the defaults, each poisoned run ends within a
stated distance of the clean run: the relative distance ``||theta - theta_clean|| / ||theta_clean -
theta_0||`` of the global model (every layer's ``s B A`` and the head) at most ``MAX_DIST``, and the
accuracy within ``MAX_ACC_DROP`` of the clean run's.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from rankwise.core import io  # noqa: E402
from rankwise.federated import defences as D  # noqa: E402
from rankwise.federated.client import make_client_fn  # noqa: E402
from rankwise.federated.config import FederatedConfig  # noqa: E402
from rankwise.federated.runner import build_strategy, run_federated  # noqa: E402
from rankwise.federated.strategy import ClientUpdate  # noqa: E402
from rankwise.federated.tasks import SyntheticTask  # noqa: E402

torch.set_num_threads(1)
logging.getLogger("flwr").setLevel(logging.ERROR)

MAX_DIST = 0.5       # a defended poisoned run stays this close (relative) to the clean run
MAX_ACC_DROP = 0.05  # ... and loses at most this much accuracy
OFF = dict(max_update_norm_ratio=None, max_examples_ratio=None, health_check=False)
ROUNDS = 3


@pytest.fixture(scope="module")
def task():
    return SyntheticTask(num_clients=4, per_client=32, n_test=256, d_in=8, hidden=16)


def cfg(**kw) -> FederatedConfig:
    base = dict(rank=4, alpha=4.0, client_ranks={i: [2, 4][i % 2] for i in range(4)}, clients_per_round=4,
                local_steps=4, batch_size=8, client_lr=2e-2, head_lr=2e-2, weighting="examples")
    base.update(kw)
    return FederatedConfig(**base)


def run(task, faults=None, method="fslora", rounds=ROUNDS, assigned=True, **kw):
    extra = {} if assigned else {"assigned_examples": None}
    s = build_strategy(method, cfg(**kw), task, **extra)
    run_federated(s, make_client_fn(task, faults=faults or {}), task.num_clients, rounds)
    return s


def vec(s) -> torch.Tensor:
    ad = s.global_adapter
    parts = [(ad.scaling[m] * ad.factors[m]["lora_B"].double() @ ad.factors[m]["lora_A"].double()).reshape(-1)
             for m in ad.factors]
    return torch.cat(parts + [t.double().reshape(-1) for t in s.global_head.values()])


@pytest.fixture(scope="module")
def clean(task):
    s = run(task)
    init = build_strategy("fslora", cfg(), task)
    return s, vec(s), vec(init)


def distance(s, clean) -> float:
    _, v0, init = clean
    v = vec(s)
    if not bool(torch.isfinite(v).all()):
        return float("inf")
    return float((v - v0).norm() / (v0 - init).norm())


def acc(s) -> float:
    return float(s.history[-1].get("accuracy", float("nan")))


# -- the attacks, undefended and defended ----------------------------------------------------------------

@pytest.mark.parametrize("fault", ["value:1e30", "boost:1e6"])
def test_huge_updates(task, clean, fault):
    clean_acc = acc(clean[0])
    assert clean_acc > 0.55  # the task is learnt
    undefended = run(task, {0: fault}, **OFF)
    assert distance(undefended, clean) > 100 and acc(undefended) < clean_acc - 0.2
    defended = run(task, {0: fault})
    assert all(h["rejected_size"] == [0] for h in defended.history[1:])
    assert distance(defended, clean) <= MAX_DIST and acc(defended) >= clean_acc - MAX_ACC_DROP


def test_inflated_example_counts(task, clean):
    fault = {0: "examples:1000000000000000000"}
    undefended = run(task, fault, assigned=False, **OFF)
    assert distance(undefended, clean) > 0.3
    capped = run(task, fault)  # the server knows each client's assigned count: the claim is capped at it
    assert capped.history[1]["examples_capped"] == [0]
    assert distance(capped, clean) == 0.0  # the attacker trained honestly: capped, it is the clean run
    # no assigned counts: capped at 10 x the round's lower median claim, so the attacker's weight is at
    # most 10 / (10 + 3) instead of ~1 (bounded, not removed: the bound for unknown assignments)
    ratio = run(task, fault, assigned=False)
    assert ratio.history[1]["examples_capped"] == [0]
    assert distance(ratio, clean) < 0.8 * distance(undefended, clean)


@pytest.mark.parametrize("fault", ["nan", "inf"])
def test_non_finite_updates_never_reach_the_model(task, clean, fault):
    s = run(task, {0: fault})
    assert all(h["rejected"] == [0] and h["clients_ok"] == 3 for h in s.history[1:])
    assert distance(s, clean) <= MAX_DIST and acc(s) >= acc(clean[0]) - MAX_ACC_DROP


@pytest.mark.parametrize("aggregator,extra", [("median", {}), ("trimmed", {"trim_fraction": 0.34}), ("krum", {})])
def test_robust_aggregators_alone_resist_huge_updates(task, clean, aggregator, extra):
    """No size bound, no health check: the robust aggregator alone keeps the 1e30 client out of the model.
    (With 3-4 clients per coordinate, a trimmed mean needs trim_fraction > 1/3 to cut one value per end.)"""
    s = run(task, {0: "value:1e30"}, aggregator=aggregator, **OFF, **extra)
    assert bool(torch.isfinite(vec(s)).all()) and distance(s, clean) <= 1.0
    assert acc(s) >= acc(clean[0]) - 0.1
    if aggregator == "krum":
        assert all(h["krum_dropped"] == [0] for h in s.history[1:])


def test_health_check_refuses_a_poisoned_round_and_writes_no_checkpoint_from_it(task, tmp_path):
    """Every other defence off: the health check alone refuses the round, rolls back, and the run continues."""
    ck = tmp_path / "ck"
    first = build_strategy("fslora", cfg(max_update_norm_ratio=None), task, checkpoint_dir=ck)
    run_federated(first, make_client_fn(task), 4, 1)
    healthy, meta = io.load_tensors(ck / "checkpoint.safetensors")
    assert meta["round"] == 1
    second = build_strategy("fslora", cfg(max_update_norm_ratio=None), task, checkpoint_dir=ck, resume=ck)
    run_federated(second, make_client_fn(task, faults={0: "boost:1e4"}), 4, 2)
    row = second.history[-1]
    assert row["round"] == 2 and "refused" in row and "loss" not in row
    tensors, meta = io.load_tensors(ck / "checkpoint.safetensors")
    assert meta["round"] == 1  # nothing written from the refused round
    for n, t in tensors.items():
        assert torch.equal(t, healthy[n]), n
    for n, t in second.tensors.items():  # rolled back to round 1's model
        assert torch.equal(t, healthy[f"g/{n}"]), n
    run_federated(second, make_client_fn(task), 4, 3)  # continues from the healthy state
    assert second.history[-1]["round"] == 3 and "refused" not in second.history[-1]
    assert io.load_tensors(ck / "checkpoint.safetensors")[1]["round"] == 3
    assert second.history[-1]["accuracy"] > 0.5


@pytest.mark.parametrize("fault,why", [("value:1e30", "test accuracy"), ("boost:1e4", "collapse bound")])
def test_health_check_catches_collapse(task, fault, why):
    """1e30 replies averaged in: finite tensors (~1e29) but accuracy at chance; a boosted update likewise."""
    undefended = run(task, {0: fault}, rounds=1, **OFF)
    assert acc(undefended) < 0.35 or not bool(torch.isfinite(vec(undefended)).all())
    s = run(task, {0: fault}, rounds=1, max_update_norm_ratio=None)
    assert why in s.history[1]["refused"]
    assert torch.equal(vec(s), vec(build_strategy("fslora", cfg(), task)))  # rolled back to the initial model


# -- the pieces -------------------------------------------------------------------------------------------

def test_robust_combine_is_flowers_median_and_trimmed_mean():
    from flwr.server.strategy.aggregate import aggregate_median, aggregate_trimmed_avg

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4, 7):
        arrays = [[rng.normal(size=(3, 5)).astype(np.float32)] for _ in range(n)]
        results = [(a, 1) for a in arrays]
        w = [1.0 / n] * n
        xs = [torch.from_numpy(a[0]) for a in arrays]
        np.testing.assert_allclose(D.robust_combine(xs, w, "median").numpy(), aggregate_median(results)[0], atol=1e-6)
        np.testing.assert_allclose(D.robust_combine(xs, w, "trimmed", 0.25).numpy(),
                                   aggregate_trimmed_avg(results, 0.25)[0], atol=1e-6)


def test_robust_combine_with_masks():
    x = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 0.0]), torch.tensor([100.0, 0.0])]
    masks = [torch.tensor([True, True]), torch.tensor([True, False]), torch.tensor([True, False])]
    w = [1 / 3] * 3
    # coordinate 1: only client 0 touched it -> its value times its weight mass (1/3), as the mean would
    assert torch.allclose(D.robust_combine(x, w, "median", masks=masks), torch.tensor([3.0, 5.0 / 3], dtype=torch.float64))
    assert torch.allclose(D.robust_combine(x, w, "mean", masks=masks), torch.tensor([104 / 3, 5 / 3], dtype=torch.float64))


def test_krum_matches_flower():
    from flwr.server.strategy.aggregate import aggregate_krum

    rng = np.random.default_rng(1)
    vecs = [rng.normal(size=6) for _ in range(6)] + [rng.normal(size=6) * 100]
    keep = D.krum_select([torch.from_numpy(v) for v in vecs], 1)
    assert 6 not in keep and len(keep) == 6
    ref = aggregate_krum([([v], 1) for v in vecs], 1, 6)[0]
    np.testing.assert_allclose(np.mean([vecs[i] for i in keep], axis=0), ref, atol=1e-9)
    assert D.krum_select([torch.zeros(2)] * 3, 1) == [0, 1, 2]  # n < f + 3: nothing can be told apart


def test_health_problem():
    ok = {"a": torch.ones(2)}
    assert D.health_problem(ok, None, None, 2.0) is None
    assert "NaN or inf" in D.health_problem({"a": torch.tensor([1.0, float("nan")])}, 1.0, 1.0, 2.0)
    assert "test loss is nan" in D.health_problem(ok, float("nan"), 1.0, 2.0)
    assert "exceeds 2 x" in D.health_problem(ok, 2.5, 1.0, 2.0)
    assert D.health_problem(ok, 1.9, 1.0, 2.0, 0.5, 0.7, 0.25) is None
    assert "fell more than 0.25" in D.health_problem(ok, 1.0, 1.0, 2.0, 0.4, 0.7, 0.25)


def test_size_and_example_caps():
    assert D.lower_median([5.0, 1.0]) == 1.0 and D.lower_median([3.0, 1.0, 2.0]) == 2.0
    assert D.size_outliers([1.0, 1.2, 50.0], 10) == [False, False, True]
    assert D.size_outliers([1.0, 50.0], 10) == [False, True]  # two clients: the attacker cannot set the scale
    assert D.size_outliers([1.0, float("inf")], None) == [False, False]
    assert D.cap_examples([10, 10**18], [None, None], 10.0) == [10, 100]
    assert D.cap_examples([10, 10**18], [12, 30], None) == [10, 30]
    assert D.update_size([np.full(4, 1e30, np.float32)], [np.zeros(4, np.float32)]) > 1e29


@pytest.mark.parametrize("method", ["fslora", "fedavg", "hetlora", "flexlora", "florist"])
def test_contributions_reproduce_each_methods_mean(task, method):
    """The robust aggregators work in each method's own aggregation space: combined by a plain weighted
    sum, the contributions give exactly what the method's aggregate gives."""
    config = cfg(weighting="examples")
    a = build_strategy(method, config, task, evaluate=False)
    b = build_strategy(method, config, task, evaluate=False)
    gen = torch.Generator().manual_seed(0)
    updates = []
    for pid in range(3):
        arrays, layout, _ = a.client_payload(1, pid)
        tensors = {n: torch.from_numpy(x.copy()) + 0.1 * torch.randn(x.shape, generator=gen)
                   for x, (n, _) in zip(arrays, layout)}
        updates.append(ClientUpdate(pid, tensors, 10 + pid, {}, None))
    if method == "fedavg":
        pytest.skip("FedAvg-LoRA's mean is Flower's FedAvg.aggregate_fit on the raw replies (checked in test_fslora)")
    a.aggregate(1, updates)
    contrib = b.contributions(1, updates)
    w = b.weights(updates)
    b.apply_combined(1, {k: D.robust_combine([c[k][0] for c in contrib], w, "mean", masks=[c[k][1] for c in contrib])
                         for k in contrib[0]}, updates)
    for m in a.modules:
        pa = a.tensors[f"{m}.lora_B"].double() @ a.tensors[f"{m}.lora_A"].double()
        pb = b.tensors[f"{m}.lora_B"].double() @ b.tensors[f"{m}.lora_A"].double()
        assert torch.allclose(pa, pb, atol=1e-5), m
    for n in a.head_names():
        assert torch.allclose(a.tensors[n], b.tensors[n], atol=1e-6), n


def test_defaults_leave_a_clean_run_unchanged(task, clean):
    s = run(task, **OFF)
    assert torch.equal(vec(s), clean[1])
    assert all(h["rejected"] == [] and not h["examples_capped"] and "refused" not in h for h in clean[0].history[1:])


def test_config_validation():
    for kw, match in [(dict(aggregator="mode"), "aggregator"), (dict(trim_fraction=0.5), "trim_fraction"),
                      (dict(krum_byzantine=-1), "krum_byzantine"), (dict(max_update_norm_ratio=0.5), "max_update"),
                      (dict(max_loss_ratio=1.0), "max_loss_ratio"), (dict(health_check=1), "health_check"),
                      (dict(max_accuracy_drop=1.5), "max_accuracy_drop")]:
        with pytest.raises(ValueError, match=f"FederatedConfig.{match}"):
            cfg(**kw)


def _nan_at(strategy, rnd: int):
    """Make the server's evaluation report a NaN loss at round ``rnd`` (a round the health check must refuse)."""
    full = strategy.evaluate_fn
    strategy.evaluate_fn = lambda ad, head: (float("nan"), {}) if ad.config["rounds"] == rnd else full(ad, head)
    return strategy


def test_refused_round_rolls_back_the_server_optimizer(task, tmp_path):
    """With a server AdamW the refused step's moments go too: state and optimizer are round 1's exactly.
    (Adam bounds each step, so a 1e30 reply does not wreck the model at once, but it would leave a 1e57
    second moment that freezes learning: the size bound, on by default, keeps it out.)"""
    kw = dict(server_optimizer="adam", server_lr=3e-3)
    ck = tmp_path / "ck"
    first = build_strategy("fslora", cfg(**kw), task, checkpoint_dir=ck)
    run_federated(first, make_client_fn(task), 4, 1)
    healthy, _ = io.load_tensors(ck / "checkpoint.safetensors")
    assert any(k.startswith("opt/") for k in healthy)
    second = _nan_at(build_strategy("fslora", cfg(**kw), task, checkpoint_dir=ck, resume=ck), 2)
    run_federated(second, make_client_fn(task), 4, 2)
    assert "test loss is nan" in second.history[-1]["refused"]
    after, _ = io.load_tensors(second.save_checkpoint(tmp_path / "after.safetensors"))
    assert healthy.keys() == after.keys()
    for k in healthy:
        assert torch.equal(healthy[k], after[k]), k
    fresh = _nan_at(build_strategy("fslora", cfg(**kw), task), 1)  # refused before the optimizer ever stepped
    run_federated(fresh, make_client_fn(task), 4, 1)
    assert "refused" in fresh.history[1] and fresh._opt is None
    assert torch.equal(vec(fresh), vec(build_strategy("fslora", cfg(**kw), task)))
