"""rankwise: reference implementations of 2026 low-rank methods for neural networks.

The families live in subpackages (``rankwise.adapt``, ``rankwise.compress``, ``rankwise.merge``,
``rankwise.train``, ``rankwise.federated``, ``rankwise.infer``, ``rankwise.science``); the embedded
offline defaults in ``rankwise.zoo``; reproductions in ``rankwise.repro``. A few entry points are
re-exported here, loaded lazily so that ``import rankwise`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_compressed": "rankwise.compress.serialization",
    "save_compressed": "rankwise.compress.serialization",
    "RankwiseError": "rankwise.core.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rankwise' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
