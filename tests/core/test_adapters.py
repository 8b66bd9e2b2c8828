"""The shared adapter management of rankwise.core.adapters, on a minimal adapter layer family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.core import adapters
from rankwise.core.adapters import AdapterLayer
from rankwise.core.errors import NumericalError, RankwiseError, SelectionError


class DeltaLinear(AdapterLayer):
    """A test family: each adapter is a full dense update ``D (out, in)`` (``y = base(x) + x D^T``)."""

    adapter_store = "deltas"
    adapter_fields = ("deltas", "adapter_config")
    adapter_label = "test adapter"
    family = "Test"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        super().__init__(base_layer, layer_name)
        self.deltas = nn.ParameterDict()
        self.train(base_layer.training)

    def add(self, name: str, delta: torch.Tensor) -> None:
        adapters.validate_adapter_name(name)
        self.deltas[name] = nn.Parameter(delta.clone())
        self.adapter_config[name] = {"n": delta.numel()}
        if not self.active_adapters:
            self.active_adapters = [name]

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        self._require(name)
        d = self.deltas[name].detach()
        return d.to(dtype or torch.promote_types(d.dtype, torch.float32))

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(self.deltas[name], not name.startswith("frozen"))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return y
        for n in self.active_adapters:
            y = y + x @ self.deltas[n].T
        return y

    # artefact hooks (AdapterMethod.save_adapter / load_adapter)
    def export_adapter(self, name):
        return {"delta": self.deltas[name].detach()}, dict(self.adapter_config[name])

    @classmethod
    def artifact_keys(cls, module, record, context):
        if not isinstance(record.get("n"), int):
            raise ValueError("n")
        return {"delta": f"{module}.delta"}

    @classmethod
    def artifact_fit(cls, model, module, base, tensors, record, context):
        if tuple(tensors["delta"].shape) != tuple(base.weight.shape):
            return f"module {module!r}: delta {tuple(tensors['delta'].shape)} does not fit {tuple(base.weight.shape)}"
        return None

    def import_adapter(self, name, tensors, record, context):
        if context.shared.get("fail_at") == self.layer_name:
            raise ValueError("injected failure")
        self.add(name, tensors["delta"])


def _model(names: tuple[str, ...] = ("a",), seed: int = 0) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    for i in (0, 2):
        layer = DeltaLinear(model[i], layer_name=str(i))
        for n in names:
            layer.add(n, 0.1 * torch.randn(layer.base_layer.weight.shape, generator=g))
        model[i] = layer
    return model


X = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: layer.base_layer.weight.detach().clone() for n, layer in adapters.adapted_layers(model, DeltaLinear)}


def test_merge_matches_forward_and_unmerge_restores():
    model = _model()
    w0 = _weights(model)
    y = model(X)
    assert adapters.merge_all(model, DeltaLinear) == ["0", "2"]
    for n, layer in adapters.adapted_layers(model, DeltaLinear):
        torch.testing.assert_close(layer.base_layer.weight, w0[n] + layer.deltas["a"].detach())
        assert layer.merged_adapters == ["a"]
    torch.testing.assert_close(model(X), y)
    with pytest.raises(RankwiseError, match="already merged"):
        adapters.merge_all(model, DeltaLinear)
    assert adapters.unmerge_all(model, DeltaLinear) == ["0", "2"]
    for n, w in _weights(model).items():
        torch.testing.assert_close(w, w0[n], atol=1e-6, rtol=0)
    with pytest.raises(RankwiseError, match="no test adapter is merged"):
        adapters.unmerge_all(model, DeltaLinear)


def test_merge_is_all_or_nothing_when_a_later_layer_fails():
    model = _model()
    w0 = _weights(model)
    with torch.no_grad():
        model[2].deltas["a"][0, 0] = float("nan")  # the second layer cannot merge
    with pytest.raises(NumericalError, match="layer '2'.*non-finite"):
        adapters.merge_all(model, DeltaLinear)
    for n, layer in adapters.adapted_layers(model, DeltaLinear):
        assert layer.merged_adapters == []
        # the first layer's merge was undone (subtracted again: exact up to float rounding)
        torch.testing.assert_close(layer.base_layer.weight, w0[n], atol=1e-6, rtol=0)


def test_merge_refuses_disabled_and_empty_model():
    model = _model()
    adapters.disable_adapters(model, DeltaLinear)
    with pytest.raises(RankwiseError, match="disabled"):
        adapters.merge_all(model, DeltaLinear)
    assert all(not layer.merged_adapters for _, layer in adapters.adapted_layers(model, DeltaLinear))
    with pytest.raises(RankwiseError, match="no Test layers to merge"):
        adapters.merge_all(nn.Sequential(nn.Linear(2, 2)), DeltaLinear)


def test_disable_enable_and_disable_refused_while_merged():
    model = _model()
    base = nn.Sequential(model[0].base_layer, nn.ReLU(), model[2].base_layer)
    y_adapted = model(X)
    adapters.disable_adapters(model, DeltaLinear)
    torch.testing.assert_close(model(X), base(X))
    adapters.enable_adapters(model, DeltaLinear)
    torch.testing.assert_close(model(X), y_adapted)
    adapters.merge_all(model, DeltaLinear)
    with pytest.raises(RankwiseError, match="unmerge before disabling"):
        adapters.disable_adapters(model, DeltaLinear)
    assert not any(layer.disabled for _, layer in adapters.adapted_layers(model, DeltaLinear))


def test_set_active_unknown_adapter_raises_and_changes_nothing():
    model = _model(("a", "b"))
    with pytest.raises(KeyError, match=r"no test adapter named \['zzz'\].*it has \['a', 'b'\]"):
        adapters.set_active(model, ["b", "zzz"], DeltaLinear)
    assert all(layer.active_adapters == ["a"] for _, layer in adapters.adapted_layers(model, DeltaLinear))
    adapters.set_active(model, ["b", "a", "b"], DeltaLinear)
    for _, layer in adapters.adapted_layers(model, DeltaLinear):
        assert layer.active_adapters == ["b", "a"]  # repeats dropped: an update is never added twice
        assert layer.deltas["a"].requires_grad and layer.deltas["b"].requires_grad
    adapters.set_active(model, "b", DeltaLinear)
    assert not model[0].deltas["a"].requires_grad and model[0].deltas["b"].requires_grad


def test_set_active_refused_while_merged_is_rolled_back():
    model = _model(("a", "b"))
    adapters.merge_all(model, DeltaLinear)
    with pytest.raises(RankwiseError, match="merged"):
        adapters.set_active(model, "b", DeltaLinear)
    assert all(layer.active_adapters == ["a"] for _, layer in adapters.adapted_layers(model, DeltaLinear))


def test_require_adapter():
    model = _model(("a",))
    assert [n for n, _ in adapters.require_adapter(model, "a", DeltaLinear)] == ["0", "2"]
    with pytest.raises(KeyError, match="no test adapter named 'x'; it has \\['a'\\]"):
        adapters.require_adapter(model, "x", DeltaLinear)
    with pytest.raises(KeyError, match="it has none"):
        adapters.require_adapter(nn.Sequential(nn.Linear(2, 2)), "x", DeltaLinear)


def test_unload_restores_plain_linear_with_merged_weights():
    model = _model()
    y = model(X)
    expected = {n: layer.base_layer.weight.detach() + layer.deltas["a"].detach()
                for n, layer in adapters.adapted_layers(model, DeltaLinear)}
    out = adapters.unload(model, DeltaLinear)
    assert out is model
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    torch.testing.assert_close(model[0].weight, expected["0"])
    torch.testing.assert_close(model[2].weight, expected["2"])
    torch.testing.assert_close(model(X), y)


def test_unload_without_merge_gives_base_model():
    model = _model()
    w0 = _weights(model)
    adapters.unload(model, DeltaLinear, merge_first=False)
    assert type(model[0]) is nn.Linear
    assert torch.equal(model[0].weight, w0["0"]) and torch.equal(model[2].weight, w0["2"])


def test_unload_failure_unmerges_and_keeps_wrappers(monkeypatch):
    model = _model()
    w0 = _weights(model)
    wrappers = (model[0], model[2])
    calls = {"n": 0}
    real = adapters.replace_module

    def flaky(m, name, new):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(m, name, new)

    monkeypatch.setattr(adapters, "replace_module", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        adapters.unload(model, DeltaLinear)
    assert (model[0], model[2]) == wrappers
    for n, layer in adapters.adapted_layers(model, DeltaLinear):
        assert layer.merged_adapters == []
        torch.testing.assert_close(layer.base_layer.weight, w0[n], atol=1e-6, rtol=0)


def test_delete_active_and_last_adapter():
    model = _model(("a", "b"))
    adapters.delete_adapter(model, "a", DeltaLinear)  # the active one
    for _, layer in adapters.adapted_layers(model, DeltaLinear):
        assert layer.adapters == ["b"] and layer.active_adapters == [] and "a" not in layer.adapter_config
    adapters.delete_adapter(model, "b", DeltaLinear)  # the last one: plain Linear back
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    with pytest.raises(KeyError, match="no test adapter named 'b'"):
        adapters.delete_adapter(model, "b", DeltaLinear)


def test_delete_keeps_empty_wrappers_when_asked_and_runs_after_hook():
    model = _model(("a",))
    seen = []
    adapters.delete_adapter(model, "a", DeltaLinear, unwrap_empty=False, after=lambda m: seen.append(m))
    assert isinstance(model[0], DeltaLinear) and model[0].adapters == []
    assert seen == [model]


def test_delete_merged_adapter_refused():
    model = _model(("a",))
    adapters.merge_all(model, DeltaLinear)
    with pytest.raises(RankwiseError, match="'a' is merged.*unmerge before deleting"):
        adapters.delete_adapter(model, "a", DeltaLinear)
    assert model[0].adapters == ["a"]


def test_failed_operation_restores_layer_state():
    model = _model(("a", "b"))
    flags = {id(p): p.requires_grad for p in model.parameters()}

    def failing_after(m):
        raise RuntimeError("late failure")

    with pytest.raises(RuntimeError, match="late failure"):
        adapters.delete_adapter(model, "a", DeltaLinear, after=failing_after)
    for _, layer in adapters.adapted_layers(model, DeltaLinear):
        assert layer.adapters == ["a", "b"] and layer.active_adapters == ["a"]
        assert set(layer.adapter_config) == {"a", "b"}
    assert {id(p): p.requires_grad for p in model.parameters()} == flags


def test_layer_level_rules():
    layer = _model(("a",))[0]
    with pytest.raises(KeyError, match="layer '0' has no test adapter 'x'"):
        layer.set_active("x")
    assert layer.merge() is True and layer.merged
    with pytest.raises(RankwiseError, match="unmerge before disabling"):
        layer.set_enabled(False)
    with pytest.raises(RankwiseError, match="already merged"):
        layer.merge()
    layer.unmerge()
    layer.unmerge()  # nothing merged: a no-op
    layer.set_active([])
    assert layer.merge() is False  # nothing active: nothing to merge


def test_validate_adapter_name():
    assert adapters.validate_adapter_name("my-adapter_1") == "my-adapter_1"
    for bad in ("a.b", "", "1a", "has space", 3):
        with pytest.raises(ValueError, match="adapter name"):
            adapters.validate_adapter_name(bad)
    with pytest.raises(ValueError, match="clashes"):
        adapters.validate_adapter_name("update")


def test_fingerprint_sees_the_base_layer():
    from rankwise.core import io

    plain = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    assert io.model_fingerprint(_model()) == io.model_fingerprint(plain)


def test_set_active_uses_a_given_sync():
    model = _model(("a", "b"))
    calls = []
    adapters.set_active(model, "b", DeltaLinear, lambda m, freeze_base: calls.append((m, freeze_base)))
    assert calls == [(model, False)]


def test_sync_trainable_active_trainable_others_frozen_shared_if_any():
    model = _model(("a", "b", "frozen_c"))
    shared = model[0].deltas["a"]
    model[2].deltas["shared"] = shared  # one parameter held by two layers' adapters (E²LoRA shares factors)
    model[2].adapter_config["shared"] = {}
    for _, layer in adapters.adapted_layers(model, DeltaLinear):
        layer.active_adapters = ["b", "frozen_c"]
    model[2].active_adapters = ["shared"]
    adapters.sync_trainable(model, DeltaLinear, freeze_base=False)
    assert shared.requires_grad  # inactive in layer 0, active in layer 2
    assert model[0].deltas["b"].requires_grad and not model[2].deltas["b"].requires_grad
    assert not model[0].deltas["frozen_c"].requires_grad  # active but not trainable
    assert model[0].base_layer.weight.requires_grad  # untouched without freeze_base
    adapters.sync_trainable(model, DeltaLinear, freeze_base=True)
    assert not any(p.requires_grad for p in model[0].base_layer.parameters())
    assert shared.requires_grad


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.v = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 1)
        self.emb = nn.Embedding(3, 4)


def test_target_layers_selection_rules():
    net = _Net()
    net.q = DeltaLinear(net.q, "q")
    # a hit on a wrapper's base layer is the wrapper; wrapper internals never count; model order
    hits = adapters.target_layers(net, ["v", "q.base_layer", "q"], DeltaLinear)
    assert [(n, type(m)) for n, m in hits] == [("q", DeltaLinear), ("v", nn.Linear)]
    assert [n for n, _ in adapters.target_layers(net, nn.Linear, DeltaLinear)] == ["q", "v"]
    assert [n for n, _ in adapters.target_layers(net, None, DeltaLinear, typed=True)] == ["q", "v"]
    assert [n for n, _ in adapters.target_layers(net, ["conv", "v"], DeltaLinear)] == ["v"]  # not rejected: skipped
    is_conv = lambda m: isinstance(m, nn.Conv1d)  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"Test adapts nn.Linear layers only; .* selects conv \(Conv1d\)"):
        adapters.target_layers(net, ["conv", "v"], DeltaLinear, rejects=is_conv)
    assert [n for n, _ in adapters.target_layers(net, "conv", DeltaLinear, accepts=is_conv)] == ["conv"]
    with pytest.raises(SelectionError, match="matched no Linear layer. Available Linear layers: q, v"):
        adapters.target_layers(net, "emb", DeltaLinear)


def test_merge_refuses_a_sum_that_overflows_the_weight_dtype():
    base = nn.Linear(2, 2).to(torch.float16)
    with torch.no_grad():
        base.weight.fill_(60000.0)  # float16 max is 65504
    layer = DeltaLinear(base, "half")
    layer.add("a", torch.full((2, 2), 10000.0, dtype=torch.float16))
    w0 = base.weight.detach().clone()
    with pytest.raises(NumericalError, match="overflows torch.float16"):
        layer.merge()
    assert torch.equal(base.weight, w0) and layer.merged_adapters == []


# ------------------------------------------------------------------------------------------------
# AdapterMethod: the whole model-level API from the layer class and its two artefact hooks
# ------------------------------------------------------------------------------------------------

METHOD = adapters.AdapterMethod(DeltaLinear, "rankwise.test_delta")


def _state(model):
    return ([(n, type(m).__name__) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def _same(a, b):
    assert a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_method_save_load_round_trip_is_bit_exact(tmp_path):
    from rankwise.core import io

    model = _model(("a", "b"))
    METHOD.set_active(model, "b")
    METHOD.save_adapter(model, tmp_path / "ad", "b")
    tensors, meta = io.load_tensors(tmp_path / "ad" / adapters.WEIGHTS_FILE)
    assert meta["kind"] == "rankwise.test_delta" and set(tensors) == {"0.delta", "2.delta"}
    assert io.read_json(tmp_path / "ad" / adapters.CONFIG_FILE)["method"] == "test_delta"
    fresh = _model(("x",))
    METHOD.load_adapter(fresh, tmp_path / "ad", "loaded")
    for i in (0, 2):
        assert torch.equal(fresh[i].deltas["loaded"], model[i].deltas["b"])
        assert fresh[i].active_adapters == ["loaded"] and not fresh[i].deltas["x"].requires_grad
    METHOD.save_adapter(model, tmp_path / "ad", "a")  # a directory it wrote itself is replaced
    with pytest.raises(Exception, match="overwrite"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep")
        METHOD.save_adapter(model, tmp_path / "mine", "a")


def test_method_load_checks_everything_before_changing_the_model(tmp_path):
    from rankwise.core import io
    from rankwise.core.errors import ArtifactError

    model = _model(("a",))
    METHOD.save_adapter(model, tmp_path / "ad", "a")
    other = _model(("a",), seed=1)
    before = _state(other)
    with pytest.raises(ArtifactError, match="different base model"):
        METHOD.load_adapter(other, tmp_path / "ad")
    with pytest.raises(ArtifactError, match="no such adapter directory"):
        METHOD.load_adapter(other, tmp_path / "missing")
    tensors, meta = io.load_tensors(tmp_path / "ad" / adapters.WEIGHTS_FILE)
    (tmp_path / "kind").mkdir()
    io.save_tensors(tmp_path / "kind" / adapters.WEIGHTS_FILE, tensors, dict(meta, kind="rankwise.other"))
    with pytest.raises(ArtifactError, match="not a rankwise Test adapter"):
        METHOD.load_adapter(other, tmp_path / "kind")
    (tmp_path / "extra").mkdir()
    io.save_tensors(tmp_path / "extra" / adapters.WEIGHTS_FILE, dict(tensors, stray=torch.ones(1)), meta)
    with pytest.raises(ArtifactError, match="unexpected \\['stray'\\]"):
        METHOD.load_adapter(other, tmp_path / "extra", check_base=False)
    (tmp_path / "bad").mkdir()
    io.save_tensors(tmp_path / "bad" / adapters.WEIGHTS_FILE, tensors,
                    dict(meta, modules=dict(meta["modules"], **{"2": {"n": "x"}})))
    with pytest.raises(ArtifactError, match="bad metadata for module '2'"):
        METHOD.load_adapter(other, tmp_path / "bad", check_base=False)
    (tmp_path / "fit").mkdir()
    io.save_tensors(tmp_path / "fit" / adapters.WEIGHTS_FILE, dict(tensors, **{"2.delta": torch.zeros(3, 3)}), meta)
    with pytest.raises(ArtifactError, match="does not fit this model: module '2': delta"):
        METHOD.load_adapter(other, tmp_path / "fit", check_base=False)
    _same(_state(other), before)


def test_method_load_is_all_or_nothing_when_a_layer_fails(tmp_path, monkeypatch):
    from rankwise.core.errors import ArtifactError

    model = _model(("a",))
    METHOD.save_adapter(model, tmp_path / "ad", "a")
    target = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))
    target.load_state_dict({k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
                            if "deltas" not in k})
    before = _state(target)
    real = adapters.ArtifactContext

    def failing(*a, **k):
        ctx = real(*a, **k)
        ctx.shared["fail_at"] = "2"
        return ctx
    monkeypatch.setattr(adapters, "ArtifactContext", failing)
    with pytest.raises(ArtifactError, match="injected failure"):
        METHOD.load_adapter(target, tmp_path / "ad")
    _same(_state(target), before)  # layer 0 was wrapped and loaded, then put back


def test_method_refuses_loading_while_merged_and_unload_merges(tmp_path):
    model = _model(("a",))
    METHOD.save_adapter(model, tmp_path / "ad", "a")
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    y = model(x)
    METHOD.merge(model)
    with pytest.raises(RankwiseError, match="unmerge the Test adapters before loading one"):
        METHOD.load_adapter(model, tmp_path / "ad", "b")
    METHOD.unmerge(model)
    out = METHOD.unload(model, merge=True)
    assert isinstance(out[0], nn.Linear) and torch.allclose(out(x), y, atol=1e-5)
    with pytest.warns(DeprecationWarning, match="merge_first"):
        METHOD.unload(_model(("a",)), merge_first=False)


def test_method_delete_unwraps_empty_layers():
    model = _model(("a", "b"))
    METHOD.delete_adapter(model, "a")
    assert METHOD.adapter_names(model) == ["b"]
    METHOD.delete_adapter(model, "b")
    assert not METHOD.layers(model) and isinstance(model[0], nn.Linear)


class _NoMerge(DeltaLinear):
    mergeable = False


def test_method_of_a_family_that_cannot_merge():
    m = adapters.AdapterMethod(_NoMerge, "rankwise.nomerge", no_merge="these cannot be merged: routed")
    with pytest.raises(RankwiseError, match="routed"):
        m.merge(nn.Sequential())
    with pytest.raises(RankwiseError, match="no Test adapter is merged"):
        m.unmerge(nn.Sequential())
