"""PAVE: the spec's correctness checks and bad inputs, on a tiny seeded BERT (fast) and learnware's RKME."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rankwise.core.errors import ArtifactError, SelectionError
from rankwise.core.io import model_fingerprint
from rankwise.science import pave as pv


def _bert(seed: int = 0, layers: int = 2):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(seed)
    return BertModel(cfg).eval()


def _data(rule: int, n: int = 32, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random token sequences; the label says whether token ``rule`` occurs (rule tokens are planted in half)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (n, 12), generator=g)
    y = torch.arange(n) % 2
    ids[y == 1, 3] = rule
    ids[y == 0] = torch.where(ids[y == 0] == rule, 11, ids[y == 0])
    mask = torch.ones_like(ids)
    mask[::3, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}, y


CFG = pv.PaveConfig(rank=4, steps=8, batch_size=8)


@pytest.fixture(scope="module")
def bert():
    return _bert()


@pytest.fixture(scope="module")
def fit(bert):
    x, y = _data(5)
    return pv.fit_spec(bert, x, y, CFG)


def test_base_model_unchanged(bert) -> None:
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    fp = model_fingerprint(bert)
    x, y = _data(5)
    pv.spec_from_inputs(bert, x, y, CFG)
    assert model_fingerprint(bert) == fp
    assert all(torch.equal(before[k], v) for k, v in bert.state_dict().items())
    assert not any("lora" in n for n, _ in bert.named_modules())


def test_deterministic_and_shapes(bert, fit) -> None:
    x, y = _data(5)
    again = pv.spec_from_inputs(bert, x, y, CFG)
    assert torch.equal(fit.spec.vector(), again.vector())  # bitwise on CPU
    spec = fit.spec
    assert len(spec.modules()) == 2 * 3  # 2 layers x query/key/value
    for m in spec.modules():
        assert spec.tensors[f"{m}.lora_B"].shape == (32, CFG.rank)
    assert spec.tensors["head.weight"].shape == (2, 32) and spec.tensors["head.bias"].shape == (2,)
    assert spec.num_parameters() == 6 * 32 * 4 + 2 * 32 + 2
    assert spec.fingerprint == model_fingerprint(bert) and spec.config == CFG.to_dict()
    other = pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=4, steps=8, batch_size=8, seed=1))
    assert not torch.equal(other.vector(), spec.vector())  # the seed matters (data order, dropout)


def test_only_b_and_head_train_and_a_is_shared(fit) -> None:
    for name, a, b in fit.factors:
        assert torch.equal(a.detach(), pv.shared_a(name, a.shape[1], CFG.rank, CFG.a_seed))
        assert not a.requires_grad and b.requires_grad
        assert float(b.detach().abs().sum()) > 0
    trainable = {n for n, p in fit.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_B" in n for n in trainable)
    assert float(fit.head.weight.detach().abs().sum()) > 0


def test_shared_a_depends_on_name_seed_only() -> None:
    a = pv.shared_a("encoder.layer.4.attention.self.query", 384, 16, 3407)
    assert torch.equal(a, pv.shared_a("encoder.layer.4.attention.self.query", 384, 16, 3407))
    assert not torch.equal(a, pv.shared_a("encoder.layer.5.attention.self.query", 384, 16, 3407))
    assert not torch.equal(a, pv.shared_a("encoder.layer.4.attention.self.query", 384, 16, 1))
    assert float(a.abs().max()) <= 1.0 / math.sqrt(384) + 1e-6  # kaiming-uniform(a = sqrt 5) bound


def test_peft_backend_gives_the_same_spec(bert, fit) -> None:
    pytest.importorskip("peft")
    x, y = _data(5)
    peft_spec = pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=4, steps=8, batch_size=8, backend="peft"))
    torch.testing.assert_close(peft_spec.vector(), fit.spec.vector(), atol=1e-6, rtol=0)


def test_layers_restrict_the_targets(bert) -> None:
    x, y = _data(5)
    spec = pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=4, steps=2, batch_size=8, layers=(1,)))
    assert spec.modules() == [f"encoder.layer.1.attention.self.{p}" for p in ("query", "key", "value")]


def test_top_encoder_on_cached_outputs_matches_the_full_model(bert) -> None:
    x, y = _data(5)
    cfg = pv.PaveConfig(rank=4, steps=4, batch_size=8, layers=(1,))
    full = pv.spec_from_inputs(bert, x, y, cfg)
    with torch.no_grad():
        h = bert(**x, output_hidden_states=True).hidden_states[1]  # the output of layer 0, cached
    top = pv.spec_from_inputs(pv.TopEncoder(bert, (1,)), {"hidden": h, "attention_mask": x["attention_mask"]}, y, cfg)
    assert top.modules() == full.modules()
    torch.testing.assert_close(top.vector(), full.vector(), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="layers must be indices"):
        pv.TopEncoder(bert, (2,))


def test_trace_formula_and_b_cosine_approximates_delta_cosine() -> None:
    g = torch.Generator().manual_seed(0)
    a = pv.shared_a("m", 384, 16, 3407)
    worst = 0.0
    for _ in range(20):
        bu = torch.randn(64, 16, generator=g, dtype=torch.float64)
        bk = 0.7 * bu + torch.randn(64, 16, generator=g, dtype=torch.float64)  # correlated pairs
        t, d = pv.trace_inner(bu, bk, a), pv.delta_inner(bu, bk, a)
        assert abs(t - d) <= 1e-5 * abs(d)
        cb = float(torch.nn.functional.cosine_similarity(bu.reshape(-1), bk.reshape(-1), dim=0))
        worst = max(worst, abs(cb - pv.delta_cosine([bu], [bk], [a])))
    assert worst <= 0.05


def test_score_distance_and_cosine_properties(fit, bert) -> None:
    assert pv.score(0.0) == 50.0
    grid = [-1.0, -0.5, -0.1, 0.0, 0.05, 0.3, 1.0]
    scores = [pv.score(c) for c in grid]
    assert all(a < b for a, b in zip(scores, scores[1:]))
    assert all(0.0 <= pv.distance(c) <= 1.0 for c in grid) and pv.distance(1.0) == 0.0
    assert pv.score(1.0) == pytest.approx(100 / (1 + math.exp(-10)))
    s = fit.spec
    x, y = _data(7, seed=3)
    t = pv.spec_from_inputs(bert, x, y, CFG)
    assert pv.cosine(s, s) == pytest.approx(1.0, abs=1e-12)
    assert pv.cosine(s, t) == pv.cosine(t, s)
    assert pv.cosine(s.scaled(3.5), t) == pytest.approx(pv.cosine(s, t), abs=1e-7)  # float32 tensors


def test_same_task_disjoint_samples_more_similar_than_other_task(bert) -> None:
    cfg = pv.PaveConfig(rank=4, steps=30, batch_size=8, lr=3e-3)
    x1, y1 = _data(5, n=48, seed=1)
    x2, y2 = _data(5, n=48, seed=2)  # same rule, another sample
    x3, y3 = _data(7, n=48, seed=3)
    x3, y3 = x3, 1 - y3  # another rule, labels flipped too
    s1, s2, s3 = (pv.spec_from_inputs(bert, x, y, cfg) for x, y in ((x1, y1), (x2, y2), (x3, y3)))
    assert pv.cosine(s1, s2) > pv.cosine(s1, s3)
    ranking = pv.identify(s1, {"same": s2, "other": s3})
    assert ranking.names() == ["same", "other"] and ranking.best.score > 50


def test_identify_result(fit, bert) -> None:
    x, y = _data(7, seed=3)
    t = pv.spec_from_inputs(bert, x, y, CFG)
    res = pv.identify(fit.spec, [t, fit.spec])
    assert res.names() == ["1", "0"] and res.matches[0].cosine == pytest.approx(1.0)
    assert res.above(res.matches[1].score + 1e-9) == [res.matches[0]]
    m = res.matches[1]
    assert m.score == pytest.approx(pv.score(m.cosine)) and m.distance == pytest.approx((1 - m.cosine) / 2)


def test_l1_penalty_kinds() -> None:
    b = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    assert float(pv.l1_penalty([b], "induced")) == 4.0  # largest absolute column sum
    assert float(pv.l1_penalty([b], "elementwise")) == 6.5
    assert float(pv.l1_penalty([b, 2 * b], "induced")) == 6.0  # (4 + 8) / 2 tensors
    cfg = pv.PaveConfig(steps=100)
    assert pv.lr_factor(0, cfg) < 1.0 and pv.lr_factor(3, cfg) == pytest.approx(1.0, abs=1e-3)
    assert pv.lr_factor(99, cfg) < 0.01


def test_save_load_roundtrip_and_atomic(tmp_path: Path, fit) -> None:
    path = fit.spec.save(tmp_path / "a.pave.safetensors")
    back = pv.PaveSpec.load(path)
    assert torch.equal(back.vector(), fit.spec.vector()) and back.fingerprint == fit.spec.fingerprint
    assert back.config == fit.spec.config and back.modules() == fit.spec.modules()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ArtifactError):
        fit.spec.save(blocker / "b.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pave.safetensors", "file"]


# -- bad inputs ----------------------------------------------------------------------------------

def test_refuses_specs_of_different_base_models_and_configs(fit) -> None:
    x, y = _data(5)
    other_model = pv.spec_from_inputs(_bert(seed=1), x, y, CFG)
    with pytest.raises(ValueError, match="different base models"):
        pv.identify(fit.spec, {"x": other_model})
    other_rank = pv.spec_from_inputs(_bert(), x, y, pv.PaveConfig(rank=2, steps=2, batch_size=8))
    with pytest.raises(ValueError, match="rank = 4 vs 2"):
        pv.cosine(fit.spec, other_rank)


def test_zero_norm_and_nan_specs(fit) -> None:
    zero = pv.PaveSpec({n: torch.zeros_like(t) for n, t in fit.spec.tensors.items()}, dict(fit.spec.config),
                       fit.spec.fingerprint)
    with pytest.raises(ValueError, match="zero norm"):
        pv.identify(fit.spec, {"z": zero})
    with pytest.raises(ValueError, match="zero norm"):
        pv.identify(zero, {"s": fit.spec})
    bad = dict(fit.spec.tensors)
    bad["head.bias"] = torch.tensor([float("nan"), 0.0])
    with pytest.raises(ValueError, match="NaN"):
        pv.PaveSpec(bad, dict(fit.spec.config))


def test_bad_data(bert) -> None:
    x, y = _data(5)
    with pytest.raises(ValueError, match="empty data"):
        pv.spec_from_inputs(bert, {k: v[:0] for k, v in x.items()}, y[:0], CFG)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        pv.spec_from_inputs(bert, x, y + 1, CFG)
    with pytest.raises(ValueError, match="integer class indices"):
        pv.spec_from_inputs(bert, x, y.float(), CFG)
    with pytest.raises(ValueError, match="attention_mask"):
        pv.spec_from_inputs(bert, {"input_ids": x["input_ids"]}, y, CFG)
    with pytest.raises(ValueError, match="exceeds min"):
        pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=33, steps=1))
    with pytest.raises(SelectionError):
        pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=4, steps=1, target_modules=("q_proj",)))
    with pytest.raises(SelectionError):
        pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=4, steps=1, layers=(7,)))


def test_pave_spec_bad_texts(bert) -> None:
    with pytest.raises(ValueError, match="empty data"):
        pv.pave_spec(bert, None, [], [])
    with pytest.raises(ValueError, match="2 texts but 1 labels"):
        pv.pave_spec(bert, None, ["a b", "c d"], [0])
    with pytest.raises(TypeError, match="not one str"):
        pv.pave_spec(bert, None, "a b", [0])
    with pytest.raises(ValueError, match="class indices"):
        pv.pave_spec(bert, None, ["a b"], ["yes"])


def test_diverged_fine_tune_is_refused(bert) -> None:
    x, y = _data(5)
    with pytest.raises(ValueError, match="diverged"):
        pv.spec_from_inputs(bert, x, y, pv.PaveConfig(rank=4, steps=3, batch_size=8, lr=float("1e300"),
                                                       max_grad_norm=1e300, l1_lambda=1e300))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="PaveConfig.rank must be an int >= 1, got 0"):
        pv.PaveConfig(rank=0)
    with pytest.raises(ValueError, match="PaveConfig.l1_kind"):
        pv.PaveConfig(l1_kind="frobenius")
    with pytest.raises(ValueError, match="PaveConfig.layers"):
        pv.PaveConfig(layers=4)
    with pytest.raises(ValueError, match="PaveConfig.train"):
        pv.PaveConfig(train="AB")
    with pytest.raises(ValueError, match="unknown field"):
        pv.PaveConfig.from_dict({"rank": 4, "nope": 1})
    assert pv.PaveConfig.from_dict(pv.PaveConfig(layers=(5, 4)).to_dict()).layers == (4, 5)


def test_load_refuses_other_files(tmp_path: Path, fit) -> None:
    from rankwise.core.io import save_tensors

    other = save_tensors(tmp_path / "other.safetensors", {"w": torch.ones(2)}, {"kind": "rankwise.adapter_state"})
    with pytest.raises(ArtifactError, match="not a PAVE spec"):
        pv.PaveSpec.load(other)
    path = fit.spec.save(tmp_path / "s.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        pv.PaveSpec.load(path)
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ArtifactError, match="truncated"):
        pv.PaveSpec.load(tmp_path / "short.safetensors")


# -- RKME through learnware ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clusters() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    c1 = torch.randn(1, 16, generator=g)
    c2 = torch.randn(1, 16, generator=g)
    return (c1 + 0.3 * torch.randn(60, 16, generator=g), c2 + 0.3 * torch.randn(60, 16, generator=g))


def test_rkme_optimisation_decreases_mmd_to_data(clusters) -> None:
    pytest.importorskip("learnware")
    pytest.importorskip("fast_pytorch_kmeans")
    x = clusters[0]
    # the beta step of learnware's optimisation (a non-negative QP) minimises MMD^2 for fixed Z: it beats
    # uniform weights on the same points. (Its Z step does not decrease MMD^2 here: its data term is twice
    # the exact gradient's; docs/methods/pave.md gives the numbers.)
    for steps in (0, 3):
        fitted = pv.rkme_spec(x, k=10, steps=steps, seed=0)
        uniform = pv.RKMESpec(fitted.z, torch.full_like(fitted.beta, 1 / len(fitted.beta)), fitted.gamma, fitted.n)
        assert pv.rkme_data_mmd(fitted, x) < pv.rkme_data_mmd(uniform, x)
        assert pv.rkme_data_mmd(fitted, x) < 0.1 * pv.rkme_data_mmd(fitted, clusters[1])
    a = pv.rkme_spec(x, k=10, seed=0)
    assert pv.rkme_mmd(a, a) == pytest.approx(0.0, abs=1e-12)
    b = pv.rkme_spec(clusters[1], k=10, seed=0)
    assert pv.rkme_mmd(a, b) == pytest.approx(a.learnware.dist(b.learnware), rel=1e-9)
    same = pv.rkme_spec(clusters[0].flip(0), k=10, seed=1)
    assert pv.rkme_identify(same, {"a": a, "b": b})[0][0] == "a"
    assert torch.equal(pv.rkme_spec(x, k=10, seed=0).z, a.z)  # seeded k-means


def test_rkme_bad_inputs() -> None:
    pytest.importorskip("learnware")
    with pytest.raises(ValueError, match="NaN"):
        pv.rkme_spec(torch.full((4, 3), float("nan")))
    with pytest.raises(ValueError, match=r"\(N >= 1, d\)"):
        pv.rkme_spec(torch.zeros(5))
