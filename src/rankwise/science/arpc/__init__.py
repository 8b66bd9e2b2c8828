"""ARPC: progressive ultra-low-bitrate image coding with multi-scale residual quantization and a
next-scale autoregressive model as entropy model and generator.

Paper: "Autoregressive-based Progressive Coding for Ultra-Low Bitrate Image Compression" (ICLR 2026,
OpenReview FXu4G5T5QZ; official code github.com/Joanna-0421/ARPC). Spec: ``shared/methods/arpc.md``.

An image is cut into ``T x T`` tiles; each tile is coded coarse to fine as K token maps by residual
quantization (:mod:`.quantizer`, spec §1-2: per-scale scalar codebooks, or bit planes with group
masks). A block-causal next-scale transformer (:mod:`.model`, spec §3) gives ``p(t_k | t_<k)``; the
first ``k`` scales are entropy-coded with it by constriction's range coder (:mod:`.bitstream`, spec §4;
a header with the image size, the scales sent and the model hash; bpp counts every byte). The decoder
decodes the sent scales exactly and lets the same model fill the others (arg-max, sampling, or
zeros) (spec §5): one model, many rates.

Public API::

    from rankwise.science import arpc
    codec = arpc.ARPCCodec(arpc.ARPCConfig(scales=(1, 2, 4, 8, 16), codebook_size=16))
    codec.fit(train_images, steps=2000, seed=0)          # (N, 1, 16, 16) in [-1, 1]
    r = codec.encode(img, num_scales=3)                   # EncodeResult: r.data, r.bpp, r.ideal_bits
    d = codec.decode(r.data, complete="argmax")           # DecodeResult: d.image, d.tokens
    codec.save("arpc.safetensors"); arpc.ARPCCodec.load("arpc.safetensors")

Baselines: ``entropy_model="histogram"`` (static per-scale token histograms, the same tokens and
coder), ``complete="zeros"`` (no AR completion), :func:`jpeg_roundtrip` (Pillow).
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.science.arpc.bitstream import (
    BitstreamError,
    Header,
    RangeReader,
    RangeWriter,
    floor_probabilities,
    ideal_bits,
    pack,
    unpack,
)
from rankwise.science.arpc.codec import (
    COMPLETIONS,
    ARPCCodec,
    DecodeResult,
    EncodeResult,
    FitResult,
    rate_distortion,
)
from rankwise.science.arpc.config import QUANTIZERS, ARPCConfig, default_groups
from rankwise.science.arpc.images import as_image, from_tiles, jpeg_roundtrip, load_image, to_pil, to_tiles
from rankwise.science.arpc.model import NextScaleTransformer, block_causal_mask
from rankwise.science.arpc.quantizer import MultiScaleQuantizer, down, kmeans_1d, up

__all__ = [
    "ARPCCodec",
    "ARPCConfig",
    "BitstreamError",
    "COMPLETIONS",
    "DecodeResult",
    "EncodeResult",
    "FitResult",
    "Header",
    "MultiScaleQuantizer",
    "NextScaleTransformer",
    "QUANTIZERS",
    "RangeReader",
    "RangeWriter",
    "as_image",
    "block_causal_mask",
    "default_groups",
    "down",
    "floor_probabilities",
    "from_tiles",
    "ideal_bits",
    "jpeg_roundtrip",
    "kmeans_1d",
    "load_image",
    "pack",
    "rate_distortion",
    "to_pil",
    "to_tiles",
    "unpack",
    "up",
]

register("arpc", config=ARPCConfig, entry=ARPCCodec)
