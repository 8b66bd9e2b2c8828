"""STAR-KV on a whole causal LM: wrap, three-phase distillation, fold/freeze, accounting, save/load.

``star_kv_wrap`` swaps ``k_proj`` (per KV head) and ``v_proj`` (joint) of the compressed layers for
:class:`~rankwise.compress.star_kv.layers.ThresholdedProj`; ``star_kv_train`` runs phases 1 and 2;
``star_kv_freeze`` folds them into :class:`~rankwise.compress.star_kv.layers.LatentProj` (phase 3 is
:func:`kd_finetune` of the folded factors); :func:`star_kv_compress` does all of it. ``lowrank_kv`` builds
the fixed-rank baselines (uniform, energy) from the same decompositions.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.compress.star_kv.config import StarKVConfig
from rankwise.compress.star_kv.layers import LatentProj, ThresholdedProj

Tensor = torch.Tensor
logger = logging.getLogger(__name__)

__all__ = ["AttentionSite", "attention_sites", "star_kv_wrap", "star_kv_train", "star_kv_freeze", "kd_finetune",
           "star_kv_compress", "StarKVReport", "TrainLog", "kv_accounting", "rank_table", "lowrank_kv",
           "uniform_plan", "energy_plan", "spectra", "kd_loss"]

_FUSED = ("c_attn", "qkv_proj", "Wqkv", "query_key_value", "qkv")


@dataclass
class AttentionSite:
    """One attention module with separate ``k_proj`` / ``v_proj``."""

    layer: int
    name: str
    attn: nn.Module
    kv_heads: int
    head_dim: int

    @property
    def k_groups(self) -> int:
        return self.kv_heads


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model`` with ``k_proj`` and ``v_proj`` attributes, in layer order.

    Raises ``TypeError`` for models without them (a fused GPT-2 ``c_attn`` included). A ``k_proj`` whose
    output is not ``kv_heads x head_dim`` falls back to one group (joint K decomposition), with a warning.
    """
    cfg = getattr(model, "config", None)
    sites: list[AttentionSite] = []
    for name, mod in model.named_modules():
        k, v = getattr(mod, "k_proj", None), getattr(mod, "v_proj", None)
        if not (isinstance(k, (nn.Linear, ThresholdedProj, LatentProj)) and v is not None):
            continue
        acfg = getattr(mod, "config", cfg)
        heads = getattr(acfg, "num_key_value_heads", None) or getattr(acfg, "num_attention_heads", None) or 1
        hd = getattr(mod, "head_dim", None) or k.out_features // heads
        if heads * hd != k.out_features:
            warnings.warn(f"STAR-KV: {name}.k_proj has {k.out_features} outputs, not {heads} heads x {hd}; "
                          "decomposing K jointly", RuntimeWarning, stacklevel=2)
            heads, hd = 1, k.out_features
        sites.append(AttentionSite(getattr(mod, "layer_idx", len(sites)), name, mod, int(heads), int(hd)))
    if not sites:
        fused = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in _FUSED]
        what = (f"it has a fused query/key/value projection ({fused[0]!r}, GPT-2 style)" if fused
                else "it has no attention module with separate k_proj / v_proj linear layers")
        raise TypeError(f"STAR-KV cannot compress {type(model).__name__}: {what}; it needs Llama-style "
                        "k_proj and v_proj")
    return sorted(sites, key=lambda s: s.layer)


def star_kv_wrap(model: nn.Module, cfg: StarKVConfig) -> list[AttentionSite]:
    """Replace K / V projections of the compressed layers by thresholded factors, in place.

    Every other parameter is frozen (``requires_grad=False``). All layers are built before any is
    swapped, so a failure leaves the model unchanged. Returns the compressed sites.
    """
    sites = attention_sites(model)
    skip = cfg.skipped(len(sites))
    chosen = [s for s in sites if s.layer not in skip]
    if not chosen:
        raise ValueError(f"STAR-KV: every layer is skipped (skip_layers={cfg.skip_layers}, {len(sites)} layers)")
    built = []
    for s in chosen:
        k, v = s.attn.k_proj, s.attn.v_proj
        if not (isinstance(k, nn.Linear) and isinstance(v, nn.Linear)):
            raise TypeError(f"{s.name}: k_proj / v_proj are already compressed ({type(k).__name__})")
        built.append((ThresholdedProj(k, s.kv_heads, cfg.sharpness, cfg.c),
                      ThresholdedProj(v, 1, cfg.sharpness, cfg.c)))
    model.requires_grad_(False)
    for s, (k, v) in zip(chosen, built):
        s.attn.k_proj, s.attn.v_proj = k, v
    return chosen


# ----------------------------------------------------------------------------------------------
# accounting


def _ranks(mod: nn.Module, groups: int, d: int) -> list[int]:
    if isinstance(mod, (ThresholdedProj,)):
        return mod.ranks()
    if isinstance(mod, LatentProj):
        return list(mod.ranks)
    return [d] * groups


def rank_table(model: nn.Module) -> list[dict[str, Any]]:
    """One row per layer: ``layer``, ``k`` (rank per KV head), ``v`` (joint rank), ``full_k`` (head_dim),
    ``full_v`` (kv_heads x head_dim), ``compressed``."""
    rows = []
    for s in attention_sites(model):
        k, v = s.attn.k_proj, s.attn.v_proj
        rows.append({"layer": s.layer, "k": _ranks(k, s.kv_heads, s.head_dim),
                     "v": _ranks(v, 1, s.kv_heads * s.head_dim)[0] if not isinstance(v, nn.Linear)
                     else s.kv_heads * s.head_dim,
                     "full_k": s.head_dim,
                     "full_v": v.out_features, "kv_heads": s.kv_heads, "in": k.in_features,
                     "compressed": not isinstance(k, nn.Linear)})
    return rows


def kv_accounting(model: nn.Module) -> dict[str, float]:
    """Cache and parameter measures of the K / V compression.

    * ``cache_removed_k`` / ``_v``: ``1 - sum_h r_h / (H d_h)`` and ``1 - r_V / (H d_h)`` over the compressed
      layers (the spec's cache-element measure);
    * ``param_removed_k`` / ``_v``: ``1 - sum (in + out_g) r_g / (in out)`` over the compressed layers,
      capped at full size per group (the official code's measure, which phase 1's targets use);
    * ``cache_kept``: cached K/V elements per token over the whole model (uncompressed layers count in
      full) / the uncompressed model's; ``cache_removed``: ``1 - cache_kept`` over the compressed layers.
    """
    kept = full = kept_c = full_c = 0
    ck = fk = cv = fv = 0.0
    pk = pfk = pv = pfv = 0.0
    for r in rank_table(model):
        fk_l, fv_l = r["kv_heads"] * r["full_k"], r["full_v"]
        kk, vv = sum(r["k"]), r["v"]
        kept += kk + vv
        full += fk_l + fv_l
        if not r["compressed"]:
            continue
        kept_c += kk + vv
        full_c += fk_l + fv_l
        ck, fk, cv, fv = ck + kk, fk + fk_l, cv + vv, fv + fv_l
        n = r["in"]
        pk += sum(min((n + r["full_k"]) * x, n * r["full_k"]) for x in r["k"])
        pfk += n * fk_l
        pv += min((n + fv_l) * vv, n * fv_l)
        pfv += n * fv_l
    out = {"cache_kept": kept / full, "cache_removed": 1 - kept_c / full_c if full_c else 0.0,
           "cache_removed_k": 1 - ck / fk if fk else 0.0, "cache_removed_v": 1 - cv / fv if fv else 0.0,
           "param_removed_k": 1 - pk / pfk if pfk else 0.0, "param_removed_v": 1 - pv / pfv if pfv else 0.0,
           "cache_elements": float(kept), "cache_elements_full": float(full)}
    return out


# ----------------------------------------------------------------------------------------------
# distillation


def kd_loss(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """``KL(p_teacher || p_student)`` of the next-token distributions, mean over tokens."""
    ls = F.log_softmax(student_logits.float().flatten(0, -2), -1)
    lt = F.log_softmax(teacher_logits.float().flatten(0, -2), -1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


def _batches(data: Sequence[Tensor], seed: int) -> Iterable[Tensor]:
    """Endless seeded passes over ``data`` (a fresh permutation per pass)."""
    if not len(data):
        raise ValueError("STAR-KV needs at least one batch of token ids")
    g = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(len(data), generator=g).tolist():
            yield data[i]


def _ids(batch: Any) -> Tensor:
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    if not isinstance(ids, Tensor) or ids.ndim != 2:
        raise TypeError(f"STAR-KV batches must be (batch, seq) token-id tensors, got {type(ids).__name__}")
    return ids


@dataclass
class TrainLog:
    """What the STAR-KV training did."""

    phase1_steps: int = 0
    phase2_steps: int = 0
    phase3_steps: int = 0
    met_k: bool = False
    met_v: bool = False
    kd: list[float] = field(default_factory=list)
    removed_k: list[float] = field(default_factory=list)
    removed_v: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _thresholded(model: nn.Module) -> tuple[list[ThresholdedProj], list[ThresholdedProj]]:
    ks, vs = [], []
    for s in attention_sites(model):
        if isinstance(s.attn.k_proj, ThresholdedProj):
            ks.append(s.attn.k_proj)
            vs.append(s.attn.v_proj)
    if not ks:
        raise ValueError("the model has no STAR-KV thresholded projections; call star_kv_wrap first")
    return ks, vs


def _step(student: nn.Module, teacher: nn.Module, ids: Tensor, w_kd: float) -> Tensor:
    with torch.no_grad():
        t = teacher(input_ids=ids).logits
    return w_kd * kd_loss(student(input_ids=ids).logits, t)


def star_kv_train(student: nn.Module, teacher: nn.Module, data: Sequence[Any], cfg: StarKVConfig,
                  seed: int = 0) -> TrainLog:
    """Phases 1 and 2 on a wrapped ``student`` (``cfg.steps`` KD steps in all).

    Phase 1: ``w_kd KL + lambda_K sum_K exp(-alpha) + lambda_V sum_V exp(-alpha)``; factors at ``cfg.lr``,
    thresholds at ``cfg.alpha_lr`` (Adam). When the parameter measure of K (V) reaches
    ``C + offset_k`` (``C + offset_v``), its thresholds freeze and its term is dropped; phase 1 ends when
    both are met or after ``cfg.phase1_cap`` steps (warning with the achieved compression). Phase 2: KD
    only, thresholds frozen, a fresh optimizer. ``data``: batches of token ids ``(batch, seq)``.
    """
    ks, vs = _thresholded(student)
    teacher.eval()
    student.train()
    t0 = time.perf_counter()
    log = TrainLog()
    it = (_ids(b) for b in _batches(list(data), seed))
    factors = [p for m in ks + vs for p in (m.U, m.s, m.V)]
    for p in factors:
        p.requires_grad_(True)
    ka, va = [m.alpha for m in ks], [m.alpha for m in vs]
    for a in ka + va:
        a.requires_grad_(True)
    target_k = min(cfg.target_compression + cfg.offset_k, 1.0)
    target_v = max(cfg.target_compression + cfg.offset_v, 0.0)
    opt = torch.optim.Adam([{"params": factors, "lr": cfg.lr}, {"params": ka + va, "lr": cfg.alpha_lr}])
    acc = kv_accounting(student)
    log.met_k, log.met_v = acc["param_removed_k"] >= target_k, acc["param_removed_v"] >= target_v
    while log.phase1_steps < cfg.phase1_cap and not (log.met_k and log.met_v):
        loss = kd = _step(student, teacher, next(it), cfg.kd_weight)
        if not log.met_k:
            loss = loss + cfg.comp_weight_k * sum(torch.exp(-a).sum() for a in ka)
        if not log.met_v:
            loss = loss + cfg.comp_weight_v * sum(torch.exp(-a).sum() for a in va)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.phase1_steps += 1
        acc = kv_accounting(student)
        log.kd.append(float(kd.detach()))
        log.removed_k.append(acc["param_removed_k"])
        log.removed_v.append(acc["param_removed_v"])
        for which, met, target, alphas in (("k", log.met_k, target_k, ka), ("v", log.met_v, target_v, va)):
            if not met and acc[f"param_removed_{which}"] >= target:
                setattr(log, f"met_{which}", True)
                for a in alphas:
                    a.requires_grad_(False)
                    a.grad = None
    if not (log.met_k and log.met_v):
        warnings.warn(f"STAR-KV: phase 1 stopped at its cap of {cfg.phase1_cap} steps before the targets "
                      f"(K {acc['param_removed_k']:.3f} of {target_k:.3f}, V {acc['param_removed_v']:.3f} of "
                      f"{target_v:.3f} parameters removed)", RuntimeWarning, stacklevel=2)
    for a in ka + va:
        a.requires_grad_(False)
    opt = torch.optim.Adam(factors, lr=cfg.lr)
    for _ in range(cfg.steps - log.phase1_steps):
        loss = _step(student, teacher, next(it), cfg.kd_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log.kd.append(float(loss.detach()))
        log.phase2_steps += 1
    for p in factors:
        p.requires_grad_(False)
    student.eval()
    log.seconds = time.perf_counter() - t0
    return log


def star_kv_freeze(model: nn.Module, cfg: StarKVConfig | None = None) -> list[dict[str, Any]]:
    """Fold every thresholded projection into a :class:`LatentProj` (dead ranks dropped), in place.

    Returns :func:`rank_table`. Rank-0 K heads are allowed (as in the official code), with a warning,
    unless ``cfg.min_head_rank`` keeps a floor.
    """
    cfg = cfg or StarKVConfig()
    sites = [s for s in attention_sites(model) if isinstance(s.attn.k_proj, ThresholdedProj)]
    if not sites:
        raise ValueError("the model has no STAR-KV thresholded projections to freeze")
    folded = [(s.attn.k_proj.fold(cfg.fold, cfg.min_head_rank, f"{s.name}.k_proj", cfg.rank_multiple),
               s.attn.v_proj.fold(cfg.fold, cfg.min_head_rank, f"{s.name}.v_proj", cfg.rank_multiple))
              for s in sites]
    for s, (k, v) in zip(sites, folded):
        s.attn.k_proj, s.attn.v_proj = k, v
        zero = [h for h, r in enumerate(k.ranks) if r == 0]
        if zero:
            warnings.warn(f"STAR-KV: {s.name}.k_proj heads {zero} have rank 0 (their keys are the bias only)",
                          RuntimeWarning, stacklevel=2)
    model.requires_grad_(False)
    return rank_table(model)


def kd_finetune(student: nn.Module, teacher: nn.Module, data: Sequence[Any], steps: int, lr: float,
                seed: int = 0, w_kd: float = 1.0) -> list[float]:
    """KD-only fine-tuning of the :class:`LatentProj` factors (phase 3, and the baselines' recovery)."""
    params = [p for m in student.modules() if isinstance(m, LatentProj) for p in m.factors.parameters()]
    if not params:
        raise ValueError("the model has no folded low-rank K/V projections to fine-tune")
    if steps == 0:
        return []
    for p in params:
        p.requires_grad_(True)
    teacher.eval()
    student.train()
    opt = torch.optim.Adam(params, lr=lr)
    it = _batches(list(data), seed)
    losses = []
    for _ in range(steps):
        loss = _step(student, teacher, _ids(next(it)), w_kd)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    for p in params:
        p.requires_grad_(False)
    student.eval()
    return losses


# ----------------------------------------------------------------------------------------------
# fixed-rank baselines


def spectra(model: nn.Module, skip: set[int]) -> dict[int, dict[str, Tensor]]:
    """Per compressed layer: ``k`` (``H x d`` singular values per KV head), ``v`` (``1 x H d``, joint)."""
    from rankwise.compress.star_kv.layers import group_svd

    out = {}
    for s in attention_sites(model):
        if s.layer in skip:
            continue
        out[s.layer] = {"k": group_svd(s.attn.k_proj.weight.detach(), s.kv_heads)[1],
                        "v": group_svd(s.attn.v_proj.weight.detach(), 1)[1]}
    return out


def uniform_plan(model: nn.Module, budget: float, skip: set[int]) -> dict[int, tuple[list[int], int]]:
    """One rank for every K head (``round(budget / (2 H L))``) and the rest of the budget on V, per layer.

    ``budget``: cached elements per token over the ``L`` compressed layers (e.g. STAR-KV's achieved size).
    """
    sites = [s for s in attention_sites(model) if s.layer not in skip]
    per_layer = budget / len(sites)
    plan = {}
    for s in sites:
        rk = max(1, min(s.head_dim, round(per_layer / (2 * s.kv_heads))))
        rv = max(1, min(s.kv_heads * s.head_dim, round(per_layer) - s.kv_heads * rk))
        plan[s.layer] = ([rk] * s.kv_heads, rv)
    return plan


def energy_plan(model: nn.Module, budget: float, skip: set[int]) -> dict[int, tuple[list[int], int]]:
    """Per head (K) and per layer (V), the smallest rank reaching a common fraction ``e`` of ``sum s_i^2``,
    with ``e`` the largest (bisection) whose total cache fits ``budget`` (the spec's 90 %-energy rule
    scaled to the budget)."""
    sp = spectra(model, skip)

    def ranks(e: float) -> dict[int, tuple[list[int], int]]:
        def r(s: Tensor) -> int:
            c = (s.double() ** 2).cumsum(0)
            return max(1, int((c < e * c[-1] - 1e-12).sum()) + 1)
        return {L: ([r(row) for row in x["k"]], r(x["v"][0])) for L, x in sp.items()}

    def size(p: dict[int, tuple[list[int], int]]) -> int:
        return sum(sum(k) + v for k, v in p.values())

    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if size(ranks(mid)) <= budget else (lo, mid)
    return ranks(lo)


def lowrank_kv(model: nn.Module, plan: dict[int, tuple[list[int], int]]) -> None:
    """Replace K / V of the planned layers by truncated-SVD :class:`LatentProj` at the given ranks, in place
    (``plan[layer] = (K rank per KV head, V rank)``); every parameter is frozen afterwards."""
    sites = {s.layer: s for s in attention_sites(model)}
    unknown = set(plan) - set(sites)
    if unknown:
        raise ValueError(f"plan names layers {sorted(unknown)} the model does not have")
    built = {L: (ThresholdedProj(sites[L].attn.k_proj, sites[L].kv_heads).truncate(list(k)),
                 ThresholdedProj(sites[L].attn.v_proj, 1).truncate([v])) for L, (k, v) in plan.items()}
    for L, (k, v) in built.items():
        sites[L].attn.k_proj, sites[L].attn.v_proj = k, v
    model.requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# one call


@dataclass
class StarKVReport:
    """What :func:`star_kv_compress` did: per-layer ranks, the measures, the training log."""

    ranks: list[dict[str, Any]]
    accounting: dict[str, float]
    log: TrainLog
    config: StarKVConfig

    def rank_nonuniformity(self) -> float:
        """max / min K head rank over heads of rank >= 1 (``nan`` when none)."""
        r = [x for row in self.ranks if row["compressed"] for x in row["k"] if x >= 1]
        return max(r) / min(r) if r else math.nan

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"ranks": self.ranks, "accounting": self.accounting, "log": asdict(self.log),
                "config": {k: v for k, v in asdict(self.config).items()}}


def star_kv_compress(model: nn.Module, cfg: StarKVConfig, calib: Sequence[Any], *,
                     teacher: nn.Module | None = None, seed: int = 0) -> StarKVReport:
    """Wrap, train (phases 1-2), fold and fine-tune (phase 3) ``model`` in place; ``teacher`` defaults to a
    frozen copy of ``model`` taken before any change. ``calib``: batches of token ids ``(batch, seq)``."""
    import copy

    data = [_ids(b) for b in calib]
    if not data:
        raise ValueError("STAR-KV needs at least one calibration batch")
    if teacher is None:
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
    star_kv_wrap(model, cfg)
    log = star_kv_train(model, teacher, data, cfg, seed=seed)
    star_kv_freeze(model, cfg)
    log.phase3_steps = len(kd_finetune(model, teacher, data, cfg.phase3_steps, cfg.lr, seed=seed + 1,
                                       w_kd=cfg.kd_weight))
    return StarKVReport(rank_table(model), kv_accounting(model), log, cfg)
