"""The registry of papers: the fixed list of 38, valid families, honest statuses, id handling."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from rankwise.core import registry
from rankwise.core.errors import UnknownMethodError

REGISTRY_SRC = Path(registry.__file__).read_text(encoding="utf-8")


def _spec_dir() -> Path | None:
    here = Path(__file__).resolve()
    env = os.environ.get("RANKWISE_SPEC_DIR")  # the specs live beside the checkout, not in it
    for cand in ([Path(env)] if env else []) + [here.parents[1] / "shared" / "methods",
                                                  here.parents[2] / "shared" / "methods"]:
        if cand.is_dir():
            return cand
    return None


def test_38_papers_with_unique_ids() -> None:
    # Count the literal entries, so that a duplicated id (silently collapsed by the dict) fails.
    ids = re.findall(r'^\s*_p\("([a-z0-9_]+)"', REGISTRY_SRC, flags=re.M)
    paper_ids = [i for i in ids if i not in registry.REFERENCES]
    assert len(paper_ids) == 38 == len(registry.PAPERS)
    assert len(set(ids)) == len(ids)
    assert not set(registry.PAPERS) & set(registry.REFERENCES)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", i) for i in registry.all_ids())


def test_paper_records_are_complete() -> None:
    for id, p in {**registry.PAPERS, **registry.REFERENCES}.items():
        assert p.id == id
        assert p.family in registry.FAMILIES, (id, p.family)
        assert p.name.strip() and p.summary.strip()
    for p in registry.PAPERS.values():
        assert p.venue in ("ICML 2026", "ICLR 2026")
        assert p.seed_list in (registry.ICML_LIST, registry.ICLR_LIST)
    assert {p.venue for p in registry.REFERENCES.values()} == {"reference"}


def test_every_spec_has_a_paper_and_back() -> None:
    specs = _spec_dir()
    if specs is None:
        pytest.skip("shared/methods specs are not available in this checkout")
    assert {p.stem for p in specs.glob("*.md")} == set(registry.PAPERS)


def test_status_is_honest() -> None:
    registry.discover()
    for id in registry.all_ids():
        status = registry.status(id)
        if id not in registry._ENTRIES:
            assert status == "planned", id
        else:
            assert status == ("reproduced" if registry.has_reproduction(id) else "implemented"), id
    for id, entry in registry._ENTRIES.items():
        assert entry.family == registry.info(id).family
        assert entry.module.startswith("rankwise."), (id, entry.module)
        assert entry.module.split(".")[1] in registry.FAMILIES, (id, entry.module)


def test_manifest_matches_the_modules() -> None:
    """The static manifest (what `rankwise list` and the README read without importing torch) names
    exactly the methods that importing every method module registers."""
    assert registry.registered_ids() == registry.discovered_ids(), (
        "src/rankwise/core/manifest.py is stale: run `python -m rankwise.readme` and commit it")


def test_listing_imports_no_method_module() -> None:
    """`rankwise list` and `rankwise --help` stay fast: the CLI, the registry table and the README
    table import neither torch nor any method family."""
    import subprocess
    import sys

    code = ("import sys; import rankwise.cli; from rankwise.core import registry; from rankwise import readme; "
            "registry.table(include_references=True); readme.papers_table_markdown(); "
            "bad = sorted(m for m in sys.modules if m in ('torch', 'numpy', 'transformers') or "
            "m.split('.')[:2] in ([ 'rankwise', f] for f in registry.FAMILIES)); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_reproduction_without_an_implementation() -> None:
    """A reproduction module of a paper whose method never registered would make 'reproduced' a lie."""
    registry.discover()
    orphans = [i for i in registry.all_ids() if registry.has_reproduction(i) and i not in registry._ENTRIES]
    assert not orphans, f"reproductions without a registered method: {orphans}"


def test_method_modules_register_their_own_ids() -> None:
    """Each module that calls register() with a literal id registers it (nothing is marked by hand)."""
    registry.discover()
    root = Path(registry.__file__).resolve().parents[1]
    for fam in registry.FAMILIES:
        for path in (root / fam).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                        == "register" and node.args and isinstance(node.args[0], ast.Constant)):
                    id = node.args[0].value
                    assert id in registry._ENTRIES, (path, id)


def test_register_and_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ENTRIES", {})
    monkeypatch.setattr(registry, "_DISCOVERED", True)
    # since santa every paper is registered and reproduced: pretend none is
    monkeypatch.setattr(registry, "has_reproduction", lambda i: False)
    monkeypatch.setattr(registry, "registered_ids", lambda: {})
    id = next(iter(registry.PAPERS))
    assert registry.status(id) == "planned"
    with pytest.raises(UnknownMethodError, match="planned"):
        registry.get(id)

    class Cfg:
        pass

    def entry() -> None:
        pass

    e = registry.register(id, config=Cfg, entry=entry)
    assert e.kind == "paper" and e.family == registry.PAPERS[id].family and e.module == __name__
    assert registry.status(id) == "implemented" and registry.get(id) is e
    assert registry.register("lora").kind == "reference"


def test_register_unknown_id_fails() -> None:
    with pytest.raises(UnknownMethodError, match="cannot register 'not_a_paper'"):
        registry.register("not_a_paper")


def test_normalize_and_suggestions() -> None:
    assert registry.normalize_id("Swift-SVD") == "swift_svd"
    assert registry.normalize_id(" lora ") == "lora"
    with pytest.raises(UnknownMethodError, match="did you mean 'swift_svd'"):
        registry.normalize_id("swft_svd")
    with pytest.raises(UnknownMethodError, match="rankwise list") as err:
        registry.info("zzzzzzzz")
    assert "did you mean" not in str(err.value)
    assert isinstance(err.value, KeyError)  # still catchable as a lookup error


def test_table_rows() -> None:
    rows = registry.table()
    assert [r["id"] for r in rows] == list(registry.PAPERS)
    assert {tuple(sorted(r)) for r in rows} == {("family", "id", "name", "status", "summary", "venue")}
    with_refs = registry.table(include_references=True)
    assert [r["id"] for r in with_refs] == registry.all_ids()
