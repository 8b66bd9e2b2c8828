"""Compressing a checkpoint larger than memory: one block's weights in memory at a time.

:func:`compress_checkpoint` runs the block-sequential mode (:mod:`~rankwise.compress.blockwise`) on a
``save_pretrained`` checkpoint without loading the model: the skeleton is built with its parameters on
the ``meta`` device and each block's weights are read from the safetensors file(s) only when its turn
comes, so that peak memory is about one block, its statistics and the cached activations (plus the
largest non-block tensor group, e.g. the embedding, while the first block's inputs are computed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

import rankwise.compress.serialization as ser
from rankwise.compress.base import CompressionReport
from rankwise.compress.blockwise import BlockRunner, capture_calls, check_block_kwargs
from rankwise.compress.calibration import calibration_mode, materialize_batches
from rankwise.compress.config import as_compress_config
from rankwise.compress.progress import Ledger, param_bytes
from rankwise.compress.targets import find_blocks, resolve_targets
from rankwise.core.errors import SelectionError
from rankwise.core.select import Selector
from rankwise.core.surgery import count_parameters

Tensor = torch.Tensor

__all__ = ["compress_checkpoint", "fix_mmap_threshold"]


def fix_mmap_threshold(threshold: int = 65536) -> bool:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own ``mmap`` (process-wide).

    glibc raises its mmap threshold dynamically (up to 32 MiB) whenever a large block is freed; from
    then on, tensors of a few MiB come from the heap, and a heap with a free hole at the wrong place is
    not returned to the OS. :func:`compress_checkpoint` frees one block's weights, statistics and work
    buffers after another, which is exactly that pattern: with the threshold fixed, the freed memory
    goes back to the OS block by block and the peak RSS stays at about one block's working set
    (``benchmarks/bench_compress.py`` measures both); :func:`compress_checkpoint` calls it unless
    told not to (``fix_allocator=False``). Equivalent to ``MALLOC_MMAP_THRESHOLD_=65536`` in
    the environment. Affects the whole process and cannot be undone (glibc turns the dynamic
    adjustment off for good); a no-op returning False on a C library without ``mallopt``.
    """
    import ctypes
    import ctypes.util

    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 < threshold <= 32 * 2 ** 20:
        raise ValueError(f"threshold must be an int in (0, 32 MiB], got {threshold!r}")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def compress_checkpoint(
    model_dir: str | Path,
    config: Any,
    calib: Iterable[Any],
    out_dir: str | Path,
    *,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    blocks: str | None = None,
    model_class: type | None = None,
    overwrite: bool = False,
    progress: bool = False,
    fix_allocator: bool = True,
) -> CompressionReport:
    """Compress a ``save_pretrained`` checkpoint block by block, without loading the whole model.

    The model skeleton is built from ``model_dir``'s ``config.json`` with its parameters on the meta
    device (buffers real); the inputs of the first block are computed with only the non-block weights
    materialised; then each block's weights are read from the safetensors file(s), the block is
    calibrated, compressed, written to its own shard in ``out_dir`` and freed. Peak memory is about
    one block + its statistics + the cached activations (``report.extra["memory"]`` holds the
    explicit tensor ledger). The result is the directory format of
    :func:`~rankwise.compress.serialization.save_compressed` (sharded), loadable with
    :func:`~rankwise.compress.serialization.load_compressed`; ``out_dir`` appears only when complete.

    Gradient-based methods (FWSVD, GFWSVD) and methods with whole-model statistics cannot run this
    way (they need the whole model for a backward pass): load the model and use :func:`compress`.

    ``fix_allocator`` (default True): on glibc, :func:`fix_mmap_threshold` is called first, so that
    what each block frees (its weights, the float64 statistics, which are dropped as soon as its layers
    are fitted, and the work buffers of the decomposition) goes back to the OS block by block; without
    it glibc's heap keeps part of each freed block and the peak RSS is that of about one and a half
    blocks. The setting is process-wide and stays (glibc cannot undo it); pass False to keep the
    allocator as it is (e.g. when the process sets ``MALLOC_MMAP_THRESHOLD_`` itself).
    """
    if not isinstance(fix_allocator, bool):
        raise TypeError(f"fix_allocator must be a bool, got {type(fix_allocator).__name__}")
    if fix_allocator:
        fix_mmap_threshold()
    cfg = as_compress_config(config)
    method = cfg.build_method()
    feed = cfg.feed or method.feed
    if method.needs_grad or method.has_prepare():
        raise ValueError(f"method {method.name!r} needs a backward pass (or statistics) through the whole model; "
                         "compress_checkpoint streams one block at a time. Load the model and use compress().")
    batches = materialize_batches(calib)
    ckpt = ser.CheckpointReader(model_dir)
    model = ser.build_skeleton(ckpt.config, model_class)
    check_block_kwargs(model)
    found = find_blocks(model, blocks)
    if found is None:
        raise SelectionError(f"{model_dir}: the model has no list of transformer blocks (pass blocks=...)")
    path, blist = found
    targets = resolve_targets(model, target, blocks=blocks)
    names = [n for n, _ in targets]
    shapes = {n: (m.out_features, m.in_features) for n, m in targets}
    # Keep names, not modules: each target Linear is replaced by its factors when its block is done, and a
    # reference here would keep every replaced Linear, with the weight read into it, alive to the end.
    del targets
    report = CompressionReport(method=method.name, config=cfg.to_json())
    report.params_before = count_parameters(model)
    entries = ser.param_entries(model)
    ledger = Ledger()
    block_prefixes = [f"{path}.{i}." for i in range(len(blist))]

    def in_block(n: str) -> bool:
        return any(n.startswith(p) for p in block_prefixes)

    samples: dict[str, Tensor] = {}
    state = {"write": False}

    def materialize(l: int) -> None:
        ckpt.materialize(model, lambda n: n.startswith(block_prefixes[l]), samples)

    def release(l: int) -> None:
        if state["write"]:
            writer.write_block(l, {block_prefixes[l] + k: v for k, v in blist[l].state_dict().items()})
        ckpt.release(model, module=blist[l])

    writer = ser.ShardWriter(out_dir, n_shards=len(blist) + 1, overwrite=overwrite)
    t_start = time.perf_counter()
    with writer, calibration_mode(model):
        nonblock = ckpt.materialize(model, lambda n: not in_block(n), samples)
        ledger.set("parameters", param_bytes(model))
        t0 = time.perf_counter()
        calls = capture_calls(model, blist[0], batches, forward, mask, progress)
        report.seconds_calibration += time.perf_counter() - t0
        # the non-block weights are not needed any more: free them (the output copies them from the source)
        ckpt.release(model, nonblock)
        runner = BlockRunner(model, path, blist, calls, names, method, cfg, feed, ledger, progress,
                             materialize=materialize, release=release)
        influence = runner.compress(shapes, report, f"compressing ({method.name}, checkpoint)",
                                    before_run=lambda: state.update(write=True))
        writer.write_block(len(blist), ckpt.read_nonblock(model, lambda n: not in_block(n)))
        report.params_after = count_parameters(model)
        order = {n: i for i, n in enumerate(names)}
        report.layers.sort(key=lambda r: order[r.name])
        fingerprint = ser.fingerprint_from_samples(entries, samples)
        report.extra.update(mode="checkpoint", feed=feed, blocks=path, n_blocks=len(blist), n_batches=len(batches),
                            memory=ledger.to_json(), seconds_total=time.perf_counter() - t_start,
                            influence=influence, base_fingerprint=fingerprint)
        writer.finish(model, report, fingerprint=fingerprint, config=ckpt.config)
    return report
