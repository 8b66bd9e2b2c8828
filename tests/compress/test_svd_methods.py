"""The shared test matrix: every registered layer method (``rankwise.compress.layer_methods()``).

A method joins automatically when its module registers it (``@register_layer_method``): the list is
read at collection time, after every module of ``rankwise.compress`` was imported. The invariants
checked here hold for every method, whatever its statistics: shapes and parameter counts of the
factors, the bias kept on the up factor, full rank reproduces the model (``exact_at_full_rank``),
determinism, bit-exact save/load, all-or-nothing surgery and rank validation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise.compress import (
    CompressConfig,
    LayerMethod,
    compress,
    layer_methods,
    load_compressed,
    resolve_layer_method,
    save_compressed,
    uniform_rank,
)
from rankwise.core.layers import LowRankLinear
from rankwise.core.surgery import count_parameters

METHODS = sorted(layer_methods())
BUILTIN = {"svd", "asvd", "fwsvd", "svd-llm", "swift-svd"}


def _model():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertModel(cfg).eval()


def _batches(n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (4, 10), generator=g)
        am = torch.ones(4, 10, dtype=torch.long)
        am[2, 6:] = 0
        out.append({"input_ids": ids, "attention_mask": am})
    return out


_U = torch.randn(16, generator=torch.Generator().manual_seed(1))


def _loss(out, batch):
    """A task loss with non-vanishing gradients (a fixed random read-out of the hidden states)."""
    h = out.last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (((h * _U).sum(-1, keepdim=True) * m) ** 2).sum() / m.sum()


@pytest.fixture(scope="module")
def base():
    return _model()


@pytest.fixture(scope="module")
def batches():
    return _batches()


def _run(model, method, batches, **kw):
    cfg_kw = {k: kw.pop(k) for k in ("ratio", "allocation") if k in kw}
    return compress(model, CompressConfig(method=method, **cfg_kw), calib=batches, loss_fn=_loss, **kw)


def _out(model, batch):
    with torch.no_grad():
        return model(**batch).last_hidden_state


def test_builtin_methods_are_registered():
    assert BUILTIN <= set(METHODS)
    for name in METHODS:
        cls = layer_methods()[name]
        assert issubclass(cls, LayerMethod) and cls.name == name
        assert resolve_layer_method(name.replace("-", "_").upper()) is cls


@pytest.mark.parametrize("method", METHODS)
def test_factors_shapes_parameters_and_bias(method, base, batches):
    model = copy.deepcopy(base)
    rep = _run(model, method, batches, ratio=0.5)
    assert rep.method == method and len(rep.layers) == 12
    for lr in rep.layers:
        low = model.get_submodule(lr.name)
        orig = base.get_submodule(lr.name)
        m, n = orig.weight.shape
        assert isinstance(low, LowRankLinear) and lr.shape == (m, n)
        assert lr.rank == low.rank == uniform_rank(m, n, 0.5)
        assert low.down.weight.shape == (lr.rank, n) and low.up.weight.shape == (m, lr.rank)
        assert lr.params_after == lr.rank * (m + n) + m == low.num_parameters
        assert torch.equal(low.up.bias, orig.bias)
        assert torch.isfinite(low.down.weight).all() and torch.isfinite(low.up.weight).all()
        assert lr.rel_error is not None and 0.0 <= lr.rel_error < 10.0
    assert rep.params_before == count_parameters(base)
    assert rep.params_after == count_parameters(model) < rep.params_before
    out = _out(model, batches[0])
    assert out.shape == _out(base, batches[0]).shape and torch.isfinite(out).all()


@pytest.mark.parametrize("method", METHODS)
def test_full_rank_reproduces_the_model(method, base, batches):
    cls = layer_methods()[method]
    model = copy.deepcopy(base)
    full = {n: min(m.in_features, m.out_features) for n, m in base.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("encoder.layer.")}
    rep = _run(model, method, batches, allocation=full)
    assert rep.ranks == full
    if not cls.exact_at_full_rank:
        pytest.skip(f"{method} does not target the layer itself at full rank")
    ref = _out(base, batches[1])
    assert (_out(model, batches[1]) - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert max(lr.rel_error for lr in rep.layers) < 1e-6


@pytest.mark.parametrize("method", METHODS)
def test_deterministic(method, base, batches):
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ra = _run(a, method, batches, ratio=0.4)
    rb = _run(b, method, batches, ratio=0.4)
    assert ra.ranks == rb.ranks
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("method", METHODS)
def test_save_load_is_bit_exact(method, base, batches, tmp_path):
    model = copy.deepcopy(base)
    rep = _run(model, method, batches, ratio=0.4)
    save_compressed(model, tmp_path / "out", rep)
    back = load_compressed(tmp_path / "out")
    assert type(back) is type(model)
    for b in batches:
        assert torch.equal(_out(back, b), _out(model, b))
    assert count_parameters(back) == rep.params_after


@pytest.mark.parametrize("method", METHODS)
def test_failure_leaves_the_model_unchanged(method, base, batches, monkeypatch):
    cls = layer_methods()[method]
    model = copy.deepcopy(base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = {"n": 0}
    orig_fit = cls.fit

    def flaky(self, name, layer, rank, stats=None, paired=None):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure")
        return orig_fit(self, name, layer, rank, stats=stats, paired=paired)

    monkeypatch.setattr(cls, "fit", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        _run(model, method, batches, ratio=0.4)
    assert calls["n"] == 5
    assert not any(isinstance(m, LowRankLinear) for m in model.modules())
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("method", METHODS)
def test_rank_out_of_range_names_the_layer(method, base, batches):
    model = copy.deepcopy(base)
    name = "encoder.layer.1.intermediate.dense"
    with pytest.raises(ValueError, match="intermediate.dense"):
        _run(model, method, batches, allocation={name: 17})
    assert isinstance(model.get_submodule(name), nn.Linear)
