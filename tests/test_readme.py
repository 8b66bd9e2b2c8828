"""The README's papers table is generated from the registry and must be current."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwise import readme
from rankwise.core import registry

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_is_current() -> None:
    assert README.is_file()
    assert readme.check_readme(README), (
        "README.md's papers table is stale (a method was registered or a reproduction added): "
        "run `python -m rankwise.readme` and commit README.md")


def test_table_lists_every_paper_with_status() -> None:
    md = readme.papers_table_markdown()
    statuses = {r["id"]: r["status"] for r in registry.table(include_references=True)}
    lines = md.splitlines()
    for id, status in statuses.items():
        (line,) = [ln for ln in lines if f"| `{id}` |" in ln]
        assert f"| {status} |" in line
    counts = {s: list(statuses[i] for i in registry.PAPERS).count(s) for s in ("reproduced", "implemented", "planned")}
    assert lines[0] == (f"38 papers: {counts['reproduced']} reproduced, {counts['implemented']} implemented, "
                        f"{counts['planned']} planned.")


def test_family_filter() -> None:
    md = readme.papers_table_markdown(family="merge")
    assert "`ctm`" in md and "`swift_svd`" not in md
    with pytest.raises(ValueError, match="family must be one of"):
        readme.papers_table_markdown(family="nope")


def test_update_keeps_the_prose(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("# Title\n\nprose before\n\n<!-- papers:start -->\nold | table\n<!-- papers:end -->\n\nafter\n")
    assert not readme.check_readme(path)
    assert readme.update_readme(path) is True
    text = path.read_text()
    assert text.startswith("# Title\n\nprose before\n\n<!-- papers:start -->\n")
    assert text.endswith("<!-- papers:end -->\n\nafter\n")
    assert readme.check_readme(path)
    assert readme.update_readme(path) is False  # idempotent
    assert readme.main([str(path), "--check"]) == 0


def test_missing_markers(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("# no markers\n")
    with pytest.raises(ValueError, match="papers:start"):
        readme.update_readme(path)
    assert path.read_text() == "# no markers\n"
    assert readme.main([str(path)]) == 2
