"""``rankwise merge``: merge several PEFT LoRA adapter directories into ONE rank-r PEFT LoRA directory.

    rankwise merge --method ctm|ta|ties|dare|mtc|knots|core --rank 16 ADAPTER_DIR... --out DIR
                   [--rule R] [--scale λ] [--density D] [--drop-rate P] [--beta B] [--seed S] [--overwrite]

Inputs are LoRA directories as PEFT writes them (``adapter_config.json`` + ``adapter_model.safetensors``,
standard LoRA on ``nn.Linear``; read by :func:`rankwise.adapt.lora.import_peft`). The output is a PEFT
LoRA directory of rank ``--rank`` (alpha = rank) that ``peft.PeftModel.from_pretrained(base, DIR)``
loads; it is written atomically (a failure leaves nothing behind).

Methods:

* ``ctm``   — Compress-then-Merge (:mod:`rankwise.merge.ctm`), ``--rule`` (default ``ties``) in the
  shared rank-r subspaces; defaults λ = 0.75, density 0.25, β = 0.25 (the paper's README command);
* ``ta`` / ``ties`` / ``dare`` — full-space task arithmetic / TIES / DARE, truncated to rank r by SVD
  (= PEFT ``add_weighted_adapter`` ``svd`` / ``ties_svd`` / ``dare_linear_svd``); λ defaults to 1;
* ``mtc``   — merge-then-compress in full space with any ``--rule`` (default ``ta``);
* ``knots`` — KnOTS space (SVD-aligned), ``--rule`` (default ``ties``), truncated;
* ``core``  — Core space, ``--rule`` (default ``ties``), truncated.

From Python: :func:`merge_dirs`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

import typer

__all__ = ["METHODS", "MergeDirsResult", "build_config", "merge_dirs", "register"]

#: method -> (space, default rule); "ctm" is Compress-then-Merge.
METHODS: dict[str, tuple[str, str]] = {
    "ctm": ("ctm", "ties"),
    "ta": ("full", "ta"),
    "ties": ("full", "ties"),
    "dare": ("full", "dare"),
    "mtc": ("full", "ta"),
    "knots": ("knots", "ties"),
    "core": ("core", "ties"),
}
_FIXED_RULE = ("ta", "ties", "dare")


@dataclass
class MergeDirsResult:
    """What :func:`merge_dirs` did: the method, its config, the output directory and diagnostics."""

    method: str
    config: Any
    out: Path
    n_adapters: int
    modules: int
    rank: int
    seconds: float
    kept_energy: list[float] = field(default_factory=list)  # CtM: per input adapter, mean over modules


def build_config(method: str, rank: int, *, rule: str | None = None, scale: float | None = None,
                 density: float | None = None, drop_rate: float | None = None, beta: float | None = None,
                 seed: int | None = None) -> Any:
    """The merge config of ``method`` (a CtMConfig or MergeConfig); unset options keep the method's defaults."""
    from rankwise.merge.baselines import MergeConfig, canonical_rule
    from rankwise.merge.ctm import CtMConfig

    if method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS)}, got {method!r}")
    space, default_rule = METHODS[method]
    if rule is not None and method in _FIXED_RULE and canonical_rule(rule, "--rule") != default_rule:
        raise ValueError(f"--method {method} fixes the rule to {default_rule!r}; use --method mtc --rule {rule} "
                         "for another rule in full space")
    kw: dict[str, Any] = {"rank": rank, "rule": rule or default_rule}
    for k, v in (("scale", scale), ("density", density), ("drop_rate", drop_rate), ("seed", seed)):
        if v is not None:
            kw[k] = v
    if method == "ctm":
        if beta is not None:
            kw["beta"] = beta
        return CtMConfig(**kw)
    if beta is not None:
        raise ValueError(f"--beta applies to --method ctm only, not {method!r}")
    return MergeConfig(space=space, **kw)


def merge_dirs(dirs: Sequence[str | Path], method: str, rank: int, out: str | Path, *, overwrite: bool = False,
               **options: Any) -> MergeDirsResult:
    """Read PEFT LoRA directories, merge them with ``method`` at ``rank``, write a PEFT LoRA directory ``out``.

    ``options``: ``rule``, ``scale``, ``density``, ``drop_rate``, ``beta``, ``seed`` (see :func:`build_config`).
    Everything is validated before anything is written; ``out`` must not be one of the inputs.
    """
    from rankwise.adapt.lora import import_peft, write_adapter_dir
    from rankwise.merge import baselines, ctm

    t0 = time.perf_counter()
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--rank must be an int >= 1, got {rank!r}")
    cfg = build_config(method, rank, **options)
    paths = [Path(d) for d in dirs]
    if not paths:
        raise ValueError("give at least one adapter directory to merge")
    out = Path(out)
    for p in paths:
        if p.resolve() == out.resolve():
            raise ValueError(f"--out {out} is one of the input adapters; choose another directory")
    states = [import_peft(p) for p in paths]
    energy: list[float] = []
    if method == "ctm":
        merged, report = ctm.merge_with_report(states, cfg)
        energy = report.mean_kept_energy()
    else:
        merged = baselines.merge(states, cfg)
    merged.config["inputs"] = [str(p) for p in paths]
    write_adapter_dir(merged, out, name="merged", base_model_name_or_path=merged.config.get("base_model_name_or_path"),
                      overwrite=overwrite)
    return MergeDirsResult(method, cfg, out, len(states), len(merged.modules()), rank,
                           time.perf_counter() - t0, energy)


def register(app: typer.Typer) -> None:
    """Add ``rankwise merge`` to the app."""

    @app.command("merge")
    def merge_cmd(
        ctx: typer.Context,
        adapters: List[Path] = typer.Argument(..., help="PEFT LoRA adapter directories to merge (one per task)."),
        method: str = typer.Option("ctm", "--method", help="ctm, ta, ties, dare, mtc, knots or core."),
        rank: int = typer.Option(16, "--rank", help="Rank r of the merged LoRA (>= 1)."),
        out: Path = typer.Option(..., "--out", help="Output PEFT LoRA directory."),
        rule: Optional[str] = typer.Option(None, "--rule", help="Merge rule for ctm/mtc/knots/core: ta, mean, "
                                           "ties, dare, dare_ties, iso_c."),
        scale: Optional[float] = typer.Option(None, "--scale", help="Global scale λ (ctm default 0.75, others 1)."),
        density: Optional[float] = typer.Option(None, "--density", help="TIES: fraction kept per task, (0, 1]."),
        drop_rate: Optional[float] = typer.Option(None, "--drop-rate", help="DARE: drop probability, [0, 1)."),
        beta: Optional[float] = typer.Option(None, "--beta", help="CtM norm balancing β in [0, 1]."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of DARE's masks."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
    ) -> None:
        """Merge LoRA adapters (PEFT directories) into one rank-r LoRA (a PEFT directory)."""
        from rankwise.verbs import common

        res = merge_dirs(adapters, method, rank, out, overwrite=overwrite, rule=rule, scale=scale, density=density,
                         drop_rate=drop_rate, beta=beta, seed=seed)
        console = common.console()
        if not common.settings(ctx).quiet and res.kept_energy:
            for p, e in zip(adapters, res.kept_energy):
                console.print(f"kept energy {e:.3f}  {p}", markup=False, soft_wrap=True)
        console.print(f"merged {res.n_adapters} adapters with {method} (rule {res.config.rule}) into rank {rank} on "
                      f"{res.modules} modules in {res.seconds:.2f} s: {res.out}", markup=False, soft_wrap=True)
