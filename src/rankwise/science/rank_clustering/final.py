"""Exactly-k step (paper §4.1) and evaluation: weighted k-means++ / k-medoids on the Coreset+, costs.

The Coreset+ construction never reads coordinates; this last step does, but only those of the
``|C|`` centers (the paper calls the distance oracle here, outside the pure R-model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FinalClustering", "weighted_kmeanspp", "kmedoids", "clustering_cost", "composed_cost",
           "optimal_reference"]


@dataclass
class FinalClustering:
    """``centers`` (k, dim) coordinates; ``labels`` (m,) cluster of each input point; ``cost`` the
    weighted cost ``sum_i w_i d(x_i, center(label_i))^p`` on the inputs; ``medoids`` (k,) input indices
    of the centers when they are input points (p != 2), else None."""

    centers: np.ndarray
    labels: np.ndarray
    cost: float
    medoids: np.ndarray | None = None


def _pairwise(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    d2 = (A * A).sum(1)[:, None] + (B * B).sum(1)[None, :] - 2.0 * A @ B.T
    return np.sqrt(np.maximum(d2, 0.0))


def _seed_pp(X: np.ndarray, w: np.ndarray, k: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """k-means++-style seeding: next center with probability proportional to ``w * d^p``; returns indices."""
    m = X.shape[0]
    first = rng.choice(m, p=w / w.sum())
    idx = [int(first)]
    dmin = np.linalg.norm(X - X[first], axis=1) ** p
    for _ in range(1, k):
        prob = w * dmin
        tot = prob.sum()
        nxt = int(rng.choice(m, p=prob / tot)) if tot > 0 else int(rng.choice(np.setdiff1d(np.arange(m), idx)))
        idx.append(nxt)
        dmin = np.minimum(dmin, np.linalg.norm(X - X[nxt], axis=1) ** p)
    return np.asarray(idx, dtype=np.int64)


def _validate(points: np.ndarray, weights: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(points, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < 1:
        raise ValueError(f"points must have shape (m, dim) with m >= 1, got {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError("points contain non-finite coordinates")
    w = np.ones(X.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (X.shape[0],) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be (m,) = ({X.shape[0]},), finite, nonnegative, not all zero")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not (1 <= k <= X.shape[0]):
        raise ValueError(f"k must be an int in [1, {X.shape[0]}] (the number of points), got {k!r}")
    return X, w


def kmedoids(points: np.ndarray, k: int, weights: np.ndarray | None = None, *, p: float = 1, seed: int = 0,
             n_init: int = 10, max_iter: int = 100, D: np.ndarray | None = None) -> FinalClustering:
    """Weighted k-medoids (alternating: assign to the nearest medoid, re-pick each cluster's medoid
    as the member minimising ``sum w d^p``), ``d^p``-weighted k-means++ seeding, best of ``n_init``.
    ``D`` (m, m): precomputed distances (else Euclidean on ``points``)."""
    X, w = _validate(points, weights, k)
    D = _pairwise(X, X) if D is None else np.asarray(D, dtype=np.float64)
    Dp = D ** p
    rng = np.random.default_rng(seed)
    best: FinalClustering | None = None
    for _ in range(max(1, n_init)):
        med = _seed_pp(X, w, k, p, rng)
        for _it in range(max_iter):
            lab = np.argmin(Dp[:, med], axis=1)
            new = med.copy()
            for c in range(k):
                mem = np.nonzero(lab == c)[0]
                if mem.size:
                    new[c] = mem[np.argmin((Dp[np.ix_(mem, mem)] * w[mem][:, None]).sum(0))]
            if np.array_equal(np.sort(new), np.sort(med)):
                med = new
                break
            med = new
        lab = np.argmin(Dp[:, med], axis=1)
        cost = float(np.sum(w * Dp[np.arange(X.shape[0]), med[lab]]))
        if best is None or cost < best.cost:
            best = FinalClustering(centers=X[med].copy(), labels=lab, cost=cost, medoids=med.copy())
    assert best is not None
    return best


def weighted_kmeanspp(points: np.ndarray, weights: np.ndarray | None, k: int, *, p: float = 2, seed: int = 0,
                      n_init: int = 10, max_iter: int = 300) -> FinalClustering:
    """The paper's exactly-k step: weighted k-means++ on the Coreset+ (``points`` = coordinates of the
    centers ``X[C]`` (|C|, dim), ``weights`` = ``|M^{-1}(c)|``).

    ``p = 2``: scikit-learn's ``KMeans`` (k-means++ seeding with ``sample_weight``, Lloyd, ``n_init``
    restarts). Other ``p`` (1 = k-median): weighted k-medoids on the points with ``d^p`` seeding.
    """
    X, w = _validate(points, weights, k)
    if p == 2:
        from sklearn.cluster import KMeans

        km = KMeans(n_clusters=k, init="k-means++", n_init=n_init, max_iter=max_iter, random_state=seed)
        km.fit(X, sample_weight=w)
        lab = km.labels_.astype(np.int64)
        cost = float(np.sum(w * np.sum((X - km.cluster_centers_[lab]) ** 2, axis=1)))
        return FinalClustering(centers=km.cluster_centers_.copy(), labels=lab, cost=cost)
    return kmedoids(X, k, w, p=p, seed=seed, n_init=n_init, max_iter=max_iter)


def clustering_cost(X: np.ndarray, centers: np.ndarray, p: float = 2) -> float:
    """``cost_p(X, U) = sum_v min_u d(v, u)^p`` (each point to its nearest center), chunked."""
    X = np.asarray(X, dtype=np.float64)
    U = np.asarray(centers, dtype=np.float64)
    tot = 0.0
    for lo in range(0, X.shape[0], 4096):
        tot += float(np.sum(_pairwise(X[lo:lo + 4096], U).min(axis=1) ** p))
    return tot


def composed_cost(X: np.ndarray, mapping: np.ndarray, centers_idx: np.ndarray, final: FinalClustering,
                  p: float = 2) -> float:
    """Cost of the composed mapping ``v -> M(v) -> final center of M(v)`` (the spec's evaluation choice)."""
    X = np.asarray(X, dtype=np.float64)
    pos = np.full(X.shape[0], -1, dtype=np.int64)
    pos[centers_idx] = np.arange(centers_idx.size)
    lab = final.labels[pos[mapping]]
    d = np.linalg.norm(X - final.centers[lab], axis=1)
    return float(np.sum(d ** p))


def optimal_reference(X: np.ndarray, k: int, p: float = 2, seed: int = 0, n_init: int = 10) -> tuple[float, np.ndarray]:
    """The paper's "Optimal" reference on true coordinates: scikit-learn ``KMeans(n_init=10)`` for p = 2,
    local weighted k-medoids on true distances for other p. Returns ``(cost, centers)``."""
    X = np.asarray(X, dtype=np.float64)
    if p == 2:
        from sklearn.cluster import KMeans

        km = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(X)
        return float(km.inertia_), km.cluster_centers_
    if X.shape[0] > 6000:
        raise ValueError("k-medoids reference needs the full distance matrix; use n <= 6000")
    fc = kmedoids(X, k, p=p, seed=seed, n_init=max(1, n_init // 2))
    return fc.cost, fc.centers
