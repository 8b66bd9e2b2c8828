"""What the adapter benchmarks share: MiniLM + mean pooling + a linear head, a fixed random batch, and
the timed training step (forward, cross-entropy, backward, optimizer step, ``zero_grad``).

The model is the real all-MiniLM-L6-v2 (:func:`rankwise.zoo.minilm`), or with ``tiny=True`` a random
two-layer BERT of hidden size 32 for smoke runs; the head has 4 classes and is initialised under seed 0
after the encoder is loaded. Batches are ``BATCH x SEQ`` random token ids in MiniLM's word-piece range
framed by ``[CLS]`` / ``[SEP]``, with random labels, all from ``torch.Generator().manual_seed(0)``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Classifier", "base", "batch", "ce_loss", "head_on", "step_factory"]


class Classifier(nn.Module):
    """A BERT encoder + mean pooling over the attention mask + a linear head (4 classes)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert
        self.classifier = nn.Linear(bert.config.hidden_size, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        w = attention_mask[..., None].to(h.dtype)
        return self.classifier((h * w).sum(1) / w.sum(1))


@functools.lru_cache(maxsize=2)
def base(tiny: bool = False) -> Classifier:
    """The shared base model (callers deep-copy it before adapting)."""
    if tiny:
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, vocab_size=30522))
    else:
        from rankwise import zoo

        bert, _ = zoo.minilm()
    torch.manual_seed(0)
    return Classifier(bert)


def batch(n: int, seq: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(inputs, labels)``: ``n`` sequences of ``seq`` random word-piece ids and 4-class labels (seed 0)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (n, seq), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 4, (n,), generator=g)


def ce_loss(model: nn.Module, b: Any) -> torch.Tensor:
    """Cross-entropy of ``model`` on a batch from :func:`batch` (the calibration loss of adapters)."""
    return nn.functional.cross_entropy(model(**b[0]), b[1])


def head_on(model: nn.Module) -> nn.Module:
    """Make the classification head trainable (adapter injection freezes everything else)."""
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    return model


def step_factory(build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], b: Callable[[], Any]
                 ) -> Callable[[], Callable[[], float]]:
    """A benchmark case factory: builds ``(model, optimizer)`` once, then each call of the returned
    function runs one training step on the batch ``b()`` and returns the loss."""
    def factory() -> Callable[[], float]:
        model, opt = build()
        model.train()
        inputs, labels = b()

        def run() -> float:
            loss = nn.functional.cross_entropy(model(**inputs), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return run
    return factory
