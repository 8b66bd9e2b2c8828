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
* writes everything as JSON (``benchmarks/results/<name>.json`` by default).

Run ``python -m benchmarks.run`` (all) or ``python -m benchmarks.run lora`` (one module).
"""

from __future__ import annotations

import gc
import importlib
import json
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


@dataclass
class Case:
    """One comparison: implementations (name -> factory) measured side by side."""

    name: str
    impls: dict[str, Factory]
    anchor: str
    params: dict[str, Any] = field(default_factory=dict)
    repeats: int = 20
    warmup: int = 3

    def __post_init__(self) -> None:
        if self.anchor not in self.impls:
            raise ValueError(f"case {self.name!r}: anchor {self.anchor!r} is not one of {list(self.impls)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"case {self.name!r}: repeats must be >= 1 and warmup >= 0")


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def time_case(case: Case) -> dict[str, Any]:
    """Alternating timing of every implementation of ``case``; medians, IQR and ratios."""
    fns = {k: f() for k, f in case.impls.items()}
    for _ in range(case.warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for i in range(case.repeats):
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
        out[k] = {"median_s": med, "q1_s": q1, "q3_s": q3, "n": len(ts),
                  "ratio_vs_anchor": med / t_anchor if t_anchor > 0 else float("nan")}
    return out


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


def memory_case(module: str, case: Case, calls: int = 2) -> dict[str, Any]:
    """Peak memory of each implementation, each in a fresh subprocess."""
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
    for name in ("peft", "transformers"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:
            pass
    return env


def run_module(name: str, out_dir: Path | None = None, memory: bool = True, only: list[str] | None = None) -> Path:
    """Run every case of ``benchmarks/bench_<name>.py``; write and return the JSON path."""
    module = f"benchmarks.bench_{name}"
    mod = importlib.import_module(module)
    results = []
    for case in mod.CASES:
        if only and case.name not in only:
            continue
        entry: dict[str, Any] = {"case": case.name, "anchor": case.anchor, "params": case.params,
                                 "time": time_case(case)}
        if memory:
            entry["memory"] = memory_case(module, case)
        results.append(entry)
        _print_case(entry)
    out_dir = Path(out_dir or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"benchmark": name, "environment": environment(), "cases": results}, indent=2))
    os.replace(tmp, path)
    print(f"wrote {path}")
    return path


def _print_case(entry: dict[str, Any]) -> None:
    print(f"\n{entry['case']}  (anchor: {entry['anchor']}, params: {entry['params']})")
    for impl, t in entry["time"].items():
        mem = entry.get("memory", {}).get(impl, {})
        m = f"{mem['peak_above_baseline_mib']:.1f} MiB" if "peak_above_baseline_mib" in mem else mem.get("error", "-")
        print(f"  {impl:<14} median {t['median_s'] * 1e3:9.3f} ms   x{t['ratio_vs_anchor']:.3f} vs anchor   peak +{m}")


if __name__ == "__main__":
    if len(sys.argv) >= 6 and sys.argv[1] == "--memory":
        print(json.dumps(_memory_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
    else:  # pragma: no cover
        print("usage: python -m benchmarks.run [NAME ...]", file=sys.stderr)
        sys.exit(2)
