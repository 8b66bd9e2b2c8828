"""Image classification tasks from scikit-learn's bundled digits (offline, no download).

The data are the 1,797 8 x 8 grey images of handwritten digits that ship with scikit-learn
(``sklearn.datasets.load_digits``), a copy of the test part of the UCI "Optical Recognition of
Handwritten Digits" data set (Alpaydin and Kaynak, 1998; CC BY 4.0 at UCI; distributed with
scikit-learn under its BSD-3-Clause licence). Pixel values 0..16 are scaled to [0, 1].

Every task is balanced: each class is cut to the size of its smallest class (a class made of
several digits, such as "odd", draws evenly from its digits as far as their counts allow), then
split per class into train and test (``test_fraction``, default 0.2). Both steps use ``seed``, so
different seeds give different, equally balanced splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rankwise.zoo.tasks import _check_name

__all__ = ["DIGITS_TASKS", "ImageTask", "digits_images", "digits_task", "digits_tasks"]


@dataclass(frozen=True)
class ImageTask:
    """A balanced image classification task.

    ``x_train`` / ``x_test``: float32 tensors (N, 1, H, W) with values in [0, 1];
    ``y_train`` / ``y_test``: int64 tensors (N,) of indices into ``labels``.
    """

    name: str
    labels: list[str]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    description: str

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[-1])


@dataclass(frozen=True)
class _DigitsSpec:
    classes: tuple[tuple[int, ...], ...]  # the digits of each class
    labels: tuple[str, ...]
    description: str
    transform: Callable[[np.ndarray], np.ndarray] | None = None


_ALL = tuple((d,) for d in range(10))
_NAMES = tuple(str(d) for d in range(10))

DIGITS_TASKS: dict[str, _DigitsSpec] = {
    "digits10": _DigitsSpec(_ALL, _NAMES, "All ten digits (10 classes)."),
    "odd_even": _DigitsSpec(((0, 2, 4, 6, 8), (1, 3, 5, 7, 9)), ("even", "odd"), "Even or odd digit."),
    "low_high": _DigitsSpec(((0, 1, 2, 3, 4), (5, 6, 7, 8, 9)), ("<5", ">=5"), "Digit below 5 or at least 5."),
    "digits0to4": _DigitsSpec(_ALL[:5], _NAMES[:5], "Digits 0-4 only (5 classes)."),
    "digits5to9": _DigitsSpec(_ALL[5:], _NAMES[5:], "Digits 5-9 only (5 classes)."),
    "3v8": _DigitsSpec(((3,), (8,)), ("3", "8"), "3 or 8 (a confusable pair)."),
    "1v7": _DigitsSpec(((1,), (7,)), ("1", "7"), "1 or 7 (a confusable pair)."),
    "4v9": _DigitsSpec(((4,), (9,)), ("4", "9"), "4 or 9 (a confusable pair)."),
    "rot90": _DigitsSpec(_ALL, _NAMES, "All ten digits, images rotated by 90 degrees counter-clockwise.",
                         lambda x: np.rot90(x, k=1, axes=(-2, -1))),
    "inverted": _DigitsSpec(_ALL, _NAMES, "All ten digits with inverted intensities (1 - x).",
                            lambda x: 1.0 - x),
}


def digits_tasks() -> list[str]:
    """The names of the digits tasks, in a fixed order."""
    return list(DIGITS_TASKS)


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images (N, 8, 8) scaled to [0, 1] and their digits; read-only (shared by calls)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (np.asarray(data.images, dtype=np.float64) / 16.0).astype(np.float32)
    target = np.asarray(data.target, dtype=np.int64)
    images.flags.writeable = False
    target.flags.writeable = False
    return images, target


def _draw_class(idx_by_digit: list[np.ndarray], n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` indices drawn as evenly as possible from several digits' shuffled index lists."""
    quota = [0] * len(idx_by_digit)
    remaining = n
    while remaining:  # round robin over the digits that still have images; n <= their total
        for j, idx in enumerate(idx_by_digit):
            if remaining and quota[j] < len(idx):
                quota[j] += 1
                remaining -= 1
    return np.concatenate([idx[:q] for idx, q in zip(idx_by_digit, quota)])


def digits_task(name: str, seed: int = 0, image_size: int = 8, test_fraction: float = 0.2) -> ImageTask:
    """Build the digits task ``name`` (one of :func:`digits_tasks`).

    ``image_size`` > 8 upsamples the 8 x 8 images bilinearly (values stay in [0, 1]), e.g. 16 for
    a ViT with patch 4. ``seed`` sets the balancing draw and the split. Raises
    :class:`~rankwise.zoo.tasks.UnknownTaskError` for an unknown ``name``.
    """
    _check_name(name, digits_tasks(), "digits task")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
        raise ValueError(f"image_size={image_size!r} must be an int >= 8 (the digits are 8 x 8)")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must be in (0, 1)")
    spec = DIGITS_TASKS[name]
    images, target = _load_digits()
    rng = np.random.default_rng(seed)
    per_digit = {d: rng.permutation(np.flatnonzero(target == d)) for d in range(10)}
    n = min(sum(len(per_digit[d]) for d in digits) for digits in spec.classes)
    n_test = max(1, int(round(n * float(test_fraction))))
    if n_test >= n:
        raise ValueError(f"test_fraction={test_fraction} leaves no training image ({n} per class)")
    train_idx, test_idx, train_y, test_y = [], [], [], []
    for c, digits in enumerate(spec.classes):
        idx = rng.permutation(_draw_class([per_digit[d] for d in digits], n, rng))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
        test_y.append(np.full(n_test, c))
        train_y.append(np.full(n - n_test, c))
    tr = rng.permutation(len(np.concatenate(train_idx)))
    te = rng.permutation(len(np.concatenate(test_idx)))

    def tensor(idx: list[np.ndarray], order: np.ndarray) -> torch.Tensor:
        x = images[np.concatenate(idx)[order]]
        if spec.transform is not None:
            x = np.ascontiguousarray(spec.transform(x))
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).unsqueeze(1)
        if image_size != 8:
            t = torch.nn.functional.interpolate(t, size=(image_size, image_size), mode="bilinear",
                                                align_corners=False).clamp_(0.0, 1.0)
        return t

    return ImageTask(
        name=name, labels=list(spec.labels),
        x_train=tensor(train_idx, tr), y_train=torch.from_numpy(np.concatenate(train_y)[tr]),
        x_test=tensor(test_idx, te), y_test=torch.from_numpy(np.concatenate(test_y)[te]),
        description=spec.description,
    )


def digits_images(image_size: int = 16, n_test: int = 297, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digit images, unlabelled and unbalanced, as ``(train, test)`` float32 tensors
    ``(N, 1, image_size, image_size)`` with values in [0, 1] (image coding and generative models).

    ``seed`` draws the permutation (``numpy.random.default_rng(seed)``); the last ``n_test`` images of it
    are the test set (default: 1,500 train / 297 test). ``image_size`` > 8 upsamples bilinearly.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
        raise ValueError(f"image_size={image_size!r} must be an int >= 8 (the digits are 8 x 8)")
    images, _ = _load_digits()
    if isinstance(n_test, bool) or not isinstance(n_test, int) or not 1 <= n_test < len(images):
        raise ValueError(f"n_test={n_test!r} must be an int in 1..{len(images) - 1}")
    order = np.random.default_rng(seed).permutation(len(images))
    t = torch.from_numpy(np.ascontiguousarray(images[order])).unsqueeze(1)
    if image_size != 8:
        t = torch.nn.functional.interpolate(t, size=(image_size, image_size), mode="bilinear",
                                            align_corners=False).clamp_(0.0, 1.0)
    n_train = len(images) - n_test
    return t[:n_train].contiguous(), t[n_train:].contiguous()
