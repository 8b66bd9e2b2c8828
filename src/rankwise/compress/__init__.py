"""Post-training low-rank compression of linear layers (SVD family).

One verb for every method::

    from rankwise.compress import CompressConfig, compress, save_compressed, load_compressed
    report = compress(model, CompressConfig(method="swift-svd", ratio=0.4, allocation="dynamic"),
                      calib=batches)                   # in place; LowRankLinear layers
    save_compressed(model, "out/", report)
    model2 = load_compressed("out/")                    # bit-identical outputs

Methods (``rankwise.compress.layer_methods()``): ``svd``, ``asvd``, ``fwsvd``, ``svd-llm``
(:mod:`~rankwise.compress.svd_baselines`), ``swift-svd`` (:mod:`~rankwise.compress.swift_svd`), and
``saes-svd`` / ``gfwsvd`` (their own modules, registered when imported; ``layer_methods()`` imports them).
Block-sequential calibration (``mode="blocks"``) and :func:`compress_checkpoint` (one block in memory
at a time) are in :mod:`~rankwise.compress.pipeline`; the directory format in
:mod:`~rankwise.compress.serialization`.
"""

from rankwise.compress.base import (
    CompressionReport,
    LayerMethod,
    LayerReport,
    PairedStats,
    layer_methods,
    register_layer_method,
    relative_output_error,
    resolve_layer_method,
    uniform_rank,
)
from rankwise.compress.pipeline import (
    Calibration,
    CompressConfig,
    calibrate,
    compress,
    compress_checkpoint,
    find_blocks,
    fix_mmap_threshold,
    forward_time_ratio,
    layer_groups,
    resolve_targets,
)
from rankwise.compress.serialization import load_compressed, read_compression_metadata, save_compressed
from rankwise.compress.svd_baselines import (
    ASVD,
    FWSVD,
    SVDLLM,
    PlainSVD,
    asvd_factors,
    fwsvd_factors,
    plain_svd_factors,
    svd_llm_factors,
)
from rankwise.compress.swift_svd import (
    SwiftSVD,
    SwiftSVDConfig,
    dynamic_ranks,
    swift_svd_compress,
    swift_svd_factors,
)

__all__ = [
    "CompressConfig", "Calibration", "compress", "calibrate", "compress_checkpoint", "fix_mmap_threshold", "save_compressed",
    "load_compressed", "read_compression_metadata", "CompressionReport", "LayerReport", "LayerMethod",
    "PairedStats", "layer_methods", "register_layer_method", "resolve_layer_method", "uniform_rank",
    "relative_output_error", "find_blocks", "resolve_targets", "layer_groups", "forward_time_ratio",
    "PlainSVD", "ASVD", "FWSVD", "SVDLLM", "plain_svd_factors", "asvd_factors", "fwsvd_factors",
    "svd_llm_factors", "SwiftSVD", "SwiftSVDConfig", "swift_svd_compress", "swift_svd_factors", "dynamic_ranks",
]
