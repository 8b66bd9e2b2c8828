"""E²LoRA: the spec's correctness checks and bad inputs (shared/methods/e2lora.md).

The adapter contract (identity at init, merge/unmerge, save/load, several adapters ...) is covered by
tests/adapt/cases_e2lora.py through test_adapter_contract.py; here: the math of the plan (entropy, RMI,
thresholds, partition, rank allocation), sharing, equivalence to LoRA, data dependence and bad input.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from rankwise.adapt import e2lora as E
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError
from rankwise.core.registry import get

HALF = 0.5 * math.log(2 * math.pi) + 0.5


def tiny_bert(layers: int = 4, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=32)
    return BertModel(cfg).eval()


def calibration(seed: int = 0, n: int = 2, freq: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 100, (4, 8), generator=g) for _ in range(n)]

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        y = model(batch).last_hidden_state
        target = torch.sin(freq * torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape)
        return (y - target).square().mean()

    return batches, loss_fn


def x_in() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(5))


def out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(x_in()).last_hidden_state


def snapshot(model: nn.Module) -> dict:
    return {"types": [(n, type(m)) for n, m in model.named_modules()],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad": {n: p.requires_grad for n, p in model.named_parameters()}}


def assert_unchanged(model: nn.Module, snap: dict) -> None:
    now = snapshot(model)
    assert now["types"] == snap["types"] and now["grad"] == snap["grad"]
    assert now["state"].keys() == snap["state"].keys()
    assert all(torch.equal(now["state"][k], v) for k, v in snap["state"].items())


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------

def test_entropy_formula_and_identical_rmi():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.01
    sigma = float(g.std(unbiased=False))
    assert abs(E.proxy_entropy(g) - (math.log(sigma) + HALF)) < 1e-6
    assert abs(E.entropy_from_std(1.0) - HALF) < 1e-12
    assert E.entropy_from_std(0.0) == -math.inf
    H, S = E.similarity_matrix([g, g.clone()])
    assert abs(H[0] - H[1]) < 1e-12
    assert abs(float(S[0, 1]) - 1.0) < 1e-6 and abs(float(S[0, 0]) - 1.0) < 1e-6


def test_rmi_symmetric_and_scale_lowers_it():
    gen = torch.Generator().manual_seed(1)
    g1 = torch.randn(40, 20, generator=gen, dtype=torch.float64) * 0.01
    g3 = torch.randn(40, 20, generator=gen, dtype=torch.float64) * 0.02 + 0.001
    H, S = E.similarity_matrix([g1, 2 * g1, g3])
    assert torch.allclose(S, S.T, atol=1e-12, rtol=0)
    assert float(S[0, 1]) < float(S[0, 0])
    # the joint entropy is that of the concatenation
    hj = E.proxy_entropy(torch.cat([g1.reshape(-1), g3.reshape(-1)]))
    rmi = (H[0] + H[2] - hj) / min(H[0], H[2])
    assert abs(float(S[0, 2]) - rmi) < 1e-10
    assert abs(H[1] - H[0] - math.log(2)) < 1e-10


def test_thresholds_are_row_means_without_diagonal():
    S = torch.tensor([[1.0, 0.9, 0.5], [0.9, 1.0, 0.7], [0.5, 0.7, 1.0]], dtype=torch.float64)
    tau = E.adaptive_thresholds(S)
    assert tau == pytest.approx([0.7, 0.8, 0.6], abs=1e-12)
    assert E.adaptive_thresholds(torch.ones(1, 1)) == [None]


def test_partition_two_blocks_of_identical_gradients():
    g = torch.randn(30, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1e-3
    grads = [g, g, g, 10 * g, 10 * g, 10 * g]
    _, S = E.similarity_matrix(grads)
    ivs = E.partition(S, E.adaptive_thresholds(S))
    assert ivs == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_partition_contiguous_disjoint_covering(seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(8, 8, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen)) * 1e-2
             for _ in range(7)]
    _, S = E.similarity_matrix(grads)
    ivs = E.partition(S, E.adaptive_thresholds(S))
    assert [i for iv in ivs for i in iv] == list(range(7))
    assert all(iv == list(range(iv[0], iv[-1] + 1)) for iv in ivs)
    # fixed thresholds: 0 merges everything, above every off-diagonal value splits everything
    assert E.partition(S, [0.0] * 7) == [list(range(7))]
    assert E.partition(S, [1.5] * 7) == [[i] for i in range(7)]


def test_hra_max_factors_sum_and_rounding():
    H = [-10.0, -9.0, -12.0, -11.0, -8.5]
    ivs = [[0, 1], [2], [3, 4]]
    ranks, Hk, F = E.allocate_ranks(H, ivs, 8)
    assert Hk == [-9.0, -12.0, -8.5]
    assert sum(F) == pytest.approx(1.0, abs=1e-12)
    T = len(ivs) * 8
    assert ranks == [round(f * T) for f in F]
    # paper's literal formula: the lowest entropy gets the largest factor (all H negative)
    assert F[1] == max(F)
    ranks_s, _, F_s = E.allocate_ranks(H, ivs, 8, score="shifted")
    assert F_s[2] == max(F_s) and F_s[1] == min(F_s)
    for score in ("paper", "shifted"):
        r_lr, _, _ = E.allocate_ranks(H, ivs, 8, score=score, rounding="largest_remainder")
        assert sum(r_lr) == T and min(r_lr) >= 1


def test_hra_clamps_zero_ranks_with_warning():
    H = [-1.0, -1000.0, -1.0]
    ivs = [[0], [1], [2]]
    with pytest.warns(UserWarning, match="clamped to 1"):
        ranks, _, _ = E.allocate_ranks(H, ivs, 1, score="shifted")
    assert min(ranks) >= 1
    with pytest.warns(UserWarning, match="clamped to 1"):
        ranks, _, _ = E.allocate_ranks(H, ivs, 1, score="shifted", rounding="largest_remainder")
    assert min(ranks) >= 1 and sum(ranks) == 3


# ------------------------------------------------------------------------------------------------
# the adapter on a model
# ------------------------------------------------------------------------------------------------

def test_identity_at_init_and_parameter_identity():
    base = tiny_bert()
    y0 = out(base)
    model = tiny_bert()
    calib, loss_fn = calibration()
    E.adapt(model, E.E2LoRAConfig(rank=4, alpha=8, calib_batches=2), calib=calib, loss_fn=loss_fn)
    torch.testing.assert_close(out(model), y0, atol=1e-6, rtol=0)
    plan = E.get_plan(model)
    expect = sum(r * (32 + 32) for t in plan.types.values() for r in t.ranks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # de-duplicated
    assert trainable == expect == plan.num_parameters() == E.trainable_parameters(model)
    assert set(plan.types) == {"encoder.layer.*.attention.self.query", "encoder.layer.*.attention.self.value"}


def _interval_model(sharing: str = "lora") -> nn.Module:
    model = tiny_bert()
    cfg = E.E2LoRAConfig(rank=4, alpha=8, sharing=sharing)
    plan = E.uniform_plan(model, cfg, intervals=2)  # intervals [[0, 1], [2, 3]] per type
    plan.types["encoder.layer.*.attention.self.query"].ranks = [3, 5]
    return E.apply_e2lora(model, plan, cfg)


def test_shared_parameters_are_the_same_objects():
    model = _interval_model()
    q = [model.get_submodule(f"encoder.layer.{i}.attention.self.query") for i in range(4)]
    assert q[0].e2lora_A["default"].weight is q[1].e2lora_A["default"].weight
    assert q[0].e2lora_B["default"].weight.data_ptr() == q[1].e2lora_B["default"].weight.data_ptr()
    assert q[1].e2lora_A["default"].weight is not q[2].e2lora_A["default"].weight
    assert q[0].rank["default"] == 3 and q[3].rank["default"] == 5
    ptrs = {layer.e2lora_A["default"].weight.data_ptr() for _, layer in E.e2lora_layers(model)}
    assert len(ptrs) == 4  # 2 types x 2 intervals
    assert E.trainable_parameters(model) == (3 + 5) * 64 + 2 * 4 * 64


def test_shared_gradient_is_sum_of_layer_gradients():
    model = _interval_model().double()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    x = x_in()
    layers = [model.get_submodule(f"encoder.layer.{i}.attention.self.query") for i in (0, 1)]
    B = layers[0].e2lora_B["default"].weight

    def loss() -> torch.Tensor:
        return model(x).last_hidden_state.square().mean()

    # per-layer contributions: detach the shared factor in one layer at a time
    grads = []
    for keep in (0, 1):
        other = layers[1 - keep]
        orig = other.factors

        def detached(name, other=other, orig=orig):
            A, Bw = orig(name)
            return A.detach(), Bw.detach()
        other.factors = detached
        B.grad = None
        loss().backward()
        grads.append(B.grad.clone())
        del other.factors
    B.grad = None
    loss().backward()
    torch.testing.assert_close(B.grad, grads[0] + grads[1], atol=1e-10, rtol=1e-8)
    # finite difference on one entry of the shared B
    eps = 1e-6
    with torch.no_grad():
        B[1, 2] += eps
        up = float(loss())
        B[1, 2] -= 2 * eps
        down = float(loss())
        B[1, 2] += eps
    assert abs((up - down) / (2 * eps) - float(B.grad[1, 2])) < 1e-6 * max(1.0, abs(float(B.grad[1, 2])))


def test_one_interval_per_layer_uniform_rank_equals_lora():
    from rankwise.adapt import lora

    ours = tiny_bert()
    cfg = E.E2LoRAConfig(rank=4, alpha=8)
    E.apply_e2lora(ours, E.uniform_plan(ours, cfg, intervals="each"), cfg)
    ref = lora.adapt(tiny_bert(), lora.LoraConfig(rank=4, alpha=8))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, layer in E.e2lora_layers(ours):
            theirs = ref.get_submodule(name)
            A, B = torch.randn(4, 32) * 0.1, torch.randn(32, 4) * 0.1
            layer.e2lora_A["default"].weight.copy_(A)
            layer.e2lora_B["default"].weight.copy_(B)
            theirs.lora_A["default"].weight.copy_(A)
            theirs.lora_B["default"].weight.copy_(B)
    torch.testing.assert_close(out(ours), out(ref), atol=1e-6, rtol=0)
    n_ref = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert E.trainable_parameters(ours) == n_ref == sum(p.numel() for p in ours.parameters() if p.requires_grad)


def test_merge_adds_the_shared_pair_to_each_layer_of_its_interval():
    model = _interval_model()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    W = {n: layer.base_layer.weight.detach().clone() for n, layer in E.e2lora_layers(model)}
    y = out(model)
    E.merge(model)
    for n, layer in E.e2lora_layers(model):
        A, B = layer.factors("default")
        torch.testing.assert_close(layer.base_layer.weight, W[n] + layer.scaling["default"] * B @ A, atol=1e-6,
                                   rtol=0)
    torch.testing.assert_close(out(model), y, atol=1e-5, rtol=0)
    with pytest.raises(RankwiseError):
        E.merge(model)
    E.unmerge(model)
    torch.testing.assert_close(out(model), y, atol=1e-5, rtol=0)


def test_sharelora_variant_slices_one_A_per_type():
    model = _interval_model("sharelora")
    q = [model.get_submodule(f"encoder.layer.{i}.attention.self.query") for i in range(4)]
    A = q[0].e2lora_A["default"].weight
    assert all(layer.e2lora_A["default"].weight is A for layer in q) and A.shape == (5, 32)
    assert q[0].e2lora_B["default"].weight is not q[1].e2lora_B["default"].weight
    assert [layer.factors("default")[0].shape[0] for layer in q] == [3, 3, 5, 5]
    plan = E.get_plan(model)
    expect = (5 * 32 + (3 + 3 + 5 + 5) * 32) + (4 * 32 + 16 * 32)  # query: A at max rank 5; value: uniform rank 4
    assert E.trainable_parameters(model) == plan.num_parameters() == expect


def test_save_load_restores_sharing_and_plan(tmp_path):
    model = tiny_bert()
    calib, loss_fn = calibration()
    E.adapt(model, E.E2LoRAConfig(rank=4, alpha=8, threshold=0.0), calib=calib, loss_fn=loss_fn)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    E.save_adapter(model, tmp_path / "a")
    other = tiny_bert()
    E.load_adapter(other, tmp_path / "a")
    assert torch.equal(out(model), out(other))
    ptrs = {layer.e2lora_A["default"].weight.data_ptr() for _, layer in E.e2lora_layers(other)}
    assert len(ptrs) == 2  # threshold 0: one interval per type
    assert E.get_plan(other).to_dict() == E.get_plan(model).to_dict()
    E.get_plan(model).save(tmp_path / "plan.json")
    assert E.E2LoRAPlan.load(tmp_path / "plan.json").to_dict() == E.get_plan(model).to_dict()
    # a plan file that breaks the partition rules is an ArtifactError
    bad = E.get_plan(model).to_dict()
    bad["types"][0]["intervals"] = [[0, 2], [1, 3]]
    E.E2LoRAPlan.from_dict(E.get_plan(model).to_dict())
    with pytest.raises(ArtifactError):
        E.E2LoRAPlan.from_dict(bad)


def test_plan_is_data_dependent():
    p1 = E.plan_e2lora(tiny_bert(6), *calibration(0, freq=1.0), E.E2LoRAConfig(rank=4))
    p2 = E.plan_e2lora(tiny_bert(6), *calibration(7, freq=0.05), E.E2LoRAConfig(rank=4))
    key = "encoder.layer.*.attention.self.query"
    assert p1.types[key].entropies != p2.types[key].entropies
    assert p1.to_dict()["types"] != p2.to_dict()["types"]


def test_block_granularity_and_cosine_share_one_partition():
    calib, loss_fn = calibration()
    for cfg in (E.E2LoRAConfig(rank=4, granularity="block"),
                E.E2LoRAConfig(rank=4, granularity="block", similarity="cosine")):
        plan = E.plan_e2lora(tiny_bert(6), calib, loss_fn, cfg)
        q, v = plan.types.values()
        assert q.intervals == v.intervals and q.ranks == v.ranks and q.entropies == v.entropies
        assert abs(sum(q.ranks) - 4 * len(q.intervals)) <= len(q.intervals) / 2


def test_ablation_switches():
    calib, loss_fn = calibration()
    hra_only = E.plan_e2lora(tiny_bert(6), calib, loss_fn, E.E2LoRAConfig(rank=4, lss=False))
    assert all(t.intervals == [[i] for i in range(6)] for t in hra_only.types.values())
    lss_only = E.plan_e2lora(tiny_bert(6), calib, loss_fn, E.E2LoRAConfig(rank=4, hra=False))
    assert all(set(t.ranks) == {4} for t in lss_only.types.values())


def test_single_layer_is_plain_lora():
    model = tiny_bert(1)
    calib, loss_fn = calibration()
    E.adapt(model, E.E2LoRAConfig(rank=4), calib=calib, loss_fn=loss_fn)
    for t in E.get_plan(model).types.values():
        assert t.intervals == [[0]] and t.ranks == [4]


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(rank=2.0), dict(alpha=0), dict(alpha=float("nan")),
                                    dict(threshold="fixed"), dict(threshold=1.5), dict(hra_score="max"),
                                    dict(rounding="floor"), dict(granularity="model"), dict(calib_batches=0),
                                    dict(lss=1), dict(similarity="kl"), dict(sharing="vera"),
                                    dict(depth_regex="layer"), dict(depth_regex="("), dict(dropout=1.0),
                                    dict(seed=1.5), dict(target=())])
def test_config_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        E.E2LoRAConfig(**kwargs)


def test_different_shapes_in_one_type_raise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    snap = snapshot(model)
    batches = [torch.randn(4, 16)]
    with pytest.raises(ValueError, match="different shapes"):
        E.adapt(model, E.E2LoRAConfig(rank=2), target=nn.Linear, calib=batches,
                loss_fn=lambda m, b: m(b).square().mean())
    assert_unchanged(model, snap)
    E.adapt(model, E.E2LoRAConfig(rank=2, depth_regex=None), target=nn.Linear, calib=batches,
            loss_fn=lambda m, b: m(b).square().mean())
    assert len(E.e2lora_layers(model)) == 3


def test_zero_and_nan_gradients_and_empty_loader_raise():
    model = tiny_bert()
    snap = snapshot(model)
    calib, loss_fn = calibration()
    with pytest.raises(ValueError, match="no batch"):
        E.adapt(model, E.E2LoRAConfig(), calib=[], loss_fn=loss_fn)
    with pytest.raises(ValueError, match="calibration batches"):
        E.adapt(model, E.E2LoRAConfig())
    with pytest.raises(ValueError, match="does not depend"):  # detached graph
        E.adapt(model, E.E2LoRAConfig(), calib=calib, loss_fn=lambda m, b: loss_fn(m, b).detach())
    # a loss that only sees the query layers: the value gradient is exactly zero
    def query_only(m, b):
        h = m.embeddings(b)
        return m.encoder.layer[0].attention.self.query(h).square().mean()
    with pytest.raises(ValueError, match="exactly zero"):
        E.adapt(model, E.E2LoRAConfig(), calib=calib, loss_fn=query_only)
    with pytest.raises(NumericalError):
        E.adapt(model, E.E2LoRAConfig(), calib=calib, loss_fn=lambda m, b: loss_fn(m, b) * float("nan"))
    assert_unchanged(model, snap)


def test_mixed_sign_entropies_raise_with_advice():
    model = tiny_bert()
    snap = snapshot(model)
    calib, loss_fn = calibration()
    with pytest.raises(NumericalError, match="Scale the calibration loss down"):
        E.adapt(model, E.E2LoRAConfig(), calib=calib, loss_fn=lambda m, b: loss_fn(m, b) * 1e5)
    assert_unchanged(model, snap)


def test_bad_rank_and_bad_plan_leave_model_unchanged():
    model = tiny_bert()
    calib, loss_fn = calibration()
    E.adapt(model, E.E2LoRAConfig(rank=2), calib=calib, loss_fn=loss_fn, name="first")
    snap = snapshot(model)
    with pytest.raises(ValueError, match="rank=33"):
        E.adapt(model, E.E2LoRAConfig(rank=33), calib=calib, loss_fn=loss_fn, name="second")
    with pytest.raises(ValueError, match="already has an adapter"):
        E.adapt(model, E.E2LoRAConfig(rank=2), calib=calib, loss_fn=loss_fn, name="first")
    plan = E.uniform_plan(tiny_bert(), E.E2LoRAConfig(rank=2))
    plan.types["encoder.layer.*.attention.self.query"].layers[0] = "encoder.layer.0.nope"
    with pytest.raises(ValueError, match="does not exist"):
        E.apply_e2lora(model, plan, name="third")
    with pytest.raises(ValueError, match="adapter name"):
        E.adapt(model, E.E2LoRAConfig(rank=2), calib=calib, loss_fn=loss_fn, name="a.b")
    assert_unchanged(model, snap)


def test_registered():
    entry = get("e2lora")
    assert entry.config is E.E2LoRAConfig and entry.entry is E.adapt
