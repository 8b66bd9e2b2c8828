"""Former home of the compression pipeline, kept so that ``rankwise.compress.pipeline`` imports keep working.

The pipeline now lives in small modules: :mod:`~rankwise.compress.config` (``CompressConfig``),
:mod:`~rankwise.compress.targets`, :mod:`~rankwise.compress.calibration`,
:mod:`~rankwise.compress.allocation`, :mod:`~rankwise.compress.blockwise`,
:mod:`~rankwise.compress.api` (the ``compress`` verb) and :mod:`~rankwise.compress.checkpoint`. Import
from ``rankwise.compress`` (or those modules); this module only re-exports.
"""

from rankwise.compress.allocation import allocate_ranks
from rankwise.compress.api import Mode, compress, forward_time_ratio
from rankwise.compress.calibration import Calibration, calibrate
from rankwise.compress.checkpoint import compress_checkpoint, fix_mmap_threshold
from rankwise.compress.config import CompressConfig
from rankwise.compress.targets import find_blocks, layer_groups, resolve_targets

__all__ = [
    "CompressConfig", "Calibration", "compress", "calibrate", "compress_checkpoint", "fix_mmap_threshold",
    "find_blocks", "resolve_targets", "layer_groups", "allocate_ranks", "forward_time_ratio", "Mode",
]
