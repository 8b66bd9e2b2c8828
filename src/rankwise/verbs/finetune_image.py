"""The image side of ``rankwise finetune`` (helpers of :mod:`rankwise.verbs.finetune`, not a verb of its own).

    rankwise finetune --method vapt|vpt-deep|vpt-shallow|lora --task rot90
    rankwise finetune --method vapt --model VIT_DIR --data images.npz [--eval held_out.npz]

The job is :mod:`rankwise.train.image_job`; this module resolves what the job does not know about:

* data: a zoo digits task (:func:`rankwise.zoo.digits_task` at the model's image size: ``digits5to9``,
  ``rot90``, ``inverted``, ...) or ``.npz`` files holding ``images`` (``(N, H, W)`` or ``(N, C, H, W)``;
  floats in [0, 1], or uint8 scaled by 1/255) and ``labels`` (``(N,)`` ints or strings; classes are the
  distinct labels in sorted order); without ``--eval`` a seeded 20 % of ``--data`` is held out. Files are
  read with ``allow_pickle=False``.
* model: the zoo's tiny ViT pretrained on digits 0-4 (:func:`rankwise.zoo.pretrained_vit`) with a fresh
  seeded head, or a local ``save_pretrained`` ViT / DeiT image classifier (its head is kept when it has as
  many classes as the data, else replaced by a fresh seeded one).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rankwise.train.image_job import ImageData
    from rankwise.train.job import FinetuneJob, FinetuneJobResult

# torch and the job are imported on first use (the CLI imports every verbs module at start)
PROMPT_METHODS = ("vapt", "vpt-deep", "vpt-shallow")  # rankwise.train.image_job.PROMPT_METHODS

__all__ = ["DEFAULT_IMAGE_TASK", "build_vit", "is_image_job", "load_image_data", "load_npz", "run_image"]

DEFAULT_IMAGE_TASK = "rot90"
ZOO_VIT = "small"


def _digits_tasks() -> list[str]:
    from rankwise import zoo

    return zoo.digits_tasks()


def is_image_job(job: FinetuneJob) -> bool:
    """Whether ``job`` is an image job: a prompt method, a zoo digits task, or ``.npz`` data."""
    if job.method in PROMPT_METHODS:
        return True
    if job.task is not None and job.task in _digits_tasks():
        return True
    return job.data is not None and Path(job.data).suffix.lower() == ".npz"


def load_npz(path: Path) -> tuple[torch.Tensor, list[Any]]:
    """``(images (N, C, H, W) float32, labels)`` from an ``.npz`` file; ValueError naming the file otherwise."""
    import numpy as np
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable .npz file without pickled objects ({e})") from None
    if "images" not in arrays or "labels" not in arrays:
        raise ValueError(f"{path}: expected arrays 'images' and 'labels', found {sorted(arrays)}")
    images, labels = arrays["images"], arrays["labels"]
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4:
        raise ValueError(f"{path}: 'images' must have shape (N, H, W) or (N, C, H, W), got {images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(f"{path}: 'labels' must have shape ({len(images)},), got {labels.shape}")
    if not len(images):
        raise ValueError(f"{path}: no images")
    if images.dtype == np.uint8:
        x = torch.from_numpy(images.astype(np.float32) / 255.0)
    elif np.issubdtype(images.dtype, np.floating):
        x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    else:
        raise ValueError(f"{path}: 'images' must be float or uint8, got {images.dtype}")
    if labels.dtype.kind in "iu":
        out = [int(v) for v in labels.tolist()]
    elif labels.dtype.kind == "U":
        out = [str(v) for v in labels.tolist()]
    else:
        raise ValueError(f"{path}: 'labels' must be ints or strings, got {labels.dtype}")
    return x, out


def _indexed(*sets: tuple[torch.Tensor, list[Any]]) -> tuple[list[str], list[torch.Tensor]]:
    import torch

    from rankwise.train.job import class_labels

    labels, indexed = class_labels(*[[(None, lab) for lab in s[1]] for s in sets])
    return labels, [torch.tensor([i for _, i in s], dtype=torch.long) for s in indexed]


def load_image_data(job: FinetuneJob, image_size: int) -> ImageData:
    """The job's images: a zoo digits task at ``image_size`` or ``.npz`` files (see the module docstring)."""
    import torch

    from rankwise.train.image_job import ImageData
    if (job.task is None) == (job.data is None):
        raise ValueError("give exactly one of --task NAME or --data FILE.npz")
    if job.task is not None:
        from rankwise import zoo

        if job.task not in zoo.digits_tasks():
            raise ValueError(f"--task {job.task!r} is not an image task; --method {job.method} learns the zoo's "
                             f"digits tasks ({', '.join(zoo.digits_tasks())}) or --data FILE.npz")
        t = zoo.digits_task(job.task, seed=job.seed, image_size=image_size)
        return ImageData(list(t.labels), t.x_train, t.y_train, t.x_test, t.y_test, f"zoo task {job.task!r}")
    if Path(job.data).suffix.lower() != ".npz":
        raise ValueError(f"--data {job.data}: --method {job.method} learns images; give an .npz file")
    x, raw = load_npz(Path(job.data))
    if job.eval_data is not None:
        xe, raw_e = load_npz(Path(job.eval_data))
        labels, (y, ye) = _indexed((x, raw), (xe, raw_e))
        return ImageData(labels, x, y, xe, ye, f"{job.data} (eval: {job.eval_data})")
    labels, (y,) = _indexed((x, raw))
    if len(y) < 5:
        raise ValueError(f"{job.data}: {len(y)} images are too few to hold out an eval split; give --eval FILE")
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(job.seed))
    n_eval = max(1, len(order) // 5)
    ev, tr = order[:n_eval], order[n_eval:]
    return ImageData(labels, x[tr], y[tr], x[ev], y[ev], f"{job.data} (20 % held out, seed {job.seed})")


def _fresh_head(model: nn.Module, num_labels: int, seed: int) -> None:
    import torch
    from torch import nn
    head = nn.Linear(model.config.hidden_size, num_labels)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)
        head.bias.zero_()
    model.classifier = head
    model.num_labels = model.config.num_labels = num_labels


def build_vit(source: Optional[str], num_labels: int, seed: int) -> nn.Module:
    """The zoo's pretrained tiny ViT (``source`` None) or a ``save_pretrained`` ViT/DeiT classifier directory."""
    if source is None:
        from rankwise import zoo

        return zoo.pretrained_vit(ZOO_VIT, num_labels=num_labels, seed=seed)
    model_dir = Path(source)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: no config.json (expected a save_pretrained layout)")
    from torch import nn
    from transformers import AutoModelForImageClassification

    from rankwise.zoo.models import quiet_transformers

    try:
        with quiet_transformers():
            model = AutoModelForImageClassification.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {model_dir}: not an image classifier transformers can load ({e})") from None
    if not isinstance(getattr(model, "classifier", None), nn.Linear):
        raise ValueError(f"--model {model_dir}: {type(model).__name__} has no linear 'classifier' head")
    if model.classifier.out_features != num_labels:
        _fresh_head(model, num_labels, seed)
    return model.eval()


def _image_size(job: FinetuneJob) -> int:
    if job.model is None:
        return 16
    import json

    cfg = json.loads((Path(job.model) / "config.json").read_text())
    size = cfg.get("image_size", 224)
    return int(size[0] if isinstance(size, list) else size)


def run_image(job: FinetuneJob, progress: bool = False, log: Callable[[str], None] | None = None) -> FinetuneJobResult:
    """:func:`rankwise.train.image_job.run_image_finetune` with the data and model resolved as the verb does."""
    from rankwise.train.image_job import run_image_finetune, validate_image_job

    validate_image_job(job)
    if job.model is not None and not Path(job.model).is_dir():
        raise FileNotFoundError(f"--model {job.model}: no such directory (expected a save_pretrained layout)")
    if job.model is not None and not (Path(job.model) / "config.json").is_file():
        raise ValueError(f"--model {job.model}: no config.json (expected a save_pretrained layout)")
    return run_image_finetune(job, load_image_data(job, _image_size(job)), build_vit, progress=progress, log=log)


def load_finetuned_image(directory: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`rankwise.train.image_job.load_image_finetuned` with this verb's model builder."""
    from rankwise.train.image_job import load_image_finetuned

    return load_image_finetuned(directory, build_vit)

