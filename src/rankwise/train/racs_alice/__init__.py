"""RACS and Alice (ICLR 2026, arXiv 2502.07752): the paper's module, registered as ``racs_alice``.

The optimizers live in :mod:`rankwise.train.racs_alice.racs` and :mod:`rankwise.train.racs_alice.alice`
(also importable under their old names :mod:`rankwise.train.racs` and :mod:`rankwise.train.alice`); what
they share with the other low-memory optimizers of the family (the :class:`LowMemOptimizer` base, AdamW
routing, the norm-growth limiter, parameter splitting) is :mod:`rankwise.train.lowmem_base`. This module
re-exports them and offers one entry point that builds either optimizer for a model (2-D block weights
on the low-memory path, embeddings / LM head / norms / biases on AdamW)::

    from rankwise.train.racs_alice import Alice, RACS, split_params_for_lowmem
    groups = split_params_for_lowmem(model)
    opt = Alice([{"params": groups["matrix"], "rank": 32, "leading_basis": 8, "update_interval": 50},
                 {"params": groups["other"], "use_adamw": True, "lr": 3e-3}], lr=0.02)
    opt.state_bytes()

    # or in one line, from a config:
    opt = lowmem_optimizer(model, LowMemConfig(optimizer="racs", racs=RACSConfig(lr=0.1)))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from rankwise.core.registry import register
from rankwise.core.validate import check_choice, check_positive
from rankwise.train.lowmem_base import (
    LowMemOptimizer,
    norm_growth_limit,
    optimizer_state_bytes,
    racs_scale,
    split_params_for_lowmem,
)
from rankwise.train.racs_alice.alice import Alice, AliceConfig, alice_switch, complement_basis, top_eigvecs
from rankwise.train.racs_alice.alice import _entry as _alice_entry
from rankwise.train.racs_alice.racs import RACS, RACSConfig, racs_fixed_point
from rankwise.train.racs_alice.racs import _entry as _racs_entry

__all__ = [
    "Alice",
    "AliceConfig",
    "LowMemConfig",
    "LowMemOptimizer",
    "RACS",
    "RACSConfig",
    "alice_switch",
    "complement_basis",
    "lowmem_optimizer",
    "norm_growth_limit",
    "optimizer_state_bytes",
    "racs_fixed_point",
    "racs_scale",
    "split_params_for_lowmem",
    "top_eigvecs",
]


@dataclass(frozen=True)
class LowMemConfig:
    """Which optimizer of the paper to build and its hyper-parameters.

    ``optimizer``: ``"alice"`` (default) or ``"racs"``. ``other_lr``: AdamW learning rate of the
    embeddings, LM head, norms and biases (``None``: the method's ``lr``).
    """

    optimizer: str = "alice"
    alice: AliceConfig = field(default_factory=AliceConfig)
    racs: RACSConfig = field(default_factory=RACSConfig)
    other_lr: float | None = None

    def __post_init__(self) -> None:
        check_choice("LowMemConfig.optimizer", self.optimizer, ("alice", "racs"))
        if not isinstance(self.alice, AliceConfig):
            raise TypeError(f"alice must be an AliceConfig, got {type(self.alice).__name__}")
        if not isinstance(self.racs, RACSConfig):
            raise TypeError(f"racs must be a RACSConfig, got {type(self.racs).__name__}")
        check_positive("LowMemConfig.other_lr", self.other_lr, allow_none=True)


def lowmem_optimizer(model: nn.Module, config: LowMemConfig | None = None) -> Alice | RACS:
    """Build Alice or RACS for ``model``: the low-memory update on every 2-D block weight
    (:func:`split_params_for_lowmem`), AdamW on the rest. Returns the optimizer."""
    config = config or LowMemConfig()
    if not isinstance(config, LowMemConfig):
        raise TypeError(f"config must be a LowMemConfig, got {type(config).__name__}")
    if config.optimizer == "alice":
        return _alice_entry(model, config.alice, config.other_lr)
    return _racs_entry(model, config.racs, config.other_lr)


register("racs_alice", config=LowMemConfig, entry=lowmem_optimizer)
