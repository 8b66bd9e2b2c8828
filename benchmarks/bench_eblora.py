"""EBLoRA's training step (RiemannianAdamW) vs PEFT LoRA + torch AdamW at equal rank, on the real all-MiniLM-L6-v2.

The model is the encoder (:func:`rankwise.zoo.minilm`) with a linear head on mean-pooled tokens; adapters of rank 4
on ``query, key, value, attention.output.dense, intermediate.dense, output.dense`` of all six layers (the EBLoRA
reproduction's targets); a batch of 16 sentences x 32 tokens (fixed random ids), head trainable. Cases
(``ratio_vs_anchor`` < 1: faster than the anchor):

* ``eblora_train_step`` (anchor: PEFT LoRA r=4 + ``torch.optim.AdamW``): forward, cross-entropy, backward,
  optimizer step, ``zero_grad``; rankwise EBLoRA r=4 with :class:`~rankwise.adapt.stiefel_cl.RiemannianAdamW`
  (tangent projection, AdamW, polar retraction of every U and V, V against a protected basis of 64 columns);
* ``eblora_optimizer_step``: the optimizer step alone on the same parameters and fixed gradients (the price of
  the projections and the 72 thin float64 SVDs per step), anchor ``torch.optim.AdamW`` on PEFT LoRA's factors.

Run ``python -m benchmarks.run eblora`` (a few minutes on 2 free cores); ``--smoke`` runs a tiny BERT once.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from benchmarks import minilm_adapters as M
from benchmarks.harness import Case

BATCH, SEQ, RANK = 16, 32, 4
TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")
PROTECTED = 64


def _base(tiny: bool) -> nn.Module:
    return M.base(tiny)


def _inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return M.batch(BATCH, SEQ)


_loss = M.ce_loss


def _build(impl: str, tiny: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(_base(tiny))
    if impl == "peft-lora-adamw":
        import peft

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                                 target_modules=list(TARGETS)), model)
        M.head_on(model)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if impl == "rankwise-eblora":
        from rankwise.adapt import stiefel_cl as eb

        eb.adapt(model, eb.EBLoRAConfig(rank=RANK, alpha=2 * RANK, target=TARGETS), calib=[_inputs()],
                 loss_fn=_loss)
        gen = torch.Generator().manual_seed(1)
        for _, layer in eb.eblora_layers(model):  # a protected basis, V moved off it
            F = eb.polar(torch.randn(layer.in_features, min(PROTECTED, layer.in_features // 4), generator=gen, dtype=torch.float64)).float()
            layer.set_protected(F)
            with torch.no_grad():
                V = layer.eblora_V["default"]
                V.copy_(eb.polar(eb.project_out(F.double(), V.double())).float())
        M.head_on(model)
        return model, eb.make_optimizer(model, lr=1e-3, extra_params=model.classifier.parameters())
    raise ValueError(f"unknown implementation {impl!r}")


def _train_step(impl: str, tiny: bool = False) -> Callable[[], Callable[[], Any]]:
    return M.step_factory(lambda: _build(impl, tiny), _inputs)


def _optimizer_step(impl: str, tiny: bool = False) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        model, opt = _build(impl, tiny)
        inputs, labels = _inputs()
        nn.functional.cross_entropy(model(**inputs), labels).backward()
        grads = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}

        def run() -> None:
            for p, g in grads.items():
                p.grad = g.clone()
            opt.step()
        return run
    return factory


_IMPLS = ("peft-lora-adamw", "rankwise-eblora")
_PARAMS = {"batch": BATCH, "seq": SEQ, "rank": RANK, "targets": list(TARGETS), "layers": 6, "protected": PROTECTED}

CASES = [
    Case("eblora_train_step", {k: _train_step(k) for k in _IMPLS}, anchor="peft-lora-adamw", params=_PARAMS,
         repeats=15, warmup=2),
    Case("eblora_optimizer_step", {k: _optimizer_step(k) for k in _IMPLS}, anchor="peft-lora-adamw", params=_PARAMS,
         repeats=15, warmup=2),
]

SMOKE_CASES = [
    Case("eblora_train_step_tiny", {k: _train_step(k, tiny=True) for k in _IMPLS}, anchor="peft-lora-adamw",
         params={**_PARAMS, "model": "tiny BERT (hidden 32, 2 layers)"}, repeats=1, warmup=0),
]
