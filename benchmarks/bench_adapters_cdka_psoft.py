"""CDKA and PSOFT training steps on the real all-MiniLM-L6-v2, side by side with PEFT at equal budget.

The model is the encoder (:func:`rankwise.zoo.minilm`) with a linear head on mean-pooled tokens (the
reproductions' model), adapters on ``query``, ``key``, ``value`` and ``attention.output.dense`` of all
six layers, one training step = forward, cross-entropy, backward, ``torch.optim.AdamW`` step,
``zero_grad``, on a batch of 16 sentences x 16 tokens (fixed random token ids), head trainable.

Cases (``ratio_vs_anchor`` < 1: faster than the anchor):

* ``cdka_step`` (anchor PEFT LoRA r=4, 3 072 parameters per matrix): rankwise CDKA with fixed
  Kronecker components ``r1 = r2 = 4``, ``r = 4`` (3 072), CDKA with budget-aligned shapes (3 072 +-10 %,
  calibrated once on one batch when the implementation is built), and PEFT LoKr at the same budget
  (``decompose_factor=2, r=8``: 3 076);
* ``psoft_step_neumann`` (anchor PEFT PSOFT r=38 with 7 Cayley-Neumann terms): rankwise PSOFT r=38
  with t = 5 (the same series), and PEFT LoRA r=1 (768 vs 779 parameters per matrix);
* ``psoft_step_exact``: rankwise PSOFT vs PEFT PSOFT, both with the exact Cayley solve (PEFT's default).

Run ``python -m benchmarks.run adapters_cdka_psoft`` (a few minutes on 2 free cores).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from benchmarks import minilm_adapters as M
from benchmarks.harness import Case

BATCH, SEQ = 16, 16
TARGETS = ("query", "key", "value", "attention.output.dense")


_base = M.base


def _inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return M.batch(BATCH, SEQ)


_head_on = M.head_on


def _build(impl: str) -> nn.Module:
    import peft

    model = copy.deepcopy(_base())
    if impl == "peft-lora-r4":
        return _head_on(peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=64, use_rslora=True,
                                                                     target_modules=list(TARGETS)), model))
    if impl == "peft-lora-r1":
        return _head_on(peft.inject_adapter_in_model(peft.LoraConfig(r=1, lora_alpha=2,
                                                                     target_modules=list(TARGETS)), model))
    if impl == "peft-lokr":
        return _head_on(peft.inject_adapter_in_model(peft.LoKrConfig(r=8, alpha=256, decompose_factor=2,
                                                                     target_modules=list(TARGETS)), model))
    if impl.startswith("rankwise-cdka"):
        from rankwise.adapt import cdka

        if impl == "rankwise-cdka-fixed":
            cfg = cdka.CDKAConfig(config_mode="fixed", r1=4, r2=4, r=4, init="zero")
            return _head_on(cdka.adapt(model, cfg, target=TARGETS))
        inputs, labels = _inputs()
        return _head_on(cdka.adapt(model, cdka.CDKAConfig(budget="lora_r4"), target=TARGETS, calib=[(inputs, labels)],
                                   loss_fn=lambda m, b: nn.functional.cross_entropy(m(**b[0]), b[1])))
    if impl.startswith("peft-psoft"):
        exact = impl.endswith("exact")
        cfg = peft.PsoftConfig(r=38, psoft_alpha=38, use_cayley_neumann=not exact,
                               num_cayley_neumann_terms=5 if exact else 7, target_modules=list(TARGETS))
        return _head_on(peft.inject_adapter_in_model(cfg, model))
    if impl.startswith("rankwise-psoft"):
        from rankwise.adapt import psoft

        exact = impl.endswith("exact")
        cfg = psoft.PSOFTConfig(r=38, cayley="exact" if exact else "neumann", neumann_terms=5)
        return _head_on(psoft.adapt(model, cfg, target=TARGETS))
    raise ValueError(f"unknown implementation {impl!r}")


def _with_adamw(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def _train_step(impl: str) -> Callable[[], Callable[[], Any]]:
    return M.step_factory(lambda: _with_adamw(_build(impl)), _inputs)


CASES = [
    Case("cdka_step", {k: _train_step(k) for k in ("peft-lora-r4", "rankwise-cdka-fixed", "rankwise-cdka-aligned",
                                                   "peft-lokr")},
         anchor="peft-lora-r4", params={"batch": BATCH, "seq": SEQ, "targets": list(TARGETS), "layers": 6,
                                        "params_per_matrix": {"peft-lora-r4": 3072, "rankwise-cdka-fixed": 3072,
                                                              "rankwise-cdka-aligned": "3072 +-10%",
                                                              "peft-lokr": 3076}},
         repeats=15, warmup=2),
    Case("psoft_step_neumann", {k: _train_step(k) for k in ("peft-psoft", "rankwise-psoft", "peft-lora-r1")},
         anchor="peft-psoft", params={"batch": BATCH, "seq": SEQ, "r": 38, "neumann_terms_rankwise": 5,
                                      "num_cayley_neumann_terms_peft": 7,
                                      "params_per_matrix": {"psoft": 779, "peft-lora-r1": 768}},
         repeats=15, warmup=2),
    Case("psoft_step_exact", {k: _train_step(k) for k in ("peft-psoft-exact", "rankwise-psoft-exact")},
         anchor="peft-psoft-exact", params={"batch": BATCH, "seq": SEQ, "r": 38, "cayley": "exact"},
         repeats=15, warmup=2),
]
