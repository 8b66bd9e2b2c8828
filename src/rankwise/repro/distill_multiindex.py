"""Reproduction of Distill-MIM (spec ``shared/methods/distill_multiindex.md``).

Per seed ``s``: the teacher ``MultiIndexTask(d, r, link="quadratic", seed=1000 + s)`` (task seeds
apart from the development task 0), real data ``task.sample(12000, seed=s)`` split 8000 / 4000 for
the two stages of ``Alg``, the reference algorithm ``TwoLayerAlg(width=L)``. Every trained model
is evaluated the standard DD way: retrained from ``EVAL_INITS`` new initialisations (seeds never
used in distillation) and scored by the test MSE on 10^4 fresh samples normalised by ``Var(y)``.

Quick mode runs one seed (0) at the method's default 1000 stage-1 steps and 200 stage-2 steps (the spec's
quick mode is one seed with margins x1.5; two seeds x 500 steps cost the same and stopped stage 1 before it
converged); full mode uses the defaults (1000 / 300) on three seeds.

Which stage-2 protocol the thresholds belong to: claims (a) and (b) are measured on the standard
dataset-distillation protocol the spec's evaluation names, i.e. the distilled set (stage-2 labels distilled
over fresh initialisations at every step) retrained from ``EVAL_INITS``, initialisations never seen in
distillation. The theory's protocol (stage-2 labels distilled for one initialisation and retrained from that
same initialisation) is reported as its own row and is not what the thresholds are checked on.

Rows: the distilled set ``S1 u S2`` (``M1 = 2 r^2``, ``M2 = L``); full real data (upper reference);
a random real subset and a k-center coreset with the same memory (``floor(memory / (d + 1))``
labelled points, used by both stages); ``S1`` with the real stage-2 data (isolates stage 1); stage-2
labels distilled for one fixed init and retrained from that init (the theory's protocol); and in
full mode the distilled set with ``M1 = d`` ("unconstrained") and the sweep ``M1 in {1, r, r^2,
2 r^2, 4 r^2}``, plus a (d, r, L) grid with one seed.

The sizes and budgets are :class:`DistillSettings` (``SETTINGS[mode]``; ``rankwise reproduce
distill_multiindex --set d=64 steps=1000``). The checks are ``claim`` checks (no paired per-example
samples: each test MSE is averaged over evaluation initialisations inside the method's code).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from rankwise.repro.result import ClaimCheck, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.science import distill_multiindex as dm

ID = "distill_multiindex"
CLAIM = ("Gradient-based dataset distillation of one-step two-layer-network training on a multi-index task stores "
         "Theta(r^2 d + L) numbers, concentrates the distilled inputs on the r-dim task subspace, and a network "
         "retrained on them from a new initialisation generalises nearly as well as one trained on the full data "
         "and much better than one trained on an equal-memory random real subset.")
EVAL_INITS = (90_001, 90_002, 90_003)
COLUMNS = ["test_mse", "memory_numbers", "points", "energy_ratio"]
DD = "Distilled S1+S2 (M1=2r^2)"
FULL = "Full real data (stage 1 + stage 2 sets)"
RAND = "Random real subset (equal memory)"
KCEN = "k-center coreset (equal memory)"
S1R = "Distilled S1 + real stage-2 data"
SAME = "Distilled S1+S2 for one init, retrained from that init"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSettings(Settings):
    """What the Distill-MIM reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    d: int = setting(32, "input dimension of the multi-index task", lo=1)
    r: int = setting(2, "task rank (index dimension)", lo=1)
    L: int = setting(128, "width of the two-layer network (M2 = L stage-2 labels)", lo=1)
    n1: int = setting(8000, "real stage-1 examples", lo=1)
    n2: int = setting(4000, "real stage-2 examples", lo=1)
    steps: int = setting(1000, "stage-1 distillation steps (the method's default)", lo=1)
    steps2: int = setting(200, "stage-2 distillation steps", lo=1)
    inits: int = setting(16, "fresh initialisations per stage-1 step", lo=1)
    real_batch: int = setting(1024, "real batch per stage-1 step", lo=1)
    stage2_inits: int = setting(4, "initialisations per stage-2 step", lo=1)
    tol: float = setting(1.5, "tolerance factor of claims (a), (b) (the spec's x1.5 for one-seed runs)", lo=0.0)
    m1_sweep: tuple[str, ...] = setting((), "M1 sweep of the memory curve (1, r, r^2, 4r^2)")
    unconstrained: bool = setting(False, "add the distilled set with M1 = d")
    curve_points: tuple[int, ...] = setting((2, 11, 45, 90, 360), "random-subset sizes of the memory curve", lo=1)
    grid: tuple[tuple[int, int, int], ...] = setting((), "(d, r, L) grid run with the first seed", lo=1)
    grid_steps: int = setting(300, "stage-1 steps of the grid runs", lo=1)

    def validate(self) -> None:
        for tag in self.m1_sweep:
            if tag not in ("1", "r", "r^2", "2r^2", "4r^2"):
                raise ValueError(f"DistillSettings.m1_sweep must hold 1, r, r^2, 2r^2 or 4r^2, got {tag!r}")


SETTINGS: dict[str, DistillSettings] = {
    "smoke": DistillSettings(d=12, L=32, n1=800, n2=400, steps=20, steps2=20, inits=4, real_batch=256,
                             stage2_inits=2, curve_points=(2, 10)),
    # quick: one seed at the method's default 1000 stage-1 steps (the spec's quick mode is one seed with the
    # margins x1.5); the same stage-1 cost as two seeds x 500 steps, which stopped stage 1 before it converged
    "quick": DistillSettings(steps=1000, seeds=(0,)),
    "full": DistillSettings(tol=1.0, steps=1000, steps2=300, curve_points=(2, 5, 11, 22, 45, 90, 180, 360),
                            m1_sweep=("1", "r", "r^2", "4r^2"), unconstrained=True,
                            grid=tuple((d, r, L) for d in (32, 64) for r in (1, 2, 3) for L in (64, 256))),
}


def _m1(tag: str, r: int) -> int:
    return {"1": 1, "r": r, "r^2": r * r, "2r^2": 2 * r * r, "4r^2": 4 * r * r}[tag]


def _eval(alg: dm.TwoLayerAlg, task: dm.MultiIndexTask, data: Any, stage2: dm.RegressionData | None = None) -> float:
    """Mean normalised test MSE over the evaluation inits (new inits, never used to distil)."""
    return float(np.mean([alg.train(data, seed=s, stage2=stage2).test_mse(task) for s in EVAL_INITS]))


def _distill(alg: dm.TwoLayerAlg, task: dm.MultiIndexTask, real: dm.RegressionData, m1: int, cfg: dict[str, Any],
             seed: int, steps: int | None = None) -> dm.DistilledSet:
    dist = dm.GradientMatchingDistiller(
        alg, m1=m1, steps=steps or cfg["steps"], stage2_steps=cfg["steps2"], inits_per_step=cfg["inits"],
        real_batch=cfg["real_batch"], stage2_inits=cfg["stage2_inits"], stage1_fraction=cfg["n1"] / (cfg["n1"] + cfg["n2"]),
        seed=seed)
    return dist.fit(real, task=task)


def _seed(cfg: dict[str, Any], seed: int, first: bool) -> dict[str, Any]:
    """One seed: the table fragment, and (first seed) the figure data of ``extra``."""
    d, r, L = cfg["d"], cfg["r"], cfg["L"]
    alg = dm.TwoLayerAlg(width=L)
    table = Table(columns=COLUMNS)
    extra: dict[str, Any] = {"curve": [], "points_on_U": None, "loss": {}, "grid": []}
    task = dm.MultiIndexTask(d=d, r=r, seed=1000 + seed)
    real = task.sample(cfg["n1"] + cfg["n2"], seed=seed)
    real1, real2 = real.split(cfg["n1"])
    ds = _distill(alg, task, real, 2 * r * r, cfg, seed)
    mem = ds.memory_numbers
    m_pts = dm.points_for_memory(mem, d)
    rows = {
        DD: (ds, None, mem, ds.m1 + ds.m2, task.energy_ratio(ds.x1)),
        FULL: (real1, real2, real.n * (d + 1), real.n, task.energy_ratio(real.x)),
        S1R: (ds.stage1_data(), real2, None, None, task.energy_ratio(ds.x1)),
    }
    rs = dm.random_subset(real, m_pts, seed=seed)
    kc = dm.k_center_subset(real, m_pts, seed=seed)
    rows[RAND] = (rs, None, m_pts * (d + 1), m_pts, task.energy_ratio(rs.x))
    rows[KCEN] = (kc, None, m_pts * (d + 1), m_pts, task.energy_ratio(kc.x))
    # the theory's protocol: stage-2 labels distilled for one fixed init, retrained from that same init
    same = dm.GradientMatchingDistiller(alg, m1=ds.m1, stage2_steps=cfg["steps2"], stage2_inits=1,
                                        stage2_redraw=False, seed=seed)
    y2f, seed2 = same.distill_stage2(ds.x1, ds.y1, real2)
    dsf = dm.DistilledSet(ds.x1, ds.y1, y2f, seed2)
    pool = same.stage2_problem(dsf, real2, seed=seed + 1)
    table.add(SAME, "test_mse", float(np.mean([net.test_mse(task) for net in pool.networks(alg, y2f)])))
    table.add(SAME, "memory_numbers", dsf.memory_numbers)
    table.add(SAME, "energy_ratio", task.energy_ratio(dsf.x1))
    if cfg["unconstrained"]:
        du = _distill(alg, task, real, d, cfg, seed)
        rows[f"Distilled S1+S2 (M1=d={d})"] = (du, None, du.memory_numbers, du.m1 + du.m2, task.energy_ratio(du.x1))
    for name, (data, st2, memo, pts, en) in rows.items():
        table.add(name, "test_mse", _eval(alg, task, data, st2))
        table.add(name, "energy_ratio", en)
        if memo is not None:
            table.add(name, "memory_numbers", memo)
            table.add(name, "points", pts)
    if first:
        extra["points_on_U"] = {"x1_U": (ds.x1.double() @ task.U).tolist(),
                                "x1_perp_norm": (ds.x1.double() - ds.x1.double() @ task.U @ task.U.T).norm(dim=1).tolist(),
                                "real_U": (real.x[:400].double() @ task.U).tolist()}
        extra["loss"] = {"stage1": ds.history.stage1_loss, "stage2": ds.history.stage2_loss}
        # memory curve: random subsets at several budgets (cheap), distilled points of the M1 sweep
        for k in cfg["curve_points"]:
            sub = dm.random_subset(real, k, seed=seed)
            extra["curve"].append({"kind": "random subset", "memory": k * (d + 1), "test_mse": _eval(alg, task, sub)})
        extra["curve"].append({"kind": "distilled", "memory": mem, "test_mse": table.values(DD, "test_mse")[-1],
                               "m1": ds.m1})
        for tag in cfg["m1_sweep"]:
            m1 = _m1(tag, r)
            dsm = _distill(alg, task, real, m1, cfg, seed)
            extra["curve"].append({"kind": "distilled", "memory": dsm.memory_numbers, "m1": m1,
                                   "test_mse": _eval(alg, task, dsm), "energy": task.energy_ratio(dsm.x1)})
        extra["full_data"] = table.values(FULL, "test_mse")[-1]
    return {"table": table, "extra": extra}


def _grid(cfg: dict[str, Any], seeds: list[int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for gd, gr, gL in cfg["grid"]:
        galg = dm.TwoLayerAlg(width=gL)
        task = dm.MultiIndexTask(d=gd, r=gr, seed=1000 + seeds[0])
        n1 = max(8000, 8 * gd * gd)
        real = task.sample(n1 + n1 // 2, seed=seeds[0])
        gcfg = {**cfg, "n1": n1, "n2": n1 // 2}
        ds = _distill(galg, task, real, 2 * gr * gr, gcfg, seeds[0], steps=cfg["grid_steps"])
        r1, r2 = real.split(n1)
        m_pts = dm.points_for_memory(ds.memory_numbers, gd)
        out.append({"d": gd, "r": gr, "L": gL, "memory": ds.memory_numbers,
                              "bound": gr * gr * gd + gL, "energy": task.energy_ratio(ds.x1),
                              "dd": _eval(galg, task, ds), "full": _eval(galg, task, r1, r2),
                              "random": _eval(galg, task, dm.random_subset(real, m_pts, seed=seeds[0]))})

    return out


def _finish(cfg: dict[str, Any], table: Table) -> tuple[list[ClaimCheck], str, dict[str, Any]]:
    d, r, L = cfg["d"], cfg["r"], cfg["L"]
    # ---------------- claims (quick: one-seed tolerances x1.5 as the spec says)
    tol = cfg["tol"]
    m = table.mean
    bound = r * r * d + L
    checks = [
        ClaimCheck(f"(a) test MSE of Alg(S1 u S2) - test MSE of Alg(full data) (tolerance 0.15 x {tol:g}; standard DD "
                   f"protocol: the distilled set retrained from {len(EVAL_INITS)} new inits)",
                   m(DD, "test_mse") - m(FULL, "test_mse"), "<=", 0.15 * tol, unit="normalised MSE"),
        ClaimCheck(f"(b) random equal-memory subset test MSE - distilled test MSE (gap 0.2 / {tol:g}; both retrained "
                   f"from new inits)",
                   m(RAND, "test_mse") - m(DD, "test_mse"), ">=", 0.2 / tol, unit="normalised MSE"),
        ClaimCheck(f"(c) energy ratio of the distilled inputs in span(U) (random inputs: r/d = {r / d:.3f})",
                   m(DD, "energy_ratio"), ">=", 0.8),
        ClaimCheck(f"(d) memory / (r^2 d + L) = memory / {bound}", m(DD, "memory_numbers") / bound, "<=", 3.0,
                   unit="x"),
    ]
    s1_gap = m(S1R, "test_mse") - m(FULL, "test_mse")
    same_gap = m(SAME, "test_mse") - m(FULL, "test_mse")
    dd_gap = m(DD, "test_mse") - m(FULL, "test_mse")
    notes = (
        f"Alg: one stage-1 step with eta1 = sqrt(d) L and row renormalisation, ridge readout (lambda 1e-3), symmetric "
        f"initialisation (f = 0 at init). Distiller: stage 1 = {cfg['steps']} Adam steps (cosine-decayed lr) on "
        f"normalised gradient matching over {cfg['inits']} fresh inits per step and a fresh real batch of "
        f"{cfg['real_batch']}; stage 2 = {cfg['steps2']} Adam steps on the L labels of seed-regenerated Gaussian "
        f"inputs, matching readout gradients at networks trained by stage 1 on S1 (fresh inits each step), at the "
        f"distilled readout and around the real readout. Evaluation retrains from 3 new inits. Where the gap comes "
        f"from: S1 + the real stage-2 data is {s1_gap:+.3f} from the full data; stage-2 labels distilled for one "
        f"init and retrained from that same init (the theory's protocol) are {same_gap:+.3f}; the distilled set "
        f"retrained from new inits is {dd_gap:+.3f}. A miss of (a) thus comes from stage 2 under re-initialisation: "
        f"ridge regression of L features on M2 = L fixed points sits at the interpolation threshold and a new "
        f"initialisation changes the features, so L labels cannot reproduce the real readout of every network "
        f"(the least-squares optimum of the labels over 48 networks also stays far from the full data, see the "
        f"method page).")
    notes += (" The thresholds of (a) and (b) belong to the standard DD protocol (retrained from new inits); the "
              "theory's same-init protocol is the row '" + SAME + "', reported, not checked.")
    if cfg["tol"] == 1.5 and cfg["steps"] > 20:
        notes += (" Quick mode: one seed at the method's default 1000 stage-1 steps (the spec's one-seed quick mode) "
                  "with the spec's x1.5 tolerances for one-seed runs.")
    if cfg["steps"] <= 20:
        notes += " Smoke mode: tiny sizes, the verdict is not meaningful."
    config = {"eval_inits": list(EVAL_INITS), "eta1": "sqrt(d) L", "ridge": 1e-3, "m1": 2 * r * r, "m2": L,
              "lr": dm.DistillConfig().lr, "stage2_lr": dm.DistillConfig().stage2_lr}
    return checks, notes, config




class DistillReproduction(Reproduction[DistillSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1  # d x L matrices of tens to hundreds: one thread is as fast and immune to contention

    def running(self) -> Any:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(1)

    def measure(self, settings: DistillSettings, seed: int) -> dict[str, Any]:
        first = not hasattr(self, "_first_done")
        self._first_done = True
        return _seed(dataclasses.asdict(settings), seed, first)

    def measure_joint(self, settings: DistillSettings, records: Records[dict]) -> list[dict[str, Any]]:
        return _grid(dataclasses.asdict(settings), records.seeds)

    def table(self, settings: DistillSettings, records: Records[dict]) -> Table:
        table = Table(columns=COLUMNS, notes={
            "test_mse": "test MSE / Var(y) on 10^4 fresh samples, mean over 3 new inits (lower is better)",
            "memory_numbers": "numbers stored (distilled: M1 (d+1) + M2; real points: points (d+1))",
            "points": "labelled points stored", "energy_ratio": "||U^T X||^2 / ||X||^2 of the stored inputs"})
        for r in records:
            table.extend(r["table"])
        self._table = table
        self._finished = _finish(dataclasses.asdict(settings), table)
        return table

    def checks(self, settings: DistillSettings, records: Records[dict]) -> list[ClaimCheck]:
        return self._finished[0]

    def extra(self, settings: DistillSettings, records: Records[dict]) -> dict[str, Any]:
        extra = dict(records.first["extra"])
        extra["grid"] = records.joint
        return extra

    def figures(self, settings: DistillSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _figures(out_dir, self._table, self.extra(settings, records), dataclasses.asdict(settings))

    def notes(self, settings: DistillSettings, records: Records[dict]) -> str:
        return self._finished[1]

    def config(self, settings: DistillSettings, records: Records[dict]) -> dict[str, Any]:
        return self._finished[2]


def _figures(out_dir: Path, table: Table, extra: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    plt = pyplot()

    names = []
    # 1. accuracy vs memory
    fig, ax = plt.subplots(figsize=(6.5, 4))
    rs = [c for c in extra["curve"] if c["kind"] == "random subset"]
    ax.semilogx([c["memory"] for c in rs], [c["test_mse"] for c in rs], "o-", color="#888", label="random real subset")
    dd = sorted([c for c in extra["curve"] if c["kind"] == "distilled"], key=lambda c: c["memory"])
    ax.semilogx([c["memory"] for c in dd], [c["test_mse"] for c in dd], "s-", color="#37a", label="distilled (M1 sweep)")
    for c in dd:
        ax.annotate(f"M1={c['m1']}", (c["memory"], c["test_mse"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if "full_data" in extra:
        ax.axhline(extra["full_data"], color="k", ls="--", label="full real data (12000 points)")
    bound = cfg["r"] ** 2 * cfg["d"] + cfg["L"]
    ax.axvline(bound, color="#3a7", ls=":", label="r^2 d + L")
    ax.set_xlabel("memory (numbers stored)")
    ax.set_ylabel("test MSE / Var(y), retrained from new inits")
    ax.set_title(f"Accuracy vs memory (d={cfg['d']}, r={cfg['r']}, L={cfg['L']}, first seed)")
    ax.legend(fontsize=8)
    names.append(save_figure(fig, out_dir / "accuracy_vs_memory.png", bbox_inches="tight"))
    # 2. distilled inputs projected on U
    if extra["points_on_U"] is not None:
        p = extra["points_on_U"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        ru = np.array(p["real_U"])
        xu = np.array(p["x1_U"])
        if ru.shape[1] >= 2:
            axes[0].scatter(ru[:, 0], ru[:, 1], s=4, color="#bbb", label="real inputs")
            axes[0].scatter(xu[:, 0], xu[:, 1], s=40, color="#c33", label="distilled inputs")
            axes[0].set_xlabel("u_1 . x")
            axes[0].set_ylabel("u_2 . x")
        else:
            axes[0].hist(ru[:, 0], bins=40, color="#bbb", density=True, label="real inputs")
            axes[0].scatter(xu[:, 0], np.zeros(len(xu)), s=40, color="#c33", label="distilled inputs")
            axes[0].set_xlabel("u_1 . x")
        axes[0].legend(fontsize=8)
        axes[0].set_title("Distilled inputs projected on span(U)")
        axes[1].bar(range(len(xu)), np.linalg.norm(xu, axis=1), label="||U^T x||")
        axes[1].bar(range(len(xu)), p["x1_perp_norm"], bottom=np.linalg.norm(xu, axis=1), label="||x - U U^T x||")
        axes[1].set_xlabel("distilled point")
        axes[1].legend(fontsize=8)
        axes[1].set_title("In-subspace vs orthogonal norm")
        names.append(save_figure(fig, out_dir / "distilled_points.png", bbox_inches="tight"))
    # 3. losses and the table's test MSE
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, v in extra["loss"].items():
        axes[0].plot(np.convolve(v, np.ones(10) / 10, mode="valid"), label=k)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("matching loss (10-step mean)")
    axes[0].legend(fontsize=8)
    rows = [rw for rw in table.rows if table.values(rw, "test_mse")]
    axes[1].barh(range(len(rows)), [table.mean(rw, "test_mse") for rw in rows],
                 xerr=[table.std(rw, "test_mse") for rw in rows], color="#37a")
    axes[1].set_yticks(range(len(rows)))
    axes[1].set_yticklabels(rows, fontsize=7)
    axes[1].set_xlabel("test MSE / Var(y)")
    names.append(save_figure(fig, out_dir / "losses_and_errors.png", bbox_inches="tight"))
    if extra["grid"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        g = extra["grid"]
        ax.scatter([e["bound"] for e in g], [e["memory"] for e in g], c=[e["dd"] for e in g], cmap="viridis")
        for e in g:
            ax.annotate(f"d{e['d']} r{e['r']} L{e['L']}", (e["bound"], e["memory"]), fontsize=6)
        lim = [min(e["bound"] for e in g) * 0.8, max(e["bound"] for e in g) * 1.2]
        ax.plot(lim, lim, "k--", lw=0.8, label="memory = r^2 d + L")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("r^2 d + L")
        ax.set_ylabel("memory used")
        ax.legend(fontsize=8)
        ax.set_title("Memory scaling over the (d, r, L) grid (colour: test MSE)")
        names.append(save_figure(fig, out_dir / "memory_scaling.png", bbox_inches="tight"))
    return names


REPRODUCTION = DistillReproduction
run = DistillReproduction.run
