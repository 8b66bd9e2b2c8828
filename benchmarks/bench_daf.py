"""DAF vs PEFT LoRA and PEFT AdaLoRA at equal trainable budget: training-step time and peak memory on MiniLM.

Same model and batch as ``bench_adapters_cdka_psoft`` (all-MiniLM-L6-v2 encoder + mean pooling + linear
head, 16 sentences x 16 tokens, head trainable). Budget ``P``: rank-4 LoRA on ``query`` and ``value`` of
all six layers (6 x 2 x 4 x (384 + 384) = 36 864 parameters).

* ``daf_step`` (anchor PEFT LoRA r=4 on q, v): rankwise DAF with ``lora_rank=4`` and ``budget_params=P``
  over its six candidate matrices per layer (round 0 already run when the implementation is built; the
  timed call is a plain training step, as between two of DAF's analysis rounds), and PEFT AdaLoRA on q, v
  with ``init_r=8, target_r=4`` (its final budget; ``update_and_allocate`` after every step, as the
  reproduction runs it).
* ``daf_analysis_round``: one DAF analysis round (forward/backward on ``analysis_batches=1`` batch with
  every adapter frozen, the Taylor scores, the greedy allocation and the change test; the change test
  usually keeps the allocation) against one PEFT LoRA training step, to put the periodic cost in units
  of steps. DAF runs a round every quarter of the training by default, so its amortised cost is small.

Run ``python -m benchmarks.run daf``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.bench_adapters_cdka_psoft import BATCH, SEQ, _base, _head_on, _inputs
from benchmarks.harness import Case

RANK = 4
BUDGET = 6 * 2 * RANK * (384 + 384)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(**inputs), labels)


def _build(impl: str) -> tuple[nn.Module, Any]:
    import peft

    model = copy.deepcopy(_base())
    batch = _inputs()
    if impl == "peft-lora-r4":
        model = peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                                             target_modules=["query", "value"]), model)
        return _head_on(model).train(), None
    if impl == "peft-adalora":
        cfg = peft.AdaLoraConfig(init_r=2 * RANK, target_r=RANK, lora_alpha=2 * RANK, target_modules=["query", "value"],
                                 total_step=1000, tinit=0, tfinal=0, deltaT=1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pm = peft.get_peft_model(model, cfg)
        _head_on(pm.base_model.model)
        return pm.train(), pm
    if impl == "rankwise-daf":
        from rankwise.adapt import daf

        cfg = daf.DAFConfig(lora_rank=RANK, lora_alpha=2.0 * RANK, budget_params=BUDGET, analysis_batches=1)
        model = daf.adapt(model, cfg, batches=[batch], loss_fn=_loss)
        model = _head_on(model).train()
        return model, daf.DAFController(model, [batch], loss_fn=_loss, total_steps=1000)
    raise ValueError(f"unknown implementation {impl!r}")


def _train_step(impl: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        model, extra = _build(impl)
        batch = _inputs()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        state = {"step": 0}

        def run() -> float:
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            if impl == "peft-adalora":
                state["step"] += 1
                extra.base_model.update_and_allocate(state["step"])
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return run
    return factory


def _analysis_round() -> Callable[[], Any]:
    model, controller = _build("rankwise-daf")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    state = {"step": 0}

    def run() -> Any:
        state["step"] += 1
        return controller.update(state["step"], opt)
    return run


CASES = [
    Case("daf_step", {k: _train_step(k) for k in ("peft-lora-r4", "rankwise-daf", "peft-adalora")},
         anchor="peft-lora-r4", params={"batch": BATCH, "seq": SEQ, "budget_params": BUDGET, "rank": RANK,
                                        "daf_candidates": "q, k, v, o, ffn-in, ffn-out",
                                        "baseline_targets": "query, value"},
         repeats=15, warmup=2),
    Case("daf_analysis_round", {"peft-lora-r4 step": _train_step("peft-lora-r4"), "rankwise-daf round": _analysis_round},
         anchor="peft-lora-r4 step", params={"analysis_batches": 1, "budget_params": BUDGET}, repeats=7, warmup=1),
]
