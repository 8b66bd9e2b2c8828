"""Reproduction of R-model clustering (spec ``shared/methods/rank_clustering.md``): k-means / k-median
from a noisy, persistent quadruplet oracle only.

Data: Gaussian blobs (scikit-learn ``make_blobs`` defaults: sigma = 1, centers uniform in [-10, 10]^d,
``random_state = seed``) and, in full mode, scikit-learn's digits (n = 1797, 64-dim). The oracle is
simulated from Euclidean distances with persistent hash-keyed flips at rate phi; the algorithms see
nothing else. The exactly-k step is weighted k-means++ (p = 2) / weighted k-medoids (p = 1) on the
Coreset+, evaluated on the composed mapping v -> M(v) -> final center of M(v) (the spec's choice).

Quick (blobs in R^2, n = 2000, k = 5, p = 2): ALG-G and Generic at phi in {0.05, 0.15, 0.25},
random centers at phi = 0.15, Optimal = scikit-learn KMeans(n_init=10) on true coordinates; claims
(a)-(e) on blobs with the spec's quick margins (x 1.2).
Full: the quick runs, n in {1000, 2000, 4000, 10000}, k in {4..8}, phi in {0, .05, .1, .15, .2, .25},
digits k = 10 with p in {1, 2}, the "pick-mins" nearest variant, and the all-pairs PROBSORT reference
for query counts; the spec's full thresholds.

Sizes, noise rates and sweeps are :class:`RankClusteringSettings` (``SETTINGS[mode]``; ``rankwise
reproduce rank_clustering --set n=4000 phi=0.1``). The checks are ``claim`` checks on cost ratios (no
paired per-example samples).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from rankwise.repro.result import ClaimCheck, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, merge_in_order, pyplot, save_figure, setting
from rankwise.science.rank_clustering import (
    GenericClusterer,
    QuadrupletOracle,
    RModelClusterer,
    clustering_cost,
    composed_cost,
    optimal_reference,
    probsort,
    random_centers_baseline,
    weighted_kmeanspp,
)

ID = "rank_clustering"
CLAIM = ("From a noisy (phi = 0.15), persistent quadruplet oracle alone, ALG-G builds an O(1)-Coreset+ with "
         "O(k polylog n) centers and O(nk polylog n) queries whose exactly-k clustering is close to Optimal, while "
         "the Generic baseline that trusts raw answers is several times worse and degrades with noise.")
NEAREST = "pick-mins"  # ALG-G step 4, spec's re-impl. option (the library default); "sort" is reported too
OTHER = "sort"


def _blobs(n: int, k: int, dim: int, seed: int) -> np.ndarray:
    from sklearn.datasets import make_blobs

    X, _ = make_blobs(n_samples=n, centers=k, n_features=dim, cluster_std=1.0, center_box=(-10.0, 10.0),
                      random_state=seed)
    return X


def _digits() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().data.astype(np.float64)


def _run_one(X: np.ndarray, k: int, p: float, phi: float, seed: int, algo: str, opt: float,
             nearest: str = NEAREST, kernel_factor: float = 2.0, knockout: str = "bracket") -> dict[str, float]:
    """One clustering run; returns the metrics (costs relative to ``opt``)."""
    n = X.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # phi = 0.25 is outside the theory: expected, reported
        oracle = QuadrupletOracle.from_points(X, error=phi, seed=1000 + seed, track_distinct=False)
    t0 = time.perf_counter()
    if algo == "ALG-G":
        res = RModelClusterer(k=k, p=p, nearest=nearest, kernel_factor=kernel_factor, knockout=knockout, seed=seed).fit(oracle)
    elif algo == "Generic":
        res = GenericClusterer(k=k, seed=seed).fit(oracle)
    elif algo == "random":
        res = random_centers_baseline(oracle, k, seed=seed)
    else:  # pragma: no cover
        raise ValueError(algo)
    C, M = res
    if algo == "random":
        from rankwise.science.rank_clustering.final import FinalClustering

        fin = FinalClustering(centers=X[C], labels=np.arange(k), cost=0.0)
    else:
        fin = weighted_kmeanspp(X[C], res.weights, k, p=p, seed=seed)
    wall = time.perf_counter() - t0
    return {"final": composed_cost(X, M, C, fin, p=p) / opt, "final_nearest": clustering_cost(X, fin.centers, p) / opt,
            "coreset": res.cost(X, p) / opt, "size": float(res.size), "calls": float(res.num_calls),
            "calls_norm": res.num_calls / (n * k * math.log(n) ** 2), "wall": wall}


COLS = ["final cost / Optimal", "final (nearest-center) / Optimal", "Coreset+ cost / Optimal", "|C|",
        "oracle calls", "calls / (n k ln^2 n)", "wall s"]
KEYS = ["final", "final_nearest", "coreset", "size", "calls", "calls_norm", "wall"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankClusteringSettings(Settings):
    """What the rank-clustering reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    n: int = setting(2000, "points of the blobs of the claims", lo=2)
    k: int = setting(5, "clusters of the blobs of the claims", lo=1)
    phi: float = setting(0.15, "oracle error rate of the claims", lo=0.0, hi=0.5)
    margin: float = setting(1.2, "factor on every threshold (the spec's quick margins: 1.2; full: 1.0)", lo=0.0)
    phi_sweep: tuple[float, ...] = setting((0.05, 0.15, 0.25), "oracle error rates run (must hold 0.05, phi, 0.25)",
                                           lo=0.0, hi=0.5)
    n_sweep: tuple[int, ...] = setting((), "point counts of the query-complexity sweep (full)", lo=2)
    k_sweep: tuple[int, ...] = setting((), "cluster counts of the k sweep (full)", lo=1)
    digits: bool = setting(False, "the full-mode extras: digits (k = 10, p in {1, 2}), all-pairs reference, "
                                  "their checks")
    nearest_variant: str = setting("first seed", "run the nearest='sort' ALG-G variant on no seed, the first seed "
                                                 "or every seed", choices=("none", "first seed", "every seed"))
    allpairs: tuple[int, ...] = setting((), "point counts of the all-pairs PROBSORT reference", lo=2)
    kernel_factor: float = setting(2.0, "ALG-G's kernel size is max(12, floor(kernel_factor floor(log2 |V_i|))): the "
                                   "constant of the spec's Theta(log n) (2: the smallest integer for which the log "
                                   "term is active at every n >= 1000; the third-party re-impl. used 1.2)", lo=0.0)
    knockout: str = setting("bracket", "ALG-G's nearest-sample knockout (pick-mins): a single-elimination bracket "
                            "or the sequential champion of the re-impl.", choices=("bracket", "sequential"))

    def validate(self) -> None:
        for phi in (0.05, self.phi, 0.25):
            if phi not in self.phi_sweep:
                raise ValueError(f"RankClusteringSettings.phi_sweep must hold {phi:g} (the claims use it), "
                                 f"got {self.phi_sweep!r}")


SETTINGS: dict[str, RankClusteringSettings] = {
    "smoke": RankClusteringSettings(n=250, k=3, nearest_variant="none"),
    "quick": RankClusteringSettings(),
    "full": RankClusteringSettings(margin=1.0, phi_sweep=(0.0, 0.05, 0.1, 0.15, 0.2, 0.25),
                                   n_sweep=(1000, 2000, 4000, 10_000), k_sweep=(4, 5, 6, 7, 8), digits=True,
                                   nearest_variant="every seed", allpairs=(40, 80, 160)),
}
TABLE_NOTES = {
    "final cost / Optimal": "exactly-k cost of the composed mapping v -> M(v) -> final center, / Optimal",
    "final (nearest-center) / Optimal": "cost_p(V, U) of the k final centers with nearest-center assignment",
    "Coreset+ cost / Optimal": "sum_v d(v, M(v))^p / Optimal",
    "oracle calls": "quadruplet queries of the Coreset+ construction (the final step uses |C| coordinates)"}


def _seed(S: dict[str, Any], seed: int, first: bool) -> dict[str, Any]:
    """One seed: its table fragment, runs, sweep data and (first seed) the scatter of the figure."""
    n0, k0, phi0 = S["n"], S["k"], S["phi"]
    sweep_n, sweep_k = list(S["n_sweep"]), list(S["k_sweep"])
    sweep_phi = list(S["phi_sweep"])
    full = S["nearest_variant"] == "every seed"
    table = Table(columns=COLS)
    runs: dict[str, list[dict[str, float]]] = {}

    def record(row: str, met: dict[str, float]) -> None:
        runs.setdefault(row, []).append(met)
        for col, key in zip(COLS, KEYS):
            table.add(row, col, met[key])

    opt_cache: dict[tuple[Any, ...], float] = {}
    extra: dict[str, Any] = {"n_sweep": {}, "k_sweep": {}, "phi_sweep": {}, "digits": {}, "allpairs": {}}
    scatter: dict[str, Any] = {}
    def run(*a: Any, **kw: Any) -> dict[str, float]:
        return _run_one(*a, kernel_factor=S["kernel_factor"], knockout=S["knockout"], **kw)

    X = _blobs(n0, k0, 2, seed)
    opt = optimal_reference(X, k0, 2, seed=seed)[0]
    opt_cache[("blobs", n0, k0, seed)] = opt
    table.add("Optimal (KMeans n_init=10, true coordinates)", "final cost / Optimal", 1.0)
    for phi in sweep_phi:
        for algo in ("ALG-G", "Generic"):
            met = run(X, k0, 2, phi, seed, algo, opt)
            record(f"{algo} phi={phi:g}", met)
            extra["phi_sweep"].setdefault(f"{algo}", {}).setdefault(f"{phi:g}", []).append(met["final"])
    record(f"random {k0} centers + knockout phi={phi0:g}", run(X, k0, 2, phi0, seed, "random", opt))
    if full or (S["nearest_variant"] == "first seed" and first):  # quick: the first seed only (time)
        record(f"ALG-G (nearest={OTHER}) phi={phi0:g}", run(X, k0, 2, phi0, seed, "ALG-G", opt, nearest=OTHER))
    if first:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oracle = QuadrupletOracle.from_points(X, error=phi0, seed=1000 + seed, track_distinct=False)
        res = RModelClusterer(k=k0, nearest=NEAREST, seed=seed).fit(oracle)
        fin = weighted_kmeanspp(X[res.centers], res.weights, k0, seed=seed)
        scatter = {"X": X, "C": res.centers, "w": res.weights, "final": fin.centers, "M": res.mapping}
    for n in sweep_n:
        Xn = X if n == n0 else _blobs(n, k0, 2, seed)
        optn = opt if n == n0 else optimal_reference(Xn, k0, 2, seed=seed)[0]
        for algo in ("ALG-G", "Generic"):
            met = runs[f"{algo} phi={phi0:g}"][-1] if n == n0 else run(Xn, k0, 2, phi0, seed, algo, optn)
            if n != n0:
                record(f"{algo} n={n}", met)
            extra["n_sweep"].setdefault(algo, {}).setdefault(str(n), []).append(met)
    for k in sweep_k:
        Xk = X if k == k0 else _blobs(n0, k, 2, seed)
        optk = opt if k == k0 else optimal_reference(Xk, k, 2, seed=seed)[0]
        for algo in ("ALG-G", "Generic"):
            met = runs[f"{algo} phi={phi0:g}"][-1] if k == k0 else run(Xk, k, 2, phi0, seed, algo, optk)
            if k != k0:
                record(f"{algo} k={k}", met)
            extra["k_sweep"].setdefault(algo, {}).setdefault(str(k), []).append(met["final"])
    if S["digits"]:
        D = _digits()
        for p in (2, 1):
            optd = optimal_reference(D, 10, p, seed=seed)[0]
            for algo in ("ALG-G", "Generic"):
                met = run(D, 10, p, phi0, seed, algo, optd)
                record(f"{algo} digits k=10 p={p}", met)
                extra["digits"].setdefault(f"{algo} p={p}", []).append(met)
    return {"table": table, "runs": runs, "extra": extra, "scatter": scatter}


def _allpairs(S: dict[str, Any], seeds: list[int]) -> dict[str, int]:
    k0, phi0 = S["k"], S["phi"]
    out: dict[str, int] = {}
    for n in S["allpairs"]:
        X = _blobs(n, k0, 2, seeds[0])
        oracle = QuadrupletOracle.from_points(X, error=phi0, seed=7, track_distinct=False)
        a, b = np.triu_indices(n, 1)
        probsort(a.size, lambda e, f: oracle.compare(a[e], b[e], a[f], b[f]))
        out[str(n)] = oracle.num_calls
    return out


def _checks(S: dict[str, Any], runs: dict[str, list[dict[str, float]]], extra: dict[str, Any]
            ) -> tuple[list[ClaimCheck], Any, dict[str, float]]:
    n0, k0, phi0 = S["n"], S["k"], S["phi"]
    sweep_n = list(S["n_sweep"])
    margin = S["margin"]
    phis_claim = (0.05, 0.25)
    def mean(row: str, key: str) -> float:
        return float(np.mean([m[key] for m in runs[row]]))

    g, gen = f"ALG-G phi={phi0:g}", f"Generic phi={phi0:g}"
    lo_phi, hi_phi = phis_claim
    alg_growth = mean(f"ALG-G phi={hi_phi:g}", "final") / mean(f"ALG-G phi={lo_phi:g}", "final")
    gen_growth = mean(f"Generic phi={hi_phi:g}", "final") / mean(f"Generic phi={lo_phi:g}", "final")
    ln2 = math.log(n0) ** 2
    checks = [
        ClaimCheck(f"(a) ALG-G final-k cost / Optimal on blobs at phi={phi0:g} (composed mapping)",
                   mean(g, "final"), "<=", 1.25 * margin, unit="x"),
        ClaimCheck(f"(b) Generic final-k cost / ALG-G final-k cost on blobs at phi={phi0:g}",
                   mean(gen, "final") / mean(g, "final"), ">=", 2.0 / margin, unit="x"),
        ClaimCheck(f"(c) ALG-G cost at phi={hi_phi:g} / its cost at phi={lo_phi:g} (nearly flat)", alg_growth, "<=",
                   1.3 * margin, unit="x"),
        ClaimCheck(f"(c) Generic's cost grows more than ALG-G's from phi={lo_phi:g} to {hi_phi:g} "
                   "(difference of the growth ratios)", gen_growth - alg_growth, ">", 0.0),
        ClaimCheck("(d) ALG-G Coreset+ cost cost_p(C, M) / Optimal (p=2, blobs)", mean(g, "coreset"), "<=",
                   2.0 * margin, unit="x"),
        ClaimCheck(f"(d) ALG-G |C| / (4 k ln^2 n) at n={n0}", mean(g, "size") / (4 * k0 * ln2), "<=", margin),
        ClaimCheck(f"(e) ALG-G oracle calls / (n k ln^2 n) at n={n0}", mean(g, "calls_norm"), "<=", 50.0 * margin),
    ]
    if S["digits"]:
        dig2 = float(np.mean([m["final"] for m in extra["digits"]["ALG-G p=2"]]))
        dig1c = float(np.mean([m["coreset"] for m in extra["digits"]["ALG-G p=1"]]))
        checks.insert(1, ClaimCheck("(a) ALG-G final-k cost / Optimal on digits (k=10, p=2) at phi=0.15", dig2, "<=",
                                    1.5, unit="x"))
        checks.insert(6, ClaimCheck("(d) ALG-G Coreset+ cost / k-medoids (p=1, digits)", dig1c, "<=", 2.0, unit="x"))
        ns = np.array(sweep_n, dtype=float)
        calls = np.array([np.mean([m["calls"] for m in extra["n_sweep"]["ALG-G"][str(n)]]) for n in sweep_n])
        slope = float(np.polyfit(np.log(ns), np.log(calls), 1)[0])
        extra["calls_slope"] = slope
        size10k = float(np.mean([m["size"] for m in extra["n_sweep"]["ALG-G"]["10000"]]))
        checks += [
            ClaimCheck("(d) ALG-G |C| / (0.05 n) at n=10^4 (paper: 187 centers)", size10k / 500.0, "<=", 1.0),
            ClaimCheck("(e) log-log slope of ALG-G oracle calls vs n over {1e3, 2e3, 4e3, 1e4} (all-pairs ~2)",
                       slope, "<=", 1.35),
        ]
        ap = extra["allpairs"]
        extra["allpairs_slope"] = float(np.polyfit(np.log([float(x) for x in ap]), np.log(list(ap.values())), 1)[0])

    return checks, mean, {"alg_growth": alg_growth, "gen_growth": gen_growth, "lo_phi": lo_phi, "hi_phi": hi_phi}


def _figures(S: dict[str, Any], seeds: list[int], runs: dict[str, list[dict[str, float]]], extra: dict[str, Any],
             scatter: dict[str, Any], out_dir: Path) -> list[str]:
    n0, k0, phi0 = S["n"], S["k"], S["phi"]
    sweep_n, sweep_k = list(S["n_sweep"]), list(S["k_sweep"])
    g, gen = f"ALG-G phi={phi0:g}", f"Generic phi={phi0:g}"
    # ------------------------------------------------------------------------------- figures
    plt = pyplot()

    figures: list[str] = []
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for row, style in ((g, "o"), (gen, "s"), (f"random {k0} centers + knockout phi={phi0:g}", "^"),
                       (f"ALG-G (nearest={OTHER}) phi={phi0:g}", "D")):
        if row in runs:
            ax.scatter([m["calls"] for m in runs[row]], [m["final"] for m in runs[row]], marker=style, label=row)
    ax.axhline(1.0, color="k", lw=0.7, ls=":", label="Optimal (KMeans on true coordinates)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of oracle queries")
    ax.set_ylabel("final k-means cost / Optimal")
    ax.set_title(f"blobs n={n0}, k={k0}, phi={phi0:g} (one point per seed)")
    ax.legend(fontsize=7)
    figures.append(save_figure(fig, out_dir / "cost_vs_queries.png", bbox_inches="tight"))

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for algo, mk in (("ALG-G", "o-"), ("Generic", "s-")):
        xs = sorted(float(x) for x in extra["phi_sweep"][algo])
        ax.plot(xs, [np.mean(extra["phi_sweep"][algo][f"{x:g}"]) for x in xs], mk, label=algo)
    ax.set_yscale("log")
    ax.set_xlabel("oracle error rate phi (persistent)")
    ax.set_ylabel("final k-means cost / Optimal")
    ax.set_title(f"noise sensitivity, blobs n={n0}, k={k0}")
    ax.legend()
    figures.append(save_figure(fig, out_dir / "cost_vs_noise.png", bbox_inches="tight"))

    if scatter:
        fig, ax = plt.subplots(figsize=(6, 6))
        Xs = scatter["X"]
        ax.scatter(Xs[:, 0], Xs[:, 1], s=3, c="0.7", label="points")
        ax.scatter(Xs[scatter["C"], 0], Xs[scatter["C"], 1], s=4 + 2 * scatter["w"], c="C0", alpha=0.6,
                   label=f"Coreset+ centers (|C|={scatter['C'].size}, size = weight)")
        ax.scatter(scatter["final"][:, 0], scatter["final"][:, 1], marker="X", s=150, c="C3", label="final k centers")
        ax.set_title(f"ALG-G on blobs, phi={phi0:g}, seed {seeds[0]}")
        ax.legend(fontsize=7, loc="best")
        figures.append(save_figure(fig, out_dir / "coreset_blobs.png", bbox_inches="tight"))

    if S["allpairs"] and sweep_n:
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.5))
        ax = axs[0]
        for algo, mk in (("ALG-G", "o-"), ("Generic", "s-")):
            calls = [np.mean([m["calls"] for m in extra["n_sweep"][algo][str(n)]]) for n in sweep_n]
            sl = float(np.polyfit(np.log(sweep_n), np.log(calls), 1)[0])
            ax.loglog(sweep_n, calls, mk, label=f"{algo} (slope {sl:.2f})")
        nn = np.array(sweep_n, dtype=float)
        ax.loglog(nn, 50 * nn * k0 * np.log(nn) ** 2, "k:", label="50 n k ln^2 n (claim bound)")
        ap = extra["allpairs"]
        ax.loglog([float(x) for x in ap], list(ap.values()), "x--",
                  label=f"all-pairs PROBSORT (slope {extra['allpairs_slope']:.2f})")
        ax.set_xlabel("n")
        ax.set_ylabel("oracle queries")
        ax.set_title("query complexity")
        ax.legend(fontsize=7)
        ax = axs[1]
        for algo, mk in (("ALG-G", "o-"), ("Generic", "s-")):
            ax.plot(sweep_k, [np.mean(extra["k_sweep"][algo][str(k)]) for k in sweep_k], mk, label=algo)
        ax.set_yscale("log")
        ax.set_xlabel("k")
        ax.set_ylabel("final k-means cost / Optimal")
        ax.set_title(f"blobs n={n0}, phi={phi0:g}")
        ax.legend()
        figures.append(save_figure(fig, out_dir / "queries_and_k.png", bbox_inches="tight"))

    return figures


def _notes(S: dict[str, Any], checks: list[ClaimCheck], runs: dict[str, list[dict[str, float]]],
           extra: dict[str, Any], mean: Any, growth: dict[str, float]) -> str:
    phi0 = S["phi"]
    full = S["digits"]
    g = f"ALG-G phi={phi0:g}"
    alg_growth, gen_growth, lo_phi, hi_phi = (growth[k] for k in ("alg_growth", "gen_growth", "lo_phi", "hi_phi"))
    for d in ("n_sweep",):
        for algo in extra[d]:
            for key in extra[d][algo]:
                extra[d][algo][key] = [{kk: float(v) for kk, v in m.items()} for m in extra[d][algo][key]]
    notes = (
        f"ALG-G with the spec's re-impl. constants (|S1|=max(6,3k), |S2|=max(24,8k,80), guard kernel/3 after a gap "
        f"delta=5, keep 75%, assign |V_i|/2, stop at 100), nearest='{NEAREST}', except the kernel: max(12, "
        f"floor({S['kernel_factor']:g} floor(log2|V_i|))) (the re-impl.'s factor 1.2 leaves ALG-TESTER at 7 votes for "
        f"every n < 8192; 2 is the smallest integer factor that makes the spec's Theta(log n) term active "
        f"at every n >= 1000), and the nearest-sample knockout is a {S['knockout']} one. Our additions, documented in docs/methods/rank_clustering.md: PROBSORT ends with a "
        "robust re-insertion pass (window majorities) because the windowed merge alone leaves items hundreds of "
        "ranks away under persistent errors; ALG-TESTER votes with the first kernel-delta kernel points (odd). "
        "Optimal is scikit-learn KMeans(n_init=10) on true coordinates (p=2) or local k-medoids (p=1), not the true "
        "optimum. The final-k step reads the coordinates of the |C| centers only. Costs are means over seeds of "
        "cost / Optimal per seed. The composed-mapping cost (spec's choice, used in the claims) also pays for "
        "points whose Coreset+ center falls on the other side of a final-cluster boundary; make_blobs' default "
        "boxes often overlap clusters, which makes this penalty visible (the nearest-center column shows the "
        "cost of the same final centers with nearest assignment).")
    if not full:
        notes += " Quick mode: blobs only, the spec's margins x1.2 on every threshold."
    if not checks[0].holds:
        notes += (f" Claim (a) missed on blobs: the composed-mapping cost is {mean(g, 'final'):.3g}x Optimal while the "
                  f"same final centers with nearest-center assignment cost {mean(g, 'final_nearest'):.3g}x; the gap is "
                  "the price of evaluating through the Coreset+ mapping on overlapping blobs (ALG-G's tester is a "
                  "factor-2 comparator, so some points map to a sample across a final-cluster boundary).")
        if "ALG-G phi=0" in runs:
            notes += (f" Even without noise ALG-G's composed cost is {mean('ALG-G phi=0', 'final'):.3g}x, against "
                      f"{mean('Generic phi=0', 'final'):.3g}x for Generic, whose exact knockout is optimal at phi=0.")
    flat = next(c for c in checks if c.statement.startswith("(c) ALG-G cost"))
    if not flat.holds:
        notes += (f" Claim (c) 'nearly flat' missed: ALG-G's cost grows {alg_growth:.3g}x from phi={lo_phi:g} to "
                  f"{hi_phi:g} (Generic: {gen_growth:.3g}x). phi=0.25 is outside the theory (phi < 1/4): there PROBSORT's "
                  "worst dislocation jumps from ~15 to hundreds of ranks on 2000 items and ALG-TESTER's majority "
                  "errs more often (at factor 1.2: 7 votes, wrong ~7% of the time; at factor 2 and n=2000: 15 votes, "
                  "~1.7%), so kernels and nearest samples degrade.")
    return notes


class RankClusteringReproduction(Reproduction[RankClusteringSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS

    def measure(self, settings: RankClusteringSettings, seed: int) -> dict[str, Any]:
        first = not hasattr(self, "_first_done")
        self._first_done = True
        return _seed(dataclasses.asdict(settings), seed, first)

    def measure_joint(self, settings: RankClusteringSettings, records: Records[dict]) -> dict[str, Any]:
        runs = merge_in_order([r["runs"] for r in records])
        extra = merge_in_order([r["extra"] for r in records])
        extra["allpairs"] = _allpairs(dataclasses.asdict(settings), records.seeds)
        return {"runs": runs, "extra": extra}

    def table(self, settings: RankClusteringSettings, records: Records[dict]) -> Table:
        table = Table(columns=COLS, notes=dict(TABLE_NOTES))
        for r in records:
            table.extend(r["table"])
        return table

    def checks(self, settings: RankClusteringSettings, records: Records[dict]) -> list[ClaimCheck]:
        self._checks = _checks(dataclasses.asdict(settings), records.joint["runs"], records.joint["extra"])
        return self._checks[0]

    def figures(self, settings: RankClusteringSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _figures(dataclasses.asdict(settings), records.seeds, records.joint["runs"], records.joint["extra"],
                        records.first["scatter"], out_dir)

    def notes(self, settings: RankClusteringSettings, records: Records[dict]) -> str:
        checks, mean, growth = self._checks
        return _notes(dataclasses.asdict(settings), checks, records.joint["runs"], records.joint["extra"], mean, growth)

    def config(self, settings: RankClusteringSettings, records: Records[dict]) -> dict[str, Any]:
        return {"n": settings.n, "k": settings.k, "p": 2, "phi": settings.phi,
                "data": "make_blobs(sigma=1, center_box=(-10,10), dim=2)", "phi_sweep": list(settings.phi_sweep),
                "n_sweep": list(settings.n_sweep), "k_sweep": list(settings.k_sweep), "nearest": NEAREST,
                "digits": settings.digits, "margin_factor": settings.margin}

    def extra(self, settings: RankClusteringSettings, records: Records[dict]) -> dict[str, Any]:
        extra = records.joint["extra"]
        return {k: v for k, v in extra.items() if k != "phi_sweep"} | {"phi_sweep": extra["phi_sweep"]}


REPRODUCTION = RankClusteringReproduction
run = RankClusteringReproduction.run
