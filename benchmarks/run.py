"""Run benchmarks: ``python -m benchmarks.run [NAME ...] [--no-memory] [--out DIR] [--smoke] [--threads N]``.

Without names, every ``benchmarks/bench_*.py`` runs. Results are JSON files in
``benchmarks/results/`` (or ``--out``); ``python -m benchmarks.table`` renders them as
``docs/benchmarks.md``. ``--smoke``: each module's smallest case once, to check that it runs
(results in ``results/smoke/``, never tabulated).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness import run_module


def available() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(p.stem[len("bench_"):] for p in here.glob("bench_*.py"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {available()})")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-implementation memory subprocesses")
    ap.add_argument("--out", type=Path, default=None, help="output folder for the JSON files")
    ap.add_argument("--case", action="append", default=None, help="run only this case (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="run each module's smallest case once (a check, not a measurement)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads while timing (default: $RANKWISE_BENCH_THREADS or 1)")
    args = ap.parse_args(argv)
    names = args.names or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; available: {available()}")
    for n in names:
        run_module(n, args.out, memory=not args.no_memory, only=args.case, smoke=args.smoke, threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
