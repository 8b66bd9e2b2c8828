"""E²LoRA training steps on the real all-MiniLM-L6-v2, side by side with PEFT's LoRA.

The model is the encoder (:func:`rankwise.zoo.minilm`) with a linear head on mean-pooled tokens (the
reproductions' model), adapters on ``query`` and ``value`` of all six layers, one training step =
forward, cross-entropy, backward, ``torch.optim.AdamW`` step, ``zero_grad``, on a batch of 16 sentences
x 16 tokens (fixed random token ids), head trainable.

Cases (``ratio_vs_anchor`` < 1: faster than the anchor):

* ``e2lora_step`` (anchor PEFT LoRA r=8, alpha=16, 73 728 adapter parameters): rankwise E²LoRA with the
  plan computed once from one calibration batch when the implementation is built (the shared pairs make
  the per-step work the same as LoRA's at the interval ranks, plus summing the shared gradients), and PEFT
  LoRA at rank 4 (about E²LoRA's parameter count on this model);
  PEFT's VeRA and VB-LoRA are peer rows for the *sharing*: VeRA shares one frozen random pair across
  layers and trains per-layer scaling vectors (``r + d_out`` per module, so it reaches LoRA r=4's budget
  only at r = 2560 on these 384-wide layers: ``peft-vera-r2560``), VB-LoRA composes every layer's factors
  from one trained vector bank (``peft-vblora-r4``: rank 4, a bank of 90 vectors of length 128, top-2).
  The trainable adapter parameters of every row (head excluded) are counted on the built model and
  recorded in ``params["trainable_params"]`` (E²LoRA's depends on its plan);
* ``e2lora_plan``: the one-shot planning overhead (one forward/backward with full weight gradients of
  the targeted layers plus the O(N^2) entropies), anchored on one PEFT LoRA r=8 training step, so the
  ratio reads "the plan costs this many training steps".

Run ``python -m benchmarks.run e2lora`` (a minute or two on 2 free cores).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from benchmarks import minilm_adapters as M
from benchmarks.harness import Case

BATCH, SEQ = 16, 16
TARGETS = ("query", "value")


_base = M.base


def _inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return M.batch(BATCH, SEQ)


_loss = M.ce_loss


_head_on = M.head_on


#: Trainable adapter parameters (head excluded) of each built implementation, filled in as they are built.
TRAINABLE: dict[str, int] = {}


def _count(impl: str, model: nn.Module) -> nn.Module:
    TRAINABLE[impl] = sum(p.numel() for n, p in model.named_parameters()
                          if p.requires_grad and "classifier" not in n)
    return model


def _build(impl: str) -> nn.Module:
    return _count(impl, _head_on(_adapt(impl)))


def _adapt(impl: str) -> nn.Module:
    import peft

    model = copy.deepcopy(_base())
    if impl in ("peft-lora-r8", "peft-lora-r4"):
        r = int(impl[-1])
        return peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(TARGETS)),
                                            model)
    # VeRA and VB-LoRA keep shared state on the tuner, so PEFT builds them only through get_peft_model
    # (a PeftModel whose forward passes the keyword arguments on to the wrapped classifier).
    if impl == "peft-vera-r2560":
        return peft.get_peft_model(model, peft.VeraConfig(r=2560, target_modules=list(TARGETS)))
    if impl == "peft-vblora-r4":
        return peft.get_peft_model(model, peft.VBLoRAConfig(r=4, num_vectors=90, vector_length=128, topk=2,
                                                            target_modules=list(TARGETS)))
    if impl == "rankwise-e2lora":
        from rankwise.adapt import e2lora

        cfg = e2lora.E2LoRAConfig(base_rank=8, alpha=16, target=TARGETS)
        return e2lora.adapt(model, cfg, calib=[_inputs()], loss_fn=_loss)
    raise ValueError(f"unknown implementation {impl!r}")


def _with_adamw(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def _train_step(impl: str) -> Callable[[], Callable[[], Any]]:
    return M.step_factory(lambda: _with_adamw(_build(impl)), _inputs)


def _plan() -> Callable[[], Any]:
    from rankwise.adapt import e2lora

    model = copy.deepcopy(_base())
    cfg = e2lora.E2LoRAConfig(base_rank=8, alpha=16, target=TARGETS)
    batch = _inputs()
    return lambda: e2lora.plan_e2lora(model, [batch], _loss, cfg)


STEP_IMPLS = ("peft-lora-r8", "rankwise-e2lora", "peft-lora-r4", "peft-vera-r2560", "peft-vblora-r4")

CASES = [
    Case("e2lora_step", {k: _train_step(k) for k in STEP_IMPLS},
         anchor="peft-lora-r8", params={"batch": BATCH, "seq": SEQ, "targets": list(TARGETS), "layers": 6,
                                        "adapter_params": {"peft-lora-r8": 73728, "peft-lora-r4": 36864,
                                                           "rankwise-e2lora": "data-dependent (plan)"},
                                        # the same dict object: filled in when each row is built, so the
                                        # JSON carries the counts measured on the built models
                                        "trainable_params": TRAINABLE},
         repeats=15, warmup=2),
    Case("e2lora_plan", {"peft-lora-r8-step": _train_step("peft-lora-r8"), "rankwise-e2lora-plan": _plan},
         anchor="peft-lora-r8-step", params={"batch": BATCH, "seq": SEQ, "targets": list(TARGETS),
                                             "calib_batches": 1}, repeats=10, warmup=1),
]
