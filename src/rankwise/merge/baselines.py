"""Baselines for merging LoRA adapters into one rank-r LoRA: merge in some space, then truncate.

Every method here takes T adapters with deltas ``ΔW_t = s_t B_t A_t`` (``B_t (m, r_t)``,
``A_t (r_t, n)``, per module) and returns ONE :class:`~rankwise.core.lora.AdapterState` of rank
``r`` per module ("merge-then-compress", MtC):

1. combine the task deltas with a *rule* in a chosen *space*:

   * ``space="full"``: the rule acts on the flattened ``m x n`` matrices ``ΔW_t`` (what PEFT's
     ``add_weighted_adapter(combination_type="svd" | "ties_svd" | "dare_ties_svd" ...)`` and
     mergekit's ``ties`` / ``dare_ties`` do);
   * ``space="knots"`` (KnOTS, Stoica et al. 2025): SVD ``[ΔW_1 ... ΔW_T] = U Σ [V_1ᵀ ... V_Tᵀ]``,
     the rule acts on the ``V_t`` (aligned right factors), ``ΔW = U Σ V_mergedᵀ``;
   * ``space="core"`` (Core-Space merging, Panariello et al. 2025): ``U_B`` / ``V_A`` = orthonormal
     bases of ``[B_1 ... B_T]`` / ``[A_1; ...; A_T]ᵀ``, ``M_t = U_Bᵀ B_t A_t V_A`` (R x R, R = Σ r_t),
     the rule acts on the ``M_t``, ``ΔW = U_B M V_Aᵀ``;

2. multiply by one global scale λ (``scale``) and truncate to rank r by SVD (Eckart–Young):
   ``B = U_r Σ_r^{1/2}``, ``A = Σ_r^{1/2} V_rᵀ`` (scaling 1, alpha = r).

Rules (:func:`merge_tensors`, all on tensors stacked as ``(T, ...)``):

* ``"ta"`` — task arithmetic, ``Σ_t X_t`` (Ilharco et al. 2023);
* ``"mean"`` — ``(1/T) Σ_t X_t``;
* ``"ties"`` — TIES (Yadav et al. 2023): keep each task's top ``density`` fraction of entries by
  magnitude, elect a sign per entry (sign of the sum of the trimmed values; entries whose sum is 0
  take the sign of the sum over all entries, + if that is 0 too), average the nonzero entries that
  agree with the elected sign;
* ``"dare"`` — DARE (Yu et al. 2024): drop each entry with probability ``drop_rate``, rescale by
  ``1/(1-drop_rate)``, sum;
* ``"dare_ties"`` — DARE's random drop, then TIES' sign election and disjoint mean;
* ``"iso_c"`` — Iso-C (Marczak et al. 2025): the sum, truncated to rank r, with every kept
  singular value replaced by their mean.

Tie-breaking (documented, deterministic): TIES keeps the ``k = round(density * numel)`` largest
magnitudes, ties broken by a stable sort (earlier position wins). DARE's mask for a task is drawn
from a generator seeded by ``seed`` and a hash of that task's own factors, so the result does not
depend on the order of the adapters.

Numerics: every factorisation runs in float64; outputs are cast to the adapters' common dtype
(``torch.promote_types`` over the inputs). Singular vectors are sign-fixed (largest |entry| of
each left vector positive), so the output is deterministic.

The untruncated merges (``rank=None`` in :func:`merged_deltas`) are the "full-parameter merging"
references of the CtM paper.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.lora import AdapterState

__all__ = [
    "RULES",
    "SPACES",
    "MergeConfig",
    "MergeInputs",
    "adapter_seed",
    "core_bases",
    "core_matrices",
    "check_adapters",
    "flatten_isotropic",
    "merge",
    "merge_tensors",
    "merged_deltas",
    "mtc_merge",
    "sign_fix",
    "truncate",
]

logger = logging.getLogger(__name__)

RULES: tuple[str, ...] = ("ta", "mean", "ties", "dare", "dare_ties", "iso_c")
_RULE_ALIASES = {"sum": "ta", "task_arithmetic": "ta", "linear": "ta", "dare_linear": "dare", "iso": "iso_c",
                 "isoc": "iso_c", "iso-c": "iso_c", "dare-ties": "dare_ties"}
SPACES: tuple[str, ...] = ("full", "knots", "core")
_FP = torch.float64
_TINY = 1e-300


def canonical_rule(rule: Any, where: str = "rule") -> str:
    """The canonical rule name (``"sum"`` -> ``"ta"``, ...); ValueError naming ``where`` otherwise."""
    if not isinstance(rule, str):
        raise ValueError(f"{where} must be a string, one of {RULES}, got {rule!r}")
    r = _RULE_ALIASES.get(rule.lower(), rule.lower())
    if r not in RULES:
        raise ValueError(f"{where} must be one of {RULES} (aliases {sorted(_RULE_ALIASES)}), got {rule!r}")
    return r


def _check_unit(name: str, value: Any, low_open: bool, high_open: bool) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    v = float(value)
    lo_ok = v > 0 if low_open else v >= 0
    hi_ok = v < 1 if high_open else v <= 1
    if not (lo_ok and hi_ok):
        rng = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return v


def check_rank(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")


def check_scale(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MergeConfig:
    """Merge-then-compress: combine in ``space`` with ``rule``, scale by λ, truncate to ``rank``.

    Attributes:
        rank: output LoRA rank r >= 1 per module (the CtM paper uses 16 = the adapters' rank).
        rule: one of :data:`RULES` (``"ta"`` = PEFT ``svd``; ``"ties"`` = ``ties_svd``;
            ``"dare_ties"`` = ``dare_ties_svd``; ``"dare"`` = ``dare_linear_svd``).
        space: ``"full"`` (m x n task matrices), ``"knots"`` (KnOTS' aligned V_t) or ``"core"``
            (Core-Space R x R matrices).
        density: TIES: fraction of entries kept per task, in (0, 1].
        drop_rate: DARE: probability of dropping an entry, in [0, 1).
        scale: the global scale λ applied to the merged delta (the CtM code's ``scaling_coeffs``).
        seed: seeds DARE's random masks.
    """

    rank: int = 16
    rule: str = "ties"
    space: str = "full"
    density: float = 0.25
    drop_rate: float = 0.05
    scale: float = 1.0
    seed: int = 420

    def __post_init__(self) -> None:
        check_rank("MergeConfig.rank", self.rank)
        object.__setattr__(self, "rule", canonical_rule(self.rule, "MergeConfig.rule"))
        if self.space not in SPACES:
            raise ValueError(f"MergeConfig.space must be one of {SPACES}, got {self.space!r}")
        object.__setattr__(self, "density", _check_unit("MergeConfig.density", self.density, True, False))
        object.__setattr__(self, "drop_rate", _check_unit("MergeConfig.drop_rate", self.drop_rate, False, True))
        object.__setattr__(self, "scale", check_scale("MergeConfig.scale", self.scale))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"MergeConfig.seed must be an int, got {self.seed!r}")


# ------------------------------------------------------------------------------------------------
# input checks shared by every merge method
# ------------------------------------------------------------------------------------------------

@dataclass
class MergeInputs:
    """Validated adapters: common module list, per-module shape, output dtype and fingerprint."""

    adapters: list[AdapterState]
    modules: list[str]
    shapes: dict[str, tuple[int, int]]
    dtype: torch.dtype
    fingerprint: str | None
    base_model: str | None


def check_adapters(adapters: Sequence[AdapterState], what: str = "merge") -> MergeInputs:
    """Validate a list of adapters for merging; raise with a message naming the adapter and module.

    Rejects: an empty list; a non-AdapterState; non-plain LoRA states (DoRA, ...); adapters for
    different base models (differing fingerprints or ``base_model_name_or_path``); different module
    sets; different ``(out, in)`` shapes per module; NaN/Inf factors (already refused by
    :meth:`AdapterState.validate`). Ranks may differ between adapters and modules; dtypes may differ
    between adapters (the output takes the promoted dtype).
    """
    if isinstance(adapters, AdapterState):
        raise TypeError(f"{what}: pass a sequence of AdapterState, not a single one")
    adapters = list(adapters)
    if not adapters:
        raise ValueError(f"{what}: the list of adapters is empty; pass at least one AdapterState")
    for i, a in enumerate(adapters):
        if not isinstance(a, AdapterState):
            raise TypeError(f"{what}: adapter {i} is a {type(a).__name__}, expected an AdapterState "
                            "(rankwise.adapt.lora.import_peft(dir) reads a PEFT directory)")
        try:
            a.validate()
        except ValueError as e:
            raise ValueError(f"{what}: adapter {i}: {e}") from e
        method = str(a.config.get("method", "lora")).lower()
        if a.config.get("use_dora") or method in ("dora",):
            raise RankwiseError(f"{what}: adapter {i} is a {method!r} adapter: unsupported adapter type; "
                                "only plain LoRA (ΔW = s B A) can be merged")
    fps = {a.fingerprint for a in adapters if a.fingerprint is not None}
    if len(fps) > 1:
        idx = [i for i, a in enumerate(adapters) if a.fingerprint is not None]
        raise RankwiseError(f"{what}: adapters {idx} were trained on different base models "
                            f"(fingerprints {sorted(f[:12] for f in fps)}); merging needs one base model")
    names = {a.config.get("base_model_name_or_path") for a in adapters} - {None}
    if len(names) > 1:
        raise RankwiseError(f"{what}: adapters name different base models {sorted(map(str, names))}; "
                            "merging needs one base model")
    first = adapters[0]
    modules = first.modules()
    ref = set(modules)
    for i, a in enumerate(adapters[1:], start=1):
        mods = set(a.modules())
        if mods != ref:
            missing, extra = sorted(ref - mods), sorted(mods - ref)
            raise RankwiseError(f"{what}: adapter {i} targets different modules than adapter 0: "
                                f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, "
                                f"extra {extra[:3]}{' ...' if len(extra) > 3 else ''}")
    shapes = {m: first.shape(m) for m in modules}
    for i, a in enumerate(adapters[1:], start=1):
        for m in modules:
            if a.shape(m) != shapes[m]:
                raise RankwiseError(f"{what}: module {m!r} has shape (out, in) = {a.shape(m)} in adapter {i} "
                                    f"but {shapes[m]} in adapter 0")
    dtype = adapters[0].factors[modules[0]]["lora_A"].dtype
    for a in adapters:
        for m in modules:
            dtype = torch.promote_types(dtype, a.factors[m]["lora_A"].dtype)
    return MergeInputs(adapters, modules, shapes, dtype, next(iter(fps)) if fps else None,
                       next(iter(names)) if names else None)


def scaled_factors(adapter: AdapterState, module: str) -> tuple[Tensor, Tensor]:
    """``(s B, A)`` of ``module`` in float64 (the scaling folded into B, CtM step 0)."""
    f = adapter.factors[module]
    return f["lora_B"].detach().to(_FP) * float(adapter.scaling[module]), f["lora_A"].detach().to(_FP)


def adapter_seed(seed: int, module: str, b: Tensor, a: Tensor) -> int:
    """A 63-bit seed from ``seed``, the module name and the factors' bytes (order-independent DARE masks)."""
    h = hashlib.sha256()
    h.update(struct.pack("<q", int(seed)))
    h.update(module.encode())
    for t in (b, a):
        t = t.detach().to("cpu", torch.float64).contiguous()
        h.update(t.numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------------
# rules
# ------------------------------------------------------------------------------------------------

def _topk_mask(x: Tensor, density: float) -> Tensor:
    """Per task (dim 0), keep the ``round(density * numel)`` largest |entries| (stable tie-breaking)."""
    T = x.shape[0]
    flat = x.reshape(T, -1)
    n = flat.shape[1]
    k = min(n, max(1, int(round(density * n))))
    if k == n:
        return torch.ones_like(flat, dtype=torch.bool).reshape(x.shape)
    order = torch.argsort(flat.abs(), dim=1, descending=True, stable=True)[:, :k]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask.reshape(x.shape)


def _elect_and_mean(x: Tensor) -> Tensor:
    """TIES steps 2-3 on trimmed tasks ``x (T, ...)``: elect signs, mean of the agreeing nonzero entries."""
    total = x.sum(0)
    sign = torch.sign(total)
    overall = torch.sign(total.sum())
    sign = torch.where(sign == 0, overall if overall != 0 else torch.ones((), dtype=x.dtype), sign)
    agree = (torch.sign(x) == sign) & (x != 0)
    count = agree.sum(0).clamp_min(1).to(x.dtype)
    return (x * agree).sum(0) / count


def _dare_drop(x: Tensor, drop_rate: float, seeds: Sequence[int]) -> Tensor:
    if drop_rate == 0.0:
        return x
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        g = torch.Generator().manual_seed(int(seeds[t]))
        keep = torch.rand(x[t].shape, generator=g, dtype=torch.float64) >= drop_rate
        out[t] = x[t] * keep.to(x.dtype) / (1.0 - drop_rate)
    return out


def merge_tensors(x: Tensor, rule: str, *, density: float = 0.25, drop_rate: float = 0.05,
                  seeds: Sequence[int] | None = None) -> Tensor:
    """Combine task tensors ``x (T, ...)`` (each task's tensor viewed as one flat vector) into one ``(...)``.

    ``rule`` in :data:`RULES`; ``"iso_c"`` returns the plain sum here (the isotropic flattening acts on
    singular values after truncation, :func:`flatten_isotropic`). ``seeds``: one per task for DARE.
    """
    rule = canonical_rule(rule)
    if x.ndim < 2:
        raise ValueError(f"merge_tensors: x must have shape (T, ...), got {tuple(x.shape)}")
    if rule in ("ta", "iso_c"):
        return x.sum(0)
    if rule == "mean":
        return x.mean(0)
    if rule == "ties":
        return _elect_and_mean(x * _topk_mask(x, density))
    if seeds is None or len(seeds) != x.shape[0]:
        raise ValueError(f"merge_tensors: rule {rule!r} needs one seed per task ({x.shape[0]})")
    dropped = _dare_drop(x, drop_rate, seeds)
    if rule == "dare":
        return dropped.sum(0)
    return _elect_and_mean(dropped)  # dare_ties


# ------------------------------------------------------------------------------------------------
# linear algebra helpers
# ------------------------------------------------------------------------------------------------

def sign_fix(U: Tensor, Vh: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Flip singular-vector pairs so that each column of ``U`` has its largest-|entry| positive."""
    if U.shape[1] == 0:
        return U, Vh
    idx = U.abs().argmax(0)
    s = torch.sign(U.gather(0, idx[None, :])[0])
    s = torch.where(s == 0, torch.ones_like(s), s)
    return U * s, (None if Vh is None else Vh * s[:, None])


def top_left_singular(X: Tensor, r: int) -> Tensor:
    """Top-``r`` left singular vectors of ``X`` (sign-fixed), ``(rows, r)``."""
    U, _, _ = torch.linalg.svd(X, full_matrices=False)
    return sign_fix(U[:, :r].contiguous())[0]


def truncate(delta: Tensor, rank: int, *, isotropic: bool = False) -> tuple[Tensor, Tensor]:
    """Best rank-``rank`` factors of ``delta (m, n)``: ``B = U_r Σ^{1/2} (m, r)``, ``A = Σ^{1/2} V_rᵀ (r, n)``.

    Eckart–Young in Frobenius norm; with ``isotropic`` (Iso-C) the kept singular values are first
    replaced by their mean. Fewer than ``rank`` directions (``min(m, n) < rank``) are zero-padded.
    """
    d = delta.to(_FP)
    U, S, Vh = torch.linalg.svd(d, full_matrices=False)
    return _factors(U, S, Vh, rank, isotropic)


def _factors(U: Tensor, S: Tensor, Vh: Tensor, rank: int, isotropic: bool) -> tuple[Tensor, Tensor]:
    k = min(rank, S.shape[0])
    U, Vh = sign_fix(U[:, :k], Vh[:k])
    S = S[:k]
    if isotropic:
        S = flatten_isotropic(S)
    root = S.clamp_min(0).sqrt()
    B = U * root
    A = root[:, None] * Vh
    if k < rank:
        B = torch.cat([B, B.new_zeros(B.shape[0], rank - k)], 1)
        A = torch.cat([A, A.new_zeros(rank - k, A.shape[1])], 0)
    return B, A


def flatten_isotropic(S: Tensor, rel_floor: float = 1e-12) -> Tensor:
    """Iso-C: replace the nonzero singular values (> ``rel_floor * σ_1``) by their mean; zeros stay zero."""
    if S.numel() == 0 or float(S.max()) <= 0:
        return S
    nz = S > rel_floor * S.max()
    return torch.where(nz, S[nz].mean(), torch.zeros_like(S))


def core_bases(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Core-Space bases (CtM step 1): ``U_B (m, R)`` left singular vectors of ``[B_1 ... B_T]``,
    ``V_A (n, R)`` right singular vectors of ``[A_1; ...; A_T]``; R = Σ r_t (thin SVD, sign-fixed).

    ``span(U_B) ⊇ col(B_t)`` and ``span(V_A) ⊇ row(A_t)`` for every t, so ``ΔW_t = U_B M_t V_Aᵀ``
    exactly (:func:`core_matrices`). Cost O((m + n) R²); never forms an m x n matrix.
    """
    B_cat = torch.cat([b.to(_FP) for b in Bs], 1)
    A_cat = torch.cat([a.to(_FP) for a in As], 0)
    U_B, _, _ = torch.linalg.svd(B_cat, full_matrices=False)
    _, _, Vh = torch.linalg.svd(A_cat, full_matrices=False)
    U_B = sign_fix(U_B)[0]
    V_A = sign_fix(Vh.T.contiguous())[0]
    return U_B, V_A


def core_matrices(U_B: Tensor, V_A: Tensor, Bs: Sequence[Tensor], As: Sequence[Tensor]) -> Tensor:
    """``M_t = (U_Bᵀ B_t)(A_t V_A)`` stacked, ``(T, R, R)`` (CtM step 2; Core Space Eq. for M_t)."""
    return torch.stack([(U_B.T @ b.to(_FP)) @ (a.to(_FP) @ V_A) for b, a in zip(Bs, As)])


# ------------------------------------------------------------------------------------------------
# merge-then-compress
# ------------------------------------------------------------------------------------------------

def _module_factors(inputs: MergeInputs, module: str) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """Scaled factors of every adapter at ``module``, skipping zero adapters (with a warning)."""
    Bs, As, keep = [], [], []
    for i, a in enumerate(inputs.adapters):
        b, aa = scaled_factors(a, module)
        if float(b.abs().max()) == 0.0 or float(aa.abs().max()) == 0.0:
            logger.warning("merge: adapter %d is zero at module %r; skipped there", i, module)
            continue
        Bs.append(b)
        As.append(aa)
        keep.append(i)
    return Bs, As, keep


def _merged_delta_module(inputs: MergeInputs, module: str, cfg: MergeConfig) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """The merged (scaled, untruncated) delta of one module: a dense (m, n) matrix, or for the core
    space the triple ``(U_B, M, V_A)`` with ``ΔW = U_B M V_Aᵀ`` (kept factored)."""
    m, n = inputs.shapes[module]
    Bs, As, _ = _module_factors(inputs, module)
    if not Bs:
        return torch.zeros(m, n, dtype=_FP)
    seeds = [adapter_seed(cfg.seed, module, b, a) for b, a in zip(Bs, As)]
    kw: dict[str, Any] = dict(density=cfg.density, drop_rate=cfg.drop_rate, seeds=seeds)
    if cfg.space == "full":
        if cfg.rule in ("ta", "iso_c", "mean"):  # linear rules: accumulate, never hold T dense matrices
            total = torch.zeros(m, n, dtype=_FP)
            for b, a in zip(Bs, As):
                total.addmm_(b, a)
            return cfg.scale * (total / len(Bs) if cfg.rule == "mean" else total)
        X = torch.stack([b @ a for b, a in zip(Bs, As)])
        return cfg.scale * merge_tensors(X, cfg.rule, **kw)
    if cfg.space == "core":
        U_B, V_A = core_bases(Bs, As)
        M = merge_tensors(core_matrices(U_B, V_A, Bs, As), cfg.rule, **kw)
        return U_B, cfg.scale * M, V_A
    # KnOTS: [ΔW_1 ... ΔW_T] = B_cat blockdiag(A_t) = Q (R_B blockdiag(A_t)) = Q U_g Σ W
    B_cat = torch.cat(Bs, 1)
    Q, R_B = torch.linalg.qr(B_cat)
    offs = [0]
    for b in Bs:
        offs.append(offs[-1] + b.shape[1])
    G = torch.cat([R_B[:, offs[t]:offs[t + 1]] @ As[t] for t in range(len(Bs))], 1)  # (R, T n)
    U_g, S, W = torch.linalg.svd(G, full_matrices=False)
    U_g, W = sign_fix(U_g, W)
    Vs = torch.stack([W[:, t * n:(t + 1) * n] for t in range(len(Bs))])  # (T, k, n) = V_tᵀ
    V_merged = merge_tensors(Vs, cfg.rule, **kw)
    return cfg.scale * ((Q @ U_g) * S) @ V_merged


def merged_deltas(adapters: Sequence[AdapterState], config: MergeConfig | None = None, *,
                  rank: int | None = -1) -> dict[str, Tensor]:
    """Per module the merged delta ``(m, n)`` in float64: truncated to ``config.rank`` (default) or,
    with ``rank=None``, the untruncated full-parameter merge (the paper's reference rows)."""
    cfg = config or MergeConfig()
    inputs = check_adapters(adapters, "merged_deltas")
    out = {}
    for mod in inputs.modules:
        d = _merged_delta_module(inputs, mod, cfg)
        if isinstance(d, tuple):
            U_B, M, V_A = d
            d = U_B @ M @ V_A.T
        if rank is not None:
            r = cfg.rank if rank == -1 else rank
            B, A = truncate(d, r, isotropic=cfg.rule == "iso_c")
            d = B @ A
        elif cfg.rule == "iso_c":
            U, S, Vh = torch.linalg.svd(d, full_matrices=False)
            d = (U * flatten_isotropic(S)) @ Vh
        out[mod] = d
    return out


def _out_state(inputs: MergeInputs, factors: dict[str, dict[str, Tensor]], rank: int,
               config: dict[str, Any]) -> AdapterState:
    for mod, f in factors.items():
        if not (bool(torch.isfinite(f["lora_A"]).all()) and bool(torch.isfinite(f["lora_B"]).all())):
            raise NumericalError(f"merge produced non-finite factors at module {mod!r}")
        factors[mod] = {k: t.to(inputs.dtype).contiguous() for k, t in f.items()}
    cfg = {"rank": rank, "alpha": float(rank), "use_rslora": False, "dropout": 0.0, "init": None,
           "targets": list(inputs.modules), "n_merged": len(inputs.adapters)}
    if inputs.base_model is not None:
        cfg["base_model_name_or_path"] = inputs.base_model
    cfg.update(config)
    return AdapterState(cfg, factors, {m: 1.0 for m in inputs.modules}, inputs.fingerprint)


def merge(adapters: Sequence[AdapterState], config: MergeConfig | None = None) -> AdapterState:
    """Merge-then-compress: one rank-``config.rank`` LoRA (alpha = r, scaling 1) from ``adapters``.

    See the module docstring for the spaces and rules. ``rank > min(m, n)`` of a module raises
    ValueError naming it. The output's factors have the adapters' common (promoted) dtype.
    """
    cfg = config or MergeConfig()
    if not isinstance(cfg, MergeConfig):
        raise TypeError(f"merge: config must be a MergeConfig, got {type(cfg).__name__}")
    inputs = check_adapters(adapters, "merge")
    for mod, (m, n) in inputs.shapes.items():
        if cfg.rank > min(m, n):
            raise ValueError(f"merge: rank={cfg.rank} exceeds min(out, in) = {min(m, n)} of module {mod!r}")
    factors = {}
    for mod in inputs.modules:
        d = _merged_delta_module(inputs, mod, cfg)
        iso = cfg.rule == "iso_c"
        if isinstance(d, tuple):  # core space: truncate the R x R core, lift (== truncation in full space)
            U_B, M, V_A = d
            U, S, Vh = torch.linalg.svd(M, full_matrices=False)
            U, Vh = U_B @ U, Vh @ V_A.T
            B, A = _factors(U, S, Vh, cfg.rank, iso)
        else:
            B, A = truncate(d, cfg.rank, isotropic=iso)
        factors[mod] = {"lora_A": A, "lora_B": B}
    return _out_state(inputs, factors, cfg.rank,
                      {"method": f"mtc-{cfg.space}-{cfg.rule}", "merge": {
                          "rule": cfg.rule, "space": cfg.space, "density": cfg.density,
                          "drop_rate": cfg.drop_rate, "scale": cfg.scale, "seed": cfg.seed}})


mtc_merge = merge


def describe(state: AdapterState) -> Mapping[str, Any]:
    """The merge settings recorded in a merged state's config (empty if not a merged state)."""
    return dict(state.config.get("merge", {}))
