"""A tiny ViT pretrained locally on the digits 0-4, built once and cached (the backbone of the VAPT
reproduction and of image ``rankwise finetune``).

Recipe (:data:`VIT_RECIPES`, deterministic):

1. Model: :func:`rankwise.zoo.tiny_vit` at ``image_size`` 16 (patch 4, a 4 x 4 grid, hidden 64, 4 layers,
   4 heads, MLP 128, one grey channel), initialised under the recipe seed, with a 5-class head.
2. Data: the training split of the zoo task ``digits0to4`` (:func:`rankwise.zoo.digits_task`, split seed
   ``seed``) at 16 x 16; every step draws a batch with replacement and shifts each image by a random
   whole number of pixels in ``[-max_shift, max_shift]`` on each axis (zero fill), from a
   ``torch.Generator`` seeded with the recipe seed: the "augmented copies" of the VAPT spec.
3. Optimiser: Adam (``lr``, no weight decay), a fixed number of steps, cross-entropy.
4. Evaluation: accuracy on the task's test split (never trained on), recorded in the record.

The artefact is a ``save_pretrained`` folder (safetensors) cached under
``cache_dir()/tiny_vit/<size>-<hash>`` (the hash covers the recipe and the torch / transformers /
scikit-learn versions' major.minor), written atomically (:func:`rankwise.core.io.atomic_dir`), so an
interrupted build leaves no half model. ``rankwise zoo build`` builds it next to the tiny LM. Same
machine and thread count: bit-identical weights; the cached artefact, not a rebuild, is the reference.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rankwise.core import io
from rankwise.core.errors import ArtifactError, NumericalError
from rankwise.zoo.images import digits_task
from rankwise.zoo.models import BUILD_THREADS, build_threads, quiet_transformers, seeded, tiny_vit
from rankwise.zoo.tinylm import _major_minor, _progress, cache_dir

__all__ = ["VIT_RECIPES", "TinyViTRecipe", "build_tiny_vit", "pretrained_vit", "tiny_vit_info", "tiny_vit_path"]

logger = logging.getLogger(__name__)

_RECORD = "rankwise_tiny_vit.json"
_REQUIRED = ("config.json", "model.safetensors", _RECORD)


@dataclass(frozen=True)
class TinyViTRecipe:
    """Everything that determines a pretrained tiny ViT (the cache key hashes all of it)."""

    image_size: int = 16
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 128
    source_task: str = "digits0to4"
    steps: int = 1500
    batch_size: int = 64
    lr: float = 1e-3
    max_shift: int = 2  # pixels at 16 x 16 (one pixel of the 8 x 8 original)
    seed: int = 0
    version: int = 1  # bump when the build code changes what a recipe produces


VIT_RECIPES: dict[str, TinyViTRecipe] = {
    "smoke": TinyViTRecipe(steps=20),  # seconds; for tests: checks the wiring, not the quality
    "small": TinyViTRecipe(),          # the reproduction's backbone; about 100 s of CPU time on one core
}


def _recipe(size: str) -> TinyViTRecipe:
    if size not in VIT_RECIPES:
        raise ValueError(f"size={size!r} is not a tiny_vit size; choose one of {list(VIT_RECIPES)}")
    return VIT_RECIPES[size]


def _key(size: str) -> dict[str, Any]:
    import sklearn
    import transformers

    return {"size": size, "recipe": asdict(_recipe(size)), "torch": _major_minor(torch.__version__),
            "transformers": _major_minor(transformers.__version__), "sklearn": _major_minor(sklearn.__version__),
            "build_threads": BUILD_THREADS}


def tiny_vit_path(size: str = "small") -> Path:
    """The cache folder of the pretrained tiny ViT ``size`` (it may not exist yet)."""
    digest = hashlib.sha256(json.dumps(_key(size), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "tiny_vit" / f"{size}-{digest}"


def _shift(x: torch.Tensor, max_shift: int, gen: torch.Generator) -> torch.Tensor:
    """Each image moved by its own random (dy, dx) in [-max_shift, max_shift]^2, zero fill."""
    if max_shift == 0:
        return x
    n, _, h, w = x.shape
    pad = torch.nn.functional.pad(x, (max_shift,) * 4)
    d = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=gen)
    return torch.stack([pad[i, :, d[i, 0]:d[i, 0] + h, d[i, 1]:d[i, 1] + w] for i in range(n)])


@torch.no_grad()
def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(pixel_values=x).logits.argmax(-1) == y).double().mean())


def _train(size: str, out: Path, progress: bool) -> dict[str, Any]:
    r = _recipe(size)
    t0, cpu0 = time.perf_counter(), time.process_time()
    task = digits_task(r.source_task, seed=r.seed, image_size=r.image_size)
    model = tiny_vit(seed=r.seed, num_labels=task.num_labels, image_size=r.image_size, hidden_size=r.hidden_size,
                     num_hidden_layers=r.num_hidden_layers, num_attention_heads=r.num_attention_heads,
                     intermediate_size=r.intermediate_size)
    model.config.id2label = dict(enumerate(task.labels))
    model.config.label2id = {v: k for k, v in enumerate(task.labels)}
    gen = torch.Generator().manual_seed(r.seed)
    opt = torch.optim.Adam(model.parameters(), lr=r.lr)
    model.train()
    losses: list[float] = []
    with seeded(r.seed), _progress(progress, r.steps, f"tiny_vit {size}") as tick:
        for step in range(r.steps):
            idx = torch.randint(0, len(task.y_train), (r.batch_size,), generator=gen)
            x = _shift(task.x_train[idx], r.max_shift, gen)
            loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits, task.y_train[idx])
            if not torch.isfinite(loss):
                raise NumericalError(f"tiny_vit {size}: non-finite training loss at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            tick(loss=f"{losses[-1]:.3f}")
    model.eval()
    metrics = {
        "source_task": r.source_task, "source_test_accuracy": _accuracy(model, task.x_test, task.y_test),
        "source_train_accuracy": _accuracy(model, task.x_train, task.y_train),
        "n_train": len(task.y_train), "n_test": len(task.y_test),
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "n_params": sum(p.numel() for p in model.parameters()),
        "build_time_s": time.perf_counter() - t0, "build_cpu_time_s": time.process_time() - cpu0,
        "torch_threads": torch.get_num_threads(),
    }
    with quiet_transformers():
        model.save_pretrained(str(out))
    return metrics


def _read_record(path: Path) -> dict[str, Any] | None:
    if not path.is_dir():
        return None
    missing = [f for f in _REQUIRED if not (path / f).is_file()]
    if missing:
        raise ArtifactError(f"the cached tiny ViT at {path} is incomplete (missing {missing}); rebuild it with "
                            "`rankwise zoo build --force`")
    record = io.read_json(path / _RECORD)
    record["path"] = str(path)
    return record


def build_tiny_vit(size: str = "small", force: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Build (or, unless ``force``, find) the pretrained tiny ViT ``size``; returns its record (path, recipe
    key, metrics: source-task test accuracy, build time). Written atomically into the cache."""
    target = tiny_vit_path(size)
    if not force:
        record = _read_record(target)
        if record is not None:
            return record
    if progress is None:
        progress = sys.stderr.isatty()
    logger.info("building tiny_vit %r into %s", size, target)
    with io.atomic_dir(target, overwrite=True) as tmp:
        with build_threads():
            metrics = _train(size, tmp, progress)
        io.write_json(tmp / _RECORD, {"key": _key(size), "metrics": metrics})
    logger.info("tiny_vit %r: source test accuracy %.3f, %.1f s", size, metrics["source_test_accuracy"],
                metrics["build_time_s"])
    return _read_record(target) or {"path": str(target), "key": _key(size), "metrics": metrics}


def tiny_vit_info(size: str = "small", build: bool = True) -> dict[str, Any] | None:
    """The record of the cached pretrained tiny ViT; builds it if ``build`` (else None when not built)."""
    return build_tiny_vit(size) if build else _read_record(tiny_vit_path(size))


def pretrained_vit(size: str = "small", num_labels: int | None = None, seed: int = 0, rebuild: bool = False,
                   progress: bool | None = None) -> Any:
    """The tiny ViT pretrained on ``digits0to4`` (``ViTForImageClassification``, eval mode, 16 x 16 grey input).

    ``num_labels`` None keeps the pretrained 5-class head (digits 0-4); an int gets a fresh head of that
    many classes (weights N(0, 0.02^2) from ``seed``, bias 0), as a downstream task needs. The first call builds and
    caches the model (about 100 s of CPU time for ``"small"``; ``rankwise zoo build`` does it ahead), later calls
    load it in well under a second. Each call returns a fresh copy.
    """
    from transformers import ViTForImageClassification

    record = build_tiny_vit(size, force=rebuild, progress=progress)
    try:
        with quiet_transformers():
            model = ViTForImageClassification.from_pretrained(record["path"], local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot load the cached tiny ViT at {record['path']} ({exc}); rebuild it with "
                            "`rankwise zoo build --force`") from exc
    if num_labels is not None:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels={num_labels!r} must be a positive int")
        head = torch.nn.Linear(model.config.hidden_size, num_labels)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.02)
            head.bias.zero_()
        model.classifier = head
        model.num_labels = num_labels
        model.config.num_labels = num_labels
    return model.eval()
