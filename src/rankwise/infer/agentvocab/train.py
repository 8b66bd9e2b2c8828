"""Supervised fine-tuning on rendered trajectories and greedy tool-call decoding (spec steps 8-9).

* :func:`sft_example`: the T0 (or expanded) encoding of a rendered trajectory with labels on the tokens
  the assistant writes (their character span lies inside an assistant turn) and ``-100`` elsewhere.
* :func:`sft_train`: full fine-tuning (every parameter, new embedding / LM-head rows included) with AdamW,
  linear warm-up and cosine decay to 10 %, clipping at norm 1, ``steps`` batches of ``batch_size``
  trajectories drawn by a seeded generator. (LoRA, the paper's choice for 7B models, is an option for real
  models; the tiny model is trained fully, as the spec's update asks.)
* :func:`generate_calls`: batched greedy decoding with a KV cache (``generate``), stopping at the
  ``</tool_call>`` token; :func:`timed_call`: one batch-1 greedy decode with the KV cache, timed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rankwise.core.steps import causal_lm_step
from rankwise.infer.agentvocab.template import Rendered

__all__ = ["Decoded", "generate_calls", "sft_example", "sft_train", "timed_call"]

IGNORE = -100


def sft_example(tokenizer: Any, r: Rendered, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` (1-D, at most ``max_length`` tokens) of a rendered trajectory; a longer one keeps its
    last ``max_length`` tokens (the assistant turns are at the end; the start of the system prompt goes)."""
    enc = tokenizer(r.text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = enc["input_ids"][-max_length:]
    offsets = enc["offset_mapping"][-max_length:]
    labels = []
    spans = r.train_spans
    for tid, (a, b) in zip(ids, offsets):
        inside = any(s <= a and b <= e for s, e in spans)
        labels.append(tid if inside else IGNORE)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sft_train(model: torch.nn.Module, tokenizer: Any, rendered: Sequence[Rendered], *, steps: int, lr: float = 2e-3,
              batch_size: int = 8, max_length: int = 1024, seed: int = 0, warmup: int = 20,
              weight_decay: float = 0.0) -> list[float]:
    """Fine-tune every parameter of ``model`` on ``rendered`` (module docstring); returns the losses."""
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps}, {batch_size}")
    if not rendered:
        raise ValueError("sft_train needs at least one rendered trajectory")
    data = [sft_example(tokenizer, r, max_length) for r in rendered]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for step in range(steps):
        pick = torch.randint(0, len(data), (batch_size,), generator=gen).tolist()
        T = max(len(data[i][0]) for i in pick)
        ids = torch.full((batch_size, T), pad, dtype=torch.long)
        labels = torch.full((batch_size, T), IGNORE, dtype=torch.long)
        mask = torch.zeros((batch_size, T), dtype=torch.long)
        for row, i in enumerate(pick):
            n = len(data[i][0])
            ids[row, :n], labels[row, :n], mask[row, :n] = data[i][0], data[i][1], 1
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, min(warmup, max(1, steps // 10)))
        if not (labels[:, 1:] != IGNORE).any():
            raise ValueError(f"sft_train: batch {step} has no assistant token to train on (max_length={max_length})")
        losses.append(causal_lm_step(model, opt, ids, mask, labels, step=step, who="sft_train"))
    model.eval()
    return losses


@dataclass
class Decoded:
    """One greedy decode: the generated ids (up to and including the stop token), their text."""

    ids: list[int]
    text: str


@torch.no_grad()
def generate_calls(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], *, stop_id: int,
                   max_new_tokens: int = 96, batch_size: int = 32) -> list[Decoded]:
    """Greedy continuations of ``prompts`` (left-padded batches, KV cache), each cut after ``stop_id``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_id
    enc = tokenizer(list(prompts), add_special_tokens=False, verbose=False)["input_ids"]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    out: list[Decoded | None] = [None] * len(enc)
    model.eval()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        T = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), T), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, T - len(enc[i]):] = torch.tensor(enc[i])
            mask[row, T - len(enc[i]):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=stop_id, pad_token_id=pad)
        for row, i in enumerate(idx):
            new = gen[row, T:].tolist()
            if stop_id in new:
                new = new[:new.index(stop_id) + 1]
            out[i] = Decoded(new, tokenizer.decode(new, clean_up_tokenization_spaces=False))
    return out  # type: ignore[return-value]


@torch.no_grad()
def timed_call(model: torch.nn.Module, tokenizer: Any, prompt: str, *, stop_id: int,
               max_new_tokens: int = 96) -> tuple[Decoded, float]:
    """Batch-1 greedy decoding with the KV cache (a plain loop, the same for every tokenizer); returns the
    decode and its wall-clock seconds (prefill included)."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    past, new = out.past_key_values, []
    nxt = int(out.logits[0, -1].argmax())
    while True:
        new.append(nxt)
        if nxt == stop_id or len(new) >= max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    dt = time.perf_counter() - t0
    return Decoded(new, tokenizer.decode(new, clean_up_tokenization_spaces=False)), dt
