"""UB-SMoE: the spec's correctness checks and bad inputs (strategy logic in-process, no Ray)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from rankwise.core.errors import SelectionError
from rankwise.federated import ub_smoe as U
from rankwise.federated.ub_smoe import (
    LoRAMoE,
    SyntheticMoETask,
    UBSMoEConfig,
    apply_pseudo_gradient,
    convert_to_lora_moe,
    ffn_flops,
    global_utilisation,
    local_train_moe,
    modulated_routing,
    phi_regulariser,
    target_modulation,
    update_phi,
)

pytest.importorskip("flwr")
torch.set_num_threads(1)


def small_task(**kw):
    args = dict(num_clients=4, per_client=16, n_test=64, hidden=16, ffn=16, num_experts=8, top_k=4)
    args.update(kw)
    return SyntheticMoETask(**args)


def small_cfg(**kw):
    args = dict(rank=2, clients_per_round=2, local_steps=2, batch_size=8, client_lr=1e-2, seed=0)
    args.update(kw)
    return UBSMoEConfig(**args)


def run(method, cfg, task, rounds=2, faults=None, **kw):
    from rankwise.federated.runner import build_strategy, run_federated

    strategy = build_strategy(method, cfg, task, **kw)
    run_federated(strategy, U.make_ub_smoe_client_fn(task, faults=faults), task.num_clients, rounds)
    return strategy


def spec(k_max=4, beta=0.25, dmr=True, pg=True, **kw):
    d = {"client": 0, "beta": beta, "k_max": k_max, "candidate_factor": 2, "dmr": dmr, "pg": pg,
         "pg_scale": "sparsity", "pg_coef": 1.0, "phi_range": [-1.0, 1.0], "phi_reg": 0.1, "lb": 0.0,
         "rescale": False}
    d.update(kw)
    return d


def lora_model(task, rank=2):
    from rankwise.core.lora import add_lora

    model = task.build_model()
    add_lora(model, task.targets, "default", rank=rank, alpha=4.0, generator=torch.Generator().manual_seed(0))
    for n, p in model.named_parameters():
        if n in task.head:
            p.requires_grad_(True)
    with torch.no_grad():  # B != 0 so that A also gets gradients
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    return model


# -- routing -----------------------------------------------------------------------------------------

def test_routing_gates_candidates_and_raw_logits():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(50, 8, generator=g)
    phi = torch.randn(8, generator=g) * 3
    gates, active, probs = modulated_routing(s, phi, k=2, n_p=4)
    cand = torch.zeros_like(active).scatter_(1, s.topk(4, dim=1).indices, True)
    assert torch.allclose(gates.sum(-1), torch.ones(50, dtype=gates.dtype))
    assert (active.sum(-1) == 2).all()
    assert not (active & ~cand).any()  # only candidates are selected
    assert (gates[~active] == 0).all()
    # outside T(x) the logits are raw: log p_i - log p_j = s_i - s_j for i, j not in T(x)
    for t in range(50):
        out = (~cand[t]).nonzero().flatten()
        lp = probs[t, out].log()
        assert torch.allclose(lp - lp[0], s[t, out] - s[t, out[0]], atol=1e-5)
    # a huge phi on an expert outside the candidates cannot pull it in
    phi2 = torch.zeros(8)
    worst = s.argmin(1)
    big = torch.full((8,), 0.0)
    big[worst[0]] = 100.0
    _, act2, _ = modulated_routing(s[:1], big + phi2, k=2, n_p=4)
    assert not act2[0, worst[0]]


def test_phi_zero_equals_plain_topk_and_mixtral_conversion():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=64,
                        max_position_embeddings=32)
    model = MixtralForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        ref = model(ids).logits
    convert_to_lora_moe(model)
    layers = U.moe_layers(model)
    assert len(layers) == 1 and layers[0][1].num_experts == 8 and layers[0][1].k_max == 2
    with torch.no_grad():
        got = model(ids).logits
        layers[0][1].dmr = False
        got_off = model(ids).logits
    assert torch.allclose(ref, got, atol=1e-5)  # K_c = K_max with phi = 0 reproduces the base routing
    assert torch.equal(got, got_off)


def test_convert_errors():
    with pytest.raises(SelectionError, match="no MoE layer found"):
        convert_to_lora_moe(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(SelectionError, match="no MoE layer found"):
        U.moe_layers(torch.nn.Linear(3, 3))


def test_shape_mismatch_on_load_is_an_error():
    from rankwise.core.lora import get_state, set_state

    a, b = small_task(), small_task(ffn=24)
    ma, mb = lora_model(a), b.build_model()
    with pytest.raises(Exception, match="does not fit"):
        set_state(mb, get_state(ma), "default", check_base=False)


# -- server-side DMR -----------------------------------------------------------------------------------

def test_utilisation_sums_to_kbar_and_skips_empty_clients():
    counts = np.array([[10, 0, 5, 1], [3, 3, 3, 3], [7, 7, 7, 7]], dtype=float)
    tokens = [8, 6, 0]  # K_c = 2, 2 (sum a / n) ; third client reports n_c = 0 and is skipped
    counts[0] = [6, 4, 3, 3]
    u, k_bar = global_utilisation(counts, tokens, [0.5, 0.25, 0.25], [2, 2, 4])
    assert k_bar == pytest.approx(2.0)
    assert float(u.sum()) == pytest.approx(k_bar)
    u2, k2 = global_utilisation(counts[:1], [0], [1.0], [2])
    assert k2 == 0.0 and float(u2.abs().sum()) == 0


def test_target_modulation_properties(caplog):
    m, k_bar = 8, 2.0
    balanced = torch.full((m,), k_bar / m, dtype=torch.float64)
    assert torch.allclose(target_modulation(balanced, k_bar), torch.zeros(m, dtype=torch.float64), atol=1e-5)
    u = torch.linspace(0.0, 1.5, 50, dtype=torch.float64)
    phi = target_modulation(u, k_bar)
    assert (phi[1:] < phi[:-1]).all()  # decreasing in u
    assert (phi > math.tanh(-1)).all() and (phi[1:] < 1).all() and (phi <= 1).all()
    assert torch.isfinite(phi[0]) and phi[0] > 0.999  # an idle expert gets ~ +1, finite thanks to eps
    with caplog.at_level(logging.WARNING):
        bad = target_modulation(torch.tensor([float("nan")] + [0.25] * 7, dtype=torch.float64), k_bar)
    assert (bad == 0).all() and "non-finite" in caplog.text
    assert torch.allclose(update_phi(torch.ones(3), torch.zeros(3), 0.9), torch.full((3,), 0.9, dtype=torch.float64))


def test_phi_regulariser():
    inside = torch.tensor([-1.0, 0.0, 0.5, 1.0], requires_grad=True)
    assert float(phi_regulariser(inside, -1, 1, 0.1).detach()) == 0.0
    out = torch.tensor([-2.0, 0.0, 3.0], requires_grad=True)
    loss = phi_regulariser(out, -1, 1, 0.1)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.1 * (1 + 4))
    assert out.grad[0] < 0 and out.grad[1] == 0 and out.grad[2] > 0  # gradient descent pushes phi back inside


def test_flops_linear_in_k_and_stats_size():
    f = [ffn_flops(64, 128, 16, k, rank=4) for k in range(1, 5)]
    assert f[2] - f[1] == f[1] - f[0] == f[3] - f[2] > 0
    task = small_task(num_layers=2)
    model = lora_model(task)
    _, stats = local_train_moe(model, task.client_data(0), spec(), steps=1, batch_size=8, lr=1e-2)
    n = len(stats["layers"]) * (len(stats["counts"][0]) + 1)
    assert n == 2 * (8 + 1)  # L (M + 1) numbers per client per round
    for c, t in zip(stats["counts"], stats["tokens"]):
        assert sum(c) == pytest.approx(1 * t)  # K_c = floor(4 * 0.25) = 1 expert per token


# -- pseudo-gradient -----------------------------------------------------------------------------------

def test_pseudo_gradient_formula():
    g = [[torch.ones(2, 2)], [torch.full((2, 2), 2.0)], [torch.zeros(2, 2)]]
    apply_pseudo_gradient(g, torch.tensor([0.0, 0.5, 0.25], dtype=torch.float64),
                          torch.tensor([True, True, False]), rho=0.5)
    assert torch.allclose(g[0][0], torch.ones(2, 2))
    assert torch.allclose(g[1][0], torch.full((2, 2), 2.0 + 0.25 * 3))
    assert torch.allclose(g[2][0], torch.full((2, 2), 0.125 * 3))


def test_pg_never_changes_forward_and_updates_idle_experts():
    task = small_task()
    data = task.client_data(1)
    results = {}
    for pg in (True, False):
        model = lora_model(task)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        loss, stats = local_train_moe(model, data, spec(beta=0.25, pg=pg), steps=3, batch_size=8, lr=1e-2, seed=0)
        counts = np.asarray(stats["counts"][0])
        idle = [i for i in range(8) if counts[i] == 0]
        assert idle, "expected an expert that K_c = 1 never activates"
        changed = {i: any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters()
                          if f"experts.{i}." in n and "lora_" in n) for i in idle}
        results[pg] = (loss, changed, counts)
    assert all(results[True][1].values())  # PG on: never-activated experts still move
    assert not any(results[False][1].values())  # PG off: their gradient is exactly zero
    # PG touches gradients only: the first forward (same init, same batch) gives the same loss
    losses = []
    for pg in (True, False):
        model = lora_model(task)
        loss, _ = local_train_moe(model, data, spec(pg=pg), steps=1, batch_size=8, lr=1e-2, seed=0)
        losses.append(loss)
    assert losses[0] == losses[1]


# -- federated runs (in-process) -------------------------------------------------------------------------

def test_dmr_pg_off_equals_naive():
    task = small_task()
    a = run("ub-smoe", small_cfg(dmr=False, pseudo_gradient=False), task)
    b = run("smoe-naive", small_cfg(), task)
    assert a.tensors.keys() == b.tensors.keys()
    for n in a.tensors:
        assert torch.equal(a.tensors[n], b.tensors[n]), n
    assert [h.get("accuracy") for h in a.history] == [h.get("accuracy") for h in b.history]


def test_ub_smoe_round_updates_phi_and_records_utilisation():
    task = small_task()
    s = run("ub-smoe", small_cfg(), task)
    row = s.history[-1]
    assert row["clients_ok"] == 2 and 0 < row["utilisation_entropy"] <= 1
    assert row["phi_abs_mean"] > 0
    assert row["stats_bytes_per_client"] == 4 * 1 * (8 + 1)
    assert set(row["k_per_client"].values()) <= {1, 2, 3, 4}
    n = s.tensors["head:moe.0.phi"]
    assert n.shape == (8,) and torch.isfinite(n).all()
    naive = run("smoe-naive", small_cfg(), task)
    assert float(naive.tensors["head:moe.0.phi"].abs().max()) == 0.0


def test_faults_and_malformed_updates(caplog):
    task = small_task()
    with caplog.at_level(logging.WARNING):
        s = run("ub-smoe", small_cfg(clients_per_round=4), task, rounds=1,
                faults={0: "raise", 1: "nan", 2: "stats"})
    row = s.history[-1]
    assert row["clients_failed"] == 1 and row["clients_rejected"] == 1 and row["clients_ok"] == 2
    assert "malformed routing statistics" in caplog.text
    assert all(torch.isfinite(t).all() for t in s.tensors.values())


def test_activation_aggregation_variant_runs():
    task = small_task()
    s = run("a3smoe", small_cfg(), task)
    assert s.ub.aggregation == "activation" and s.ub.output_rescale
    assert all(torch.isfinite(t).all() for t in s.tensors.values())


def test_registration():
    from rankwise.core import registry
    from rankwise.federated.runner import methods

    assert {"ub-smoe", "smoe-naive", "smoe-llb", "a3smoe"} <= set(methods())
    assert registry.get("ub_smoe").config is UBSMoEConfig


# -- bad configuration -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"client_budget": {0: 1.5}}, "client 0"),
    ({"client_budget": {3: -0.1}}, "client 3"),
    ({"client_budget": {2: 0.1}, "k_max": 4}, "client 2"),
    ({"candidate_factor": 0}, "candidate_factor"),
    ({"dmr_momentum": 1.0}, "dmr_momentum"),
    ({"dmr_momentum": -0.1}, "dmr_momentum"),
    ({"phi_range": (1.0, -1.0)}, "phi_range"),
    ({"phi_range": (0.5, 0.5)}, "phi_range"),
    ({"phi_reg": -0.1}, "phi_reg"),
    ({"pg_coef": -1.0}, "pg_coef"),
    ({"pg_scale": "cubic"}, "pg_scale"),
    ({"aggregation": "median"}, "aggregation"),
    ({"budget_tiers": ()}, "budget_tiers"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        UBSMoEConfig(**kw)


def test_bad_config_against_model():
    cfg = UBSMoEConfig(candidate_factor=3)
    with pytest.raises(ValueError, match="N_p"):
        cfg.check_model(num_experts=8, k_max=4)  # 12 > M = 8
    with pytest.raises(ValueError, match="client 1"):
        UBSMoEConfig(budget_tiers=(1.0, 0.1)).check_model(8, 4, num_clients=2)
    layer = LoRAMoE(8, 8, 8, 4)
    with pytest.raises(ValueError, match="client 5"):
        U.client_routing(spec(beta=0.2, client=5), layer)
    with pytest.raises(ValueError, match="N_p"):
        U.client_routing(spec(candidate_factor=3), layer)


def test_strategy_rejects_model_without_moe():
    from rankwise.federated.runner import build_strategy
    from rankwise.federated.tasks import SyntheticTask

    with pytest.raises(SelectionError, match="no MoE layer found"):
        build_strategy("ub-smoe", small_cfg(), SyntheticTask(num_clients=2, per_client=16), evaluate=False)


def test_plain_fslora_config_is_read_with_ub_defaults():
    from rankwise.federated.config import FederatedConfig

    cfg = UBSMoEConfig.from_base(FederatedConfig(rank=4, client_ranks={0: 2}, local_steps=3))
    assert cfg.rank == 4 and cfg.local_steps == 3 and cfg.dmr and cfg.pseudo_gradient
    assert [cfg.budget_of(i) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 0.25]
    assert json.loads(json.dumps(cfg.to_json()))["phi_range"] == [-1.0, 1.0]


def test_llb_trains_phi_locally_without_server_target():
    task = small_task()
    s = run("smoe-llb", small_cfg(head_lr=5e-2), task)
    assert s.ub.dmr and not s.ub.modulation_update and s.ub.load_balance_coef == 0.01
    phi = s.tensors["head:moe.0.phi"]
    assert float(phi.abs().max()) > 0  # moved by the local balancing loss only
    assert s.history[-1]["phi_abs_mean"] == pytest.approx(float(phi.abs().mean()))


def test_resume_gives_the_same_global_state(tmp_path):
    from rankwise.federated.runner import build_strategy, run_federated

    task = small_task()
    full = run("ub-smoe", small_cfg(), task, rounds=2)
    first = build_strategy("ub-smoe", small_cfg(), task, checkpoint_dir=tmp_path)
    run_federated(first, U.make_ub_smoe_client_fn(task), task.num_clients, 1)
    resumed = build_strategy("ub-smoe", small_cfg(), task, resume=tmp_path)
    run_federated(resumed, U.make_ub_smoe_client_fn(task), task.num_clients, 2)
    for n in full.tensors:
        assert torch.equal(full.tensors[n], resumed.tensors[n]), n


def test_florist_stacked_svd_is_exact_and_thresholds_energy():
    from rankwise.federated.runner import build_strategy, run_federated
    from rankwise.federated.client import make_client_fn
    from rankwise.federated.config import FederatedConfig
    from rankwise.federated.strategy import ClientUpdate
    from rankwise.federated.tasks import SyntheticTask

    task = SyntheticTask(num_clients=2, per_client=16, hidden=16)
    cfg = FederatedConfig(rank=8, client_ranks={0: 2, 1: 4}, clients_per_round=2, local_steps=1, seed=0)
    s = build_strategy("florist", cfg, task, evaluate=False, energy=1.0)
    g = torch.Generator().manual_seed(0)
    ups, target = [], {}
    for pid, k in ((0, 2), (1, 4)):
        t = {f"{m}.lora_{x}": torch.randn(*((k, s.tensors[f'{m}.lora_A'].shape[1]) if x == "A"
                                            else (s.tensors[f'{m}.lora_B'].shape[0], k)), generator=g)
             for m in s.modules for x in "AB"}
        t.update({n: s.tensors[n].clone() for n in s.head_names()})
        ups.append(ClientUpdate(pid, t, 10, {}))
    for m in s.modules:
        target[m] = sum(0.5 * u.tensors[f"{m}.lora_B"].double() @ u.tensors[f"{m}.lora_A"].double() for u in ups)
    s.aggregate(1, ups)
    for m in s.modules:  # total rank 6 <= r = 8 and energy 1: exact
        got = s.tensors[f"{m}.lora_B"].double() @ s.tensors[f"{m}.lora_A"].double()
        assert torch.allclose(got, target[m], atol=1e-4)
        assert s.kept_ranks[m] == 6
    s2 = build_strategy("florist", cfg, task, evaluate=False, energy=0.5)
    s2.aggregate(1, ups)
    for m in s2.modules:
        sv = torch.linalg.svdvals(target[m])
        e = torch.cumsum(sv ** 2, 0) / (sv ** 2).sum()
        j = s2.kept_ranks[m]
        assert e[j - 1] >= 0.5 and (j == 1 or e[j - 2] < 0.5)
    with pytest.raises(ValueError, match="energy"):
        build_strategy("florist", cfg, task, evaluate=False, energy=0.0)
    s3 = build_strategy("florist", cfg, task, evaluate=False)
    run_federated(s3, make_client_fn(task), 2, 1)
    assert s3.history[-1]["clients_ok"] == 2


def test_many_layers_keep_model_order():
    task = small_task(num_layers=11, num_experts=4, top_k=2, hidden=8, ffn=8, expert_scale=0.5)
    s = run("ub-smoe", small_cfg(clients_per_round=1, budget_tiers=(0.5, 1.0)), task, rounds=1)
    assert s.layers[:3] == ["moe.0", "moe.1", "moe.2"] and s.layers[-1] == "moe.10"
    assert s.history[-1]["clients_ok"] == 1 and np.isfinite(s.history[-1]["utilisation_entropy"])
