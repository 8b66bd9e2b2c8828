"""ULD-Net's trained digits models, built once by a fixed recipe and cached (``rankwise zoo build``).

Per seed (0, 1, 2): the MLP 64 -> 64 -> 64 -> 10 (``Linear -> norm -> act`` per hidden layer) as
(A) ReLU + per-sample LayerNorm, (B) ULD-Net (PolyAct degree 2 + PolyNorm k = 4, mu = 2, per-sample),
(D) B with batch statistics; and the one-hidden-block 64 -> 64 -> 10 of A and B (depth rows; the
encrypted rows use seed 0's).
AdamW lr 3e-3, batch 64, 40 epochs; PolyNorm arms: exact normalisation for 8 epochs, then a hard switch
with L1/L2 (1e-3, 1e-2). Data: ``zoo.digits_task("digits10", seed)`` (balanced, stratified 80/20).
Files: ``cache_dir()/uldnet/<arm>-<sizes>-s<seed>-<hash>.safetensors`` (state dict + recipe). Cold build:
about 6 s per model on one idle core (15 models).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import torch

from rankwise.core import io
from rankwise.science import uldnet
from rankwise.zoo import cache_dir
from rankwise.zoo.images import digits_task
from rankwise.zoo.models import BUILD_THREADS, build_threads

__all__ = ["ARMS", "RECIPE", "build", "config", "data", "model"]

RECIPE: dict[str, Any] = {"epochs": 40, "lr": 3e-3, "batch": 64, "warmup_frac": 0.2, "blend_frac": 0.0,
                          "lam1": 1e-3, "lam2": 1e-2, "version": 1}
ARMS = ("A", "B", "D")
DEEP, SHALLOW = (64, 64, 64, 10), (64, 64, 10)
BUILD_SEEDS = (0, 1, 2)


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train [N, 64], y_train, x_test, y_test)`` of digits10 for ``seed``."""
    t = digits_task("digits10", seed=seed)
    return t.x_train.flatten(1), t.y_train, t.x_test.flatten(1), t.y_test


def config(arm: str, recipe: dict[str, Any] | None = None) -> uldnet.ULDConfig:
    R = recipe or RECIPE
    return uldnet.ULDConfig(axis="batch" if arm == "D" else "per_sample", warmup_frac=R["warmup_frac"],
                            blend_frac=R["blend_frac"], lam1=R["lam1"], lam2=R["lam2"])


def _arch(arm: str, sizes: tuple[int, ...], seed: int, recipe: dict[str, Any]) -> torch.nn.Sequential:
    m = uldnet.mlp(sizes, seed=seed)
    if arm != "A":
        uldnet.convert(m, config(arm, recipe))
    return m


def _path(arm: str, sizes: tuple[int, ...], seed: int, recipe: dict[str, Any]):
    blob = json.dumps({"arm": arm, "sizes": sizes, "seed": seed, "recipe": recipe,
                       "torch": ".".join(torch.__version__.split(".")[:2]), "build_threads": BUILD_THREADS},
                      sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return cache_dir() / "uldnet" / f"{arm}-{'x'.join(map(str, sizes))}-s{seed}-{digest}.safetensors"


def model(arm: str, seed: int = 0, sizes: tuple[int, ...] = DEEP, *, recipe: dict[str, Any] | None = None,
          cache: bool = True, rebuild: bool = False) -> torch.nn.Sequential:
    """The trained ``arm`` model (eval mode): loaded from the cache, else trained (and cached)."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}; choose from {list(ARMS)}")
    R = dict(recipe or RECIPE)
    m = _arch(arm, tuple(sizes), seed, R)
    path = _path(arm, tuple(sizes), seed, R)
    if cache and path.is_file() and not rebuild:
        state, _ = io.load_tensors(path)
        m.load_state_dict(state)
        return m.eval()
    xtr, ytr, _, _ = data(seed)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(xtr), generator=gen)
    loader = [(xtr[perm[i:i + R["batch"]]], ytr[perm[i:i + R["batch"]]]) for i in range(0, len(xtr), R["batch"])]
    torch.manual_seed(seed)
    with build_threads():
        uldnet.train(m, loader, epochs=R["epochs"], config=config(arm, R), lr=R["lr"])
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.save_tensors(path, {k: v.detach().clone() for k, v in m.state_dict().items()},
                        {"arm": arm, "seed": seed, "sizes": list(sizes), "recipe": R})
    return m.eval()


def build(force: bool = False, seeds: tuple[int, ...] = BUILD_SEEDS) -> dict[str, Any]:
    """Train (or check) every cached model; what ``rankwise zoo build`` calls for ULD-Net."""
    out: dict[str, Any] = {}
    for seed in seeds:
        for arm in ARMS:
            t0 = time.perf_counter()
            model(arm, seed, DEEP, rebuild=force)
            out[f"{arm}/s{seed}"] = round(time.perf_counter() - t0, 1)
        for arm in ("A", "B"):  # the depth rows of every seed; the encrypted rows use seed 0's
            t0 = time.perf_counter()
            model(arm, seed, SHALLOW, rebuild=force)
            out[f"{arm}-shallow/s{seed}"] = round(time.perf_counter() - t0, 1)
    return out
