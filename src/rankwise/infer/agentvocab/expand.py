"""Vocabulary expansion (spec step 7): added tokens and mean-initialised embedding / LM-head rows.

Tokens are Hugging Face added tokens with ``normalized=False, special=False`` (``tokenizers``' added
vocabulary matches them on the raw text, leftmost-longest, before the BPE model sees the rest; they decode
to their own text, so ``decode(encode(s)) == s`` still holds). New ids are ``V0 .. V0+K-1`` with ``V0 =
len(tokenizer)``. Each new input-embedding row and each new LM-head row is the mean of the rows of the
token's T0 subtokens; tied weights stay tied. When the embedding matrix has padding rows (more rows than
``len(tokenizer)``, e.g. rounded up to a multiple of 64), the new tokens take rows ``V0..`` (the padding
rows are overwritten, never left to collide) and the matrix grows only if ``V0 + K`` exceeds it, rounded up
to the same multiple.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

__all__ = ["add_markers", "expand_model", "expanded_tokenizer", "subtoken_ids"]


def expanded_tokenizer(tokenizer: Any, tokens: Sequence[str]) -> Any:
    """A copy of ``tokenizer`` with ``tokens`` appended as added tokens (ids ``len(tokenizer)..``)."""
    from tokenizers import AddedToken

    if len(set(tokens)) != len(tokens):
        raise ValueError("expanded_tokenizer: the token list has duplicates")
    vocab = tokenizer.get_vocab()
    taken = [t for t in tokens if t in vocab]
    if taken:
        raise ValueError(f"expanded_tokenizer: {len(taken)} tokens are already in the vocabulary, e.g. {taken[0]!r}")
    new = copy.deepcopy(tokenizer)
    v0 = len(tokenizer)
    if tokens:
        new.add_tokens([AddedToken(t, normalized=False, special=False) for t in tokens])
    got = new.convert_tokens_to_ids(list(tokens))
    if got != list(range(v0, v0 + len(tokens))):
        raise RuntimeError("expanded_tokenizer: the tokenizer did not assign consecutive new ids")
    return new


def subtoken_ids(tokenizer: Any, tokens: Sequence[str]) -> list[list[int]]:
    """T0's encoding of each token string (no special tokens)."""
    if not tokens:
        return []
    ids = tokenizer(list(tokens), add_special_tokens=False, verbose=False)["input_ids"]
    for t, i in zip(tokens, ids):
        if not i:
            raise ValueError(f"token {t!r} encodes to nothing with the base tokenizer")
    return ids


def _pad_multiple(rows: int, vocab: int) -> int:
    if rows <= vocab:
        return 1
    for m in (128, 64, 32, 16, 8):
        if rows % m == 0:
            return m
    return 1


@torch.no_grad()
def expand_model(model: torch.nn.Module, tokenizer: Any, tokens: Sequence[str], init: str = "mean") -> dict[str, Any]:
    """Give ``model`` rows for ``tokens`` (ids ``len(tokenizer)..``), in place; ``tokenizer`` is T0.

    ``init="mean"``: each new input row (and LM-head row, and bias entry if any) is the mean of its T0
    subtokens' rows; ``"random"``: transformers' default initialisation of resized rows (a contrast).
    Returns ``{"v0", "rows", "ids", "subtokens"}``. Everything is computed before the model is touched, so
    a bad token list leaves it unchanged."""
    if init not in ("mean", "random"):
        raise ValueError(f"init must be 'mean' or 'random', got {init!r}")
    v0, k = len(tokenizer), len(tokens)
    emb = model.get_input_embeddings()
    rows = emb.weight.shape[0]
    if rows < v0:
        raise ValueError(f"the model has {rows} embedding rows for a tokenizer of {v0} tokens")
    subs = subtoken_ids(tokenizer, tokens)
    if k == 0:
        return {"v0": v0, "rows": rows, "ids": [], "subtokens": []}
    bad = [i for s in subs for i in s if i >= v0]
    if bad:
        raise ValueError(f"subtoken id {bad[0]} is outside the base vocabulary ({v0})")
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    in_rows = torch.stack([emb.weight[s].mean(0) for s in subs])
    out_rows = torch.stack([head.weight[s].mean(0) for s in subs]) if head is not None and not tied else None
    bias = getattr(head, "bias", None) if head is not None else None
    bias_rows = torch.stack([bias[s].mean() for s in subs]) if bias is not None else None
    need = v0 + k
    if need > rows:
        mult = _pad_multiple(rows, v0)
        model.resize_token_embeddings(-(-need // mult) * mult, mean_resizing=False)
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
    new = slice(v0, need)
    if init == "mean":
        emb.weight[new] = in_rows.to(emb.weight.dtype)
        if out_rows is not None:
            head.weight[new] = out_rows.to(head.weight.dtype)
        if bias_rows is not None and getattr(head, "bias", None) is not None:
            head.bias[new] = bias_rows.to(head.bias.dtype)
    return {"v0": v0, "rows": int(emb.weight.shape[0]), "ids": list(range(v0, need)), "subtokens": subs}


def add_markers(model: torch.nn.Module | None, tokenizer: Any, markers: Sequence[str]) -> tuple[Any, list[str]]:
    """Make each template marker one token (as in a chat tokenizer); returns ``(tokenizer, added)``.

    Markers that already encode to a single token are left alone; the others become added tokens with
    mean-initialised rows in ``model`` (if given). This is the template set-up shared by every arm, done
    before stage 1, not part of the mined vocabulary."""
    missing = [m for m, ids in zip(markers, subtoken_ids(tokenizer, markers)) if len(ids) != 1]
    if not missing:
        return tokenizer, []
    new = expanded_tokenizer(tokenizer, missing)
    if model is not None:
        expand_model(model, tokenizer, missing)
    return new, missing
