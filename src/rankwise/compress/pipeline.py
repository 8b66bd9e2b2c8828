"""The compression pipeline: one verb, :func:`compress`, for every per-layer low-rank method.

``compress(model, config, calib=batches)`` replaces each target ``nn.Linear`` by a
:class:`~rankwise.core.layers.LowRankLinear` (two thin linears ``down`` = ``B``, ``up`` = ``A`` + bias),
in place, all or nothing (:func:`rankwise.core.surgery.transaction`: a failure puts every replaced
module back). The method (:mod:`rankwise.compress.base`) only turns a layer and its statistics into
factors; the pipeline does the rest:

* **targets**: by default every ``nn.Linear`` inside the model's transformer blocks (the largest
  ``nn.ModuleList`` of modules of one class: ``encoder.layer`` of BERT, ``model.layers`` of Llama;
  override with ``blocks="path.to.list"``), or a :mod:`rankwise.core.select` selector. A target that
  is not an ``nn.Linear`` (GPT-2's ``Conv1D``, an embedding) raises ``TypeError``;
* **statistics**: the kinds the method ``needs`` plus ``input_cov`` (``X^T X``, which gives every
  layer's relative output error ``||X W^T - X (A B)^T||_F^2 / ||X W^T||_F^2`` on the calibration data),
  streamed in float64 by :mod:`rankwise.core.stats`, padding tokens excluded (``attention_mask``);
* **ranks**: ``"uniform"`` (``floor(rho m n / (m + n))``, ``rho = config.ratio`` the kept-parameter
  fraction), ``"dynamic"`` (Swift-SVD's block-influence allocation, exact per-type budgets, usable with
  any method), ``"method"`` (the method's own ``rank_for``) or an explicit ``{name: rank}`` map;
* **order** (``mode``):

  ``"whole"``: one pass of the whole model collects every target's statistics, then every layer is
  fitted. ``"blocks"``: block-sequential. The inputs of the first block are captured once per
  calibration batch (the forward stops there); then block ``l`` alone is run on the cached inputs,
  its targets' statistics are collected, its layers fitted and replaced, and its outputs feed block
  ``l + 1``: from the original block (``feed="original"``: identical results to ``"whole"``) or from
  the compressed one (``feed="compressed"``: SAES-SVD's closed loop). With ``feed="compressed"`` the
  layers of a block are compressed group by group (layers that read the same tensor form a group:
  BERT ``{query, key, value} -> attention.output.dense -> intermediate.dense -> output.dense``, Llama
  ``{q, k, v} -> o -> {gate, up} -> down``), each group's statistics collected after the previous
  group was replaced; methods with ``paired=True`` receive :class:`~rankwise.compress.base.PairedStats`
  (``H``, ``Delta``) built from two streams on the same tokens: the compressed-so-far model and the
  full-precision one. Block mode holds one block's statistics at a time plus the cached block inputs.
  ``"auto"`` (default): ``"blocks"`` for ``feed="compressed"`` methods, ``"whole"`` otherwise.

Gradient statistics (FWSVD's Fisher, GFWSVD's factors) need a backward pass through the whole model:
they are always collected in one whole-model pass (``loss_fn``), also in block mode.

:func:`compress_checkpoint` runs the block mode on a ``save_pretrained`` checkpoint without loading the
model: the skeleton is built with its parameters on the ``meta`` device and each block's weights are
read from the safetensors file(s) only when its turn comes, so that peak memory is about one block,
its statistics and the cached activations (plus the largest non-block tensor group, e.g. the embedding,
while the first block's inputs are computed).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.base import (
    CompressionReport,
    LayerMethod,
    LayerReport,
    PairedStats,
    check_ratio,
    resolve_layer_method,
    uniform_rank,
)
from rankwise.core.errors import NumericalError, SelectionError
from rankwise.core.io import model_fingerprint
from rankwise.core.layers import LowRankLinear, validate_rank
from rankwise.core.linalg import LowRankFactors
from rankwise.core.select import Selector, select
from rankwise.core.stats import KINDS, CalibrationError, LayerStats, StatsCollector, default_forward
from rankwise.core.surgery import count_parameters, replace_module, transaction

log = logging.getLogger(__name__)

Tensor = torch.Tensor
Mode = Literal["auto", "whole", "blocks"]

__all__ = [
    "CompressConfig", "Calibration", "compress", "calibrate", "compress_checkpoint", "fix_mmap_threshold",
    "find_blocks",
    "resolve_targets", "layer_groups", "allocate_ranks", "forward_time_ratio",
]

_ALLOCATIONS = ("uniform", "dynamic", "method")


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class CompressConfig:
    """What to compress with: the method, the kept-parameter fraction, the rank allocation, options.

    Attributes:
        method: a registered layer method (``"swift-svd"``, ``"svd-llm"``, ``"svd"``, ``"asvd"``,
            ``"fwsvd"``, ``"saes-svd"``, ``"gfwsvd"``; ``_`` and ``-`` are interchangeable).
        ratio: kept-parameter fraction ``rho`` of the target layers (``param_ratio``), in ``(0, 1]``.
        allocation: ``"uniform"``, ``"dynamic"``, ``"method"`` or ``{layer name: rank}`` (layers not
            listed get the uniform rank).
        alpha: exponent of the dynamic allocation score (2.5, Swift-SVD).
        base_fraction: base rank of the dynamic allocation as a fraction of the uniform rank (0.5).
        options: keyword arguments of the method's constructor (e.g. ``{"damping": 1e-5}``).
        feed: override the method's ``feed`` (``"original"`` / ``"compressed"``); None = the method's.
        dtype: accumulation dtype of the statistics (float64).
        measure_error: collect ``X^T X`` of every target to report its relative output error.
    """

    method: str = "swift-svd"
    ratio: float = 0.4
    allocation: str | Mapping[str, int] = "uniform"
    alpha: float = 2.5
    base_fraction: float = 0.5
    options: Mapping[str, Any] = field(default_factory=dict)
    feed: str | None = None
    dtype: torch.dtype = torch.float64
    measure_error: bool = True

    def __post_init__(self) -> None:
        cls = resolve_layer_method(self.method)
        object.__setattr__(self, "method", cls.name)
        check_ratio(self.ratio, "ratio")
        alloc = self.allocation
        if isinstance(alloc, str):
            if alloc not in _ALLOCATIONS:
                raise ValueError(f"allocation={alloc!r} is not supported; choose one of {list(_ALLOCATIONS)} "
                                 "or give a {layer name: rank} mapping")
        elif isinstance(alloc, Mapping):
            clean: dict[str, int] = {}
            for k, v in alloc.items():
                if not isinstance(k, str):
                    raise TypeError(f"allocation keys must be layer names (str), got {k!r}")
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"allocation[{k!r}] must be an int rank, got {v!r}")
                if v <= 0:
                    raise ValueError(f"allocation[{k!r}] = {v}: rank must be > 0 for layer {k!r}")
                clean[k] = v
            object.__setattr__(self, "allocation", clean)
        else:
            raise TypeError(f"allocation must be a string or a mapping, got {type(alloc).__name__}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"alpha={self.alpha!r} must be a finite number (2.5 in Swift-SVD)")
        if isinstance(self.base_fraction, bool) or not isinstance(self.base_fraction, (int, float)) \
                or not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction={self.base_fraction!r} must be in [0, 1]")
        if not isinstance(self.options, Mapping):
            raise TypeError(f"options must be a mapping of keyword arguments, got {type(self.options).__name__}")
        object.__setattr__(self, "options", dict(self.options))
        if self.feed not in (None, "original", "compressed"):
            raise ValueError(f"feed={self.feed!r} must be None, 'original' or 'compressed'")
        if cls.paired and self.feed == "original":
            raise ValueError(f"method {cls.name!r} reads paired statistics and needs feed='compressed'")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        if not isinstance(self.measure_error, bool):
            raise TypeError(f"measure_error must be a bool, got {self.measure_error!r}")

    @property
    def method_class(self) -> type[LayerMethod]:
        return resolve_layer_method(self.method)

    def build_method(self) -> LayerMethod:
        """An instance of the method with ``options``; bad options raise ``TypeError``/``ValueError``."""
        cls = self.method_class
        try:
            return cls(**self.options)
        except TypeError as e:
            raise TypeError(f"bad options {sorted(self.options)} for method {cls.name!r}: {e}") from None

    def to_json(self) -> dict[str, Any]:
        from rankwise.compress.base import _jsonable

        return _jsonable({"method": self.method, "ratio": self.ratio, "allocation": self.allocation,
                          "alpha": self.alpha, "base_fraction": self.base_fraction, "options": dict(self.options),
                          "feed": self.feed, "dtype": self.dtype, "measure_error": self.measure_error})


def _as_config(config: Any) -> CompressConfig:
    if isinstance(config, CompressConfig):
        return config
    conv = getattr(config, "to_compress_config", None)
    if callable(conv):
        out = conv()
        if isinstance(out, CompressConfig):
            return out
    raise TypeError(f"config must be a CompressConfig (or a method config with to_compress_config()), "
                    f"got {type(config).__name__}")


# ----------------------------------------------------------------------------------------------
# blocks, targets, groups


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's list of repeated transformer blocks as ``(path, module_list)``.

    With ``path``, that submodule (an ``nn.ModuleList`` / ``nn.Sequential`` of blocks; anything else
    raises :class:`~rankwise.core.errors.SelectionError`). Without, the ``nn.ModuleList`` whose
    children all have one class and which holds the most parameters (``encoder.layer`` of BERT,
    ``model.layers`` of Llama); None when the model has none.
    """
    if path is not None:
        if not isinstance(path, str) or not path:
            raise TypeError(f"blocks must be the dotted path of a ModuleList, got {path!r}")
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise SelectionError(f"blocks={path!r}: the model has no submodule of that name") from None
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0:
            raise SelectionError(f"blocks={path!r} is a {type(mod).__name__}, not a non-empty ModuleList of blocks")
        return path, mod  # type: ignore[return-value]
    best: tuple[int, int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(c) for c in mod}
        if len(kinds) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size == 0:
            continue
        key = (size, -name.count("."))
        if best is None or key > best[:2]:
            best = (size, -name.count("."), name, mod)
    return None if best is None else (best[2], best[3])


def _block_of(name: str, path: str, n_blocks: int) -> int | None:
    prefix = path + "." if path else ""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() and int(head) < n_blocks else None


def _inside_lowrank(model: nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0]
    while True:
        if isinstance(model.get_submodule(parent) if parent else model, LowRankLinear):
            return True
        if not parent:
            return False
        parent = parent.rpartition(".")[0]


def resolve_targets(model: nn.Module, target: Selector = None, *, blocks: str | None = None
                    ) -> list[tuple[str, nn.Linear]]:
    """The ``(name, nn.Linear)`` pairs to compress, in model order.

    ``target=None``: every ``nn.Linear`` inside the transformer blocks (:func:`find_blocks`). Otherwise a
    :mod:`rankwise.core.select` selector; a selected module that is a linear map of another type
    (GPT-2's ``Conv1D``, ``nn.Embedding``, anything with a 2-D ``weight`` that is not an ``nn.Linear``)
    raises ``TypeError``; containers and norms a pattern happens to match are skipped. The factors of
    an already compressed layer (``*.down`` / ``*.up`` of a ``LowRankLinear``) are never targets.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if target is None:
        found = find_blocks(model, blocks)
        if found is None:
            raise SelectionError("the model has no list of repeated blocks (nn.ModuleList) to take the default "
                                 "targets from; pass target=... (e.g. nn.Linear or a name pattern)")
        path, _ = found
        hits = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(path + ".")]
    else:
        if isinstance(target, type) or (isinstance(target, tuple) and target and all(isinstance(t, type) for t in target)):
            types = target if isinstance(target, tuple) else (target,)
            bad = [t.__name__ for t in types if not issubclass(t, nn.Linear)]
            if bad:
                raise TypeError(f"target types {bad} are not nn.Linear; rankwise compresses nn.Linear layers only "
                                "(for GPT-2's Conv1D, convert it to nn.Linear first: weight.T)")
        hits = select(model, target)
        wrong = [(n, type(m).__name__) for n, m in hits if not isinstance(m, nn.Linear)
                 and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.ndim >= 2]
        if wrong:
            raise TypeError(f"target {target!r} selects modules that are not nn.Linear: {wrong[:5]}; rankwise "
                            "compresses nn.Linear layers only (GPT-2's Conv1D stores the transposed weight: "
                            "convert it to nn.Linear first)")
        hits = [(n, m) for n, m in hits if isinstance(m, nn.Linear)]
    hits = [(n, m) for n, m in hits if not _inside_lowrank(model, n)]
    if not hits:
        raise SelectionError(f"target {target!r} selects no nn.Linear layer to compress")
    return hits  # type: ignore[return-value]


class _Stop(Exception):
    """Raised by a hook to end a forward pass early (nothing after that point is needed)."""


def _first_tensor_arg(args: tuple, kwargs: dict) -> tuple[Tensor | None, int | str | None]:
    if args and isinstance(args[0], torch.Tensor):
        return args[0], 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], "hidden_states"
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return a, i
    return None, None


def _out_tensor(out: Any) -> Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    hs = getattr(out, "last_hidden_state", None)
    if isinstance(hs, torch.Tensor):
        return hs
    raise TypeError(f"a block returned {type(out).__name__}; expected a tensor or a tuple starting with one")


def layer_groups(block: nn.Module, names: Sequence[str], run: Callable[[], Any]) -> list[list[str]]:
    """Group the layers ``names`` (relative to ``block``) by the tensor they read, in call order.

    ``run()`` runs ``block`` once (e.g. on one calibration batch). Layers called with the same input
    tensor (same storage, shape and strides) form one group: BERT ``[[query, key, value],
    [attention.output.dense], [intermediate.dense], [output.dense]]``, Llama ``[[q, k, v], [o],
    [gate, up], [down]]``. Raises :class:`~rankwise.core.stats.CalibrationError` naming layers that
    ``run`` never called.
    """
    seen: list[tuple[str, tuple]] = []
    handles = []
    # the inputs stay referenced until the grouping is done: a freed input's address can be handed to the
    # next layer's (different) input tensor, which would then look like the same tensor
    alive: list[torch.Tensor] = []

    def hook(name: str) -> Callable:
        def pre(mod: nn.Module, args: tuple) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is not None and all(n != name for n, _ in seen):
                alive.append(x)
                seen.append((name, (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape),
                                    tuple(x.stride()))))
        return pre

    try:
        for n in names:
            handles.append(block.get_submodule(n).register_forward_pre_hook(hook(n)))
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    alive.clear()
    missing = [n for n in names if all(n != s for s, _ in seen)]
    if missing:
        raise CalibrationError(f"the calibration batch never reached layer(s) {missing} (the hook never fired); "
                               "they cannot be calibrated")
    groups: list[list[str]] = []
    last_key = None
    for n, key in seen:
        if groups and key == last_key:
            groups[-1].append(n)
        else:
            groups.append([n])
        last_key = key
    return groups


# ----------------------------------------------------------------------------------------------
# calibration helpers


def _materialize_batches(calib: Any) -> list[Any]:
    if calib is None:
        raise CalibrationError("calibration data is required: pass calib=<iterable of batches>")
    if isinstance(calib, (str, bytes)):
        raise TypeError("calib must be an iterable of batches (dicts of tensors, tuples or tensors), not a string")
    if isinstance(calib, torch.Tensor):
        raise TypeError("calib must be an iterable of batches; wrap a single tensor batch in a list: calib=[x]")
    try:
        batches = list(calib)
    except TypeError:
        raise TypeError(f"calib must be an iterable of batches, got {type(calib).__name__}") from None
    if not batches:
        raise CalibrationError("the calibration data is empty: `calib` yielded no batch")
    return batches


def _resolve_mask(batch: Any, mask: Any) -> Tensor | None:
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "auto":
            raise ValueError(f"mask must be 'auto', None, a tensor or a callable, got {mask!r}")
        if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
            return batch["attention_mask"]
        return None
    if isinstance(mask, torch.Tensor):
        return mask
    if callable(mask):
        return mask(batch)
    raise TypeError(f"mask must be 'auto', None, a tensor or a callable, got {type(mask).__name__}")


@contextlib.contextmanager
def _calibration_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode and ``config.use_cache = False`` (no KV cache during calibration), restored after."""
    flags = {m: m.training for m in model.modules()}
    configs = []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "use_cache") and all(cfg is not c for c, _ in configs):
            configs.append((cfg, cfg.use_cache))
    model.eval()
    for cfg, _ in configs:
        cfg.use_cache = False
    try:
        yield
    finally:
        for m, f in flags.items():
            m.training = f
        for cfg, v in configs:
            cfg.use_cache = v


def _input_dim_hooks(model: nn.Module, names: Iterable[str]) -> list[Any]:
    """Pre-hooks that raise ``ValueError`` naming the layer when an input's last dim != in_features."""
    handles = []
    for n in names:
        mod = model.get_submodule(n)
        want = mod.in_features

        def pre(m: nn.Module, args: tuple, _n: str = n, _want: int = want) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.shape[-1] != _want:
                raise ValueError(f"layer {_n!r}: calibration input last dim {x.shape[-1]} != in_features {_want} "
                                 "(do the calibration batches belong to this model?)")
        handles.append(mod.register_forward_pre_hook(pre))
    return handles


def _kinds_for(method: LayerMethod, cfg: CompressConfig) -> tuple[str, ...]:
    kinds = list(method.needs)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"method {method.name!r} needs unknown statistics kinds {bad}")
    if cfg.measure_error or (cfg.allocation == "dynamic" and "output_cov" not in kinds):
        kinds.append("input_cov")
    return tuple(dict.fromkeys(kinds))


@dataclass
class Calibration:
    """Whole-model calibration statistics, re-usable for several ``compress`` calls (ratios, allocations).

    ``stats``: ``{layer: LayerStats}``; ``kinds``: what was collected; ``influence``: raw block influence
    ``I_l`` per block (None when not collected); ``block_path``: the block list it refers to;
    ``cache``: per-method memo of statistics-only work (eigendecompositions, Cholesky factors).
    """

    stats: dict[str, LayerStats]
    kinds: tuple[str, ...]
    influence: list[float] | None = None
    block_path: str | None = None
    n_batches: int = 0
    seconds: float = 0.0
    cache: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return max((s.n_tokens for s in self.stats.values()), default=0)


class _InfluenceHooks:
    """Forward hooks on every block accumulating ``sum (1 - cos(h_in, h_out))`` and token counts."""

    def __init__(self, blocks: nn.ModuleList):
        self.sums = [0.0] * len(blocks)
        self.counts = [0] * len(blocks)
        self.mask: Tensor | None = None
        self.handles = [b.register_forward_hook(self._hook(i), with_kwargs=True) for i, b in enumerate(blocks)]

    def _hook(self, i: int) -> Callable:
        from rankwise.compress.swift_svd import block_influence

        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            h_in, _ = _first_tensor_arg(args, kwargs)
            if h_in is None:
                return
            s, c = block_influence(h_in, _out_tensor(out), self.mask)
            self.sums[i] += s
            self.counts[i] += c
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def values(self) -> list[float]:
        if any(c == 0 for c in self.counts):
            raise CalibrationError("no calibration token reached some transformer blocks; cannot compute the "
                                   "block influence")
        return [s / c for s, c in zip(self.sums, self.counts)]


def _collect_whole(
    model: nn.Module,
    batches: Sequence[Any],
    names: Sequence[str],
    kinds: Sequence[str],
    *,
    forward: Callable | None,
    loss_fn: Callable | None,
    mask: Any,
    dtype: torch.dtype,
    collect_options: Mapping[str, Any],
    blocks: nn.ModuleList | None,
    progress: bool,
) -> tuple[dict[str, LayerStats], list[float] | None]:
    nameset = set(names)
    col = StatsCollector(model, target=lambda n, m: n in nameset, kinds=kinds, types=(nn.Linear,), dtype=dtype,
                         **dict(collect_options))
    infl = None
    handles = _input_dim_hooks(model, names)
    try:
        if blocks is not None:
            infl = _InfluenceHooks(blocks)
        with col:
            for batch in _track(batches, "calibrating", progress):
                m = _resolve_mask(batch, mask)
                if infl is not None:
                    infl.mask = m
                col.run(batch, forward=forward, loss_fn=loss_fn, mask=m)
        stats = col.results()
    finally:
        for h in handles:
            h.remove()
        if infl is not None:
            infl.remove()
    return stats, (infl.values() if infl is not None else None)


def calibrate(
    model: nn.Module,
    calib: Iterable[Any],
    config: Any,
    *,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    mask: Any = "auto",
    blocks: str | None = None,
    influence: bool | None = None,
    extra_kinds: Sequence[str] = (),
    progress: bool = False,
) -> Calibration:
    """Collect, in one whole-model pass, the statistics ``config``'s method needs for every target.

    The result can be passed to :func:`compress` (``calibration=``) several times: with other ratios,
    allocations, or (when ``extra_kinds`` adds their kinds) other methods of the same feed. The block
    influence of every block is collected when ``influence`` is True (default: when the model has
    blocks). Raises :class:`~rankwise.core.stats.CalibrationError` for empty data or a target that no
    calibration token reached.
    """
    cfg = _as_config(config)
    method = cfg.build_method()
    if method.feed == "compressed" or cfg.feed == "compressed":
        raise ValueError(f"method {method.name!r} collects its statistics block by block on the compressed model "
                         "(feed='compressed'); a whole-model Calibration cannot serve it")
    batches = _materialize_batches(calib)
    found = find_blocks(model, blocks)
    targets = resolve_targets(model, target, blocks=blocks)
    kinds = tuple(dict.fromkeys((*_kinds_for(method, cfg), *extra_kinds)))
    want_infl = found is not None if influence is None else bool(influence)
    if want_infl and found is None:
        raise SelectionError("block influence needs the model's transformer blocks; none found (pass blocks=...)")
    t0 = time.perf_counter()
    with _calibration_mode(model):
        stats, infl = _collect_whole(model, batches, [n for n, _ in targets], kinds, forward=forward,
                                     loss_fn=loss_fn, mask=mask, dtype=cfg.dtype,
                                     collect_options=method.collect_options(),
                                     blocks=found[1] if want_infl and found else None, progress=progress)
    return Calibration(stats=stats, kinds=kinds, influence=infl, block_path=found[0] if found else None,
                       n_batches=len(batches), seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# ranks


def _energy(name: str, layer: nn.Linear, st: LayerStats) -> float:
    """``||Y||_F^2`` of the layer on the calibration data (bias excluded): ``tr C`` or ``tr(W H W^T)``."""
    if st.yty is not None and not st.output_bias:
        return float(torch.diagonal(st.yty).sum())
    if st.xtx is not None:
        W = layer.weight.detach().to(torch.float64)
        return float(((W @ st.xtx.to(W.device, torch.float64)) * W).sum())
    raise CalibrationError(f"layer {name!r}: the dynamic allocation needs its output or input covariance")


def _layer_type(name: str, path: str | None, n_blocks: int) -> tuple[str, int | None]:
    if path is not None:
        b = _block_of(name, path, n_blocks)
        if b is not None:
            return name[len(path) + 1 + len(str(b)) + 1:], b
    return name, None


def allocate_ranks(
    cfg: CompressConfig,
    method: LayerMethod,
    shapes: Mapping[str, tuple[int, int]],
    *,
    influence: Sequence[float] | None = None,
    energy: Mapping[str, float] | None = None,
    block_path: str | None = None,
    n_blocks: int = 0,
) -> dict[str, int]:
    """Ranks of the targets (``shapes = {name: (m, n)}``) under ``cfg.allocation``; each checked to be in ``[1, min(m, n)]``."""
    alloc = cfg.allocation
    ranks: dict[str, int] = {}
    if isinstance(alloc, Mapping):
        unknown = [n for n in alloc if n not in shapes]
        if unknown:
            raise ValueError(f"allocation names layers that are not targets: {unknown[:5]}")
        for n, (m, k) in shapes.items():
            ranks[n] = alloc.get(n, uniform_rank(m, k, cfg.ratio))
    elif alloc == "uniform":
        ranks = {n: uniform_rank(m, k, cfg.ratio) for n, (m, k) in shapes.items()}
    elif alloc == "method":
        for n, (m, k) in shapes.items():
            r = method.rank_for(m, k)
            if r is None:
                raise ValueError(f"allocation='method': method {method.name!r} has no rank rule of its own")
            ranks[n] = r
    else:  # dynamic
        from rankwise.compress.swift_svd import dynamic_ranks, normalize_influence

        if energy is None:
            raise CalibrationError("the dynamic allocation needs every target's output energy")
        tilde = normalize_influence(influence) if influence else []
        types, importance = {}, {}
        for n in shapes:
            t, b = _layer_type(n, block_path, n_blocks)
            types[n] = t
            importance[n] = tilde[b] if (b is not None and tilde) else 1.0
        eps = {n: math.sqrt(max(energy[n], 0.0)) for n in shapes}
        ranks = dynamic_ranks(shapes, types, importance, eps, cfg.ratio, alpha=cfg.alpha,
                              base_fraction=cfg.base_fraction)
    for n, r in ranks.items():
        m, k = shapes[n]
        validate_rank(r, k, m, n)
    return ranks


# ----------------------------------------------------------------------------------------------
# fitting


class _Ledger:
    """Explicit tensor-memory accounting of a run (bytes held by parameters, statistics, activations)."""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.peak = 0
        self.peak_at: dict[str, int] = {}

    def set(self, key: str, nbytes: int) -> None:
        self.current[key] = int(nbytes)
        total = sum(self.current.values())
        if total > self.peak:
            self.peak = total
            self.peak_at = dict(self.current)

    def to_json(self) -> dict[str, Any]:
        return {"peak_tensor_bytes": self.peak, "at_peak": self.peak_at}


def _tensor_bytes(ts: Iterable[Any]) -> int:
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            if not t.is_meta:
                total += t.numel() * t.element_size()
        elif isinstance(t, (list, tuple)):
            total += _tensor_bytes(t)
        elif isinstance(t, dict):
            total += _tensor_bytes(t.values())
    return total


def _stats_bytes(stats: Mapping[str, LayerStats]) -> int:
    return sum(_tensor_bytes(s.tensors().values()) for s in stats.values())


def _param_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _check_factors(name: str, f: Any, m: int, n: int, rank: int) -> tuple[Tensor, Tensor]:
    if isinstance(f, LowRankFactors) or (isinstance(f, tuple) and len(f) == 2):
        B, A = f
    else:
        raise TypeError(f"layer {name!r}: the method returned {type(f).__name__}, expected LowRankFactors (B, A)")
    if tuple(B.shape) != (rank, n) or tuple(A.shape) != (m, rank):
        raise ValueError(f"layer {name!r}: factors B {tuple(B.shape)} / A {tuple(A.shape)} do not have the shapes "
                         f"({rank}, {n}) / ({m}, {rank})")
    for what, t in (("B", B), ("A", A)):
        if not bool(torch.isfinite(t).all()):
            raise NumericalError(f"layer {name!r}: factor {what} has NaN/Inf values")
    return B, A


def _cached_error(cache: dict[str, Any] | None, name: str, W: Tensor, B: Tensor, A: Tensor, H: Tensor) -> float:
    """:func:`~rankwise.compress.base.relative_output_error` with ``W H`` memoised per layer (float64).

    ``tr(E H E^T) = tr(W H W^T) - 2 <A B, W H> + tr((A^T A)(B H B^T))`` costs ``O(r n^2)`` once ``W H``
    (``O(m n^2)``) is known; the memo (kept with a :class:`Calibration`) is reused by every method fitted
    from the same statistics; it is keyed by the statistics object and a checksum of the weight.
    """
    W64 = W.detach().to(torch.float64)
    H64 = H.detach().to(W64.device, torch.float64)
    hit = cache.get(name) if cache is not None else None
    key = (tuple(W64.shape), float(W64.sum()), float(W64.square().sum()), float(W64[..., ::7].abs().sum()))
    if hit is not None and hit[0] == key and hit[3] is H:
        WH, den = hit[1], hit[2]
    else:
        WH = W64 @ H64
        den = float((WH * W64).sum())
        if cache is not None:
            cache[name] = (key, WH, den, H)
    A64 = A.detach().to(W64.device, torch.float64)
    B64 = B.detach().to(W64.device, torch.float64)
    cross = float(((A64 @ B64) * WH).sum())
    quad = float(((A64.mT @ A64) * (B64 @ H64 @ B64.mT)).sum())
    num = max(den - 2.0 * cross + quad, 0.0)
    if den <= 0.0:
        return 0.0 if num <= 0.0 else float("inf")
    return num / den


class _Fitter:
    """Fits and swaps layers, filling the report (shared by the whole, block and checkpoint modes)."""

    def __init__(self, model: nn.Module, method: LayerMethod, cfg: CompressConfig, ranks: Mapping[str, int],
                 report: CompressionReport, progress: Any = None, err_cache: dict[str, Any] | None = None):
        self.err_cache = err_cache
        self.model = model
        self.method = method
        self.cfg = cfg
        self.ranks = ranks
        self.report = report
        self.progress = progress
        self.seconds = 0.0

    def fit(self, name: str, stats: LayerStats | None, paired: PairedStats | None = None) -> None:
        layer = self.model.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, not an nn.Linear")
        m, n = layer.weight.shape
        rank = self.ranks[name]
        t0 = time.perf_counter()
        f = self.method.fit(name, layer, rank, stats=stats, paired=paired)
        B, A = _check_factors(name, f, m, n, rank)
        new = LowRankLinear.from_linear(layer, factors=(B, A))
        secs = time.perf_counter() - t0
        self.seconds += secs
        err = None
        if self.cfg.measure_error:
            H = stats.xtx if (stats is not None and stats.xtx is not None) else (paired.H if paired is not None else None)
            if H is not None:
                err = _cached_error(self.err_cache, name, layer.weight, new.down.weight, new.up.weight, H)
        bias = layer.bias is not None
        replace_module(self.model, name, new)
        self.report.layers.append(LayerReport(
            name=name, shape=(m, n), rank=rank, params_before=m * n + (m if bias else 0),
            params_after=new.num_parameters, rel_error=err, seconds=secs, info=dict(self.method.info())))
        if self.progress is not None:
            self.progress.advance()


# ----------------------------------------------------------------------------------------------
# progress


class _Bar:
    """A rich progress bar on stderr (only when enabled and stderr is a terminal)."""

    def __init__(self, enabled: bool, description: str, total: int):
        self._p = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._p.start()
            self._task = self._p.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=text)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def _track(items: Sequence[Any], description: str, enabled: bool) -> Iterator[Any]:
    bar = _Bar(enabled, description, len(items))
    try:
        for x in items:
            yield x
            bar.advance()
    finally:
        bar.close()


# ----------------------------------------------------------------------------------------------
# block streams


@dataclass
class _Call:
    """One calibration batch at the entry of the blocks: the hidden states and the rest of the call."""

    hidden: Tensor
    args: tuple
    kwargs: dict
    where: int | str
    mask: Tensor | None

    def run(self, block: nn.Module, hidden: Tensor) -> Tensor:
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(self.where, int):
            args.insert(self.where, hidden)
        else:
            kwargs[self.where] = hidden
        return _out_tensor(block(*args, **kwargs))


def _is_cache(v: Any) -> bool:
    return any(c.__module__.startswith("transformers.cache_utils") for c in type(v).__mro__)


def _sanitize(v: Any) -> Any:
    if _is_cache(v):
        return None
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(_sanitize(x) for x in v)
    if isinstance(v, list):
        return [_sanitize(x) for x in v]
    return v


def _capture_calls(model: nn.Module, block0: nn.Module, batches: Sequence[Any], forward: Callable | None,
                   mask: Any, progress: bool) -> list[_Call]:
    """Run each batch up to the first block and keep what enters it (the forward stops there)."""
    fwd = forward or default_forward
    calls: list[_Call] = []
    box: dict[str, Any] = {}

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        box["args"], box["kwargs"] = args, kwargs
        raise _Stop

    h = block0.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for batch in _track(batches, "capturing block inputs", progress):
            box.clear()
            with torch.no_grad():
                try:
                    fwd(model, batch)
                except _Stop:
                    pass
            if "args" not in box:
                raise CalibrationError("a calibration batch never reached the first transformer block")
            args, kwargs = box["args"], dict(box["kwargs"])
            hidden, where = _first_tensor_arg(args, kwargs)
            if hidden is None:
                raise CalibrationError("the first transformer block was called without a hidden-state tensor")
            if isinstance(where, int):
                rest_args = tuple(_sanitize(a) for i, a in enumerate(args) if i != where)
            else:
                rest_args = tuple(_sanitize(a) for a in args)
                kwargs.pop(where)
            kw = {}
            for k, v in kwargs.items():
                if k in ("past_key_value", "past_key_values", "cache", "layer_past"):
                    v = None
                elif k == "use_cache":
                    v = False
                kw[k] = _sanitize(v)
            m = _resolve_mask(batch, mask)
            calls.append(_Call(hidden.detach(), rest_args, kw, where, None if m is None else m.detach()))
    finally:
        h.remove()
    return calls


def _check_block_kwargs(model: nn.Module) -> None:
    cfg = getattr(model, "config", None)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(set(types)) > 1:
        raise ValueError(f"this model's blocks take per-layer arguments (layer_types={sorted(set(types))}); the "
                         "block-sequential mode replays the first block's arguments for every block and cannot "
                         "run it; use mode='whole'")


class _PairedCapture:
    """Hooks that keep the inputs of some layers during one forward, in call order."""

    def __init__(self, block: nn.Module, names: Sequence[str], stop_after: str | None = None):
        self.inputs: dict[str, list[Tensor]] = {n: [] for n in names}
        self.handles = []
        for n in names:
            mod = block.get_submodule(n)
            self.handles.append(mod.register_forward_pre_hook(self._pre(n)))
            if n == stop_after:
                self.handles.append(mod.register_forward_hook(self._stop))

    def _pre(self, n: str) -> Callable:
        def pre(mod: nn.Module, args: tuple) -> None:
            self.inputs[n].append(args[0].detach())
        return pre

    @staticmethod
    def _stop(mod: nn.Module, args: tuple, out: Any) -> None:
        raise _Stop

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _accumulate_paired(acc: dict[str, list], name: str, xs: list[Tensor], xfs: list[Tensor], mask: Tensor | None,
                       dtype: torch.dtype) -> None:
    if len(xs) != len(xfs):
        raise CalibrationError(f"layer {name!r} was called {len(xs)} time(s) in the compressed model but {len(xfs)} "
                               "in the full-precision one on the same batch")
    for x, xf in zip(xs, xfs):
        if x.shape != xf.shape:
            raise CalibrationError(f"layer {name!r}: inputs of the compressed ({tuple(x.shape)}) and full-precision "
                                   f"({tuple(xf.shape)}) streams differ in shape; both passes must use identical "
                                   "batches and attention masks")
        n = x.shape[-1]
        X = x.reshape(-1, n)
        Xf = xf.reshape(-1, n)
        if mask is not None and mask.numel() == X.shape[0]:
            keep = mask.reshape(-1).to(X.device) != 0
            X, Xf = X[keep], Xf[keep]
        X, Xf = X.to(dtype), Xf.to(dtype)
        if not (bool(torch.isfinite(X).all()) and bool(torch.isfinite(Xf).all())):
            raise NumericalError(f"layer {name!r}: non-finite values (NaN/Inf) in its calibration inputs")
        H, D, c = acc.setdefault(name, [torch.zeros(n, n, dtype=dtype, device=X.device),
                                        torch.zeros(n, n, dtype=dtype, device=X.device), 0])
        H.add_(X.mT @ X)
        D.add_((Xf - X).mT @ X)
        acc[name][2] = c + X.shape[0]


class _BlockRunner:
    """Block-sequential calibration and compression over cached block inputs.

    ``materialize(l)`` / ``release(l)`` are called around block ``l`` (checkpoint mode loads and frees
    the block's weights there; in-memory mode does nothing).
    """

    def __init__(self, model: nn.Module, path: str, blocks: nn.ModuleList, calls: list[_Call],
                 targets: Sequence[str], method: LayerMethod, cfg: CompressConfig, feed: str,
                 ledger: _Ledger, progress: bool,
                 materialize: Callable[[int], None] | None = None, release: Callable[[int], None] | None = None,
                 param_bytes: Callable[[], int] | None = None):
        self.model, self.path, self.blocks, self.calls = model, path, blocks, calls
        self.method, self.cfg, self.feed, self.ledger = method, cfg, feed, ledger
        self.progress = progress
        self.materialize = materialize or (lambda l: None)
        self.release = release or (lambda l: None)
        self.param_bytes = param_bytes or (lambda: _param_bytes(model))
        self.by_block: dict[int, list[str]] = {}
        for n in targets:
            b = _block_of(n, path, len(blocks))
            if b is None:
                raise ValueError(f"target {n!r} is outside the transformer blocks {path!r}; the block-sequential "
                                 "mode compresses layers inside the blocks only (use mode='whole')")
            self.by_block.setdefault(b, []).append(n)
        self.kinds = _kinds_for(method, cfg)
        self.prefix = lambda l: f"{path}.{l}."

    def _rel(self, l: int, names: Sequence[str]) -> list[str]:
        p = self.prefix(l)
        return [n[len(p):] for n in names]

    def _collector(self, block: nn.Module, rel: Sequence[str]) -> StatsCollector:
        relset = set(rel)
        return StatsCollector(block, target=lambda n, m: n in relset, kinds=self.kinds, types=(nn.Linear,),
                              dtype=self.cfg.dtype, **dict(self.method.collect_options()))

    def _stats_full(self, l: int, stats: Mapping[str, LayerStats]) -> dict[str, LayerStats]:
        p = self.prefix(l)
        out = {}
        for rel, st in stats.items():
            st.name = p + rel
            out[p + rel] = st
        return out

    def _track_acts(self, streams: Sequence[Sequence[Tensor]]) -> None:
        self.ledger.set("activations", sum(_tensor_bytes(s) for s in streams)
                        + _tensor_bytes([(c.args, c.kwargs) for c in self.calls]))

    # -- pre-pass of the dynamic allocation -----------------------------------------------------

    def energies_and_influence(self) -> tuple[dict[str, float], list[float]]:
        """Stream the original model once: every target's output energy and every block's influence."""
        from rankwise.compress.swift_svd import block_influence

        hs = [c.hidden for c in self.calls]
        energy: dict[str, float] = {}
        influence: list[float] = []
        bar = _Bar(self.progress, "allocation pre-pass", len(self.blocks))
        try:
            for l, block in enumerate(self.blocks):
                self.materialize(l)
                self.ledger.set("parameters", self.param_bytes())
                names = self.by_block.get(l, [])
                col = self._collector(block, self._rel(l, names)) if names else None
                outs, s_sum, c_sum = [], 0.0, 0
                handles = _input_dim_hooks(block, self._rel(l, names))
                try:
                    with contextlib.ExitStack() as stack:
                        if col is not None:
                            stack.enter_context(col)
                        for call, h in zip(self.calls, hs):
                            with torch.no_grad(), (col.token_mask(call.mask) if col else contextlib.nullcontext()):
                                out = call.run(block, h)
                            s, c = block_influence(h, out, call.mask)
                            s_sum, c_sum = s_sum + s, c_sum + c
                            outs.append(out.detach())
                finally:
                    for hd in handles:
                        hd.remove()
                if c_sum == 0:
                    raise CalibrationError(f"no calibration token reached block {l}")
                influence.append(s_sum / c_sum)
                if col is not None:
                    stats = self._stats_full(l, col.results())
                    self.ledger.set("statistics", _stats_bytes(stats))
                    for n, st in stats.items():
                        energy[n] = _energy(n, self.model.get_submodule(n), st)
                    del stats
                    self.ledger.set("statistics", 0)
                hs = outs
                self._track_acts([hs])
                self.release(l)
                bar.advance()
        finally:
            bar.close()
        return energy, influence

    # -- main pass --------------------------------------------------------------------------------

    def run(self, fitter: _Fitter) -> float:
        """Calibrate and compress block by block; returns the calibration seconds (forward passes)."""
        paired = self.method.paired
        hc = [c.hidden for c in self.calls]
        hf = list(hc) if paired else None
        calib_s = 0.0
        for l, block in enumerate(self.blocks):
            self.materialize(l)
            self.ledger.set("parameters", self.param_bytes())
            names = self.by_block.get(l, [])
            rel = self._rel(l, names)
            t0 = time.perf_counter()
            if self.feed == "original":
                outs = []
                if names:
                    col = self._collector(block, rel)
                    handles = _input_dim_hooks(block, rel)
                    try:
                        with col:
                            for call, h in zip(self.calls, hc):
                                with torch.no_grad(), col.token_mask(call.mask):
                                    outs.append(call.run(block, h).detach())
                    finally:
                        for hd in handles:
                            hd.remove()
                    stats = self._stats_full(l, col.results())
                    self.ledger.set("statistics", _stats_bytes(stats))
                    calib_s += time.perf_counter() - t0
                    for n in names:
                        fitter.fit(n, stats[n])
                    del stats, col
                    self.ledger.set("statistics", 0)
                else:
                    with torch.no_grad():
                        outs = [call.run(block, h).detach() for call, h in zip(self.calls, hc)]
                    calib_s += time.perf_counter() - t0
                hc = outs
                self._track_acts([hc])
            else:
                fp = copy.deepcopy(block) if paired else None
                if fp is not None:
                    self.ledger.set("fp_block", _param_bytes(fp))
                if names:
                    groups = layer_groups(block, rel, lambda: self.calls[0].run(block, hc[0]))
                    for g in groups:
                        t1 = time.perf_counter()
                        stats, pstats = self._group_stats(block, fp, g, hc, hf)
                        calib_s += time.perf_counter() - t1
                        p = self.prefix(l)
                        for r in g:
                            fitter.fit(p + r, stats[p + r], pstats.get(p + r) if pstats else None)
                        self.ledger.set("statistics", 0)
                t1 = time.perf_counter()
                with torch.no_grad():
                    hc = [call.run(block, h).detach() for call, h in zip(self.calls, hc)]
                    if fp is not None and hf is not None:
                        hf = [call.run(fp, h).detach() for call, h in zip(self.calls, hf)]
                calib_s += time.perf_counter() - t1
                del fp
                self.ledger.set("fp_block", 0)
                self._track_acts([hc] + ([hf] if hf is not None else []))
            self.release(l)
        return calib_s

    def _group_stats(self, block: nn.Module, fp: nn.Module | None, group: Sequence[str], hc: Sequence[Tensor],
                     hf: Sequence[Tensor] | None) -> tuple[dict[str, LayerStats], dict[str, PairedStats] | None]:
        """Statistics of one group on the compressed stream (and the paired statistics against the FP stream)."""
        l = self.blocks_index(block)
        col = self._collector(block, group)
        handles = _input_dim_hooks(block, group)
        last = group[-1]
        acc: dict[str, list] = {}
        cap = None
        stopper = None
        try:
            # the collector's hooks first: the hook that stops the forward after the group's last layer
            # must run after the collector has seen that layer
            with col:
                if fp is not None:
                    cap = _PairedCapture(block, group, stop_after=last)
                else:
                    stopper = block.get_submodule(last).register_forward_hook(_PairedCapture._stop)
                for i, call in enumerate(self.calls):
                    xfs: dict[str, list[Tensor]] = {}
                    if fp is not None and hf is not None:
                        cap_f = _PairedCapture(fp, group, stop_after=last)
                        try:
                            with torch.no_grad():
                                try:
                                    call.run(fp, hf[i])
                                except _Stop:
                                    pass
                        finally:
                            cap_f.remove()
                        xfs = cap_f.inputs
                    if cap is not None:
                        for v in cap.inputs.values():
                            v.clear()
                    with torch.no_grad(), col.token_mask(call.mask):
                        try:
                            call.run(block, hc[i])
                        except _Stop:
                            pass
                    if cap is not None:
                        for n in group:
                            _accumulate_paired(acc, n, cap.inputs[n], xfs[n], call.mask, self.cfg.dtype)
        finally:
            for hd in handles:
                hd.remove()
            if cap is not None:
                cap.remove()
            if stopper is not None:
                stopper.remove()
        stats = self._stats_full(l, col.results())
        paired = None
        if fp is not None:
            p = self.prefix(l)
            paired = {}
            for n in group:
                H, D, c = acc[n]
                if not (bool(torch.isfinite(H).all()) and bool(torch.isfinite(D).all())):
                    raise NumericalError(f"layer {p + n!r}: paired statistics are not finite")
                paired[p + n] = PairedStats(H=H, Delta=D, tokens=int(c))
        self.ledger.set("statistics", _stats_bytes(stats) + _tensor_bytes(
            [(ps.H, ps.Delta) for ps in (paired or {}).values()]))
        return stats, paired

    def blocks_index(self, block: nn.Module) -> int:
        for i, b in enumerate(self.blocks):
            if b is block:
                return i
        raise RuntimeError("block not in the block list")


# ----------------------------------------------------------------------------------------------
# the verb


def _resolve_mode(mode: str, feed: str, method: LayerMethod) -> str:
    if mode not in ("auto", "whole", "blocks"):
        raise ValueError(f"mode={mode!r} must be 'auto', 'whole' or 'blocks'")
    if mode == "auto":
        return "blocks" if feed == "compressed" else "whole"
    if mode == "whole" and feed == "compressed":
        raise ValueError(f"method {method.name!r} calibrates each layer on the already compressed model "
                         "(feed='compressed'); that needs mode='blocks' (or 'auto')")
    return mode


def compress(
    model: nn.Module,
    config: Any,
    calib: Iterable[Any] | None = None,
    *,
    target: Selector = None,
    mode: Mode = "auto",
    calibration: Calibration | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    mask: Any = "auto",
    blocks: str | None = None,
    progress: bool = False,
) -> CompressionReport:
    """Compress ``model``'s target linears in place with ``config``'s method; returns the report.

    Args:
        model: any ``nn.Module`` (Hugging Face ``transformers`` models first).
        config: a :class:`CompressConfig` (or a method config such as
            :class:`~rankwise.compress.swift_svd.SwiftSVDConfig`).
        calib: calibration batches (dicts are called as ``model(**batch)``, tuples as ``model(*batch)``,
            anything else as ``model(batch)``; or give ``forward(model, batch)``). Materialised once.
        target: :mod:`rankwise.core.select` selector; None = every ``nn.Linear`` in the blocks.
        mode: ``"whole"``, ``"blocks"`` or ``"auto"`` (see the module docstring).
        calibration: statistics from :func:`calibrate` instead of ``calib`` (whole mode only).
        loss_fn: ``loss_fn(output, batch) -> scalar`` for gradient-based methods (FWSVD, GFWSVD).
        mask: token mask: ``"auto"`` (the batch's ``attention_mask``), None, a tensor or ``callable(batch)``.
        blocks: dotted path of the block list (overrides the detection).
        progress: show progress bars (on a terminal).

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
    cfg = _as_config(config)
    method = cfg.build_method()
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
    else:
        batches = _materialize_batches(calib)
    if mode == "blocks":
        if found is None:
            raise SelectionError("mode='blocks' needs the model's list of transformer blocks; none was found "
                                 "(pass blocks='path.to.ModuleList')")
        _check_block_kwargs(model)
        if feed == "compressed" and (method.needs_grad or method.has_prepare()):
            raise ValueError(f"method {method.name!r} needs whole-model (gradient) statistics and cannot be fed "
                             "from the compressed model")

    report = CompressionReport(method=method.name, config=cfg.to_json())
    report.params_before = count_parameters(model)
    report.extra["base_fingerprint"] = model_fingerprint(model)
    ledger = _Ledger()
    ledger.set("parameters", _param_bytes(model))
    t_start = time.perf_counter()
    with _calibration_mode(model), transaction(model):
        if method.has_prepare():
            if calibration is not None and not batches:
                raise ValueError(f"method {method.name!r} collects its own statistics; pass calib= as well")
            t0 = time.perf_counter()
            method.prepare(model, batches, target=list(names), loss_fn=loss_fn, forward=forward, mask=mask)
            report.seconds_calibration += time.perf_counter() - t0
        whole_stats = mode == "whole" or method.needs_grad
        if whole_stats:
            if calibration is not None:
                cal = calibration
                missing_k = [k for k in _kinds_for(method, cfg) if k not in cal.kinds]
                missing_n = [n for n in names if n not in cal.stats]
                if missing_k or missing_n:
                    raise ValueError(f"the Calibration lacks kinds {missing_k} / layers {missing_n[:5]} that "
                                     f"method {method.name!r} needs; recollect it with calibrate(model, calib, config)")
                if cfg.allocation == "dynamic" and cal.influence is None and found is not None:
                    raise ValueError("the Calibration has no block influence; the dynamic allocation needs it")
            else:
                t0 = time.perf_counter()
                want_infl = cfg.allocation == "dynamic" and found is not None
                stats, infl = _collect_whole(model, batches, names, _kinds_for(method, cfg), forward=forward,
                                             loss_fn=loss_fn, mask=mask, dtype=cfg.dtype,
                                             collect_options=method.collect_options(),
                                             blocks=found[1] if want_infl else None, progress=progress)
                cal = Calibration(stats=stats, kinds=_kinds_for(method, cfg), influence=infl,
                                  block_path=found[0] if found else None, n_batches=len(batches),
                                  seconds=time.perf_counter() - t0)
                report.seconds_calibration += cal.seconds
            ledger.set("statistics", _stats_bytes({n: cal.stats[n] for n in names}))
            # memos only pay off when the caller reuses the Calibration (several ratios / methods)
            reuse = calibration is not None
            method.cache = cal.cache.setdefault(f"{method.name}:{id(method.__class__)}", {}) if reuse else None
            energy = None
            if cfg.allocation == "dynamic":
                energy = {n: _energy(n, model.get_submodule(n), cal.stats[n]) for n in names}
            ranks = allocate_ranks(cfg, method, shapes, influence=cal.influence, energy=energy,
                                   block_path=found[0] if found else None, n_blocks=len(found[1]) if found else 0)
            bar = _Bar(progress, f"compressing ({method.name})", len(names))
            fitter = _Fitter(model, method, cfg, ranks, report, bar,
                             err_cache=cal.cache.setdefault("_errors", {}) if reuse else None)
            try:
                for n in names:
                    fitter.fit(n, cal.stats[n])
            finally:
                bar.close()
            report.extra["influence"] = cal.influence
        else:
            assert found is not None
            path, blist = found
            method.cache = None  # block by block: nothing to reuse, keep memory at one block
            t0 = time.perf_counter()
            calls = _capture_calls(model, blist[0], batches, forward, mask, progress)
            report.seconds_calibration += time.perf_counter() - t0
            runner = _BlockRunner(model, path, blist, calls, names, method, cfg, feed, ledger, progress)
            runner._track_acts([[c.hidden for c in calls]])
            energy, influence = None, None
            if cfg.allocation == "dynamic":
                t0 = time.perf_counter()
                energy, influence = runner.energies_and_influence()
                report.seconds_calibration += time.perf_counter() - t0
            ranks = allocate_ranks(cfg, method, shapes, influence=influence, energy=energy, block_path=path,
                                   n_blocks=len(blist))
            bar = _Bar(progress, f"compressing ({method.name}, blocks)", len(names))
            fitter = _Fitter(model, method, cfg, ranks, report, bar)
            try:
                report.seconds_calibration += runner.run(fitter)
            finally:
                bar.close()
            report.extra["influence"] = influence
        report.seconds_decomposition = fitter.seconds
        order = {n: i for i, n in enumerate(names)}
        report.layers.sort(key=lambda r: order[r.name])
    report.params_after = count_parameters(model)
    report.extra.update(mode=mode, feed=feed, blocks=found[0] if found else None,
                        n_blocks=len(found[1]) if found else 0, n_batches=len(batches) or (
                            calibration.n_batches if calibration else 0),
                        memory=ledger.to_json(), seconds_total=time.perf_counter() - t_start)
    log.info("%s", report.summary())
    return report


# ----------------------------------------------------------------------------------------------
# checkpoint mode


def fix_mmap_threshold(threshold: int = 65536) -> bool:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own ``mmap`` (process-wide).

    glibc raises its mmap threshold dynamically (up to 32 MiB) whenever a large block is freed; from
    then on, tensors of a few MiB come from the heap, and a heap with a free hole at the wrong place is
    not returned to the OS. :func:`compress_checkpoint` frees one block's weights, statistics and work
    buffers after another, which is exactly that pattern: with the threshold fixed, the freed memory
    goes back to the OS block by block and the peak RSS stays at about one block's working set
    (``benchmarks/bench_compress.py`` measures both). Equivalent to ``MALLOC_MMAP_THRESHOLD_=65536`` in
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

    On glibc, call :func:`fix_mmap_threshold` once before, so that what each block frees goes back to
    the OS (otherwise the heap keeps some of it and the peak RSS is that of one and a half blocks).
    """
    from rankwise.compress import serialization as ser

    cfg = _as_config(config)
    method = cfg.build_method()
    feed = cfg.feed or method.feed
    if method.needs_grad or method.has_prepare():
        raise ValueError(f"method {method.name!r} needs a backward pass (or statistics) through the whole model; "
                         "compress_checkpoint streams one block at a time. Load the model and use compress().")
    batches = _materialize_batches(calib)
    ckpt = ser.CheckpointReader(model_dir)
    model = ser.build_skeleton(ckpt.config, model_class)
    _check_block_kwargs(model)
    found = find_blocks(model, blocks)
    if found is None:
        raise SelectionError(f"{model_dir}: the model has no list of transformer blocks (pass blocks=...)")
    path, blist = found
    targets = resolve_targets(model, target, blocks=blocks)
    names = [n for n, _ in targets]
    shapes = {n: (m.out_features, m.in_features) for n, m in targets}
    report = CompressionReport(method=method.name, config=cfg.to_json())
    report.params_before = count_parameters(model)
    entries = ser.param_entries(model)
    ledger = _Ledger()
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
    with writer, _calibration_mode(model):
        nonblock = ckpt.materialize(model, lambda n: not in_block(n), samples)
        ledger.set("parameters", _param_bytes(model))
        t0 = time.perf_counter()
        calls = _capture_calls(model, blist[0], batches, forward, mask, progress)
        report.seconds_calibration += time.perf_counter() - t0
        # the non-block weights are not needed any more: free them (the output copies them from the source)
        ckpt.release(model, nonblock)
        runner = _BlockRunner(model, path, blist, calls, names, method, cfg, feed, ledger, progress,
                              materialize=materialize, release=release)
        runner._track_acts([[c.hidden for c in calls]])
        energy, influence = None, None
        if cfg.allocation == "dynamic":
            t0 = time.perf_counter()
            energy, influence = runner.energies_and_influence()
            report.seconds_calibration += time.perf_counter() - t0
        ranks = allocate_ranks(cfg, method, shapes, influence=influence, energy=energy, block_path=path,
                               n_blocks=len(blist))
        state["write"] = True
        method.cache = None
        bar = _Bar(progress, f"compressing ({method.name}, checkpoint)", len(names))
        fitter = _Fitter(model, method, cfg, ranks, report, bar)
        try:
            report.seconds_calibration += runner.run(fitter)
        finally:
            bar.close()
        report.seconds_decomposition = fitter.seconds
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


# ----------------------------------------------------------------------------------------------
# speed


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

    with _calibration_mode(original), _calibration_mode(compressed):
        once(original), once(compressed)
        to, tc = [], []
        for i in range(repeats):
            for which in ((original, to), (compressed, tc)) if i % 2 == 0 else ((compressed, tc), (original, to)):
                which[1].append(once(which[0]))
    a, b = statistics.median(to), statistics.median(tc)
    return {"original_s": a, "compressed_s": b, "ratio": b / a if a > 0 else float("nan")}
