"""Side-by-side benchmark harness.

A benchmark module ``benchmarks/bench_<name>.py`` defines ``CASES``: a list of :class:`Case`. A case
names two or more implementations (e.g. ``"rankwise"`` and ``"peft"``), each a zero-argument
*factory* that builds its inputs and returns the zero-argument callable to time. The harness

* builds every implementation once, then times them **alternating** (A, B, A, B, ...) in the same
  process, after warm-up, so that drift of the machine (frequency, other load) hits all of them
  alike; it reports the median, the interquartile range and the ratio of medians against the
  case's anchor (``ratio = t_impl / t_anchor``; < 1 means faster than the anchor);
* measures peak memory of each implementation in a fresh subprocess: the peak resident set size
  (``VmHWM``) while building and running it, minus the resident size after imports, so that
  one implementation's allocations cannot hide another's;
* writes everything as JSON (``benchmarks/results/<name>.json`` by default), with the raw times,
  the spread of each ratio (quartiles of the per-round ratios ``t_impl[i] / t_anchor[i]``: the rounds
  alternate, so a round's two times saw the same machine state), the thread count, the warm-up and
  the number of repeats; a case may state its :class:`Goal` s and, for a growth case (one
  implementation per problem size), the expected exponent: the harness fits ``t ~ size^p``;
* runs every case with at least :data:`MIN_REPEATS` repeats and :data:`THREADS` torch threads
  (``RANKWISE_BENCH_THREADS``, default 1), and in *smoke* mode (``--smoke``) each module's smallest
  case once, to check that it runs; smoke results go to ``results/smoke/`` and are never tabulated.

Run ``python -m benchmarks.run`` (all) or ``python -m benchmarks.run lora`` (one module);
``python -m benchmarks.table`` turns the JSON into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

Factory = Callable[[], Callable[[], Any]]

#: The fewest repeats a tabulated measurement runs with (a case asking for fewer gets this many).
MIN_REPEATS = 5
#: Torch threads of every timed call (``RANKWISE_BENCH_THREADS``; 1 by default, so that runs compare).
THREADS = int(os.environ.get("RANKWISE_BENCH_THREADS", "1"))


@dataclass(frozen=True)
class Goal:
    """What a case should show, checked from the measured numbers.

    ``metric="ratio"``: ``ratio_vs_anchor`` of ``impl`` must be ``<= max_ratio`` (e.g. 0.5 for "at
    least 2x faster than the anchor"), or, with ``versus``, the ratio of the medians of ``impl`` and
    that other implementation; ``metric="exponent"``: the fitted growth exponent of a growth case
    must lie within ``tol`` of the case's ``expected_exponent``; ``metric="seconds"``: the median time
    of ``impl`` must be ``<= max_seconds`` (an absolute budget, e.g. the CLI's start-up). ``text`` says
    the goal in words.
    """

    text: str
    metric: str = "ratio"
    impl: str | None = None
    max_ratio: float | None = None
    tol: float = 0.5
    max_seconds: float | None = None
    versus: str | None = None

    def __post_init__(self) -> None:
        if self.metric not in ("ratio", "exponent", "seconds"):
            raise ValueError(f"Goal.metric must be 'ratio', 'exponent' or 'seconds', got {self.metric!r}")
        if self.metric == "ratio" and (self.impl is None or self.max_ratio is None):
            raise ValueError("a ratio Goal needs impl and max_ratio")
        if self.metric == "seconds" and (self.impl is None or self.max_seconds is None):
            raise ValueError("a seconds Goal needs impl and max_seconds")

    def check(self, entry: dict[str, Any]) -> bool | None:
        """Met (True/False) on a result entry of :func:`run_module`; None if the entry lacks the number."""
        if self.metric == "ratio":
            t = entry.get("time", {}).get(self.impl)
            if t is None:
                return None
            if self.versus is not None:  # against another implementation of the case, not the anchor
                v = entry.get("time", {}).get(self.versus)
                return None if v is None else bool(t["median_s"] <= self.max_ratio * v["median_s"])
            return bool(t["ratio_vs_anchor"] <= self.max_ratio)
        if self.metric == "seconds":
            t = entry.get("time", {}).get(self.impl)
            return None if t is None else bool(t["median_s"] <= self.max_seconds)
        g = entry.get("growth")
        if not g or g.get("exponent") is None or not math.isfinite(g["exponent"]):
            return None
        return bool(abs(g["exponent"] - g["expected_exponent"]) <= self.tol)

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "metric": self.metric, "impl": self.impl, "max_ratio": self.max_ratio,
                "tol": self.tol, "max_seconds": self.max_seconds, "versus": self.versus}


@dataclass
class Case:
    """One comparison: implementations (name -> factory) measured side by side.

    ``goals``: what the case should show (:class:`Goal`). A *growth* case times one problem at several
    sizes: ``sizes`` maps each implementation (``"d=1024"``, ...) to its size, and
    ``expected_exponent`` is the exponent ``p`` of ``t ~ size^p`` that the algorithm's cost predicts.
    ``smoke``: the case a smoke run executes for its module (default: the module's first case; a module
    may instead define ``SMOKE_CASES``, small versions of its cases). ``cold``: implementations that skip
    the warm-up because one call is already minutes of many identical sub-problems (the first of them
    absorbs the first-call costs that a warm-up is for); the JSON lists them. ``memory_calls``: calls of
    each implementation in its memory subprocess (the peak does not grow after the first; 1 for cases
    whose calls take minutes).
    """

    name: str
    impls: dict[str, Factory]
    anchor: str
    params: dict[str, Any] = field(default_factory=dict)
    repeats: int = 20
    warmup: int = 3
    goals: tuple[Goal, ...] = ()
    sizes: dict[str, float] | None = None
    expected_exponent: float | None = None
    smoke: bool = False
    cold: tuple[str, ...] = ()
    memory_calls: int = 2

    def __post_init__(self) -> None:
        if self.anchor not in self.impls:
            raise ValueError(f"case {self.name!r}: anchor {self.anchor!r} is not one of {list(self.impls)}")
        if self.repeats < 1 or self.warmup < 0 or self.memory_calls < 1:
            raise ValueError(f"case {self.name!r}: repeats and memory_calls must be >= 1 and warmup >= 0")
        unknown = [k for k in self.cold if k not in self.impls]
        if unknown:
            raise ValueError(f"case {self.name!r}: cold names unknown implementation(s) {unknown}")
        if self.sizes is not None:
            if set(self.sizes) != set(self.impls) or len(self.sizes) < 2:
                raise ValueError(f"case {self.name!r}: sizes must give a size to each of >= 2 implementations")
            if self.expected_exponent is None:
                raise ValueError(f"case {self.name!r}: a growth case needs expected_exponent")
        for g in self.goals:
            if g.metric in ("ratio", "seconds") and g.impl not in self.impls:
                raise ValueError(f"case {self.name!r}: goal on unknown implementation {g.impl!r}")
            if g.versus is not None and g.versus not in self.impls:
                raise ValueError(f"case {self.name!r}: goal versus unknown implementation {g.versus!r}")
            if g.metric == "exponent" and self.sizes is None:
                raise ValueError(f"case {self.name!r}: an exponent goal needs a growth case (sizes=...)")


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def time_case(case: Case, repeats: int | None = None, warmup: int | None = None) -> dict[str, Any]:
    """Alternating timing of every implementation of ``case``; medians, IQR, ratios and their spread.

    ``repeats`` / ``warmup`` override the case's. Each implementation's entry holds ``median_s``,
    ``q1_s``, ``q3_s``, ``n``, ``times_s`` (raw), ``ratio_vs_anchor`` (ratio of medians) and
    ``ratio_q1`` / ``ratio_q3`` (quartiles of the per-round ratios).
    """
    repeats = case.repeats if repeats is None else repeats
    warmup = case.warmup if warmup is None else warmup
    fns = {k: f() for k, f in case.impls.items()}
    for _ in range(warmup):
        for k, fn in fns.items():
            if k not in case.cold:
                fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for i in range(repeats):
        # Alternate the order too, so neither implementation always runs right after the other.
        for k in (order if i % 2 == 0 else order[::-1]):
            gc.collect()
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    out: dict[str, Any] = {}
    t_anchor = statistics.median(times[case.anchor])
    for k, ts in times.items():
        q1, med, q3 = _quantiles(ts)
        per_round = [t / a if a > 0 else float("nan") for t, a in zip(ts, times[case.anchor])]
        r1, _, r3 = _quantiles(per_round)
        out[k] = {"median_s": med, "q1_s": q1, "q3_s": q3, "n": len(ts), "times_s": ts,
                  "ratio_vs_anchor": med / t_anchor if t_anchor > 0 else float("nan"),
                  "ratio_q1": r1, "ratio_q3": r3}
    return out


def fit_exponent(sizes: dict[str, float], times: dict[str, Any]) -> dict[str, Any]:
    """Least-squares slope ``p`` of ``log t`` against ``log size`` (``t ~ size^p``), with its spread.

    ``times`` is :func:`time_case`'s output. The exponent is fitted on the medians; its spread is the
    quartiles of the exponents fitted round by round (round ``i``'s time at every size).
    """
    names = [k for k in sizes if k in times]

    def slope(ts: list[float]) -> float:
        xs = [math.log(sizes[k]) for k in names]
        ys = [math.log(t) if t > 0 else float("nan") for t in ts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den > 0 else float("nan")

    p = slope([times[k]["median_s"] for k in names])
    rounds = min(len(times[k].get("times_s", [])) for k in names)
    per_round = [slope([times[k]["times_s"][i] for k in names]) for i in range(rounds)]
    q1, _, q3 = _quantiles(per_round) if per_round else (float("nan"),) * 3
    return {"sizes": [sizes[k] for k in names], "exponent": p, "exponent_q1": q1, "exponent_q3": q3}


def _rss_kib() -> int:
    # Current resident set size (Linux), in KiB.
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:  # pragma: no cover - non-Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss_kib() -> int:
    # Peak resident set size of this process (Linux VmHWM, per address space, so it is reset by
    # exec). ru_maxrss is not: it carries the parent's peak across fork+exec, which made every
    # implementation of a case report the parent's footprint.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - non-Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _memory_child(module: str, case_name: str, impl: str, calls: int) -> dict[str, Any]:
    mod = importlib.import_module(module)
    case = next(c for c in mod.CASES if c.name == case_name)
    gc.collect()
    base = _rss_kib()
    fn = case.impls[impl]()
    for _ in range(max(1, calls)):
        fn()
    peak = _peak_rss_kib()
    return {"peak_rss_mib": peak / 1024, "peak_above_baseline_mib": max(0, peak - base) / 1024,
            "baseline_rss_mib": base / 1024}


def memory_case(module: str, case: Case, calls: int | None = None) -> dict[str, Any]:
    """Peak memory of each implementation, each in a fresh subprocess (``calls``: the case's ``memory_calls``)."""
    calls = case.memory_calls if calls is None else calls
    out: dict[str, Any] = {}
    for impl in case.impls:
        cmd = [sys.executable, "-m", "benchmarks.harness", "--memory", module, case.name, impl, str(calls)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            out[impl] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
            continue
        out[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def environment() -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        env["loadavg"] = [round(x, 2) for x in os.getloadavg()]  # a busy machine shows here
    except OSError:  # pragma: no cover - no load average on this platform
        pass
    for name in ("peft", "transformers"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:
            pass
    return env


def _smoke_cases(mod: Any) -> list[Case]:
    if getattr(mod, "SMOKE_CASES", None):  # a module may give small versions of its cases
        return list(mod.SMOKE_CASES)
    flagged = [c for c in mod.CASES if c.smoke]
    return flagged or list(mod.CASES[:1])


def run_module(name: str, out_dir: Path | None = None, memory: bool = True, only: list[str] | None = None,
               smoke: bool = False, threads: int | None = None) -> Path:
    """Run every case of ``benchmarks/bench_<name>.py``; write and return the JSON path.

    ``smoke``: only the module's smoke case (:attr:`Case.smoke`, else its first), once, no warm-up,
    no memory subprocesses, written to ``<out_dir>/smoke/``: it checks that the benchmark runs and is
    never tabulated. Otherwise every case runs with at least :data:`MIN_REPEATS` repeats.
    ``threads`` (default :data:`THREADS`): torch threads while timing, recorded in the JSON.
    """
    import torch

    module = f"benchmarks.bench_{name}"
    mod = importlib.import_module(module)
    threads = THREADS if threads is None else threads
    env = dict(environment(), loadavg_at="start")  # the machine's load, not this run's own
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    results = []
    try:
        for case in (_smoke_cases(mod) if smoke else mod.CASES):
            if only and case.name not in only:
                continue
            repeats = 1 if smoke else max(case.repeats, MIN_REPEATS)
            warmup = 0 if smoke else case.warmup
            entry: dict[str, Any] = {"case": case.name, "anchor": case.anchor, "params": case.params,
                                     "repeats": repeats, "warmup": warmup, "threads": torch.get_num_threads(),
                                     "cold": list(case.cold),
                                     "goals": [g.to_json() for g in case.goals],
                                     "time": time_case(case, repeats=repeats, warmup=warmup)}
            if case.sizes is not None:
                entry["growth"] = dict(fit_exponent(case.sizes, entry["time"]),
                                       expected_exponent=case.expected_exponent)
            entry["goals_met"] = [g.check(entry) for g in case.goals]
            if memory and not smoke:
                entry["memory"] = memory_case(module, case)
            results.append(entry)
            _print_case(entry)
    finally:
        torch.set_num_threads(before)
    out_dir = Path(out_dir or Path(__file__).resolve().parent / "results")
    if smoke:
        out_dir = out_dir / "smoke"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    write_json(path, {"benchmark": name, "smoke": smoke, "min_repeats": 1 if smoke else MIN_REPEATS,
                      "environment": dict(env, threads=threads), "cases": results})
    print(f"wrote {path}")
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic JSON write (a temporary file, then a rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _print_case(entry: dict[str, Any]) -> None:
    print(f"\n{entry['case']}  (anchor: {entry['anchor']}, params: {entry['params']})")
    for impl, t in entry["time"].items():
        mem = entry.get("memory", {}).get(impl, {})
        m = f"{mem['peak_above_baseline_mib']:.1f} MiB" if "peak_above_baseline_mib" in mem else mem.get("error", "-")
        print(f"  {impl:<14} median {t['median_s'] * 1e3:9.3f} ms   x{t['ratio_vs_anchor']:.3f} vs anchor   peak +{m}")
    if "growth" in entry:
        g = entry["growth"]
        print(f"  fitted exponent {g['exponent']:.2f} (expected {g['expected_exponent']:g})")


if __name__ == "__main__":
    if len(sys.argv) >= 6 and sys.argv[1] == "--memory":
        print(json.dumps(_memory_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
    else:  # pragma: no cover
        print("usage: python -m benchmarks.run [NAME ...]", file=sys.stderr)
        sys.exit(2)
