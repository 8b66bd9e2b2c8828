"""CondiQuant's super-resolution (SR) network and data, built once by a fixed recipe and cached
(``rankwise zoo build``; reproductions and benchmarks load them, they never train the FP net themselves).

Data (offline, seeded, data seed 0 for every model seed): ``n_images`` grayscale HR images of
``hr x hr`` pixels in [0, 1]: half synthetic (anti-aliased rectangles / ellipses / lines rendered at 4x and
average-pooled, sinusoidal gratings of random frequency and orientation, smooth Gaussian blobs, additive
texture noise), half scikit-learn digits upsampled bicubically from 8 x 8 plus mild noise; shuffled. LR =
bicubic x2 downsampling with antialiasing. Split: 80 % train, 10 % calibration pool, 10 % test (2400 / 300 /
300 of 3000).

Model (:class:`SRNet`, a small SwinIR-like CNN with channel-MLP blocks): head conv3x3(1 -> C); ``blocks`` x
[depthwise conv3x3(C) -> 1x1 conv C -> 2C (``fc1``) -> GELU -> 1x1 conv 2C -> C (``fc2``), residual]; global
residual; tail conv3x3(C -> 4) + PixelShuffle(2) + bicubic skip of the LR input. L1 loss, Adam, batch 32.

Recipes (:data:`RECIPES`): ``full`` (HR 32, 3 blocks, C = 48, 1500 steps; seeds 0, 1, 2), ``quick`` (HR 16,
2 blocks, 300 steps; seed 0) and ``smoke`` (HR 16, 1 block, C = 16, 30 steps on 200 images; trained in memory
by the tests, never cached). Files: ``cache_dir()/condiquant/<recipe>-s<seed>-<hash>.safetensors`` and
``data-<hash>.safetensors``. Cold build (``build()``): about 70 s per full model on 2 idle cores, 10 s for
quick (several times that on a loaded machine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rankwise.core import io
from rankwise.zoo import cache_dir
from rankwise.zoo.models import BUILD_THREADS, build_threads

__all__ = ["RECIPES", "SRData", "SRNet", "SRRecipe", "bicubic_psnr", "build", "data", "model", "psnr",
           "synthetic_images"]


@dataclasses.dataclass(frozen=True)
class SRRecipe:
    hr: int = 32                 #: HR side (LR = hr / 2)
    n_images: int = 3000
    channels: int = 48
    blocks: int = 3
    steps: int = 1500
    batch: int = 32
    lr: float = 2e-3
    seeds: tuple[int, ...] = (0, 1, 2)  #: the seeds ``build()`` caches
    version: int = 1


RECIPES: dict[str, SRRecipe] = {
    "full": SRRecipe(),
    "quick": SRRecipe(hr=16, blocks=2, steps=300, seeds=(0,)),
    "smoke": SRRecipe(hr=16, n_images=200, channels=16, blocks=1, steps=30, seeds=()),
}


class SRNet(nn.Module):
    """The FP SR network (x2); input ``(B, 1, h, w)`` LR, output ``(B, 1, 2h, 2w)``."""

    def __init__(self, channels: int = 48, blocks: int = 3):
        super().__init__()
        c = channels
        self.head = nn.Conv2d(1, c, 3, padding=1)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "dw": nn.Conv2d(c, c, 3, padding=1, groups=c), "fc1": nn.Conv2d(c, 2 * c, 1),
            "fc2": nn.Conv2d(2 * c, c, 1)}) for _ in range(blocks))
        self.tail = nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, lr: torch.Tensor) -> torch.Tensor:
        up = F.interpolate(lr, scale_factor=2, mode="bicubic", align_corners=False)
        f = self.head(lr)
        h = f
        for b in self.blocks:
            h = h + b["fc2"](F.gelu(b["fc1"](b["dw"](h))))
        return F.pixel_shuffle(self.tail(h + f), 2) + up


# ---------------------------------------------------------------------------------------------- data


def _shapes(rng: np.random.Generator, hr: int) -> np.ndarray:
    """One synthetic HR image (``hr x hr``, float64 in [0, 1])."""
    ss = 4 * hr
    yy, xx = np.mgrid[0:ss, 0:ss] / ss
    img = np.full((ss, ss), rng.uniform(0.1, 0.6))
    for _ in range(rng.integers(2, 5)):
        kind = rng.integers(0, 3)
        v = rng.uniform(0.0, 1.0)
        cx, cy = rng.uniform(0.1, 0.9, size=2)
        if kind == 0:  # rectangle
            w, h = rng.uniform(0.1, 0.5, size=2)
            mask = (abs(xx - cx) < w / 2) & (abs(yy - cy) < h / 2)
        elif kind == 1:  # rotated ellipse
            a, b = rng.uniform(0.05, 0.35, size=2)
            t = rng.uniform(0, math.pi)
            u, w_ = (xx - cx) * math.cos(t) + (yy - cy) * math.sin(t), -(xx - cx) * math.sin(t) + (yy - cy) * math.cos(t)
            mask = (u / a) ** 2 + (w_ / b) ** 2 < 1
        else:  # line of random width
            t = rng.uniform(0, math.pi)
            d = abs((xx - cx) * math.sin(t) - (yy - cy) * math.cos(t))
            mask = d < rng.uniform(0.01, 0.05)
        img[mask] = v
    img = img.reshape(hr, 4, hr, 4).mean(axis=(1, 3))  # 4x supersampling = anti-aliasing
    yy, xx = np.mgrid[0:hr, 0:hr] / hr
    if rng.random() < 0.5:  # sinusoidal grating
        f, t = rng.uniform(1.0, 0.45 * hr), rng.uniform(0, math.pi)
        img = img + rng.uniform(0.05, 0.25) * np.sin(2 * math.pi * f * (xx * math.cos(t) + yy * math.sin(t)) + rng.uniform(0, 6.3))
    for _ in range(rng.integers(0, 3)):  # smooth Gaussian blobs
        cx, cy, s = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.25)
        img = img + rng.uniform(-0.3, 0.3) * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s * s))
    img = img + rng.uniform(0.0, 0.03) * rng.standard_normal((hr, hr))  # texture noise
    return np.clip(img, 0.0, 1.0)


def synthetic_images(n: int, hr: int, seed: int = 0) -> torch.Tensor:
    """``n`` synthetic HR images ``(n, 1, hr, hr)`` (float32)."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([_shapes(rng, hr) for _ in range(n)]).astype(np.float32)).unsqueeze(1)


def _digits(n: int, hr: int, seed: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(seed + 1)
    d = load_digits().images.astype(np.float32) / 16.0
    idx = rng.choice(len(d), size=n, replace=n > len(d))
    x = torch.from_numpy(d[idx]).unsqueeze(1)
    x = F.interpolate(x, size=(hr, hr), mode="bicubic", align_corners=False)
    noise = torch.from_numpy(rng.standard_normal(x.shape).astype(np.float32)) * 0.01
    return (x + noise).clamp(0.0, 1.0)


def downsample(hr: torch.Tensor) -> torch.Tensor:
    """Bicubic x2 downsampling with antialiasing (the LR inputs)."""
    return F.interpolate(hr, scale_factor=0.5, mode="bicubic", align_corners=False, antialias=True)


@dataclasses.dataclass
class SRData:
    """HR/LR tensors ``(N, 1, s, s)`` of the three splits."""

    hr_train: torch.Tensor
    hr_calib: torch.Tensor
    hr_test: torch.Tensor

    @property
    def lr_train(self) -> torch.Tensor:
        return downsample(self.hr_train)

    @property
    def lr_calib(self) -> torch.Tensor:
        return downsample(self.hr_calib)

    @property
    def lr_test(self) -> torch.Tensor:
        return downsample(self.hr_test)


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _data_key(r: SRRecipe) -> dict[str, Any]:
    return {"hr": r.hr, "n": r.n_images, "version": r.version}


def data(recipe: str | SRRecipe = "full", *, cache: bool = True) -> SRData:
    """The recipe's data set (cached under ``cache_dir()/condiquant`` when ``cache``)."""
    r = RECIPES[recipe] if isinstance(recipe, str) else recipe
    path = cache_dir() / "condiquant" / f"data-{_digest(_data_key(r))}.safetensors"
    if cache and path.is_file():
        hr = io.load_tensors(path)[0]["hr"]
    else:
        n_syn = r.n_images // 2
        hr = torch.cat([synthetic_images(n_syn, r.hr, 0), _digits(r.n_images - n_syn, r.hr, 0)])
        hr = hr[torch.randperm(len(hr), generator=torch.Generator().manual_seed(0))].contiguous()
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            io.save_tensors(path, {"hr": hr}, {"recipe": _data_key(r)})
    n_tr, n_ca = int(0.8 * len(hr)), int(0.1 * len(hr))
    return SRData(hr[:n_tr], hr[n_tr:n_tr + n_ca], hr[n_tr + n_ca:])


def psnr(sr: torch.Tensor, hr: torch.Tensor, border: int = 2) -> torch.Tensor:
    """Per-image PSNR (dB) of ``sr`` (clamped to [0, 1]) against ``hr``, ``border`` pixels cropped."""
    b = border
    d = (sr.clamp(0, 1) - hr)[..., b:hr.shape[-2] - b, b:hr.shape[-1] - b]
    mse = d.double().pow(2).flatten(1).mean(1).clamp_min(1e-12)
    return -10.0 * torch.log10(mse)


def bicubic_psnr(d: SRData) -> torch.Tensor:
    """Per-image PSNR of plain bicubic upsampling on the test split (the lower bound)."""
    return psnr(F.interpolate(d.lr_test, scale_factor=2, mode="bicubic", align_corners=False), d.hr_test)


# --------------------------------------------------------------------------------------------- models


def _path(name: str, r: SRRecipe, seed: int) -> Path:
    key = {"recipe": dataclasses.asdict(r), "seed": seed, "torch": ".".join(torch.__version__.split(".")[:2]),
           "build_threads": BUILD_THREADS}
    return cache_dir() / "condiquant" / f"{name}-s{seed}-{_digest(key)}.safetensors"


def _train(r: SRRecipe, d: SRData, seed: int) -> SRNet:
    torch.manual_seed(seed)
    m = SRNet(r.channels, r.blocks)
    opt = torch.optim.Adam(m.parameters(), lr=r.lr)
    lr_tr, hr_tr = d.lr_train, d.hr_train
    g = torch.Generator().manual_seed(1000 + seed)
    m.train()
    for _ in range(r.steps):
        idx = torch.randint(0, len(hr_tr), (r.batch,), generator=g)
        loss = (m(lr_tr[idx]) - hr_tr[idx]).abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return m.eval()


def model(recipe: str = "full", seed: int = 0, *, cache: bool = True, rebuild: bool = False) -> SRNet:
    """The trained FP :class:`SRNet` of ``recipe`` and ``seed`` (eval mode): from the cache, else trained
    (and cached when ``cache``; the ``smoke`` recipe is never cached)."""
    if recipe not in RECIPES:
        raise ValueError(f"CondiQuant SR recipe {recipe!r} is unknown; choose from {list(RECIPES)}")
    r = RECIPES[recipe]
    cache = cache and recipe != "smoke"
    path = _path(recipe, r, seed)
    if cache and path.is_file() and not rebuild:
        m = SRNet(r.channels, r.blocks)
        m.load_state_dict(io.load_tensors(path)[0])
        return m.eval()
    t0 = time.perf_counter()
    d = data(r, cache=cache)
    with build_threads():
        m = _train(r, d, seed)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.save_tensors(path, {k: v.detach().clone() for k, v in m.state_dict().items()},
                        {"recipe": dataclasses.asdict(r), "seed": seed, "train_s": round(time.perf_counter() - t0, 1)})
    return m


def build(force: bool = False) -> dict[str, Any]:
    """Train (or check) every cached model of the ``quick`` and ``full`` recipes; ``rankwise zoo build``."""
    out: dict[str, Any] = {}
    for name in ("quick", "full"):
        for seed in RECIPES[name].seeds:
            t0 = time.perf_counter()
            model(name, seed, rebuild=force)
            out[f"{name}/s{seed}"] = round(time.perf_counter() - t0, 1)
    return out
