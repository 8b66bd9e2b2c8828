"""Alice under its historical module path (kept importable; docs, benchmarks and reproductions use it).

The optimizer lives in :mod:`rankwise.train.racs_alice.alice`, the machinery it shares with RACS and the
LoRA-S optimizers in :mod:`rankwise.train.lowmem_base`; every public name this module had is re-exported.
"""

from rankwise.train.racs_alice.alice import (
    EXACT_INIT_MAX,
    INIT_POWER_ITERS,
    Alice,
    AliceConfig,
    _entry,
    alice_switch,
    complement_basis,
    top_eigvecs,
)

__all__ = ["Alice", "AliceConfig", "alice_switch", "complement_basis", "top_eigvecs"]
