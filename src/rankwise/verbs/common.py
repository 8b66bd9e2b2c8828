"""What every ``rankwise`` verb shares: the console, progress, the user-error format and option parsing.

A verb module (``rankwise/verbs/<verb>.py``) imports these public names and nothing private from
:mod:`rankwise.cli`, which only assembles the app. Keep this module light: it is imported by
``rankwise --help``.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import click
import typer
from typer.core import TyperCommand

from rankwise.core.errors import RankwiseError, UnknownMethodError

__all__ = [
    "USER_ERRORS", "USAGE_EXIT", "Settings", "debug", "one_line", "settings", "console", "progress",
    "MultiValueCommand", "expand_multi", "parse_mode", "parse_seeds", "SMOKE", "QUICK", "FULL", "SEEDS",
    "NO_CACHE",
]

# Errors that a user can cause: printed as one line, exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (
    RankwiseError, UnknownMethodError, ValueError, TypeError, FileNotFoundError, PermissionError,
    NotADirectoryError, IsADirectoryError, FileExistsError,
)
USAGE_EXIT = 2


def debug() -> bool:
    """``RANKWISE_DEBUG`` is set: show tracebacks instead of one-line errors."""
    return os.environ.get("RANKWISE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def one_line(e: BaseException) -> str:
    """An exception as one line (its message with white space folded, or its type name)."""
    msg = " ".join(str(e).split())
    return msg or type(e).__name__


# Options that take several values: `--seeds 0 1 2` is rewritten to `--seeds 0 --seeds 1 --seeds 2`
# before click parses (click options take a fixed number of values).
_MULTI_VALUE = {
    "--seeds": re.compile(r"[0-9][0-9,]*").fullmatch,
    "--only": lambda tok: not tok.startswith("-"),
    "--set": lambda tok: "=" in tok and not tok.startswith("-"),
}


def expand_multi(args: Sequence[str]) -> list[str]:
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
        return super().parse_args(ctx, expand_multi(args))


@dataclass
class Settings:
    """Options of the root command that every verb reads (``rankwise --quiet VERB``)."""

    quiet: bool = False


def settings(ctx: click.Context) -> Settings:
    """The root command's settings (defaults when a verb runs outside the app)."""
    obj = ctx.find_object(Settings)
    return obj if obj is not None else Settings()


def console() -> Any:
    """A rich console for a verb's output (no syntax highlighting of numbers and paths)."""
    from rich.console import Console

    return Console(highlight=False)


def progress(ctx: click.Context) -> bool:
    """Progress bars only when not --quiet and stdout is a terminal."""
    return not settings(ctx).quiet and sys.stdout.isatty()


def parse_mode(smoke: bool, quick: bool, full: bool) -> str:
    chosen = [m for m, on in (("smoke", smoke), ("quick", quick), ("full", full)) if on]
    if len(chosen) > 1:
        raise typer.BadParameter(f"choose one of --smoke, --quick, --full (got {', '.join('--' + m for m in chosen)})")
    return chosen[0] if chosen else "quick"


def parse_seeds(values: Optional[List[str]]) -> Optional[list[int]]:
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

