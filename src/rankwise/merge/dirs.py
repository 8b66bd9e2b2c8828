"""Merge PEFT LoRA adapter directories into one PEFT LoRA directory (what ``rankwise merge`` runs).

Inputs are LoRA directories as PEFT writes them (``adapter_config.json`` + ``adapter_model.safetensors``,
standard LoRA on ``nn.Linear``). The output is a PEFT LoRA directory of rank ``rank`` (alpha = rank)
that ``peft.PeftModel.from_pretrained(base, DIR)`` loads; it is written atomically (a failure leaves
nothing behind). The method is looked up in the merge registry (:mod:`rankwise.merge.base`)::

    from rankwise.merge.dirs import merge_dirs
    res = merge_dirs(["task_a", "task_b"], "ctm", 16, "merged", rule="ties")
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rankwise.core.peft_format import import_peft, write_adapter_dir
from rankwise.core.validate import check_int
from rankwise.merge.base import merge_methods, resolve_merge_method

__all__ = ["METHODS", "MergeDirsResult", "build_config", "merge_dirs"]


def _methods_table() -> dict[str, tuple[str, str]]:
    """method -> (space, default rule) of every registered method (``"ctm"`` for Compress-then-Merge)."""
    out = {}
    for name, m in merge_methods().items():
        cfg = m.build_config(1)
        out[name] = (getattr(cfg, "space", name), cfg.rule)
    return out


#: method -> (space, default rule), from the registry (kept for callers of the old verb module).
METHODS: dict[str, tuple[str, str]] = _methods_table()


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


def build_config(method: str, rank: int, **options: Any) -> Any:
    """The merge config of ``method`` at ``rank`` (a CtMConfig or MergeConfig); options left at ``None``
    (``rule``, ``scale``, ``density``, ``drop_rate``, ``beta``, ``seed``) keep the method's defaults."""
    return resolve_merge_method(method).build_config(rank, **options)


def merge_dirs(dirs: Sequence[str | Path], method: str, rank: int, out: str | Path, *, overwrite: bool = False,
               **options: Any) -> MergeDirsResult:
    """Read PEFT LoRA directories, merge them with ``method`` at ``rank``, write a PEFT LoRA directory ``out``.

    ``options``: ``rule``, ``scale``, ``density``, ``drop_rate``, ``beta``, ``seed`` (see :func:`build_config`).
    Everything is validated before anything is written; ``out`` must not be one of the inputs.
    """
    t0 = time.perf_counter()
    check_int("--rank", rank, 1)
    merger = resolve_merge_method(method)
    cfg = merger.build_config(rank, **options)
    paths = [Path(d) for d in dirs]
    if not paths:
        raise ValueError("give at least one adapter directory to merge")
    out = Path(out)
    for p in paths:
        if p.resolve() == out.resolve():
            raise ValueError(f"--out {out} is one of the input adapters; choose another directory")
    states = [import_peft(p) for p in paths]
    merged, diagnostics = merger.run(states, cfg)
    merged.config["inputs"] = [str(p) for p in paths]
    write_adapter_dir(merged, out, name="merged", base_model_name_or_path=merged.config.get("base_model_name_or_path"),
                      overwrite=overwrite)
    return MergeDirsResult(method, cfg, out, len(states), len(merged.modules()), rank,
                           time.perf_counter() - t0, list(diagnostics.get("kept_energy", [])))
