"""Reproduction of DiffBCP (spec ``shared/methods/diffbcp.md``): Bayesian CP completion with a CUSP rank
prior and a diffusion prior, sampled by split Gibbs, against BCP-CUSP (no coupling), CP-ALS (tensorly's
masked ``parafac``), diffusion only (PnP-DM) and the hand-annealed rho schedule.

Per seed: ``n_digits`` held-out 16 x 16 digits (``zoo.digits_images``' test split, never seen by the
prior) in [-1, 1], a random mask observing ``observed`` of the pixels and noise ``N(0, sigma^2)`` on them;
the patch tensor is 4 x 4 x 49 (4 x 4 patches, stride 2). The prior is the cached diffusers UNet of
``repro.kit.diffusion_priors`` (``rankwise zoo build``). Metric: PSNR of the posterior mean (data range 2).
Second part: rank recovery of BCP-CUSP on a synthetic rank-3 tensor 20 x 20 x 20, 50 % observed.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from rankwise.repro.kit import diffusion_priors as kit
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.science import diffbcp as db

ID = "diffbcp"
CLAIM = ("At 10 % observed pixels (noise 0.05), DiffBCP's posterior-mean PSNR on held-out 16 x 16 digits is "
         ">= BCP-CUSP + 1.5 dB and >= CP-ALS (rank 4) + 1.5 dB; on a synthetic rank-3 tensor BCP-CUSP's "
         "contribution rank is 3 +- 1 with relative error < 0.1.")

# thresholds of the spec, stated before any run
MARGIN_DB = 1.5
RANK_TOL = 1
REL_ERR_MAX = 0.1
# preconditions
PRIOR_LEARNED_DB = 1.0  # diffusion only (PnP-DM) must beat the constant fill by this much: the prior carries information
SATURATION_DB = 35.0  # DiffBCP below this: the task is not solved outright

ROWS = ("DiffBCP", "DiffBCP (annealed rho)", "BCP-CUSP", "CP-ALS", "PnP-DM (diffusion only)", "constant fill")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffBCPSettings(Settings):
    """What the DiffBCP reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    n_digits: int = setting(20, "held-out test digits (the first n of zoo.digits_images' test split)", lo=1, hi=297)
    observed: tuple[float, ...] = setting((0.1, 0.2), "fractions of observed pixels (the claim: the first, 0.1)",
                                          lo=0.01, hi=1.0)
    sigma: float = setting(0.05, "noise std on the observed pixels ([-1, 1] scale)", lo=0.0)
    iters: int = setting(60, "outer split-Gibbs iterations K (the same for every sampled row)", lo=2)
    burn_in: int = setting(24, "burn-in iterations", lo=0)
    n_samples: int = setting(12, "collected samples (equally spaced after burn-in)", lo=1)
    init_rank: int = setting(32, "initial CP rank R0", lo=1)
    grid_steps: int = setting(50, "reverse-diffusion time grid (the block starts at sigma(t) < rho)", lo=1)
    als_rank: int = setting(4, "CP-ALS rank", lo=1)
    als_iter_max: int = setting(500, "CP-ALS iteration cap", lo=1)
    als_restarts: int = setting(2, "CP-ALS random restarts besides the SVD start (best observed fit wins)", lo=0)
    annealed_row: bool = setting(True, "run the hand-annealed rho ablation")
    synth_size: int = setting(20, "synthetic tensor side (I x I x I)", lo=3)
    synth_rank: int = setting(3, "synthetic tensor rank", lo=1)
    synth_observed: float = setting(0.5, "synthetic observed fraction", lo=0.01, hi=1.0)
    synth_noise: float = setting(0.01, "synthetic noise std", lo=0.0)
    synth_init_rank: int = setting(16, "BCP-CUSP R0 on the synthetic tensor", lo=1)
    synth_sweeps: int = setting(300, "BCP-CUSP sweeps on the synthetic tensor", lo=2)
    recipe: str = setting("cached", "diffusion prior: the cached zoo recipe, or smoke's tiny in-memory one",
                          choices=("cached", "smoke"))

    def validate(self) -> None:
        if self.burn_in >= self.iters:
            raise ValueError(f"DiffBCPSettings.burn_in must be < iters = {self.iters}, got {self.burn_in}")


SETTINGS = {
    "smoke": DiffBCPSettings(n_digits=2, observed=(0.1,), iters=4, burn_in=1, n_samples=2, init_rank=8, grid_steps=10,
                             als_iter_max=20, als_restarts=0, synth_size=8, synth_init_rank=6, synth_sweeps=20,
                             recipe="smoke"),
    "quick": DiffBCPSettings(seeds=(0,), n_digits=5, observed=(0.1,), iters=20, burn_in=8, n_samples=6),
    # full: quick's K = 20 at 8 digits, both observed fractions, 3 seeds (the class defaults, 20 digits at
    # K = 60, were sized at 30-50 CPU min from quick's per-image time; this is ~48 image runs, ~7 min)
    "full": DiffBCPSettings(n_digits=8, iters=20, burn_in=8, n_samples=6),
}


def _constant_fill(y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.full_like(y, float(y[m.bool()].mean()))


class DiffBCPReproduction(Reproduction[DiffBCPSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1

    def _prior(self, s: DiffBCPSettings) -> db.TinyVPDiffusion:
        if not hasattr(self, "_p"):
            cache = s.recipe == "cached"
            self._p = kit.prior(0, recipe=None if cache else kit.SMOKE_RECIPE, cache=cache)
        return self._p

    def measure(self, s: DiffBCPSettings, seed: int) -> dict[str, Any]:
        prior = self._prior(s)
        truth = kit.digits("test")[: s.n_digits, 0].double()
        out: dict[str, Any] = {"synthetic": self._synthetic(s, seed), "runs": {}}
        cfg = db.DiffBCPConfig(init_rank=s.init_rank, iters=s.iters, burn_in=s.burn_in, n_samples=s.n_samples,
                               grid_steps=s.grid_steps)
        for frac in s.observed:
            gen = torch.Generator().manual_seed(1000 * seed + int(round(frac * 100)))
            masks = [(torch.rand(truth.shape[1:], generator=gen) < frac).double() for _ in truth]
            for m in masks:  # at least one observed pixel per image
                if not m.any():
                    m[0, 0] = 1.0
            ys = [t + s.sigma * torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in truth]
            ys = [y * m for y, m in zip(ys, masks)]
            rec: dict[str, Any] = {"psnr": {}, "images": {}, "traces": {}}
            results = {
                "DiffBCP": db.DiffBCP(cfg).fit_many(ys, masks, prior, seed),
                "BCP-CUSP": db.DiffBCP(dataclasses.replace(cfg, schedule="none")).fit_many(ys, masks, None, seed),
                "PnP-DM (diffusion only)": db.pnp_dm(ys, masks, prior, max(s.sigma, 1e-3), cfg, seed),
            }
            if s.annealed_row:
                results["DiffBCP (annealed rho)"] = db.DiffBCP(dataclasses.replace(cfg, schedule="annealed")).fit_many(
                    ys, masks, prior, seed)
            images = {k: [r.mean for r in v] for k, v in results.items()}
            als = [db.cp_als_complete(y, m, rank=s.als_rank, n_iter_max=s.als_iter_max, restarts=s.als_restarts,
                                      seed=seed) for y, m in zip(ys, masks)]
            images["CP-ALS"] = [a.image for a in als]
            images["constant fill"] = [_constant_fill(y, m) for y, m in zip(ys, masks)]
            for row, ims in images.items():
                rec["psnr"][row] = [db.psnr(im, t) for im, t in zip(ims, truth)]
                rec["images"][row] = [im.float().tolist() for im in ims[:4]]
            rec["images"]["truth"] = [t.float().tolist() for t in truth[:4]]
            rec["images"]["observed"] = [torch.where(m.bool(), y, torch.full_like(y, float("nan"))).float().tolist()
                                         for y, m in zip(ys[:4], masks[:4])]
            rec["images"]["DiffBCP std"] = [r.std.float().tolist() for r in results["DiffBCP"][:4]]
            rec["active_final"] = {k: _mean([r.rank_z_trace[-1] for r in results[k]]) for k in ("DiffBCP", "BCP-CUSP")}
            rec["noise_std_final"] = {k: _mean([r.noise_std for r in results[k]]) for k in ("DiffBCP", "BCP-CUSP")}
            rec["als_iters"] = [a.all_iterations for a in als]
            rec["als_converged"] = [a.converged for a in als]
            rec["cpu_s"] = {k: sum(r.cpu_s for r in v) / len(v) for k, v in results.items()}
            rec["cpu_s"]["CP-ALS"] = sum(a.cpu_s for a in als) / len(als)
            for k, v in results.items():
                r0 = v[0]
                rec["traces"][k] = {"rho": r0.rho_trace, "tau": r0.tau_trace, "rank": r0.rank_trace,
                                    "rank_z": r0.rank_z_trace, "size": r0.size_trace, "steps": r0.steps_trace}
            rec["wiring"] = self._wiring(s, results, prior, cfg, truth)
            out["runs"][str(frac)] = rec
        return out

    def _synthetic(self, s: DiffBCPSettings, seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(50_000 + seed)
        n, R = s.synth_size, s.synth_rank
        U = [torch.randn(n, R, generator=gen, dtype=torch.float64) for _ in range(3)]
        X = torch.einsum("ir,jr,kr->ijk", *U)
        M = (torch.rand(n, n, n, generator=gen) < s.synth_observed).double()
        Y = X + s.synth_noise * torch.randn(X.shape, generator=gen, dtype=torch.float64)
        res = db.BayesianCP(db.CUSPConfig(init_rank=s.synth_init_rank)).fit(Y, M, sweeps=s.synth_sweeps, seed=seed)
        return {"rank": res.rank, "rank_z": res.rank_z_trace[-1], "rel_err": res.relative_error(X),
                "rank_trace": res.rank_trace, "rank_z_trace": res.rank_z_trace, "size_trace": res.size_trace,
                "noise_std": res.tau_trace[-1] ** -0.5, "cpu_s": res.cpu_s}

    def _wiring(self, s: DiffBCPSettings, results: dict[str, Any], prior: Any, cfg: db.DiffBCPConfig,
                truth: torch.Tensor) -> dict[str, float]:
        rho_err = 0.0
        for r in results["DiffBCP"]:
            for k, rho in enumerate(r.rho_trace):
                want = db.rho_noise_adaptive(k, r.tau_trace[k - 1] if k else 1.0, cfg.rho_const, cfg.rho_min, cfg.rho_max)
                rho_err = max(rho_err, abs(rho - want))
        ann_err = 0.0
        for r in results.get("DiffBCP (annealed rho)", []):
            for k, rho in enumerate(r.rho_trace):
                ann_err = max(ann_err, abs(rho - db.rho_annealed(k, cfg.rho0, cfg.gamma, cfg.rho_min)))
        steps_bad = 0
        for r in results["DiffBCP"]:
            steps_bad += sum(int(st != prior.steps_for(rho)) for st, rho in zip(r.steps_trace, r.rho_trace))
        grid = [prior.steps_for(rho) for rho in torch.logspace(2, -3, 60).tolist()]
        steps_bad += sum(int(b > a) for a, b in zip(grid, grid[1:]))
        pm = db.PatchMap(1, truth.shape[1], truth.shape[2], cfg.patch, cfg.stride)
        trip = max(float((pm.to_image(pm.to_tensor(t)) - t).abs().max()) for t in truth)
        return {"rho_err": rho_err, "annealed_err": ann_err, "steps_bad": float(steps_bad), "patch_roundtrip": trip}

    # ------------------------------------------------------------------------------------ report
    def table(self, s: DiffBCPSettings, records: Records[dict]) -> Table:
        t = Table(columns=["psnr_db", "cpu_s_per_image"],
                  notes={"psnr_db": "PSNR of the posterior mean (reconstruction) vs the clean digit, mean over digits",
                         "cpu_s_per_image": "CPU seconds per image (process time, one thread; the diffusion block "
                                            "is batched over the digits)"})
        for frac in s.observed:
            tag = "" if frac == s.observed[0] else f" [{frac:.0%} observed]"
            for r in records:
                run = r["runs"][str(frac)]
                for row in ROWS:
                    if row in run["psnr"]:
                        t.add(row + tag, "psnr_db", _mean(run["psnr"][row]))
                        if row in run["cpu_s"]:
                            t.add(row + tag, "cpu_s_per_image", run["cpu_s"][row])
        self._t = t
        return t

    def _claim_run(self, s: DiffBCPSettings, records: Records[dict]) -> list[dict[str, Any]]:
        return [r["runs"][str(s.observed[0])] for r in records]

    def preconditions(self, s: DiffBCPSettings, records: Records[dict]) -> list[Precondition]:
        runs = self._claim_run(s, records)
        gain = _mean([_mean(r["psnr"]["PnP-DM (diffusion only)"]) - _mean(r["psnr"]["constant fill"]) for r in runs])
        return [
            Precondition("the diffusion prior learned: PnP-DM PSNR - constant-fill PSNR (dB)", gain, ">=", PRIOR_LEARNED_DB),
            Precondition("the task does not saturate: DiffBCP PSNR (dB)",
                         _mean([_mean(r["psnr"]["DiffBCP"]) for r in runs]), "<=", SATURATION_DB),
        ]

    def checks(self, s: DiffBCPSettings, records: Records[dict]) -> list[ClaimCheck]:
        runs = self._claim_run(s, records)

        def paired(a: str, b: str) -> list[list[float]]:
            return [[x - y for x, y in zip(r["psnr"][a], r["psnr"][b])] for r in runs]

        vs_bcp, vs_als = paired("DiffBCP", "BCP-CUSP"), paired("DiffBCP", "CP-ALS")
        syn = [r["synthetic"] for r in records]
        wires = [r["runs"][str(f)]["wiring"] for r in records for f in s.observed]
        return [
            ClaimCheck(f"DiffBCP - BCP-CUSP PSNR at {s.observed[0]:.0%} observed", _nested_mean(vs_bcp), ">=", MARGIN_DB,
                       unit="dB", samples=vs_bcp),
            ClaimCheck(f"DiffBCP - CP-ALS (rank {s.als_rank}) PSNR at {s.observed[0]:.0%} observed", _nested_mean(vs_als),
                       ">=", MARGIN_DB, unit="dB", samples=vs_als),
            ClaimCheck(f"synthetic rank-{s.synth_rank}: max over seeds of |contribution rank - {s.synth_rank}|",
                       float(max(abs(x["rank"] - s.synth_rank) for x in syn)), "<=", RANK_TOL),
            ClaimCheck("synthetic: max over seeds of the relative error of the posterior mean",
                       max(x["rel_err"] for x in syn), "<", REL_ERR_MAX),
            ClaimCheck("rho trace = clip(sqrt(c / tau_k), rho_min, rho_max) (max abs difference)",
                       max(w["rho_err"] for w in wires), "<=", 0.0, kind="wiring"),
            ClaimCheck("annealed rho trace = max(rho0 gamma^k, rho_min) (max abs difference)",
                       max(w["annealed_err"] for w in wires), "<=", 0.0, kind="wiring"),
            ClaimCheck("diffusion block: steps run = grid steps below rho, non-increasing as rho shrinks (violations)",
                       sum(w["steps_bad"] for w in wires), "<=", 0.0, kind="wiring"),
            ClaimCheck("patch round trip: max |patches2image(image2patches(I)) - I|",
                       max(w["patch_roundtrip"] for w in wires), "<=", 1e-12, kind="wiring"),
        ]

    def figures(self, s: DiffBCPSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        if not len(records):
            return []
        run = records[0]["runs"][str(s.observed[0])]
        cols = ["truth", "observed"] + [r for r in ROWS if r in run["images"]] + ["DiffBCP std"]
        n = len(run["images"]["truth"])
        fig, axes = plt.subplots(n, len(cols), figsize=(1.4 * len(cols), 1.5 * n + 0.4), squeeze=False)
        for j, c in enumerate(cols):
            for i in range(n):
                ax = axes[i][j]
                img = torch.tensor(run["images"][c][i])
                if c == "DiffBCP std":
                    ax.imshow(img, cmap="magma")
                else:
                    ax.imshow(torch.nan_to_num(img, nan=-1.0).clamp(-1, 1), cmap="gray", vmin=-1, vmax=1)
                    if c in run["psnr"]:
                        ax.set_xlabel(f"{run['psnr'][c][i]:.1f} dB", fontsize=6)
                ax.set_xticks([])
                ax.set_yticks([])
                if i == 0:
                    ax.set_title(c.replace(" (", "\n("), fontsize=6)
        fig.suptitle(f"DiffBCP reconstructions, {s.observed[0]:.0%} observed, sigma {s.sigma}, seed {records.seeds[0]}",
                     fontsize=8)
        fig.tight_layout()
        names = [save_figure(fig, out_dir / "diffbcp_reconstructions.png")]
        tr = run["traces"]
        fig, ax = plt.subplots(1, 3, figsize=(12, 3.4))
        for row in ("DiffBCP", "DiffBCP (annealed rho)", "PnP-DM (diffusion only)"):
            if row in tr:
                ax[0].plot(tr[row]["rho"], label=row)
        ax[0].axhline(s.sigma * math.sqrt(100.0), color="gray", ls=":", lw=1, label="sqrt(c) x true sigma")
        ax[0].set_yscale("log")
        ax[0].set_xlabel("outer iteration")
        ax[0].set_ylabel("rho")
        ax[0].legend(fontsize=7)
        for row, ls in (("DiffBCP", "-"), ("BCP-CUSP", "--")):
            ax[1].plot(tr[row]["rank"], ls=ls, label=f"{row}: contribution rank")
            ax[1].plot(tr[row]["rank_z"], ls=ls, label=f"{row}: CUSP #(z_r > r)")
            ax[1].plot(tr[row]["size"], ls=ls, lw=0.8, label=f"{row}: truncation R")
        ax[1].set_xlabel("outer iteration (digit 1)")
        ax[1].legend(fontsize=6)
        syn = records[0]["synthetic"]
        ax[2].plot(syn["rank_trace"], label="contribution rank")
        ax[2].plot(syn["rank_z_trace"], label="CUSP #(z_r > r)")
        ax[2].plot(syn["size_trace"], label="truncation R")
        ax[2].axhline(s.synth_rank, color="k", ls=":", lw=1, label="true rank")
        ax[2].set_xlabel("sweep (synthetic tensor)")
        ax[2].legend(fontsize=7)
        fig.tight_layout()
        names.append(save_figure(fig, out_dir / "diffbcp_traces.png"))
        return names

    def notes(self, s: DiffBCPSettings, records: Records[dict]) -> str:
        runs = self._claim_run(s, records)
        t = self._t
        als = [it for r in runs for its in r["als_iters"] for it in its]
        conv = [c for r in runs for c in r["als_converged"]]
        syn = records[0]["synthetic"]
        parts = [f"{s.n_digits} held-out digits x {len(records)} seed(s), {s.iters} outer iterations (burn-in {s.burn_in}, "
                 f"{s.n_samples} samples), R0 = {s.init_rank}, {s.grid_steps}-step reverse grid.",
                 f"Margins at {s.observed[0]:.0%} observed (reported, not checked: the spec expects them only "
                 f"qualitatively): DiffBCP - PnP-DM = {t.mean('DiffBCP', 'psnr_db') - t.mean('PnP-DM (diffusion only)', 'psnr_db'):+.2f} dB"]
        if s.annealed_row:
            parts[-1] += f", DiffBCP - annealed rho = {t.mean('DiffBCP', 'psnr_db') - t.mean('DiffBCP (annealed rho)', 'psnr_db'):+.2f} dB"
        parts[-1] += "."
        parts.append(f"CP-ALS (tensorly masked parafac, SVD start + {s.als_restarts} random restarts): ALS iterations "
                     f"per run median {sorted(als)[len(als) // 2]}, max {max(als)}; the chosen run converged (tol 1e-7) "
                     f"on {sum(conv)}/{len(conv)} digits.")
        parts.append(f"Synthetic (seed {records.seeds[0]}): contribution rank {syn['rank']}, CUSP active count "
                     f"{syn['rank_z']}, relative error {syn['rel_err']:.4f}, noise std {syn['noise_std']:.4f}, "
                     f"{syn['cpu_s']:.1f} CPU s for {s.synth_sweeps} sweeps.")
        act = {k: _mean([r["active_final"][k] for r in runs]) for k in ("DiffBCP", "BCP-CUSP")}
        nstd = {k: _mean([r["noise_std_final"][k] for r in runs]) for k in ("DiffBCP", "BCP-CUSP")}
        parts.append(f"At the last iteration, CUSP active count (mean over digits): DiffBCP {act['DiffBCP']:.1f}, BCP-CUSP "
                     f"{act['BCP-CUSP']:.1f}; estimated noise std tau^-1/2: DiffBCP {nstd['DiffBCP']:.2f}, BCP-CUSP "
                     f"{nstd['BCP-CUSP']:.2f} (true {s.sigma}). With ~26 observed pixels per digit the data barely pull the "
                     f"weights out of the spike (theta_inf = 1e-3): the CP block stays near the zero image, tau stays small and "
                     f"rho = sqrt(c / tau) stays far above sqrt(c) sigma, so DiffBCP's diffusion block starts from high noise. "
                     f"Constant fill at the observed mean: {t.mean('constant fill', 'psnr_db'):.2f} dB; 10 % observed is the "
                     f"regime where low rank alone fails (the paper's premise), not a broken baseline: BCP-CUSP recovers the "
                     f"synthetic tensor, and on these digits it reaches about 14-16 dB at 20 % observed (docs/methods/diffbcp.md).")
        if s.recipe == "smoke":
            parts.append("Smoke: an untrained tiny prior in memory; the numbers check the wiring only.")
        return " ".join(parts)


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def _nested_mean(v: list[list[float]]) -> float:
    return _mean([_mean(x) for x in v])


REPRODUCTION = DiffBCPReproduction
run = DiffBCPReproduction.run
