"""``rankwise zoo build``: build (or check) the embedded offline models and data in the cache."""

from __future__ import annotations

import inspect
from typing import Any

import typer

from rankwise.core.errors import RankwiseError
from rankwise.verbs import common


def zoo_build_cmd(
    ctx: typer.Context,
    force: bool = typer.Option(False, "--force", help="Rebuild even what is already cached."),
    size: str = typer.Option("small", "--size", help="Which set of models to build: small (what the quick "
                             "modes and most full modes use), smoke (test-sized), full (the extra models of "
                             "full modes that need their own, e.g. SAMBAL's and AgentVocab's)."),
) -> None:
    """Build (or check) the embedded offline models and data in the cache."""
    try:
        from rankwise import zoo

        build = getattr(zoo, "build")
    except (ImportError, AttributeError) as e:
        raise RankwiseError(f"the model zoo cannot be built in this installation (rankwise.zoo.build is "
                            f"not available: {e})") from None
    from rankwise.repro.kit import artefacts

    zoo_sizes = tuple(getattr(zoo, "BUILD_SETS", ("smoke", "small")))
    extra_sizes = artefacts.sizes()
    if size not in zoo_sizes and size not in extra_sizes:
        raise RankwiseError(f"--size {size!r} is unknown; choose one of {sorted(set(zoo_sizes) | set(extra_sizes))}")
    if size in zoo_sizes:
        params = inspect.signature(build).parameters
        kwargs: dict[str, Any] = {"force": force, "size": size, "progress": common.progress(ctx)}
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kwargs = {k: v for k, v in kwargs.items() if accepts_any or k in params}
        result = build(**kwargs)
        if result is not None and not common.settings(ctx).quiet:
            common.console().print(result)
    # the reproductions' trained artefacts (they need the method code, so they are not the zoo's own):
    # PriorGuide's score models, ARPC's codecs, ... A size only they know (``full``: the full modes' models
    # of SAMBAL and AgentVocab) builds only theirs.
    extra = artefacts.build_all(force=force, size=size)
    if not common.settings(ctx).quiet:
        common.console().print(extra)


def register(app: typer.Typer) -> None:
    zoo_app = typer.Typer(help="Embedded offline models and data.", no_args_is_help=True)
    zoo_app.command("build")(zoo_build_cmd)
    app.add_typer(zoo_app, name="zoo")
