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
    "USER_ERRORS", "USAGE_EXIT", "Settings", "debug", "one_line", "usage_line", "settings", "console", "progress",
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


def _hint(e: click.BadParameter) -> str | None:
    if e.param_hint is not None:
        h = e.param_hint
        return h if isinstance(h, str) else " / ".join(h)
    p = e.param
    if p is None:
        return None
    if isinstance(p, click.Option):
        return " / ".join(p.opts)
    return (p.human_readable_name or p.name or "").upper() or None


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split())
    m = re.match(r"(.+?[.)])(\s|$)", text)
    return (m.group(1) if m else text).rstrip(".")


def usage_line(e: click.ClickException) -> str:
    """A click/typer usage error as ``<option>: <message>``, one line (what ``rankwise: error:`` prints).

    Conversion errors (``--ratio abc``) add what the option accepts (the first sentence of its help);
    an unknown option or command adds the close matches, or the choices.
    """
    if isinstance(e, click.MissingParameter):
        hint = _hint(e)
        kind = e.param_type or (e.param.param_type_name if e.param is not None else "parameter")
        return f"{hint}: missing; this {kind} is required" if hint else one_line(e)
    if isinstance(e, click.BadParameter):
        hint, msg = _hint(e), " ".join(e.message.split()).rstrip(".")
        if isinstance(e.param, click.Option) and "is not a valid" in msg and e.param.help:
            msg += f"; expected: {_first_sentence(e.param.help)}"
        if not hint or msg.startswith(hint.split(" / ")[0]):
            return msg
        return f"{hint}: {msg}"
    if isinstance(e, click.NoSuchOption):
        close = f" (did you mean {' or '.join(e.possibilities)}?)" if e.possibilities else ""
        where = f" of `{e.ctx.command_path}`" if e.ctx is not None else ""
        return f"{e.option_name}: no such option{where}{close}"
    if isinstance(e, click.BadOptionUsage):
        msg = " ".join(e.message.split()).rstrip(".").replace(f"Option {e.option_name!r} ", "")
        return f"{e.option_name}: {msg}"
    if isinstance(e, click.UsageError):
        return " ".join(e.format_message().split()).rstrip(".")
    return one_line(e)


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


def _after_multi(args: Sequence[str]) -> list[tuple[str, str]]:
    """``(option, token)`` for each non-option token right after the values of a multi-value option."""
    out = []
    for i, tok in enumerate(args):
        if tok == "--":
            break
        if tok in _MULTI_VALUE and i + 1 < len(args):
            j = i + 2
            while j < len(args) and _MULTI_VALUE[tok](args[j]):
                j += 1
            if j < len(args) and not args[j].startswith("-"):
                out.append((tok, args[j]))
    return out


class MultiValueCommand(TyperCommand):
    """A command whose ``--seeds`` / ``--only`` options accept several values after one flag.

    A first ``--seeds`` value that is not a seed is reported against ``--seeds``; so is a stray
    token after the seeds that click would call an "unexpected extra argument" (``--seeds a b``).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for i, tok in enumerate(args):
            if tok == "--":
                break
            if tok == "--seeds" and i + 1 < len(args) and not args[i + 1].startswith("-") \
                    and not _MULTI_VALUE[tok](args[i + 1]):
                raise click.BadParameter(f"seeds are non-negative integers; got {args[i + 1]!r}",
                                         ctx=ctx, param_hint="--seeds")
        try:
            return super().parse_args(ctx, expand_multi(args))
        except click.UsageError as e:
            stray = _after_multi(args)
            if "unexpected extra argument" in e.message and stray:
                opt, tok = stray[0]
                what = "seeds are non-negative integers" if opt == "--seeds" else "not a value it takes"
                raise click.BadParameter(f"{what}; got {tok!r}", ctx=ctx, param_hint=opt) from None
            raise


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



#: the embedded model families a ``--model zoo:<name>`` can name: (what to call it, where its names live)
_ZOO_KINDS = {"tiny_lm": "embedded tiny LM", "warm": "embedded model"}


def zoo_model(arg: str, kind: str, flag: str = "--model") -> tuple[Any, Any, str] | None:
    """``(model, tokenizer, description)`` for ``zoo:<name>`` (``kind``: ``"tiny_lm"``, the pretrained tiny
    LMs of :data:`rankwise.zoo.RECIPES`, or ``"warm"``, the warm-up models of :data:`rankwise.zoo.WARM_RECIPES`),
    built or loaded from the cache; ``None`` when ``arg`` is not a ``zoo:`` reference (a directory). An unknown
    name is a one-line error listing the choices."""
    if not arg.startswith("zoo:"):
        return None
    if kind not in _ZOO_KINDS:
        raise ValueError(f"kind must be one of {sorted(_ZOO_KINDS)}, got {kind!r}")
    from rankwise import zoo

    names = zoo.RECIPES if kind == "tiny_lm" else zoo.WARM_RECIPES
    name = arg[4:]
    if name not in names:
        raise ValueError(f"{flag} {arg}: no {_ZOO_KINDS[kind]} {name!r}; choose one of "
                         f"{', '.join('zoo:' + n for n in sorted(names))}")
    model, tok = zoo.tiny_lm(name) if kind == "tiny_lm" else zoo.warm_lm(name)
    what = f"zoo.tiny_lm({name!r})" if kind == "tiny_lm" else f"embedded warm-up model {name!r}"
    return model, tok, what
