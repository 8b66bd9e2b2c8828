"""The one verb: ``compress(model, <method config>, calib=...)`` for every method, chosen by the config's
type through the layer-method registry; the deprecated spellings; the package's import structure."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import rankwise.compress as C
from rankwise.compress import CompressConfig, compress
from rankwise.compress.base import method_for_config


def _bert(layers: int = 2, seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    return BertModel(cfg).eval()


def _batches(n: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (4, 8), generator=g),
             "attention_mask": torch.ones(4, 8, dtype=torch.long)} for _ in range(n)]


def _loss(out, batch):
    return out.last_hidden_state.square().mean()


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


# every method config, the registered method it names, and the CompressConfig it equals
CASES = [
    (C.PlainSVDConfig(param_ratio=0.5), "svd", CompressConfig(method="svd", ratio=0.5)),
    (C.ASVDConfig(param_ratio=0.5, alpha=0.7), "asvd", CompressConfig(method="asvd", ratio=0.5, options={"alpha": 0.7})),
    (C.FWSVDConfig(param_ratio=0.5, fisher="sample"), "fwsvd",
     CompressConfig(method="fwsvd", ratio=0.5, options={"fisher": "sample"})),
    (C.SVDLLMConfig(param_ratio=0.5, allocation="dynamic"), "svd-llm",
     CompressConfig(method="svd-llm", ratio=0.5, allocation="dynamic")),
    (C.SwiftSVDConfig(param_ratio=0.5, allocation="uniform"), "swift-svd",
     CompressConfig(method="swift-svd", ratio=0.5)),
    (C.SAESSVDConfig(compression_ratio=0.5), "saes-svd",
     CompressConfig(method="saes-svd", ratio=0.5, options=C.SAESSVDConfig(compression_ratio=0.5).method_options())),
    (C.GFWSVDConfig(param_ratio=0.5, power_iters=3), "gfwsvd",
     CompressConfig(method="gfwsvd", ratio=0.5, options=C.GFWSVDConfig(param_ratio=0.5, power_iters=3).method_options())),
]


@pytest.mark.parametrize("config,name,equivalent", CASES, ids=[c[1] for c in CASES])
def test_config_type_chooses_the_method_and_equals_the_generic_config(config, name, equivalent):
    assert method_for_config(config).name == name == config.method_class.name
    assert method_for_config(config).config_class is type(config)
    base, batches = _bert(), _batches()
    kw = {"loss_fn": _loss} if method_for_config(config).needs_grad else {}
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ra = compress(a, config, calib=batches, **kw)
    rb = compress(b, equivalent, calib=batches, **kw)
    assert ra.method == name and ra.ranks == rb.ranks and ra.layers
    assert _same(a, b)


def test_every_registered_method_has_a_config():
    assert {m.name for m in C.layer_methods().values() if m.config_class is not None} == {c[1] for c in CASES}


def test_config_targets_are_the_default_target_and_bad_configs_fail():
    m = _bert()
    rep = compress(m, C.SVDLLMConfig(param_ratio=0.5, targets="re:.*attention\\.self\\.query"), calib=_batches())
    assert sorted(rep.ranks) == [f"encoder.layer.{i}.attention.self.query" for i in range(2)]
    with pytest.raises(TypeError, match="method config"):
        compress(_bert(), object(), calib=_batches())
    with pytest.raises(ValueError, match="PlainSVDConfig.param_ratio"):
        C.PlainSVDConfig(param_ratio=0.0)
    with pytest.raises(ValueError, match="ASVD.alpha"):
        C.ASVDConfig(alpha=-1.0)
    with pytest.raises(ValueError, match="SVDLLMConfig.allocation"):
        C.SVDLLMConfig(allocation="method")
    with pytest.raises(ValueError, match="FWSVD.fisher"):
        C.FWSVDConfig(fisher="token")


def test_plain_svd_needs_no_data():
    a, b = _bert(), _bert()
    ra = compress(a, C.PlainSVDConfig(param_ratio=0.5))
    rb = compress(b, C.PlainSVDConfig(param_ratio=0.5), calib=_batches())
    assert ra.ranks == rb.ranks and _same(a, b)
    assert all(l.rel_error is None for l in ra.layers) and all(l.rel_error is not None for l in rb.layers)
    with pytest.raises(Exception, match="required"):
        compress(_bert(), C.SVDLLMConfig())  # X^T X is its statistic
    with pytest.raises(Exception, match="required"):
        compress(_bert(), C.PlainSVDConfig(allocation="dynamic"))  # the allocation reads the outputs


def test_the_old_string_form_is_a_deprecated_alias():
    base, batches = _bert(), _batches()
    a, b, c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    compress(a, CompressConfig(method="svd-llm"), calib=batches)
    with pytest.warns(DeprecationWarning, match="compress\\(model, method='svd-llm'\\) is deprecated"):
        compress(b, method="svd-llm", calib=batches)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        compress(c, "svd_llm", batches)
    assert _same(a, b) and _same(a, c)
    with pytest.raises(ValueError, match="not both"):
        compress(_bert(), C.PlainSVDConfig(), method="svd")


def test_command_module_names_are_deprecated_aliases():
    import rankwise.compress.command as cmd
    from rankwise.core.textfiles import tokenize_batches
    from rankwise.train.losses import contrastive_loss
    from rankwise.verbs.compress import compress_command

    for name, obj in (("tokenize_batches", tokenize_batches), ("contrastive_loss", contrastive_loss),
                      ("compress_command", compress_command)):
        with pytest.warns(DeprecationWarning, match=f"command.{name} is deprecated"):
            assert getattr(cmd, name) is obj
    with pytest.raises(AttributeError):
        cmd.nothing_here  # noqa: B018


# ----------------------------------------------------------------------------------------------
# structure: no import cycle inside the package, no import of another family, zoo, verbs or repro


_PKG = Path(C.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Every module of rankwise.compress -> the rankwise modules it imports (imports inside functions count)."""
    mods = {}
    for f in _PKG.rglob("*.py"):
        rel = f.relative_to(_PKG.parent.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    out: dict[str, set[str]] = {}
    for m, f in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
        out[m] = {d for d in deps if d.startswith("rankwise")} - {m}
    return out


def test_no_import_cycle_inside_compress():
    graph = {m: {d for d in ds if d.startswith("rankwise.compress")} for m, ds in _imports().items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph.get(m, ()):
            assert state.get(d) != 1, f"import cycle: {' -> '.join(path[path.index(d):] + [d]) if d in path else d}"
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_compress_imports_only_itself_and_core():
    bad = {m: sorted(d for d in ds if not d.startswith(("rankwise.compress", "rankwise.core")))
           for m, ds in _imports().items()}
    assert not {m: d for m, d in bad.items() if d}, bad
