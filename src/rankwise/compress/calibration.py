"""Calibration: the batches, the statistics the method needs, and the reusable :class:`Calibration`.

:func:`calibrate` collects, in one whole-model pass, the statistics a method needs for every target
(streamed in float64 by :mod:`rankwise.core.stats`, padding tokens excluded with the batch's
``attention_mask``) and, when the model has transformer blocks, every block's influence (for the
dynamic rank allocation). The result can serve several ``compress`` calls (ratios, allocations,
methods of the same feed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.allocation import block_influence
from rankwise.compress.base import LayerMethod
from rankwise.compress.config import CompressConfig, as_compress_config
from rankwise.compress.progress import track
from rankwise.compress.targets import find_blocks, first_tensor_arg, out_tensor, resolve_targets
from rankwise.core.errors import SelectionError
from rankwise.core.select import Selector
from rankwise.core.stats import KINDS, CalibrationError, LayerStats, StatsCollector, resolve_mask

Tensor = torch.Tensor

__all__ = ["Calibration", "calibrate", "release_stats", "materialize_batches", "resolve_mask", "calibration_mode", "input_dim_hooks",
           "kinds_for", "layer_kinds_for", "collect_whole"]


def materialize_batches(calib: Any) -> list[Any]:
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


@contextlib.contextmanager
def calibration_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode and ``config.use_cache = False`` (no KV cache during calibration), restored after."""
    # weak keys: block-sequential compression replaces modules inside this context, and a strong
    # reference here kept every replaced Linear (and the weight read into it) alive to the end
    flags = weakref.WeakKeyDictionary((m, m.training) for m in model.modules())
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
        for m, f in list(flags.items()):
            m.training = f
        for cfg, v in configs:
            cfg.use_cache = v


def input_dim_hooks(model: nn.Module, names: Iterable[str]) -> list[Any]:
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


def release_stats(stats: Mapping[str, LayerStats] | Iterable[LayerStats]) -> int:
    """Drop the float64 buffers of ``stats`` (``xtx``, ``yty``, ...: set to None); returns the bytes dropped.

    The block-sequential mode calls it once a block's layers are fitted, so that the buffers go back
    to the allocator at once even if some object (a collector, a hook, a traceback) still refers to the
    :class:`~rankwise.core.stats.LayerStats`; the objects keep their counts and names.
    """
    items = stats.values() if isinstance(stats, Mapping) else stats
    freed = 0
    for st in items:
        for f in dataclasses.fields(st):
            v = getattr(st, f.name)
            if isinstance(v, Tensor):
                freed += v.numel() * v.element_size()
                setattr(st, f.name, None)
    return freed


def kinds_for(method: LayerMethod, cfg: CompressConfig) -> tuple[str, ...]:
    kinds = list(method.needs)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"method {method.name!r} needs unknown statistics kinds {bad}")
    if cfg.measure_error or (cfg.allocation == "dynamic" and "output_cov" not in kinds):
        kinds.append("input_cov")
    return tuple(dict.fromkeys(kinds))


def layer_kinds_for(method: LayerMethod, cfg: CompressConfig, extra: Sequence[str] = ()
                    ) -> Callable[[str, nn.Module], tuple[str, ...]]:
    """Per layer, the kinds of :func:`kinds_for` that layer needs (``StatsCollector(layer_kinds=...)``).

    ``method.needs_for(out, in)``, plus ``X^T X`` when the error is measured or the dynamic allocation
    has no ``Y^T Y`` for the layer's energy, plus ``extra`` (kinds asked for every layer).
    """
    def kinds(name: str, module: nn.Module) -> tuple[str, ...]:
        m, n = module.weight.shape
        own = list(method.needs_for(int(m), int(n)))
        if cfg.measure_error or (cfg.allocation == "dynamic" and "output_cov" not in own):
            own.append("input_cov")
        return tuple(dict.fromkeys((*own, *extra)))
    return kinds


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
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            h_in, _ = first_tensor_arg(args, kwargs)
            if h_in is None:
                return
            s, c = block_influence(h_in, out_tensor(out), self.mask)
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


def collect_whole(
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
    layer_kinds: Callable[[str, nn.Module], Sequence[str]] | None = None,
) -> tuple[dict[str, LayerStats], list[float] | None]:
    nameset = set(names)
    col = StatsCollector(model, target=lambda n, m: n in nameset, kinds=kinds, types=(nn.Linear,), dtype=dtype,
                         layer_kinds=layer_kinds, **dict(collect_options))
    infl = None
    handles = input_dim_hooks(model, names)
    try:
        if blocks is not None:
            infl = _InfluenceHooks(blocks)
        with col:
            for batch in track(batches, "calibrating", progress):
                m = resolve_mask(batch, mask)
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
    cfg = as_compress_config(config)
    method = cfg.build_method()
    if method.feed == "compressed" or cfg.feed == "compressed":
        raise ValueError(f"method {method.name!r} collects its statistics block by block on the compressed model "
                         "(feed='compressed'); a whole-model Calibration cannot serve it")
    batches = materialize_batches(calib)
    found = find_blocks(model, blocks)
    targets = resolve_targets(model, target, blocks=blocks)
    kinds = tuple(dict.fromkeys((*kinds_for(method, cfg), *extra_kinds)))
    want_infl = found is not None if influence is None else bool(influence)
    if want_infl and found is None:
        raise SelectionError("block influence needs the model's transformer blocks; none found (pass blocks=...)")
    t0 = time.perf_counter()
    with calibration_mode(model):
        stats, infl = collect_whole(model, batches, [n for n, _ in targets], kinds, forward=forward,
                                     loss_fn=loss_fn, mask=mask, dtype=cfg.dtype,
                                     collect_options=method.collect_options(),
                                     blocks=found[1] if want_infl and found else None, progress=progress,
                                     layer_kinds=layer_kinds_for(method, cfg, extra_kinds))
    return Calibration(stats=stats, kinds=kinds, influence=infl, block_path=found[0] if found else None,
                       n_batches=len(batches), seconds=time.perf_counter() - t0)
