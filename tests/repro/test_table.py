"""The measured table of docs/reproductions.md is generated from report summaries, never typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankwise.repro import table


def _summary(mode: str, runs: dict[str, tuple[str, float, float, str]], load: float = 0.1) -> dict:
    papers = [{"id": i, "kind": "paper", "verdict": v, "reason": why, "cpu_time_s": cpu, "wall_time_s": wall,
               "environment": {"threads": 1, "cpus": 2, "loadavg_start": [load, 0.2, 0.3], "time": "2026-12-02T05:00:00"}}
              for i, (v, cpu, wall, why) in runs.items()]
    papers.append({"id": "zz_ref", "kind": "reference"})  # listed but not run: no verdict, no row data
    return {"mode": mode, "papers": papers}


def test_table_rows_times_and_budgets() -> None:
    quick = _summary("quick", {"a": ("holds", 30.4, 31.0, ""), "b": ("inconclusive", 75.0, 80.0, "interval | wide")},
                     load=0.05)
    full = _summary("full", {"b": ("does not hold", 400.0, 410.0, "B below A by 3 points")}, load=1.4)
    md = table.measured_table(quick, full, ids=["a", "b", "c"])
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| `")}
    assert rows["`a`"].split("|")[2:8] == [" holds ", " 30 ", " 31 ", " not run ", " – ", " – "]
    # the full mode's reason wins; a '|' in a reason cannot break the table
    assert "B below A by 3 points" in rows["`b`"] and "interval" not in rows["`b`"]
    assert rows["`c`"].count("not run") == 2
    assert "load average at the start 0.05 to 0.05" in md and "1.40 to 1.40" in md
    assert "Over the 60 s budget (wall time): `b` (1 thread of 2)." in md  # 80 s > 60, on 1 of 2 cores
    assert "ran beside others" in md
    assert "Quick: 1 holds, 1 inconclusive, 1 not run." in md
    assert "zz_ref" not in md  # rows are the ids asked for


def test_table_escapes_and_shortens_reasons() -> None:
    md = table.measured_table(_summary("quick", {"a": ("inconclusive", 1.0, 1.0, "x | y " * 100)}), None, ids=["a"])
    row = next(line for line in md.splitlines() if line.startswith("| `a`"))
    assert "x \\| y" in row and row.rstrip(" |").endswith("…")
    assert "full:" not in md


def test_write_table_replaces_only_the_section(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{table.START}\nold\n{table.END}\noutro\n")
    assert table.write_table("new table\n", doc) is True
    assert doc.read_text() == f"intro\n{table.START}\nnew table\n{table.END}\noutro\n"
    assert table.write_table("new table\n", doc) is False
    bad = tmp_path / "bad.md"
    bad.write_text("no markers\n")
    with pytest.raises(ValueError, match="measured:start"):
        table.write_table("x", bad)
    assert bad.read_text() == "no markers\n"


def test_main_errors_are_clear(tmp_path: Path, capsys) -> None:
    assert table.main(["--quick", str(tmp_path / "missing.json")]) == 2
    assert "no such summary" in capsys.readouterr().err
    (tmp_path / "x.json").write_text(json.dumps({"rows": []}))
    assert table.main(["--quick", str(tmp_path / "x.json")]) == 2
    assert "not a rankwise report summary" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one"):
        table.measured_table(None, None)


def test_docs_have_the_measured_section() -> None:
    text = table.DEFAULT_DOC.read_text(encoding="utf-8")
    assert text.count(table.START) == 1 and text.count(table.END) == 1


def test_over_budget_on_all_cores_has_no_thread_note() -> None:
    quick = _summary("quick", {"b": ("holds", 150.0, 80.0, "")})
    quick["papers"][0]["environment"]["threads"] = 2
    md = table.measured_table(quick, None, ids=["b"])
    assert "Over the 60 s budget (wall time): `b`." in md and "ran beside others" not in md


def test_docs_table_is_the_one_generated_from_the_kept_summaries() -> None:
    """docs/reproductions.md's measured section is exactly what the kept summaries generate (regenerate with
    `python -m rankwise.repro.table --quick docs/measured/quick-summary.json --full docs/measured/full-summary.json
    --write` after copying new summaries)."""
    root = Path(__file__).resolve().parents[2]
    doc, kept = root / "docs" / "reproductions.md", root / "docs" / "measured"
    if not doc.is_file() or not (kept / "quick-summary.json").is_file():
        pytest.skip("not a source checkout")
    full = kept / "full-summary.json"
    md = table.measured_table(table.load_summary(kept / "quick-summary.json"),
                              table.load_summary(full) if full.is_file() else None)
    text = doc.read_text(encoding="utf-8")
    assert text[text.index(table.START) + len(table.START):text.index(table.END)] == "\n" + md
