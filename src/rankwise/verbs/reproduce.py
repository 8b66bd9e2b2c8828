"""``rankwise reproduce ID``: run one paper's reproduction and print its table, checks and verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from rankwise.verbs import common


def _print_result(console: Any, result: Any, out: Path) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"{result.id} ({result.mode}, seeds {', '.join(map(str, result.seeds))})",
              title_justify="left")
    t.add_column("", overflow="fold")
    for c in result.table.columns:
        t.add_column(c + ("*" if c in result.table.notes else ""), justify="right", overflow="fold")
    for r in result.table.rows:
        t.add_row(r, *[result.table.cell(r, c) for c in result.table.columns])
    console.print(t)
    for c, note in result.table.notes.items():
        console.print(Text(f"* {c}: {note}", style="dim"))
    console.print(Text("Claim: ", style="bold") + Text(result.claim))
    for c in result.checks:
        mark = Text("  ✓ " if c.holds else "  ✗ ", style="green" if c.holds else "red")
        console.print(mark + Text(c.describe()))
    colour = "green" if result.verdict == "holds" else "red"
    cached = " (from the cache)" if result.cache_hit else ""
    console.print(Text("Verdict: ", style="bold") + Text(result.verdict, style=f"bold {colour}")
                  + Text(f" (smallest margin {result.margin:+.3g}; {result.wall_time_s:.1f} s{cached})"))
    if result.notes:
        console.print(Text("Notes: ", style="bold") + Text(result.notes))


def reproduce_cmd(
    ctx: typer.Context,
    id: str = typer.Argument(..., metavar="ID", help="Paper id (see `rankwise list`), e.g. swift_svd."),
    smoke: bool = common.SMOKE,
    quick: bool = common.QUICK,
    full: bool = common.FULL,
    seeds: Optional[List[str]] = common.SEEDS,
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: runs/<id>)."),
    no_cache: bool = common.NO_CACHE,
) -> None:
    """Run one paper's reproduction: table, claim checks, verdict, JSON and figures.

    ID is a paper or reference id from `rankwise list` (e.g. swift_svd, lora).
    """
    from rankwise.repro.harness import reproduce

    mode = common.parse_mode(smoke, quick, full)
    result = reproduce(id, mode=mode, seeds=common.parse_seeds(seeds), out_dir=out, use_cache=not no_cache,
                       progress=common.progress(ctx))
    folder = result.source_dir or out
    console = common.console()
    if not common.settings(ctx).quiet:
        _print_result(console, result, folder)
    console.print(f"result: {folder / 'result.json'}", soft_wrap=True, markup=False)
    for f in result.figures:
        console.print(f"figure: {folder / f}", soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    app.command("reproduce", cls=common.MultiValueCommand)(reproduce_cmd)
