"""DiffBCP's diffusion prior, trained once by a fixed recipe and cached (``rankwise zoo build``).

A diffusers ``UNet2DModel`` (ResNet blocks, channels 16/32/32, about 0.27M parameters) with a
1000-step linear-beta ``DDPMScheduler`` (epsilon prediction), trained on the 1,500 training digits of
``zoo.digits_images(16)`` (scikit-learn's 8 x 8 digits upsampled bilinearly to 16 x 16, scaled to
[-1, 1]); the 297 test digits are never seen. File: ``cache_dir()/diffbcp/digits16-s<seed>-<hash>.safetensors``;
the hash covers the recipe and the torch/diffusers major.minor versions. Cold build time: see
docs/methods/diffbcp.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import torch

from rankwise.science.diffbcp.prior import TinyVPDiffusion
from rankwise.zoo import cache_dir
from rankwise.zoo.images import digits_images
from rankwise.zoo.models import BUILD_THREADS, build_threads

__all__ = ["RECIPE", "build", "digits", "prior"]

logger = logging.getLogger(__name__)

RECIPE: dict[str, Any] = {"image_size": 16, "channels": [16, 32, 32], "steps": 1500, "batch": 32, "lr": 2e-3,
                          "grid_steps": 50, "version": 1}
SMOKE_RECIPE: dict[str, Any] = dict(RECIPE, channels=[8, 8], steps=5, batch=4, grid_steps=10)


def digits(split: str = "test") -> torch.Tensor:
    """The digits of ``split`` ("train": 1,500, "test": 297) as [N, 1, 16, 16] float32 in [-1, 1]."""
    train, test = digits_images(16, n_test=297, seed=0)
    return (train if split == "train" else test) * 2.0 - 1.0


def _path(seed: int, recipe: dict[str, Any]):
    import diffusers

    versions = {"torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
                "diffusers": ".".join(diffusers.__version__.split(".")[:2]), "build_threads": BUILD_THREADS}
    blob = json.dumps({"seed": seed, "recipe": recipe, "versions": versions}, sort_keys=True)
    return cache_dir() / "diffbcp" / f"digits16-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}.safetensors"


def prior(seed: int = 0, *, recipe: dict[str, Any] | None = None, rebuild: bool = False,
          cache: bool = True) -> TinyVPDiffusion:
    """The trained digits prior (trained on first use and cached; ``cache=False``: in memory only, for
    smoke runs with a small ``recipe``)."""
    R = dict(recipe or RECIPE)
    path = _path(seed, R)
    if cache and path.is_file() and not rebuild:
        return TinyVPDiffusion.load(path)
    t0 = time.perf_counter()
    with torch.random.fork_rng(), build_threads():
        m = TinyVPDiffusion.train(digits("train"), steps=R["steps"], batch_size=R["batch"], lr=R["lr"], seed=seed,
                                  block_out_channels=tuple(R["channels"]), grid_steps=R["grid_steps"])
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        m.save(path, {"seed": seed, "recipe": R, "train_wall_s": time.perf_counter() - t0})
        logger.info("trained the DiffBCP digits prior (seed %d) in %.1f s", seed, time.perf_counter() - t0)
    return m


def build(force: bool = False) -> dict[str, Any]:
    """Build (or check) the cached prior; what ``rankwise zoo build`` calls for DiffBCP."""
    t0 = time.perf_counter()
    m = prior(0, rebuild=force)
    tr = m.train_result
    return {"digits16/s0": {"s": round(time.perf_counter() - t0, 1),
                            "train_cpu_s": round(tr.cpu_s, 1) if tr else None,
                            "final_loss": round(tr.final_loss, 4) if tr else None}}
