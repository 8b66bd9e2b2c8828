"""Cached artefacts of the reproductions that ``rankwise zoo build`` builds after the zoo's own.

:data:`BUILDERS` maps a name to ``"module:function"``; each function takes ``force`` (rebuild what is
cached) and returns a JSON-able record. A reproduction whose trained models are cached by a recipe adds
one line here (imported lazily, so that building one does not import every reproduction's peers).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

__all__ = ["BUILDERS", "build_all", "sizes"]

BUILDERS: dict[str, str] = {
    "priorguide": "rankwise.repro.kit.score_models:build",
    "arpc": "rankwise.repro.kit.arpc_codec:build",
    "diffbcp": "rankwise.repro.kit.diffusion_priors:build",
    "uldnet": "rankwise.repro.kit.uldnet_models:build",
    "sambal": "rankwise.repro.kit.sambal_models:build",
    "condiquant": "rankwise.repro.kit.condiquant_sr:build",
    "agentvocab": "rankwise.repro.kit.agentvocab_models:build",
}


def _sizes_of(module: Any) -> tuple[str, ...]:
    return tuple(getattr(module, "SIZES", getattr(module, "RECIPES", ())))


def sizes() -> tuple[str, ...]:
    """Every ``--size`` some builder knows (``small`` always: builders without sizes build for it)."""
    out = {"small"}
    for target in BUILDERS.values():
        mod, fn = target.split(":")
        module = importlib.import_module(mod)
        if "size" in inspect.signature(getattr(module, fn)).parameters:
            out.update(_sizes_of(module))
    return tuple(sorted(out))


def build_all(force: bool = False, only: tuple[str, ...] | None = None, size: str = "small") -> dict[str, Any]:
    """Run every builder (or those named in ``only``); returns ``{name: record}``.

    ``size`` (``rankwise zoo build --size``): a builder with a ``size`` parameter and a ``SIZES`` tuple
    (or else a ``RECIPES`` table) builds that size when it lists it; a builder without sizes builds only for
    the default size ``"small"``."""
    unknown = [n for n in (only or ()) if n not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown artefact builders {unknown}; choose from {list(BUILDERS)}")
    out: dict[str, Any] = {}
    for name, target in BUILDERS.items():
        if only and name not in only:
            continue
        mod, fn = target.split(":")
        module = importlib.import_module(mod)
        builder = getattr(module, fn)
        if "size" in inspect.signature(builder).parameters:
            if size in _sizes_of(module):
                out[name] = builder(force=force, size=size)
        elif size == "small":
            out[name] = builder(force=force)
    return out
