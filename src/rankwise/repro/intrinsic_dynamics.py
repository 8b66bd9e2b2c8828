"""Reproduction of "Intrinsic training dynamics of deep neural networks" (intrinsic_dynamics) at small scale.

Plan (spec ``shared/methods/intrinsic_dynamics.md``, "Reproduction at small scale"), float64, RK4, dt = 1e-3:

* quick: two-layer linear net ``n = r = 4``, ``m = 3``, ``lambda = 0.7`` (lambda-balanced init), target ``Y``
  random ``4 x 3``, ``t in [0, 2]``; one-hidden-layer ReLU net ``d = 5``, 8 neurons, 64 Gaussian inputs, teacher
  a random 2-neuron ReLU net, ``t in [0, 1]``. Claims: (a) parameter flow = intrinsic flow to 1e-6 (linear;
  ReLU up to the first activation-pattern change), (b) the lambda-formula fails (>= 1e-2) for a non-balanced
  ``C``, (c) conservation of ``C`` and ``delta_j`` to 1e-8, (d) the Euclidean guess ``Z' = -G`` fails (>= 1e-2).
* full: sweeps ``lambda in {0, 0.1, 1, 10}`` x ``m in {1, 3, 8}``; ``lambda = 0`` with ``r in {4, 6, 12}``; deep linear
  ``N = 3, 4`` balanced; the kernel-inclusion criterion table; the linear neural ODE with ``N in {8, 16, 32, 64}``
  against our ``N -> infinity`` formula; conservation-law counts by the Lie-algebra rank.

Horizons, step and the full-mode sweeps are :class:`IntrinsicSettings` (``SETTINGS[mode]``;
``rankwise reproduce intrinsic_dynamics --set dt=5e-4``). The checks are ``claim`` checks: the paper's
statements are identities of the flows, measured numerically.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rankwise.repro.result import ClaimCheck, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.science.intrinsic_dynamics import (
    DeepLinear,
    DeepReLUPathLift,
    FrobeniusLoss,
    IntrinsicConfig,
    LinearFactorization,
    LinearODE,
    ReLUNet,
    check_criterion,
    compare,
    conservation_law_count,
    euclidean_flow,
    intrinsic_flow,
    level_set_counterexample,
    simulate_flow,
)

ID = "intrinsic_dynamics"
CLAIM = ("The gradient flow of a two-layer linear net from a lambda-balanced init, and of a one-hidden-layer ReLU "
         "net in its path-lifting, is a closed flow of z = phi(theta) given by the intrinsic formula (to 1e-6), "
         "while the same formula fails for a non-balanced init and the Euclidean flow z' = -grad l(z) fails.")

@dataclasses.dataclass(frozen=True, kw_only=True)
class IntrinsicSettings(Settings):
    """What the intrinsic-dynamics reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    dt: float = setting(1e-3, "RK4 step of every flow", lo=0.0)
    t_lin: float = setting(2.0, "horizon of the two-layer linear flows", lo=0.0)
    t_relu: float = setting(1.0, "horizon of the ReLU flows", lo=0.0)
    full: bool = setting(False, "run the sweeps, deep linear nets, criterion table and linear neural ODE")
    lams: tuple[float, ...] = setting((0.0, 0.1, 1.0, 10.0), "lambdas of the linear sweep (full)", lo=0.0)
    ms: tuple[int, ...] = setting((1, 3, 8), "output sizes m of the linear sweep (full)", lo=1)
    rs: tuple[int, ...] = setting((4, 6, 12), "ranks r of the lambda = 0 sweep (full)", lo=1)
    depths: tuple[int, ...] = setting((3, 4), "depths N of the deep linear nets (full)", lo=2)
    ode_Ns: tuple[int, ...] = setting((8, 16, 32, 64), "discretisations N of the linear neural ODE (full)", lo=1)
    t_ode: float = setting(1.0, "horizon of the linear neural ODE (full)", lo=0.0)


SETTINGS: dict[str, IntrinsicSettings] = {
    "smoke": IntrinsicSettings(dt=1e-2, t_lin=0.2, t_relu=0.2),
    "quick": IntrinsicSettings(),
    "full": IntrinsicSettings(full=True),
}
N_LIN, M_LIN, R_LIN, LAM = 4, 3, 4, 0.7
D_RELU, K_RELU, N_DATA = 5, 8, 64


def _fmax(x: np.ndarray) -> float:
    return float(np.max(x)) if len(x) else 0.0


def _linear_case(n: int, m: int, r: int, lam: float | None, seed: int, cfg: IntrinsicConfig,
                 C: torch.Tensor | None = None) -> dict[str, Any]:
    """Parameter flow vs intrinsic lambda-flow for ``Z = U V^T``; ``C`` given -> non-balanced init and the
    lambda-formula applied with the isotropic fit ``lambda = tr(C)/r`` (claim (b))."""
    g = torch.Generator().manual_seed(10_000 + seed)
    sys_ = LinearFactorization(n, m, r)
    Y = torch.randn(n, m, generator=g, dtype=torch.float64)
    loss = FrobeniusLoss(Y)
    th0 = sys_.init_with_invariant(C, seed=g) if C is not None else sys_.relaxed_balanced_init(lam, seed=g)
    h0 = sys_.invariants(th0)
    assumed = h0 if C is None else (torch.trace(C) / r * torch.eye(r, dtype=torch.float64)).reshape(-1)
    p = simulate_flow(sys_, th0, loss, cfg)
    i = intrinsic_flow(sys_, sys_.phi(th0), assumed, loss, cfg)
    e = euclidean_flow(sys_.phi(th0), loss, cfg)
    return {"param": p, "intrinsic": i, "euclid": e, "err": compare(p, i), "err_euclid": compare(p, e),
            "cons": p.conservation_residual(), "theta0": th0, "system": sys_}


def _relu_case(seed: int, cfg: IntrinsicConfig) -> dict[str, Any]:
    g = torch.Generator().manual_seed(20_000 + seed)
    X = torch.randn(N_DATA, D_RELU, generator=g, dtype=torch.float64)
    tw = torch.randn(2, D_RELU, generator=g, dtype=torch.float64) / D_RELU ** 0.5
    ta = torch.randn(2, generator=g, dtype=torch.float64)
    y = (ta[:, None] * torch.relu(tw @ X.mT)).sum(0)
    sys_ = ReLUNet(D_RELU, K_RELU)
    th0 = sys_.random_init(seed=g)
    loss = sys_.loss(X, y, th0)
    z0, h0 = sys_.phi(th0), sys_.invariants(th0)
    p = simulate_flow(sys_, th0, loss, cfg)
    i = intrinsic_flow(sys_, z0, h0, loss, cfg)
    # the same flows continued through activation-pattern changes (the formula holds piecewise)
    cont = IntrinsicConfig(t_max=cfg.t_max, dt=cfg.dt, on_pattern_change="locate")
    pc = simulate_flow(sys_, th0, loss, cont)
    ic = intrinsic_flow(sys_, z0, h0, loss, cont)
    ec = euclidean_flow(z0, loss, cont)
    return {"param": p, "intrinsic": i, "err": compare(p, i), "t_stop": p.stopped_at if p.stopped_at else cfg.t_max,
            "stop_reason": p.stop_reason or "horizon", "err_cont": compare(pc, ic), "err_euclid_cont": compare(pc, ec),
            "cons": pc.conservation_residual(), "n_changes": len(pc.events),
            "t_end_cont": float(pc.times[-1]), "stop_reason_cont": pc.stop_reason or "horizon",
            "param_cont": pc, "theta0": th0, "system": sys_}


def _figures(out_dir: Path, curves: dict[str, tuple[np.ndarray, np.ndarray]],
             cons: dict[str, tuple[np.ndarray, np.ndarray]], ode: dict[str, Any] | None) -> list[str]:
    plt = pyplot()
    names = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, (t, e) in curves.items():
        ax.semilogy(t[1:], np.maximum(e[1:], 1e-17), label=label)
    ax.axhline(1e-6, color="k", ls=":", lw=1, label="1e-6 (claim a)")
    ax.axhline(1e-2, color="r", ls=":", lw=1, label="1e-2 (claims b, d)")
    ax.set_xlabel("training time t")
    ax.set_ylabel("‖Z_param(t) − Z_other(t)‖ / ‖Z_param(t)‖")
    ax.set_title("parameter flow vs lifted flows (seed 0)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    names.append(save_figure(fig, out_dir / "relative_error.png", dpi=120))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, (t, c) in cons.items():
        ax.semilogy(t[1:], np.maximum(c[1:], 1e-18), label=label)
    ax.axhline(1e-8, color="k", ls=":", lw=1, label="1e-8 (claim c)")
    ax.set_xlabel("training time t")
    ax.set_ylabel("max |h(t) − h(0)|")
    ax.set_title("conservation-law residuals along the parameter flow (seed 0)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    names.append(save_figure(fig, out_dir / "conservation.png", dpi=120))

    if ode:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        Ns = np.array(ode["Ns"], dtype=float)
        err = np.array(ode["err"])
        ax.loglog(Ns, err, "o-", label="‖Z_N(1) − Z_∞(1)‖ / ‖Z_∞(1)‖")
        ax.loglog(Ns, err[0] * Ns[0] / Ns, "k--", lw=1, label="∝ 1/N")
        ax.set_xlabel("N (discretisation of the linear ODE)")
        ax.set_title(f"linear neural ODE, fitted slope {ode['slope']:.2f}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        names.append(save_figure(fig, out_dir / "ode_convergence.png", dpi=120))
    return names


def _seed(S: dict[str, Any], seed: int, first: bool) -> dict[str, Any]:
    """One seed of the reproduction: its table fragment and what the checks, notes and figures need."""
    table = Table(columns=list(COLUMNS))
    cfg_lin = IntrinsicConfig(t_max=S["t_lin"], dt=S["dt"])
    cfg_relu = IntrinsicConfig(t_max=S["t_relu"], dt=S["dt"])
    agg: dict[str, list[Any]] = {k: [] for k in AGG_KEYS}
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    cons: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    full_rows: dict[str, list[float]] = {}
    crit_mismatch: list[str] = []
    crit_rows: list[dict[str, Any]] = []
    ode: dict[str, Any] | None = None
    bal = _linear_case(N_LIN, M_LIN, R_LIN, LAM, seed, cfg_lin)
    gC = torch.Generator().manual_seed(30_000 + seed)
    G = torch.randn(R_LIN, R_LIN, generator=gC, dtype=torch.float64)
    S_ = 0.5 * (G + G.mT)
    S_ = S_ - torch.trace(S_) / R_LIN * torch.eye(R_LIN, dtype=torch.float64)
    # anisotropic, positive definite: eigenvalues of C in [0.5, 1.5] * LAM, mean LAM
    C = LAM * (torch.eye(R_LIN, dtype=torch.float64) + 0.5 * S_ / torch.linalg.matrix_norm(S_, ord=2))
    nb = _linear_case(N_LIN, M_LIN, R_LIN, None, seed, cfg_lin, C=C)
    relu = _relu_case(seed, cfg_relu)
    crit_bal = check_criterion(bal["system"], bal["theta0"])
    crit_nb = check_criterion(nb["system"], nb["theta0"])
    crit_relu = check_criterion(relu["system"], relu["theta0"])
    agg["a_lin"].append(_fmax(bal["err"]))
    agg["a_relu"].append(_fmax(relu["err"]))
    agg["b"].append(_fmax(nb["err"]))
    agg["c_lin"].append(max(_fmax(bal["cons"]), _fmax(nb["cons"])))
    agg["c_relu"].append(_fmax(relu["cons"]))
    agg["d"].append(_fmax(bal["err_euclid"]))
    agg["t_stop"].append(relu["t_stop"])
    agg["relu_cont"].append(_fmax(relu["err_cont"]))
    agg["relu_changes"].append(relu["n_changes"])
    agg["d_relu"].append(_fmax(relu["err_euclid_cont"]))
    agg["stop_reason"].append(relu["stop_reason"])
    agg["t_end_cont"].append(round(relu["t_end_cont"], 4))
    agg["stop_reason_cont"].append(relu["stop_reason_cont"])
    rows = [
        (f"linear λ={LAM} balanced: intrinsic λ-formula", _fmax(bal["err"]), _fmax(bal["cons"]), S["t_lin"], crit_bal),
        (f"linear non-balanced C (tr C/r={LAM}): λ-formula", _fmax(nb["err"]), _fmax(nb["cons"]), S["t_lin"], crit_nb),
        ("linear λ-balanced: Euclidean guess Z'=-G", _fmax(bal["err_euclid"]), float("nan"), S["t_lin"], None),
        ("ReLU path-lifting: intrinsic formula (to 1st change, spec rule)", _fmax(relu["err"]), float("nan"),
         relu["t_stop"], crit_relu),
        ("ReLU path-lifting: intrinsic formula through pattern changes", _fmax(relu["err_cont"]),
         _fmax(relu["cons"]), relu["t_end_cont"], None),
        ("ReLU: Euclidean guess z'=-g (through pattern changes)", _fmax(relu["err_euclid_cont"]), float("nan"),
         relu["t_end_cont"], None),
    ]
    for name, err, cres, tstop, crit in rows:
        table.add(name, "max_rel_error", err)
        if not np.isnan(cres):
            table.add(name, "conservation_residual", cres)
        table.add(name, "t_stop", tstop)
        if crit is not None:
            table.add(name, "criterion_inclusion", float(crit.inclusion))
    if first:
        curves = {f"λ-balanced (λ={LAM}): intrinsic": (bal["param"].times, bal["err"]),
                  "non-balanced C: λ-formula": (nb["param"].times, nb["err"]),
                  "Euclidean guess Z' = −G": (bal["param"].times, bal["err_euclid"]),
                  "ReLU: intrinsic, to 1st pattern change": (relu["param"].times, relu["err"]),
                  "ReLU: intrinsic, through pattern changes": (relu["param_cont"].times, relu["err_cont"])}
        cons = {"linear ‖C(t) − C(0)‖ (max entry), λ-balanced": (bal["param"].times, bal["cons"]),
                "linear, non-balanced": (nb["param"].times, nb["cons"]),
                "ReLU max_j |δ_j(t) − δ_j(0)|": (relu["param_cont"].times, relu["cons"])}

    if S["full"]:
        def add(name: str, col: str, v: float) -> None:
            table.add(name, col, v)
            full_rows.setdefault(f"{name}|{col}", []).append(v)

        for lam in S["lams"]:
            for m in S["ms"]:
                res = _linear_case(4, m, 4, lam, seed, cfg_lin)
                add(f"sweep n=r=4 m={m} λ={lam:g}", "max_rel_error", _fmax(res["err"]))
                add(f"sweep n=r=4 m={m} λ={lam:g}", "conservation_residual", _fmax(res["cons"]))
        for r in S["rs"]:
            res = _linear_case(4, 3, r, 0.0, seed, cfg_lin)
            add(f"sweep λ=0 n=4 m=3 r={r}", "max_rel_error", _fmax(res["err"]))
            add(f"sweep λ=0 n=4 m=3 r={r}", "conservation_residual", _fmax(res["cons"]))
        for N in S["depths"]:
            g = torch.Generator().manual_seed(40_000 + seed)
            dl = DeepLinear([3] + [4] * (N - 1) + [3])
            th0 = dl.balanced_init(seed=g)
            loss = FrobeniusLoss(torch.randn(3, 3, generator=g, dtype=torch.float64))
            p = simulate_flow(dl, th0, loss, cfg_lin)
            i = intrinsic_flow(dl, dl.phi(th0), dl.invariants(th0), loss, cfg_lin)
            add(f"deep linear N={N} balanced: Arora formula", "max_rel_error", _fmax(compare(p, i)))
            add(f"deep linear N={N} balanced: Arora formula", "conservation_residual",
                _fmax(p.conservation_residual()))
        # criterion table: balanced must pass; generic C must fail when r < n + m
        for (n, m, r) in [(4, 1, 4), (4, 3, 4), (4, 8, 4), (4, 3, 6), (4, 3, 12)]:
            lf = LinearFactorization(n, m, r)
            g = torch.Generator().manual_seed(50_000 + seed)
            inits = [("λ=0 balanced", lf.relaxed_balanced_init(0.0, seed=g))]
            if n >= r:  # U^T U - V^T V = 0.7 I needs rank r on the U side
                inits.append(("λ=0.7 balanced", lf.relaxed_balanced_init(0.7, seed=g)))
            inits.append(("generic C", lf.random_init(seed=g)))
            for kind, th in inits:
                rep = check_criterion(lf, th)
                expected = True if "balanced" in kind else (False if r < n + m else None)
                if expected is not None and rep.inclusion != expected:
                    crit_mismatch.append(f"seed {seed} (n,m,r)=({n},{m},{r}) {kind}: {rep.inclusion}")
                crit_rows.append({"seed": seed, "n": n, "m": m, "r": r, "init": kind, **rep.as_dict(),
                                  "expected": expected})
                add(f"criterion (n,m,r)=({n},{m},{r}) {kind}", "criterion_inclusion", float(rep.inclusion))
        g = torch.Generator().manual_seed(60_000 + seed)
        for widths in ([3, 4, 2], [3, 4, 4, 2]):
            drl = DeepReLUPathLift(widths)
            rep = check_criterion(drl, drl.random_init(seed=g))
            crit_rows.append({"seed": seed, "system": f"deep ReLU {widths}", **rep.as_dict()})
            add(f"criterion deep ReLU widths={widths}", "criterion_inclusion", float(rep.inclusion))
        # level-set counterexample for a generic C at (4, 3, 4)
        lf = LinearFactorization(4, 3, 4)
        ce = level_set_counterexample(lf, lf.random_init(seed=g))
        full_rows.setdefault("counterexample_metric_change", []).append(ce["metric_change"])
        full_rows.setdefault("counterexample_residual", []).append(ce["residual"])
        # linear neural ODE: finite-N intrinsic formula and convergence to the N -> infinity formula
        g = torch.Generator().manual_seed(70_000 + seed)
        A0 = torch.randn(3, 3, generator=g, dtype=torch.float64) / 3 ** 0.5
        A0 = 0.5 * (A0 + A0.mT)
        Y = torch.linalg.matrix_exp(torch.randn(3, 3, generator=g, dtype=torch.float64) / 3 ** 0.5)
        loss = FrobeniusLoss(Y)
        cfg_ode = IntrinsicConfig(t_max=S["t_ode"], dt=S["dt"], record_every=10)
        lim = intrinsic_flow(LinearODE.limit_velocity, torch.linalg.matrix_exp(A0), torch.zeros(0), loss, cfg_ode)
        errs = []
        for N in S["ode_Ns"]:
            ode_sys = LinearODE(3, N)
            th0 = ode_sys.theta_from_A([A0] * N)
            p = simulate_flow(ode_sys, th0, loss, cfg_ode)
            i = intrinsic_flow(ode_sys, ode_sys.phi(th0), ode_sys.invariants(th0), loss, cfg_ode)
            add(f"linear ODE N={N}: discretised balanced formula", "max_rel_error", _fmax(compare(p, i)))
            add(f"linear ODE N={N}: discretised balanced formula", "conservation_residual",
                _fmax(p.conservation_residual()))
            e = float(np.linalg.norm(p.z[-1] - lim.z[-1]) / np.linalg.norm(lim.z[-1]))
            errs.append(e)
            add(f"linear ODE N={N}: vs N→∞ formula at t=1", "max_rel_error", e)
        slope = float(np.polyfit(np.log(S["ode_Ns"]), np.log(errs), 1)[0])
        full_rows.setdefault("ode_slope", []).append(slope)
        if ode is None:
            ode = {"Ns": S["ode_Ns"], "err": errs, "slope": slope}

    return {"table": table, "agg": agg, "curves": curves, "cons": cons, "full_rows": full_rows,
            "crit_mismatch": crit_mismatch, "crit_rows": crit_rows, "ode": ode}


COLUMNS = ["max_rel_error", "conservation_residual", "t_stop", "criterion_inclusion"]
AGG_KEYS = ("a_lin", "a_relu", "b", "c_lin", "c_relu", "d", "t_stop", "relu_cont", "relu_changes", "d_relu",
            "stop_reason", "t_end_cont", "stop_reason_cont")


class IntrinsicReproduction(Reproduction[IntrinsicSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1  # tiny models: more threads only spin

    def measure(self, settings: IntrinsicSettings, seed: int) -> dict[str, Any]:
        first = not hasattr(self, "_first_done")
        self._first_done = True
        return _seed(dataclasses.asdict(settings), seed, first)

    def table(self, settings: IntrinsicSettings, records: Records[dict]) -> Table:
        table = Table(columns=list(COLUMNS),
                      notes={"max_rel_error": "max_t ||Z_param - Z_lifted|| / ||Z_param||",
                             "conservation_residual": "max_t |h(t) - h(0)| along the parameter flow",
                             "t_stop": "time of the first activation-pattern change (ReLU) or the horizon",
                             "criterion_inclusion": "1 if ker dphi ∩ ker dh ⊂ ker dM at theta_0"})
        for r in records:
            table.extend(r["table"])
        return table

    def measure_joint(self, settings: IntrinsicSettings, records: Records[dict]) -> dict[str, Any]:
        """Everything after the seeds (checks, notes, extra, config), computed once as the old run did."""
        return _finish(dataclasses.asdict(settings), records)

    def checks(self, settings: IntrinsicSettings, records: Records[dict]) -> list[ClaimCheck]:
        return records.joint["checks"]

    def figures(self, settings: IntrinsicSettings, records: Records[dict], out_dir: Path) -> list[str]:
        first = records.first
        return _figures(out_dir, first["curves"], first["cons"], records.joint["ode"])

    def notes(self, settings: IntrinsicSettings, records: Records[dict]) -> str:
        return records.joint["notes"]

    def config(self, settings: IntrinsicSettings, records: Records[dict]) -> dict[str, Any]:
        return records.joint["config"]

    def extra(self, settings: IntrinsicSettings, records: Records[dict]) -> dict[str, Any]:
        return records.joint["extra"]


def _finish(S: dict[str, Any], records: Records[dict]) -> dict[str, Any]:
    seeds = records.seeds
    agg: dict[str, list[Any]] = {k: [v for r in records for v in r["agg"][k]] for k in AGG_KEYS}
    full_rows: dict[str, list[float]] = {}
    for r in records:
        for k, vs in r["full_rows"].items():
            full_rows.setdefault(k, []).extend(vs)
    crit_mismatch = [m for r in records for m in r["crit_mismatch"]]
    crit_rows = [c for r in records for c in r["crit_rows"]]
    ode = records.first["ode"]
    checks = [
        ClaimCheck(f"(a) λ-balanced linear (λ={LAM}): max_t relative error, parameter vs intrinsic flow",
                   max(agg["a_lin"]), "<=", 1e-6),
        ClaimCheck("(a) ReLU path-lifting: max_t relative error up to the first pattern (or sign) change",
                   max(agg["a_relu"]), "<=", 1e-6),
        ClaimCheck("(b) non-balanced C: relative error of the λ-formula (λ = tr C / r)", min(agg["b"]), ">=", 1e-2),
        ClaimCheck("(c) linear: max_t max |C(t) − C(0)|", max(agg["c_lin"]), "<=", 1e-8),
        ClaimCheck("(c) ReLU: max_t max_j |δ_j(t) − δ_j(0)|", max(agg["c_relu"]), "<=", 1e-8),
        ClaimCheck("(d) Euclidean guess Z' = −G: relative error", min(agg["d"]), ">=", 1e-2),
    ]
    extra: dict[str, Any] = {"relu_t_stop": agg["t_stop"], "relu_stop_reason": agg["stop_reason"],
                             "relu_pattern_changes": agg["relu_changes"], "relu_t_end_located": agg["t_end_cont"],
                             "relu_error_through_changes": agg["relu_cont"]}
    if S["full"]:
        sweep = [v for k, vs in full_rows.items() if k.startswith("sweep") and k.endswith("|max_rel_error")
                 for v in vs]
        sweep_c = [v for k, vs in full_rows.items() if k.startswith("sweep") and k.endswith("|conservation_residual")
                   for v in vs]
        deep = [v for k, vs in full_rows.items() if k.startswith("deep linear") and k.endswith("|max_rel_error")
                for v in vs]
        odef = [v for k, vs in full_rows.items() if "discretised" in k and k.endswith("|max_rel_error") for v in vs]
        checks += [
            ClaimCheck("sweep λ∈{0,0.1,1,10} × m∈{1,3,8} and λ=0, r∈{4,6,12}: max relative error", max(sweep),
                       "<=", 1e-6),
            ClaimCheck("sweeps: max conservation residual of C", max(sweep_c), "<=", 1e-8),
            ClaimCheck("deep linear N=3,4 balanced: max relative error to the Arora formula", max(deep), "<=", 1e-6),
            ClaimCheck("criterion: cases disagreeing with 'balanced -> True, generic C with r < n+m -> False'",
                       len(crit_mismatch), "<=", 0, note="; ".join(crit_mismatch)),
            ClaimCheck("linear ODE: discretised balanced formula vs parameter flow, max relative error", max(odef),
                       "<=", 1e-6),
            ClaimCheck("linear ODE: log-log slope of ‖Z_N(1) − Z_∞(1)‖ in N (~1/N)",
                       float(np.mean(full_rows["ode_slope"])), "<=", -0.8),
        ]
        extra.update(criterion=crit_rows, ode=ode, counterexample_metric_change=full_rows["counterexample_metric_change"],
                     counterexample_residual=full_rows["counterexample_residual"])
        try:
            lf = LinearFactorization(4, 3, 4)
            extra["conservation_laws_linear_4_3_4"] = conservation_law_count(lf, lf.random_init(seed=seeds[0]))
            rl = ReLUNet(3, 4)
            extra["conservation_laws_relu_3_4"] = conservation_law_count(rl, rl.random_init(seed=seeds[0]), max_order=3)
        except Exception as exc:  # pragma: no cover - informational only
            extra["conservation_laws_error"] = repr(exc)
    notes = (
        f"RK4 with dt={S['dt']} in float64 on both the parameter flow (closed-form -J^T grad l, checked against "
        "autograd in the tests) and the lifted flows. Linear: lambda-balanced init by the spec's construction "
        "U = Q (V^T V + lambda I)^{1/2}; the non-balanced init has C = 0.7 (I + S/2), S the traceless part of (G + G^T)/2 "
        "with G Gaussian scaled to spectral norm 1 (so C is positive definite, eigenvalues in [0.35, 1.05]; "
        "U = Q(V^T V + C)^{1/2}), and the lambda-formula is applied with lambda = tr(C)/r = 0.7, so "
        "claim (b) measures what ignoring the anisotropy of C costs. ReLU: w_j ~ N(0, I/d), a_j ~ N(0, 1/k) (our choice), teacher weights "
        f"N(0, I/d). With the spec's rule (stop at the first change) the ReLU runs stopped at t = {agg['t_stop']} "
        f"(reason {agg['stop_reason']}: 'pattern' = an activation pattern changed, 'sign' = an output weight a_j "
        "crossed 0, the non-intrinsic set), so claim (a) for ReLU covers only that interval. We therefore also ran "
        "both flows through the kinks with event location (bisection onto each crossing, every RK4 stage on one "
        f"piece): through {agg['relu_changes']} located pattern changes up to t = {agg['t_end_cont']} (end reason "
        f"{agg['stop_reason_cont']}) the intrinsic formula tracks the parameter flow to {max(agg['relu_cont']):.2g}; "
        "claim (c) for ReLU is measured on these longer runs."
    )
    if S["full"]:
        notes += (" Linear neural ODE: W_k = I + A_k/N with the L^2 gradient flow A_k' = -N dl/dA_k (parametrised by "
                  "B = A/sqrt(N)), balanced init A(s) = A_0 symmetric; its finite-N intrinsic flow is the deep-linear "
                  "formula divided by N, whose N -> infinity limit we derived as Z' = -int_0^1 (ZZ^T)^(1-s) G (Z^TZ)^s ds "
                  "(log-mean of eigenvalues); Z_infinity starts from expm(A_0). The spec's limit formula was not "
                  "recovered, so this comparison is our derivation.")
        wide = [c for c in crit_rows if c.get("init") == "generic C" and c["r"] >= c["n"] + c["m"]]
        if wide:
            notes += (" Criterion with r >= n + m (the spec only states the case r < n + m): generic C gave inclusion = "
                      f"{sorted({c['inclusion'] for c in wide})} (leakage "
                      f"{min(c['leakage'] for c in wide):.2g}-{max(c['leakage'] for c in wide):.2g}), i.e. no intrinsic "
                      "dynamic for a generic init there either, with all entries of C as the conservation laws "
                      "(conservation_law_count confirms C carries all of them on small cases).")
    config = {"dt": S["dt"], "linear": {"n": N_LIN, "m": M_LIN, "r": R_LIN, "lambda": LAM,
                                                     "t_max": S["t_lin"]},
              "relu": {"d": D_RELU, "k": K_RELU, "n_data": N_DATA, "teacher_neurons": 2, "t_max": S["t_relu"]}}
    if S["full"]:
        config.update({k: S[k] for k in ("lams", "ms", "rs", "depths", "ode_Ns", "t_ode")})
    return {"checks": checks, "notes": notes, "config": config, "extra": extra, "ode": ode}


REPRODUCTION = IntrinsicReproduction
run = IntrinsicReproduction.run
