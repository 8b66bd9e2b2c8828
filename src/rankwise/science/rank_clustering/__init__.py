"""R-model clustering: k-median / k-means Coreset+ from a noisy, persistent quadruplet comparison oracle.

Spec: ``shared/methods/rank_clustering.md`` ("Metric k-clustering using only Weak Comparison Oracles",
Raychaudhury, Esmailpour, Galhotra, Sintos; ICLR 2026, arXiv 2601.19333).

- :mod:`.oracle`: :class:`QuadrupletOracle` ("is d(a,b) <= d(c,d)?"), simulated with persistent,
  hash-keyed flips at rate ``phi`` or wrapping any callable; counts calls;
- :mod:`.sorting`: PROBSORT (persistent random errors) and ADVSORT (randomised quicksort);
- :mod:`.algorithm`: ALG-G (:class:`RModelClusterer`), the paper's Generic baseline, random centers;
- :mod:`.final`: the exactly-k step (weighted k-means++ / k-medoids on the Coreset+) and costs.

Example::

    import numpy as np
    from rankwise.science.rank_clustering import QuadrupletOracle, RModelClusterer, weighted_kmeanspp
    X = np.random.default_rng(0).normal(size=(2000, 2)) + 10 * np.random.default_rng(1).integers(0, 5, (2000, 1))
    oracle = QuadrupletOracle.from_points(X, error=0.15, seed=0)
    C, M = RModelClusterer(k=5, p=2, seed=0).fit(oracle)
    final = weighted_kmeanspp(X[C], weights=np.bincount(M, minlength=len(X))[C], k=5, seed=0)
"""

from rankwise.core.registry import register
from rankwise.science.rank_clustering.algorithm import (
    CoresetPlus,
    EdgeTester,
    GenericClusterer,
    GenericConfig,
    RModelClusterer,
    RModelConfig,
    fit_coreset_plus,
    random_centers_baseline,
)
from rankwise.science.rank_clustering.final import (
    FinalClustering,
    clustering_cost,
    composed_cost,
    kmedoids,
    optimal_reference,
    weighted_kmeanspp,
)
from rankwise.science.rank_clustering.oracle import (
    OracleBudgetExceeded,
    OracleError,
    OracleInconsistencyError,
    QuadrupletOracle,
    canonical_quadruplets,
    keyed_uniform,
)
from rankwise.science.rank_clustering.sorting import advsort, dislocation, probsort, robust_reinsert

__all__ = [
    "QuadrupletOracle", "OracleError", "OracleInconsistencyError", "OracleBudgetExceeded",
    "canonical_quadruplets", "keyed_uniform",
    "probsort", "advsort", "robust_reinsert", "dislocation",
    "RModelConfig", "RModelClusterer", "CoresetPlus", "EdgeTester", "GenericConfig", "GenericClusterer",
    "fit_coreset_plus", "random_centers_baseline",
    "FinalClustering", "weighted_kmeanspp", "kmedoids", "clustering_cost", "composed_cost", "optimal_reference",
]

register("rank_clustering", config=RModelConfig, entry=fit_coreset_plus)
