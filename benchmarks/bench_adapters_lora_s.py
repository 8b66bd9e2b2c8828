"""LoRA-S optimizers (AdamS, LRACS) vs AdamW: one LoRA training step on the real all-MiniLM-L6-v2.

Same model, batch and targets as ``bench_adapters_cdka_psoft`` (encoder + mean pooling + linear head,
16 sentences x 16 tokens, LoRA r=4 on ``query``, ``key``, ``value``, ``attention.output.dense`` of all
six layers, head trainable). One step = forward, cross-entropy, backward, optimizer step, ``zero_grad``.

Implementations (anchor: PEFT LoRA + ``torch.optim.AdamW``, what users run today):

* ``peft-lora-adamw``: PEFT ``LoraConfig(r=4)`` + AdamW;
* ``rankwise-lora-adamw``: rankwise's LoRA layer + AdamW (the same function as PEFT's);
* ``rankwise-lora-adams``: rankwise LoRA + :class:`rankwise.train.riemannian_lora.AdamS` (G_X captured by
  hooks, Adam moments on the m x n gradient of the product, horizontal lift to the factors);
* ``rankwise-lora-lracs``: rankwise LoRA + :class:`~rankwise.train.riemannian_lora.LRACS` (row/column
  statistics of G_X, state m + n + 1 per matrix);
* ``peft-lora-adams``: PEFT's LoRA layers + AdamS (the optimizer works on either layer type).

The LoRA-S rows start from the spec's offset initialisation (full-rank factors; the lift needs them),
the AdamW rows from LoRA's usual ``B = 0``; a step costs the same either way.

Run ``python -m benchmarks.run adapters_lora_s`` (a couple of minutes on 2 free cores).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from benchmarks import minilm_adapters as M
from benchmarks.bench_adapters_cdka_psoft import BATCH, SEQ, TARGETS, _base, _head_on, _inputs
from benchmarks.harness import Case

RANK, ALPHA = 4, 8.0


def _build(impl: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from rankwise.train import riemannian_lora as rl

    model = copy.deepcopy(_base())
    if impl.startswith("peft-"):
        import peft

        model = peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)),
                                             model)
    else:
        from rankwise.adapt import lora

        model = lora.adapt(model, lora.LoraConfig(rank=RANK, alpha=ALPHA, target=TARGETS))
    model = _head_on(model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt_name = impl.rsplit("-", 1)[1]
    if opt_name == "adamw":
        return model, torch.optim.AdamW(params, lr=1e-4)
    rl.offset_init_(model, seed=0)
    cls = rl.AdamS if opt_name == "adams" else rl.LRACS
    pairs = rl.lora_factor_pairs(model)
    ids = {id(t) for p in pairs for t in (p.lora_A, p.lora_B)}
    return model, cls(pairs, lr=1e-4, other_params=[p for p in params if id(p) not in ids], other_lr=1e-4)


def _train_step(impl: str) -> Callable[[], Callable[[], Any]]:
    return M.step_factory(lambda: _build(impl), _inputs)


IMPLS = ("peft-lora-adamw", "rankwise-lora-adamw", "rankwise-lora-adams", "rankwise-lora-lracs", "peft-lora-adams")
CASES = [
    Case("lora_s_step", {k: _train_step(k) for k in IMPLS}, anchor="peft-lora-adamw",
         params={"batch": BATCH, "seq": SEQ, "targets": list(TARGETS), "layers": 6, "rank": RANK, "alpha": ALPHA},
         repeats=15, warmup=2),
]
