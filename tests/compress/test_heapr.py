"""HEAPr: the correctness checks and bad inputs of shared/methods/heapr.md."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from rankwise import zoo
from rankwise.compress import heapr
from rankwise.compress.heapr import (
    ExpertMLP,
    HEAPrConfig,
    UnfusedExperts,
    atom_scores,
    calibrate,
    drop_experts,
    heapr_compress,
    heapr_prune,
    lm_forward,
    load_pruned,
    moe_layers,
    prune_atoms,
    save_pruned,
    select_atoms,
    unfuse_experts,
)
from rankwise.core.errors import ArtifactError

D = torch.float64


def ids(seed: int = 0, shape=(4, 24), vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.fixture(scope="module")
def calibrated():
    """A tiny random Qwen2-MoE, unfused, with its calibration statistics on two batches."""
    m = zoo.tiny_moe(seed=0)
    unfuse_experts(m)
    batches = [ids(1), ids(2)]
    return m, batches, calibrate(m, batches)


# ------------------------------------------------------------------------------------------------
# un-fusing


@pytest.mark.parametrize("style", ["qwen2_moe", "mixtral"])
def test_unfuse_is_exact(style: str) -> None:
    m = zoo.tiny_moe(seed=3, style=style)
    x = ids(0)
    ref = logits(m, x)
    names = unfuse_experts(m)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for n in names:
        assert isinstance(m.get_submodule(n), UnfusedExperts)
        ex = m.get_submodule(n)[0]
        assert isinstance(ex.gate_proj, nn.Linear) and isinstance(ex.down_proj, nn.Linear)
    assert torch.equal(logits(m, x), ref)           # identical logits, bit for bit
    assert unfuse_experts(m) == names                # idempotent


def test_unfused_weights_are_the_fused_slices() -> None:
    m = zoo.tiny_moe(seed=1)
    fused = copy.deepcopy(m.model.layers[0].mlp.experts)
    unfuse_experts(m)
    ex = m.model.layers[0].mlp.experts[5]
    inter = fused.down_proj.shape[2]
    assert torch.equal(ex.gate_proj.weight, fused.gate_up_proj[5, :inter])
    assert torch.equal(ex.up_proj.weight, fused.gate_up_proj[5, inter:])
    assert torch.equal(ex.down_proj.weight, fused.down_proj[5])


def test_model_without_moe_blocks_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="no recognised mixture-of-experts block; supported: Qwen2MoE"):
        unfuse_experts(zoo.tiny_llama())
    with pytest.raises(TypeError, match="mixture-of-experts"):
        heapr_compress(zoo.tiny_llama(), calib=[ids(0)])


# ------------------------------------------------------------------------------------------------
# the score


def _explicit(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(a, g) of every expert's down_proj, by plain autograd (no rankwise statistics code)."""
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    handles = []
    for ln, layer in moe_layers(model).items():
        for e, ex in enumerate(layer.experts):
            key = f"{ln}/{e}"
            seen[key] = []

            def hook(mod, args, out, key=key):
                out.retain_grad()
                seen[key].append((args[0].detach(), out))
            handles.append(ex.down_proj.register_forward_hook(hook))
    for b in batches:
        model.zero_grad()
        lm_forward(model, b).loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return {k: [(a.double(), y.grad.double()) for a, y in v] for k, v in seen.items()}


def test_score_equals_explicit_loops(calibrated) -> None:
    m, batches, stats = calibrated
    scores = atom_scores(m, stats)
    raw = _explicit(copy.deepcopy(m), batches)
    for ln, layer in moe_layers(m).items():
        for e, ex in enumerate(layer.experts):
            pairs = raw[f"{ln}/{e}"]
            if not pairs:
                assert bool((scores[ln][e] == -1).all())
                continue
            A = torch.cat([a for a, _ in pairs])
            Gs = torch.cat([g for _, g in pairs])
            T = A.shape[0]
            assert stats[ln][e].count == T
            G = sum(torch.outer(g, g) for g in Gs) / T
            assert torch.allclose(G, stats[ln][e].G(), rtol=1e-9, atol=1e-18)
            assert torch.allclose(G, G.T) and float(torch.linalg.eigvalsh(G).min()) > -1e-12 * float(G.abs().max())
            U = ex.down_proj.weight.detach().double()
            for j in range(ex.width):
                u = U[:, j]
                s_closed = 0.5 * float((A[:, j] ** 2).mean()) * float(u @ G @ u)
                s_eq16 = sum(0.5 * float((u * A[t, j]) @ G @ (u * A[t, j])) for t in range(T)) / T
                assert scores[ln][e][j].item() == pytest.approx(s_closed, rel=1e-8, abs=1e-30)
                assert scores[ln][e][j].item() == pytest.approx(s_eq16, rel=1e-8, abs=1e-30)
            assert bool((scores[ln][e] >= 0).all())


def test_per_token_and_taylor_against_loops(calibrated) -> None:
    m, batches, stats = calibrated
    pt = atom_scores(m, stats, HEAPrConfig(fisher="per_token"))
    ty = atom_scores(m, stats, HEAPrConfig(score="taylor"))
    en = atom_scores(m, stats, HEAPrConfig(score="energy"))
    raw = _explicit(copy.deepcopy(m), batches)
    ln = next(iter(moe_layers(m)))
    for e, ex in enumerate(moe_layers(m)[ln].experts):
        if not raw[f"{ln}/{e}"]:
            continue
        A = torch.cat([a for a, _ in raw[f"{ln}/{e}"]])
        Gs = torch.cat([g for _, g in raw[f"{ln}/{e}"]])
        U = ex.down_proj.weight.detach().double()
        c = A * (Gs @ U)                              # c_tj = a_tj g_t . u_j
        assert torch.allclose(pt[ln][e], 0.5 * c.square().mean(0), rtol=1e-8, atol=1e-30)
        assert torch.allclose(ty[ln][e], c.mean(0).abs(), rtol=1e-8, atol=1e-30)
        assert torch.allclose(en[ln][e], A.square().mean(0) * U.square().sum(0), rtol=1e-8, atol=1e-30)


def test_per_token_equals_aggregate_when_gradients_are_equal() -> None:
    """With a loss linear in the expert outputs (router weights 1), g_t = v for every token."""
    torch.manual_seed(0)
    H, inter = 6, 5
    experts = UnfusedExperts([ExpertMLP(nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False),
                                        nn.Linear(inter, H, bias=False), nn.SiLU()) for _ in range(3)])
    wrapper = nn.Module()
    wrapper.experts = experts
    v = torch.randn(H)

    def forward(model, batch):
        x, idx = batch
        return model.experts(x, idx, torch.ones(idx.shape))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(20, H, generator=g), torch.randint(0, 3, (20, 1), generator=g)) for _ in range(2)]
    stats = calibrate(wrapper, batches, forward=forward, loss_fn=lambda out, b: (out @ v).sum())
    agg = atom_scores(wrapper, stats, HEAPrConfig())
    tok = atom_scores(wrapper, stats, HEAPrConfig(fisher="per_token"))
    for a, b in zip(agg["experts"], tok["experts"]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-30)


def test_router_weight_scales_G_by_c_squared() -> None:
    """g is taken before the router weight: router weight x c with down_proj / c (the same function)
    multiplies G_i by c^2 and leaves the scores unchanged."""
    m = zoo.tiny_moe(seed=2)
    unfuse_experts(m)
    batches = [ids(4)]
    before = calibrate(m, batches)
    s_before = atom_scores(m, before)
    block = m.model.layers[0].mlp
    e, c = 3, 4.0
    orig = block.gate.forward

    def scaled(h):
        logits_, w, idx = orig(h)
        return logits_, torch.where(idx == e, w * c, w), idx
    block.gate.forward = scaled
    with torch.no_grad():
        block.experts[e].down_proj.weight /= c
    after = calibrate(m, batches)
    ln = "model.layers.0.mlp.experts"
    assert after[ln][e].count == before[ln][e].count > 0
    assert torch.allclose(after[ln][e].G(), c * c * before[ln][e].G(), rtol=1e-5, atol=1e-20)
    assert torch.allclose(atom_scores(m, after)[ln][e], s_before[ln][e], rtol=1e-5, atol=1e-25)
    other = (e + 1) % 8
    assert torch.allclose(after[ln][other].G(), before[ln][other].G(), rtol=1e-5, atol=1e-20)


def test_unrouted_experts_score_minus_one_and_are_pruned_first() -> None:
    m = zoo.tiny_moe(seed=0)
    unfuse_experts(m)
    stats = calibrate(m, [ids(0, shape=(1, 2))])    # 2 tokens x top-2: at most 4 of 8 experts per layer
    scores = atom_scores(m, stats)
    for ln, row in stats.items():
        idle = [e for e, s in enumerate(row) if s.count == 0]
        assert len(idle) >= 4
        for e in idle:
            assert bool((scores[ln][e] == heapr.UNROUTED).all())
    with pytest.warns(UserWarning, match="width 0"):
        rep = heapr_prune(m, scores, HEAPrConfig(prune_ratio=0.25, scope="layer"))
    for ln, row in stats.items():
        idle = [e for e, s in enumerate(row) if s.count == 0]
        removed = sum(rep.widths_before[ln]) - sum(rep.kept_per_expert[ln])
        assert sum(rep.widths_before[ln][e] - rep.kept_per_expert[ln][e] for e in idle) == \
            min(removed, sum(rep.widths_before[ln][e] for e in idle))


# ------------------------------------------------------------------------------------------------
# selection and pruning


@pytest.mark.parametrize("scope", ["global", "layer"])
@pytest.mark.parametrize("p", [0.1, 0.25, 0.5])
def test_exact_number_kept_and_parameter_count(calibrated, scope: str, p: float) -> None:
    m0, _, stats = calibrated
    m = copy.deepcopy(m0)
    cfg = HEAPrConfig(prune_ratio=p, scope=scope)
    scores = atom_scores(m, stats, cfg)
    keep = select_atoms(scores, cfg)
    rep = prune_atoms(m, keep)
    H = m.config.hidden_size
    if scope == "global":
        assert rep.atoms_after == int(rep.atoms_before * (1 - p))
    else:
        for ln in rep.widths_before:
            assert sum(rep.kept_per_expert[ln]) == int(sum(rep.widths_before[ln]) * (1 - p))
    assert rep.params_before - rep.params_after == 3 * H * (rep.atoms_before - rep.atoms_after)
    assert rep.params_after == sum(q.numel() for q in m.parameters())
    # the kept atoms are the top scores
    allv = torch.cat([s for row in scores.values() for s in row])
    kept = torch.cat([s[k] for ln in scores for s, k in zip(scores[ln], keep[ln])])
    if scope == "global":
        assert float(kept.min()) >= float(torch.sort(allv, descending=True).values[kept.numel() - 1])


def test_p_zero_is_bit_identical_to_the_fused_model() -> None:
    m = zoo.tiny_moe(seed=5)
    x = ids(7)
    ref = logits(m, x)
    rep = heapr_compress(m, HEAPrConfig(prune_ratio=0.0), calib=[ids(1)])
    assert rep.atoms_after == rep.atoms_before and rep.params_after == rep.params_before
    assert torch.equal(logits(m, x), ref)


def test_slicing_equals_masking(calibrated) -> None:
    m0, _, stats = calibrated
    sliced, masked = copy.deepcopy(m0), copy.deepcopy(m0)
    cfg = HEAPrConfig(prune_ratio=0.4)
    keep = select_atoms(atom_scores(sliced, stats, cfg), cfg)
    prune_atoms(sliced, keep)
    with torch.no_grad():
        for ln, layer in moe_layers(masked).items():
            for ex, k in zip(layer.experts, keep[ln]):
                drop = torch.ones(ex.width, dtype=torch.bool)
                drop[k] = False
                ex.down_proj.weight[:, drop] = 0.0   # restoring zeros in the removed columns
    x = ids(9)
    assert torch.allclose(logits(sliced, x), logits(masked, x), rtol=1e-5, atol=1e-6)


def test_zero_width_expert_outputs_zeros() -> None:
    ex = ExpertMLP(nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False), nn.Linear(3, 4, bias=False), nn.SiLU())
    ex.keep(torch.arange(0))
    assert ex.width == 0
    assert torch.equal(ex(torch.randn(5, 4)), torch.zeros(5, 4))


def test_non_gated_experts_are_supported() -> None:
    torch.manual_seed(0)
    H, inter = 6, 8
    wrapper = nn.Module()
    wrapper.experts = UnfusedExperts([ExpertMLP(None, nn.Linear(H, inter, bias=False), nn.Linear(inter, H, bias=False),
                                                nn.GELU()) for _ in range(2)])

    def forward(model, batch):
        x, idx = batch
        return model.experts(x, idx, torch.full(idx.shape, 0.5))

    batches = [(torch.randn(16, H), torch.randint(0, 2, (16, 1)))]
    stats = calibrate(wrapper, batches, forward=forward, loss_fn=lambda out, b: out.square().sum())
    before = sum(q.numel() for q in wrapper.parameters())
    rep = heapr_prune(wrapper, atom_scores(wrapper, stats), HEAPrConfig(prune_ratio=0.5))
    assert rep.atoms_after == 8
    assert before - sum(q.numel() for q in wrapper.parameters()) == 2 * H * 8   # atom = row of W_in, column of W_out


def test_drop_experts_removes_the_least_frequent(calibrated) -> None:
    m0, _, stats = calibrated
    m = copy.deepcopy(m0)
    freq = heapr.expert_frequency(stats)
    rep = drop_experts(m, freq, 2)
    for ln, f in freq.items():
        zero = [e for e, w in enumerate(rep.kept_per_expert[ln]) if w == 0]
        assert len(zero) == 2
        assert max(f[e] for e in zero) <= min(f[e] for e in range(8) if e not in zero)
    m2 = copy.deepcopy(m0)
    rep2 = heapr_prune(m2, atom_scores(m2, stats), HEAPrConfig(prune_ratio=0.25))
    assert rep.params_after == rep2.params_after      # the same parameter count as p = 0.25


# ------------------------------------------------------------------------------------------------
# save / reload


def test_save_and_reload_unequal_widths(calibrated, tmp_path) -> None:
    m0, _, stats = calibrated
    m = copy.deepcopy(m0)
    rep = heapr_prune(m, atom_scores(m, stats), HEAPrConfig(prune_ratio=0.3))
    assert len(set(rep.kept_per_expert["model.layers.0.mlp.experts"])) > 1
    save_pruned(m, tmp_path / "out", report=rep)
    m2 = load_pruned(tmp_path / "out")
    assert [ex.width for ex in moe_layers(m2)["model.layers.1.mlp.experts"].experts] == \
        rep.kept_per_expert["model.layers.1.mlp.experts"]
    x = ids(11)
    assert torch.equal(logits(m2, x), logits(m, x))
    meta = json.loads((tmp_path / "out" / "heapr.json").read_text())
    assert meta["widths"] == rep.kept_per_expert
    with pytest.raises(ArtifactError, match="not empty"):
        save_pruned(m, tmp_path / "out", overwrite=False)


def test_reload_refuses_damaged_directories(calibrated, tmp_path) -> None:
    m = copy.deepcopy(calibrated[0])
    save_pruned(m, tmp_path / "a")
    with pytest.raises(ArtifactError, match="not a HEAPr-pruned"):
        load_pruned(tmp_path)
    meta = json.loads((tmp_path / "a" / "heapr.json").read_text())
    meta["widths"]["model.layers.0.mlp.experts"][0] = 7
    (tmp_path / "a" / "heapr.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="does not fit"):
        load_pruned(tmp_path / "a")


# ------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("kw, match", [
    ({"prune_ratio": 1.0}, "HEAPrConfig.prune_ratio must be"),
    ({"prune_ratio": -0.1}, "HEAPrConfig.prune_ratio must be"),
    ({"scope": "block"}, "HEAPrConfig.scope must be"),
    ({"fisher": "diag"}, "HEAPrConfig.fisher must be"),
    ({"score": "magnitude"}, "HEAPrConfig.score must be"),
])
def test_bad_config(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        HEAPrConfig(**kw)


def test_bad_keep_leaves_the_model_unchanged(calibrated) -> None:
    m = copy.deepcopy(calibrated[0])
    widths = {ln: layer.widths for ln, layer in moe_layers(m).items()}
    keep = {ln: [torch.arange(w) for w in ws] for ln, ws in widths.items()}
    keep["model.layers.1.mlp.experts"][3] = torch.tensor([2, 1])
    with pytest.raises(ValueError, match="sorted"):
        prune_atoms(m, keep)
    assert {ln: layer.widths for ln, layer in moe_layers(m).items()} == widths


def test_empty_calibration_is_an_error() -> None:
    from rankwise.core.stats import CalibrationError

    m = zoo.tiny_moe()
    with pytest.raises(CalibrationError, match="empty"):
        calibrate(m, [])


@pytest.mark.slow
def test_score_predicts_the_true_loss_change_near_a_minimum() -> None:
    """Spearman > 0.5 between s_ij and the measured loss increase of masking atom (i, j), on a tiny
    MoE trained to (near) zero loss on its calibration batches (OBS assumes a minimum)."""
    from scipy.stats import spearmanr

    m = zoo.tiny_moe(seed=0, hidden_size=32, num_hidden_layers=1, moe_intermediate_size=16, vocab_size=64)
    batches = [ids(s, shape=(4, 16), vocab=64) for s in (0, 1)]
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m.train()
    for _ in range(150):
        for b in batches:
            opt.zero_grad()
            lm_forward(m, b).loss.backward()
            opt.step()
    m.eval()
    stats = calibrate(m, batches)
    ln = "model.layers.0.mlp.experts"
    scores = atom_scores(m, stats)[ln]

    def loss() -> float:
        with torch.no_grad():
            return sum(float(lm_forward(m, b).loss) for b in batches) / len(batches)
    base = loss()
    s, d = [], []
    for e, ex in enumerate(moe_layers(m)[ln].experts):
        for j in range(0, ex.width, 2):
            W = ex.down_proj.weight
            old = W[:, j].clone()
            with torch.no_grad():
                W[:, j] = 0.0
            d.append(loss() - base)
            with torch.no_grad():
                W[:, j] = old
            s.append(float(scores[e][j]))
    assert spearmanr(s, d).statistic > 0.5
