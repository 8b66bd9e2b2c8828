"""The compression verb: ``compress(model, config, calib=batches)`` for every per-layer low-rank method.

``compress(model, SwiftSVDConfig(param_ratio=0.4), calib=batches)`` replaces each target ``nn.Linear``
by a :class:`~rankwise.core.layers.LowRankLinear` (two thin linears ``down`` = ``B``, ``up`` = ``A`` +
bias), in place, all or nothing (:func:`rankwise.core.surgery.transaction`: a failure puts every
replaced module back). The config's type chooses the method (a method's own config: ``SwiftSVDConfig``,
``SAESSVDConfig``, ``GFWSVDConfig``, ``PlainSVDConfig``, ``ASVDConfig``, ``FWSVDConfig``, ``SVDLLMConfig``;
or a :class:`~rankwise.compress.config.CompressConfig` naming any registered method). The method
(:mod:`rankwise.compress.base`) only turns a layer and its statistics into factors; the pipeline does
the rest:

* **targets** (:mod:`~rankwise.compress.targets`): by default the config's ``targets``, else every
  ``nn.Linear`` inside the model's transformer blocks (the largest ``nn.ModuleList`` of modules of one
  class: ``encoder.layer`` of BERT, ``model.layers`` of Llama; override with ``blocks="path.to.list"``),
  or a :mod:`rankwise.core.select` selector. A target that is not an ``nn.Linear`` (GPT-2's ``Conv1D``,
  an embedding) raises ``TypeError``;
* **statistics** (:mod:`~rankwise.compress.calibration`): the kinds the method ``needs`` plus
  ``input_cov`` (``X^T X``, which gives every layer's relative output error
  ``||X W^T - X (A B)^T||_F^2 / ||X W^T||_F^2`` on the calibration data), streamed in float64 by
  :mod:`rankwise.core.stats`, padding tokens excluded (``attention_mask``). A method that needs no
  statistics (plain SVD, GFWSVD with ``prepared=`` factors) also runs without ``calib`` (then no
  layer error is reported);
* **ranks** (:mod:`~rankwise.compress.allocation`): ``"uniform"`` (``floor(rho m n / (m + n))``),
  ``"dynamic"`` (Swift-SVD's block-influence allocation, usable with any method), ``"method"`` (the
  method's own ``rank_for``) or an explicit ``{name: rank}`` map;
* **order** (``mode``): ``"whole"``: one pass of the whole model collects every target's statistics,
  then every layer is fitted. ``"blocks"`` (:mod:`~rankwise.compress.blockwise`): block-sequential,
  one block's statistics at a time, fed from the original blocks (``feed="original"``: identical
  results to ``"whole"``) or from the compressed ones (``feed="compressed"``: SAES-SVD's closed loop,
  group by group, with paired statistics). ``"auto"`` (default): ``"blocks"`` for
  ``feed="compressed"`` methods, ``"whole"`` otherwise.

Gradient statistics (FWSVD's Fisher, GFWSVD's factors) need a backward pass through the whole model:
they are always collected in one whole-model pass (``loss_fn``), also in block mode.
:func:`~rankwise.compress.checkpoint.compress_checkpoint` runs the block mode on a checkpoint without
loading the whole model.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from torch import nn

from rankwise.compress.allocation import allocate_ranks, layer_energy
from rankwise.compress.base import CompressionReport, LayerMethod
from rankwise.compress.blockwise import BlockRunner, capture_calls, check_block_kwargs
from rankwise.compress.calibration import (
    Calibration,
    calibration_mode,
    collect_whole,
    kinds_for,
    layer_kinds_for,
    materialize_batches,
)
from rankwise.compress.config import CompressConfig, MethodConfig, as_compress_config
from rankwise.compress.fitting import Fitter
from rankwise.compress.progress import Bar, Ledger, param_bytes, stats_bytes
from rankwise.compress.targets import find_blocks, resolve_targets
from rankwise.core.errors import SelectionError
from rankwise.core.io import model_fingerprint
from rankwise.core.select import Selector
from rankwise.core.stats import default_forward
from rankwise.core.surgery import count_parameters, transaction

log = logging.getLogger(__name__)

Tensor = torch.Tensor
Mode = Literal["auto", "whole", "blocks"]

__all__ = ["compress", "forward_time_ratio", "Mode"]


def _resolve_mode(mode: str, feed: str, method: LayerMethod) -> str:
    if mode not in ("auto", "whole", "blocks"):
        raise ValueError(f"mode={mode!r} must be 'auto', 'whole' or 'blocks'")
    if mode == "auto":
        return "blocks" if feed == "compressed" else "whole"
    if mode == "whole" and feed == "compressed":
        raise ValueError(f"method {method.name!r} calibrates each layer on the already compressed model "
                         "(feed='compressed'); that needs mode='blocks' (or 'auto')")
    return mode


def _deprecated_method_name(config: Any, method: str | None) -> Any:
    """The old string form ``compress(model, method="svd-llm")`` / ``compress(model, "svd-llm")``."""
    if method is not None:
        if config is not None:
            raise ValueError("give either a config or method=, not both")
        config = method
    if isinstance(config, str):
        warnings.warn(f"compress(model, method={config!r}) is deprecated; pass a config object, e.g. "
                      "compress(model, SVDLLMConfig(...)) or compress(model, CompressConfig(method=...))",
                      DeprecationWarning, stacklevel=3)
        return CompressConfig(method=config)
    if config is None:
        raise TypeError("compress() needs a config, e.g. compress(model, SwiftSVDConfig(), calib=batches)")
    return config


def compress(
    model: nn.Module,
    config: Any = None,
    calib: Iterable[Any] | None = None,
    *,
    target: Selector = None,
    mode: Mode = "auto",
    calibration: Calibration | None = None,
    prepared: Any = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    mask: Any = "auto",
    blocks: str | None = None,
    progress: bool = False,
    method: str | None = None,
) -> CompressionReport:
    """Compress ``model``'s target linears in place with ``config``'s method; returns the report.

    Args:
        model: any ``nn.Module`` (Hugging Face ``transformers`` models first).
        config: a method's own config (:class:`~rankwise.compress.swift_svd.SwiftSVDConfig`,
            ``SAESSVDConfig``, ``GFWSVDConfig``, ``PlainSVDConfig``, ``ASVDConfig``, ``FWSVDConfig``,
            ``SVDLLMConfig``; its type chooses the method) or a :class:`CompressConfig`.
        calib: calibration batches (dicts are called as ``model(**batch)``, tuples as ``model(*batch)``,
            anything else as ``model(batch)``; or give ``forward(model, batch)``). Materialised once.
        target: :mod:`rankwise.core.select` selector; None = the config's ``targets``, else every
            ``nn.Linear`` in the blocks.
        mode: ``"whole"``, ``"blocks"`` or ``"auto"`` (see the module docstring).
        calibration: statistics from :func:`~rankwise.compress.calibration.calibrate` instead of
            ``calib`` (whole mode only).
        prepared: statistics the method would collect itself (GFWSVD's ``{layer: KroneckerFactors}``),
            computed by the caller; the method's own collection is skipped for the layers they cover.
        loss_fn: ``loss_fn(output, batch) -> scalar`` for gradient-based methods (FWSVD, GFWSVD).
        mask: token mask: ``"auto"`` (the batch's ``attention_mask``), None, a tensor or ``callable(batch)``.
        blocks: dotted path of the block list (overrides the detection).
        progress: show progress bars (on a terminal).
        method: deprecated: ``compress(model, method="svd-llm")`` is ``compress(model,
            CompressConfig(method="svd-llm"))``.

    Returns:
        :class:`~rankwise.compress.base.CompressionReport` (per-layer rank, parameters, relative output
        error on the calibration data, seconds; totals; ``extra``: mode, feed, blocks, memory ledger).

    Raises:
        TypeError: a target is not an ``nn.Linear``; ValueError: bad rank/ratio (naming the layer),
        calibration input that does not fit a layer; CalibrationError: empty data, a target never
        reached (hook never fired); NumericalError: NaN/Inf statistics (naming the layer). On any
        error the model is left unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _deprecated_method_name(config, method)  # the deprecated method= keyword ends here; below,
    # `method` is the LayerMethod instance (the name the pipeline has always used for it)
    if target is None and isinstance(config, MethodConfig):
        target = config.default_target
    cfg = as_compress_config(config)
    method = cfg.build_method()
    if prepared is not None:
        method.load_prepared(prepared)
    feed = cfg.feed or method.feed
    if method.paired and feed != "compressed":
        raise ValueError(f"method {method.name!r} reads paired statistics and needs feed='compressed'")
    mode = _resolve_mode(mode, feed, method)
    found = find_blocks(model, blocks)
    targets = resolve_targets(model, target, blocks=blocks)
    names = [n for n, _ in targets]
    shapes = {n: (m.out_features, m.in_features) for n, m in targets}
    if calibration is not None:
        if calib is not None:
            raise ValueError("give either calib= or calibration=, not both")
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration from calibrate(), got {type(calibration).__name__}")
        if mode != "whole":
            raise ValueError("a precomputed Calibration serves mode='whole' only")
        batches: list[Any] = []
    elif (calib is None and mode == "whole" and not method.needs and cfg.allocation != "dynamic"
          and method.is_prepared(names)):
        batches = []  # the method needs no statistics and has nothing left to prepare: no data, no error report
    else:
        batches = materialize_batches(calib)
    if mode == "blocks":
        if found is None:
            raise SelectionError("mode='blocks' needs the model's list of transformer blocks; none was found "
                                 "(pass blocks='path.to.ModuleList')")
        check_block_kwargs(model)
        if feed == "compressed" and (method.needs_grad or method.has_prepare()):
            raise ValueError(f"method {method.name!r} needs whole-model (gradient) statistics and cannot be fed "
                             "from the compressed model")

    report = (type(method).report_class or CompressionReport)(method=method.name, config=cfg.to_json())
    report.params_before = count_parameters(model)
    report.extra["base_fingerprint"] = model_fingerprint(model)
    ledger = Ledger()
    ledger.set("parameters", param_bytes(model))
    t_start = time.perf_counter()
    with calibration_mode(model), transaction(model):
        if method.has_prepare():
            if calibration is not None and not batches and not method.is_prepared(names):
                raise ValueError(f"method {method.name!r} collects its own statistics; pass calib= as well")
            t0 = time.perf_counter()
            method.prepare(model, batches, target=list(names), loss_fn=loss_fn, forward=forward, mask=mask)
            report.seconds_calibration += time.perf_counter() - t0
        whole_stats = mode == "whole" or method.needs_grad
        if whole_stats:
            if calibration is not None:
                cal = calibration
                need = layer_kinds_for(method, cfg)
                missing_n = [n for n in names if n not in cal.stats]
                missing_k = sorted({k for n in names if n in cal.stats for k in need(n, model.get_submodule(n))
                                    if k not in cal.stats[n].kinds})
                if missing_k or missing_n:
                    raise ValueError(f"the Calibration lacks kinds {missing_k} / layers {missing_n[:5]} that "
                                     f"method {method.name!r} needs; recollect it with calibrate(model, calib, config)")
                if cfg.allocation == "dynamic" and cal.influence is None and found is not None:
                    raise ValueError("the Calibration has no block influence; the dynamic allocation needs it")
            elif not batches:
                cal = Calibration(stats={}, kinds=())
            else:
                t0 = time.perf_counter()
                want_infl = cfg.allocation == "dynamic" and found is not None
                stats, infl = collect_whole(model, batches, names, kinds_for(method, cfg), forward=forward,
                                             loss_fn=loss_fn, mask=mask, dtype=cfg.dtype,
                                             collect_options=method.collect_options(),
                                             blocks=found[1] if want_infl else None, progress=progress,
                                             layer_kinds=layer_kinds_for(method, cfg))
                cal = Calibration(stats=stats, kinds=kinds_for(method, cfg), influence=infl,
                                  block_path=found[0] if found else None, n_batches=len(batches),
                                  seconds=time.perf_counter() - t0)
                report.seconds_calibration += cal.seconds
            ledger.set("statistics", stats_bytes({n: cal.stats[n] for n in names if n in cal.stats}))
            # memos only pay off when the caller reuses the Calibration (several ratios / methods)
            reuse = calibration is not None
            method.cache = cal.cache.setdefault(f"{method.name}:{id(method.__class__)}", {}) if reuse else None
            energy = None
            if cfg.allocation == "dynamic":
                energy = {n: layer_energy(n, model.get_submodule(n), cal.stats[n]) for n in names}
            ranks = allocate_ranks(cfg, method, shapes, influence=cal.influence, energy=energy,
                                   block_path=found[0] if found else None, n_blocks=len(found[1]) if found else 0)
            bar = Bar(progress, f"compressing ({method.name})", len(names))
            fitter = Fitter(model, method, cfg, ranks, report, bar,
                             err_cache=cal.cache.setdefault("_errors", {}) if reuse else None)
            try:
                for n in names:
                    fitter.fit(n, cal.stats.get(n))
            finally:
                bar.close()
            report.extra["influence"] = cal.influence
            report.seconds_decomposition = fitter.seconds
        else:
            assert found is not None
            path, blist = found
            t0 = time.perf_counter()
            calls = capture_calls(model, blist[0], batches, forward, mask, progress)
            report.seconds_calibration += time.perf_counter() - t0
            runner = BlockRunner(model, path, blist, calls, names, method, cfg, feed, ledger, progress)
            report.extra["influence"] = runner.compress(shapes, report, f"compressing ({method.name}, blocks)")
        order = {n: i for i, n in enumerate(names)}
        report.layers.sort(key=lambda r: order[r.name])
    report.params_after = count_parameters(model)
    report.extra.update(mode=mode, feed=feed, blocks=found[0] if found else None,
                        n_blocks=len(found[1]) if found else 0, n_batches=len(batches) or (
                            calibration.n_batches if calibration else 0),
                        memory=ledger.to_json(), seconds_total=time.perf_counter() - t_start)
    log.info("%s", report.summary())
    return report


def forward_time_ratio(original: nn.Module, compressed: nn.Module, batches: Sequence[Any], *, repeats: int = 5,
                       forward: Callable[[nn.Module, Any], Any] | None = None) -> dict[str, float]:
    """Median forward time of both models over ``batches`` (alternating, after one warm-up pass).

    Returns ``{"original_s", "compressed_s", "ratio"}`` with ``ratio = compressed / original``
    (< 1: the compressed model is faster).
    """
    import statistics

    fwd = forward or default_forward
    batches = list(batches)
    if not batches:
        raise ValueError("forward_time_ratio needs at least one batch")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")

    def once(m: nn.Module) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                fwd(m, b)
        return time.perf_counter() - t0

    with calibration_mode(original), calibration_mode(compressed):
        once(original), once(compressed)
        to, tc = [], []
        for i in range(repeats):
            for which in ((original, to), (compressed, tc)) if i % 2 == 0 else ((compressed, tc), (original, to)):
                which[1].append(once(which[0]))
    a, b = statistics.median(to), statistics.median(tc)
    return {"original_s": a, "compressed_s": b, "ratio": b / a if a > 0 else float("nan")}
