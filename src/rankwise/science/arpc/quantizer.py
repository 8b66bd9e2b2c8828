"""Multi-scale residual quantization on pixel tiles (spec §1-2).

With ``f = x`` (no VAE) a tile ``x (N, C, T, T)`` is coded coarse to fine: ``f_hat_0 = 0`` and for
``k = 1..K``::

    z_k     = Down(x - f_hat_{k-1}, s_k)          area interpolation to s_k x s_k
    t_k     = Q_k(z_k)                              integer tokens (N, C, s_k, s_k)
    f_hat_k = f_hat_{k-1} + Up(Deq_k(t_k), T)       bilinear interpolation back to T x T

``Q_k`` is either a scalar codebook per scale (``vq``: 1-D k-means on the training residuals,
deterministic quantile start and Lloyd steps in float64) or a uniform quantizer of the residual
range ``[-a_k, a_k]`` that keeps only the ``g_k`` most significant of ``bits`` bit planes
(``bitplane``: the group mask; the dropped planes cost no bits and dequantize to the cell centre).
Tokens never sent are "zero-filled": they add nothing to ``f_hat``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rankwise.science.arpc.config import ARPCConfig

__all__ = ["MultiScaleQuantizer", "down", "kmeans_1d", "up"]


def down(x: Tensor, size: int) -> Tensor:
    """Area interpolation of ``x (N, C, H, W)`` to ``size x size`` (identity at the same size)."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="area")


def up(x: Tensor, size: int) -> Tensor:
    """Bilinear interpolation of ``x (N, C, h, w)`` to ``size x size`` (identity at the same size)."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def kmeans_1d(values: Tensor, k: int, iters: int = 50) -> Tensor:
    """A sorted codebook of ``k`` scalars for ``values`` (1-D k-means, float64, deterministic).

    Starts from the ``(i + 0.5) / k`` quantiles and runs ``iters`` Lloyd steps; an empty cell keeps
    its centre. Duplicate centres (fewer distinct values than ``k``) are spread by a tiny offset so
    the codebook stays strictly increasing.
    """
    v = values.detach().reshape(-1).to(torch.float64)
    if v.numel() == 0:
        raise ValueError("kmeans_1d needs at least one value")
    v, _ = torch.sort(v)
    q = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    c = torch.quantile(v, q) if v.numel() < 16_000_000 else v[(q * (v.numel() - 1)).long()]
    for _ in range(iters):
        edges = (c[1:] + c[:-1]) / 2
        cell = torch.bucketize(v, edges)
        sums = torch.zeros(k, dtype=torch.float64).index_add_(0, cell, v)
        counts = torch.bincount(cell, minlength=k).to(torch.float64)
        new = torch.where(counts > 0, sums / counts.clamp_min(1), c)
        new, _ = torch.sort(new)
        if torch.equal(new, c):
            break
        c = new
    eps = 1e-6
    for i in range(1, k):  # strictly increasing
        if c[i] <= c[i - 1]:
            c[i] = c[i - 1] + eps
    return c


class MultiScaleQuantizer(nn.Module):
    """Residual quantizer over the scale schedule of an :class:`ARPCConfig`; ``fit`` before use.

    Buffers: ``codebooks (K, V)`` (vq; unused entries of a scale are never produced) and ``ranges
    (K,)`` (bitplane: the half-width ``a_k`` of each scale's quantization interval).
    """

    def __init__(self, config: ARPCConfig) -> None:
        super().__init__()
        self.config = config
        K = config.num_scales
        self.register_buffer("codebooks", torch.zeros(K, config.codebook_size))
        self.register_buffer("ranges", torch.ones(K))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    # ---- one scale --------------------------------------------------------------------------------
    def quantize(self, z: Tensor, k: int) -> Tensor:
        """Tokens (int64, same shape) of residual values ``z`` at scale ``k`` (0-based)."""
        if self.config.quantizer == "vq":
            cb = self.codebooks[k]
            edges = (cb[1:] + cb[:-1]) / 2
            return torch.bucketize(z.contiguous(), edges.contiguous())
        a = self.ranges[k]
        levels = self.config.vocab(k)
        u = (z.clamp(-a, a) + a) / (2 * a)
        return (u * levels).floor().clamp_(0, levels - 1).long()

    def dequantize(self, t: Tensor, k: int) -> Tensor:
        """Values of tokens ``t`` at scale ``k`` (0-based)."""
        if self.config.quantizer == "vq":
            return self.codebooks[k][t]
        a = self.ranges[k]
        levels = self.config.vocab(k)
        return -a + (t.to(self.ranges.dtype) + 0.5) * (2 * a / levels)

    # ---- the whole schedule -----------------------------------------------------------------------
    def _check_tiles(self, x: Tensor) -> None:
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"tiles must be a tensor (N, C, T, T), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if x.shape[1] != c.channels or x.shape[2] != c.tile or x.shape[3] != c.tile:
            raise ValueError(f"tiles must have shape (N, {c.channels}, {c.tile}, {c.tile}), got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError("tiles hold NaN or inf pixels")

    @torch.no_grad()
    def fit(self, x: Tensor) -> "MultiScaleQuantizer":
        """Learn each scale's codebook (vq) or range (bitplane) on the residuals of training tiles
        ``x (N, C, T, T)``, coarse to fine (each scale sees the residual left by the scales before)."""
        self._check_tiles(x)
        c = self.config
        x = x.to(torch.float32)
        f_hat = torch.zeros_like(x)
        for k, s in enumerate(c.scales):
            z = down(x - f_hat, s)
            if c.quantizer == "vq":
                self.codebooks[k] = kmeans_1d(z, c.codebook_size, c.kmeans_iters).to(self.codebooks.dtype)
            else:
                a = torch.quantile(z.abs().reshape(-1).to(torch.float64)[:4_000_000], 0.995).item()
                self.ranges[k] = max(a, 1e-4)
            f_hat = f_hat + up(self.dequantize(self.quantize(z, k), k), c.tile)
        self.fitted.fill_(True)
        return self

    def _check_fitted(self) -> None:
        if not bool(self.fitted):
            raise RuntimeError("the quantizer is not fitted: call ARPCCodec.fit (or MultiScaleQuantizer.fit) first")

    @torch.no_grad()
    def encode(self, x: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """``(tokens, f_hats)``: tokens ``t_k (N, C, s_k, s_k)`` for every scale and the running
        reconstructions ``f_hat_k (N, C, T, T)`` after each scale."""
        self._check_fitted()
        self._check_tiles(x)
        c = self.config
        x = x.to(torch.float32)
        f_hat = torch.zeros_like(x)
        tokens, f_hats = [], []
        for k, s in enumerate(c.scales):
            t = self.quantize(down(x - f_hat, s), k)
            f_hat = f_hat + up(self.dequantize(t, k), c.tile)
            tokens.append(t)
            f_hats.append(f_hat)
        return tokens, f_hats

    def add_scale(self, f_hat: Tensor, t: Tensor, k: int) -> Tensor:
        """``f_hat + Up(Deq_k(t))``: the reconstruction after adding scale ``k``'s tokens."""
        return f_hat + up(self.dequantize(t, k), self.config.tile)

    @torch.no_grad()
    def reconstruct(self, tokens: list[Tensor]) -> Tensor:
        """``f_hat`` from the tokens of the first ``len(tokens)`` scales (later scales zero-filled)."""
        self._check_fitted()
        c = self.config
        if not 1 <= len(tokens) <= c.num_scales:
            raise ValueError(f"reconstruct needs 1..{c.num_scales} scales of tokens, got {len(tokens)}")
        n = tokens[0].shape[0]
        f_hat = torch.zeros(n, c.channels, c.tile, c.tile, dtype=self.codebooks.dtype)
        for k, t in enumerate(tokens):
            want = (n, c.channels, c.scales[k], c.scales[k])
            if tuple(t.shape) != want:
                raise ValueError(f"tokens of scale {k + 1} must have shape {want}, got {tuple(t.shape)}")
            f_hat = self.add_scale(f_hat, t, k)
        return f_hat
