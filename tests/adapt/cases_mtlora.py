"""mtLoRA entries of the shared adapter contract (see the bottom of ``contract.py``).

mtLoRA's routed mixture cannot be merged into the base weights, so ``merge``/``unmerge`` are None
here; ``tests/adapt/test_mtlora.py`` checks that merging raises a RankwiseError saying why.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def cases(contract) -> list:
    def api(fn: str):
        def call(*args: Any) -> Any:
            from rankwise.adapt import mtlora

            return getattr(mtlora, fn)(*args)
        return call

    def make(name: str, kinds: tuple[str, ...], **cfg: Any):
        def target_for(kind: str) -> Any:
            if cfg.get("placement") == "component":
                return nn.Linear if kind == "mlp" else ("query", "value")
            return None

        def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
            from rankwise.adapt.mtlora import MtLoRAConfig, adapt

            return adapt(model, MtLoRAConfig(rank=4, alpha=8, num_experts=3, dropout=0.0, seed=seed, **cfg),
                         target=target_for(kind), name=adapter)

        def bad_rank(model: nn.Module, kind: str) -> None:
            from rankwise.adapt.mtlora import MtLoRAConfig, adapt

            adapt(model, MtLoRAConfig(rank=10_000, num_experts=3, **cfg), target=target_for(kind))

        return contract.AdapterCase(
            name=name, apply=apply, kinds=kinds, merge=None, unmerge=None,
            disable=api("disable_adapters"), enable=api("enable_adapters"), set_active=api("set_active"),
            save=api("save_adapter"), load=api("load_adapter"), bad_rank=bad_rank)

    return [
        make("mtlora-ffn", ("bert",)),
        make("mtlora-both-fgr8", ("bert",), placement="both", routing_group_size=8),
        make("mtlora-component", ("mlp", "bert"), placement="component"),
    ]
