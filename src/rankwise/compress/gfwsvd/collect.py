"""Collecting the Kronecker factors of a model: per-sample gradient hooks, MFF over the data, save/load."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.gfwsvd.config import GFWSVDConfig
from rankwise.compress.gfwsvd.fisher import (
    KroneckerFactors,
    SampleFactors,
    _mff,
    _mff_samples,
    _Operator,
    kfac_from_samples,
)
from rankwise.core.errors import NumericalError
from rankwise.core.select import Selector, select
from rankwise.core.stats import CalibrationError, LayerStats, default_forward

Tensor = torch.Tensor

log = logging.getLogger(__name__)

__all__ = ["PerSampleGradientCollector", "collect_kronecker_fisher", "collect_sample_factors", "factors_from_samples",
           "layer_stats_from_samples", "save_factors", "load_factors"]


# ----------------------------------------------------------------------------------------------
# per-sample gradient collection with hooks


class PerSampleGradientCollector:
    """Hooks that hand each target layer's per-sample ``(X_s, D_s)`` of every batch to a sink.

    For each forward call the layer input ``x`` (``(B, ..., n)``; a 2-D input is ``B`` samples of one
    token) is kept until its output gradient ``g = dL/dy`` arrives; after the backward of a batch the
    calls of each layer are concatenated along the token dim per sample (so a layer called twice per
    forward gives ``G_s = sum over both calls``) and handed to ``sink(name, X (B, T, n), D (B, T, m))``.
    Padding tokens (``mask == 0``; shape ``(B, ...)``) get zero rows. The model's parameters and
    ``requires_grad`` flags are never touched: a zero scalar leaf is added to each target output so
    that output gradients exist in a frozen model, and only that leaf is differentiated.
    """

    def __init__(self, model: nn.Module, target: Selector = None, *, types: tuple[type, ...] = (nn.Linear,)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.modules: dict[str, nn.Module] = dict(select(model, target, types))
        self._calls: dict[str, list[list[Tensor | None]]] = {k: [] for k in self.modules}
        self._handles: list[Any] = []
        self._leaf = torch.zeros((), requires_grad=True)
        self._mask: Tensor | None = None
        self.sink: Callable[[str, Tensor, Tensor], None] | None = None
        self.batches = 0

    @property
    def names(self) -> list[str]:
        return list(self.modules)

    def dims(self) -> dict[str, tuple[int, int]]:
        out = {}
        for k, mod in self.modules.items():
            m, n = getattr(mod, "out_features", None), getattr(mod, "in_features", None)
            if not isinstance(m, int) or not isinstance(n, int):
                raise TypeError(f"layer {k!r} ({type(mod).__name__}) has no in_features/out_features")
            out[k] = (m, n)
        return out

    def __enter__(self) -> "PerSampleGradientCollector":
        for k, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(self._hook(k)))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._handles:
            self._handles.pop().remove()
        for k in self._calls:
            self._calls[k] = []

    def _hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None or not isinstance(output, torch.Tensor):
                raise TypeError(f"layer {name!r} must take and return tensors to collect per-sample gradients")
            slot: list[Tensor | None] = [x.detach(), None]
            self._calls[name].append(slot)
            out = output + self._leaf  # exact (+0); gives dL/dy even when nothing requires grad

            def grad_hook(g: Tensor) -> None:
                slot[1] = g.detach()

            out.register_hook(grad_hook)
            return out
        return hook

    def run(self, batch: Any, *, loss_fn: Callable[[Any, Any], Tensor] | None = None,
            forward: Callable[[nn.Module, Any], Any] | None = None, mask: Any = "auto") -> None:
        """Forward + backward of one batch, then hand the per-sample factors of every layer to ``sink``."""
        if not self._handles:
            raise RuntimeError("use the collector as a context manager: `with PerSampleGradientCollector(...) as c:`")
        fwd = forward or default_forward
        if isinstance(mask, str):
            if mask != "auto":
                raise ValueError(f"mask must be 'auto', None, a tensor or a callable, got {mask!r}")
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        elif callable(mask):
            mask = mask(batch)
        for k in self._calls:
            self._calls[k] = []
        try:
            with torch.enable_grad():
                out = fwd(self.model, batch)
                loss = _loss(out, batch, loss_fn)
                if not bool(torch.isfinite(loss.detach())):
                    raise NumericalError(f"calibration loss is not finite ({float(loss.detach()):.3g}) at batch "
                                         f"{self.batches}")
                if loss.requires_grad:
                    torch.autograd.grad(loss, [self._leaf], allow_unused=True)
            self._flush(mask)
        finally:
            for k in self._calls:
                self._calls[k] = []
        self.batches += 1

    def _flush(self, mask: Tensor | None) -> None:
        for k, calls in self._calls.items():
            parts_x, parts_d = [], []
            for x, g in calls:
                if g is None:  # this call's output did not influence the loss
                    continue
                B = x.shape[0] if x.ndim >= 2 else 1
                X = x.reshape(B, -1, x.shape[-1])
                Dg = g.reshape(B, -1, g.shape[-1])
                if mask is not None and mask.numel() == X.shape[0] * X.shape[1]:
                    keep = (mask.reshape(B, -1) != 0).to(X.dtype).unsqueeze(-1)
                    X, Dg = X * keep, Dg * keep.to(Dg.dtype)
                parts_x.append(X)
                parts_d.append(Dg)
            if not parts_x:
                continue
            if len({p.shape[0] for p in parts_x}) > 1:
                raise ValueError(f"layer {k!r}: calls within one batch have different batch sizes; cannot "
                                 "group tokens per sample")
            X = torch.cat(parts_x, 1) if len(parts_x) > 1 else parts_x[0]
            Dg = torch.cat(parts_d, 1) if len(parts_d) > 1 else parts_d[0]
            if self.sink is not None:
                self.sink(k, X, Dg)


def _loss(out: Any, batch: Any, loss_fn: Callable | None) -> Tensor:
    if loss_fn is not None:
        loss = loss_fn(out, batch)
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    elif isinstance(out, torch.Tensor) and out.ndim == 0:
        loss = out
    else:
        raise ValueError("GFWSVD needs a task loss for its gradients: pass loss_fn(output, batch) -> scalar, "
                         "or use a model that returns .loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss.reshape(())


class _RecomputeOperator(_Operator):
    """MFF half-steps computed by re-running the calibration data (memory ``O(m^2 + n^2)`` per layer)."""

    def __init__(self, col: PerSampleGradientCollector, batches: Sequence[Any], run_kw: dict[str, Any],
                 compute_dtype: torch.dtype = torch.float64):
        self.col, self.batches, self.run_kw = col, batches, run_kw
        self.compute_dtype = compute_dtype

    def _pass(self, mats: Mapping[str, Tensor], which: str) -> dict[str, Tensor]:
        acc: dict[str, Tensor] = {}

        def sink(k: str, X: Tensor, Dg: Tensor) -> None:
            if k not in mats:
                return
            sf = SampleFactors(X.shape[-1], Dg.shape[-1], name=k, compute_dtype=self.compute_dtype)
            sf.add(X, Dg)
            v = sf.p_step(mats[k]) if which == "p" else sf.q_step(mats[k])
            acc[k] = v if k not in acc else acc[k] + v

        self.col.sink = sink
        for b in self.batches:
            self.col.run(b, **self.run_kw)
        return acc

    def p_step(self, Q: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self._pass(Q, "p")

    def q_step(self, P: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self._pass(P, "q")


# ----------------------------------------------------------------------------------------------
# collecting the factors of a model


def collect_kronecker_fisher(
    model: nn.Module,
    calib: Iterable[Any],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    config: GFWSVDConfig | None = None,
    *,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    row_fisher: bool = True,
) -> dict[str, KroneckerFactors]:
    """Kronecker-factored Fisher ``(P, Q)`` of every target linear layer, by MFF (or K-FAC).

    Args:
        model: any module; it is put in eval mode for the duration (flags restored) and never modified.
        calib: batches (``dict`` -> ``model(**batch)``, tuple -> ``model(*batch)``, or ``forward(model, batch)``).
            ``storage="recompute"`` needs a re-iterable (e.g. a list), not a one-shot generator.
        loss_fn: ``loss_fn(output, batch) -> scalar``, the task loss whose per-sample gradients define
            the Fisher (default: ``output.loss``). Its scale does not matter (``P kron Q`` scales, the
            compression does not).
        config: :class:`GFWSVDConfig` (``power_iters``, ``tol``, ``approximation``, ``storage``, ...).
        target: selector of the layers; default ``config.targets`` or every ``nn.Linear``.
        mask: token mask of each batch (``"auto"`` = its ``attention_mask``).
        row_fisher: also compute FWSVD's row Fisher from the same per-sample gradients.
    Returns:
        ``{layer name: KroneckerFactors}`` in model order.
    Raises:
        CalibrationError: empty ``calib``, a layer no gradient reached, or an all-zero Fisher.
    """
    cfg = config or GFWSVDConfig()
    sel = target if target is not None else (list(cfg.targets) if cfg.targets else None)
    col = PerSampleGradientCollector(model, sel)
    dims = col.dims()
    run_kw = dict(loss_fn=loss_fn, forward=forward, mask=mask)
    if cfg.storage == "recompute":
        if iter(calib) is calib:  # type: ignore[comparison-overlap]
            raise ValueError("storage='recompute' re-runs the calibration data 2T+1 times; pass a list (or any "
                             "re-iterable), not a one-shot iterator")
        batches: Sequence[Any] = calib if isinstance(calib, Sequence) else list(calib)
    else:
        batches = calib if isinstance(calib, Sequence) else list(calib)
    if len(batches) == 0:
        raise CalibrationError("the calibration data is empty: `calib` yielded no batch")
    names = col.names
    out: dict[str, KroneckerFactors] = {}
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with col:
            if cfg.storage == "tokens":
                step = cfg.layers_per_pass or len(names)
                for i in range(0, len(names), step):
                    samples = _collect_samples(col, names[i:i + step], dims, batches, run_kw, cfg.compute_dtype)
                    out.update(_factors_from_samples(samples, cfg, row_fisher))
            else:
                out.update(_recompute(col, batches, run_kw, dims, cfg, row_fisher))
    finally:
        for mod, f in flags.items():
            mod.training = f
    return {k: out[k] for k in names}


def _collect_samples(col: PerSampleGradientCollector, group: Sequence[str], dims: Mapping[str, tuple[int, int]],
                     batches: Sequence[Any], run_kw: dict[str, Any], compute_dtype: torch.dtype
                     ) -> dict[str, SampleFactors]:
    """One forward + backward of every batch, keeping the per-sample ``(X_s, D_s)`` of the layers in ``group``."""
    samples = {k: SampleFactors(dims[k][1], dims[k][0], name=k, compute_dtype=compute_dtype) for k in group}

    def sink(k: str, X: Tensor, Dg: Tensor) -> None:
        if k in samples:
            samples[k].add(X, Dg)

    col.sink = sink
    for b in batches:
        col.run(b, **run_kw)
    _check_reached(samples)
    return samples


def collect_sample_factors(
    model: nn.Module,
    calib: Iterable[Any],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    compute_dtype: torch.dtype = torch.float64,
) -> dict[str, SampleFactors]:
    """The per-sample gradient factors ``(X_s, D_s)`` of every target linear, from ONE backward pass per batch.

    The shared-pass entry point: the returned :class:`SampleFactors` give GFWSVD's factors
    (:func:`factors_from_samples`), the K-FAC ablation (``approximation="kfac"``), FWSVD's row Fisher
    (:meth:`SampleFactors.row_fisher`) and the forward statistics of the same tokens
    (:func:`layer_stats_from_samples`, e.g. SVD-LLM(W)'s ``X^T X``) without re-running the data.
    Arguments as in :func:`collect_kronecker_fisher` (``compute_dtype``: dtype of the later MFF
    contractions). Memory ``O(tokens (m + n))`` per layer. Returns ``{layer name: SampleFactors}`` in
    model order; raises :class:`CalibrationError` for empty data or a layer no gradient reached.
    """
    if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype={compute_dtype!r} must be a floating torch.dtype")
    col = PerSampleGradientCollector(model, target)
    dims = col.dims()
    batches = calib if isinstance(calib, Sequence) else list(calib)
    if len(batches) == 0:
        raise CalibrationError("the calibration data is empty: `calib` yielded no batch")
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with col:
            return _collect_samples(col, col.names, dims, batches, dict(loss_fn=loss_fn, forward=forward, mask=mask),
                                    compute_dtype)
    finally:
        for mod, f in flags.items():
            mod.training = f


def factors_from_samples(samples: Mapping[str, SampleFactors], config: GFWSVDConfig | None = None, *,
                         row_fisher: bool = True) -> dict[str, KroneckerFactors]:
    """GFWSVD's Kronecker factors (MFF, or K-FAC with ``approximation="kfac"``) of collected samples.

    Equal to :func:`collect_kronecker_fisher` with ``storage="tokens"`` on the same data (the MFF
    contractions run in each :class:`SampleFactors`' ``compute_dtype``); ``row_fisher`` adds FWSVD's
    row Fisher from the same per-sample gradients. The samples can serve several configs.
    """
    cfg = config or GFWSVDConfig()
    if not isinstance(cfg, GFWSVDConfig):
        raise TypeError(f"config must be a GFWSVDConfig, got {type(cfg).__name__}")
    if not samples:
        raise ValueError("samples is empty: collect them with collect_sample_factors(...) first")
    bad = [k for k, s in samples.items() if not isinstance(s, SampleFactors)]
    if bad:
        raise TypeError(f"samples must map layer names to SampleFactors; not for {bad[:5]}")
    _check_reached(samples)
    return _factors_from_samples(samples, cfg, row_fisher)


def layer_stats_from_samples(samples: Mapping[str, SampleFactors]) -> dict[str, LayerStats]:
    """:class:`~rankwise.core.stats.LayerStats` with the ``"input_cov"`` and ``"input_abs_mean"`` sums of the
    kept tokens (those with a non-zero output gradient; with a token mask and a loss that reaches every
    token, exactly the non-padding tokens), so that activation-based baselines (SVD-LLM(W), ASVD,
    the pipeline's output-error report) share GFWSVD's one pass over the calibration data."""
    out = {}
    for k, s in samples.items():
        xtx, abs_sum, count = s.input_sums()
        out[k] = LayerStats(name=k, in_features=s.n, out_features=s.m, n_tokens=count, xtx=xtx, x_abs_sum=abs_sum)
    return out


def _check_reached(samples: Mapping[str, SampleFactors]) -> None:
    silent = [k for k, s in samples.items() if s.samples == 0]
    if silent:
        raise CalibrationError(f"no gradient reached {len(silent)} target layer(s): {silent[:10]} (frozen branch, "
                               "unused layer, or a loss that does not depend on them)")
    S = next(iter(samples.values())).samples
    if S < 2:
        warnings.warn(f"only {S} calibration sample: the empirical Fisher is rank-deficient; use more samples",
                      RuntimeWarning, stacklevel=3)


def _factors_from_samples(samples: Mapping[str, SampleFactors], cfg: GFWSVDConfig, row_fisher: bool
                          ) -> dict[str, KroneckerFactors]:
    if cfg.approximation == "kfac":
        res = {k: kfac_from_samples(s) for k, s in samples.items()}
    else:
        res = _mff_samples(samples, cfg.power_iters, cfg.tol)
    if row_fisher:
        for k, s in samples.items():
            res[k].row_fisher = s.row_fisher() / s.samples
    return res


def _recompute(col: PerSampleGradientCollector, batches: Sequence[Any], run_kw: dict[str, Any],
               dims: Mapping[str, tuple[int, int]], cfg: GFWSVDConfig, row_fisher: bool) -> dict[str, KroneckerFactors]:
    counts = {k: 0 for k in dims}
    rows = {k: torch.zeros(dims[k][0], dtype=torch.float64) for k in dims}
    kfac = {k: [torch.zeros(dims[k][1], dims[k][1], dtype=torch.float64),
                torch.zeros(dims[k][0], dims[k][0], dtype=torch.float64), 0] for k in dims}

    def sink(k: str, X: Tensor, Dg: Tensor) -> None:  # pass 0: counts, row Fisher, K-FAC sums
        sf = SampleFactors(X.shape[-1], Dg.shape[-1], name=k)
        sf.add(X, Dg)
        counts[k] += sf.samples
        if row_fisher:
            rows[k] += sf.row_fisher()
        if cfg.approximation == "kfac":
            A, G, c = sf.kfac()
            kfac[k][0] += A
            kfac[k][1] += G
            kfac[k][2] += c

    col.sink = sink
    for b in batches:
        col.run(b, **run_kw)
    silent = [k for k, c in counts.items() if c == 0]
    if silent:
        raise CalibrationError(f"no gradient reached {len(silent)} target layer(s): {silent[:10]}")
    if min(counts.values()) < 2:
        warnings.warn(f"only {min(counts.values())} calibration sample: the empirical Fisher is rank-deficient; use "
                      "more samples", RuntimeWarning, stacklevel=3)
    if cfg.approximation == "kfac":
        res = {k: KroneckerFactors(P=kfac[k][0] / kfac[k][2], Q=kfac[k][1] / kfac[k][2], samples=counts[k], kind="kfac")
               for k in dims}
    else:
        res = _mff(_RecomputeOperator(col, batches, run_kw, cfg.compute_dtype), dims, counts, cfg.power_iters, cfg.tol)
    if row_fisher:
        for k in dims:
            res[k].row_fisher = rows[k] / counts[k]
    return res


# ----------------------------------------------------------------------------------------------
# saving and loading factors (safetensors + JSON metadata)


def save_factors(factors: Mapping[str, KroneckerFactors], path: Any) -> Any:
    """Save ``{name: KroneckerFactors}`` to a safetensors file atomically (re-use for other ratios)."""
    from rankwise.core import io

    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {}
    for k, f in factors.items():
        tensors[f"{k}::P"] = f.P.contiguous()
        tensors[f"{k}::Q"] = f.Q.contiguous()
        if f.row_fisher is not None:
            tensors[f"{k}::row_fisher"] = f.row_fisher.contiguous()
        meta[k] = {"sigma": f.sigma if math.isfinite(f.sigma) else None, "samples": f.samples, "iters": f.iters,
                   "converged": f.converged, "kind": f.kind}
    return io.save_tensors(path, tensors, metadata={"kind": "gfwsvd-kronecker-factors", "layers": meta})


def load_factors(path: Any) -> dict[str, KroneckerFactors]:
    """Load factors written by :func:`save_factors` (validating shapes and metadata)."""
    from rankwise.core import io
    from rankwise.core.errors import ArtifactError

    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != "gfwsvd-kronecker-factors":
        raise ArtifactError(f"{path} does not hold GFWSVD Kronecker factors (kind={meta.get('kind')!r})")
    out: dict[str, KroneckerFactors] = {}
    for k, info in meta.get("layers", {}).items():
        try:
            P, Q = tensors[f"{k}::P"], tensors[f"{k}::Q"]
        except KeyError:
            raise ArtifactError(f"{path}: factors of layer {k!r} are missing") from None
        if P.ndim != 2 or P.shape[0] != P.shape[1] or Q.ndim != 2 or Q.shape[0] != Q.shape[1]:
            raise ArtifactError(f"{path}: factors of layer {k!r} are not square matrices")
        sigma = info.get("sigma")
        out[k] = KroneckerFactors(P=P, Q=Q, sigma=float("nan") if sigma is None else float(sigma),
                                  samples=int(info.get("samples", 0)), iters=int(info.get("iters", 0)),
                                  converged=bool(info.get("converged", False)), kind=str(info.get("kind", "mff")),
                                  row_fisher=tensors.get(f"{k}::row_fisher"))
    return out

