"""E²LoRA's math, no model needed: gradient entropy, the similarity matrix, adaptive thresholds,
the interval partition and the rank allocation."""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from rankwise.adapt.e2lora.config import HRA_SCORES, ROUNDINGS, SIMILARITIES, _HALF_LOG_2PI_E, _pos_int
from rankwise.core.adapters import deprecated_kwargs
from rankwise.core.errors import NumericalError


# ------------------------------------------------------------------------------------------------
# the math (no model needed)
# ------------------------------------------------------------------------------------------------

def entropy_from_std(sigma: float) -> float:
    """``H = log sigma + 1/2 log(2 pi) + 1/2`` (step 2); ``sigma = 0`` gives ``-inf``."""
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}")
    return -math.inf if sigma == 0 else math.log(sigma) + _HALF_LOG_2PI_E


def _moments(G: torch.Tensor) -> tuple[int, float, float]:
    """``(n, mean, population variance)`` of the elements of ``G`` in float64."""
    g = G.detach().reshape(-1).to(torch.float64)
    if g.numel() == 0:
        raise ValueError("a gradient with no elements has no entropy")
    mean = g.mean()
    return g.numel(), float(mean), float((g - mean).square().mean())


def proxy_entropy(G: torch.Tensor) -> float:
    """Proxy entropy ``H(G) = log sigma + 1/2 log(2 pi) + 1/2`` of the elements of ``G`` (any shape; step 2)."""
    _, _, var = _moments(G)
    return entropy_from_std(math.sqrt(var))


def _joint_var(a: tuple[int, float, float], b: tuple[int, float, float]) -> float:
    """Population variance of the concatenation of two samples with moments ``a``, ``b`` (parallel formula)."""
    (na, ma, va), (nb, mb, vb) = a, b
    n = na + nb
    return (na * va + nb * vb) / n + na * nb * (ma - mb) ** 2 / (n * n)


def similarity_matrix(grads: Sequence[torch.Tensor], kind: str = "rmi") -> tuple[list[float], torch.Tensor]:
    """Entropies ``H_l`` and the ``N x N`` similarity matrix of the gradients ``grads`` (steps 2-3).

    ``kind="rmi"``: ``RMI_ij = (H_i + H_j - H(G_i, G_j)) / min(H_i, H_j)`` with the joint entropy of the
    concatenation ``[vec G_i ; vec G_j]`` (float64; symmetric; ``RMI_ii = 1`` up to rounding).
    ``kind="cosine"``: cosine similarity of ``vec G_i`` and ``vec G_j`` (same sizes required).
    Returns ``(H (N,), S (N, N) float64)``.
    """
    if kind not in SIMILARITIES:
        raise ValueError(f"similarity kind must be one of {SIMILARITIES}, got {kind!r}")
    if not grads:
        raise ValueError("similarity_matrix needs at least one gradient")
    mom = [_moments(g) for g in grads]
    H = [entropy_from_std(math.sqrt(v)) for _, _, v in mom]
    N = len(grads)
    S = torch.eye(N, dtype=torch.float64)
    if kind == "cosine":
        flat = [g.detach().reshape(-1).to(torch.float64) for g in grads]
        if len({f.numel() for f in flat}) != 1:
            raise ValueError("cosine similarity needs gradients of one size")
        X = torch.stack(flat)
        nrm = X.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        return H, (X @ X.T) / (nrm[:, None] * nrm[None, :])
    for i in range(N):
        for j in range(N):
            hij = entropy_from_std(math.sqrt(_joint_var(mom[i], mom[j])))
            S[i, j] = (H[i] + H[j] - hij) / min(H[i], H[j])
    return H, S


def adaptive_thresholds(S: torch.Tensor) -> list[float | None]:
    """``tau_m = 1/(N-1) sum_{k != m} S_mk`` (step 4); ``[None]`` for ``N = 1``."""
    N = S.shape[0]
    if S.ndim != 2 or S.shape[1] != N:
        raise ValueError(f"the similarity matrix must be square, got shape {tuple(S.shape)}")
    if N == 1:
        return [None]
    S = S.to(torch.float64)
    off = S.sum(1) - S.diagonal()
    return [float(v) / (N - 1) for v in off]


def partition(S: torch.Tensor, thresholds: Sequence[float | None]) -> list[list[int]]:
    """Greedy Local-Similarity Sharing (step 5): contiguous intervals covering ``0..N-1``.

    An interval starts at the first unassigned layer ``s`` and takes the next layer ``j`` while
    ``S[s, j] >= thresholds[s]`` (comparison with the interval's START layer and its threshold).
    """
    N = S.shape[0]
    if len(thresholds) != N:
        raise ValueError(f"need one threshold per layer ({N}), got {len(thresholds)}")
    out: list[list[int]] = []
    s = 0
    while s < N:
        cur = [s]
        j = s + 1
        while j < N and thresholds[s] is not None and float(S[s, j]) >= float(thresholds[s]):
            cur.append(j)
            j += 1
        out.append(cur)
        s = j
    return out


@deprecated_kwargs(base_rank="rank")
def allocate_ranks(H: Sequence[float], intervals: Sequence[Sequence[int]], rank: int, *,
                   score: str = "paper", rounding: str = "round", max_rank: int | None = None,
                   where: str = "") -> tuple[list[int], list[float], list[float]]:
    """Heterogeneous Rank Allocation (step 6): ``(ranks r_k, interval entropies H_k, factors F_k)``.

    ``H_k = max_{l in I_k} H_l``; ``score="paper"``: ``F_k = H_k / sum_i H_i``; ``"shifted"``: scores
    ``H_k - min_i H_i + 1`` normalised. Budget ``T = K * rank``; ``rounding="round"``:
    ``r_k = round(F_k T)``; ``"largest_remainder"``: floors plus one for the largest remainders (ties to the
    earlier interval), so ``sum r_k = T`` exactly. Ranks below 1 become 1 (a warning; with
    ``largest_remainder`` the unit is taken from the largest rank so the sum stays ``T``); ranks above
    ``max_rank`` are capped (a warning).
    """
    if score not in HRA_SCORES:
        raise ValueError(f"score must be one of {HRA_SCORES}, got {score!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if not _pos_int(rank):
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    K = len(intervals)
    Hk = [max(float(H[i]) for i in iv) for iv in intervals]
    if not all(math.isfinite(h) for h in Hk):
        raise NumericalError(f"{where}non-finite interval entropy {Hk}; a gradient is zero or not finite")
    if score == "paper":
        scores = Hk
    else:
        lo = min(Hk)
        scores = [h - lo + 1.0 for h in Hk]
    total = sum(scores)
    if total == 0 or not math.isfinite(total):
        raise NumericalError(f"{where}the HRA scores {scores} sum to {total}; cannot form allocation factors")
    F = [s / total for s in scores]
    if any(f < 0 for f in F):
        raise NumericalError(f"{where}negative allocation factors {F} (entropies of mixed sign)")
    T = K * rank
    quota = [f * T for f in F]
    if rounding == "round":
        ranks = [int(round(q)) for q in quota]
    else:
        ranks = [int(math.floor(q)) for q in quota]
        rest = T - sum(ranks)
        order = sorted(range(K), key=lambda k: (-(quota[k] - ranks[k]), k))
        for k in order[:rest]:
            ranks[k] += 1
    low = [k for k, r in enumerate(ranks) if r < 1]
    if low:
        warnings.warn(f"{where}HRA gave rank 0 to interval(s) {low} (rank={rank}); clamped to 1",
                      stacklevel=2)
        for k in low:
            ranks[k] = 1
            if rounding == "largest_remainder":
                big = max(range(K), key=lambda i: (ranks[i], -i))
                ranks[big] -= 1
    if max_rank is not None and any(r > max_rank for r in ranks):
        warnings.warn(f"{where}HRA ranks {ranks} exceed min(d_in, d_out) = {max_rank}; capped", stacklevel=2)
        ranks = [min(r, max_rank) for r in ranks]
    return ranks, Hk, F
