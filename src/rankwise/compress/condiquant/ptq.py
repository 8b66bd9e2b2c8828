"""Plain post-training quantization (PTQ) run after (or without) conditioning: W{b}A{b} fake quantization.

Weights: per-output-channel symmetric, levels ``-q..q`` with ``q = 2^(b-1) - 1`` (``2^b - 1 <= 2^b``
levels; ``scale = max|w| / q``, :class:`torch.ao.quantization.PerChannelMinMaxObserver`'s formula for
``quant_min=-q, quant_max=q``). Activations (each target layer's input): per-tensor asymmetric, levels
``0..2^b - 1``, bounds from the calibration data by an observer:

* ``"minmax"``: the min and max (``torch.ao.quantization.MinMaxObserver``'s qparams, zero kept in range);
* ``"percentile"``: the ``100 - p`` and ``p`` percentiles (default ``p = 99.9``) of the values.

The rounding itself is torch's ``fake_quantize_per_channel_affine`` / ``fake_quantize_per_tensor_affine``.
``w_bits`` / ``a_bits`` of ``None`` leave that side in floating point (the W-only / A-only studies).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rankwise.core import io
from rankwise.core.errors import ArtifactError, SelectionError
from rankwise.core.select import available_names, matcher, select
from rankwise.core.stats import default_forward
from rankwise.core.surgery import replace_module
from rankwise.core.validate import check_choice, check_int, check_number

Tensor = torch.Tensor

__all__ = ["OBSERVERS", "QuantLayer", "QuantizedModel", "act_qparams", "check_bits", "dequantize", "fake_quant_act",
           "fake_quant_weight", "levels", "load_quantized", "ptq_quantize", "weight_qparams"]

OBSERVERS = ("minmax", "percentile")
_EPS = torch.finfo(torch.float32).eps
_MAX_SAMPLES = 1 << 22  # activation values kept per layer for percentiles (strided subsample beyond)


def check_bits(field: str, bits: Any) -> int | None:
    """``bits`` as an int in 2..8, or None (that side stays in floating point)."""
    return check_int(field, bits, lo=2, hi=8, allow_none=True)


def weight_qparams(w: Tensor, bits: int) -> tuple[Tensor, int]:
    """Per-output-channel (dim 0) symmetric scales of ``w`` and ``q = 2^(b-1) - 1`` (levels ``-q..q``)."""
    q = 2 ** (bits - 1) - 1
    amax = w.detach().reshape(w.shape[0], -1).abs().amax(dim=1).to(torch.float32)
    return torch.clamp(amax / q, min=_EPS), q


def fake_quant_weight(w: Tensor, bits: int) -> Tensor:
    """``w`` rounded to its per-channel symmetric grid (same shape and dtype)."""
    scale, q = weight_qparams(w, bits)
    zp = torch.zeros(w.shape[0], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(w.detach().float(), scale, zp, 0, -q, q).to(w.dtype)


def act_qparams(lo: float, hi: float, bits: int) -> tuple[float, int]:
    """Per-tensor asymmetric ``(scale, zero_point)`` for the range ``[lo, hi]`` on levels ``0..2^b - 1``
    (the range is widened to contain 0, as torch.ao's MinMaxObserver does)."""
    qmax = 2 ** bits - 1
    lo_, hi_ = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = max((hi_ - lo_) / qmax, _EPS)
    scale = float(torch.tensor(scale, dtype=torch.float32))
    zp = int(min(max(0 - round(lo_ / scale), 0), qmax))
    return scale, zp


def dequantize(w_int: Tensor, scale: Tensor) -> Tensor:
    """``w_int * scale`` per output channel (float32), exactly torch's fake-quantized values."""
    return w_int.float() * scale.reshape((-1,) + (1,) * (w_int.ndim - 1))


def fake_quant_act(x: Tensor, scale: float, zero_point: int, bits: int) -> Tensor:
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 2 ** bits - 1)


class QuantLayer(nn.Module):
    """A Linear / Conv2d with fake-quantized weight and (optionally) input; the same call signature.

    Buffers: ``w_int`` (int8, the integer weight, same shape as the weight), ``w_scale`` (per output
    channel); ``a_range`` (the observed ``[lo, hi]``), ``a_scale`` and ``a_zero_point``."""

    def __init__(self, layer: nn.Module, w_bits: int | None, a_bits: int | None, a_range: tuple[float, float] | None):
        super().__init__()
        self.layer = layer
        self.w_bits, self.a_bits = w_bits, a_bits
        if w_bits is not None:
            scale, q = weight_qparams(layer.weight, w_bits)
            shape = (-1,) + (1,) * (layer.weight.ndim - 1)
            fq = fake_quant_weight(layer.weight, w_bits).float()
            self.register_buffer("w_int", torch.clamp(torch.round(fq / scale.reshape(shape)), -q, q).to(torch.int8))
            self.register_buffer("w_scale", scale)
            with torch.no_grad():
                layer.weight.copy_(dequantize(self.w_int, scale).to(layer.weight.dtype))
        if a_bits is not None:
            if a_range is None:
                raise ValueError("QuantLayer: a_range is required when a_bits is set")
            s, z = act_qparams(a_range[0], a_range[1], a_bits)
            self.register_buffer("a_range", torch.tensor(a_range, dtype=torch.float32))
            self.register_buffer("a_scale", torch.tensor(s, dtype=torch.float32))
            self.register_buffer("a_zero_point", torch.tensor(z, dtype=torch.int32))

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.a_bits is not None:
            x = fake_quant_act(x, float(self.a_scale), int(self.a_zero_point), self.a_bits)
        return self.layer(x, *args, **kwargs)


class _RangeObserver:
    """Collects one layer's input range (min/max) or a value sample (percentile)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.lo, self.hi = float("inf"), float("-inf")
        self.samples: list[Tensor] = []
        self.count = 0

    def __call__(self, _m: nn.Module, args: tuple, _out: Any) -> None:
        x = args[0].detach()
        if not bool(torch.isfinite(x).all()):
            raise ValueError("PTQ calibration activations contain NaN/Inf")
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        if self.kind == "percentile":
            v = x.reshape(-1).float()
            step = max(1, v.numel() // _MAX_SAMPLES)
            self.samples.append(v[::step].clone())
        self.count += 1

    def range(self, pct: float) -> tuple[float, float]:
        if self.kind == "minmax":
            return self.lo, self.hi
        v = torch.cat(self.samples)
        if v.numel() > _MAX_SAMPLES:
            v = v[:: (v.numel() + _MAX_SAMPLES - 1) // _MAX_SAMPLES]
        qs = torch.quantile(v, torch.tensor([1.0 - pct / 100.0, pct / 100.0]))
        return float(qs[0]), float(qs[1])


class QuantizedModel(nn.Module):
    """The fake-quantized copy of a model returned by :func:`ptq_quantize`; calls go to ``.model``."""

    def __init__(self, model: nn.Module, info: dict[str, Any]):
        super().__init__()
        self.model = model
        self.info = info

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def quant_layers(self) -> dict[str, QuantLayer]:
        return {n: m for n, m in self.model.named_modules() if isinstance(m, QuantLayer)}

    def save(self, path: str | Path) -> Path:
        """One safetensors file: integer weights (int8) + scales of the quantized layers, activation
        qparams, and every other tensor of the model in floating point; written atomically."""
        tensors: dict[str, Tensor] = {}
        for name, t in self.model.state_dict().items():
            if name.endswith("layer.weight") and isinstance(self.model.get_submodule(name[: -len(".layer.weight")]), QuantLayer) \
                    and self.info["w_bits"] is not None:
                continue  # stored as w_int + w_scale
            tensors[name] = t
        return io.save_tensors(path, tensors, {"kind": "condiquant-ptq", **self.info})


def load_quantized(path: str | Path, model: nn.Module) -> QuantizedModel:
    """Rebuild a :class:`QuantizedModel` saved by :meth:`QuantizedModel.save` on ``model``'s architecture
    (a floating-point model of the same class and shapes; it is copied, not changed)."""
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != "condiquant-ptq":
        raise ArtifactError(f"{path} is not a CondiQuant PTQ file (kind={meta.get('kind')!r})")
    q = copy.deepcopy(model)
    for name in meta["layers"]:
        rng = meta["ranges"].get(name)
        layer = q.get_submodule(name)
        replace_module(q, name, QuantLayer(layer, None, meta["a_bits"], tuple(rng) if rng else None))
        ql = q.get_submodule(name)
        ql.w_bits = meta["w_bits"]
        if meta["w_bits"] is not None:
            w_int, scale = tensors[f"{name}.w_int"], tensors[f"{name}.w_scale"]
            ql.register_buffer("w_int", w_int)
            ql.register_buffer("w_scale", scale)
            with torch.no_grad():
                ql.layer.weight.copy_(dequantize(w_int, scale).to(ql.layer.weight.dtype))
    missing, unexpected = q.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.endswith("layer.weight")]
    if missing or unexpected:
        raise ArtifactError(f"{path}: tensors do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return QuantizedModel(q, dict(meta))


def ptq_quantize(model: nn.Module, calib: Iterable[Any], w_bits: int | None = 4, a_bits: int | None = 4, *,
                 observer: str = "minmax", percentile: float = 99.9, target: Any = None,
                 layer_types: tuple[type, ...] = (nn.Linear, nn.Conv2d), skip: tuple[str, ...] = (),
                 forward: Callable[[nn.Module, Any], Any] | None = None) -> QuantizedModel:
    """A fake-quantized copy of ``model`` (the original is not changed): the selected layers' weights at
    ``w_bits`` and their inputs at ``a_bits`` (each 2..8, or None for floating point), activation bounds
    from ``calib`` by ``observer`` (``"minmax"`` or ``"percentile"`` at ``percentile``)."""
    w_bits = check_bits("ptq_quantize.w_bits", w_bits)
    a_bits = check_bits("ptq_quantize.a_bits", a_bits)
    check_choice("ptq_quantize.observer", observer, OBSERVERS)
    pct = check_number("ptq_quantize.percentile", percentile, lo=50.0, hi=100.0, low_open=True)
    q = copy.deepcopy(model)
    hits = select(q, target, tuple(layer_types), allow_empty=True)
    if skip:
        sk = matcher([skip] if isinstance(skip, str) else list(skip))
        hits = [(n, m) for n, m in hits if not sk(n, m)]
    if not hits:
        raise SelectionError(f"ptq_quantize found no layer to quantize; available: {available_names(q, tuple(layer_types))[:40]}")
    ranges: dict[str, tuple[float, float]] = {}
    if a_bits is not None:
        obs = {n: _RangeObserver(observer) for n, _ in hits}
        handles = [m.register_forward_hook(obs[n]) for n, m in hits]
        fwd, n_batches = forward or default_forward, 0
        was = q.training
        try:
            q.eval()
            with torch.no_grad():
                for batch in calib:
                    fwd(q, batch)
                    n_batches += 1
        finally:
            for h in handles:
                h.remove()
            q.train(was)
        if n_batches == 0:
            raise ValueError("ptq_quantize: the calibration data is empty")
        silent = [n for n, o in obs.items() if o.count == 0]
        if silent:
            raise ValueError(f"ptq_quantize: no calibration input reached {silent[:10]}")
        ranges = {n: o.range(pct) for n, o in obs.items()}
    for n, m in hits:
        replace_module(q, n, QuantLayer(m, w_bits, a_bits, ranges.get(n)))
    info = {"w_bits": w_bits, "a_bits": a_bits, "observer": observer, "percentile": pct,
            "layers": [n for n, _ in hits], "ranges": {n: list(r) for n, r in ranges.items()}}
    return QuantizedModel(q.eval(), info)


def levels(t: Tensor) -> int:
    """The number of distinct values of ``t`` (for the "<= 2^b levels" check)."""
    return int(torch.unique(t).numel())

