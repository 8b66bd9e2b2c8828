"""Prompt-completion batches for causal-LM training, shared by the SFT loop (``train.sft``) and the zoo's
warm-up builds (``zoo.warm``).

A pair is tokenized as ``ids(prompt) + ids(completion) + [eos]`` (no other special tokens; the prompt
and completion are tokenized separately, so the boundary is exact whatever the tokenizer). Labels
copy the ids, with the prompt positions (``mask_prompt=True``) and the right padding set to
``IGNORE_INDEX``; the model shifts them (``labels[:, 1:]`` against ``logits[:, :-1]``), as Hugging
Face causal LMs and TRL do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["IGNORE_INDEX", "LMBatch", "collate", "encode_pair"]

IGNORE_INDEX = -100


@dataclass
class LMBatch:
    """``input_ids``, ``attention_mask``, ``labels`` (all ``(B, T)``) and ``prompt_lens`` ``(B,)``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    prompt_lens: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


def encode_pair(tokenizer: Any, prompt: str, completion: str, add_eos: bool = True) -> tuple[list[int], int]:
    """``(ids, prompt_len)``: the prompt's ids, then the completion's, then EOS (``add_eos``)."""
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise TypeError(f"prompt and completion must be str, got {type(prompt).__name__}, "
                        f"{type(completion).__name__}")
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; pass add_eos=False or set tokenizer.eos_token")
        c = c + [tokenizer.eos_token_id]
    if not c:
        raise ValueError(f"empty completion for prompt {prompt!r:.60}: nothing to train on")
    return list(p) + list(c), len(p)


def collate(encoded: Sequence[tuple[list[int], int]], pad_id: int, mask_prompt: bool = True,
            max_length: int | None = None) -> LMBatch:
    """Right-pad encoded pairs to the longest (truncated at ``max_length``) into an :class:`LMBatch`."""
    if not encoded:
        raise ValueError("collate() needs at least one example")
    seqs = [ids[:max_length] if max_length else ids for ids, _ in encoded]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        att[i, :len(s)] = 1
    labels = ids.masked_fill(att == 0, IGNORE_INDEX)
    plen = torch.tensor([min(p, T) for _, p in encoded], dtype=torch.long)
    if mask_prompt:
        labels = labels.masked_fill(torch.arange(T)[None, :] < plen[:, None], IGNORE_INDEX)
    return LMBatch(ids, att, labels, plen)
