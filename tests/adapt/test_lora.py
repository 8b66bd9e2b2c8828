"""Reference LoRA: the layer math, named adapters, rsLoRA, dropout, merging, AdapterState, save/load, bad inputs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.adapt import lora
from rankwise.adapt.lora import LoraConfig
from rankwise.core import io
from rankwise.core.errors import ArtifactError, RankwiseError, SelectionError
from rankwise.core.lora import AdapterState, LoraLinear, add_lora, get_state, lora_layers, set_state


def _mlp(seed: int = 0) -> nn.Module:
    return contract.tiny_model("mlp", seed)


def _bert(seed: int = 0, hidden: int = 32) -> nn.Module:
    return contract.tiny_model("bert", seed, hidden=hidden)


def _snapshot(model):
    return ([(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()})


def _same(model, snap):
    types, state, grads = snap
    assert [(n, type(m)) for n, m in model.named_modules()] == types
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items())


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"rank": 0}, "rank"), ({"rank": -2}, "rank"), ({"rank": 2.0}, "rank"), ({"rank": True}, "rank"),
    ({"alpha": 0}, "alpha"), ({"alpha": float("nan")}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"dropout": -0.1}, "dropout"), ({"use_rslora": 1}, "use_rslora"), ({"target": ()}, "target"),
    ({"target": ("query", 3)}, "target"), ({"init": "pissa"}, "init"), ({"seed": "1"}, "seed"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LoraConfig.{field}"):
        LoraConfig(**kwargs)


def test_config_defaults_and_normalisation():
    cfg = LoraConfig(target="query", alpha=16)
    assert cfg.target == ("query",) and cfg.alpha == 16.0 and cfg.rank == 8 and cfg.init == "kaiming"
    assert LoraConfig(target=["a", "b"]).target == ("a", "b")
    with pytest.raises(Exception):
        cfg.rank = 4  # frozen


def test_registered():
    from rankwise.core import registry

    entry = registry._ENTRIES["lora"]
    assert entry.entry is lora.adapt and entry.config is LoraConfig and entry.kind == "reference"


# --------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------

def test_layer_forward_matches_equation():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = LoraLinear(copy.deepcopy(base))
    layer.add_adapter("a", rank=3, alpha=6.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(7, 6)
    assert torch.equal(layer(x), base(x))  # added, not active yet
    layer.set_active("a")
    with torch.no_grad():
        layer.lora_B["a"].weight.normal_()
    A, B = layer.lora_A["a"].weight, layer.lora_B["a"].weight
    expected = base(x) + 2.0 * x @ A.T @ B.T  # s = alpha / r = 2
    torch.testing.assert_close(layer(x), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.delta_weight("a"), 2.0 * B @ A)
    assert layer.scaling["a"] == 2.0 and layer.rank("a") == 3


def test_rslora_scaling():
    assert lora.lora_scaling(16, 4) == 4.0
    assert lora.lora_scaling(16, 4, use_rslora=True) == 8.0
    model = _mlp()
    lora.adapt(model, LoraConfig(rank=4, alpha=6, use_rslora=True), target=nn.Linear)
    for _, layer in lora_layers(model):
        assert layer.scaling["default"] == pytest.approx(6 / math.sqrt(4))
    state = lora.get_state(model)
    assert state.config["use_rslora"] is True
    assert all(s == pytest.approx(3.0) for s in state.scaling.values())


def test_init_is_deterministic_and_b_zero():
    a, b = _mlp(), _mlp()
    lora.adapt(a, LoraConfig(rank=2, seed=5), target=nn.Linear)
    lora.adapt(b, LoraConfig(rank=2, seed=5), target=nn.Linear)
    c = lora.adapt(_mlp(), LoraConfig(rank=2, seed=6), target=nn.Linear)
    sa, sb, sc = (lora.get_state(m) for m in (a, b, c))
    assert sa.allclose(sb) and not sa.allclose(sc)
    assert all(torch.count_nonzero(f["lora_B"]) == 0 for f in sa.factors.values())
    g = lora.get_state(lora.adapt(_mlp(), LoraConfig(rank=4, init="gaussian"), target=nn.Linear))
    std = torch.cat([f["lora_A"].flatten() for f in g.factors.values()]).std().item()
    assert 0.15 < std < 0.4  # N(0, 1/r^2) with r = 4


def test_merge_exact_and_refuses_double_merge():
    model = lora.adapt(_mlp(), LoraConfig(rank=4), target=nn.Linear)
    contract.perturb_trainable(model, 3)
    w0 = {n: layer.base_layer.weight.detach().clone() for n, layer in lora_layers(model)}
    y = contract.forward(model, "mlp")
    lora.merge(model)
    for n, layer in lora_layers(model):
        torch.testing.assert_close(layer.base_layer.weight, w0[n] + layer.delta_weight("default"))
    torch.testing.assert_close(contract.forward(model, "mlp"), y, atol=1e-5, rtol=0)
    with pytest.raises(RankwiseError, match="already merged"):
        lora.merge(model)
    with pytest.raises(RankwiseError, match="unmerge"):
        lora.disable_adapters(model)
    with pytest.raises(RankwiseError, match="unmerge"):
        lora.adapt(model, LoraConfig(rank=2), target=nn.Linear, name="other")
    lora.unmerge(model)
    for n, layer in lora_layers(model):
        torch.testing.assert_close(layer.base_layer.weight, w0[n], atol=1e-6, rtol=0)
    with pytest.raises(RankwiseError, match="nothing is merged|no adapter is merged"):
        lora.unmerge(model)


def test_merged_model_equals_adapter_model_and_unload():
    model = lora.adapt(_bert(), LoraConfig(rank=4, target=("query", "key", "value", "dense")))
    contract.perturb_trainable(model, 4)
    y = contract.forward(model, "bert")
    plain = lora.unload(copy.deepcopy(model), merge=True)
    assert not lora_layers(plain)
    assert not any("lora_" in k for k in plain.state_dict())
    torch.testing.assert_close(contract.forward(plain, "bert"), y, atol=1e-5, rtol=0)
    # the unloaded model has the base model's state-dict layout
    assert plain.state_dict().keys() == _bert().state_dict().keys()


def test_several_named_adapters_sum_and_delete():
    model = lora.adapt(_mlp(), LoraConfig(rank=2, seed=1), target=nn.Linear, name="a")
    contract.perturb_trainable(model, 1)
    lora.adapt(model, LoraConfig(rank=3, seed=2), target=["0", "4"], name="b")
    contract.perturb_trainable(model, 2)
    assert lora.adapter_names(model) == ["a", "b"]
    y0 = contract.forward(_mlp(), "mlp")
    lora.set_active(model, "a")
    ya = contract.forward(model, "mlp")
    # only the active adapter is trainable
    assert all(p.requires_grad == (".a." in n) for n, p in model.named_parameters() if "lora_" in n)
    lora.set_active(model, "b")
    yb = contract.forward(model, "mlp")
    lora.set_active(model, ["a", "b"])
    yab = contract.forward(model, "mlp")
    layer = dict(lora_layers(model))["2"]
    assert layer.active_adapters == ["a"]  # "b" does not target layer 2
    # with every layer linear in the update on one path only this holds at layer 0's output:
    first = model[0]
    x = contract.inputs("mlp")
    torch.testing.assert_close(first(x) - first.base_layer(x),
                               x @ first.delta_weight("a").T + x @ first.delta_weight("b").T, atol=1e-5, rtol=0)
    assert not torch.allclose(yab, ya) and not torch.allclose(yab, yb)
    with pytest.raises(ValueError, match="already has an adapter named 'a'"):
        lora.adapt(model, LoraConfig(rank=2), target=nn.Linear, name="a")
    with pytest.raises(KeyError, match="zzz"):
        lora.set_active(model, "zzz")
    lora.delete_adapter(model, "b")
    assert lora.adapter_names(model) == ["a"]
    lora.delete_adapter(model, "a")
    assert not lora_layers(model) and isinstance(model[0], nn.Linear)
    torch.testing.assert_close(contract.forward(model, "mlp"), y0, atol=0, rtol=0)


def test_dropout_train_vs_eval():
    model = lora.adapt(_mlp(), LoraConfig(rank=4, dropout=0.5), target=nn.Linear)
    assert not any(m.training for m in model.modules())  # new modules follow the model's eval mode
    contract.perturb_trainable(model, 5)
    x = contract.inputs("mlp")
    model.eval()
    y_eval = contract.forward(model, "mlp")
    torch.testing.assert_close(contract.forward(model, "mlp"), y_eval, atol=0, rtol=0)
    nodrop = lora.adapt(_mlp(), LoraConfig(rank=4, dropout=0.0), target=nn.Linear)
    set_state(nodrop, lora.get_state(model))
    torch.testing.assert_close(contract.forward(nodrop, "mlp"), y_eval, atol=0, rtol=0)
    model.train()
    torch.manual_seed(0)
    y1 = contract.forward(model, "mlp")
    y2 = contract.forward(model, "mlp")
    assert not torch.allclose(y1, y2) and not torch.allclose(y1, y_eval)
    # dropout acts on the adapter path only: disabled adapters give the base output in train mode too
    lora.disable_adapters(model)
    torch.testing.assert_close(contract.forward(model, "mlp"), contract.forward(_mlp(), "mlp"), atol=0, rtol=0)


def test_gradients_reach_only_lora_and_training_changes_output():
    model = lora.adapt(_bert(), LoraConfig(rank=4))
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n_train == 2 * 2 * (4 * 32 + 32 * 4)  # 2 layers x (query, value) x (A + B)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = contract.inputs("bert")
    y0 = model(ids).last_hidden_state.detach()
    probe = torch.randn(y0.shape, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = (model(ids).last_hidden_state * probe).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.allclose(model(ids).last_hidden_state, y0)


def test_per_layer_rank_and_alpha():
    model = _mlp()
    add_lora(model, nn.Linear, rank={"0": 2, "2": 4, "4": 8}, alpha=lambda n, m: float(m.out_features))
    state = get_state(model)
    assert state.ranks() == {"0": 2, "2": 4, "4": 8}
    assert state.scaling == {"0": 32 / 2, "2": 32 / 4, "4": 8 / 8}
    with pytest.raises(ValueError, match="no entry for layer '2'"):
        add_lora(_mlp(), nn.Linear, name="x", rank={"0": 2})


# --------------------------------------------------------------------------------------------
# bad inputs to adapt
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [33, 10_000])
def test_rank_too_large_names_layer_and_leaves_model(rank):
    model = _mlp()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=r"rank \d+ for layer '0' exceeds min\(in_features=16"):
        lora.adapt(model, LoraConfig(rank=rank), target=nn.Linear)
    _same(model, snap)


def test_rank_nonpositive_rejected():
    with pytest.raises(ValueError, match="rank"):
        lora.adapt(_mlp(), LoraConfig(rank=0), target=nn.Linear)
    model = _mlp()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="rank must be a positive int, got 0 for layer '2'"):
        add_lora(model, nn.Linear, rank={"0": 2, "2": 0, "4": 2})
    _same(model, snap)


def test_selector_matching_nothing():
    model = _bert()
    snap = _snapshot(model)
    with pytest.raises(SelectionError, match="matched no"):
        lora.adapt(model, LoraConfig(target=("q_proj",)))
    with pytest.raises(SelectionError):
        lora.adapt(model, LoraConfig(), target="attention")  # BertAttention, not a Linear
    with pytest.raises(SelectionError, match="matched no Linear layer"):
        lora.adapt(_mlp(), LoraConfig(rank=2))  # default ("query", "value") on an MLP
    _same(model, snap)


def test_failure_midway_leaves_model_unchanged(monkeypatch):
    model = lora.adapt(_bert(), LoraConfig(rank=2), name="first")
    snap = _snapshot(model)
    calls = {"n": 0}
    real = LoraLinear.add_adapter

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LoraLinear, "add_adapter", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        lora.adapt(model, LoraConfig(rank=2, target=("query", "key", "value")), name="second")
    _same(model, snap)
    assert lora.adapter_names(model) == ["first"]
    assert all(layer.active_adapters == ["first"] for _, layer in lora_layers(model))


def test_bad_adapter_name_and_types():
    with pytest.raises(ValueError, match="adapter name"):
        lora.adapt(_mlp(), LoraConfig(rank=2), target=nn.Linear, name="a.b")
    with pytest.raises(ValueError, match="clashes"):
        lora.adapt(_mlp(), LoraConfig(rank=2), target=nn.Linear, name="keys")
    with pytest.raises(TypeError, match="LoraConfig"):
        lora.adapt(_mlp(), {"rank": 2}, target=nn.Linear)
    with pytest.raises(TypeError, match="nn.Linear"):
        LoraLinear(nn.Conv1d(2, 2, 1))


# --------------------------------------------------------------------------------------------
# AdapterState
# --------------------------------------------------------------------------------------------

def test_adapter_state_roundtrip_and_helpers(tmp_path):
    model = lora.adapt(_bert(), LoraConfig(rank=4, alpha=8))
    contract.perturb_trainable(model, 6)
    state = lora.get_state(model)
    assert state.modules() == [n for n, _ in lora_layers(model)]
    assert state.config["targets"] == state.modules() and state.config["rank"] == 4
    assert state.fingerprint == io.model_fingerprint(_bert())
    m0 = state.modules()[0]
    layer = model.get_submodule(m0)
    torch.testing.assert_close(state.delta_weight(m0), layer.delta_weight("default"))
    assert state.shape(m0) == (32, 32) and state.num_parameters() == 4 * (4 * 32 + 32 * 4)
    tensors, meta = state.to_tensors()
    back = AdapterState.from_tensors(tensors, meta)
    assert back.allclose(state) and back.fingerprint == state.fingerprint
    path = state.save(tmp_path / "state.safetensors")
    loaded = AdapterState.load(path, model=_bert())
    assert loaded.allclose(state) and loaded.config == state.config
    with pytest.raises(ArtifactError, match="different base model"):
        AdapterState.load(path, model=_bert(seed=1))
    # state of a model is independent of later training
    contract.perturb_trainable(model, 7)
    assert loaded.allclose(state)


def test_adapter_state_validation():
    a, b = torch.zeros(2, 4), torch.zeros(3, 2)
    ok = AdapterState({}, {"m": {"lora_A": a, "lora_B": b}}, {"m": 1.0})
    assert ok.rank("m") == 2 and ok.shape("m") == (3, 4)
    assert ok == ok and ok != ok.clone() and ok.allclose(ok.clone())  # identity equality; allclose for values
    bad = [
        ({}, {"m": {"lora_A": a, "lora_B": torch.zeros(3, 3)}}, {"m": 1.0}, "expected A"),
        ({}, {"m": {"lora_A": a}}, {"m": 1.0}, "exactly"),
        ({}, {"m": {"lora_A": a, "lora_B": b}}, {}, "scaling"),
        ({}, {"m": {"lora_A": a, "lora_B": b}}, {"m": float("inf")}, "finite"),
        ({}, {"m": {"lora_A": a.double(), "lora_B": b}}, {"m": 1.0}, "dtype"),
        ({}, {"m": {"lora_A": a.long(), "lora_B": b.long()}}, {"m": 1.0}, "floating"),
        ({}, {"m": {"lora_A": a * float("nan"), "lora_B": b}}, {"m": 1.0}, "NaN"),
        ({"x": object()}, {"m": {"lora_A": a, "lora_B": b}}, {"m": 1.0}, "JSON"),
        ({}, {}, {}, "non-empty"),
    ]
    for cfg, factors, scaling, msg in bad:
        with pytest.raises(ValueError, match=msg):
            AdapterState(cfg, factors, scaling)


def test_set_state_other_ranks_and_rejections():
    model = _mlp()
    f = {"0": {"lora_A": torch.randn(3, 16), "lora_B": torch.randn(32, 3)},
         "4": {"lora_A": torch.randn(5, 32), "lora_B": torch.randn(8, 5)}}
    state = AdapterState({"dropout": 0.0}, f, {"0": 0.5, "4": 2.0})
    set_state(model, state, "merged")
    x = contract.inputs("mlp")
    base = _mlp()
    h = torch.relu(base[0](x) + 0.5 * x @ f["0"]["lora_A"].T @ f["0"]["lora_B"].T)
    h = torch.relu(base[2](h))
    torch.testing.assert_close(model(x), base[4](h) + 2.0 * h @ f["4"]["lora_A"].T @ f["4"]["lora_B"].T,
                               atol=1e-5, rtol=0)
    snap = _snapshot(model)
    wrong = AdapterState({}, {"2": {"lora_A": torch.randn(2, 7), "lora_B": torch.randn(32, 2)}}, {"2": 1.0})
    with pytest.raises(ArtifactError, match=r"module '2'.*\(out=32, in=7\)"):
        set_state(model, wrong, "merged")
    missing = AdapterState({}, {"9": {"lora_A": torch.randn(2, 7), "lora_B": torch.randn(32, 2)}}, {"9": 1.0})
    with pytest.raises(ArtifactError, match="does not exist"):
        set_state(model, missing, "merged")
    nonlinear = AdapterState({}, {"1": {"lora_A": torch.randn(2, 7), "lora_B": torch.randn(32, 2)}}, {"1": 1.0})
    with pytest.raises(ArtifactError, match="not nn.Linear"):
        set_state(model, nonlinear, "merged")
    other = get_state(lora.adapt(_mlp(seed=3), LoraConfig(rank=2), target=nn.Linear))
    with pytest.raises(ArtifactError, match="different base model"):
        set_state(model, other)
    _same(model, snap)


# --------------------------------------------------------------------------------------------
# save / load (native directory)
# --------------------------------------------------------------------------------------------

def test_save_load_named_adapters(tmp_path):
    model = lora.adapt(_bert(), LoraConfig(rank=4), name="a")
    contract.perturb_trainable(model, 1)
    lora.adapt(model, LoraConfig(rank=2, use_rslora=True, target=("key",)), name="b")
    contract.perturb_trainable(model, 2)
    lora.save_adapter(model, tmp_path / "a", "a")
    lora.save_adapter(model, tmp_path / "b", "b")
    fresh = _bert()
    lora.load_adapter(fresh, tmp_path / "a", "a")
    lora.load_adapter(fresh, tmp_path / "b", "b")
    for n in ("a", "b"):
        assert lora.get_state(fresh, n).allclose(lora.get_state(model, n))
        lora.set_active(model, n)
        lora.set_active(fresh, n)
        assert torch.equal(contract.forward(model, "bert"), contract.forward(fresh, "bert"))
    # loading again under an existing name replaces that adapter
    lora.load_adapter(fresh, tmp_path / "b", "a")
    assert lora.get_state(fresh, "a").allclose(lora.get_state(model, "b"))
    assert not any(name == "a" and "query" in n for n, layer in lora_layers(fresh) for name in layer.adapters)


def test_load_rejects_other_base_and_mismatched_shapes(tmp_path):
    model = lora.adapt(_bert(), LoraConfig(rank=4))
    contract.perturb_trainable(model, 1)
    lora.save_adapter(model, tmp_path / "ad")
    other = _bert(seed=1)
    snap = _snapshot(other)
    with pytest.raises(ArtifactError, match="different base model"):
        lora.load_adapter(other, tmp_path / "ad")
    _same(other, snap)
    lora.load_adapter(other, tmp_path / "ad", check_base=False)  # explicit override
    wider = _bert(hidden=48)
    snap = _snapshot(wider)
    with pytest.raises(ArtifactError, match="does not fit this model"):
        lora.load_adapter(wider, tmp_path / "ad")
    with pytest.raises(ArtifactError, match=r"adapter is for \(out=32, in=32\).*\(out=48, in=48\)"):
        lora.load_adapter(wider, tmp_path / "ad", check_base=False)
    _same(wider, snap)


def test_load_rejects_corrupt_safetensors(tmp_path):
    model = lora.adapt(_mlp(), LoraConfig(rank=4), target=nn.Linear)
    contract.perturb_trainable(model, 1)
    d = lora.save_adapter(model, tmp_path / "ad")
    good = (d / "adapter_model.safetensors").read_bytes()
    target = _mlp()
    snap = _snapshot(target)
    cases = {"flipped byte": bytearray(good), "truncated": good[:-40], "empty": b"", "garbage": b"\x00" * 64,
             "header cut": good[:20]}
    cases["flipped byte"][-3] ^= 0x55
    for what, data in cases.items():
        (d / "adapter_model.safetensors").write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match="adapter_model.safetensors") as info:
            lora.load_adapter(target, d)
        assert any(w in str(info.value) for w in ("corrupt", "truncated", "not a safetensors")), (what, info.value)
        _same(target, snap)
    (d / "adapter_model.safetensors").write_bytes(good)
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not a valid JSON"):
        lora.load_adapter(target, d)
    _same(target, snap)
    with pytest.raises(ArtifactError, match="no such adapter directory"):
        lora.load_adapter(target, tmp_path / "nope")


def test_edited_config_is_detected(tmp_path):
    import json

    model = lora.adapt(_mlp(), LoraConfig(rank=4, alpha=8), target=nn.Linear)
    d = lora.save_adapter(model, tmp_path / "ad")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 32
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="disagree"):
        lora.load_adapter(_mlp(), d)
    cfg["lora_alpha"], cfg["r"] = 8, 2
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="rank 4 in the weights but 2"):
        lora.load_adapter(_mlp(), d)


def test_unwritable_output_dir(tmp_path, monkeypatch):
    import tempfile

    model = lora.adapt(_mlp(), LoraConfig(rank=2), target=nn.Linear)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ArtifactError, match=str(blocker / "ad")):
        lora.save_adapter(model, blocker / "ad")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(ArtifactError, match="not writable"):
        lora.save_adapter(model, tmp_path / "out" / "ad")
    monkeypatch.undo()
    assert not (tmp_path / "out" / "ad").exists()


def test_save_does_not_clobber_foreign_directory(tmp_path):
    model = lora.adapt(_mlp(), LoraConfig(rank=2), target=nn.Linear)
    d = tmp_path / "ad"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="overwrite=True"):
        lora.save_adapter(model, d)
    assert (d / "notes.txt").read_text() == "keep me"
    lora.save_adapter(model, d, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    lora.save_adapter(model, d)  # its own earlier save is replaced without asking
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_interrupted_save_keeps_previous_adapter(tmp_path, monkeypatch):
    model = lora.adapt(_mlp(), LoraConfig(rank=2), target=nn.Linear)
    d = lora.save_adapter(model, tmp_path / "ad")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    contract.perturb_trainable(model, 1)

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "save_tensors", crash)
    with pytest.raises(KeyboardInterrupt):
        lora.save_adapter(model, d)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]


def test_fingerprint_ignores_adapters_and_merging():
    base = _bert()
    fp = io.model_fingerprint(base)
    model = lora.adapt(copy.deepcopy(base), LoraConfig(rank=4))
    contract.perturb_trainable(model, 1)
    assert io.model_fingerprint(model) == fp
    lora.merge(model)
    assert io.model_fingerprint(model) == fp
    lora.unmerge(model)
    assert io.model_fingerprint(model) == fp
    assert io.model_fingerprint(_bert(seed=1)) != fp
    assert io.model_fingerprint(copy.deepcopy(base).double()) != fp
