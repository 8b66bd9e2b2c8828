"""The ``rankwise`` command. Thin: each verb parses its options and calls one library function.

Verbs::

    rankwise list [--markdown] [--family F]
    rankwise reproduce ID [--smoke|--quick|--full] [--seeds 0 1 2] [--out DIR] [--no-cache]
    rankwise report [--smoke|--quick|--full] [--only ID ...] [--out DIR] [--seeds ...] [--no-cache]
    rankwise zoo build [--force] [--size small]

``--quiet`` (before the verb) turns off progress bars and commentary; progress bars are also off
when stdout is not a terminal. A user error (unknown id, bad option value, unwritable folder, ...)
prints one line on stderr and exits with status 2; set ``RANKWISE_DEBUG=1`` for the traceback.

Adding a verb: write one function decorated with ``@app.command()`` (or a sub-app with
``app.add_typer``), import the library inside it, and use :func:`_console` / :func:`_progress`;
or put it in its own module ``rankwise/verbs/<verb>.py`` with ``register(app)`` (see
:mod:`rankwise.verbs`), which is how ``finetune``, ``merge`` and ``federate`` are added.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

import click
import typer
from typer.core import TyperCommand, TyperGroup

from rankwise.core.errors import RankwiseError, UnknownMethodError

# Errors that a user can cause: printed as one line, exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (
    RankwiseError, UnknownMethodError, ValueError, TypeError, FileNotFoundError, PermissionError,
    NotADirectoryError, IsADirectoryError, FileExistsError,
)
USAGE_EXIT = 2

# bitsandbytes (pulled in by PEFT) warns on every CPU with AVX512-BF16 that an optional 4-bit kernel
# package is missing; rankwise never runs 4-bit kernels, so the command keeps that line out of its output
import logging as _logging  # noqa: E402

_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# likewise torchao (the peers extra; PEFT imports it when present) about its CUDA-only kernels, and torch's
# pytree registry about torchao's enums
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)


def _debug() -> bool:
    return os.environ.get("RANKWISE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg or type(e).__name__


class RankwiseGroup(TyperGroup):
    """The top-level group: turns user errors raised by any verb into one line and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            if _debug():
                raise
            click.echo(f"rankwise: error: {_one_line(e)}", err=True)
            raise click.exceptions.Exit(USAGE_EXIT) from None


# Options that take several values: `--seeds 0 1 2` is rewritten to `--seeds 0 --seeds 1 --seeds 2`
# before click parses (click options take a fixed number of values).
_MULTI_VALUE = {
    "--seeds": re.compile(r"[0-9][0-9,]*").fullmatch,
    "--only": lambda tok: not tok.startswith("-"),
}


def _expand_multi(args: Sequence[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            out.extend(args[i - 1:])
            break
        if tok not in _MULTI_VALUE:
            out.append(tok)
            continue
        values = []
        if i < len(args):  # the first value is always the option's (click reports a bad one)
            values.append(args[i])
            i += 1
        while i < len(args) and _MULTI_VALUE[tok](args[i]):
            values.append(args[i])
            i += 1
        if not values:
            out.append(tok)
        for v in values:
            out += [tok, v]
    return out


class MultiValueCommand(TyperCommand):
    """A command whose ``--seeds`` / ``--only`` options accept several values after one flag."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _expand_multi(args))


app = typer.Typer(
    name="rankwise",
    cls=RankwiseGroup,
    help="Low-rank methods for neural networks (2026 papers), each with a CPU reproduction of its claim.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
zoo_app = typer.Typer(help="Embedded offline models and data.", no_args_is_help=True)
app.add_typer(zoo_app, name="zoo")


@dataclass
class Settings:
    quiet: bool = False


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.find_object(Settings)
    return obj if obj is not None else Settings()


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def _progress(ctx: click.Context) -> bool:
    """Progress bars only when not --quiet and stdout is a terminal."""
    return not _settings(ctx).quiet and sys.stdout.isatty()


@app.callback()
def _root(
    ctx: typer.Context,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars and no commentary."),
) -> None:
    ctx.obj = Settings(quiet=quiet)


# --------------------------------------------------------------------------------------------------
# Shared option parsing


def _mode(smoke: bool, quick: bool, full: bool) -> str:
    chosen = [m for m, on in (("smoke", smoke), ("quick", quick), ("full", full)) if on]
    if len(chosen) > 1:
        raise typer.BadParameter(f"choose one of --smoke, --quick, --full (got {', '.join('--' + m for m in chosen)})")
    return chosen[0] if chosen else "quick"


def _seeds(values: Optional[List[str]]) -> Optional[list[int]]:
    if not values:
        return None
    out = []
    for v in values:
        for tok in re.split(r"[,\s]+", v.strip()):
            if not tok:
                continue
            if not re.fullmatch(r"[0-9]+", tok):
                raise typer.BadParameter(f"seeds are non-negative integers; got {tok!r}", param_hint="--seeds")
            out.append(int(tok))
    if not out:
        raise typer.BadParameter("no seeds given", param_hint="--seeds")
    return out


SMOKE = typer.Option(False, "--smoke", help="A few seconds: checks the wiring only (verdict not meaningful).")
QUICK = typer.Option(False, "--quick", help="At most 60 s per paper on 2 CPU cores (default).")
FULL = typer.Option(False, "--full", help="At most 10 min per paper, more seeds.")
SEEDS = typer.Option(None, "--seeds", help="Seeds, e.g. --seeds 0 1 2 or --seeds 0,1,2 (default: the mode's).")
NO_CACHE = typer.Option(False, "--no-cache", help="Recompute, neither reading nor writing the cache.")


# --------------------------------------------------------------------------------------------------
# list


@app.command("list")
def list_cmd(
    ctx: typer.Context,
    markdown: bool = typer.Option(False, "--markdown", help="Print a Markdown table (as in the README)."),
    family: Optional[str] = typer.Option(None, "--family", help="Only this family: adapt, merge, compress, "
                                         "train, federated, infer, science."),
) -> None:
    """The 38 papers (and the reference methods) with their status."""
    from rankwise.core import registry

    if family is not None and family not in registry.FAMILIES:
        raise typer.BadParameter(f"unknown family {family!r}; choose one of {', '.join(registry.FAMILIES)}",
                                 param_hint="--family")
    if markdown:
        from rankwise.readme import papers_table_markdown

        typer.echo(papers_table_markdown(family=family), nl=False)
        return
    from rich.table import Table

    rows = [r for r in registry.table(include_references=True) if family in (None, r["family"])]
    style = {"planned": "dim", "implemented": "blue", "reproduced": "green"}
    console = _console()
    for title, keep in (("Papers", registry.PAPERS), ("Reference methods", registry.REFERENCES)):
        sel = [r for r in rows if r["id"] in keep]
        if not sel:
            continue
        t = Table(title=f"{title} ({len(sel)})", title_justify="left")
        t.add_column("id", no_wrap=True)
        t.add_column("name")
        t.add_column("venue", no_wrap=True)
        t.add_column("family", no_wrap=True)
        t.add_column("status", no_wrap=True)
        if console.width >= 120:
            t.add_column("what it does")
        for r in sel:
            cells = [r["id"], r["name"], r["venue"], r["family"],
                     f"[{style.get(r['status'], '')}]{r['status']}[/]"]
            if console.width >= 120:
                cells.append(r["summary"])
            t.add_row(*cells)
        console.print(t)


# --------------------------------------------------------------------------------------------------
# reproduce


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


@app.command("reproduce", cls=MultiValueCommand)
def reproduce_cmd(
    ctx: typer.Context,
    id: str = typer.Argument(..., metavar="ID", help="Paper id (see `rankwise list`), e.g. swift_svd."),
    smoke: bool = SMOKE,
    quick: bool = QUICK,
    full: bool = FULL,
    seeds: Optional[List[str]] = SEEDS,
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: runs/<id>)."),
    no_cache: bool = NO_CACHE,
) -> None:
    """Run one paper's reproduction: table, claim checks, verdict, JSON and figures.

    ID is a paper or reference id from `rankwise list` (e.g. swift_svd, lora).
    """
    from rankwise.repro.harness import reproduce

    mode = _mode(smoke, quick, full)
    result = reproduce(id, mode=mode, seeds=_seeds(seeds), out_dir=out, use_cache=not no_cache,
                       progress=_progress(ctx))
    folder = result.source_dir or out
    console = _console()
    if not _settings(ctx).quiet:
        _print_result(console, result, folder)
    console.print(f"result: {folder / 'result.json'}", soft_wrap=True, markup=False)
    for f in result.figures:
        console.print(f"figure: {folder / f}", soft_wrap=True, markup=False)


# --------------------------------------------------------------------------------------------------
# report


@app.command("report", cls=MultiValueCommand)
def report_cmd(
    ctx: typer.Context,
    smoke: bool = SMOKE,
    quick: bool = QUICK,
    full: bool = FULL,
    only: Optional[List[str]] = typer.Option(None, "--only", help="Only these ids (--only a b or --only a --only b)."),
    out: Path = typer.Option(Path("report"), "--out", help="Output folder of index.html."),
    seeds: Optional[List[str]] = SEEDS,
    no_cache: bool = NO_CACHE,
) -> None:
    """Run every reproduction (cached) and write one HTML page with all of them."""
    from rich.markup import escape

    from rankwise.repro.report import run_report

    mode = _mode(smoke, quick, full)
    ids = [i for v in (only or []) for i in v.split(",") if i.strip()] or None
    run = run_report(mode=mode, only=ids, out_dir=out, seeds=_seeds(seeds), use_cache=not no_cache,
                     progress=_progress(ctx))
    console = _console()
    counts = run.summary["counts"]
    if not _settings(ctx).quiet:
        parts = [f"{v} {k}" for k, v in counts.items() if v and k in ("holds", "does not hold", "error")]
        console.print(f"{len(run.results)} reproduction(s) in {mode} mode: {', '.join(parts) or 'none'}",
                      markup=False)
        for id, e in run.errors.items():
            console.print(f"[red]error[/] {id}: {escape(_one_line(e))}", soft_wrap=True)
    console.print(f"report: {run.index.resolve()}", soft_wrap=True, markup=False)
    if run.errors:
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------------
# zoo


@zoo_app.command("build")
def zoo_build_cmd(
    ctx: typer.Context,
    force: bool = typer.Option(False, "--force", help="Rebuild even what is already cached."),
    size: str = typer.Option("small", "--size", help="Which set of models to build."),
) -> None:
    """Build (or check) the embedded offline models and data in the cache."""
    try:
        from rankwise import zoo

        build = getattr(zoo, "build")
    except (ImportError, AttributeError) as e:
        raise RankwiseError(f"the model zoo cannot be built in this installation (rankwise.zoo.build is "
                            f"not available: {e})") from None
    params = inspect.signature(build).parameters
    kwargs: dict[str, Any] = {"force": force, "size": size, "progress": _progress(ctx)}
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in kwargs.items() if accepts_any or k in params}
    result = build(**kwargs)
    if result is not None and not _settings(ctx).quiet:
        _console().print(result)


# --------------------------------------------------------------------------------------------------
# compress


@app.command("compress")
def compress_cmd(
    ctx: typer.Context,
    method: str = typer.Option(..., "--method", help="swift-svd, saes-svd, gfwsvd, svd, asvd, fwsvd or svd-llm."),
    ratio: float = typer.Option(0.4, "--ratio", help="Kept-parameter fraction of the compressed layers, in (0, 1]."),
    model: Optional[Path] = typer.Option(None, "--model", help="A save_pretrained model directory (default: the "
                                         "embedded all-MiniLM-L6-v2)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration texts: .txt (one per line) or .jsonl "
                                         "({\"text\": ...} per line). Default: the embedded corpus."),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="Held-out texts for the fidelity (same formats)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Save the compressed model to this directory."),
    mode: str = typer.Option("auto", "--mode", help="auto, whole or blocks (block-sequential calibration)."),
    allocation: str = typer.Option("uniform", "--allocation", help="uniform or dynamic (Swift-SVD's ranks)."),
    n_calib: int = typer.Option(64, "--n-calib", help="Number of calibration texts."),
    n_eval: int = typer.Option(128, "--n-eval", help="Number of held-out texts."),
    seed: int = typer.Option(0, "--seed", help="Which texts are sampled from the embedded corpus."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
) -> None:
    """Compress a model's linear layers with an SVD method; print per-layer ranks and errors, the
    embedding fidelity on held-out text and the forward-time ratio."""
    from rich.table import Table

    from rankwise.compress.command import compress_command

    res = compress_command(method, ratio, model_dir=model, calib_file=calib, eval_file=eval_file, out=out,
                           mode=mode, allocation=allocation, n_calib=n_calib, n_eval=n_eval, seed=seed,
                           overwrite=overwrite, progress=_progress(ctx))
    console = _console()
    rep = res.report
    if not _settings(ctx).quiet:
        prefix = f"{rep.extra['blocks']}." if rep.extra.get("blocks") else ""
        t = Table(title=f"{res.method} on {res.model} (ratio {ratio}, {rep.extra.get('mode')} mode)",
                  title_justify="left", box=None, pad_edge=False)
        for c, j in ((f"layer ({prefix}…)" if prefix else "layer", "left"), ("shape", "right"), ("rank", "right"),
                     ("params", "right"), ("error", "right"), ("s", "right")):
            t.add_column(c, justify=j, no_wrap=True)
        for r in res.rows():
            err = "–" if r["rel_error"] is None else f"{r['rel_error']:.4f}"
            name = r["layer"][len(prefix):] if prefix and r["layer"].startswith(prefix) else r["layer"]
            t.add_row(name, r["shape"], str(r["rank"]), f"{r['params_before']:,}→{r['params_after']:,}", err,
                      f"{r['seconds']:.2f}")
        console.print(t)
        for note in res.notes:
            console.print(f"note: {note}", markup=False, soft_wrap=True)
    console.print(f"parameters: {rep.params_before:,} → {rep.params_after:,} ({rep.kept_fraction:.3f} of the model; "
                  f"{rep.target_params_after / max(1, rep.target_params_before):.3f} of the compressed layers)",
                  markup=False)
    console.print(f"embedding fidelity: mean cosine {res.fidelity:.4f} to the original on {res.n_eval} held-out "
                  f"texts (calibration: {res.n_calib} texts from {res.calib_source})", markup=False, soft_wrap=True)
    if res.speed:
        console.print(f"forward time: {res.speed['compressed_s'] * 1e3:.1f} ms vs {res.speed['original_s'] * 1e3:.1f} "
                      f"ms uncompressed (ratio {res.speed['ratio']:.2f})", markup=False)
    console.print(f"time: calibration {rep.seconds_calibration:.1f} s, decomposition {rep.seconds_decomposition:.1f} s, "
                  f"total {res.seconds:.1f} s", markup=False)
    if res.out_dir is not None:
        console.print(f"saved: {res.out_dir}", markup=False, soft_wrap=True)


# --------------------------------------------------------------------------------------------------


def _register_verb_modules() -> None:
    """Add the verbs defined in :mod:`rankwise.verbs` (one module per verb, each with ``register(app)``)."""
    import importlib
    import pkgutil

    import rankwise.verbs

    for info in sorted(pkgutil.iter_modules(rankwise.verbs.__path__), key=lambda m: m.name):
        importlib.import_module(f"rankwise.verbs.{info.name}").register(app)


_register_verb_modules()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``rankwise``)."""
    try:
        app(args=None if argv is None else list(argv), prog_name="rankwise")
    except USER_ERRORS as e:  # raised outside a verb (e.g. while parsing)
        if _debug():
            raise
        print(f"rankwise: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(USAGE_EXIT)


if __name__ == "__main__":
    main()
