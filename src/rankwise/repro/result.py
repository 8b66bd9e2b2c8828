"""The result of a reproduction: a table over seeds, the checked claims, figures, time, environment.

Every reproduction module ``rankwise.repro.<id>`` defines::

    def run(mode: str, seeds: Sequence[int], out_dir: Path) -> ReproResult

(most do so through :class:`rankwise.repro.skeleton.Reproduction`) and builds its result with
:class:`Table` (per-seed values of each metric for the method and its baselines),
:class:`ClaimCheck` (a measured number against the paper's claimed threshold, labelled ``claim`` or
``wiring``, optionally with a paired bootstrap interval) and :class:`Precondition` (what must be true
for the checks to mean anything). The verdict (``holds`` / ``does not hold`` / ``inconclusive`` /
``wiring only``) is a property computed from them; nothing sets it by hand.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import statistics
import time
from dataclasses import dataclass, field
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

    def extend(self, other: "Table") -> "Table":
        """Append ``other``'s values cell by cell (rows and columns in ``other``'s order); returns self.

        A reproduction that fills one table fragment per seed joins them in seed order with this, which
        gives the same table as adding every value to one table seed after seed."""
        for r, cols in other.rows.items():
            for c, vals in cols.items():
                for v in vals:
                    self.add(r, c, v)
        return self

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


KINDS = ("claim", "wiring")
VERDICTS = ("holds", "does not hold", "inconclusive", "wiring only")


def _num_or_nan(x: Any) -> float:
    return float("nan") if x is None else float(x)


@dataclass
class ClaimCheck:
    """One claim of the paper (or one wiring identity), checked against a measured number.

    ``statement`` says the claim in words; ``measured`` is what this run measured (a mean over
    seeds, a ratio, a count ...); the point estimate holds when ``measured <op> threshold``.
    ``margin`` is signed so that a positive margin means the claim held with room to spare.

    ``kind`` is ``"claim"`` (evidence about the paper; the verdict rests on these) or ``"wiring"``
    (an identity or invariant that only a bug can break, such as "the same logits as PEFT").

    ``samples`` (optional, not serialised): the paired per-example values the check averages, one
    sequence per seed (e.g. ``correct_method_i - correct_baseline_i`` for every test example ``i``);
    ``measured`` must then equal their statistic (``"mean"``: mean over seeds of the per-seed mean;
    ``"abs_mean"``: its absolute value). From them the check computes a paired bootstrap interval
    (:func:`rankwise.repro.evidence.paired_bootstrap`: over the examples, and over the seeds when there
    are >= 3; 95%). :attr:`status` is then ``inconclusive`` when the interval contains the threshold.
    """

    statement: str
    measured: float
    op: str
    threshold: float
    unit: str = ""
    note: str = ""
    kind: str = "claim"
    samples: Sequence[Sequence[float]] | None = field(default=None, repr=False, compare=False)
    statistic: str = "mean"
    # the interval, computed from ``samples`` (or read back from JSON)
    ci: tuple[float, float] | None = None
    ci_level: float | None = None
    n_examples: int | None = None
    n_seeds: int | None = None
    ci_over_seeds: bool = False

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"ClaimCheck.op must be one of {list(_OPS)}, got {self.op!r}")
        if self.kind not in KINDS:
            raise ValueError(f"ClaimCheck.kind must be one of {list(KINDS)}, got {self.kind!r}")
        self.measured = float(self.measured)
        self.threshold = float(self.threshold)
        if self.samples is not None:
            from rankwise.repro import evidence

            iv = evidence.paired_bootstrap(self.samples, self.statistic)
            if not math.isclose(iv.estimate, self.measured, rel_tol=1e-9, abs_tol=1e-9):
                raise ValueError(f"ClaimCheck {self.statement!r}: measured {self.measured!r} is not the "
                                 f"{self.statistic} of its samples ({iv.estimate!r})")
            self.ci, self.ci_level = (iv.lo, iv.hi), iv.level
            self.n_examples, self.n_seeds, self.ci_over_seeds = iv.n_examples, iv.n_seeds, iv.over_seeds
            self.samples = None  # the interval is what is kept
        elif self.ci is not None:
            self.ci = (float(self.ci[0]), float(self.ci[1]))

    @property
    def holds(self) -> bool:
        """Whether the point estimate satisfies the claim (``measured <op> threshold``)."""
        if math.isnan(self.measured):
            return False
        return bool(_OPS[self.op](self.measured, self.threshold))

    @property
    def inconclusive(self) -> bool:
        """The interval (if any) contains the threshold."""
        return self.ci is not None and self.ci[0] <= self.threshold <= self.ci[1]

    @property
    def status(self) -> str:
        """``holds``, ``does not hold`` or ``inconclusive`` (the interval contains the threshold)."""
        if self.inconclusive and not math.isnan(self.measured):
            return "inconclusive"
        return "holds" if self.holds else "does not hold"

    @property
    def to_decide(self) -> tuple[int | None, str] | None:
        """For an inconclusive check: about how many examples per seed (or seeds) would decide it."""
        if self.status != "inconclusive" or self.ci is None:
            return None
        from rankwise.repro.evidence import Interval, samples_to_decide

        iv = Interval(self.measured, self.ci[0], self.ci[1], self.ci_level or 0.95, self.n_examples or 1,
                      self.n_seeds or 1, self.ci_over_seeds)
        return samples_to_decide(iv, self.threshold)

    @property
    def margin(self) -> float:
        d = self.measured - self.threshold
        return (d if self.op in (">=", ">") else -d) + 0.0  # + 0.0: no "-0" margins

    def interval_text(self) -> str:
        """``"95% CI [lo, hi]"`` (and what would decide it when inconclusive), or ``""``."""
        if self.ci is None:
            return ""
        text = f"{100 * (self.ci_level or 0.95):.0f}% CI [{self.ci[0]:.4g}, {self.ci[1]:.4g}]"
        need = self.to_decide
        if need is not None:
            n, unit = need
            text += (f"; about {n} {unit} would decide it" if n is not None else
                     "; the estimate sits on the threshold")
        return text

    def describe(self) -> str:
        u = f" {self.unit}" if self.unit else ""
        ci = f", {self.interval_text()}" if self.ci is not None else ""
        return (f"{self.statement}: measured {self.measured:.4g}{u} {self.op} {self.threshold:.4g}{u}"
                f" -> {self.status} (margin {self.margin:+.3g}{ci})")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"statement": self.statement, "measured": _clean(self.measured), "op": self.op,
                             "threshold": _clean(self.threshold), "unit": self.unit, "note": self.note,
                             "kind": self.kind, "holds": self.holds, "status": self.status,
                             "margin": _clean(self.margin)}
        if self.ci is not None:
            need = self.to_decide
            d.update(statistic=self.statistic, ci=[_clean(self.ci[0]), _clean(self.ci[1])], ci_level=self.ci_level,
                     n_examples=self.n_examples, n_seeds=self.n_seeds, ci_over_seeds=self.ci_over_seeds,
                     to_decide=None if need is None else {"count": need[0], "unit": need[1]})
        return d

    @classmethod
    def from_json(cls, c: dict[str, Any]) -> "ClaimCheck":
        ci = c.get("ci")
        return cls(statement=c["statement"], measured=_num_or_nan(c["measured"]), op=c["op"],
                   threshold=_num_or_nan(c["threshold"]), unit=c.get("unit", ""), note=c.get("note", ""),
                   kind=c.get("kind", "claim"), statistic=c.get("statistic", "mean"),
                   ci=None if ci is None else (_num_or_nan(ci[0]), _num_or_nan(ci[1])),
                   ci_level=c.get("ci_level"), n_examples=c.get("n_examples"), n_seeds=c.get("n_seeds"),
                   ci_over_seeds=bool(c.get("ci_over_seeds", False)))


@dataclass
class Precondition:
    """What must be true of the measured numbers for the claim checks to mean anything.

    Stated in the reproduction module before any run (its statement, op and threshold are module
    constants), evaluated on the measured numbers: the task does not saturate, the baseline the claim
    compares against learned, the upper-bound row beats the lower-bound row. A failed precondition
    makes the verdict ``inconclusive`` with the precondition as its reason.
    """

    statement: str
    measured: float
    op: str
    threshold: float
    unit: str = ""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Precondition.op must be one of {list(_OPS)}, got {self.op!r}")
        self.measured = float(self.measured)
        self.threshold = float(self.threshold)

    @property
    def holds(self) -> bool:
        return not math.isnan(self.measured) and bool(_OPS[self.op](self.measured, self.threshold))

    def describe(self) -> str:
        u = f" {self.unit}" if self.unit else ""
        return (f"{self.statement}: measured {self.measured:.4g}{u}, needs {self.op} {self.threshold:.4g}{u}"
                f" -> {'met' if self.holds else 'failed'}")

    def to_json(self) -> dict[str, Any]:
        return {"statement": self.statement, "measured": _clean(self.measured), "op": self.op,
                "threshold": _clean(self.threshold), "unit": self.unit, "holds": self.holds}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Precondition":
        return cls(statement=d["statement"], measured=_num_or_nan(d["measured"]), op=d["op"],
                   threshold=_num_or_nan(d["threshold"]), unit=d.get("unit", ""))


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
    preconditions: list[Precondition] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)  # settings changed from the mode's defaults
    cpu_time_s: float = 0.0
    # Run-time facts set by the harness, never serialised: whether this result came from the cache,
    # and the folder that holds its result.json and figures.
    cache_hit: bool = field(default=False, compare=False, repr=False)
    source_dir: Path | None = field(default=None, compare=False, repr=False)

    @property
    def claim_checks(self) -> list[ClaimCheck]:
        return [c for c in self.checks if c.kind == "claim"]

    def _verdict_and_reason(self) -> tuple[str, str]:
        wiring = [c for c in self.checks if c.kind == "wiring" and c.status != "holds"]
        if wiring:
            return "does not hold", "a wiring check failed (a bug, so no claim check can be trusted): " + \
                "; ".join(c.statement for c in wiring)
        claims = self.claim_checks
        if not claims:
            return "wiring only", (f"{self.mode} checks wiring only" if self.checks else "no checks")
        failed_pre = [p for p in self.preconditions if not p.holds]
        if failed_pre:
            return "inconclusive", "precondition failed: " + "; ".join(p.describe() for p in failed_pre)
        failed = [c for c in claims if c.status == "does not hold"]
        if failed:
            return "does not hold", "; ".join(f"{c.statement} (margin {c.margin:+.3g})" for c in failed)
        unsure = [c for c in claims if c.status == "inconclusive"]
        if unsure:
            return "inconclusive", "the interval contains the threshold: " + "; ".join(
                f"{c.statement} ({c.interval_text()})" for c in unsure)
        return "holds", ""

    @property
    def verdict(self) -> str:
        """Computed from the checks and preconditions, never set by hand. In order:

        1. a ``wiring`` check fails: ``does not hold`` (a bug; no claim check can be trusted);
        2. no ``claim`` check: ``wiring only`` (shown as "<mode> checks wiring only");
        3. a precondition fails: ``inconclusive``;
        4. a claim check fails decisively (its point estimate misses and its interval, if any,
           excludes the threshold): ``does not hold``;
        5. a claim check's interval contains the threshold: ``inconclusive``;
        6. otherwise ``holds``.
        """
        return self._verdict_and_reason()[0]

    @property
    def reason(self) -> str:
        """Why the verdict is not ``holds`` (empty when it holds)."""
        return self._verdict_and_reason()[1]

    @property
    def verdict_text(self) -> str:
        """The verdict as shown to a reader (``"quick checks wiring only"`` for a wiring-only mode)."""
        v = self.verdict
        return f"{self.mode} checks wiring only" if v == "wiring only" else v

    @property
    def margin(self) -> float:
        """The smallest margin over the claim checks (all checks if none is a claim check)."""
        return min((c.margin for c in (self.claim_checks or self.checks)), default=float("nan"))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "mode": self.mode, "seeds": list(self.seeds), "claim": self.claim,
            "verdict": self.verdict, "reason": self.reason, "margin": _clean(self.margin),
            "checks": [c.to_json() for c in self.checks],
            "preconditions": [p.to_json() for p in self.preconditions], "overrides": self.overrides,
            "table": self.table.to_json(), "figures": list(self.figures), "notes": self.notes,
            "config": self.config, "wall_time_s": self.wall_time_s, "cpu_time_s": self.cpu_time_s,
            "environment": self.environment, "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReproResult":
        """Read a result written by :meth:`to_json`, this version's or an older one (missing fields:
        checks are claim checks without intervals, no preconditions, no overrides)."""
        return cls(id=d["id"], mode=d["mode"], seeds=list(d["seeds"]), claim=d["claim"],
                   table=Table.from_json(d["table"]), checks=[ClaimCheck.from_json(c) for c in d["checks"]],
                   figures=list(d["figures"]), notes=d.get("notes", ""), config=d.get("config", {}),
                   wall_time_s=float(d.get("wall_time_s", 0.0)), environment=d.get("environment", {}),
                   extra=d.get("extra", {}),
                   preconditions=[Precondition.from_json(p) for p in d.get("preconditions", [])],
                   overrides=dict(d.get("overrides", {})), cpu_time_s=float(d.get("cpu_time_s", 0.0)))

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
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if hasattr(os, "getloadavg"):  # the 1, 5 and 15-minute load averages when the run ended (POSIX)
        env["loadavg"] = [round(x, 2) for x in os.getloadavg()]
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
