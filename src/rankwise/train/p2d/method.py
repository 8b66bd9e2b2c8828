"""P2D: find task-sensitive heads with a short probe fine-tune, score the pool through them, train only them.

    p2d = P2D(model, tokenizer, P2DConfig(head_fraction=0.1, data_fraction=0.1))
    probe = p2d.probe_set(pool)                  # 2 % of the pool, at most 256 samples (seeded)
    heads = p2d.localize_heads(probe)            # HeadSelection: (L, H) mask + ALPS scores
    subset = p2d.select_data(pool, heads)        # DataSelection: indices, affinities, exclusions
    with p2d.restrict_to_heads(model, heads):    # gradient masks; everything else frozen
        sft(model, tokenizer, [pool[i] for i in subset.indices], SFTConfig(weight_decay=0.0, ...))
    p2d.aer(t_proxy, t_select, t_train, t_ref)   # {"aer": ..., "speedup": ...}

Stages (spec "Method"): 1. proxy = a copy of the model fine-tuned ``proxy_steps`` AdamW steps on the
probe set, attention projections only; head score between the original and the proxy (ALPS
Wasserstein-1 by default). 2. top ``head_fraction`` of all heads. 3. affinity of each pool sample
through the selected heads of the ORIGINAL model: ``grad_norm`` (L2 norm of the restricted gradient),
``activation`` (mean norm of the heads' outputs, forward only) or ``grad_cosine`` (cosine of the
restricted gradient with the probe set's mean one). 4. top ``data_fraction`` of the pool after
removing exact repeats. ``timings`` records each stage's wall time.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive
from rankwise.train.p2d.heads import (
    HEAD_SCORES,
    HeadRestriction,
    HeadSelection,
    attention_parameters,
    find_attention,
    head_mask,
    head_scores,
    load_heads,
    restrict_to_heads,
    save_heads,
    select_heads,
)
from rankwise.train.p2d.scoring import (
    EncodedPool,
    cosine_to,
    encode_pool,
    head_activations,
    head_gradients,
    round_count,
)

__all__ = ["AFFINITIES", "DataSelection", "P2D", "P2DConfig", "aer", "top_k"]

logger = logging.getLogger(__name__)
AFFINITIES = ("grad_norm", "activation", "grad_cosine")


@dataclass(frozen=True)
class P2DConfig:
    """P2D's knobs (spec defaults; the proxy is this library's choice, see docs/methods/p2d.md).

    Attributes:
        head_fraction, data_fraction: rho_h and rho_d in (0, 1] (paper: 0.1 each).
        proxy_steps: AdamW steps of the probe fine-tune (0: no proxy; every score is 0).
        proxy_samples, proxy_fraction: the probe set is ``min(proxy_samples, max(1, ceil(proxy_fraction * N)))``
            random pool samples.
        proxy_lr, proxy_batch_size: the probe fine-tune's AdamW rate and batch.
        head_score: one of ``wasserstein`` (ALPS), ``kl``, ``js``, ``cosine``, ``update_norm``.
        affinity: ``grad_norm`` (default), ``activation`` or ``grad_cosine``.
        batch_size: samples per scoring batch; max_length: tokens per sample (longer ones are cut).
        dedup: drop exact repeats of a (prompt, completion) pair before selecting.
        seed: the probe set, the proxy's batch order.
    """

    head_fraction: float = 0.1
    data_fraction: float = 0.1
    proxy_steps: int = 50
    proxy_samples: int = 256
    proxy_fraction: float = 0.02
    proxy_lr: float = 1e-3
    proxy_batch_size: int = 16
    head_score: str = "wasserstein"
    affinity: str = "grad_norm"
    batch_size: int = 32
    max_length: int = 256
    dedup: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_number("P2DConfig.head_fraction", self.head_fraction, 0.0, 1.0, low_open=True)
        check_number("P2DConfig.data_fraction", self.data_fraction, 0.0, 1.0, low_open=True)
        check_int("P2DConfig.proxy_steps", self.proxy_steps, 0)
        check_int("P2DConfig.proxy_samples", self.proxy_samples, 1)
        check_number("P2DConfig.proxy_fraction", self.proxy_fraction, 0.0, 1.0, low_open=True)
        check_positive("P2DConfig.proxy_lr", self.proxy_lr)
        check_int("P2DConfig.proxy_batch_size", self.proxy_batch_size, 1)
        check_choice("P2DConfig.head_score", self.head_score, HEAD_SCORES)
        check_choice("P2DConfig.affinity", self.affinity, AFFINITIES)
        check_int("P2DConfig.batch_size", self.batch_size, 1)
        check_int("P2DConfig.max_length", self.max_length, 2)
        check_bool("P2DConfig.dedup", self.dedup)
        check_int("P2DConfig.seed", self.seed, 0)


@dataclass
class DataSelection:
    """The selected pool indices (best first) and the per-sample affinities behind them.

    ``affinities[i]`` is NaN for a sample that was excluded: ``no_response`` (no response token),
    ``duplicates`` (an exact repeat), ``nonfinite`` (count of NaN/inf gradients or scores).
    """

    indices: list[int]
    affinities: torch.Tensor
    method: str
    no_response: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    nonfinite: int = 0
    seconds: float = 0.0

    def report(self) -> dict[str, Any]:
        return {"method": self.method, "selected": len(self.indices), "pool": int(self.affinities.numel()),
                "excluded_no_response": len(self.no_response), "excluded_duplicates": len(self.duplicates),
                "excluded_nonfinite": self.nonfinite, "seconds": self.seconds}


def top_k(scores: torch.Tensor, fraction: float, keys: Sequence[Any] | None = None, highest: bool = True) -> list[int]:
    """Indices of the ``max(1, round(fraction * N))`` best finite scores (N = all samples, NaN included),
    best first; ties broken by ``keys`` (e.g. the sample text, so the result does not depend on the pool's
    order) and then by index."""
    check_number("data_fraction", fraction, 0.0, 1.0, low_open=True)
    n = int(scores.numel())
    if n == 0:
        raise ValueError("the pool is empty")
    finite = [i for i in range(n) if torch.isfinite(scores[i])]
    if not finite:
        raise ValueError("no sample has a finite score (every sample was excluded)")
    k = min(round_count(fraction, n), len(finite))
    sign = -1.0 if highest else 1.0
    key = (lambda i: (sign * float(scores[i]), keys[i], i)) if keys is not None else (lambda i: (sign * float(scores[i]), i))
    return sorted(finite, key=key)[:k]


def aer(t_proxy: float, t_select: float, t_train: float, t_ref: float) -> dict[str, float]:
    """Alignment Efficiency Ratio ``(T_proxy + T_select + T_train) / T_ref`` (lower is better) and its inverse,
    the end-to-end speedup (this library's definition; the paper's formula was not recovered)."""
    for name, t in (("t_proxy", t_proxy), ("t_select", t_select), ("t_train", t_train)):
        check_number(name, t, 0.0)
    check_positive("t_ref", t_ref)
    total = t_proxy + t_select + t_train
    r = total / t_ref
    return {"aer": r, "speedup": (t_ref / total) if total > 0 else float("inf"), "t_proxy": t_proxy,
            "t_select": t_select, "t_train": t_train, "t_ref": t_ref, "t_total": total}


class P2D:
    """The P2D pipeline on one causal LM and its tokenizer (see the module docstring)."""

    def __init__(self, model: nn.Module, tokenizer: Any, config: P2DConfig | None = None, **overrides: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if config is None:
            config = P2DConfig(**overrides)
        elif not isinstance(config, P2DConfig):
            raise TypeError(f"config must be a P2DConfig, got {type(config).__name__}")
        elif overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.layouts = find_attention(model)
        H = self.layouts[0].num_heads
        if any(lay.num_heads != H for lay in self.layouts):
            raise ValueError("P2D needs the same number of heads in every attention layer")
        self.shape = (len(self.layouts), H)
        self.timings: dict[str, float] = {}
        self.heads: HeadSelection | None = None
        self._probe_grad: torch.Tensor | None = None

    # -- stage 1 and 2 ------------------------------------------------------------------------------

    def probe_set(self, pool: Sequence[Any]) -> list[Any]:
        """A seeded random ``min(proxy_samples, max(1, ceil(proxy_fraction * N)))`` of ``pool``."""
        if len(pool) == 0:
            raise ValueError("the pool is empty")
        c = self.config
        n = min(c.proxy_samples, max(1, math.ceil(c.proxy_fraction * len(pool) - 1e-9)), len(pool))
        idx = torch.randperm(len(pool), generator=torch.Generator().manual_seed(c.seed))[:n].tolist()
        return [pool[i] for i in idx]

    def proxy(self, probe: Sequence[Any]) -> nn.Module:
        """A copy of the model fine-tuned ``proxy_steps`` steps on ``probe``, attention projections only."""
        from rankwise.train.sft import SFTConfig, SFTTrainer, make_sft_batches

        if len(probe) == 0:
            raise ValueError("the probe set is empty")
        c = self.config
        twin = copy.deepcopy(self.model)
        if c.proxy_steps == 0:
            return twin
        attn = {id(p) for p in attention_parameters(twin)}
        for p in twin.parameters():
            p.requires_grad_(id(p) in attn)
        cfg = SFTConfig(lr=c.proxy_lr, steps=c.proxy_steps, batch_size=c.proxy_batch_size, max_length=c.max_length,
                        weight_decay=0.0, seed=c.seed)
        trainer = SFTTrainer(twin, cfg)
        for b in make_sft_batches(self.tokenizer, probe, cfg):
            trainer.step(b)
        return twin.eval()

    def localize_heads(self, probe: Sequence[Any]) -> HeadSelection:
        """Stages 1-2: the proxy's head scores and the top ``head_fraction`` heads (also kept as ``self.heads``)."""
        t0 = time.perf_counter()
        twin = self.proxy(probe)
        scores = head_scores(self.model, twin, self.config.head_score)
        chosen = select_heads(scores, self.config.head_fraction)
        self.heads = HeadSelection(head_mask(chosen, *self.shape), scores,
                                   {"head_score": self.config.head_score, "head_fraction": self.config.head_fraction,
                                    "proxy_steps": self.config.proxy_steps, "probe_samples": len(probe),
                                    "source": "p2d-proxy"})
        if self.config.affinity == "grad_cosine":
            enc = encode_pool(self.tokenizer, probe, self.config.max_length, dedup=False)
            vec, _ = head_gradients(self.model, enc, self.heads.mask, self.config.batch_size, reduce="vector")
            ok = torch.isfinite(vec).all(1)
            if not ok.any():
                raise ValueError("no probe sample has a finite gradient through the selected heads")
            self._probe_grad = vec[ok].mean(0)
        self.timings["proxy"] = time.perf_counter() - t0
        return self.heads

    # -- stage 3 and 4 ------------------------------------------------------------------------------

    def _mask(self, heads: HeadSelection | torch.Tensor | Sequence[tuple[int, ...]] | None) -> torch.Tensor:
        if heads is None:
            if self.heads is None:
                raise ValueError("no heads: call localize_heads() first or pass heads")
            heads = self.heads
        if isinstance(heads, HeadSelection):
            return heads.mask
        if isinstance(heads, torch.Tensor):
            return heads.bool()
        return head_mask(heads, *self.shape)

    def affinities(self, pool: Sequence[Any], heads: Any = None) -> tuple[torch.Tensor, EncodedPool, int]:
        """``(affinities (N,), encoded pool, non-finite count)`` of every pool sample through ``heads``."""
        if len(pool) == 0:
            raise ValueError("the pool is empty")
        c = self.config
        mask = self._mask(heads)
        enc = encode_pool(self.tokenizer, pool, c.max_length, c.dedup)
        if enc.no_response:
            warnings.warn(f"{len(enc.no_response)} pool sample(s) have no response token; their affinity is undefined "
                          "and they are excluded", RuntimeWarning, stacklevel=2)
        bad = 0
        if c.affinity == "grad_norm":
            a, bad = head_gradients(self.model, enc, mask, c.batch_size)
        elif c.affinity == "activation":
            a = head_activations(self.model, enc, mask, c.batch_size)
        else:
            if self._probe_grad is None:
                raise ValueError("affinity='grad_cosine' needs the probe gradient: call localize_heads() first")
            vec, bad = head_gradients(self.model, enc, mask, c.batch_size, reduce="vector")
            a = cosine_to(vec, self._probe_grad)
        valid = torch.tensor(enc.valid)
        nonfinite = int((valid & ~torch.isfinite(a)).sum())
        return a, enc, max(bad, nonfinite)

    def select_data(self, pool: Sequence[Any], heads: Any = None) -> DataSelection:
        """Stages 3-4: the top ``data_fraction`` of ``pool`` by affinity through ``heads`` (default: the localised
        ones). The ranking does not depend on the pool's order (ties broken by the sample's text)."""
        t0 = time.perf_counter()
        a, enc, bad = self.affinities(pool, heads)
        if bad:
            logger.warning("%d pool sample(s) had a non-finite gradient or score and are excluded", bad)
        idx = top_k(a, self.config.data_fraction, enc.keys)
        sel = DataSelection(idx, a, self.config.affinity, enc.no_response, enc.duplicates, bad)
        sel.seconds = self.timings["select"] = time.perf_counter() - t0
        return sel

    # -- stage 5, AER, persistence ---------------------------------------------------------------------

    @staticmethod
    def restrict_to_heads(model: nn.Module, heads: HeadSelection | torch.Tensor | Sequence[tuple[int, ...]]
                          ) -> HeadRestriction:
        """:func:`~rankwise.train.p2d.heads.restrict_to_heads` (accepts a :class:`HeadSelection`)."""
        return restrict_to_heads(model, heads.mask if isinstance(heads, HeadSelection) else heads)

    @staticmethod
    def aer(t_proxy: float, t_select: float, t_train: float, t_ref: float) -> dict[str, float]:
        return aer(t_proxy, t_select, t_train, t_ref)

    def save_heads(self, path: str | Path, heads: HeadSelection | None = None) -> Path:
        sel = heads if heads is not None else self.heads
        if sel is None:
            raise ValueError("no heads to save: call localize_heads() first")
        return save_heads(path, sel)

    def load_heads(self, path: str | Path) -> HeadSelection:
        """Load a saved head mask for this model (its (L, H) must match); it becomes ``self.heads``."""
        self.heads = load_heads(path, *self.shape)
        return self.heads
