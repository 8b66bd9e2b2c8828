"""``rankwise reproduce ID``: run one paper's reproduction and print its table, checks and verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from rankwise.verbs import common


_STYLE = {"holds": "green", "does not hold": "red", "inconclusive": "yellow", "wiring only": "cyan"}


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
    if result.overrides:
        console.print(Text("Settings changed: ", style="bold")
                      + Text(", ".join(f"{k}={v}" for k, v in result.overrides.items())))
    for p in result.preconditions:
        mark = Text("  ✓ " if p.holds else "  ✗ ", style="green" if p.holds else "yellow")
        console.print(mark + Text("precondition: " + p.describe()))
    marks = {"holds": "  ✓ ", "does not hold": "  ✗ ", "inconclusive": "  ? "}
    for c in result.checks:
        mark = Text(marks[c.status], style=_STYLE[c.status])
        console.print(mark + Text(f"[{c.kind}] ", style="dim") + Text(c.describe()))
    cached = " (from the cache)" if result.cache_hit else ""
    console.print(Text("Verdict: ", style="bold") + Text(result.verdict_text, style=f"bold {_STYLE[result.verdict]}")
                  + Text(f" (smallest margin {result.margin:+.3g}; {result.wall_time_s:.1f} s{cached})"))
    if result.reason and result.verdict != "holds":
        console.print(Text("Why: ", style="bold") + Text(result.reason))
    if result.notes:
        console.print(Text("Notes: ", style="bold") + Text(result.notes))


def _print_settings(console: Any, id: str, mode: str, overrides: dict[str, str]) -> None:
    """The settings of ``id`` in ``mode`` (with ``overrides``): name, value, meaning."""
    from rich.table import Table

    from rankwise.core import registry
    from rankwise.repro.harness import load_module, reproduction_class

    key = registry.normalize_id(id)
    cls = reproduction_class(load_module(key))
    if cls is None:
        raise ValueError(f"{key} has no settings (its module does not use the reproduction skeleton)")
    s = cls.settings_for(mode, overrides)
    t = Table(title=f"{key} settings ({mode}); change with --set name=value", title_justify="left")
    for col in ("name", "value", "meaning"):
        t.add_column(col, overflow="fold")
    docs = s.docs()
    for name, value in s.to_json().items():
        t.add_row(name, repr(value), docs.get(name, ""))
    console.print(t)


def reproduce_cmd(
    ctx: typer.Context,
    id: str = typer.Argument(..., metavar="ID", help="Paper id (see `rankwise list`), e.g. swift_svd."),
    smoke: bool = common.SMOKE,
    quick: bool = common.QUICK,
    full: bool = common.FULL,
    seeds: Optional[List[str]] = common.SEEDS,
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: runs/<id>)."),
    no_cache: bool = common.NO_CACHE,
    set_: Optional[List[str]] = typer.Option(
        None, "--set", metavar="KEY=VALUE",
        help="Change a setting of the mode, e.g. --set rank=4 targets=query,value (see --show-settings)."),
    show_settings: bool = typer.Option(False, "--show-settings",
                                       help="Print the mode's settings (with any --set) and exit."),
) -> None:
    """Run one paper's reproduction: table, claim checks, verdict, JSON and figures.

    ID is a paper or reference id from `rankwise list` (e.g. swift_svd, lora).
    """
    from rankwise.repro.harness import reproduce
    from rankwise.repro.skeleton import parse_overrides

    mode = common.parse_mode(smoke, quick, full)
    try:
        overrides = parse_overrides(set_ or [])
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--set") from None
    console = common.console()
    if show_settings:
        _print_settings(console, id, mode, overrides)
        return
    result = reproduce(id, mode=mode, seeds=common.parse_seeds(seeds), out_dir=out, use_cache=not no_cache,
                       progress=common.progress(ctx), overrides=overrides)
    folder = result.source_dir or out
    if not common.settings(ctx).quiet:
        _print_result(console, result, folder)
    console.print(f"result: {folder / 'result.json'}", soft_wrap=True, markup=False)
    for f in result.figures:
        console.print(f"figure: {folder / f}", soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    app.command("reproduce", cls=common.MultiValueCommand)(reproduce_cmd)
