import pytest
import torch
from torch import nn

from rankwise.core.errors import SelectionError
from rankwise.core.select import available_names, describe, matcher, select
from rankwise.core.surgery import (count_parameters, freeze, get_submodule, parameter_report, replace_module,
                                   transaction, unfreeze, wrap_module)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(4, 4)
        self.key = nn.Linear(4, 4)
        self.value = nn.Linear(4, 4)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attn()
        self.norm = nn.LayerNorm(4)
        self.dense = nn.Linear(4, 8)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.Linear(8, 2), nn.ReLU())


def names(hits):
    return [n for n, _ in hits]


QKV0 = ["layers.0.attention.query", "layers.0.attention.key", "layers.0.attention.value"]


def test_select_by_type_and_types_restriction():
    m = Model()
    lin = names(select(m, nn.Linear))
    assert len(lin) == 9 and lin[0] == "layers.0.attention.query"  # model order
    assert names(select(m, None, types=(nn.Linear,))) == lin
    assert names(select(m, (nn.LayerNorm, nn.ReLU))) == ["layers.0.norm", "layers.1.norm", "head.1"]
    # a type target is intersected with types
    assert names(select(m, nn.Module, types=(nn.LayerNorm,))) == ["layers.0.norm", "layers.1.norm"]
    with pytest.raises(SelectionError, match="unsupported types"):
        select(m, nn.LayerNorm, types=(nn.Linear,))
    with pytest.raises(SelectionError, match="required"):
        select(m, None)


def test_select_by_glob_regex_bare_name_list_and_callable():
    m = Model()
    assert names(select(m, "layers.0.attention.*")) == QKV0
    assert names(select(m, "*.query")) == ["layers.0.attention.query", "layers.1.attention.query"]
    assert names(select(m, "re:layers\\.1\\..*\\.(query|value)")) == ["layers.1.attention.query",
                                                                       "layers.1.attention.value"]
    with pytest.raises(SelectionError):  # regex must match the whole name
        select(m, "re:query")
    assert names(select(m, "dense")) == ["layers.0.dense", "layers.1.dense"]
    assert names(select(m, ["key", "dense"])) == ["layers.0.attention.key", "layers.0.dense",
                                                  "layers.1.attention.key", "layers.1.dense"]
    assert names(select(m, ("key",), types=(nn.Linear,))) == ["layers.0.attention.key", "layers.1.attention.key"]
    pick = select(m, lambda n, mod: isinstance(mod, nn.Linear) and mod.out_features == 8)
    assert names(pick) == ["layers.0.dense", "layers.1.dense"]
    assert all(mod is get_submodule(m, n) for n, mod in pick)
    pred = matcher("*.dense", types=(nn.Linear,))
    assert pred("layers.0.dense", m.layers[0].dense) and not pred("layers.0.norm", m.layers[0].norm)


def test_name_patterns_filtered_by_types():
    m = Model()
    # "attention" matches the Attn parents only; with types=Linear that is an error, not silence
    with pytest.raises(SelectionError, match="unsupported types"):
        select(m, "attention", types=(nn.Linear,))
    assert names(select(m, "layers.0.*", types=(nn.Linear,))) == QKV0 + ["layers.0.dense"]
    assert names(select(m, ["layers.0.*"], types=(nn.LayerNorm,))) == ["layers.0.norm"]
    assert names(select(m, lambda n, mod: n.startswith("head"), types=(nn.Linear,))) == ["head.0"]


def test_no_match_lists_available_names():
    m = Model()
    with pytest.raises(SelectionError, match="matched no module") as e:
        select(m, "*.q_proj")
    msg = str(e.value)
    assert "layers.0.attention.query" in msg and "head.0" in msg
    with pytest.raises(SelectionError, match="Available Linear modules") as e:
        select(m, "q_proj", types=(nn.Linear,))
    assert "layers.0.norm" not in str(e.value)
    assert select(m, "q_proj", allow_empty=True) == []
    with pytest.raises(SelectionError, match="unsupported target"):
        select(m, 42)
    with pytest.raises(SelectionError, match="sequence"):
        select(m, [])
    with pytest.raises(SelectionError, match="sequence"):
        select(m, ["query", 3])
    assert available_names(m, (nn.LayerNorm,)) == ["layers.0.norm", "layers.1.norm"]
    assert describe(select(m, nn.Linear)).startswith("9 module(s): layers.0.attention.query")
    assert "" not in names(select(m, lambda n, mod: True))  # the root is never selected


def test_replace_and_wrap():
    m = Model()
    old = m.layers[1].dense
    new = nn.Linear(4, 8)
    assert replace_module(m, "layers.1.dense", new) is old and m.layers[1].dense is new
    seq_old = m.head[0]
    assert replace_module(m, "head.0", nn.Identity()) is seq_old and isinstance(m.head[0], nn.Identity)
    blk = m.layers[0]
    assert replace_module(m, "layers.0", nn.Identity()) is blk and isinstance(m.layers[0], nn.Identity)
    w = wrap_module(m, "layers.1.attention.query", lambda mod: nn.Sequential(mod, nn.ReLU()))
    assert m.layers[1].attention.query is w and isinstance(w[0], nn.Linear)
    with pytest.raises(ValueError, match="root"):
        replace_module(m, "", nn.Identity())
    with pytest.raises(AttributeError):
        replace_module(m, "layers.1.missing", nn.Identity())
    with pytest.raises(TypeError, match="not a submodule"):
        replace_module(m, "layers.1.dense.weight", nn.Identity())
    assert isinstance(m.layers[1].dense.weight, nn.Parameter)
    with pytest.raises(TypeError, match="nn.Module"):
        replace_module(m, "layers.1.dense", torch.zeros(2))


def test_transaction_restores_on_exception():
    m = Model()
    before = dict(m.named_modules())
    flags = {n: p.requires_grad for n, p in m.named_parameters()}
    m.layers[0].norm.weight.requires_grad_(False)
    flags["layers.0.norm.weight"] = False
    with pytest.raises(RuntimeError, match="fail"):
        with transaction(m) as log:
            replace_module(m, "layers.0.attention.query", nn.Identity())
            replace_module(m, "layers.1", nn.Identity())
            replace_module(m, "head.0", nn.Linear(8, 2))
            freeze(m)
            m.layers[0].norm.weight.requires_grad_(True)
            assert len(log) == 3
            raise RuntimeError("fail")
    assert dict(m.named_modules()) == before
    assert {n: p.requires_grad for n, p in m.named_parameters()} == flags


def test_transaction_commits_and_nests():
    m = Model()
    q = nn.Identity()
    with transaction(m):
        replace_module(m, "layers.0.attention.query", q)
    assert m.layers[0].attention.query is q
    orig_key, orig_dense = m.layers[0].attention.key, m.layers[0].dense
    with pytest.raises(KeyError):
        with transaction(m):
            replace_module(m, "layers.0.attention.key", nn.Identity())
            with pytest.raises(ValueError):
                with transaction(m):
                    replace_module(m, "layers.0.dense", nn.Identity())
                    raise ValueError("inner")
            assert m.layers[0].dense is orig_dense  # inner rolled back alone
            with transaction(m):
                replace_module(m, "layers.0.dense", nn.Identity())  # inner commits
            raise KeyError("outer")
    assert m.layers[0].attention.key is orig_key and m.layers[0].dense is orig_dense
    assert m.layers[0].attention.query is q  # the earlier committed transaction stays


def test_count_freeze_unfreeze():
    m = Model()
    n_lin = 6 * (16 + 4) + 2 * (32 + 8) + (16 + 2)
    n_norm = 2 * 8
    assert count_parameters(m) == n_lin + n_norm
    shared = nn.Sequential(m.head[0], m.head[0])
    assert count_parameters(shared) == 18
    assert freeze(m, except_=lambda n, p: n.endswith("norm.weight")) == 9 * 2 + 2
    assert count_parameters(m, trainable_only=True) == 8
    rep = parameter_report(m)
    assert rep["total"] == n_lin + n_norm and rep["trainable"] == 8
    assert rep["fraction"] == pytest.approx(8 / (n_lin + n_norm))
    assert unfreeze(m, only=lambda n, p: n.startswith("head")) == 2
    assert unfreeze(m) == 9 * 2 + 2 - 2
    assert parameter_report(nn.ReLU())["fraction"] == 0.0
