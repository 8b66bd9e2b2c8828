"""Block-sequential calibration and compression over cached block inputs.

The inputs of the first block are captured once per calibration batch (:func:`capture_calls`, the
forward stops there); then block ``l`` alone is run on the cached inputs, its targets' statistics are
collected, its layers fitted and replaced, and its outputs feed block ``l + 1``: from the original
block (``feed="original"``: identical results to the whole-model mode) or from the compressed one
(``feed="compressed"``: SAES-SVD's closed loop). With ``feed="compressed"`` the layers of a block are
compressed group by group (:func:`~rankwise.compress.targets.layer_groups`), each group's statistics
collected after the previous group was replaced; methods with ``paired=True`` receive
:class:`~rankwise.compress.base.PairedStats` (``H``, ``Delta``) built from two streams on the same
tokens: the compressed-so-far model and the full-precision one. :class:`BlockRunner` serves both the
in-memory block mode of ``compress`` and :func:`~rankwise.compress.checkpoint.compress_checkpoint`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.allocation import allocate_ranks, block_influence, layer_energy
from rankwise.compress.base import LayerMethod, PairedStats
from rankwise.compress.calibration import input_dim_hooks, kinds_for, layer_kinds_for, release_stats, resolve_mask
from rankwise.compress.config import CompressConfig
from rankwise.compress.fitting import Fitter
from rankwise.compress.progress import Bar, Ledger, stats_bytes, tensor_bytes, track
from rankwise.compress.progress import param_bytes as model_param_bytes
from rankwise.compress.targets import StopForward, block_of, first_tensor_arg, layer_groups, out_tensor
from rankwise.core.errors import NumericalError
from rankwise.core.stats import CalibrationError, LayerStats, StatsCollector, default_forward

Tensor = torch.Tensor

__all__ = ["BlockRunner", "capture_calls", "check_block_kwargs"]


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
        return out_tensor(block(*args, **kwargs))


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


def capture_calls(model: nn.Module, block0: nn.Module, batches: Sequence[Any], forward: Callable | None,
                   mask: Any, progress: bool) -> list[_Call]:
    """Run each batch up to the first block and keep what enters it (the forward stops there)."""
    fwd = forward or default_forward
    calls: list[_Call] = []
    box: dict[str, Any] = {}

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        box["args"], box["kwargs"] = args, kwargs
        raise StopForward

    h = block0.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for batch in track(batches, "capturing block inputs", progress):
            box.clear()
            with torch.no_grad():
                try:
                    fwd(model, batch)
                except StopForward:
                    pass
            if "args" not in box:
                raise CalibrationError("a calibration batch never reached the first transformer block")
            args, kwargs = box["args"], dict(box["kwargs"])
            hidden, where = first_tensor_arg(args, kwargs)
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
            m = resolve_mask(batch, mask)
            calls.append(_Call(hidden.detach(), rest_args, kw, where, None if m is None else m.detach()))
    finally:
        h.remove()
    return calls


def check_block_kwargs(model: nn.Module) -> None:
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
        raise StopForward

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


class BlockRunner:
    """Block-sequential calibration and compression over cached block inputs.

    ``materialize(l)`` / ``release(l)`` are called around block ``l`` (checkpoint mode loads and frees
    the block's weights there; in-memory mode does nothing).
    """

    def __init__(self, model: nn.Module, path: str, blocks: nn.ModuleList, calls: list[_Call],
                 targets: Sequence[str], method: LayerMethod, cfg: CompressConfig, feed: str,
                 ledger: Ledger, progress: bool,
                 materialize: Callable[[int], None] | None = None, release: Callable[[int], None] | None = None,
                 param_bytes: Callable[[], int] | None = None):
        self.model, self.path, self.blocks, self.calls = model, path, blocks, calls
        self.method, self.cfg, self.feed, self.ledger = method, cfg, feed, ledger
        self.progress = progress
        self.materialize = materialize or (lambda l: None)
        self.release = release or (lambda l: None)
        self.param_bytes = param_bytes or (lambda: model_param_bytes(model))
        self.by_block: dict[int, list[str]] = {}
        for n in targets:
            b = block_of(n, path, len(blocks))
            if b is None:
                raise ValueError(f"target {n!r} is outside the transformer blocks {path!r}; the block-sequential "
                                 "mode compresses layers inside the blocks only (use mode='whole')")
            self.by_block.setdefault(b, []).append(n)
        self.kinds = kinds_for(method, cfg)
        self.layer_kinds = layer_kinds_for(method, cfg)
        self.prefix = lambda l: f"{path}.{l}."

    def _rel(self, l: int, names: Sequence[str]) -> list[str]:
        p = self.prefix(l)
        return [n[len(p):] for n in names]

    def _collector(self, block: nn.Module, rel: Sequence[str]) -> StatsCollector:
        relset = set(rel)
        return StatsCollector(block, target=lambda n, m: n in relset, kinds=self.kinds, types=(nn.Linear,),
                              dtype=self.cfg.dtype, layer_kinds=self.layer_kinds,
                              **dict(self.method.collect_options()))

    def _stats_full(self, l: int, stats: Mapping[str, LayerStats]) -> dict[str, LayerStats]:
        p = self.prefix(l)
        out = {}
        for rel, st in stats.items():
            st.name = p + rel
            out[p + rel] = st
        return out

    def track_activations(self, streams: Sequence[Sequence[Tensor]]) -> None:
        self.ledger.set("activations", sum(tensor_bytes(s) for s in streams)
                        + tensor_bytes([(c.args, c.kwargs) for c in self.calls]))

    # -- pre-pass of the dynamic allocation -----------------------------------------------------

    def energies_and_influence(self) -> tuple[dict[str, float], list[float]]:
        """Stream the original model once: every target's output energy and every block's influence."""
        hs = [c.hidden for c in self.calls]
        energy: dict[str, float] = {}
        influence: list[float] = []
        bar = Bar(self.progress, "allocation pre-pass", len(self.blocks))
        try:
            for l, block in enumerate(self.blocks):
                self.materialize(l)
                self.ledger.set("parameters", self.param_bytes())
                names = self.by_block.get(l, [])
                col = self._collector(block, self._rel(l, names)) if names else None
                outs, s_sum, c_sum = [], 0.0, 0
                handles = input_dim_hooks(block, self._rel(l, names))
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
                    self.ledger.set("statistics", stats_bytes(stats))
                    for n, st in stats.items():
                        energy[n] = layer_energy(n, self.model.get_submodule(n), st)
                    release_stats(stats)
                    del stats, col
                    self.ledger.set("statistics", 0)
                hs = outs
                self.track_activations([hs])
                self.release(l)
                bar.advance()
        finally:
            bar.close()
        return energy, influence

    # -- the whole run ----------------------------------------------------------------------------

    def compress(self, shapes: Mapping[str, tuple[int, int]], report: Any, label: str,
                 before_run: Callable[[], None] | None = None) -> list[float] | None:
        """Ranks (after the dynamic allocation's pre-pass when asked), then the main pass; fills ``report``.

        ``before_run()`` is called between the two passes (checkpoint mode starts writing blocks there).
        Returns the block influence of the pre-pass (None without it).
        """
        self.track_activations([[c.hidden for c in self.calls]])
        energy, influence = None, None
        if self.cfg.allocation == "dynamic":
            t0 = time.perf_counter()
            energy, influence = self.energies_and_influence()
            report.seconds_calibration += time.perf_counter() - t0
        ranks = allocate_ranks(self.cfg, self.method, shapes, influence=influence, energy=energy,
                               block_path=self.path, n_blocks=len(self.blocks))
        if before_run is not None:
            before_run()
        self.method.cache = None  # block by block: nothing to reuse, keep memory at one block
        bar = Bar(self.progress, label, len(shapes))
        fitter = Fitter(self.model, self.method, self.cfg, ranks, report, bar)
        try:
            report.seconds_calibration += self.run(fitter)
        finally:
            bar.close()
        report.seconds_decomposition = fitter.seconds
        return influence

    # -- main pass --------------------------------------------------------------------------------

    def run(self, fitter: Fitter) -> float:
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
                    handles = input_dim_hooks(block, rel)
                    try:
                        with col:
                            for call, h in zip(self.calls, hc):
                                with torch.no_grad(), col.token_mask(call.mask):
                                    outs.append(call.run(block, h).detach())
                    finally:
                        for hd in handles:
                            hd.remove()
                    stats = self._stats_full(l, col.results())
                    self.ledger.set("statistics", stats_bytes(stats))
                    calib_s += time.perf_counter() - t0
                    for n in names:
                        fitter.fit(n, stats[n])
                    release_stats(stats)  # this block's float64 buffers go back now, not at the next block
                    del stats, col
                    self.ledger.set("statistics", 0)
                else:
                    with torch.no_grad():
                        outs = [call.run(block, h).detach() for call, h in zip(self.calls, hc)]
                    calib_s += time.perf_counter() - t0
                hc = outs
                self.track_activations([hc])
            else:
                fp = copy.deepcopy(block) if paired else None
                if fp is not None:
                    self.ledger.set("fp_block", model_param_bytes(fp))
                if names:
                    groups = layer_groups(block, rel, lambda: self.calls[0].run(block, hc[0]))
                    for g in groups:
                        t1 = time.perf_counter()
                        stats, pstats = self._group_stats(block, fp, g, hc, hf)
                        calib_s += time.perf_counter() - t1
                        p = self.prefix(l)
                        for r in g:
                            fitter.fit(p + r, stats[p + r], pstats.get(p + r) if pstats else None)
                        release_stats(stats)
                        for ps in (pstats or {}).values():
                            ps.H = ps.Delta = None
                        del stats, pstats
                        self.ledger.set("statistics", 0)
                t1 = time.perf_counter()
                with torch.no_grad():
                    hc = [call.run(block, h).detach() for call, h in zip(self.calls, hc)]
                    if fp is not None and hf is not None:
                        hf = [call.run(fp, h).detach() for call, h in zip(self.calls, hf)]
                calib_s += time.perf_counter() - t1
                del fp
                self.ledger.set("fp_block", 0)
                self.track_activations([hc] + ([hf] if hf is not None else []))
            self.release(l)
        return calib_s

    def _group_stats(self, block: nn.Module, fp: nn.Module | None, group: Sequence[str], hc: Sequence[Tensor],
                     hf: Sequence[Tensor] | None) -> tuple[dict[str, LayerStats], dict[str, PairedStats] | None]:
        """Statistics of one group on the compressed stream (and the paired statistics against the FP stream)."""
        l = self.blocks_index(block)
        col = self._collector(block, group)
        handles = input_dim_hooks(block, group)
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
                                except StopForward:
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
                        except StopForward:
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
        self.ledger.set("statistics", stats_bytes(stats) + tensor_bytes(
            [(ps.H, ps.Delta) for ps in (paired or {}).values()]))
        return stats, paired

    def blocks_index(self, block: nn.Module) -> int:
        for i, b in enumerate(self.blocks):
            if b is block:
                return i
        raise RuntimeError("block not in the block list")
