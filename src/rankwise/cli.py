"""The ``rankwise`` command. Thin: each verb parses its options and calls one library function.

Verbs::

    rankwise list [--markdown] [--family F]
    rankwise reproduce ID [--smoke|--quick|--full] [--seeds 0 1 2] [--out DIR] [--no-cache]
    rankwise report [--smoke|--quick|--full] [--only ID ...] [--out DIR] [--seeds ...] [--no-cache]
    rankwise zoo build [--force] [--size small]
    rankwise compress --method M --ratio R [--model DIR] [--out DIR]
    rankwise finetune --method M [--task NAME | --model DIR --data FILE] [--out DIR]
    rankwise merge --method M --rank R ADAPTER_DIR ... --out DIR
    rankwise federate --method M [--clients N] [--rounds R]
    rankwise continual --method eblora|lora|olora|inflora --tasks A,B,... [--resume DIR] --out DIR
    rankwise codec encode IMG.png [--scales K] -o X.arpc | codec decode X.arpc -o OUT.png [--complete argmax|sample|zeros]

``--quiet`` (before the verb) turns off progress bars and commentary; progress bars are also off
when stdout is not a terminal. A user error (unknown id, bad option value, unwritable folder, ...)
prints one line on stderr and exits with status 2; set ``RANKWISE_DEBUG=1`` for the traceback.

This module only assembles the app: every verb lives in its own module ``rankwise/verbs/<verb>.py``
with ``register(app)``; what verbs share (console, progress, error format, option parsing) is
:mod:`rankwise.verbs.common`. Adding a verb is adding a file there.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator, Optional, Sequence

import click
import typer
from typer.core import TyperGroup

from rankwise.verbs import common
from rankwise.verbs.common import USAGE_EXIT, USER_ERRORS, Settings

__all__ = ["app", "main"]


# bitsandbytes (pulled in by PEFT) warns on every CPU with AVX512-BF16 that an optional 4-bit kernel
# package is missing; rankwise never runs 4-bit kernels, so the command keeps that line out of its output
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# likewise torchao (the peers extra; PEFT imports it when present) about its CUDA-only kernels, and torch's
# pytree registry about torchao's enums
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def _fail(line: str) -> click.exceptions.Exit:
    click.echo(f"rankwise: error: {line}", err=True)
    return click.exceptions.Exit(USAGE_EXIT)


@contextlib.contextmanager
def _usage_failures() -> Iterator[None]:
    """A click usage error as one ``rankwise: error:`` line and exit 2 (the help page for no arguments
    passes through; ``--debug`` shows the traceback)."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.UsageError as e:
        if common.debug():
            raise
        raise _fail(common.usage_line(e)) from None


class RankwiseGroup(TyperGroup):
    """The top-level group: turns user errors raised by any verb, and every usage error of click/typer
    (bad option value, unknown option or command, missing or extra argument), into one line
    ``rankwise: error: ...`` on stderr and exit 2 (no usage box)."""

    def make_context(self, info_name: Optional[str], args: list[str], parent: Optional[click.Context] = None,
                     **extra: Any) -> click.Context:
        with _usage_failures():
            return super().make_context(info_name, args, parent=parent, **extra)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand as e:
            close = f"did you mean {' or '.join(e.possibilities)}? " if e.possibilities else ""
            raise click.UsageError(f"no such command {e.command_name!r}; {close}commands: "
                                   f"{', '.join(sorted(self.list_commands(ctx)))}", ctx) from None

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_failures():
            try:
                return super().invoke(ctx)
            except USER_ERRORS as e:
                if common.debug():
                    raise
                raise _fail(common.one_line(e)) from None


app = typer.Typer(
    name="rankwise",
    cls=RankwiseGroup,
    help="Low-rank methods for neural networks (2026 papers), each with a CPU reproduction of its claim.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    ctx: typer.Context,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars and no commentary."),
) -> None:
    ctx.obj = Settings(quiet=quiet)


def _register_verb_modules() -> None:
    """Add the verbs defined in :mod:`rankwise.verbs` (one module per verb, each with ``register(app)``)."""
    import importlib
    import pkgutil

    import rankwise.verbs

    for info in sorted(pkgutil.iter_modules(rankwise.verbs.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"rankwise.verbs.{info.name}")
        if hasattr(module, "register"):  # verbs.common holds shared helpers, not a verb
            module.register(app)


_register_verb_modules()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``rankwise``)."""
    try:
        app(args=None if argv is None else list(argv), prog_name="rankwise")
    except USER_ERRORS as e:  # raised outside a verb (e.g. while parsing)
        if common.debug():
            raise
        print(f"rankwise: error: {common.one_line(e)}", file=sys.stderr)
        sys.exit(USAGE_EXIT)


if __name__ == "__main__":
    main()
