"""EBLoRA (``stiefel_cl``) entries of the shared adapter contract (loaded by ``tests/adapt/contract.py``).

The gradient initialisation reads the contract's seeded regression loss on the tiny model's outputs; the
magnitude starts at 0 (identity at init) and the contract's perturbation moves U, V and s.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def cases(contract: Any) -> list:
    def make(case_name: str, **cfg: Any):
        def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
            from rankwise.adapt.stiefel_cl import EBLoRAConfig, adapt

            target: Any = nn.Linear if kind == "mlp" else ("query", "value")
            calib, loss_fn = contract._calibration(kind, 0)
            config = EBLoRAConfig(**{"rank": 4, "alpha": 8.0, "seed": seed, "grad_batches": 2, **cfg})
            return adapt(model, config, target=target, name=adapter, calib=calib, loss_fn=loss_fn)

        def bad_rank(model: nn.Module, kind: str) -> None:
            from rankwise.adapt.stiefel_cl import EBLoRAConfig, adapt

            target: Any = nn.Linear if kind == "mlp" else ("query", "value")
            calib, loss_fn = contract._calibration(kind, 0)
            adapt(model, EBLoRAConfig(rank=10_000), target=target, calib=calib, loss_fn=loss_fn)

        mod = "rankwise.adapt.stiefel_cl"
        api = contract._method_api
        return contract.AdapterCase(
            name=case_name, apply=apply, merge=api(mod, "merge"), unmerge=api(mod, "unmerge"),
            disable=api(mod, "disable_adapters"), enable=api(mod, "enable_adapters"),
            set_active=api(mod, "set_active"), save=api(mod, "save_adapter"), load=api(mod, "load_adapter"),
            bad_rank=bad_rank)

    return [make("stiefel_cl"), make("stiefel_cl-rank2-alpha16", rank=2, alpha=16.0)]
