"""Reproductions: one module per paper (``rankwise.repro.<id>``) plus the harness and the report.

* :func:`reproduce` (from :mod:`rankwise.repro.harness`) runs one paper's reproduction, with caching;
* :func:`run_report` / :func:`build_report` (from :mod:`rankwise.repro.report`) run all of them and
  write the HTML report;
* :class:`ReproResult`, :class:`Table`, :class:`ClaimCheck`, :class:`Precondition` (from
  :mod:`rankwise.repro.result`) are what a reproduction returns;
* :class:`Reproduction`, :class:`Settings`, :func:`setting` (from :mod:`rankwise.repro.skeleton`) are what a
  reproduction module declares (see ``docs/reproductions-howto.md``).

The names are loaded lazily so that ``import rankwise.repro.<id>`` stays cheap.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "reproduce": "rankwise.repro.harness",
    "ReproductionUnavailable": "rankwise.repro.harness",
    "ReproContractError": "rankwise.repro.harness",
    "build_report": "rankwise.repro.report",
    "run_report": "rankwise.repro.report",
    "ReproResult": "rankwise.repro.result",
    "Table": "rankwise.repro.result",
    "ClaimCheck": "rankwise.repro.result",
    "Precondition": "rankwise.repro.result",
    "environment": "rankwise.repro.result",
    "Reproduction": "rankwise.repro.skeleton",
    "Settings": "rankwise.repro.skeleton",
    "setting": "rankwise.repro.skeleton",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rankwise.repro' has no attribute {name!r}")
