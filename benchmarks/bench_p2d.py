"""P2D's stages against full-data fine-tuning: what each stage costs, in the time of full FT.

The model is a tiny Llama of the reproduction's geometry (4 layers x 8 heads of 16, hidden 128, FFN 512;
random weights: timing does not depend on pretraining) on :class:`rankwise.zoo.synthetic.P2DWorld`'s
pool (word-level, about 14 tokens per sample). Heads: 3 of 32 (10 %), the first three of layer 1.

Cases (``ratio_vs_anchor`` < 1: cheaper than the anchor):

* ``p2d_train_step``: one AdamW step on a batch of 32 (forward, backward, step). Anchor: full fine-tuning of
  every parameter; ``p2d-heads``: the same model under ``restrict_to_heads`` (gradient masks on the four
  attention projections, everything else frozen); ``peft-lora-r8``: PEFT LoRA rank 8 on q/k/v/o.
* ``p2d_stages``: the selection stages over a pool of ``N`` samples. Anchor: one epoch of full fine-tuning
  over the pool (``N / 32`` steps); ``p2d-proxy``: the 50-step probe fine-tune plus the ALPS scores;
  ``p2d-grad-affinity``: per-sample gradient norms through the heads (one batched backward per 32
  samples); ``p2d-activation-affinity`` (forward only); ``loss-topk`` (forward only, the baseline).

Goal: P2D's gradient-affinity pass over the pool costs less than one epoch of full FT over it (the AER
of the reproduction then counts the selection at most as one extra epoch). Run ``python -m benchmarks.run p2d``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case, Goal

BATCH = 32
HEADS = [(1, 0), (1, 1), (1, 2)]


@functools.lru_cache(maxsize=4)
def _setup(layers: int, hidden: int, n: int) -> tuple[nn.Module, Any, list[Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.zoo.synthetic import P2DWorld

    world = P2DWorld()
    tok = world.tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(cfg), tok, world.pool(n, seed=0)


def _train_step(impl: str, layers: int, hidden: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.train.p2d import lora_model, restrict_to_heads
        from rankwise.train.sft import SFTConfig, SFTTrainer, make_sft_batches

        base, tok, pool = _setup(layers, hidden, BATCH)
        model = copy.deepcopy(base).train()
        if impl == "peft-lora-r8":
            model = lora_model(model, rank=8)
        elif impl == "p2d-heads":
            restrict_to_heads(model, HEADS)
        cfg = SFTConfig(lr=1e-3, steps=10_000, batch_size=BATCH, weight_decay=0.0)
        trainer = SFTTrainer(model, cfg)
        (batch,) = make_sft_batches(tok, pool, SFTConfig(steps=1, batch_size=BATCH))

        def run() -> None:
            trainer.step(batch)

        return run

    return factory


def _stage(impl: str, layers: int, hidden: int, n: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.train.p2d import P2D, P2DConfig, loss_data
        from rankwise.train.sft import SFTConfig, sft

        base, tok, pool = _setup(layers, hidden, n)
        model = copy.deepcopy(base)
        p2d = P2D(model, tok, P2DConfig(affinity="activation" if impl == "p2d-activation-affinity" else "grad_norm"))

        def run() -> None:
            if impl == "full-ft-epoch":
                sft(copy.deepcopy(base), tok, pool, SFTConfig(lr=1e-3, steps=max(1, n // BATCH), batch_size=BATCH))
            elif impl == "p2d-proxy":
                p2d.localize_heads(p2d.probe_set(pool))
            elif impl == "loss-topk":
                loss_data(model, tok, pool, 0.1, batch_size=BATCH)
            else:
                p2d.select_data(pool, HEADS)

        return run

    return factory


STAGES = ("full-ft-epoch", "p2d-proxy", "p2d-grad-affinity", "p2d-activation-affinity", "loss-topk")


def _cases(layers: int, hidden: int, n: int, repeats: int, suffix: str = "") -> list[Case]:
    params = {"layers": layers, "heads": 8, "hidden": hidden, "batch": BATCH, "selected_heads": len(HEADS)}
    step = Case(f"p2d_train_step{suffix}", {k: _train_step(k, layers, hidden) for k in
                                            ("full-ft", "p2d-heads", "peft-lora-r8")},
                anchor="full-ft", params=params, repeats=repeats * 4, warmup=2)
    stages = Case(f"p2d_stages{suffix}", {k: _stage(k, layers, hidden, n) for k in STAGES}, anchor="full-ft-epoch",
                  params={**params, "pool": n}, repeats=repeats, warmup=1,
                  goals=(Goal("P2D's gradient affinity over the pool costs less than one epoch of full FT over it",
                              impl="p2d-grad-affinity", max_ratio=1.0),))
    return [step, stages]


CASES = _cases(4, 128, 512, repeats=5)
SMOKE_CASES = [_cases(2, 32, 64, repeats=1, suffix="_smoke")[1]]
