"""Image helpers of the codec: checks, tiling, PNG/Pillow conversion and the JPEG baseline (Pillow).

The codec's images are float tensors ``(C, H, W)`` with values in ``[-1, 1]`` (``(H, W)`` is taken
as one channel). An image whose sides are not multiples of the tile side ``T`` is padded by edge
replication to the next multiple before tiling; the decoder crops back (the header stores the size).
Tiles are taken in raster order.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["as_image", "from_tiles", "jpeg_roundtrip", "load_image", "to_pil", "to_tiles"]

_TOL = 1e-4


def as_image(img: Any, channels: int | None = None) -> Tensor:
    """``img`` as a float32 tensor ``(C, H, W)`` in ``[-1, 1]``; ``ValueError`` (one line) for a wrong
    rank, a channel count other than ``channels``, NaN/inf or values outside ``[-1, 1]``."""
    if isinstance(img, np.ndarray):
        img = torch.from_numpy(np.ascontiguousarray(img))
    if not isinstance(img, Tensor):
        raise TypeError(f"an image is a tensor or numpy array (C, H, W) in [-1, 1], got {type(img).__name__}")
    if not img.is_floating_point():
        raise TypeError(f"an image must be a float tensor in [-1, 1], got dtype {img.dtype} "
                        f"(use load_image for files, or x / 127.5 - 1 for uint8)")
    if img.dim() == 2:
        img = img.unsqueeze(0)
    if img.dim() != 3:
        raise ValueError(f"an image must have shape (C, H, W) or (H, W), got {tuple(img.shape)}")
    if channels is not None and img.shape[0] != channels:
        raise ValueError(f"this codec codes {channels}-channel images, got {img.shape[0]} channels "
                         f"(shape {tuple(img.shape)})")
    if img.shape[1] < 1 or img.shape[2] < 1:
        raise ValueError(f"an image must have at least one pixel, got shape {tuple(img.shape)}")
    if not torch.isfinite(img).all():
        raise ValueError("the image holds NaN or inf pixels")
    lo, hi = float(img.min()), float(img.max())
    if lo < -1 - _TOL or hi > 1 + _TOL:
        raise ValueError(f"pixel values must lie in [-1, 1], got [{lo:.4g}, {hi:.4g}]")
    return img.detach().to(torch.float32).clamp(-1, 1).contiguous()


def to_tiles(img: Tensor, tile: int, pad: bool = True) -> tuple[Tensor, tuple[int, int]]:
    """``(tiles (n, C, T, T), (rows, cols))`` of an image ``(C, H, W)``, raster order.

    With ``pad=False`` sides that are not multiples of ``tile`` raise ``ValueError``; otherwise the
    image is padded by edge replication.
    """
    C, H, W = img.shape
    ph, pw = (-H) % tile, (-W) % tile
    if (ph or pw) and not pad:
        raise ValueError(f"image size {H}x{W} is not a multiple of the tile side {tile} "
                         f"(pass pad=True to pad by edge replication)")
    if ph or pw:
        img = F.pad(img.unsqueeze(0), (0, pw, 0, ph), mode="replicate").squeeze(0)
    rows, cols = img.shape[1] // tile, img.shape[2] // tile
    tiles = img.reshape(C, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(rows * cols, C, tile, tile)
    return tiles.contiguous(), (rows, cols)


def from_tiles(tiles: Tensor, grid: tuple[int, int], height: int, width: int) -> Tensor:
    """The image ``(C, height, width)`` from raster-ordered ``tiles (n, C, T, T)`` (crops the padding)."""
    rows, cols = grid
    n, C, T, _ = tiles.shape
    if n != rows * cols:
        raise ValueError(f"{n} tiles do not fill a {rows}x{cols} grid")
    img = tiles.reshape(rows, cols, C, T, T).permute(2, 0, 3, 1, 4).reshape(C, rows * T, cols * T)
    return img[:, :height, :width].contiguous()


def load_image(path: str | Path, channels: int = 1) -> Tensor:
    """A PNG/JPEG/... file as ``(channels, H, W)`` in ``[-1, 1]`` (Pillow; converted to grey ``L`` for
    one channel, ``RGB`` for three)."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such image file")
    try:
        with Image.open(p) as im:
            im = im.convert("L" if channels == 1 else "RGB")
            arr = np.asarray(im, dtype=np.float32)
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{p}: not a readable image ({e})") from None
    if arr.ndim == 2:
        arr = arr[None]
    else:
        arr = arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr)) / 127.5 - 1.0


def to_pil(img: Tensor) -> Any:
    """A ``(C, H, W)`` tensor in ``[-1, 1]`` as a Pillow image (``L`` or ``RGB``), rounded to uint8."""
    from PIL import Image

    arr = ((img.detach().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
    if arr.shape[0] == 1:
        return Image.fromarray(arr[0], mode="L")
    return Image.fromarray(arr.transpose(1, 2, 0), mode="RGB")


def jpeg_roundtrip(img: Tensor, quality: int) -> tuple[int, Tensor]:
    """The JPEG baseline: ``(file bytes, decoded image)`` of ``img (C, H, W)`` in ``[-1, 1]`` saved by
    Pillow at ``quality`` (1..95, no optimisation flags) and read back."""
    from PIL import Image

    if not 1 <= int(quality) <= 95:
        raise ValueError(f"quality must be in 1..95, got {quality}")
    buf = io.BytesIO()
    to_pil(img).save(buf, format="JPEG", quality=int(quality))
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im, dtype=np.float32)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return len(data), torch.from_numpy(np.ascontiguousarray(arr)) / 127.5 - 1.0
