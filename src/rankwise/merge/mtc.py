"""Merge-then-compress (MtC): merge LoRA adapters in some space, then truncate to one rank-r LoRA.

Every method here takes T adapters with deltas ``ΔW_t = s_t B_t A_t`` (``B_t (m, r_t)``,
``A_t (r_t, n)``, per module) and returns ONE :class:`~rankwise.core.lora.AdapterState` of rank
``r`` per module:

1. combine the task deltas with a *rule* (:mod:`rankwise.merge.rules`: task arithmetic, TIES, DARE,
   DARE-TIES, Iso-C, mean) in a chosen *space*:

   * ``space="full"``: the rule acts on the flattened ``m x n`` matrices ``ΔW_t`` (what PEFT's
     ``add_weighted_adapter(combination_type="svd" | "ties_svd" | "dare_ties_svd" ...)`` and
     mergekit's ``ties`` / ``dare_ties`` do);
   * ``space="knots"`` (KnOTS, Stoica et al. 2025): SVD ``[ΔW_1 ... ΔW_T] = U Σ [V_1ᵀ ... V_Tᵀ]``,
     the rule acts on the ``V_t`` (aligned right factors), ``ΔW = U Σ V_mergedᵀ``;
   * ``space="core"`` (Core-Space merging, Panariello et al. 2025): ``U_B`` / ``V_A`` = orthonormal
     bases of ``[B_1 ... B_T]`` / ``[A_1; ...; A_T]ᵀ``, ``M_t = U_Bᵀ B_t A_t V_A`` (R x R, R = Σ r_t),
     the rule acts on the ``M_t``, ``ΔW = U_B M V_Aᵀ``;

2. multiply by one global scale λ (``scale``) and truncate to rank r by SVD (Eckart–Young):
   ``B = U_r Σ_r^{1/2}``, ``A = Σ_r^{1/2} V_rᵀ`` (scaling 1, alpha = r); Iso-C replaces the kept
   singular values by their mean.

Numerics: every factorisation runs in float64; outputs are cast to the adapters' common dtype
(``torch.promote_types`` over the inputs). Singular vectors are sign-fixed, so the output is
deterministic. The untruncated merges (``rank=None`` in :func:`merged_deltas`) are the
"full-parameter merging" references of the CtM paper.

Registered merge methods (:mod:`rankwise.merge.base`): ``ta``, ``ties``, ``dare``, ``iso_c`` (full
space, the rule fixed), ``mtc`` (full space, any rule, default ``ta``), ``knots`` and ``core`` (their
space, any rule, default ``ties``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from rankwise.core.lora import AdapterState
from rankwise.core.validate import check_choice, check_int, check_number, check_unit
from rankwise.merge.base import MergeMethod, register_merge_method
from rankwise.merge.common import (
    FP,
    MergeInputs,
    adapter_seed,
    check_adapters,
    check_rank_fits,
    core_space,
    flatten_isotropic,
    lowrank_factors,
    map_modules,
    module_factors,
    out_state,
    sign_fix,
    truncate,
)
from rankwise.merge.rules import canonical_rule, merge_tensors, needs_seeds

__all__ = ["SPACES", "MergeConfig", "describe", "merge", "merged_delta_module", "merged_deltas", "mtc_merge"]

SPACES: tuple[str, ...] = ("full", "knots", "core")


@dataclass(frozen=True)
class MergeConfig:
    """Merge-then-compress: combine in ``space`` with ``rule``, scale by λ, truncate to ``rank``.

    Attributes:
        rank: output LoRA rank r >= 1 per module (the CtM paper uses 16 = the adapters' rank).
        rule: one of :data:`~rankwise.merge.rules.RULES` (``"ta"`` = PEFT ``svd``; ``"ties"`` =
            ``ties_svd``; ``"dare_ties"`` = ``dare_ties_svd``; ``"dare"`` = ``dare_linear_svd``).
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
        object.__setattr__(self, "rank", check_int("MergeConfig.rank", self.rank, 1))
        object.__setattr__(self, "rule", canonical_rule(self.rule, "MergeConfig.rule"))
        check_choice("MergeConfig.space", self.space, SPACES)
        object.__setattr__(self, "density", check_unit("MergeConfig.density", self.density, low_open=True))
        object.__setattr__(self, "drop_rate", check_unit("MergeConfig.drop_rate", self.drop_rate, high_open=True))
        object.__setattr__(self, "scale", check_number("MergeConfig.scale", self.scale))
        object.__setattr__(self, "seed", check_int("MergeConfig.seed", self.seed))


def merged_delta_module(inputs: MergeInputs, module: str, cfg: MergeConfig) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """The merged (scaled, untruncated) delta of one module: a dense (m, n) matrix, or for the core
    space the triple ``(U_B, M, V_A)`` with ``ΔW = U_B M V_Aᵀ`` (kept factored)."""
    m, n = inputs.shapes[module]
    Bs, As, _ = module_factors(inputs, module)
    if not Bs:
        return torch.zeros(m, n, dtype=FP)
    # the seeds hash every factor's bytes: only DARE's random masks need them
    seeds = [adapter_seed(cfg.seed, module, b, a) for b, a in zip(Bs, As)] if needs_seeds(cfg.rule) else None
    kw: dict[str, Any] = dict(density=cfg.density, drop_rate=cfg.drop_rate, seeds=seeds)
    if cfg.space == "full":
        if cfg.rule in ("ta", "iso_c", "mean"):  # linear rules: accumulate, never hold T dense matrices
            total = torch.zeros(m, n, dtype=FP)
            for b, a in zip(Bs, As):
                total.addmm_(b, a)
            return cfg.scale * (total / len(Bs) if cfg.rule == "mean" else total)
        X = torch.stack([b @ a for b, a in zip(Bs, As)])
        return cfg.scale * merge_tensors(X, cfg.rule, **kw)
    if cfg.space == "core":
        U_B, V_A, L, K = core_space(Bs, As)
        M = merge_tensors(L @ K.mT, cfg.rule, **kw)
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
        d = merged_delta_module(inputs, mod, cfg)
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


def merge(adapters: Sequence[AdapterState], config: MergeConfig | None = None) -> AdapterState:
    """Merge-then-compress: one rank-``config.rank`` LoRA (alpha = r, scaling 1) from ``adapters``.

    See the module docstring for the spaces and rules. ``rank > min(m, n)`` of a module raises
    ValueError naming it. The output's factors have the adapters' common (promoted) dtype.
    """
    cfg = config or MergeConfig()
    if not isinstance(cfg, MergeConfig):
        raise TypeError(f"merge: config must be a MergeConfig, got {type(cfg).__name__}")
    inputs = check_adapters(adapters, "merge")
    check_rank_fits(inputs, cfg.rank, "merge")
    iso = cfg.rule == "iso_c"

    def one(mod: str) -> dict[str, Tensor]:
        d = merged_delta_module(inputs, mod, cfg)
        if isinstance(d, tuple):  # core space: truncate the R x R core, lift (== truncation in full space)
            U_B, M, V_A = d
            U, S, Vh = torch.linalg.svd(M, full_matrices=False)
            k = min(cfg.rank, S.shape[0])  # lift only the kept directions: (m, k), not (m, R)
            B, A = lowrank_factors(U_B @ U[:, :k], S[:k], Vh[:k] @ V_A.T, cfg.rank, iso)
        else:
            B, A = truncate(d, cfg.rank, isotropic=iso)
        return {"lora_A": A, "lora_B": B}

    # in core space the modules are merged one per thread (map_modules): each holds O((m + n) R); the
    # full-space and KnOTS merges hold dense m x n matrices (T of them for the entry-wise rules), so they
    # stay one module at a time, their large SVDs on the intra-op threads
    workers = None if cfg.space == "core" else 1
    factors = dict(zip(inputs.modules, map_modules(one, inputs.modules, workers)))
    return out_state(inputs, factors, cfg.rank,
                     {"method": f"mtc-{cfg.space}-{cfg.rule}", "merge": {
                         "rule": cfg.rule, "space": cfg.space, "density": cfg.density,
                         "drop_rate": cfg.drop_rate, "scale": cfg.scale, "seed": cfg.seed}})


mtc_merge = merge


def describe(state: AdapterState) -> Mapping[str, Any]:
    """The merge settings recorded in a merged state's config (empty if not a merged state)."""
    return dict(state.config.get("merge", {}))


# ------------------------------------------------------------------------------------------------
# registered methods
# ------------------------------------------------------------------------------------------------

def _method(name: str, space: str, rule: str, summary: str, *, rule_fixed: bool) -> MergeMethod:
    return register_merge_method(MergeMethod(name, MergeConfig, merge, summary, {"space": space, "rule": rule},
                                             ("space", "rule") if rule_fixed else ("space",)))


_method("ta", "full", "ta", "task arithmetic in full space, truncated by SVD (PEFT svd)", rule_fixed=True)
_method("ties", "full", "ties", "TIES in full space, truncated by SVD (PEFT ties_svd)", rule_fixed=True)
_method("dare", "full", "dare", "DARE in full space, truncated by SVD (PEFT dare_linear_svd)", rule_fixed=True)
_method("iso_c", "full", "iso_c", "Iso-C: the sum truncated by SVD with flattened singular values",
        rule_fixed=True)
_method("mtc", "full", "ta", "merge-then-compress in full space with any --rule", rule_fixed=False)
_method("knots", "knots", "ties", "KnOTS space (SVD-aligned) with any --rule, truncated", rule_fixed=False)
_method("core", "core", "ties", "Core space with any --rule, truncated", rule_fixed=False)
