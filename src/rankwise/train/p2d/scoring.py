"""Per-sample data scores through a set of attention heads: gradient norms, gradients, activations, losses.

Every score works on batches of a pool of prompt-completion pairs (right-padded, the prompt masked) and
returns one value (or vector) per sample; samples of one batch never interact (causal LM, attention
mask), so batching gives the same numbers as one sample at a time up to float rounding.

Per-sample gradients restricted to the selected heads are computed in one backward per batch, without
materialising the model's gradient: for a linear map ``y = x W^T`` the gradient of sample ``b``'s loss
is ``sum_t g_{b,t} x_{b,t}^T`` (``g = dL_b/dy``, captured by a hook on the output), and only its rows
(Q/K/V: the head's output features) or columns (O: the head's input features) are formed.
The sample loss is the mean token cross-entropy of its response (completion + EOS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.core.lmdata import IGNORE_INDEX, LMBatch, collate
from rankwise.train.p2d.heads import AttentionLayout, find_attention
from rankwise.train.sft import pairs_of

__all__ = ["EncodedPool", "encode_pool", "sample_losses", "head_gradients", "head_activations"]


@dataclass
class EncodedPool:
    """Token ids of a pool; ``valid[i]`` is False for a sample with no response token (or a duplicate)."""

    encoded: list[tuple[list[int], int]]
    valid: list[bool]
    keys: list[tuple[str, str]]
    no_response: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    pad_id: int = 0
    max_length: int = 256

    def __len__(self) -> int:
        return len(self.encoded)

    def batches(self, batch_size: int, only_valid: bool = True) -> list[tuple[list[int], LMBatch]]:
        idx = [i for i in range(len(self)) if self.valid[i] or not only_valid]
        return [(idx[s:s + batch_size], collate([self.encoded[i] for i in idx[s:s + batch_size]], self.pad_id, True,
                                                self.max_length)) for s in range(0, len(idx), batch_size)]


def encode_pool(tokenizer: Any, pool: Sequence[Any], max_length: int = 256, dedup: bool = True) -> EncodedPool:
    """Encode ``pool`` (``.prompt``/``.completion`` objects or pairs); flags empty responses and repeats.

    A sample whose completion has no token, or whose completion is cut away by ``max_length``, has no
    response token: its affinity is undefined. With ``dedup`` the second and later copies of an exact
    ``(prompt, completion)`` repeat are flagged too.
    """
    pairs = pairs_of(pool)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None or tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer needs an EOS token (and a pad token, or EOS to pad with)")
    out = EncodedPool([], [], pairs, pad_id=pad, max_length=max_length)
    seen: set[tuple[str, str]] = set()
    for i, (p, c) in enumerate(pairs):
        if not isinstance(p, str) or not isinstance(c, str):
            raise TypeError(f"pool[{i}]: prompt and completion must be str")
        pi = tokenizer(p, add_special_tokens=False)["input_ids"]
        ci = tokenizer(c, add_special_tokens=False)["input_ids"] if c.strip() else []
        ok = bool(ci) and len(pi) < max_length
        out.encoded.append((list(pi) + list(ci) + [tokenizer.eos_token_id], len(pi)))
        if not ok:
            out.no_response.append(i)
        elif dedup and (p, c) in seen:
            out.duplicates.append(i)
            ok = False
        seen.add((p, c))
        out.valid.append(ok)
    return out


def _device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters())).device


def _token_ce(model: nn.Module, batch: LMBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, mask)``, both ``(B, T-1)``: per-token cross-entropy of the response and its mask."""
    dev = _device(model)
    logits = model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev)).logits[:, :-1]
    labels = batch.labels[:, 1:].to(dev)
    mask = labels != IGNORE_INDEX
    ce = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                     labels.masked_fill(~mask, 0).reshape(-1), reduction="none").view(labels.shape)
    return ce * mask, mask


def _sample_mean(ce: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ce.sum(1) / mask.sum(1).clamp(min=1)


@torch.no_grad()
def sample_losses(model: nn.Module, enc: EncodedPool, batch_size: int = 64) -> torch.Tensor:
    """``(N,)`` float64 mean response cross-entropy of each sample (NaN for invalid samples)."""
    out = torch.full((len(enc),), float("nan"), dtype=torch.float64)
    was = model.training
    model.eval()
    try:
        for idx, b in enc.batches(batch_size):
            out[idx] = _sample_mean(*_token_ce(model, b)).double().cpu()
    finally:
        model.train(was)
    return out


@dataclass
class _Slices:
    """What of one module's weight the selected heads own: output rows ``rows`` (or all) x input cols ``cols``."""

    module: nn.Module
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    conv1d: bool
    bias: bool


def _head_index(heads: Sequence[int], d: int, offset: int = 0) -> torch.Tensor:
    return torch.cat([torch.arange(offset + h * d, offset + (h + 1) * d) for h in heads])


def _slices(layout: AttentionLayout, sel: torch.Tensor) -> list[_Slices]:
    heads = sel.nonzero().flatten().tolist()
    if not heads:
        return []
    d = layout.head_dim
    groups = sorted({h // layout.group for h in heads})
    q_rows, kv_rows = _head_index(heads, d), _head_index(groups, d)
    if layout.fused:
        D = layout.num_heads * d
        rows = torch.cat([q_rows, kv_rows + D, kv_rows + 2 * D])
        return [_Slices(layout.q, rows, None, True, layout.q.bias is not None),
                _Slices(layout.o, None, q_rows, True, False)]
    return [_Slices(layout.q, q_rows, None, False, layout.q.bias is not None),
            _Slices(layout.k, kv_rows, None, False, layout.k.bias is not None),
            _Slices(layout.v, kv_rows, None, False, layout.v.bias is not None),
            _Slices(layout.o, None, q_rows, False, False)]


def head_gradients(model: nn.Module, enc: EncodedPool, mask: torch.Tensor, batch_size: int = 32,
                   reduce: str = "norm") -> tuple[torch.Tensor, int]:
    """Per-sample gradients of the response loss w.r.t. the selected heads' slices (spec step 3).

    ``mask``: ``(L, H)`` bool heads. ``reduce="norm"``: ``(N,)`` L2 norms (float64); ``"vector"``: ``(N, n_S)``
    float32 gradient vectors. Invalid samples and samples whose gradient is not finite are NaN; the
    second return value counts the non-finite ones. The model's parameters and ``.grad`` are untouched.
    """
    layouts = find_attention(model)
    if tuple(mask.shape) != (len(layouts), layouts[0].num_heads):
        raise ValueError(f"head mask must be shaped ({len(layouts)}, {layouts[0].num_heads}), got {tuple(mask.shape)}")
    slices = [s for lay, row in zip(layouts, mask.bool().cpu()) for s in _slices(lay, row)]
    if not slices:
        raise ValueError("no head selected")
    dev = _device(model)
    store: dict[int, list[torch.Tensor]] = {}

    def hook(i: int) -> Any:
        def fwd(mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
            store[i] = [inp[0].detach()]
            out.register_hook(lambda g: store[i].append(g.detach()))
        return fwd

    weights = [s.module.weight for s in slices]
    prev = {p: p.requires_grad for p in model.parameters()}
    handles = [s.module.register_forward_hook(hook(i)) for i, s in enumerate(slices)]
    width = None
    n = len(enc)
    norms = torch.full((n,), float("nan"), dtype=torch.float64)
    vectors: torch.Tensor | None = None
    bad = 0
    was = model.training
    model.eval()
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in weights:
            w.requires_grad_(True)
        for idx, b in enc.batches(batch_size):
            store.clear()
            ce, m = _token_ce(model, b)
            total = _sample_mean(ce, m).sum()
            torch.autograd.grad(total, list(dict.fromkeys(weights)), allow_unused=True)
            parts = []
            for i, s in enumerate(slices):
                x, g = store[i]  # (B, T, in), (B, T, out) of the module as written: Linear or Conv1D
                if s.rows is not None:
                    g = g[..., s.rows.to(dev)]
                if s.cols is not None:
                    x = x[..., s.cols.to(dev)]
                parts.append(torch.einsum("bto,bti->boi", g.float(), x.float()).flatten(1))
                if s.bias and s.rows is not None:
                    parts.append(g.float().sum(1))
            vec = torch.cat(parts, 1)
            finite = torch.isfinite(vec).all(1).cpu()
            bad += int((~finite).sum())
            nv = vec.double().norm(dim=1).cpu()
            nv[~finite] = float("nan")
            norms[idx] = nv
            if reduce == "vector":
                if vectors is None:
                    width = vec.shape[1]
                    vectors = torch.full((n, width), float("nan"), dtype=torch.float32)
                v = vec.cpu()
                v[~finite] = float("nan")
                vectors[idx] = v
    finally:
        for h in handles:
            h.remove()
        for p, flag in prev.items():
            p.requires_grad_(flag)
        model.train(was)
    if reduce == "vector":
        return (vectors if vectors is not None else torch.empty(n, 0)), bad
    return norms, bad


@torch.no_grad()
def head_activations(model: nn.Module, enc: EncodedPool, mask: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """``(N,)`` mean L2 norm of the selected heads' outputs ``o_h = z_h W_o[:, h]^T`` over the response tokens
    and the selected heads (forward only; NaN for invalid samples)."""
    layouts = find_attention(model)
    sel = mask.bool().cpu()
    store: dict[int, torch.Tensor] = {}
    handles = []
    for l, lay in enumerate(layouts):
        if sel[l].any():
            handles.append(lay.o.register_forward_hook(
                lambda mod, inp, out, l=l: store.__setitem__(l, inp[0].detach())))
    out = torch.full((len(enc),), float("nan"), dtype=torch.float64)
    was = model.training
    model.eval()
    try:
        for idx, b in enc.batches(batch_size):
            store.clear()
            _, m = _token_ce(model, b)
            resp = torch.nn.functional.pad(m, (1, 0)).float()  # response token positions (labels != -100)
            acc = torch.zeros(len(idx), dtype=torch.float64, device=resp.device)
            count = 0
            for l, z in store.items():
                lay, d = layouts[l], layouts[l].head_dim
                W = lay.o.weight if lay.fused else lay.o.weight.T  # (H*d, hidden)
                for h in sel[l].nonzero().flatten().tolist():
                    o = z[..., h * d:(h + 1) * d] @ W[h * d:(h + 1) * d]
                    acc += ((o.norm(dim=-1) * resp).sum(1) / resp.sum(1).clamp(min=1)).double()
                    count += 1
            out[idx] = (acc / max(count, 1)).cpu()
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return out


def cosine_to(vectors: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``(N,)`` cosine of each row with ``reference`` (float64; NaN rows stay NaN)."""
    v = vectors.double()
    r = reference.double()
    return (v @ r) / (v.norm(dim=1) * r.norm()).clamp_min(1e-30)


def round_count(fraction: float, n: int) -> int:
    """``max(1, round(fraction * n))`` with halves rounded up."""
    return max(1, int(math.floor(fraction * n + 0.5)))
