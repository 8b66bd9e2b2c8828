"""The federated family's structure: no import cycle, methods found from any process, the renamed config."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import rankwise.federated as family

PKG = Path(family.__file__).parent
BUILTIN = ("fslora", "fedavg", "hetlora", "flexlora", "ub-smoe", "smoe-naive", "smoe-llb", "a3smoe", "florist")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """``module -> modules of the family it imports``, counting imports anywhere (inside functions too).

    ``from pkg import sub`` counts as importing the submodule ``pkg.sub`` (when it is one), not ``pkg``.
    """
    mods = {_module_name(f): f for f in PKG.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = subs if all(s in mods for s in subs) else [node.module, *subs]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    edges[m].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found = []
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for n in sorted(edges[node]):
                if n == start:
                    found.append(path + [start])
                elif n > start and n not in path:
                    stack.append((n, path + [n]))
    return found


def test_no_import_cycle_in_the_family():
    edges = _import_graph()
    assert "rankwise.federated.registry" in edges and len(edges) >= 14
    assert _cycles(edges) == []
    # the graph check can fail: a cycle is found when there is one
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    # the runner no longer reaches the method modules
    assert not {"rankwise.federated.ub_smoe", "rankwise.federated.fslora"} & edges["rankwise.federated.runner"]


def test_a_fresh_process_finds_every_method():
    """What a Ray worker or a SuperNode's ClientApp does: resolve a method without importing its module first."""
    code = ("import json, sys\n"
            "from rankwise.federated.config import FederatedConfig\n"
            "from rankwise.federated.runner import RunSettings, client_fn_from_settings, methods\n"
            "s = RunSettings(method='ub-smoe', task='synthetic-moe', num_clients=2,"
            " config=FederatedConfig(clients_per_round=2))\n"
            "fn = client_fn_from_settings(s)\n"
            "print(json.dumps({'methods': list(methods()), 'client': fn.__qualname__,"
            " 'loaded': 'rankwise.federated.ub_smoe' in sys.modules}))\n")
    env = dict(os.environ, PYTHONPATH=str(PKG.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(got["methods"]) == BUILTIN
    assert got["loaded"] and got["client"].startswith("make_client_fn")


def test_registry_entries():
    from rankwise.federated import registry
    from rankwise.federated.config import FederatedConfig
    from rankwise.federated.ub_smoe import UBSMoEConfig

    assert registry.names() == BUILTIN
    assert registry.get("ub-smoe").default_task == "synthetic-moe" and registry.get("ub-smoe").config is UBSMoEConfig
    assert registry.get("fslora").default_task == "minilm" and registry.get("fslora").config is FederatedConfig
    assert registry.get("florist").client_factory is None
    with pytest.raises(ValueError, match="method must be one of"):
        registry.get("fedprox")


def test_fslora_config_is_a_deprecated_alias():
    from rankwise.federated.config import FederatedConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from rankwise.federated import FSLoRAConfig
        from rankwise.federated.config import FSLoRAConfig as again
    assert FSLoRAConfig is FederatedConfig and again is FederatedConfig
    assert any(issubclass(w.category, DeprecationWarning) and "FederatedConfig" in str(w.message) for w in caught)


def test_synthetic_moe_task_lives_with_the_tasks():
    from rankwise.federated import tasks, ub_smoe

    assert ub_smoe.SyntheticMoETask is tasks.SyntheticMoETask
    assert tasks.resolve_task("synthetic-moe", {"num_clients": 2, "per_client": 8, "n_test": 8}).num_clients == 2
