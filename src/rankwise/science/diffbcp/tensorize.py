"""Patch tensorisation (spec "Tensorisation", code ``image2patches``): an image ``[C, H, W]`` is cut into
overlapping ``p x p`` patches with stride ``s`` and stacked into a tensor ``[C, p, p, P]`` (``[p, p, P]``
for one channel); the way back averages the overlapping patches, so ``patches2image(image2patches(I))
== I`` exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rankwise.core.validate import check_int

__all__ = ["PatchMap"]


@dataclass(frozen=True)
class PatchMap:
    """Overlapping ``patch x patch`` patches with ``stride`` of ``channels x height x width`` images.

    ``(H - patch)`` and ``(W - patch)`` must be multiples of ``stride`` so that the patches cover
    the image exactly."""

    channels: int
    height: int
    width: int
    patch: int = 4
    stride: int = 2

    def __post_init__(self) -> None:
        check_int("PatchMap.channels", self.channels, 1)
        check_int("PatchMap.height", self.height, 1)
        check_int("PatchMap.width", self.width, 1)
        check_int("PatchMap.patch", self.patch, 1)
        check_int("PatchMap.stride", self.stride, 1)
        if self.patch > min(self.height, self.width):
            raise ValueError(f"PatchMap.patch must be <= the image size {self.height} x {self.width}, got {self.patch}")
        for name, size in (("height", self.height), ("width", self.width)):
            if (size - self.patch) % self.stride:
                raise ValueError(f"PatchMap.stride={self.stride} must divide {name} - patch = {size} - {self.patch} "
                                 f"= {size - self.patch}")

    @property
    def grid(self) -> tuple[int, int]:
        return (self.height - self.patch) // self.stride + 1, (self.width - self.patch) // self.stride + 1

    @property
    def n_patches(self) -> int:
        a, b = self.grid
        return a * b

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        p = self.patch
        return (p, p, self.n_patches) if self.channels == 1 else (self.channels, p, p, self.n_patches)

    def _check(self, image: Tensor) -> Tensor:
        want = (self.channels, self.height, self.width)
        if image.dim() == 2 and self.channels == 1:
            image = image.unsqueeze(0)
        if tuple(image.shape) != want:
            raise ValueError(f"PatchMap: image must be {list(want)}, got {list(image.shape)}")
        return image

    def to_tensor(self, image: Tensor) -> Tensor:
        """``[C, H, W]`` (or ``[H, W]``) -> the patch tensor :attr:`tensor_shape`."""
        image = self._check(image)
        p = self.patch
        u = torch.nn.functional.unfold(image.unsqueeze(0).double(), p, stride=self.stride)[0]  # [C p p, P]
        u = u.reshape(self.channels, p, p, self.n_patches)
        return u[0] if self.channels == 1 else u

    def counts(self) -> Tensor:
        """How many patches cover each pixel, ``[C, H, W]``."""
        return self.to_image_sum(torch.ones(self.tensor_shape, dtype=torch.float64))

    def to_image_sum(self, t: Tensor) -> Tensor:
        if tuple(t.shape) != self.tensor_shape:
            raise ValueError(f"PatchMap: patch tensor must be {list(self.tensor_shape)}, got {list(t.shape)}")
        cols = t.reshape(self.channels * self.patch * self.patch, self.n_patches).double()
        return torch.nn.functional.fold(cols.unsqueeze(0), (self.height, self.width), self.patch,
                                        stride=self.stride)[0]

    def to_image(self, t: Tensor) -> Tensor:
        """The patch tensor -> ``[C, H, W]``, averaging the overlapping patches."""
        return self.to_image_sum(t) / self.counts()
