"""The result of a reproduction: a table over seeds, the checked claims, figures, time, environment.

Every reproduction module ``rankwise.repro.<id>`` defines::

    def run(mode: str, seeds: Sequence[int], out_dir: Path) -> ReproResult

and builds its result with :class:`Table` (per-seed values of each metric for the method and its
baselines) and :class:`ClaimCheck` (a measured number against the paper's claimed threshold). The
verdict is a property computed from the claim checks; nothing sets it by hand.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

Mode = Literal["smoke", "quick", "full"]
MODES: tuple[str, ...] = ("smoke", "quick", "full")
# The time budgets of the modes (DESIGN.md): smoke a few seconds, quick <= 60 s, full <= 10 min.
BUDGET_S: dict[str, float] = {"smoke": 20.0, "quick": 60.0, "full": 600.0}
DEFAULT_SEEDS: dict[str, tuple[int, ...]] = {"smoke": (0,), "quick": (0, 1), "full": (0, 1, 2)}

_OPS = {
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
}


def _clean(x: float) -> float | str | None:
    """A float for strict JSON: NaN -> None, +-inf -> "inf"/"-inf" (``float()`` reads both back)."""
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


@dataclass
class Table:
    """Rows (the method and its baselines) x columns (metrics), each cell a list of per-seed values."""

    columns: list[str]
    rows: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # Optional per-column note, e.g. "lower is better" or a unit.
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, row: str, column: str, value: float) -> None:
        if column not in self.columns:
            raise KeyError(f"unknown column {column!r}; columns are {self.columns}")
        self.rows.setdefault(row, {}).setdefault(column, []).append(float(value))

    def values(self, row: str, column: str) -> list[float]:
        return list(self.rows.get(row, {}).get(column, []))

    def mean(self, row: str, column: str) -> float:
        v = self.values(row, column)
        return statistics.fmean(v) if v else float("nan")

    def std(self, row: str, column: str) -> float:
        v = self.values(row, column)
        if len(v) < 2:
            return 0.0
        if not all(math.isfinite(x) for x in v):
            return float("nan")
        return statistics.stdev(v)

    def cell(self, row: str, column: str, digits: int = 4) -> str:
        v = self.values(row, column)
        if not v:
            return "–"
        m = self.mean(row, column)
        return f"{m:.{digits}g}" if len(v) == 1 else f"{m:.{digits}g} ± {self.std(row, column):.2g}"

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            "notes": self.notes,
            "rows": {r: {c: {"values": [_clean(x) for x in v], "mean": _clean(self.mean(r, c)),
                             "std": _clean(self.std(r, c))} for c, v in cols.items()}
                     for r, cols in self.rows.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Table":
        t = cls(columns=list(d["columns"]), notes=dict(d.get("notes", {})))
        for r, cols in d["rows"].items():
            for c, cell in cols.items():
                t.rows.setdefault(r, {})[c] = [float("nan") if x is None else float(x) for x in cell["values"]]
        return t


@dataclass
class ClaimCheck:
    """One claim of the paper, checked against a measured number.

    ``statement`` says the claim in words; ``measured`` is what this run measured (a mean over
    seeds, a ratio, a count ...); the claim holds when ``measured <op> threshold``. ``margin`` is
    signed so that a positive margin means the claim held with room to spare.
    """

    statement: str
    measured: float
    op: str
    threshold: float
    unit: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"ClaimCheck.op must be one of {list(_OPS)}, got {self.op!r}")
        self.measured = float(self.measured)
        self.threshold = float(self.threshold)

    @property
    def holds(self) -> bool:
        if math.isnan(self.measured):
            return False
        return bool(_OPS[self.op](self.measured, self.threshold))

    @property
    def margin(self) -> float:
        d = self.measured - self.threshold
        return (d if self.op in (">=", ">") else -d) + 0.0  # + 0.0: no "-0" margins

    def describe(self) -> str:
        u = f" {self.unit}" if self.unit else ""
        word = "holds" if self.holds else "does not hold"
        return (f"{self.statement}: measured {self.measured:.4g}{u} {self.op} {self.threshold:.4g}{u}"
                f" -> {word} (margin {self.margin:+.3g})")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured"] = _clean(self.measured)
        d["threshold"] = _clean(self.threshold)
        d.update(holds=self.holds, margin=_clean(self.margin))
        return d


@dataclass
class ReproResult:
    """Everything a reproduction reports; written as ``result.json`` beside its PNG figures."""

    id: str
    mode: str
    seeds: list[int]
    claim: str  # the paper's headline claim as one sentence
    table: Table
    checks: list[ClaimCheck]
    figures: list[str] = field(default_factory=list)  # file names relative to the output folder
    notes: str = ""  # the honest explanation (why a claim did not hold at this scale, choices made)
    config: dict[str, Any] = field(default_factory=dict)  # sizes, steps, learning rates used
    wall_time_s: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # curves or other data behind the figures
    # Run-time facts set by the harness, never serialised: whether this result came from the cache,
    # and the folder that holds its result.json and figures.
    cache_hit: bool = field(default=False, compare=False, repr=False)
    source_dir: Path | None = field(default=None, compare=False, repr=False)

    @property
    def verdict(self) -> str:
        """``holds`` when every checked claim holds, ``does not hold`` otherwise (computed)."""
        if not self.checks:
            return "does not hold"
        return "holds" if all(c.holds for c in self.checks) else "does not hold"

    @property
    def margin(self) -> float:
        """The smallest margin over the checked claims (negative: the claim missed by this much)."""
        return min((c.margin for c in self.checks), default=float("nan"))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "mode": self.mode, "seeds": list(self.seeds), "claim": self.claim,
            "verdict": self.verdict, "margin": _clean(self.margin),
            "checks": [c.to_json() for c in self.checks],
            "table": self.table.to_json(), "figures": list(self.figures), "notes": self.notes,
            "config": self.config, "wall_time_s": self.wall_time_s, "environment": self.environment,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReproResult":
        checks = [ClaimCheck(statement=c["statement"], measured=float("nan") if c["measured"] is None
                             else c["measured"], op=c["op"], threshold=c["threshold"],
                             unit=c.get("unit", ""), note=c.get("note", "")) for c in d["checks"]]
        return cls(id=d["id"], mode=d["mode"], seeds=list(d["seeds"]), claim=d["claim"],
                   table=Table.from_json(d["table"]), checks=checks, figures=list(d["figures"]),
                   notes=d.get("notes", ""), config=d.get("config", {}),
                   wall_time_s=float(d.get("wall_time_s", 0.0)),
                   environment=d.get("environment", {}), extra=d.get("extra", {}))

    def save(self, out_dir: Path) -> Path:
        """Write ``result.json`` atomically into ``out_dir`` (figures are already there)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "result.json"
        atomic_write_text(path, json.dumps(self.to_json(), indent=2, allow_nan=False))
        self.source_dir = out_dir
        return path

    @classmethod
    def load(cls, path: Path | str) -> "ReproResult":
        """Read a ``result.json`` (or the folder holding it) written by :meth:`save`."""
        path = Path(path)
        file = path / "result.json" if path.is_dir() else path
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no reproduction result at {file}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
        result = cls.from_json(data)
        result.source_dir = file.parent
        return result


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``,
    so that a reader never sees a partial file and a failed write leaves the old file in place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def environment(seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    import numpy
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "numpy": numpy.__version__,
        "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    # Installed versions from the package metadata: importing flwr or transformers only to read a
    # version would cost seconds.
    from importlib import metadata

    for key, dist in (("transformers", "transformers"), ("peft", "peft"), ("flwr", "flwr"),
                      ("sklearn", "scikit-learn"), ("scipy", "scipy")):
        try:
            env[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # pragma: no cover - optional
            pass
    from rankwise import __version__

    env["rankwise"] = __version__
    if seeds is not None:
        env["seeds"] = list(seeds)
    return env
