"""The inputs every reproduction run checks first: the mode, the seeds and the output folder.

Shared by the harness (:mod:`rankwise.repro.harness`, which re-exports them) and the skeleton
(:mod:`rankwise.repro.skeleton`), so that neither imports the other.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

from rankwise.repro.result import DEFAULT_SEEDS, MODES


def validate_mode(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`~rankwise.repro.result.MODES`, else raise ValueError."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def resolve_seeds(mode: str, seeds: Sequence[int] | None) -> list[int]:
    """The seeds to run: ``seeds`` validated, or the mode's default (``DEFAULT_SEEDS[mode]``)."""
    if seeds is None:
        return list(DEFAULT_SEEDS[validate_mode(mode)])
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__"):
        raise TypeError(f"seeds must be a sequence of integers, got {type(seeds).__name__}")
    out: list[int] = []
    for s in seeds:
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise TypeError(f"seeds must be integers, got {s!r} ({type(s).__name__})")
        s = int(s)
        if s < 0:
            raise ValueError(f"seeds must be non-negative integers, got {s}")
        out.append(s)
    if not out:
        raise ValueError("seeds must not be empty")
    if len(set(out)) != len(out):
        raise ValueError(f"seeds must be distinct, got {out}")
    return out


def ensure_writable(out_dir: Path | str) -> Path:
    """Create ``out_dir`` if needed and check that a file can be written there.

    Raises :class:`PermissionError` with the folder and the reason, so that a run never starts
    only to fail when it saves its result.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise PermissionError(f"cannot write to output folder {out}: it exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rankwise-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or str(e)
        raise PermissionError(f"cannot write to output folder {out}: {reason}") from None
    return out
