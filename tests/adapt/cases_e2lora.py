"""E²LoRA entries of the shared adapter contract (loaded by ``tests/adapt/contract.py``).

E²LoRA plans from calibration gradients (the contract's seeded regression loss on the tiny model's
outputs; one fixed calibration set so that the ``seed`` of ``apply`` only changes the initialisation).
On the tiny BERT the query/value types have two layers each and share one pair per interval; the
tiny MLP's three Linear layers all differ in shape, so it runs with ``depth_regex=None`` (every layer
its own type, i.e. plain LoRA of rank ``rank``) -- with the default it is rejected (see
tests/adapt/test_e2lora.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def cases(contract: Any) -> list:
    def make(case_name: str, **cfg: Any):
        def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
            from rankwise.adapt.e2lora import E2LoRAConfig, adapt

            extra = {"depth_regex": None} if kind == "mlp" else {}
            target: Any = nn.Linear if kind == "mlp" else ("query", "value")
            calib, loss_fn = contract._calibration(kind, 0)
            config = E2LoRAConfig(rank=4, alpha=8.0, seed=seed, calib_batches=2, **extra, **cfg)
            return adapt(model, config, target=target, name=adapter, calib=calib, loss_fn=loss_fn)

        def bad_rank(model: nn.Module, kind: str) -> None:
            from rankwise.adapt.e2lora import E2LoRAConfig, adapt

            extra = {"depth_regex": None} if kind == "mlp" else {}
            target: Any = nn.Linear if kind == "mlp" else ("query", "value")
            calib, loss_fn = contract._calibration(kind, 0)
            adapt(model, E2LoRAConfig(rank=10_000, **extra), target=target, calib=calib, loss_fn=loss_fn)

        mod = "rankwise.adapt.e2lora"
        api = contract._method_api
        return contract.AdapterCase(
            name=case_name, apply=apply, merge=api(mod, "merge"), unmerge=api(mod, "unmerge"),
            disable=api(mod, "disable_adapters"), enable=api(mod, "enable_adapters"),
            set_active=api(mod, "set_active"), save=api(mod, "save_adapter"), load=api(mod, "load_adapter"),
            bad_rank=bad_rank)

    return [make("e2lora"),
            make("e2lora-sharelora-shifted-lr", sharing="sharelora", hra_score="shifted",
                 rounding="largest_remainder")]
