"""One-example safety patch vs the multi-example baseline: time and peak memory of a 10-step patch.

Each call runs a whole patch in place on a seeded random tiny Llama (the timing does not depend on what
the weights learned): 10 AdamW steps (``stop_nll=None``, so every row takes all 10) on

* ``multi-example-100`` (the anchor): :class:`MultiExampleSafetyPatch` on 100 refusal examples, one batch
  per step (the reproduction's baseline at the same step budget);
* ``one-shot``: :class:`OneShotSafetyPatch` on one example;
* ``one-shot-projected-k8``: the same with every 2-D update projected onto the top-8 singular directions of
  the example's gradient (one SVD per weight before the first step, two thin products per step).

Sizes: the reproduction's model (4 layers, hidden 128) and a wider one (8 layers, hidden 512) where the
SVDs of the projected patch weigh more. Run ``python -m benchmarks.run safety_one_shot`` (``--smoke``
for a tiny check).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case


def _setup(hidden: int, layers: int) -> tuple[Any, Any, list[Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.zoo.synthetic import SafetyWorld

    world = SafetyWorld()
    tok = world.tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id)).eval()
    return model, tok, world.harmful(100, 0, "refuse")


def _patch(impl: str, hidden: int, layers: int, epochs: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.train.safety_one_shot import MultiExampleSafetyPatch, OneShotSafetyPatch, SafetyPatchConfig

        model, tok, examples = _setup(hidden, layers)
        rank = 8 if impl == "one-shot-projected-k8" else None
        cfg = SafetyPatchConfig(epochs=epochs, lr=1e-4, stop_nll=None, projection_rank=rank)
        if impl == "multi-example-100":
            patcher: Any = MultiExampleSafetyPatch(model, tok, cfg)
            data: Any = examples
        else:
            patcher, data = OneShotSafetyPatch(model, tok, cfg), examples[0]

        def run() -> None:
            patcher.patch(data, inplace=True)

        return run

    return factory


def _case(hidden: int, layers: int, epochs: int = 10, repeats: int = 5) -> Case:
    impls = {k: _patch(k, hidden, layers, epochs) for k in ("multi-example-100", "one-shot", "one-shot-projected-k8")}
    return Case(f"patch_h{hidden}_l{layers}", impls, anchor="multi-example-100",
                params={"hidden": hidden, "layers": layers, "epochs": epochs, "optimizer": "adamw",
                        "multi_examples": 100, "projection_rank": 8},
                repeats=repeats, warmup=1)


CASES = [_case(128, 4), _case(512, 8, repeats=3)]
SMOKE_CASES = [_case(16, 1, epochs=2, repeats=1)]
