"""``rankwise merge``: merge several PEFT LoRA adapter directories into ONE rank-r PEFT LoRA directory.

    rankwise merge --method ctm|ta|ties|dare|iso_c|mtc|knots|core --rank 16 ADAPTER_DIR... --out DIR
                   [--rule R] [--scale λ] [--density D] [--drop-rate P] [--beta B] [--seed S] [--overwrite]

Inputs are LoRA directories as PEFT writes them (``adapter_config.json`` + ``adapter_model.safetensors``,
standard LoRA on ``nn.Linear``). The output is a PEFT LoRA directory of rank ``--rank`` (alpha = rank)
that ``peft.PeftModel.from_pretrained(base, DIR)`` loads; it is written atomically (a failure leaves
nothing behind).

Methods come from the merge registry (:func:`rankwise.merge.base.merge_methods`):

* ``ctm``   — Compress-then-Merge (:mod:`rankwise.merge.ctm`), ``--rule`` (default ``ties``) in the
  shared rank-r subspaces; defaults λ = 0.75, density 0.25, β = 0.25 (the paper's README command);
* ``ta`` / ``ties`` / ``dare`` / ``iso_c`` — full-space task arithmetic / TIES / DARE / Iso-C, truncated
  to rank r by SVD (= PEFT ``add_weighted_adapter`` ``svd`` / ``ties_svd`` / ``dare_linear_svd``); λ defaults to 1;
* ``mtc``   — merge-then-compress in full space with any ``--rule`` (default ``ta``);
* ``knots`` — KnOTS space (SVD-aligned), ``--rule`` (default ``ties``), truncated;
* ``core``  — Core space, ``--rule`` (default ``ties``), truncated.

The work is :func:`rankwise.merge.dirs.merge_dirs` (re-exported here with :class:`MergeDirsResult`,
:func:`build_config` and :data:`METHODS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

__all__ = ["METHODS", "MergeDirsResult", "build_config", "merge_dirs", "register"]

# The help text names the registry's methods and rules without importing the merge package (torch):
# tests/test_verb_merge.py checks these three lists against rankwise.merge's registry.
HELP_METHODS = ("ctm", "ta", "ties", "dare", "iso_c", "mtc", "knots", "core")
HELP_RULES = ("ta", "mean", "ties", "dare", "dare_ties", "iso_c")
#: the methods whose merge rule --rule may change (the others fix it: ties is TIES, ...)
HELP_FREE_RULE = ("ctm", "mtc", "knots", "core")

_LAZY = {"METHODS", "MergeDirsResult", "build_config", "merge_dirs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rankwise.merge import dirs

        return getattr(dirs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(app: typer.Typer) -> None:
    """Add ``rankwise merge`` to the app."""

    @app.command("merge")
    def merge_cmd(
        ctx: typer.Context,
        adapters: List[Path] = typer.Argument(..., help="PEFT LoRA adapter directories to merge (one per task)."),
        method: str = typer.Option("ctm", "--method", help=f"{', '.join(HELP_METHODS)}."),
        rank: int = typer.Option(16, "--rank", help="Rank r of the merged LoRA (>= 1)."),
        out: Path = typer.Option(..., "--out", help="Output PEFT LoRA directory."),
        rule: Optional[str] = typer.Option(None, "--rule", help=f"Merge rule for {'/'.join(HELP_FREE_RULE)}: "
                                           f"{', '.join(HELP_RULES)}."),
        scale: Optional[float] = typer.Option(None, "--scale", help="Global scale λ (ctm default 0.75, others 1)."),
        density: Optional[float] = typer.Option(None, "--density", help="TIES: fraction kept per task, (0, 1]."),
        drop_rate: Optional[float] = typer.Option(None, "--drop-rate", help="DARE: drop probability, [0, 1)."),
        beta: Optional[float] = typer.Option(None, "--beta", help="CtM norm balancing β in [0, 1]."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of DARE's masks."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
    ) -> None:
        """Merge LoRA adapters (PEFT directories) into one rank-r LoRA (a PEFT directory)."""
        from rankwise.merge.dirs import merge_dirs
        from rankwise.verbs import common

        res = merge_dirs(adapters, method, rank, out, overwrite=overwrite, rule=rule, scale=scale, density=density,
                         drop_rate=drop_rate, beta=beta, seed=seed)
        console = common.console()
        if not common.settings(ctx).quiet and res.kept_energy:
            for p, e in zip(adapters, res.kept_energy):
                console.print(f"kept energy {e:.3f}  {p}", markup=False, soft_wrap=True)
        console.print(f"merged {res.n_adapters} adapters with {method} (rule {res.config.rule}) into rank {rank} on "
                      f"{res.modules} modules in {res.seconds:.2f} s: {res.out}", markup=False, soft_wrap=True)
