"""Reproduction of "Clustering in Deep Stochastic Transformers" (token_dynamics) at small scale.

Plan (spec ``shared/methods/token_dynamics.md``, "Reproduction at small scale"):

* quick: two-token phase diagram, ``d in {3, 4, 8}``, ``beta in {0.5, 2, 8}``, ``R = 200``, ``T = 20``,
  ``h = 0.02``; claims (a) d=8, beta=0.5 antipodal <= 0.03, (b) d=8, beta=8 antipodal >= 0.10, (c) at beta=2
  d=3 exceeds d=8 by >= 0.15, (d) the deterministic flow (V = I, beta = 1) collapses in >= 99% of runs for
  d in {3, 8}; plus the two further claims that cost seconds: n = 4 and n = 8 tokens keep antipodal pairs
  (d = 4, beta = 8), and the Euler-Maruyama SDE agrees with the discrete network (d = 4, beta = 4).
* full: grid ``d in {3,4,6,8,12}`` x ``beta in {0,0.5,1,2,4,8}``, ``R = 400``, ``h = 0.01``; monotonicity in
  beta (non-decreasing up to 0.05) and in d (non-increasing for beta >= 2, same slack); everything of
  quick; and the noise-vs-accuracy experiment: an 8-layer width-32 Transformer trained with random
  values ("noise on") vs ``V = I`` ("noise off").
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from rankwise.repro.result import ClaimCheck, ReproResult, Table, environment
from rankwise.science.token_dynamics import (
    SphereTransformer,
    antipodal_boundary_beta,
    coupled_refinement,
    phase_diagram,
    simulate,
    TokenDynamicsConfig,
)

ID = "token_dynamics"
CLAIM = ("With random value matrices shared by all tokens (a common matrix Brownian motion in the depth limit), "
         "two tokens end antipodal with positive probability in a region of large beta / small d, and never "
         "for small beta at d = 8, while the deterministic attention flow collapses every pair.")

SETTINGS: dict[str, dict[str, Any]] = {
    "smoke": dict(dims=[3, 8], betas=[0.5, 2.0, 8.0], runs=16, horizon=2.0, step=0.05, det_runs=8,
                  n_multi=[4], multi_runs=16, em_runs=16, em_step=0.02, train_steps=5, train_tasks=["pointer"],
                  train_n=256),
    "quick": dict(dims=[3, 4, 8], betas=[0.5, 2.0, 8.0], runs=200, horizon=20.0, step=0.02, det_runs=200,
                  n_multi=[4, 8], multi_runs=200, em_runs=200, em_step=0.004, train_steps=0, train_tasks=[],
                  train_n=0),
    "full": dict(dims=[3, 4, 6, 8, 12], betas=[0.0, 0.5, 1.0, 2.0, 4.0, 8.0], runs=400, horizon=20.0, step=0.01,
                 det_runs=400, n_multi=[4, 8], multi_runs=400, em_runs=400, em_step=0.002, train_steps=400,
                 train_tasks=["pointer", "majority"], train_n=8192),
}
SLACK = 0.05  # Monte-Carlo slack of the monotonicity claims (spec)


# --------------------------------------------------------------------------------------------------
# Noise vs accuracy: synthetic sequence tasks for a deep stochastic Transformer

VOCAB, SEQ = 8, 15  # 15 data tokens + 1 query/CLS token = 16 tokens (spec: "16 tokens")


def make_task(task: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Token ids ``(n, 16)``, labels ``(n,)``, vocabulary size and number of classes.

    ``pointer``: 15 tokens from 8 symbols, then a query token naming a position p (first in the
    sequence); label = the symbol at p (needs token-specific information at depth).
    ``majority``: 15 bits after a CLS token; label = majority bit (solvable from the token mean).
    """
    if task == "pointer":
        x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        p = torch.randint(0, SEQ, (n,), generator=g)
        return torch.cat([(VOCAB + p)[:, None], x], 1), x[torch.arange(n), p], VOCAB + SEQ, VOCAB
    if task == "majority":
        x = torch.randint(0, 2, (n, SEQ), generator=g)
        return torch.cat([torch.full((n, 1), 2), x], 1), (x.sum(1) > SEQ // 2).long(), 3, 2
    raise ValueError(f"unknown task {task!r}")


def train_accuracy(task: str, noise_on: bool, seed: int, steps: int, n_train: int) -> float:
    """Test accuracy of an 8-layer width-32 :class:`SphereTransformer` after ``steps`` Adam steps.

    Same data, same optimiser and budget for both inits; only the value matrices at init differ:
    ``V ~ N(0, 1/d)`` (noise on) or ``V = I`` (noise off, the deterministic attention flow).
    """
    g = torch.Generator().manual_seed(1000 + seed)
    X, y, vocab, n_cls = make_task(task, n_train, g)
    Xte, yte, _, _ = make_task(task, min(2048, n_train), g)
    model = SphereTransformer(vocab, dim=32, depth=8, n_classes=n_cls, max_len=SEQ + 1,
                              value_scale=1.0 if noise_on else 0.0, value_mean=0.0 if noise_on else 1.0, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gb = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, n_train, (128,), generator=gb)
        loss = torch.nn.functional.cross_entropy(model(X[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float((model(Xte).argmax(1) == yte).double().mean())


# --------------------------------------------------------------------------------------------------


def _figures(out_dir: Path, grids: list[Any], paths: dict[str, np.ndarray], times: np.ndarray,
             acc: dict[str, list[float]] | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    g0 = grids[0]
    anti = np.mean([g.antipodal for g in grids], axis=0)
    fig, ax = plt.subplots(figsize=(1.1 * len(g0.betas) + 2.5, 0.6 * len(g0.dims) + 2.8))
    im = ax.imshow(anti, origin="lower", cmap="viridis", vmin=0, vmax=max(0.5, float(anti.max())), aspect="auto")
    ax.set_xticks(range(len(g0.betas)), [f"{b:g}" for b in g0.betas])
    ax.set_yticks(range(len(g0.dims)), [str(d) for d in g0.dims])
    from matplotlib.patches import Rectangle

    first = True
    for i in range(len(g0.dims)):
        for j in range(len(g0.betas)):
            ax.text(j, i, f"{anti[i, j]:.2f}", ha="center", va="center",
                    color="w" if anti[i, j] < 0.3 else "k", fontsize=8)
            if g0.lyapunov[i, j] > 0:  # theory: the antipodal pair repels (lambda_- > 0)
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="r", lw=1.5, ls="--",
                                       label="theory: antipodal repelling (λ₋ > 0)" if first else None))
                first = False
    if not first:
        ax.legend(loc="upper left", fontsize=7, bbox_to_anchor=(0.0, -0.18))
    ax.set_xlabel("β (interaction strength)")
    ax.set_ylabel("d (dimension)")
    ax.set_title("P(two tokens end antipodal), mean over seeds")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out_dir / "phase_diagram.png", dpi=120)
    plt.close(fig)
    names.append("phase_diagram.png")

    fig, axes = plt.subplots(1, len(paths), figsize=(4.2 * len(paths), 3.2), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (label, rho) in zip(axes, paths.items()):
        for r in rho[:25]:
            ax.plot(times, r, lw=0.7, alpha=0.7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("depth-time t")
        ax.set_ylim(-1.05, 1.05)
    axes[0].set_ylabel("ρ = <u₁,u₂>")
    fig.tight_layout()
    fig.savefig(out_dir / "rho_paths.png", dpi=120)
    plt.close(fig)
    names.append("rho_paths.png")

    if acc:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        labels = list(acc)
        ax.bar(range(len(labels)), [np.mean(acc[k]) for k in labels],
               yerr=[np.std(acc[k]) for k in labels], color=["tab:blue", "tab:gray"] * len(labels))
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=7)
        ax.set_ylabel("test accuracy")
        ax.set_title("8-layer Transformer: random values vs V = I")
        fig.tight_layout()
        fig.savefig(out_dir / "noise_accuracy.png", dpi=120)
        plt.close(fig)
        names.append("noise_accuracy.png")
    return names


def _run(mode: str, seeds: Sequence[int], out_dir: Path) -> ReproResult:
    """Run the reproduction in ``mode`` ("smoke", "quick" or "full") for ``seeds``; write figures and result.json."""
    if mode not in SETTINGS:
        raise ValueError(f"mode must be one of {list(SETTINGS)}, got {mode!r}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    t0 = time.perf_counter()
    S = SETTINGS[mode]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cols = ["antipodal", "collapsed", "other", "mean_clusters", "lyapunov_antipodal", "accuracy"]
    table = Table(columns=cols, notes={"antipodal": "fraction of runs ending with rho < -0.99 (n > 2: some pair)",
                                       "collapsed": "fraction with rho > 0.99 (n > 2: every pair)",
                                       "lyapunov_antipodal": "theory: < 0 means the antipodal pair attracts",
                                       "accuracy": "test accuracy (noise-vs-accuracy experiment)"})
    common = dict(horizon=S["horizon"], step=S["step"])
    grids, det, multi, em_pair, acc = [], {}, {}, [], {}
    rho_paths: dict[str, np.ndarray] = {}
    refine: list[float] = []
    for seed in seeds:
        grid = phase_diagram(S["dims"], S["betas"], runs=S["runs"], seed=seed, **common)
        grids.append(grid)
        for i, d in enumerate(grid.dims):
            for j, b in enumerate(grid.betas):
                row = f"stochastic d={d} β={b:g}"
                table.add(row, "antipodal", grid.antipodal[i, j])
                table.add(row, "collapsed", grid.collapsed[i, j])
                table.add(row, "other", grid.other[i, j])
                table.add(row, "lyapunov_antipodal", grid.lyapunov[i, j])
        # (d) deterministic attention flow (V = I, no noise, step h), beta = 1
        for d in (3, 8):
            r = simulate(TokenDynamicsConfig(dim=d, beta=1.0, noise=False, runs=S["det_runs"], seed=seed,
                                             record_every=max(1, int(round(S["horizon"] / S["step"])) // 100),
                                             **common))
            sm = r.summary()
            det.setdefault(d, []).append(sm["collapsed"])
            row = f"deterministic flow d={d} β=1"
            for k in ("antipodal", "collapsed", "other"):
                table.add(row, k, sm[k])
            if seed == seeds[0] and d == 8:
                rho_paths["deterministic flow, d=8, β=1"] = r.rho_path()
                times = r.times
        # sample paths of the stochastic model for the figure (first seed)
        if seed == seeds[0]:
            rec = max(1, int(round(S["horizon"] / S["step"])) // 100)
            for d, b in ((8, 8.0), (8, 0.5)):
                r = simulate(TokenDynamicsConfig(dim=d, beta=b, runs=25, seed=seed, record_every=rec, **common))
                rho_paths[f"random values, d={d}, β={b:g}"] = r.rho_path()
        # n > 2 tokens: antipodal pairs persist (d = 4, beta = 8)
        for n in S["n_multi"]:
            r = simulate(TokenDynamicsConfig(n_tokens=n, dim=4, beta=8.0, runs=S["multi_runs"], seed=seed, **common))
            sm = r.summary()
            multi.setdefault(n, []).append(sm["antipodal"])
            row = f"n={n} tokens d=4 β=8"
            for k in ("antipodal", "collapsed", "other", "mean_clusters"):
                table.add(row, k, sm[k])
        # Euler-Maruyama of the SDE vs the discrete network at (d = 4, beta = 4)
        disc = simulate(TokenDynamicsConfig(dim=4, beta=4.0, runs=S["em_runs"], seed=seed, **common)).summary()
        em_cfg = TokenDynamicsConfig(dim=4, beta=4.0, runs=S["em_runs"], seed=seed, integrator="sde",
                                     horizon=S["horizon"], step=S["em_step"], record_every=10**6)
        em_res = simulate(em_cfg)
        em = em_res.summary()
        em_pair.append((disc["antipodal"], em["antipodal"]))
        for row, sm in (("discrete network d=4 β=4", disc), (f"Euler-Maruyama SDE d=4 β=4 (h={S['em_step']:g})", em)):
            for k in ("antipodal", "collapsed", "other"):
                table.add(row, k, sm[k])
        if mode == "full":
            c, f = coupled_refinement(TokenDynamicsConfig(dim=4, beta=4.0, runs=S["em_runs"], seed=seed, **common))
            refine.append(abs(c["antipodal"] - f["antipodal"]))
        # noise vs accuracy (full; smoke only checks the wiring)
        for task in S["train_tasks"]:
            for on in (True, False):
                a = train_accuracy(task, on, seed, S["train_steps"], S["train_n"])
                key = f"{task}: {'random V (noise on)' if on else 'V = I (noise off)'}"
                acc.setdefault(key, []).append(a)
                table.add(key, "accuracy", a)

    def cell(d: int, b: float) -> float:
        return float(np.mean([g.get(d, b) for g in grids]))

    checks: list[ClaimCheck] = []
    dims, betas = S["dims"], S["betas"]
    if 8 in dims and 0.5 in betas:
        checks.append(ClaimCheck("(a) d=8, β=0.5: antipodal fraction stays small", cell(8, 0.5), "<=", 0.03))
    if 8 in dims and 8.0 in betas:
        checks.append(ClaimCheck("(b) d=8, β=8: antipodal fraction is positive", cell(8, 8.0), ">=", 0.10))
    if 3 in dims and 8 in dims and 2.0 in betas:
        checks.append(ClaimCheck("(c) β=2: antipodal fraction at d=3 minus at d=8", cell(3, 2.0) - cell(8, 2.0),
                                 ">=", 0.15))
    checks.append(ClaimCheck("(d) deterministic flow (V=I, β=1) collapsed fraction, min over d∈{3,8}",
                             min(float(np.mean(v)) for v in det.values()), ">=", 0.99))
    for n, v in multi.items():
        checks.append(ClaimCheck(f"n={n} tokens (d=4, β=8): fraction of runs with an antipodal pair",
                                 float(np.mean(v)), ">", 0.0))
    em_gap = abs(float(np.mean([a for a, _ in em_pair])) - float(np.mean([b for _, b in em_pair])))
    checks.append(ClaimCheck("Euler-Maruyama SDE vs discrete network (d=4, β=4): |Δ antipodal fraction|",
                             em_gap, "<=", 0.07))
    if mode == "full":
        anti = np.mean([g.antipodal for g in grids], axis=0)
        viol_beta = float(np.max(anti[:, :-1] - anti[:, 1:]))
        big = [j for j, b in enumerate(betas) if b >= 2]
        viol_dim = float(np.max(anti[1:, big] - anti[:-1, big]))
        checks.append(ClaimCheck("monotone in β: largest decrease of the antipodal fraction as β grows",
                                 viol_beta, "<=", SLACK))
        checks.append(ClaimCheck("non-increasing in d (β≥2): largest increase of the antipodal fraction as d grows",
                                 viol_dim, "<=", SLACK))
    if acc and mode == "full":
        gaps = []
        for task in S["train_tasks"]:
            on = np.mean(acc[f"{task}: random V (noise on)"])
            off = np.mean(acc[f"{task}: V = I (noise off)"])
            gaps.append(float(on - off))
        checks.append(ClaimCheck("noise on vs noise off: accuracy gap, min over tasks", min(gaps), ">=", 0.0,
                                 note="qualitative at this scale (spec)"))

    figures = _figures(out_dir, grids, rho_paths, times, acc or None)
    boundary = {d: round(antipodal_boundary_beta(d), 4) for d in dims}
    notes = (
        "Discrete deep network of the spec (one value matrix V_k ~ N(0, 1/d) per layer shared by all tokens, "
        "residual sqrt(h), RMS normalisation), float64 numpy, vectorised over runs and betas. "
        f"Theory line: from the spec's Ito drift/diffusion of rho we derived b(rho) = (1-rho^2)[2pq(rho+d-2) - rho]/d "
        "and sigma^2 = 2(1-2pq)(1-rho^2)^2/d, so the antipodal Lyapunov exponent is (4pq(d-1) - 2)/d with "
        f"pq = 1/(4 cosh^2 beta): antipodal attracting iff cosh^2(beta) > (d-1)/2, i.e. beta_c(d) = {boundary}. "
        "Finite-horizon fractions near beta_c are small but not zero because the approach to either end is slow. "
        "The Euler-Maruyama SDE evaluates its coefficients at u/|u| (norm mean-reverting; plain EM on the raw "
        f"state blows up through the cubic Ito term) with step {S['em_step']}; its independent noise makes the "
        f"comparison a Monte-Carlo one (standard error of each fraction sqrt(p(1-p)/R) ~ "
        f"{math.sqrt(0.35 * 0.65 / S['em_runs']):.3f} per seed at R={S['em_runs']})."
    )
    if refine:
        notes += (f" Discretisation check (coupled Brownian paths, h vs h/2, d=4, beta=4): |Δ antipodal| = "
                  f"{np.mean(refine):.3f} (spec: <= 0.05).")
    if acc:
        notes += (" Noise vs accuracy: SphereTransformer (8 layers, width 32, post-RMS-norm, 1/sqrt(8) residual, "
                  "attention only) trained 400 Adam steps (lr 3e-3, batch 128) on two 16-token tasks: 'pointer' "
                  "(return the symbol at a queried position: needs token identity at depth) and 'majority' (needs "
                  "only the token mean); the paper's task was not recovered, these are our choices.")
    config = {k: v for k, v in S.items()}
    config.update(threshold=0.99, quick_claim_step=S["step"])
    extra = {"antipodal_grid": [g.antipodal.tolist() for g in grids], "dims": dims, "betas": betas,
             "lyapunov": grids[0].lyapunov.tolist(), "beta_c": boundary,
             "accuracy": {k: v for k, v in acc.items()}, "discretisation_gap": refine}
    result = ReproResult(id=ID, mode=mode, seeds=seeds, claim=CLAIM, table=table, checks=checks, figures=figures,
                         notes=notes, config=config, wall_time_s=time.perf_counter() - t0,
                         environment=environment(seeds), extra=extra)
    result.save(out_dir)
    return result


def run(mode: str, seeds: Sequence[int], out_dir: Path) -> ReproResult:
    """Run the reproduction in ``mode`` ("smoke", "quick" or "full") for ``seeds``; write figures and result.json.

    Uses one torch thread while it runs (tiny models: more threads only spin) and restores the setting.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(mode, seeds, out_dir)
    finally:
        torch.set_num_threads(threads)
