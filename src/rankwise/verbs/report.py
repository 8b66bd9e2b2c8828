"""``rankwise report``: run every reproduction (cached) and write one HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from rankwise.verbs import common


def report_cmd(
    ctx: typer.Context,
    smoke: bool = common.SMOKE,
    quick: bool = common.QUICK,
    full: bool = common.FULL,
    only: Optional[List[str]] = typer.Option(None, "--only", help="Only these ids (--only a b or --only a --only b)."),
    out: Path = typer.Option(Path("report"), "--out", help="Output folder of index.html."),
    seeds: Optional[List[str]] = common.SEEDS,
    no_cache: bool = common.NO_CACHE,
    jobs: int = typer.Option(1, "--jobs", "-j", min=1,
                             help="Reproductions run at once, each in its own process with cores/jobs torch "
                                  "threads (build the models first: rankwise zoo build)."),
) -> None:
    """Run every reproduction (cached) and write one HTML page with all of them."""
    from rich.markup import escape

    from rankwise.repro.report import run_report

    mode = common.parse_mode(smoke, quick, full)
    ids = [i for v in (only or []) for i in v.split(",") if i.strip()] or None
    console = common.console()
    bar = common.progress(ctx)
    # with no progress bar (stdout is a file or a pipe: `make demo > log`), one line per finished
    # reproduction, so that a long run shows where it is
    lines = not bar and not common.settings(ctx).quiet
    run = run_report(mode=mode, only=ids, out_dir=out, seeds=common.parse_seeds(seeds), use_cache=not no_cache,
                     progress=bar, on_done=_print_done if lines else None, jobs=jobs)
    counts = run.summary["counts"]
    if not common.settings(ctx).quiet:
        parts = [f"{v} {k}" for k, v in counts.items() if v and k in ("holds", "does not hold", "inconclusive", "wiring only", "error")]
        console.print(f"{len(run.results)} reproduction(s) in {mode} mode: {', '.join(parts) or 'none'}",
                      markup=False)
        for id, e in run.errors.items():
            console.print(f"[red]error[/] {id}: {escape(common.one_line(e))}", soft_wrap=True)
    console.print(f"report: {run.index.resolve()}", soft_wrap=True, markup=False)
    if run.errors:
        raise typer.Exit(1)


def _print_done(id: str, result: object, seconds: float) -> None:
    verdict = (f"error: {common.one_line(result)}" if isinstance(result, BaseException)
               else getattr(result, "verdict_text", "?"))
    print(f"{id:<20} {verdict}  ({seconds:.1f} s)", flush=True)


def register(app: typer.Typer) -> None:
    app.command("report", cls=common.MultiValueCommand)(report_cmd)
