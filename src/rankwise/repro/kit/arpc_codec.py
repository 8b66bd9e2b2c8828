"""ARPC codecs trained on the zoo's 16 x 16 digits by a fixed recipe, built once and cached.

The ARPC reproduction and ``rankwise codec`` (without ``--model``) use these; they are built by
``rankwise zoo build`` (or on first use) and never inside a reproduction's timed budget.

Recipe (:data:`RECIPES`): :func:`rankwise.zoo.digits_images` (1,797 digits upsampled x2 to 16 x 16,
scaled to [-1, 1]; 1,500 train / 297 test, split seed 0), an :class:`~rankwise.science.arpc.ARPCConfig`
(scales 1, 2, 4, 8, 16; per-scale 16-entry k-means codebooks; AR transformer 2 layers, width 32,
4 heads) fitted on the training images by ``ARPCCodec.fit`` (Adam, warm-up + cosine, the recipe's
steps and batch, parameters and batches seeded by the model seed). One codec per model seed.

Each codec is cached as ``cache_dir()/arpc/<size>-s<seed>-<hash>/codec.safetensors`` (plus
``info.json`` with the recipe and the build time); the hash covers the recipe, the seed and torch's
major.minor version. A build writes into a temporary folder renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from rankwise.core.io import atomic_dir, read_json, write_json
from rankwise.zoo import cache_dir, digits_images
from rankwise.zoo.models import build_threads

__all__ = ["ARPCRecipe", "RECIPES", "build", "codec_path", "digits", "zoo_codec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ARPCRecipe:
    """Everything that determines a cached codec (its hash keys the cache)."""

    config: dict[str, Any] = field(default_factory=dict)  # ARPCConfig fields that differ from the defaults
    steps: int = 800
    batch_size: int = 16
    lr: float = 3e-3
    n_train: int | None = None  # None: all 1,500 training digits
    seeds: tuple[int, ...] = (0, 1, 2)  # the seeds `rankwise zoo build` builds
    threads: int = 2  # torch threads while training (build times in the docs use 2)
    version: int = 1


RECIPES: dict[str, ARPCRecipe] = {
    # seconds; for tests and smoke runs: checks the wiring, not the quality
    "smoke": ARPCRecipe(config={"ar_width": 16, "ar_heads": 2, "ar_layers": 1}, steps=15, batch_size=8,
                        n_train=200, seeds=(0,)),
    # the reproduction's models (cold build: see docs/methods/arpc.md)
    "small": ARPCRecipe(config={"ar_width": 32}, steps=400),
}


def _recipe(size: str) -> ARPCRecipe:
    if size not in RECIPES:
        raise ValueError(f"size={size!r} is not an ARPC recipe; choose one of {list(RECIPES)}")
    return RECIPES[size]


def digits(n_train: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, test)`` digits ``(N, 1, 16, 16)`` in [-1, 1]: 1,500 / 297, split seed 0."""
    train, test = digits_images(image_size=16, n_test=297, seed=0)
    train = train * 2 - 1
    if n_train is not None:
        train = train[:n_train]
    return train, test * 2 - 1


def codec_path(size: str = "small", seed: int = 0) -> Path:
    """The cache folder of the codec ``size`` / ``seed`` (it may not exist yet)."""
    r = _recipe(size)
    key = {"recipe": asdict(r), "size": size, "seed": seed, "torch": ".".join(torch.__version__.split(".")[:2])}
    key["recipe"].pop("seeds")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "arpc" / f"{size}-s{seed}-{digest}"


def _build_one(size: str, seed: int) -> Path:
    from rankwise.science.arpc import ARPCCodec, ARPCConfig

    r = _recipe(size)
    path = codec_path(size, seed)
    train, _ = digits(r.n_train)
    with build_threads(r.threads):
        t0 = time.perf_counter()
        codec = ARPCCodec(ARPCConfig(**r.config))
        fit = codec.fit(train, steps=r.steps, batch_size=r.batch_size, lr=r.lr, seed=seed)
        seconds = time.perf_counter() - t0
    with atomic_dir(path, overwrite=True) as tmp:
        codec.save(tmp / "codec.safetensors")
        write_json(tmp / "info.json", {"size": size, "seed": seed, "recipe": asdict(r), "build_seconds": seconds,
                                       "torch": torch.__version__, "final_loss": fit.losses[-1],
                                       "train_bits": fit.train_bits, "quantizer_mse": fit.quantizer_mse})
    log.info("built ARPC codec %s seed %d in %.0f s", size, seed, seconds)
    return path


def zoo_codec(size: str = "small", seed: int = 0, build_missing: bool = True) -> Any:
    """The cached :class:`~rankwise.science.arpc.ARPCCodec` of ``size`` / ``seed`` (built if missing and
    ``build_missing``; otherwise a missing codec raises ``FileNotFoundError`` naming the command)."""
    from rankwise.science.arpc import ARPCCodec

    path = codec_path(size, seed)
    if not (path / "codec.safetensors").is_file():
        if not build_missing:
            raise FileNotFoundError(f"the ARPC codec {size}/seed {seed} is not built; run `rankwise zoo build`")
        _build_one(size, seed)
    return ARPCCodec.load(path / "codec.safetensors")


def info(size: str = "small", seed: int = 0) -> dict[str, Any] | None:
    """The ``info.json`` of a built codec (None if not built)."""
    p = codec_path(size, seed) / "info.json"
    return read_json(p) if p.is_file() else None


def build(force: bool = False, size: str = "small", seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Build (or check) the codecs of ``size`` for ``seeds`` (default: the recipe's); what ``rankwise zoo
    build`` calls. Returns ``{seed: {"path", "built_now", "build_seconds"}}``."""
    r = _recipe(size)
    out: dict[str, Any] = {}
    for seed in seeds if seeds is not None else r.seeds:
        path = codec_path(size, seed)
        now = force or not (path / "codec.safetensors").is_file()
        if now:
            _build_one(size, seed)
        meta = info(size, seed) or {}
        out[seed] = {"path": str(path), "built_now": now, "build_seconds": meta.get("build_seconds")}
    return out


if __name__ == "__main__":  # pragma: no cover - python -m rankwise.repro.kit.arpc_codec [size] [seed...]
    import sys

    logging.basicConfig(level=logging.INFO)
    size = sys.argv[1] if len(sys.argv) > 1 else "small"
    seeds = [int(s) for s in sys.argv[2:]] or None
    print(build(size=size, seeds=seeds))
