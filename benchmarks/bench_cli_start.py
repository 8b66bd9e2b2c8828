"""Start-up time of the ``rankwise`` command (issue: `rankwise --help` and `rankwise list` <= 0.5 s).

Each implementation is one fresh interpreter (``subprocess``), so the time includes Python's own start;
the anchor is an interpreter that imports nothing (``python -c pass``), and ``import torch`` is a row for
scale (what every command paid before the verbs imported their libraries lazily). ``python -X importtime
-m rankwise.cli --help`` shows where the remaining time goes (docs/benchmarks.md quotes it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

from benchmarks.harness import Case, Goal


def _command(*args: str) -> Callable[[], Callable[[], None]]:
    def factory() -> Callable[[], None]:
        env = {**os.environ, "COLUMNS": "120"}

        def run() -> None:
            subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL, env=env)
        return run
    return factory


CASES = [
    Case("cli_start", impls={
        "python -c pass": _command("-c", "pass"),
        "rankwise --help": _command("-m", "rankwise.cli", "--help"),
        "rankwise list": _command("-m", "rankwise.cli", "list"),
        "import torch": _command("-c", "import torch"),
    }, anchor="python -c pass", params={"unit": "one fresh interpreter per call"}, repeats=7, warmup=1,
        goals=(Goal("`rankwise --help` starts in <= 0.5 s", metric="seconds", impl="rankwise --help",
                    max_seconds=0.5),
               Goal("`rankwise list` starts in <= 0.5 s", metric="seconds", impl="rankwise list",
                    max_seconds=0.5))),
]
