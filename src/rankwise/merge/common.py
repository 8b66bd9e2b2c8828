"""What every merging method shares: input checks, per-module factors, seeds, SVD helpers, the output.

A merging method takes T adapters with deltas ``ΔW_t = s_t B_t A_t`` (``B_t (m, r_t)``, ``A_t (r_t, n)``,
per module) and returns ONE :class:`~rankwise.core.lora.AdapterState`. The helpers here are the steps
every such method repeats:

* :func:`check_adapters` validates the inputs (one base model, one module set, one shape per module)
  and gives the output dtype (promoted over the inputs) as a :class:`MergeInputs`;
* :func:`module_factors` gives each adapter's ``(s B, A)`` of one module in float64, skipping zero
  adapters; :func:`adapter_seed` seeds per-adapter randomness from the factors themselves, so that
  a result does not depend on the order of the adapters;
* :func:`core_bases` / :func:`core_matrices`: the Core-Space representation ``ΔW_t = U_B M_t V_Aᵀ``
  (used by Core-Space merging and by CtM's first two steps), with ``M_t = L_t K_tᵀ`` from
  :func:`core_factors` (:func:`core_space` gives all four, concatenating the factors once);
* :func:`truncate` / :func:`lowrank_factors`: the best rank-r factors by SVD (Eckart–Young), with the
  Iso-C flattening of the kept singular values as an option (:func:`flatten_isotropic`);
* :func:`out_state` checks the merged factors and builds the output state (alpha = r, scaling 1);
* :func:`map_modules` runs the per-module work of a merge on a few threads, one module per thread.

Numerics: every factorisation runs in float64 (:data:`FP`); singular vectors are sign-fixed (largest
|entry| of each left vector positive), so outputs are deterministic.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import Tensor

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.lora import AdapterState

__all__ = [
    "FP",
    "MergeInputs",
    "adapter_seed",
    "check_adapters",
    "check_rank_fits",
    "core_bases",
    "core_factors",
    "core_matrices",
    "core_space",
    "flatten_isotropic",
    "lowrank_factors",
    "map_modules",
    "module_factors",
    "out_state",
    "scaled_factors",
    "sign_fix",
    "top_left_singular",
    "truncate",
]

logger = logging.getLogger(__name__)

_Item = TypeVar("_Item")
_Out = TypeVar("_Out")

#: the dtype of every factorisation
FP = torch.float64


# ------------------------------------------------------------------------------------------------
# inputs
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
                            "(rankwise.core.peft_format.import_peft(dir) reads a PEFT directory)")
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


def check_rank_fits(inputs: MergeInputs, rank: int, what: str = "merge") -> None:
    """ValueError naming the module if ``rank > min(out, in)`` of any module."""
    for mod, (m, n) in inputs.shapes.items():
        if rank > min(m, n):
            raise ValueError(f"{what}: rank={rank} exceeds min(out, in) = {min(m, n)} of module {mod!r}")


def scaled_factors(adapter: AdapterState, module: str) -> tuple[Tensor, Tensor]:
    """``(s B, A)`` of ``module`` in float64 (the scaling folded into B, CtM step 0)."""
    f = adapter.factors[module]
    return f["lora_B"].detach().to(FP) * float(adapter.scaling[module]), f["lora_A"].detach().to(FP)


def module_factors(inputs: MergeInputs, module: str) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """Scaled factors ``(Bs, As, kept)`` of every adapter at ``module``, skipping zero adapters (with a
    warning); ``kept`` lists the indices of the adapters used."""
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
# linear algebra
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


def flatten_isotropic(S: Tensor, rel_floor: float = 1e-12) -> Tensor:
    """Iso-C: replace the nonzero singular values (> ``rel_floor * σ_1``) by their mean; zeros stay zero."""
    if S.numel() == 0 or float(S.max()) <= 0:
        return S
    nz = S > rel_floor * S.max()
    return torch.where(nz, S[nz].mean(), torch.zeros_like(S))


def lowrank_factors(U: Tensor, S: Tensor, Vh: Tensor, rank: int, isotropic: bool = False) -> tuple[Tensor, Tensor]:
    """Rank-``rank`` factors from a thin SVD ``U diag(S) Vh``: ``B = U_r Σ_r^{1/2}``, ``A = Σ_r^{1/2} V_rᵀ``.

    Sign-fixed; with ``isotropic`` (Iso-C) the kept singular values are first replaced by their mean.
    Fewer than ``rank`` directions are zero-padded, so ``B`` is always ``(m, rank)`` and ``A`` ``(rank, n)``.
    """
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


def truncate(delta: Tensor, rank: int, *, isotropic: bool = False) -> tuple[Tensor, Tensor]:
    """Best rank-``rank`` factors of ``delta (m, n)``: ``B = U_r Σ^{1/2} (m, r)``, ``A = Σ^{1/2} V_rᵀ (r, n)``.

    Eckart–Young in Frobenius norm; with ``isotropic`` (Iso-C) the kept singular values are first
    replaced by their mean. Fewer than ``rank`` directions (``min(m, n) < rank``) are zero-padded.
    """
    U, S, Vh = torch.linalg.svd(delta.to(FP), full_matrices=False)
    return lowrank_factors(U, S, Vh, rank, isotropic)


def _cat(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``[B_1 ... B_T] (m, R)`` and ``[A_1; ...; A_T] (R, n)`` in float64."""
    return torch.cat([b.to(FP) for b in Bs], 1), torch.cat([a.to(FP) for a in As], 0)


def _bases(B_cat: Tensor, A_cat: Tensor) -> tuple[Tensor, Tensor]:
    # V_A as the left singular vectors of the tall A_catᵀ: LAPACK's thin SVD of the (n, R) matrix takes
    # ~35 % less time than that of the wide (R, n) one (measured at 4096 x 128: 23 vs 37 ms). Both bases
    # are returned row-major: the SVD gives column-major U, and MKL's float64 (m, R) @ (R, r) product
    # with both operands column-major is ~8x slower than with a row-major U (lifts U_B P, 4096 x 128 x 16)
    U_B = torch.linalg.svd(B_cat, full_matrices=False)[0]
    V_A = torch.linalg.svd(A_cat.T, full_matrices=False)[0]
    return sign_fix(U_B)[0].contiguous(), sign_fix(V_A)[0].contiguous()


def _factors(U_B: Tensor, V_A: Tensor, B_cat: Tensor, A_cat: Tensor, ranks: list[int]) -> tuple[Tensor, Tensor]:
    Lc = U_B.T @ B_cat            # (R, Σ r_t), column block t = U_Bᵀ B_t
    Kc = (A_cat @ V_A).T          # (R, Σ r_t), column block t = V_Aᵀ A_tᵀ
    T, R, k = len(ranks), Lc.shape[0], max(ranks)
    if all(r == k for r in ranks):
        return (Lc.view(R, T, k).permute(1, 0, 2).contiguous(), Kc.view(R, T, k).permute(1, 0, 2).contiguous())
    L, K = Lc.new_zeros(T, R, k), Kc.new_zeros(T, R, k)
    start = 0
    for t, r in enumerate(ranks):
        L[t, :, :r], K[t, :, :r] = Lc[:, start:start + r], Kc[:, start:start + r]
        start += r
    return L, K


def core_bases(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Core-Space bases (CtM step 1): ``U_B (m, R)`` left singular vectors of ``[B_1 ... B_T]``,
    ``V_A (n, R)`` right singular vectors of ``[A_1; ...; A_T]``; R = Σ r_t (thin SVD, sign-fixed).

    ``span(U_B) ⊇ col(B_t)`` and ``span(V_A) ⊇ row(A_t)`` for every t, so ``ΔW_t = U_B M_t V_Aᵀ``
    exactly (:func:`core_matrices`). Cost O((m + n) R²); never forms an m x n matrix.
    """
    return _bases(*_cat(Bs, As))


def core_factors(U_B: Tensor, V_A: Tensor, Bs: Sequence[Tensor], As: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``L_t = U_Bᵀ B_t`` and ``K_t = V_Aᵀ A_tᵀ`` stacked ``(T, R, k)`` (``k = max r_t``, zero-padded), so
    that the core matrices are ``M_t = L_t K_tᵀ`` (:func:`core_matrices`): two ``R x (m or n) x R``
    products instead of ``2 T`` thin ones."""
    return _factors(U_B, V_A, *_cat(Bs, As), [int(b.shape[1]) for b in Bs])


def core_space(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(U_B, V_A, L, K)``: :func:`core_bases` and :func:`core_factors` in one call, the factors
    concatenated once (what CtM and the core-space merge-then-compress bound run)."""
    B_cat, A_cat = _cat(Bs, As)
    U_B, V_A = _bases(B_cat, A_cat)
    return (U_B, V_A, *_factors(U_B, V_A, B_cat, A_cat, [int(b.shape[1]) for b in Bs]))


def core_matrices(U_B: Tensor, V_A: Tensor, Bs: Sequence[Tensor], As: Sequence[Tensor]) -> Tensor:
    """``M_t = (U_Bᵀ B_t)(A_t V_A)`` stacked, ``(T, R, R)`` (CtM step 2; Core Space Eq. for M_t)."""
    L, K = core_factors(U_B, V_A, Bs, As)
    return L @ K.mT


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------

def out_state(inputs: MergeInputs, factors: dict[str, dict[str, Tensor]], rank: int,
              config: dict[str, Any]) -> AdapterState:
    """The merged rank-``rank`` state (alpha = r, scaling 1) from float64 ``factors``; ``config`` is
    added to its metadata (``method``, ``merge`` settings). Raises NumericalError naming a module whose
    factors are not finite; casts the factors to the inputs' common dtype."""
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


# ------------------------------------------------------------------------------------------------
# modules in parallel
# ------------------------------------------------------------------------------------------------

def map_modules(fn: Callable[[_Item], _Out], items: Sequence[_Item], workers: int | None = None) -> list[_Out]:
    """``[fn(x) for x in items]``, computed on ``workers`` threads (default ``torch.get_num_threads()``)
    that each run one item at a time on ONE intra-op thread; results in the order of ``items``.

    The modules of a merge are independent, and much of a module's work is a long chain of small
    (``R x R``, ``R = Σ r_t ~ 10^2``) factorisations that a second intra-op thread cannot speed up
    (:func:`rankwise.merge.ctm.tucker2` runs them on one): one module per thread keeps every core busy.
    With two or more workers every item is computed on one intra-op thread, so the results do not depend
    on how many; with one worker (or one item) ``fn`` runs here, on the caller's threads (the same
    result to rounding: a factorisation's sums may be split differently). The first exception, in
    the order of ``items``, is raised once the running items have finished; items not yet started are
    cancelled. The caller's thread count is restored afterwards (torch keeps one process-wide value).
    """
    items = list(items)
    n = torch.get_num_threads()
    workers = n if workers is None else int(workers)
    workers = max(1, min(workers, len(items)))
    if workers == 1:
        return [fn(x) for x in items]

    def run(x: _Item) -> _Out:
        torch.set_num_threads(1)  # this thread's intra-op pool; torch also records it process-wide
        return fn(x)

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="rankwise-merge") as pool:
            futures: list[Future[_Out]] = [pool.submit(run, x) for x in items]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:  # the pool's exit then waits only for the running ones
                    f.cancel()
                raise
    finally:
        torch.set_num_threads(n)
