"""Reproduction of CondiQuant (spec ``shared/methods/condiquant.md``): lowering the condition number of each
weight at a fixed calibration output before plain MinMax PTQ raises the PSNR of a low-bit SR network.

Per seed (model init + calibration subset), on the cached SR net and data of ``repro.kit.condiquant_sr``
(a SwinIR-like CNN with channel-MLP blocks; x2 grayscale SR): CondiQuant (``spread`` prox, the documented
lambda grid, K = 100, output budget 2e-3) and its ``shave`` variant condition the 1x1 convs (``fc1``/``fc2``,
linear maps over channels; head, tail and depthwise convs stay FP); then PTQ at W{b}A{b} (per-output-channel
symmetric weights, per-tensor asymmetric inputs of the 1x1 convs; 64 calibration LR images) with MinMax and
Percentile(99.9) observers on the original and on each conditioned model. Measured: test PSNR (border 2
cropped), per-layer kappa before/after, the FP output change of conditioning, and W-only vs A-only
quantization at the same bits (the paper's motivation).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from rankwise.compress.condiquant import (
    LAMBDA_GRID,
    SPEC_LAMBDA_GRID,
    CondiQuantConfig,
    act_qparams,
    condition_model,
    ptq_quantize,
)
from rankwise.repro.kit import condiquant_sr as sr
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

ID = "condiquant"
CLAIM = ("On a small SR network with channel-MLP blocks, CondiQuant (spread prox) + MinMax PTQ beats MinMax PTQ "
         "by >= 0.2 dB test PSNR at W3A3 and >= 0.4 dB at W2A2, the conditioned FP model stays within 0.1 dB of "
         "the original, per-layer kappa never rises and the median kappa falls, and activation-only quantization "
         "costs more PSNR than weight-only at the same bits.")

# thresholds of the spec, stated before any run
GAIN = {3: 0.2, 2: 0.4}          # dB, CondiQuant+MinMax - MinMax at W{b}A{b}
FP_TOL = 0.1                     # dB, |conditioned FP - FP|
KAPPA_TOL = 1e-9                 # relative: kappa_after <= kappa_before (1 + tol)
QPARAM_TOL = 1e-6
# preconditions
FP_OVER_BICUBIC = 0.3            # dB: the FP net learned beyond its bicubic skip
MINMAX_LOSS = 0.2                # dB at W3A3: there is a quantization loss to recover (the claim's own margin)
TARGET = "re:blocks\\.\\d+\\.fc[12]"
STUDY_BITS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class CondiQuantSettings(Settings):
    """What the CondiQuant reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    recipe: str = setting("full", "the cached SR net + data recipe (repro.kit.condiquant_sr; smoke trains in memory)",
                          choices=("smoke", "quick", "full"))
    bits: tuple[int, ...] = setting((4, 3, 2), "PTQ bit widths b (weights and activations at W{b}A{b})", lo=2, hi=8)
    observers: tuple[str, ...] = setting(("minmax", "percentile"), "PTQ activation observers (arms): minmax, percentile")
    proxes: tuple[str, ...] = setting(("spread", "shave"), "conditioning variants: spread (the claim's), shave")
    n_calib: int = setting(64, "calibration LR images (drawn per seed from the calibration pool)", lo=1)
    calib_batch: int = setting(16, "calibration batch size", lo=1)
    n_test: int = setting(300, "test images (PSNR per image)", lo=1)
    percentile: float = setting(99.9, "Percentile observer's clip percentile", lo=50.0, hi=100.0)
    max_iters: int = setting(100, "K, proximal gradient steps per layer and lambda", lo=1)
    max_rel_output_err: float = setting(2e-3, "per-layer output budget ||XW - Y|| / ||Y|| (the spec's)", lo=0.0)
    spec_grid: bool = setting(False, "search only the spec's lambda grid 1e-3..1 instead of the extended default")
    budgets: tuple[float, ...] = setting((1e-2, 3e-2), "looser output budgets reported as sensitivity rows "
                                         "(spread + MinMax; not part of the claim)", lo=0.0)

    def validate(self) -> None:
        for field, vals, allowed in (("observers", self.observers, ("minmax", "percentile")),
                                     ("proxes", self.proxes, ("spread", "shave"))):
            if not vals or any(v not in allowed for v in vals):
                raise ValueError(f"CondiQuantSettings.{field} must be a non-empty tuple of {allowed}, got {vals}")
        if "spread" not in self.proxes:
            raise ValueError(f"CondiQuantSettings.proxes must include 'spread' (the claim's prox), got {self.proxes}")
        if "minmax" not in self.observers:
            raise ValueError(f"CondiQuantSettings.observers must include 'minmax', got {self.observers}")


SETTINGS = {
    "smoke": CondiQuantSettings(recipe="smoke", bits=(3,), observers=("minmax",), n_calib=8, n_test=16,
                                max_iters=5, budgets=(1e-2,), seeds=(0,)),
    "quick": CondiQuantSettings(recipe="quick", bits=(3,), observers=("minmax",), seeds=(0,)),
    "full": CondiQuantSettings(seeds=(0, 1, 2)),
}


def _arm(obs: str, prox: str | None, b: int) -> str:
    name = {"minmax": "MinMax", "percentile": "Percentile"}[obs]
    return f"{'CondiQuant(' + prox + ') + ' if prox else ''}{name} W{b}A{b}"


def _psnr(m: torch.nn.Module, lr: torch.Tensor, hr: torch.Tensor) -> list[float]:
    with torch.no_grad():
        return sr.psnr(m(lr), hr).tolist()


def _diff(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


def _mean(v: list[float]) -> float:
    return statistics.fmean(v) if v else math.nan


class CondiQuantReproduction(Reproduction[CondiQuantSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1

    def measure(self, s: CondiQuantSettings, seed: int) -> dict[str, Any]:
        d = sr.data(s.recipe, cache=s.recipe != "smoke")
        m = sr.model(s.recipe, seed)
        lr_te, hr_te = d.lr_test[: s.n_test], d.hr_test[: s.n_test]
        pool = d.lr_calib
        idx = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[: s.n_calib]
        calib = [pool[idx[i:i + s.calib_batch]] for i in range(0, len(idx), s.calib_batch)]
        res: dict[str, Any] = {"psnr": {}, "kappa": {}, "lam": {}, "out_change": {}, "wiring": {}}
        res["psnr"]["FP"] = _psnr(m, lr_te, hr_te)
        with torch.no_grad():
            up = torch.nn.functional.interpolate(lr_te, scale_factor=2, mode="bicubic", align_corners=False)
            res["psnr"]["bicubic"] = sr.psnr(up, hr_te).tolist()
            y_fp = m(lr_te)
        models: dict[str | None, torch.nn.Module] = {None: m}
        shapes = {n: (tuple(p.shape), p.dtype) for n, p in m.named_parameters()}
        mismatch = 0
        grid = SPEC_LAMBDA_GRID if s.spec_grid else LAMBDA_GRID
        for prox in (*s.proxes, *(f"spread, err<={b:g}" for b in s.budgets)):
            mc = copy.deepcopy(m)
            budget = float(prox.split("<=")[1]) if "<=" in prox else s.max_rel_output_err
            rep = condition_model(mc, calib, CondiQuantConfig(prox=prox.split(",")[0], target=TARGET, lam_grid=grid,
                                                              max_iters=s.max_iters, max_rel_output_err=budget))
            models[prox] = mc
            mismatch += sum((tuple(p.shape), p.dtype) != shapes.get(n) for n, p in mc.named_parameters())
            mismatch += abs(len(list(mc.parameters())) - len(shapes))
            res["kappa"][prox] = [(r.name, r.kappa_before, r.kappa_after) for r in rep.layers]
            res["lam"][prox] = {r.name: r.lam for r in rep.layers}
            res["psnr"][f"FP conditioned ({prox})"] = _psnr(mc, lr_te, hr_te)
            with torch.no_grad():
                res["out_change"][prox] = float((mc(lr_te) - y_fp).norm() / y_fp.norm())
        res["wiring"]["shape_mismatch"] = mismatch
        levels_over, qparam_err, err_ratio = 0, 0.0, 0.0
        for b in s.bits:
            for obs in s.observers:
                for prox, mm in models.items():
                    if obs != "minmax" and prox is not None and "<=" in prox:
                        continue
                    q = ptq_quantize(mm, calib, b, b, observer=obs, percentile=s.percentile, target=TARGET)
                    res["psnr"][_arm(obs, prox, b)] = _psnr(q, lr_te, hr_te)
                    for ql in q.quant_layers().values():
                        levels_over = max(levels_over, int(torch.unique(ql.w_int).numel()) - 2 ** b)
                    if obs == "minmax" and prox is None:
                        e1, e2 = _check_minmax(q, mm, calib, b)
                        qparam_err, err_ratio = max(qparam_err, e1), max(err_ratio, e2)
        res["wiring"].update(levels_over=levels_over, qparam_err=qparam_err, err_ratio=err_ratio)
        b = STUDY_BITS
        res["psnr"][f"W-only W{b}"] = _psnr(ptq_quantize(m, calib, b, None, target=TARGET), lr_te, hr_te)
        res["psnr"][f"A-only A{b}"] = _psnr(ptq_quantize(m, calib, None, b, target=TARGET), lr_te, hr_te)
        return res

    def table(self, s: CondiQuantSettings, records: Records[dict]) -> Table:
        t = Table(columns=["PSNR", "median kappa", "FP output change"],
                  notes={"PSNR": "test PSNR (dB, border 2 cropped), higher is better",
                         "median kappa": "median over the 1x1 convs of sigma_max / sigma_min",
                         "FP output change": "||f_conditioned(x) - f(x)|| / ||f(x)|| on the test LR images"})
        for r in records:
            for row, v in r["psnr"].items():
                t.add(row, "PSNR", _mean(v))
            before = [k0 for _, k0, _ in r["kappa"][s.proxes[0]]]
            t.add("FP", "median kappa", statistics.median(before))
            for prox in r["kappa"]:
                t.add(f"FP conditioned ({prox})", "median kappa", statistics.median(k1 for _, _, k1 in r["kappa"][prox]))
                t.add(f"FP conditioned ({prox})", "FP output change", r["out_change"][prox])
        self._t = t
        return t

    def preconditions(self, s: CondiQuantSettings, records: Records[dict]) -> list[Precondition]:
        t = self._t
        out = [Precondition("the FP net beats its bicubic skip (dB)", t.mean("FP", "PSNR") - t.mean("bicubic", "PSNR"),
                            ">=", FP_OVER_BICUBIC, "dB")]
        b = 3 if 3 in s.bits else min(s.bits)
        out.append(Precondition(f"MinMax W{b}A{b} loses PSNR against FP (something to recover)",
                                t.mean("FP", "PSNR") - t.mean(_arm("minmax", None, b), "PSNR"), ">=", MINMAX_LOSS, "dB"))
        return out

    def checks(self, s: CondiQuantSettings, records: Records[dict]) -> list[ClaimCheck]:
        out = []
        for b in s.bits:
            if b not in GAIN:
                continue
            paired = [_diff(r["psnr"][_arm("minmax", "spread", b)], r["psnr"][_arm("minmax", None, b)]) for r in records]
            out.append(ClaimCheck(f"CondiQuant(spread) + MinMax - MinMax at W{b}A{b} (dB)",
                                  statistics.fmean(_mean(p) for p in paired), ">=", GAIN[b], "dB", samples=paired))
        fp = [_diff(r["psnr"]["FP conditioned (spread)"], r["psnr"]["FP"]) for r in records]
        out.append(ClaimCheck("|conditioned FP - FP| (dB)", abs(statistics.fmean(_mean(p) for p in fp)), "<=", FP_TOL,
                              "dB", samples=fp, statistic="abs_mean"))
        ratio = [statistics.median(k1 for _, _, k1 in r["kappa"]["spread"]) / statistics.median(k0 for _, k0, _ in r["kappa"]["spread"])
                 for r in records]
        out.append(ClaimCheck("median kappa after / before (spread)", statistics.fmean(ratio), "<", 1.0))
        b = STUDY_BITS
        wa = [_diff(r["psnr"][f"W-only W{b}"], r["psnr"][f"A-only A{b}"]) for r in records]
        out.append(ClaimCheck(f"PSNR(W-only W{b}) - PSNR(A-only A{b}): activations cost more (dB)",
                              statistics.fmean(_mean(p) for p in wa), ">", 0.0, "dB", samples=wa))
        worst = max(k1 / k0 - 1.0 for r in records for p in r["kappa"] for _, k0, k1 in r["kappa"][p] if math.isfinite(k0))
        out += [
            ClaimCheck("max over layers of kappa_after / kappa_before - 1 (never increases)", worst, "<=", KAPPA_TOL,
                       kind="wiring"),
            ClaimCheck("parameters whose shape/dtype changed, plus added/removed parameters",
                       max(r["wiring"]["shape_mismatch"] for r in records), "<=", 0, kind="wiring"),
            ClaimCheck("integer weight levels beyond 2^b", max(r["wiring"]["levels_over"] for r in records), "<=", 0,
                       kind="wiring"),
            ClaimCheck("MinMax activation qparams vs torch.ao MinMaxObserver (relative scale error, zero-point mismatch)",
                       max(r["wiring"]["qparam_err"] for r in records), "<=", QPARAM_TOL, kind="wiring"),
            ClaimCheck("MinMax fake-quant error on calibration data / (scale / 2)",
                       max(r["wiring"]["err_ratio"] for r in records), "<=", 1.0 + 1e-4, kind="wiring"),
        ]
        return out

    def notes(self, s: CondiQuantSettings, records: Records[dict]) -> str:
        t = self._t
        lines = [f"Recipe {s.recipe!r} ({sr.RECIPES[s.recipe]}), {len(records)} seed(s), {s.n_test} test images, "
                 f"{s.n_calib} calibration images; conditioned layers: the 1x1 convs {TARGET}."]
        for b in s.bits:
            base = t.mean(_arm("minmax", None, b), "PSNR")
            gains = ", ".join(f"{p} {t.mean(_arm('minmax', p, b), 'PSNR') - base:+.3f} dB" for p in records.first["kappa"])
            lines.append(f"W{b}A{b}: CondiQuant + MinMax vs MinMax: {gains}.")
            if "percentile" in s.observers:
                pb = t.mean(_arm("percentile", None, b), "PSNR")
                gains = ", ".join(f"{p} {t.mean(_arm('percentile', p, b), 'PSNR') - pb:+.3f} dB" for p in s.proxes)
                lines.append(f"W{b}A{b}: CondiQuant + Percentile vs Percentile: {gains}.")
        r0 = records.first
        for p in r0["kappa"]:
            lams = sorted(set(r0["lam"][p].values()))
            lines.append(f"{p}: lambdas chosen (seed {records.items()[0][0]}) {lams}; FP output change "
                         f"{_mean([r['out_change'][p] for r in records]):.2e}.")
        lines.append("Tiny models start at kappa ~ 5-10, so no 100x reduction is expected (spec).")
        return " ".join(lines)

    def figures(self, s: CondiQuantSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        t = self._t
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        labels = list(records.first["kappa"])
        width = 0.8 / len(labels)
        for i, prox in enumerate(labels):
            vals = [t.mean(_arm("minmax", prox, b), "PSNR") - t.mean(_arm("minmax", None, b), "PSNR") for b in s.bits]
            a1.bar([j + i * width for j in range(len(s.bits))], vals, width, label=prox)
        for j, b in enumerate(s.bits):
            if b in GAIN:
                a1.hlines(GAIN[b], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--")
        a1.axhline(0.0, color="k", lw=0.5)
        a1.set_xticks([j + 0.4 - width / 2 for j in range(len(s.bits))], [f"W{b}A{b}" for b in s.bits])
        a1.set_ylabel("gain over MinMax PTQ (dB)")
        a1.set_title("CondiQuant + MinMax - MinMax; dashed: the claim", fontsize=9)
        a1.legend(fontsize=7)
        r0 = records.first
        for prox in r0["kappa"]:
            k0 = [k for _, k, _ in r0["kappa"][prox]]
            k1 = [k for _, _, k in r0["kappa"][prox]]
            a2.scatter(k0, k1, label=prox)
        lim = max(k for _, k, _ in r0["kappa"][s.proxes[0]])
        a2.plot([1, lim], [1, lim], "k:")
        a2.set_xlabel("kappa before")
        a2.set_ylabel("kappa after")
        a2.legend(fontsize=7)
        return [save_figure(fig, out_dir / "condiquant.png")]


def _check_minmax(q: Any, fp: torch.nn.Module, calib: list[torch.Tensor], bits: int) -> tuple[float, float]:
    """Compare each quantized layer's activation qparams with torch.ao's MinMaxObserver on the same (FP
    model's) calibration inputs, and the largest fake-quant error on them over ``scale / 2``."""
    from torch.ao.quantization import MinMaxObserver

    qerr, ratio = 0.0, 0.0
    layers = q.quant_layers()
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in layers}
    hooks = [fp.get_submodule(n).register_forward_pre_hook(lambda mod, args, n=n: seen[n].append(args[0].detach()))
             for n in layers]
    try:
        with torch.no_grad():
            for x in calib:
                fp(x)
    finally:
        for h in hooks:
            h.remove()
    for n, ql in layers.items():
        obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=2 ** bits - 1)
        for x in seen[n]:
            obs(x)
        scale, zp = obs.calculate_qparams()
        s_ours, z_ours = act_qparams(float(ql.a_range[0]), float(ql.a_range[1]), bits)
        qerr = max(qerr, abs(s_ours - float(scale)) / float(scale) + abs(z_ours - int(zp)))
        xs = torch.cat([x.reshape(-1) for x in seen[n]])
        fq = torch.fake_quantize_per_tensor_affine(xs, s_ours, z_ours, 0, 2 ** bits - 1)
        ratio = max(ratio, float((fq - xs).abs().max()) / (s_ours / 2))
    return qerr, ratio


REPRODUCTION = CondiQuantReproduction
run = CondiQuantReproduction.run
