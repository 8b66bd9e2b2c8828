"""The merge registry: every method is a MergeMethod with its config class; the old module names still import."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch

import rankwise.merge as merge_pkg
from rankwise.core.errors import UnknownMethodError
from rankwise.core.lora import AdapterState
from rankwise.merge import CtMConfig, MergeConfig, ctm_merge, merge_methods, mtc_merge, resolve_merge_method
from rankwise.merge import baselines
from rankwise.merge.base import MergeMethod, register_merge_method
from rankwise.merge.dirs import METHODS, build_config

MODS = ("q", "v")


def lora(seed: int, m: int = 12, n: int = 10, r: int = 3) -> AdapterState:
    g = torch.Generator().manual_seed(seed)
    f = {k: {"lora_A": torch.randn(r, n, generator=g), "lora_B": torch.randn(m, r, generator=g)} for k in MODS}
    return AdapterState({"rank": r, "alpha": r}, f, {k: 1.0 for k in MODS})


def test_every_method_is_registered_with_its_config_class():
    methods = merge_methods()
    assert list(methods)[:1] == ["ctm"]
    assert set(methods) == {"ctm", "ta", "ties", "dare", "iso_c", "mtc", "knots", "core"}
    assert methods["ctm"].config_class is CtMConfig
    assert all(m.config_class is MergeConfig for n, m in methods.items() if n != "ctm")
    assert METHODS["knots"] == ("knots", "ties") and METHODS["ctm"] == ("ctm", "ties") and METHODS["mtc"] == ("full", "ta")


@pytest.mark.parametrize("name,space,rule", [("ta", "full", "ta"), ("ties", "full", "ties"), ("dare", "full", "dare"),
                                             ("iso_c", "full", "iso_c"), ("knots", "knots", "ties"),
                                             ("core", "core", "ties"), ("mtc", "full", "ta")])
def test_run_equals_the_direct_call(name, space, rule):
    ads = [lora(i) for i in range(3)]
    method = resolve_merge_method(name.upper())
    cfg = method.build_config(3, density=0.5)
    assert (cfg.space, cfg.rule, cfg.density) == (space, rule, 0.5)
    state, diag = method.run(ads, cfg)
    assert diag == {}
    ref = mtc_merge(ads, MergeConfig(rank=3, space=space, rule=rule, density=0.5))
    for m in MODS:
        assert torch.equal(state.delta_weight(m), ref.delta_weight(m))


def test_ctm_reports_kept_energy():
    ads = [lora(i) for i in range(2)]
    cfg = build_config("ctm", 3, beta=0.5, rule="ta")
    state, diag = resolve_merge_method("ctm").run(ads, cfg)
    assert len(diag["kept_energy"]) == 2 and all(0 < e <= 1 + 1e-9 for e in diag["kept_energy"])
    ref = ctm_merge(ads, CtMConfig(rank=3, beta=0.5, rule="ta"))
    assert torch.equal(state.delta_weight("q"), ref.delta_weight("q"))


def test_bad_options_name_the_method():
    with pytest.raises(ValueError, match="fixes the rule to 'ties'"):
        build_config("ties", 4, rule="ta")
    build_config("ties", 4, rule="TIES")  # the same rule, spelled differently, is fine
    with pytest.raises(ValueError, match="--beta applies to --method ctm only, not 'ta'"):
        build_config("ta", 4, beta=0.5)
    with pytest.raises(ValueError, match="--nope applies to no merge method"):
        build_config("ctm", 4, nope=1)
    with pytest.raises(UnknownMethodError, match="--method must be one of"):
        resolve_merge_method("nope")
    with pytest.raises(ValueError, match="need a value in preset"):
        register_merge_method(MergeMethod("x", MergeConfig, mtc_merge, fixed=("rule",)))


def test_baselines_module_keeps_every_name():
    for name in ["RULES", "SPACES", "MergeConfig", "MergeInputs", "adapter_seed", "core_bases", "core_matrices",
                 "check_adapters", "flatten_isotropic", "merge", "merge_tensors", "merged_deltas", "mtc_merge",
                 "sign_fix", "truncate", "canonical_rule", "scaled_factors", "top_left_singular", "describe",
                 "_factors", "_module_factors", "_out_state", "_merged_delta_module", "_RULE_ALIASES"]:
        assert hasattr(baselines, name), name
    assert baselines.merge is mtc_merge


def test_baselines_validators_are_deprecated():
    with pytest.warns(DeprecationWarning, match="check_int"):
        baselines.check_rank("X.rank", 2)
    with pytest.warns(DeprecationWarning, match="check_number"):
        assert baselines.check_scale("X.scale", 2) == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=r"X.d must be a number in \(0, 1\], got 0"):
            baselines._check_unit("X.d", 0, True, False)


def test_merge_modules_import_no_private_name_of_each_other_and_no_other_family():
    root = pathlib.Path(merge_pkg.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "baselines.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rankwise.merge"):
                assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.module)
                assert node.module != "rankwise.merge.baselines", path
            if isinstance(node, ast.ImportFrom) and node.module:
                family = node.module.split(".")[1] if node.module.startswith("rankwise.") else None
                assert family in (None, "merge", "core"), (path, node.module)
