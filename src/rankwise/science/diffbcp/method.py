"""DiffBCP's split Gibbs sampler (spec "Outer loop"): a CP block (one CUSP Gibbs sweep that sees the
observations and the diffusion-side copy ``x`` at coupling ``rho``) alternating with a diffusion block
(low-rank-guided denoising of the CP reconstruction at noise level ``rho``); plus the PnP-DM path
(the same loop with a closed-form pixel likelihood step instead of the CP block).

Images are ``[C, H, W]`` (or ``[H, W]``) scaled to [-1, 1]; masks have the same shape, 1 = observed.
Several images run together through :meth:`DiffBCP.fit_many` so that the diffusion block batches its
UNet calls; each image keeps its own random stream (``numpy.random.default_rng([seed, i])``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_choice, check_int, check_number
from rankwise.science.diffbcp.bcp import check_observations, collect_indices
from rankwise.science.diffbcp.cusp import CUSPConfig, active_rank, contribution_rank, cp_full, init_state, sweep
from rankwise.science.diffbcp.prior import DiffusionPrior
from rankwise.science.diffbcp.tensorize import PatchMap

__all__ = ["DiffBCP", "DiffBCPConfig", "DiffBCPResult", "complete", "pnp_dm", "psnr", "rho_annealed",
           "rho_noise_adaptive"]

SCHEDULES = ("noise_adaptive", "annealed", "none")


@dataclass(frozen=True)
class DiffBCPConfig:
    """DiffBCP settings (defaults: the spec's small-scale reproduction; official values in comments).

    ``schedule``: ``"noise_adaptive"`` (``rho_k = clip(sqrt(c / tau_k), rho_min, rho_max)``, ``rho_0 =
    clip(c, ...)``), ``"annealed"`` (the hand-tuned ablation ``rho_k = max(rho0 gamma^k, rho_min)``) or
    ``"none"`` (no coupling, no diffusion: BCP-CUSP on the patch tensor). ``grid_steps``: the diffusion
    block's reverse time grid (``None``: the prior's own)."""

    init_rank: int = 32  # official: 200 on 256^2 patches
    patch: int = 4  # official: 16 (stride 8) on 256^2 images
    stride: int = 2
    iters: int = 60  # official K = 100
    burn_in: int = 24  # official 40
    n_samples: int = 12  # official 20
    rho_const: float = 100.0
    rho_min: float = 0.3
    rho_max: float = 10.0
    schedule: str = "noise_adaptive"
    rho0: float = 10.0
    gamma: float = 0.9
    grid_steps: int | None = 50
    alpha: float = 2.0
    theta_inf: float = 1e-3
    max_rank: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        n = "DiffBCPConfig"
        check_int(f"{n}.init_rank", self.init_rank, 1)
        check_int(f"{n}.patch", self.patch, 1)
        check_int(f"{n}.stride", self.stride, 1)
        check_int(f"{n}.iters", self.iters, 1)
        check_int(f"{n}.burn_in", self.burn_in, 0, self.iters - 1)
        check_int(f"{n}.n_samples", self.n_samples, 1)
        check_number(f"{n}.rho_const", self.rho_const, 0.0, low_open=True)
        check_number(f"{n}.rho_min", self.rho_min, 0.0, low_open=True)
        check_number(f"{n}.rho_max", self.rho_max, 0.0, low_open=True)
        if self.rho_min > self.rho_max:
            raise ValueError(f"{n}.rho_min must be <= rho_max = {self.rho_max}, got {self.rho_min}")
        check_choice(f"{n}.schedule", self.schedule, SCHEDULES)
        check_number(f"{n}.rho0", self.rho0, 0.0, low_open=True)
        check_number(f"{n}.gamma", self.gamma, 0.0, 1.0, low_open=True)
        check_int(f"{n}.grid_steps", self.grid_steps, 1, allow_none=True)
        self.cusp()  # validates alpha, theta_inf, max_rank, adaptive

    def cusp(self) -> CUSPConfig:
        return CUSPConfig(init_rank=self.init_rank, alpha=self.alpha, theta_inf=self.theta_inf,
                          max_rank=self.max_rank, adaptive=self.adaptive)


def rho_noise_adaptive(k: int, tau: float, c: float, rho_min: float, rho_max: float) -> float:
    """``rho_0 = clip(c, rho_min, rho_max)``; ``rho_k = clip(sqrt(c / tau_k), rho_min, rho_max)`` for k >= 1."""
    r = c if k == 0 else math.sqrt(c / tau)
    return min(max(r, rho_min), rho_max)


def rho_annealed(k: int, rho0: float, gamma: float, rho_min: float) -> float:
    """The hand-annealed ablation ``rho_k = max(rho0 gamma^k, rho_min)``."""
    return max(rho0 * gamma**k, rho_min)


def psnr(estimate: Tensor, truth: Tensor, data_range: float = 2.0) -> float:
    """PSNR in dB for images in [-1, 1] (``data_range`` 2; the same number as on [0, 1] images)."""
    mse = float(((estimate.double() - truth.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


@dataclass
class DiffBCPResult:
    """One image's result.

    ``mean``/``std``: posterior mean and per-pixel std of the diffusion-side samples ``x`` (of the CP
    reconstructions ``z`` when there is no diffusion); ``z_mean``/``z_std``: of the CP reconstructions;
    ``last``: the last sample. Traces per outer iteration: ``rho_trace``, ``tau_trace`` (the noise
    precision sample; ``noise_std = tau^-1/2``), ``rank_trace`` (contribution rank), ``rank_z_trace``
    (CUSP active count), ``size_trace`` (truncation R), ``steps_trace`` (reverse diffusion steps run).
    Shapes follow the input (``[H, W]`` in, ``[H, W]`` out)."""

    mean: Tensor
    std: Tensor
    z_mean: Tensor
    z_std: Tensor
    last: Tensor
    method: str
    rho_trace: list[float] = field(default_factory=list)
    tau_trace: list[float] = field(default_factory=list)
    rank_trace: list[int] = field(default_factory=list)
    rank_z_trace: list[int] = field(default_factory=list)
    size_trace: list[int] = field(default_factory=list)
    steps_trace: list[int] = field(default_factory=list)
    cpu_s: float = 0.0

    @property
    def noise_std(self) -> float:
        return self.tau_trace[-1] ** -0.5 if self.tau_trace else float("nan")

    def psnr(self, truth: Tensor, which: str = "mean") -> float:
        """PSNR of ``mean`` (or ``last``/``z_mean``) against ``truth`` (same shape, [-1, 1])."""
        return psnr(getattr(self, which), truth.reshape(self.mean.shape))


class _Run:
    """Per-image state of one split-Gibbs run."""

    def __init__(self, image: Tensor, mask: Tensor, cfg: DiffBCPConfig, rng: np.random.Generator, cp: bool) -> None:
        self.shape2d = image.dim() == 2
        Y, M = check_observations(image, mask, "image")
        if Y.dim() == 2:
            Y, M = Y.unsqueeze(0), M.unsqueeze(0)
        if Y.dim() != 3:
            raise ValueError(f"DiffBCP: an image must be [C, H, W] or [H, W], got shape {list(image.shape)}")
        self.Y, self.M, self.rng = Y, M, rng
        self.x = torch.zeros_like(Y)
        if cp:
            self.pm = PatchMap(Y.shape[0], Y.shape[1], Y.shape[2], cfg.patch, cfg.stride)
            self.Yt, self.Mt = self.pm.to_tensor(Y), self.pm.to_tensor(M)
            self.st = init_state(self.pm.tensor_shape, cfg.cusp(), rng)
        self.sums = {k: torch.zeros_like(Y) for k in ("x1", "x2", "z1", "z2")}
        self.n = 0
        self.res = DiffBCPResult(Y, Y, Y, Y, Y, "")

    def out(self, t: Tensor) -> Tensor:
        return t[0] if self.shape2d else t


class DiffBCP:
    """The DiffBCP sampler (``schedule="none"``: BCP-CUSP on the patch tensor, no prior needed)."""

    def __init__(self, config: DiffBCPConfig | None = None) -> None:
        self.config = config or DiffBCPConfig()

    def fit(self, image: Tensor, mask: Tensor, prior: DiffusionPrior | None = None, seed: int = 0) -> DiffBCPResult:
        """Complete one image ``[C, H, W]`` / ``[H, W]`` in [-1, 1] observed where ``mask`` is 1."""
        return self.fit_many([image], [mask], prior, seed)[0]

    def fit_many(self, images: Sequence[Tensor], masks: Sequence[Tensor], prior: DiffusionPrior | None = None,
                 seed: int = 0) -> list[DiffBCPResult]:
        """Complete several images at once (their diffusion blocks share UNet calls)."""
        return _loop(self.config, images, masks, prior, seed, "cp", None)


def complete(image: Tensor, mask: Tensor, config: DiffBCPConfig | None = None, prior: DiffusionPrior | None = None,
             seed: int = 0) -> DiffBCPResult:
    """Functional entry point: ``DiffBCP(config).fit(image, mask, prior, seed)``."""
    return DiffBCP(config).fit(image, mask, prior, seed)


def pnp_dm(images: Sequence[Tensor], masks: Sequence[Tensor], prior: DiffusionPrior, sigma: float,
           config: DiffBCPConfig | None = None, seed: int = 0) -> list[DiffBCPResult]:
    """Diffusion-only posterior sampling (PnP-DM path): the same outer loop and ``rho`` schedule (with the
    known noise precision ``1 / sigma^2`` as ``tau``), but the likelihood step draws the observed pixels
    from ``N((y / sigma^2 + x / rho^2) / (1 / sigma^2 + 1 / rho^2), 1 / (1 / sigma^2 + 1 / rho^2))`` and copies
    the unobserved pixels from ``x``."""
    check_number("pnp_dm.sigma", sigma, 0.0, low_open=True)
    return _loop(config or DiffBCPConfig(), images, masks, prior, seed, "pixel", sigma)


def _loop(cfg: DiffBCPConfig, images: Sequence[Tensor], masks: Sequence[Tensor], prior: DiffusionPrior | None,
          seed: int, block: str, sigma: float | None) -> list[DiffBCPResult]:
    if len(images) != len(masks) or not len(images):
        raise ValueError(f"DiffBCP: need as many masks as images (at least one), got {len(images)} and {len(masks)}")
    check_int("DiffBCP.seed", seed, 0)
    coupled = cfg.schedule != "none"
    if block == "pixel" and not coupled:
        raise ValueError("pnp_dm needs a coupling schedule (noise_adaptive or annealed), got schedule='none'")
    runs = [_Run(im, m, cfg, np.random.default_rng([seed, i]), block == "cp") for i, (im, m) in enumerate(zip(images, masks))]
    if coupled:
        if prior is None:
            raise ValueError(f"DiffBCP: schedule={cfg.schedule!r} needs a diffusion prior (or use schedule='none')")
        want = tuple(prior.image_shape)
        for r in runs:
            if tuple(r.Y.shape) != want:
                raise ValueError(f"DiffBCP: the prior's image size {list(want)} differs from the image's {list(r.Y.shape)}")
        if cfg.grid_steps is not None and hasattr(prior, "set_grid") and getattr(prior, "grid_steps", None) != cfg.grid_steps:
            prior.set_grid(cfg.grid_steps)
    gen = torch.Generator().manual_seed(seed)
    keep = set(collect_indices(cfg.iters, cfg.burn_in, cfg.n_samples))
    ccfg = cfg.cusp()
    c0 = time.process_time()
    for k in range(cfg.iters):
        rhos, zs = [], []
        for r in runs:
            tau = (1.0 / sigma**2) if block == "pixel" else r.st.tau
            if cfg.schedule == "noise_adaptive":
                rho = rho_noise_adaptive(k, tau, cfg.rho_const, cfg.rho_min, cfg.rho_max)
            elif cfg.schedule == "annealed":
                rho = rho_annealed(k, cfg.rho0, cfg.gamma, cfg.rho_min)
            else:
                rho = math.inf
            if block == "cp":
                xt = r.pm.to_tensor(r.x) if coupled else None
                sweep(r.st, r.Yt, r.Mt, ccfg, r.rng, xt, 0.0 if not coupled else 1.0 / rho**2)
                z = r.pm.to_image(cp_full(r.st.factors, r.st.lam))
                r.res.tau_trace.append(r.st.tau)
                r.res.rank_trace.append(contribution_rank(r.st.factors, r.st.lam, ccfg.contribution_tol))
                r.res.rank_z_trace.append(active_rank(r.st.z))
                r.res.size_trace.append(r.st.rank)
            else:
                prec = 1.0 / sigma**2 + 1.0 / rho**2
                draw = (r.Y / sigma**2 + r.x / rho**2) / prec + torch.from_numpy(r.rng.standard_normal(tuple(r.Y.shape))) / math.sqrt(prec)
                z = torch.where(r.M.bool(), draw, r.x)
                r.res.tau_trace.append(1.0 / sigma**2)
            r.res.rho_trace.append(rho if coupled else float("nan"))
            rhos.append(rho)
            zs.append(z)
        if coupled:
            x, steps = prior.denoise(torch.stack(zs).float(), torch.tensor(rhos, dtype=torch.float64), gen)
            for i, r in enumerate(runs):
                r.x = x[i].double()
                r.res.steps_trace.append(int(steps[i]))
        else:
            for i, r in enumerate(runs):
                r.x = zs[i]
        if not all(torch.isfinite(r.x).all() for r in runs):
            raise FloatingPointError(f"DiffBCP: non-finite reconstruction at iteration {k}")
        if k in keep:
            for i, r in enumerate(runs):
                r.sums["x1"] += r.x
                r.sums["x2"] += r.x**2
                r.sums["z1"] += zs[i]
                r.sums["z2"] += zs[i] ** 2
                r.n += 1
    cpu = (time.process_time() - c0) / len(runs)
    out = []
    name = ("diffbcp" if coupled else "bcp_cusp") if block == "cp" else "pnp_dm"
    for i, r in enumerate(runs):
        mx, mz = r.sums["x1"] / r.n, r.sums["z1"] / r.n
        sx = (r.sums["x2"] / r.n - mx**2).clamp_min(0).sqrt()
        sz = (r.sums["z2"] / r.n - mz**2).clamp_min(0).sqrt()
        res = r.res
        res.mean, res.std, res.z_mean, res.z_std, res.last = (r.out(mx), r.out(sx), r.out(mz), r.out(sz), r.out(r.x))
        res.method, res.cpu_s = name, cpu
        out.append(res)
    return out


