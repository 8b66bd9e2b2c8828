"""P2D's baselines: random / loss-based data selection, random heads, full data, and PEFT LoRA (through PEFT).

* :func:`random_data`: a seeded random ``max(1, round(fraction * N))`` of the pool.
* :func:`loss_data`: top-k by the sample's mean response cross-entropy under the model (``highest=True``:
  the perplexity-based "hard examples" selection; ``False``: the easiest).
* :func:`random_heads`: a seeded random head set of the same size as P2D's.
* full data: ``data_fraction=1`` (every sample) — no function needed.
* :func:`lora_model`: the model wrapped by ``peft.get_peft_model`` with a ``LoraConfig`` on the attention
  projections (PEFT imported inside the function).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.core.validate import check_int, check_number
from rankwise.train.p2d.heads import HeadSelection, find_attention, head_count
from rankwise.train.p2d.method import DataSelection, top_k
from rankwise.train.p2d.scoring import encode_pool, round_count, sample_losses

__all__ = ["DATA_METHODS", "loss_data", "lora_model", "random_data", "random_heads", "select"]

DATA_METHODS = ("p2d", "random", "loss")


def random_data(pool: Sequence[Any], fraction: float, seed: int = 0) -> DataSelection:
    """A seeded random ``max(1, round(fraction * N))`` of ``pool`` (affinities are the random keys)."""
    check_number("data_fraction", fraction, 0.0, 1.0, low_open=True)
    if len(pool) == 0:
        raise ValueError("the pool is empty")
    t0 = time.perf_counter()
    keys = torch.rand(len(pool), generator=torch.Generator().manual_seed(check_int("seed", seed, 0)),
                      dtype=torch.float64)
    idx = keys.argsort(descending=True)[: round_count(fraction, len(pool))].tolist()
    return DataSelection(idx, keys, "random", seconds=time.perf_counter() - t0)


def loss_data(model: nn.Module, tokenizer: Any, pool: Sequence[Any], fraction: float, highest: bool = True,
              batch_size: int = 64, max_length: int = 256, dedup: bool = True) -> DataSelection:
    """Top-k of ``pool`` by mean response cross-entropy under ``model`` (one forward per batch)."""
    if len(pool) == 0:
        raise ValueError("the pool is empty")
    t0 = time.perf_counter()
    enc = encode_pool(tokenizer, pool, max_length, dedup)
    losses = sample_losses(model, enc, batch_size)
    idx = top_k(losses, fraction, enc.keys, highest=highest)
    return DataSelection(idx, losses, "loss" if highest else "loss_low", enc.no_response, enc.duplicates,
                         seconds=time.perf_counter() - t0)


def random_heads(model_or_shape: nn.Module | tuple[int, int], fraction: float, seed: int = 0) -> HeadSelection:
    """``max(1, floor(fraction * L * H))`` heads drawn uniformly without replacement (seeded)."""
    if isinstance(model_or_shape, nn.Module):
        lay = find_attention(model_or_shape)
        shape = (len(lay), lay[0].num_heads)
    else:
        shape = tuple(model_or_shape)
    L, H = shape
    k = head_count(fraction, L * H)
    keys = torch.rand(L * H, generator=torch.Generator().manual_seed(check_int("seed", seed, 0)), dtype=torch.float64)
    mask = torch.zeros(L * H, dtype=torch.bool)
    mask[keys.argsort(descending=True)[:k]] = True
    return HeadSelection(mask.view(L, H), keys.view(L, H), {"source": "random", "head_fraction": fraction, "seed": seed})


def lora_model(model: nn.Module, rank: int = 8, alpha: float | None = None,
               target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"), seed: int = 0) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=...))``.

    PEFT draws the ``A`` factors from torch's global generator; here that draw runs on a fork of it seeded
    with ``seed``, so the adapter depends on ``seed`` only and the caller's generator is left as it was."""
    from peft import LoraConfig, get_peft_model

    check_int("rank", rank, 1)
    check_int("seed", seed, 0)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=0.0,
                     target_modules=list(target_modules), task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, cfg)


def select(model: nn.Module, tokenizer: Any, pool: Sequence[Any], method: str = "p2d",
           config: Any = None, heads: str | HeadSelection = "proxy") -> tuple[DataSelection, HeadSelection, dict[str, float]]:
    """One selection as the CLI runs it: ``(data selection, head selection, stage timings)``.

    ``method``: ``p2d`` (affinity through the heads), ``random`` or ``loss`` (highest response loss).
    ``heads``: ``"proxy"`` (P2D's probe fine-tune), ``"random"`` (same count, seeded), ``"all"``, or a
    :class:`HeadSelection` (e.g. :func:`load_heads` of an earlier run). The data fraction is
    ``config.data_fraction`` (a :class:`P2DConfig`).
    """
    from rankwise.core.validate import check_choice
    from rankwise.train.p2d.method import P2D, P2DConfig

    check_choice("method", method, DATA_METHODS)
    cfg = P2DConfig() if config is None else config
    if len(pool) == 0:
        raise ValueError("the pool is empty")
    p2d = P2D(model, tokenizer, cfg)
    if isinstance(heads, HeadSelection):
        if tuple(heads.mask.shape) != p2d.shape:
            raise ValueError(f"the head mask is {tuple(heads.mask.shape)}, the model has {p2d.shape} heads")
        p2d.heads = heads
        if cfg.affinity == "grad_cosine" and method == "p2d":
            raise ValueError("affinity grad_cosine needs the proxy's probe gradients: use heads='proxy'")
    elif heads == "proxy":
        p2d.localize_heads(p2d.probe_set(pool))
    elif heads == "random":
        p2d.heads = random_heads(p2d.shape, cfg.head_fraction, cfg.seed)
    elif heads == "all":
        L, H = p2d.shape
        p2d.heads = HeadSelection(torch.ones(L, H, dtype=torch.bool), torch.zeros(L, H, dtype=torch.float64),
                                  {"source": "all"})
    else:
        raise ValueError(f"heads must be 'proxy', 'random', 'all' or a HeadSelection, got {heads!r}")
    if method == "p2d":
        data = p2d.select_data(pool)
    elif method == "random":
        data = random_data(pool, cfg.data_fraction, cfg.seed)
    else:
        data = loss_data(model, tokenizer, pool, cfg.data_fraction, batch_size=cfg.batch_size,
                         max_length=cfg.max_length, dedup=cfg.dedup)
    timings = dict(p2d.timings)
    timings["select"] = data.seconds
    return data, p2d.heads, timings
