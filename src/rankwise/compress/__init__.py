"""Post-training low-rank compression of linear layers (SVD family).

One verb for every method, torchao-style: the config's type chooses the method::

    from rankwise.compress import SwiftSVDConfig, compress, save_compressed, load_compressed
    report = compress(model, SwiftSVDConfig(param_ratio=0.4), calib=batches)   # in place; LowRankLinear layers
    save_compressed(model, "out/", report)
    model2 = load_compressed("out/")                    # bit-identical outputs

Method configs: :class:`SwiftSVDConfig`, :class:`SAESSVDConfig`, :class:`GFWSVDConfig` (the papers) and
:class:`PlainSVDConfig`, :class:`ASVDConfig`, :class:`FWSVDConfig`, :class:`SVDLLMConfig` (the
baselines, :mod:`~rankwise.compress.svd_baselines`); :class:`CompressConfig` names any registered
method (``rankwise.compress.layer_methods()``) with every pipeline setting. Layout: ``config``,
``targets``, ``calibration`` (:func:`calibrate`, reusable statistics), ``allocation`` (ranks),
``blockwise`` (block-sequential mode), ``api`` (:func:`compress`), ``checkpoint``
(:func:`compress_checkpoint`, one block in memory at a time), ``job`` (the work behind ``rankwise
compress``), ``serialization`` (the directory format).
"""

from rankwise.compress.allocation import allocate_ranks, dynamic_ranks
from rankwise.compress.api import compress, forward_time_ratio
from rankwise.compress.base import (
    CompressionReport,
    LayerMethod,
    LayerReport,
    PairedStats,
    layer_methods,
    method_for_config,
    register_layer_method,
    relative_output_error,
    resolve_layer_method,
    uniform_rank,
)
from rankwise.compress.calibration import Calibration, calibrate
from rankwise.compress.checkpoint import compress_checkpoint, fix_mmap_threshold
from rankwise.compress.config import CompressConfig, MethodConfig
from rankwise.compress.gfwsvd import GFWSVDConfig
from rankwise.compress.saes_svd import SAESConfig, SAESSVDConfig
from rankwise.compress.serialization import load_compressed, read_compression_metadata, save_compressed
from rankwise.compress.svd_baselines import (
    ASVD,
    FWSVD,
    SVDLLM,
    ASVDConfig,
    FWSVDConfig,
    PlainSVD,
    PlainSVDConfig,
    SVDLLMConfig,
    asvd_factors,
    fwsvd_factors,
    plain_svd_factors,
    svd_llm_factors,
)
from rankwise.compress.swift_svd import (
    SwiftSVD,
    SwiftSVDConfig,
    swift_svd_compress,
    swift_svd_factors,
)
from rankwise.compress.targets import find_blocks, layer_groups, resolve_targets

__all__ = [
    "compress", "CompressConfig", "MethodConfig", "Calibration", "calibrate", "compress_checkpoint",
    "fix_mmap_threshold", "save_compressed", "load_compressed", "read_compression_metadata", "CompressionReport",
    "LayerReport", "LayerMethod", "PairedStats", "layer_methods", "register_layer_method", "resolve_layer_method",
    "method_for_config", "uniform_rank", "relative_output_error", "find_blocks", "resolve_targets", "layer_groups",
    "allocate_ranks", "forward_time_ratio",
    "SwiftSVDConfig", "SAESSVDConfig", "SAESConfig", "GFWSVDConfig", "PlainSVDConfig", "ASVDConfig", "FWSVDConfig",
    "SVDLLMConfig",
    "PlainSVD", "ASVD", "FWSVD", "SVDLLM", "plain_svd_factors", "asvd_factors", "fwsvd_factors",
    "svd_llm_factors", "SwiftSVD", "swift_svd_compress", "swift_svd_factors", "dynamic_ranks",
]
