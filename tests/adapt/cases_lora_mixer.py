"""LoRA-Mixer entries of the shared adapter contract (see the bottom of ``contract.py``).

A routed mixture cannot be merged into the base weights, so ``merge``/``unmerge`` are None here;
``tests/adapt/test_lora_mixer.py`` checks that merging raises a RankwiseError saying why.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def cases(contract) -> list:
    def api(fn: str):
        def call(*args: Any) -> Any:
            from rankwise.adapt import lora_mixer

            return getattr(lora_mixer, fn)(*args)
        return call

    def make(name: str, **cfg: Any):
        def target_for(kind: str) -> Any:
            return nn.Linear if kind == "mlp" else ("query", "key", "value", "attention.output.dense")

        def apply(model: nn.Module, kind: str, adapter: str = "default", seed: int = 0) -> nn.Module:
            from rankwise.adapt.lora_mixer import LoRAMixerConfig, adapt

            config = LoRAMixerConfig(num_experts=3, rank=4, alpha=8, dropout=0.0, seed=seed, **cfg)
            return adapt(model, config, target=target_for(kind), name=adapter)

        def bad_rank(model: nn.Module, kind: str) -> None:
            from rankwise.adapt.lora_mixer import LoRAMixerConfig, adapt

            adapt(model, LoRAMixerConfig(num_experts=3, rank=10_000, top_k_infer=2), target=target_for(kind))

        return contract.AdapterCase(
            name=name, apply=apply, merge=None, unmerge=None,
            disable=api("disable_adapters"), enable=api("enable_adapters"), set_active=api("set_active"),
            save=api("save_adapter"), load=api("load_adapter"), bad_rank=bad_rank)

    return [
        make("lora_mixer-top2", top_k_infer=2),
        make("lora_mixer-top1-raw", top_k_infer=1, renormalize=False),
        make("lora_mixer-shared-router", top_k_infer=2, share_router="layer"),
    ]
