"""rankwise LoRA vs PEFT LoRA on the real all-MiniLM-L6-v2 (anchor: PEFT).

Four cases, each rankwise vs PEFT at the same rank (8), alpha (16), dropout (0) and targets, the
classification head trainable in both (PEFT ``task_type="SEQ_CLS"`` puts it in ``modules_to_save``;
rankwise unfreezes it), on a batch of 16 sequences x 64 tokens (fixed random token ids):

* ``forward_qv`` / ``forward_all``: inference forward (eval mode, ``torch.no_grad``), LoRA on
  ``query``/``value`` / on every Linear of the encoder (``query``, ``key``, ``value``, ``dense``:
  attention output, FFN in/out, and the pooler; 37 layers);
* ``train_step_qv`` / ``train_step_all``: one training step in train mode: forward, cross-entropy,
  backward, ``torch.optim.AdamW`` step, ``zero_grad``.

Both libraries are timed alternately in one process (benchmarks/harness.py), so machine drift hits
both alike; ``ratio_vs_anchor`` < 1 means rankwise is faster. Run:
``python -m benchmarks.run lora`` (about 1-3 minutes on 2 free cores; ``--no-memory`` skips the
per-implementation memory subprocesses).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case

BATCH, SEQ, RANK, ALPHA = 16, 64, 8, 16.0
TARGETS: dict[str, tuple[str, ...]] = {"qv": ("query", "value"), "all": ("query", "key", "value", "dense")}


def _inputs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (BATCH, SEQ), generator=g)
    ids[:, 0] = 101  # [CLS]
    ids[:, -1] = 102  # [SEP]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    return inputs, torch.randint(0, 2, (BATCH,), generator=g)


def _model(impl: str, targets: tuple[str, ...]) -> torch.nn.Module:
    from rankwise import zoo

    model, _ = zoo.minilm_classifier(2, seed=0)
    if impl == "rankwise":
        from rankwise.adapt import lora

        lora.adapt(model, lora.LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0, target=targets, seed=0))
        for p in model.classifier.parameters():
            p.requires_grad_(True)
        return model
    import peft

    cfg = peft.LoraConfig(task_type="SEQ_CLS", r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                          target_modules=list(targets))
    return peft.get_peft_model(model, cfg)


def _forward(impl: str, targets: tuple[str, ...]) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        model = _model(impl, targets).eval()
        inputs, _ = _inputs()

        def run() -> Any:
            with torch.no_grad():
                return model(**inputs).logits
        return run
    return factory


def _train_step(impl: str, targets: tuple[str, ...]) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        model = _model(impl, targets).train()
        inputs, labels = _inputs()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def run() -> float:
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return run
    return factory


def _params(kind: str, targets: str) -> dict[str, Any]:
    return {"model": "all-MiniLM-L6-v2 (BertForSequenceClassification, 2 labels)", "batch": BATCH, "seq": SEQ,
            "rank": RANK, "alpha": ALPHA, "targets": list(TARGETS[targets]), "kind": kind,
            "threads": torch.get_num_threads()}


CASES = [
    Case(f"{kind}_{t}",
         impls={"rankwise": make("rankwise", TARGETS[t]), "peft": make("peft", TARGETS[t])},
         anchor="peft", params=_params(kind, t), repeats=reps, warmup=2)
    for kind, make, reps in (("forward", _forward, 15), ("train_step", _train_step, 12))
    for t in ("qv", "all")
]
