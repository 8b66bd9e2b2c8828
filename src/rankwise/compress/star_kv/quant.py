"""Low-rank-aware mixed-precision quantisation of the STAR-KV latents.

Each latent block (one K head's ``r_h`` channels, or the V layer's ``r_V``) is ordered by singular value.
Its leading ``outlier_frac`` (20 %) of channels get ``hi_bits`` (4) and the rest ``lo_bits`` (3); each part
is rotated by a block Hadamard with random signs (orthogonal, so it can be folded into the factors offline:
the cache stores ``z H`` and the up factor absorbs ``H^T``), then quantised symmetrically per token with an
absmax scale ``scale = amax / (2^(b-1) - 1)``, rounded and clamped.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from rankwise.core.validate import check_int, check_number

Tensor = torch.Tensor

__all__ = ["quantize", "dequantize", "uniform_quantize", "block_hadamard", "random_hadamard_rotation",
           "mixed_precision_quantize", "relative_mse"]

EPS = 1e-8  # floor of the absmax scale: an all-zero row quantises to zeros without dividing by zero


def _bits(bits: int) -> int:
    return int(check_int("bits", bits, 2, 8))


def quantize(x: Tensor, bits: int, dim: int = -1) -> tuple[Tensor, Tensor]:
    """Symmetric absmax quantisation along ``dim`` (per token for ``dim=-1``).

    Returns integer codes in ``[-(2^(b-1) - 1), 2^(b-1) - 1]`` (int8) and the scale (``x``'s dtype,
    ``dim`` kept). ``|dequantize(q, scale) - x| <= scale / 2`` element by element.
    """
    qmax = 2 ** (_bits(bits) - 1) - 1
    scale = (x.abs().amax(dim=dim, keepdim=True) / qmax).clamp_min(EPS)
    q = torch.round(x / scale).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """``q * scale``."""
    return q.to(scale.dtype) * scale


def uniform_quantize(x: Tensor, bits: int) -> Tensor:
    """Quantise-dequantise per token (last dimension) at ``bits``."""
    return dequantize(*quantize(x, bits))


def block_hadamard(n: int) -> Tensor:
    """An orthogonal ``n x n`` block-diagonal matrix of normalised Sylvester Hadamard blocks (the binary
    decomposition of ``n``, largest block first; float64)."""
    check_int("n", n, 1)
    blocks, rest = [], n
    while rest:
        size = 1 << (rest.bit_length() - 1)
        H = torch.ones(1, 1, dtype=torch.float64)
        while H.shape[0] < size:
            H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
        blocks.append(H / math.sqrt(size))
        rest -= size
    return torch.block_diag(*blocks)


def random_hadamard_rotation(n: int, seed: int = 0) -> Tensor:
    """``diag(signs) @ block_hadamard(n)`` with seeded random signs (orthogonal, float64)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return signs[:, None] * block_hadamard(n)


def mixed_precision_quantize(z: Tensor, ranks: Sequence[int], *, outlier_frac: float = 0.2, hi_bits: int = 4,
                             lo_bits: int = 3, rotate: bool = True, seed: int = 0) -> tuple[Tensor, float]:
    """Quantise-dequantise latents ``z`` (``(..., sum(ranks))``, blocks in ``ranks`` order).

    Per block of width ``r``: the leading ``ceil(outlier_frac r)`` channels at ``hi_bits``, the rest at
    ``lo_bits``, each part rotated first (``rotate``; its own random-sign block Hadamard, seeded by
    ``seed`` and the part's position) and rotated back after. Returns the dequantised latents in the
    original basis and the average bits per element.
    """
    check_number("outlier_frac", outlier_frac, 0.0, 1.0)
    if sum(ranks) != z.shape[-1]:
        raise ValueError(f"ranks {list(ranks)} sum to {sum(ranks)}, the latents have {z.shape[-1]} channels")
    out, col, bits_total, part = torch.empty_like(z), 0, 0.0, 0
    for r in ranks:
        lead = math.ceil(outlier_frac * r)
        for width, bits in ((lead, hi_bits), (r - lead, lo_bits)):
            if width == 0:
                continue
            x = z[..., col:col + width]
            if rotate:
                H = random_hadamard_rotation(width, seed * 100003 + part).to(z.dtype)
                out[..., col:col + width] = uniform_quantize(x @ H, bits) @ H.T
            else:
                out[..., col:col + width] = uniform_quantize(x, bits)
            bits_total += width * bits
            col += width
            part += 1
    return out, bits_total / max(1, sum(ranks))


def relative_mse(x: Tensor, xq: Tensor) -> float:
    """``||x - xq||^2 / ||x||^2`` (float64)."""
    x, xq = x.double(), xq.double()
    return float(((x - xq) ** 2).sum() / (x ** 2).sum().clamp_min(1e-300))
