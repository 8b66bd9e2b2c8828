"""FSLoRA and baselines: spec correctness checks, faults, resume, bad configurations (in-process, no Ray)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from rankwise.core.errors import ArtifactError, SelectionError  # noqa: E402
from rankwise.core.lora import AdapterState  # noqa: E402
from rankwise.federated import FederatedConfig, SyntheticTask, build_strategy, make_client_fn, run_federated  # noqa: E402
from rankwise.federated.fslora import draw_indices, sketch_matrix  # noqa: E402
from rankwise.federated.strategy import ClientUpdate  # noqa: E402

torch.set_num_threads(1)
logging.getLogger("flwr").setLevel(logging.WARNING)

N = 6


@pytest.fixture(scope="module")
def task() -> SyntheticTask:
    return SyntheticTask(num_clients=N, per_client=32, n_test=128, d_in=8, hidden=16)


def cfg(**kw) -> FederatedConfig:
    base = dict(rank=8, alpha=8.0, client_ranks={i: [2, 4, 8][i % 3] for i in range(N)}, clients_per_round=3,
                local_steps=3, batch_size=8, client_lr=1e-2)
    base.update(kw)
    return FederatedConfig(**base)


def run(method, task, config, rounds=2, **kw):
    s = build_strategy(method, config, task, **{k: v for k, v in kw.items() if k in ("checkpoint_dir", "resume")})
    run_federated(s, make_client_fn(task, faults=kw.get("faults")), N, rounds,
                  round_timeout=kw.get("round_timeout"))
    return s


# -- the sketch ---------------------------------------------------------------------------------

def test_sketch_unbiased_and_k_nonzeros():
    rng = np.random.default_rng(0)
    r, k, n = 8, 3, 20000
    total = torch.zeros(r, r, dtype=torch.float64)
    for _ in range(n):
        S = sketch_matrix(r, draw_indices(r, k, rng))
        assert int((S != 0).sum()) == k
        total += S
    assert float((total / n - torch.eye(r, dtype=torch.float64)).abs().max()) < 0.02 * r / k * 1.5


def test_fresh_indices_every_round(task):
    s = build_strategy("fslora", cfg(), task, evaluate=False)
    J = [s.sketch(rnd, 0) for rnd in range(1, 6)]  # client 0 has k=2 of r=8: C(8,2)=28 subsets
    firsts = {tuple(j[next(iter(j))]) for j in J}
    assert len(firsts) > 1
    assert all(len(v) == 2 for j in J for v in j.values())


def test_bad_sketch_sizes():
    rng = np.random.default_rng(0)
    for k in (0, 9, 2.5):
        with pytest.raises(ValueError):
            draw_indices(8, k, rng)


# -- sliced = masked (official code), zero gradients outside J ------------------------------------

def test_sliced_equals_masked_and_zero_grads():
    torch.manual_seed(0)
    d, l, r, k, alpha, lr = 6, 5, 4, 2, 4.0, 0.1
    W0, x = torch.randn(d, l), torch.randn(7, l)
    A, B = torch.randn(r, l), torch.randn(d, r)
    J = torch.tensor([1, 3])
    S = sketch_matrix(r, J.numpy(), torch.float32)
    # masked (official): W0 + (alpha/r) B S A, full B and A as parameters
    Bm, Am = B.clone().requires_grad_(), A.clone().requires_grad_()
    ym = x @ (W0 + alpha / r * Bm @ S @ Am).T
    ym.square().sum().backward()
    # sliced: W0 + (alpha/k) B[:,J] A[J]
    Bs, As = B[:, J].clone().requires_grad_(), A[J].clone().requires_grad_()
    ys = x @ (W0 + alpha / k * Bs @ As).T
    ys.square().sum().backward()
    assert torch.allclose(ym, ys, atol=1e-5)
    outside = torch.tensor([0, 2])
    assert float(Bm.grad[:, outside].abs().max()) == 0.0 and float(Am.grad[outside].abs().max()) == 0.0
    assert torch.allclose(Bm.grad[:, J], Bs.grad, atol=1e-5) and torch.allclose(Am.grad[J], As.grad, atol=1e-5)
    # one SGD step agrees
    assert torch.allclose((Bm - lr * Bm.grad)[:, J], Bs - lr * Bs.grad, atol=1e-6)


# -- aggregation ---------------------------------------------------------------------------------

def test_aggregation_divides_by_number_of_clients(task):
    s = build_strategy("fslora", cfg(client_ranks={i: 8 for i in range(N)}), task, evaluate=False)
    before = {n: t.clone() for n, t in s.tensors.items()}
    m = s.modules[0]
    ups = []
    for pid in range(3):
        J = s.sketch(1, pid)
        tens = {}
        for mm in s.modules:
            j = torch.as_tensor(J[mm])
            tens[f"{mm}.lora_A"] = s.tensors[f"{mm}.lora_A"][j].clone()
            tens[f"{mm}.lora_B"] = s.tensors[f"{mm}.lora_B"][:, j].clone()
        for h in s.head_names():
            tens[h] = s.tensors[h].clone()
        if pid == 0:
            tens[f"{m}.lora_B"][:, 5] += 3.0
        ups.append(ClientUpdate(pid, tens, 10, {}))
    s.aggregate(1, ups)
    diff = s.tensors[f"{m}.lora_B"] - before[f"{m}.lora_B"]
    assert torch.allclose(diff[:, 5], torch.full_like(diff[:, 5], 1.0), atol=1e-6)
    diff[:, 5] = 0
    assert float(diff.abs().max()) == 0.0


def test_sketched_aggregate_unbiased(task):
    """For a loss linear in W, one SGD step: E_sketch[scatter-mean of sliced updates] = full-rank FedAvg update."""
    torch.manual_seed(1)
    r, k, alpha, lr, d, l = 8, 2, 8.0, 0.1, 5, 4
    C = torch.randn(d, l, dtype=torch.float64)  # loss <C, W>: gradient wrt W is C whatever the sketch
    A, B = torch.randn(r, l, dtype=torch.float64), torch.randn(d, r, dtype=torch.float64)
    full_dB = -lr * (alpha / r) * C @ A.T
    rng = np.random.default_rng(123)
    from rankwise.federated.fslora import scatter_delta
    n = 4000
    draws = []
    for _ in range(n):
        J = draw_indices(r, k, rng)
        j = torch.as_tensor(J)
        dBJ = -lr * (alpha / k) * C @ A[j].T
        draws.append(scatter_delta(r, [(J, dBJ, 1.0)], 1, (d, r)))
    stack = torch.stack(draws)
    mean, se = stack.mean(0), stack.std(0) / n ** 0.5
    z = ((mean - full_dB) / se.clamp_min(1e-12)).abs()
    assert float(z.max()) < 4.5, float(z.max())
    assert float((mean - full_dB).abs().max()) < 0.1 * float(full_dB.abs().max())


def test_ratio_one_equals_fedavg(task):
    c = cfg(client_ranks={i: 8 for i in range(N)}, weighting="examples")
    a = run("fslora", task, c, rounds=2)
    b = run("fedavg", task, c, rounds=2)
    assert a.global_adapter.allclose(b.global_adapter, atol=1e-6)
    for n in a.head_names():
        assert torch.allclose(a.tensors[n], b.tensors[n], atol=1e-6)
    assert [h["accuracy"] for h in a.history] == pytest.approx([h["accuracy"] for h in b.history], abs=1e-9)


def test_init_output_equals_base(task):
    from rankwise.core.lora import set_state

    s = build_strategy("fslora", cfg(), task, evaluate=False)
    assert all(float(f["lora_B"].abs().max()) == 0 for f in s.global_adapter.factors.values())
    base, adapted = task.build_model(), task.build_model()
    set_state(adapted, s.global_adapter, check_base=False)
    x = task.test_data().inputs["x"][:32]
    assert torch.equal(base(x), adapted(x))
    # the sketched client model at init is the base model too
    from rankwise.federated.client import install

    arrays, layout, scaling = s.client_payload(1, 0)
    client = install(base, arrays, layout, scaling)
    assert torch.equal(base(x), client(x))


def test_registered():
    from rankwise.core import registry

    e = registry.get("fslora")
    assert e.config is FederatedConfig and e.family == "federated"
    assert registry.status("fslora") == "reproduced"


def test_hetlora_norm_weighting(task):
    from rankwise.federated.baselines import HetLoRALogic
    from rankwise.federated.strategy import flower_class

    state, _ = __import__("rankwise.federated.runner", fromlist=["initial_state"]).initial_state(task, cfg())
    s = flower_class(HetLoRALogic, "HetLoRAStrategy")(cfg(weighting="uniform"), state, norm_weighting=True)
    m = s.modules[0]
    big = {f"{mm}.{k}": torch.zeros_like(s.tensors[f"{mm}.{k}"][:2] if k == "lora_A"
                                         else s.tensors[f"{mm}.{k}"][:, :2])
           for mm in s.modules for k in ("lora_A", "lora_B")}
    small = {k: v.clone() for k, v in big.items()}
    big[f"{m}.lora_A"][0, 0], big[f"{m}.lora_B"][0, 0] = 2.0, 2.0     # ||B A|| = 4
    small[f"{m}.lora_A"][0, 0], small[f"{m}.lora_B"][0, 0] = 1.0, 1.0  # ||B A|| = 1
    s.aggregate(1, [ClientUpdate(0, big, 1, {}), ClientUpdate(1, small, 1, {})])
    assert float(s.tensors[f"{m}.lora_A"][0, 0]) == pytest.approx(0.8 * 2 + 0.2 * 1)


def test_upload_scales_with_sketch_ratio(task):
    s = run("fslora", task, cfg(), rounds=2)
    f = run("fedavg", task, cfg(), rounds=2)
    assert all(h["upload_bytes_per_client"] < f.history[1]["upload_bytes_per_client"] for h in s.history[1:])
    # shapes of the uploaded blocks are k x in and out x k
    arrays, layout, scaling = s.client_payload(3, 0)
    assert all(shape[0] == 2 for n, shape in layout if n.endswith("lora_A"))
    assert all(shape[1] == 2 for n, shape in layout if n.endswith("lora_B"))
    assert set(scaling.values()) == {8.0 / 2}


@pytest.mark.parametrize("method", ["hetlora", "flexlora", "fedavg"])
def test_baselines_learn(method, task):
    s = run(method, task, cfg(), rounds=3)
    assert s.history[-1]["loss"] < s.history[0]["loss"]


# -- faults --------------------------------------------------------------------------------------

def _sampled(strategy, rnd):
    return strategy.sample(rnd, list(range(N)))


_FAULT_RUNS: dict[str, object] = {}


@pytest.mark.parametrize("fault", ["raise", "nan", "shape", "dtype"])
def test_faulty_client_left_out(task, fault):
    c = cfg()
    probe = build_strategy("fslora", c, task, evaluate=False)
    bad = _sampled(probe, 1)[0]
    s = run("fslora", task, c, rounds=1, faults={bad: fault})
    row = s.history[-1]
    assert row["clients_ok"] == 2
    if fault == "raise":
        assert row["clients_failed"] == 1 and row["rejected"] == []
    else:
        assert row["rejected"] == [bad] and row["clients_failed"] == 0
    assert all(torch.isfinite(t).all() for t in s.tensors.values())
    # the global model is the aggregate of the two good clients only, whatever was wrong with the third
    if "raise" not in _FAULT_RUNS:
        _FAULT_RUNS["raise"] = s if fault == "raise" else run("fslora", task, c, rounds=1, faults={bad: "raise"})
    assert s.global_adapter.allclose(_FAULT_RUNS["raise"].global_adapter)
    assert not s.global_adapter.allclose(run("fslora", task, c, rounds=1).global_adapter)


def test_timeout_client_left_out(task):
    c = cfg()
    probe = build_strategy("fslora", c, task, evaluate=False)
    slow = _sampled(probe, 1)[1]
    s = run("fslora", task, c, rounds=1, faults={slow: "sleep:20"}, round_timeout=5.0)
    assert s.history[-1]["clients_ok"] == 2 and s.history[-1]["clients_failed"] == 1


def test_all_invalid_leaves_state_unchanged(task):
    c = cfg(clients_per_round=2)
    probe = build_strategy("fslora", c, task, evaluate=False)
    bad = _sampled(probe, 1)
    before = probe.global_adapter
    s = run("fslora", task, c, rounds=1, faults={p: "nan" for p in bad})
    assert s.global_adapter.allclose(before)
    assert s.history[-1]["clients_ok"] == 0


def test_on_invalid_raise(task):
    from rankwise.federated.strategy import InvalidUpdateError

    c = cfg(on_invalid="raise")
    probe = build_strategy("fslora", c, task, evaluate=False)
    with pytest.raises(Exception) as e:
        run("fslora", task, c, rounds=1, faults={_sampled(probe, 1)[0]: "shape"})
    assert isinstance(e.value, InvalidUpdateError) or "rejected" in str(e.value)


# -- resume --------------------------------------------------------------------------------------

@pytest.mark.parametrize("server_optimizer,lr", [("avg", 1.0), ("adam", 1e-2)])
def test_resume_equals_uninterrupted(task, tmp_path, server_optimizer, lr):
    c = cfg(server_optimizer=server_optimizer, server_lr=lr)
    full = run("fslora", task, c, rounds=3)
    first = run("fslora", task, c, rounds=2, checkpoint_dir=tmp_path)
    assert (tmp_path / "checkpoint.safetensors").is_file() and first.completed_rounds == 2
    resumed = run("fslora", task, c, rounds=3, resume=tmp_path)
    assert resumed.completed_rounds == 3
    assert resumed.global_adapter.allclose(full.global_adapter)
    assert [h["round"] for h in resumed.history] == [0, 1, 2, 3]


def test_resume_with_other_rank_fails(task, tmp_path):
    run("fslora", task, cfg(), rounds=1, checkpoint_dir=tmp_path)
    with pytest.raises(ArtifactError, match="rank"):
        build_strategy("fslora", cfg(rank=4, client_ranks={i: 2 for i in range(N)}), task, resume=tmp_path)


# -- bad configurations ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(client_ranks={0: 9}), "client 0"),
    (dict(client_ranks={0: 0}), "client 0"),
    (dict(client_ranks={0: 2.5}), "client 0"),
    (dict(rank=0), "rank"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(server_optimizer="lbfgs"), "server_optimizer"),
    (dict(weighting="mean"), "weighting"),
    (dict(default_rank=99), "default_rank"),
    (dict(server_momentum=1.0), "server_momentum"),
])
def test_bad_config(kw, match):
    base = dict(rank=8)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        FederatedConfig(**base)


def test_unknown_and_missing_client_ids(task):
    with pytest.raises(ValueError, match="client ids"):
        build_strategy("fslora", cfg(client_ranks={0: 2, 40: 4}), task)
    c = FederatedConfig(rank=8, client_ranks={0: 2})
    with pytest.raises(ValueError, match="default_rank"):
        c.rank_of(3)
    assert FederatedConfig(rank=8, client_ranks={0: 2}, default_rank=4).rank_of(3) == 4


def test_rank_above_layer_and_bad_targets(task):
    with pytest.raises(ValueError, match="fc1|rank"):
        build_strategy("fslora", cfg(rank=20, client_ranks={}), task)
    with pytest.raises(SelectionError):
        build_strategy("fslora", cfg(target_modules=("nope",)), task)


def test_hetlora_needs_avg(task):
    with pytest.raises(ValueError, match="avg"):
        build_strategy("hetlora", cfg(server_optimizer="adam", server_lr=1e-3), task)


def test_global_adapter_saves(task, tmp_path):
    s = run("fslora", task, cfg(), rounds=1)
    p = s.global_adapter.save(tmp_path / "g.safetensors")
    assert AdapterState.load(p).allclose(s.global_adapter)


def test_evaluate_model_lists_per_example_correctness():
    from rankwise.federated.tasks import evaluate_model

    task = SyntheticTask(num_clients=2, per_client=8, n_test=50, d_in=8, hidden=16)
    model, data = task.build_model(), task.test_data()
    hits: list[float] = []
    loss, acc = evaluate_model(model, data, batch_size=16, per_example=hits)
    with torch.no_grad():
        inputs, y = data.select(torch.arange(len(data)))
        expected = (model(**inputs).argmax(-1) == y).double().tolist()
    assert hits == expected and sum(hits) / len(hits) == pytest.approx(acc)
    # the logits are float32 and a matmul over 7 rows may take another kernel than one over 16, so
    # the two batchings agree to float32 precision, not float64 (seen: 2e-9 relative on one machine)
    assert evaluate_model(model, data, batch_size=7)[0] == pytest.approx(loss, rel=1e-6)
