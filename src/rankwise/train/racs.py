"""RACS under its historical module path (kept importable; docs, benchmarks and reproductions use it).

The optimizer lives in :mod:`rankwise.train.racs_alice.racs`, the machinery it shares with Alice and the
LoRA-S optimizers in :mod:`rankwise.train.lowmem_base`; every name this module had is re-exported.
"""

from rankwise.train.lowmem_base import (
    LowMemOptimizer,
    norm_growth_limit,
    optimizer_state_bytes,
    racs_scale,
    split_params_for_lowmem,
)
from rankwise.train.racs_alice.racs import RACS, RACSConfig, _entry, racs_fixed_point

__all__ = [
    "RACS",
    "RACSConfig",
    "LowMemOptimizer",
    "norm_growth_limit",
    "optimizer_state_bytes",
    "racs_fixed_point",
    "racs_scale",
    "split_params_for_lowmem",
]
