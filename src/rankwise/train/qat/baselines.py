"""Weight-only quantization-aware training (QAT): fake quantizers, the quantized linear layer, export.

The base QAT methods that WinQ (:mod:`rankwise.train.qat.winq`) is added on top of:

* ``"minmax"`` -- STE fake-quant with min-max scales: ``W_hat = s clamp(round(W/s), -Q_N, Q_P)``,
  ``s = max|W_row| / Q_P`` recomputed at every forward (not learned), ``Q_N = 2^{b-1}``,
  ``Q_P = 2^{b-1} - 1``; ``dW_hat/dW = 1`` inside the clip range, 0 outside. Bits {2, 3, 4, 8}.
* ``"lsq"`` -- learned step size (Esser et al. 2020): ``s`` learnable per output channel, initialised
  to ``2 mean|W_row| / sqrt(Q_P)``; ``dW_hat/ds = round(W/s) - W/s`` inside the range, ``-Q_N`` or
  ``Q_P`` outside; the gradient of ``s`` is scaled by ``1/sqrt(numel(W) Q_P)``. Bits {2, 3, 4, 8}.
* ``"seq"`` -- ParetoQ's stretched elastic quantizer for 2 and 3 bits and ternary (1.58 bits):
  ``W_hat = alpha (round(clamp(W/alpha, -c, c) n - shift) + shift) / n`` with ``n = 2^{b-1}``,
  ``shift = 1/2`` (levels symmetric, no zero: 2-bit levels +-alpha/4, +-3 alpha/4) and for ternary
  ``n = 1.5``, ``shift = 0`` (levels 0, +-2 alpha/3); ``c = 0.99`` keeps ``|W| = alpha`` on the outer
  level (ParetoQ's ``clip_val``); ``alpha`` learnable per channel, initialised to ``max|W_row|``.
  Gradients as LSQ with the level function in place of ``round``, scale ``1/sqrt(numel(W) Q_P)``.
* ``"sign"`` -- 1-bit ``alpha sign(W)`` (``sign(0) = +1``), ``alpha`` learnable per channel,
  initialised to ``mean|W_row|``; ``dW_hat/dW = 1`` for ``|W| <= alpha``, ``dW_hat/dalpha = sign(W)``,
  scale ``1/sqrt(numel(W))``.
* ``"paretoq"`` -- ParetoQ's bit-specific choice: 1 -> sign, 1.58 -> ternary SEQ, 2 -> SEQ,
  3/4/8 -> LSQ with the scale initialised to ``max|W_row| / (2^{b-1} - 1)``.

Every quantizer is written with straight-through ``round`` (``round(x).detach() + (x - x.detach())``) and
``clamp``, so autograd produces the gradients above and also supports double backward
(Hessian-vector products, used by the WinQ reproduction).

:func:`prepare_qat` swaps the targeted ``nn.Linear`` modules of a model for :class:`QuantLinear`
(in place, all or nothing); :func:`export_quantized` writes integer codes + scales as safetensors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError

__all__ = [
    "QUANTIZERS",
    "QATConfig",
    "QuantLinear",
    "check_and_clamp_",
    "dequantize",
    "distinct_levels",
    "export_quantized",
    "fake_quant",
    "init_scale",
    "load_quantized",
    "parse_bits",
    "prepare_qat",
    "quant_layers",
    "quantize_codes",
    "round_ste",
]

SCALE_FLOOR = 1e-5  # every scale / clip value is clamped to >= this (spec: zero or negative scales)
SEQ_CLIP = 0.99  # ParetoQ's clip_val: keeps |W| = alpha on the outermost level

#: quantizer -> supported bit-widths (1.58 is ternary)
QUANTIZERS: dict[str, tuple[float, ...]] = {
    "minmax": (2, 3, 4, 8),
    "lsq": (2, 3, 4, 8),
    "seq": (1.58, 2, 3),
    "sign": (1,),
    "ternary": (1.58,),
    "paretoq": (1, 1.58, 2, 3, 4, 8),
}


def parse_bits(w_bits: Any) -> float:
    """``1, 1.58, "ternary", 2, 3, 4, 8`` -> a float bit-width (ternary is 1.58)."""
    if isinstance(w_bits, str):
        if w_bits.strip().lower() in ("ternary", "1.58"):
            return 1.58
        raise ValueError(f"w_bits={w_bits!r} must be one of 1, 1.58 ('ternary'), 2, 3, 4, 8")
    if isinstance(w_bits, bool) or not isinstance(w_bits, numbers.Real):
        raise TypeError(f"w_bits must be a number or 'ternary', got {type(w_bits).__name__}")
    b = float(w_bits)
    if b in (1.0, 2.0, 3.0, 4.0, 8.0):
        return b
    if abs(b - 1.58) < 1e-3:
        return 1.58
    raise ValueError(f"w_bits={w_bits!r} must be one of 1, 1.58 ('ternary'), 2, 3, 4, 8")


def resolve(quantizer: str, bits: float) -> str:
    """The concrete quantizer (``minmax``, ``lsq``, ``seq``, ``sign``) for ``quantizer`` at ``bits``."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer={quantizer!r} must be one of {sorted(QUANTIZERS)}")
    if bits not in QUANTIZERS[quantizer]:
        raise ValueError(f"w_bits={bits:g} is not supported by quantizer {quantizer!r}; "
                         f"supported: {list(QUANTIZERS[quantizer])}")
    if quantizer == "paretoq":
        return {1.0: "sign", 1.58: "seq", 2.0: "seq"}.get(bits, "lsq")
    if quantizer == "ternary":
        return "seq"
    return quantizer


def _qn_qp(bits: float) -> tuple[int, int]:
    b = int(bits)
    return 2 ** (b - 1), 2 ** (b - 1) - 1


def _seq_levels(bits: float) -> tuple[float, float]:
    """(n, shift) of the SEQ level function."""
    if bits == 1.58:
        return 1.5, 0.0
    return float(2 ** (int(bits) - 1)), 0.5


def _grad_scale_qp(kind: str, bits: float) -> int:
    """The Q_P of the gradient-scale rule 1/sqrt(numel Q_P) (ParetoQ: 1 for sign and ternary)."""
    if kind == "sign" or bits == 1.58:
        return 1
    return _qn_qp(bits)[1]


# --------------------------------------------------------------------------------------------------
# straight-through building blocks


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward (exactly), identity backward (straight-through estimator); twice differentiable."""
    return torch.round(x).detach() + (x - x.detach())


def _scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` forward, gradient multiplied by ``factor`` backward."""
    y = x * factor
    return (x - y).detach() + y


def init_scale(w: torch.Tensor, kind: str, bits: float, quantizer: str = "") -> torch.Tensor | None:
    """Per-output-channel initial scale / clip value (shape (out, 1)); ``None`` for min-max.

    sign: mean|W_row|; seq (2-bit, ternary, 3-bit): max|W_row|; lsq: 2 mean|W_row| / sqrt(Q_P),
    or max|W_row| / (2^{b-1} - 1) under ``quantizer="paretoq"`` (the WinQ/ParetoQ initialisation).
    Computed in float64, clamped to >= 1e-5.
    """
    a = w.detach().double().abs().reshape(w.shape[0], -1)
    if kind == "minmax":
        return None
    if kind == "sign":
        s = a.mean(dim=1, keepdim=True)
    elif kind == "seq":
        s = a.amax(dim=1, keepdim=True)
    elif kind == "lsq":
        qp = _qn_qp(bits)[1]
        s = a.amax(dim=1, keepdim=True) / qp if quantizer == "paretoq" else 2 * a.mean(dim=1, keepdim=True) / math.sqrt(qp)
    else:
        raise ValueError(f"unknown quantizer kind {kind!r}")
    return s.clamp_min(SCALE_FLOOR).to(w.dtype)


def fake_quant(w: torch.Tensor, scale: torch.Tensor | None, kind: str, bits: float) -> torch.Tensor:
    """Quantize-dequantize ``w`` (out, in) with per-channel ``scale`` (out, 1); same shape as ``w``.

    ``kind`` is a concrete quantizer (``minmax``, ``lsq``, ``seq``, ``sign``); see the module
    docstring for each rule and its gradients.
    """
    if kind == "minmax":
        qn, qp = _qn_qp(bits)
        s = (w.detach().abs().amax(dim=1, keepdim=True) / qp).clamp_min(SCALE_FLOOR)
        return s * round_ste(torch.clamp(w / s, -qn, qp))
    if scale is None:
        raise RankwiseError(f"quantizer {kind!r} needs a learnable scale")
    g = 1.0 / math.sqrt(w.numel() * _grad_scale_qp(kind, bits))
    s = _scale_grad(scale.clamp_min(SCALE_FLOOR), g)
    if kind == "lsq":
        qn, qp = _qn_qp(bits)
        return s * round_ste(torch.clamp(w / s, -qn, qp))
    if kind == "seq":
        n, shift = _seq_levels(bits)
        v = torch.clamp(w / s, -SEQ_CLIP, SEQ_CLIP)
        return s * (round_ste(v * n - shift) + shift) / n
    if kind == "sign":
        sgn = torch.where(w >= 0, 1.0, -1.0).to(w.dtype)
        # value alpha*sign(W); dW_hat/dW = 1 on |W| <= alpha (clipped STE), dW_hat/dalpha = sign(W)
        v = torch.clamp(w / s.detach(), -1.0, 1.0)
        return s * (sgn + (v - v.detach()))
    raise ValueError(f"unknown quantizer kind {kind!r}")


def quantize_codes(w: torch.Tensor, scale: torch.Tensor | None, kind: str, bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes (int8, shape of ``w``) and the per-channel scale (out, 1) used for them.

    Dequantization (:func:`dequantize`): ``scale * (code + shift) / n`` with ``(n, shift)`` = (1, 0) for
    minmax / lsq / sign and the SEQ level parameters for seq.
    """
    with torch.no_grad():
        if kind == "minmax":
            qn, qp = _qn_qp(bits)
            s = (w.abs().amax(dim=1, keepdim=True) / qp).clamp_min(SCALE_FLOOR)
            codes = torch.clamp(torch.round(w / s), -qn, qp)
        elif kind == "lsq":
            qn, qp = _qn_qp(bits)
            s = scale.clamp_min(SCALE_FLOOR)
            codes = torch.clamp(torch.round(w / s), -qn, qp)
        elif kind == "seq":
            n, shift = _seq_levels(bits)
            s = scale.clamp_min(SCALE_FLOOR)
            codes = torch.round(torch.clamp(w / s, -SEQ_CLIP, SEQ_CLIP) * n - shift)
        elif kind == "sign":
            s = scale.clamp_min(SCALE_FLOOR)
            codes = torch.where(w >= 0, 1.0, -1.0)
        else:
            raise ValueError(f"unknown quantizer kind {kind!r}")
    return codes.to(torch.int8), s.detach().clone()


def _levels(kind: str, bits: float) -> tuple[float, float]:
    return _seq_levels(bits) if kind == "seq" else (1.0, 0.0)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str, bits: float) -> torch.Tensor:
    """Inverse of :func:`quantize_codes`: ``scale * (codes + shift) / n`` (float32)."""
    n, shift = _levels(kind, bits)
    return scale.float() * (codes.float() + shift) / n


def distinct_levels(w_hat: torch.Tensor) -> int:
    """The largest number of distinct values in one output channel (row) of ``w_hat``."""
    return max(int(torch.unique(row).numel()) for row in w_hat.detach())


# --------------------------------------------------------------------------------------------------
# the quantized linear layer


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose forward uses the fake-quantized weight ``Q_b(W + U_w; c + U_c)``.

    ``weight`` (out, in) are the latent full-precision weights; ``clip`` (out, 1) the learnable
    per-channel scale / clip values (``None`` for min-max). ``noise_w`` / ``noise_c`` are the optional
    pre-quantization perturbations set by WinQ for one forward/backward (plain attributes, not
    buffers, so DDP never broadcasts them). Activations stay in full precision.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, quantizer: str = "paretoq",
                 w_bits: Any = 2, device: Any = None, dtype: Any = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.w_bits = parse_bits(w_bits)
        self.quantizer = quantizer
        self.kind = resolve(quantizer, self.w_bits)
        s = init_scale(self.weight, self.kind, self.w_bits, quantizer)
        self.clip = nn.Parameter(s) if s is not None else None
        self.noise_w: torch.Tensor | None = None
        self.noise_c: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantizer: str = "paretoq", w_bits: Any = 2) -> "QuantLinear":
        """Wrap an existing ``nn.Linear``: its ``weight``/``bias`` Parameters are reused (not copied)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            q = cls(linear.in_features, linear.out_features, bias=False, quantizer="minmax", w_bits=2)
        q.weight = linear.weight
        q.bias = linear.bias
        q.w_bits = parse_bits(w_bits)
        q.quantizer = quantizer
        q.kind = resolve(quantizer, q.w_bits)
        s = init_scale(linear.weight, q.kind, q.w_bits, quantizer)
        q.clip = nn.Parameter(s) if s is not None else None
        q.noise_w = None
        q.noise_c = None
        q.train(linear.training)
        return q

    def quantized_weight(self, noisy: bool = True) -> torch.Tensor:
        """``Q_b(W (+ U_w); c (+ U_c))`` (out, in); ``noisy=False`` ignores the perturbations."""
        w = self.weight
        c = self.clip
        if noisy and self.noise_w is not None:
            w = w + self.noise_w
        if noisy and c is not None and self.noise_c is not None:
            c = c + self.noise_c
        return fake_quant(w, c, self.kind, self.w_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight(noisy=True).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quantizer={self.quantizer}({self.kind}), w_bits={self.w_bits:g}"


@dataclass(frozen=True)
class QATConfig:
    """Weight-only QAT set-up.

    ``w_bits``: 1, 1.58 (or ``"ternary"``), 2, 3, 4 or 8. ``quantizer``: ``"paretoq"`` (default:
    bit-specific), ``"seq"``, ``"lsq"``, ``"minmax"`` (STE min-max), ``"sign"``, ``"ternary"``.
    ``target``: a :func:`rankwise.core.select.select` selector of the linears to quantize (glob,
    ``"re:<regex>"``, types or a callable); ``None`` = every ``nn.Linear`` except the model's output
    embedding (LM head). Embeddings are never touched (they are not ``nn.Linear``).
    """

    w_bits: Any = 2
    quantizer: str = "paretoq"
    target: Any = None

    def __post_init__(self) -> None:
        bits = parse_bits(self.w_bits)
        object.__setattr__(self, "w_bits", bits)
        resolve(self.quantizer, bits)


def quant_layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    """The ``(name, QuantLinear)`` pairs of a prepared model, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def prepare_qat(model: nn.Module, config: QATConfig | None = None) -> nn.Module:
    """Swap the targeted ``nn.Linear`` modules of ``model`` for :class:`QuantLinear` (in place).

    All or nothing: on any error the model is left as it was. Raises
    :class:`~rankwise.core.errors.SelectionError` (listing the candidate names) when nothing
    matches and :class:`RankwiseError` when a targeted layer is already quantized. Returns ``model``.
    """
    from rankwise.core.select import select
    from rankwise.core.surgery import replace_module, transaction

    config = config or QATConfig()
    if not isinstance(config, QATConfig):
        raise TypeError(f"config must be a QATConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config.target is None:
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None

        def target(name: str, mod: nn.Module) -> bool:
            return isinstance(mod, nn.Linear) and mod is not head

        hits = select(model, target)
    else:
        hits = select(model, config.target, types=(nn.Linear,))
    already = [n for n, m in hits if isinstance(m, QuantLinear)]
    if already:
        raise RankwiseError(f"prepare_qat: {already[:5]} are already quantized (QuantLinear); prepare a model once")
    bad = [n for n, m in hits if not isinstance(m, nn.Linear)]
    if bad:
        raise RankwiseError(f"prepare_qat: only nn.Linear can be quantized; the target also matched {bad[:5]}")
    with transaction(model):
        for name, mod in hits:
            replace_module(model, name, QuantLinear.from_linear(mod, config.quantizer, config.w_bits))
    return model


@torch.no_grad()
def check_and_clamp_(model: nn.Module) -> None:
    """After an optimizer step: clamp every scale to >= 1e-5 and raise :class:`NumericalError`
    naming the first layer whose latent weights or scales are non-finite."""
    for name, layer in quant_layers(model):
        if not torch.isfinite(layer.weight).all():
            raise NumericalError(f"QAT: non-finite latent weights in layer {name!r}")
        if layer.clip is not None:
            if not torch.isfinite(layer.clip).all():
                raise NumericalError(f"QAT: non-finite scale / clip values in layer {name!r}")
            layer.clip.clamp_(min=SCALE_FLOOR)


def export_quantized(model: nn.Module, path: str | Path) -> Path:
    """Write every quantized layer as int8 codes + per-channel scales to one safetensors file.

    Tensors ``<layer>.codes`` (int8, (out, in)) and ``<layer>.scale`` (float32, (out, 1)); metadata:
    per layer the concrete quantizer, bit-width and the level parameters ``(n, shift)`` such that
    ``W_hat = scale (codes + shift) / n``. Written atomically (no partial file on error).
    """
    from rankwise.core.io import save_tensors

    layers = quant_layers(model)
    if not layers:
        raise RankwiseError("export_quantized: the model has no QuantLinear layer (call prepare_qat first)")
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"format": "rankwise-qat-v1", "layers": {}}
    for name, layer in layers:
        codes, scale = quantize_codes(layer.weight.detach(), None if layer.clip is None else layer.clip.detach(),
                                      layer.kind, layer.w_bits)
        tensors[f"{name}.codes"] = codes
        tensors[f"{name}.scale"] = scale.float()
        n, shift = _levels(layer.kind, layer.w_bits)
        meta["layers"][name] = {"kind": layer.kind, "w_bits": layer.w_bits, "n": n, "shift": shift,
                                "shape": list(layer.weight.shape)}
    return save_tensors(path, tensors, metadata=meta)


def load_quantized(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a file of :func:`export_quantized`; returns ``{layer name: dequantized weight (out, in)}``."""
    from rankwise.core.io import load_tensors

    tensors, meta = load_tensors(path)
    if meta.get("format") != "rankwise-qat-v1":
        raise ArtifactError(f"{path} is not a rankwise QAT export (format {meta.get('format')!r})")
    out = {}
    for name, info in meta["layers"].items():
        codes, scale = tensors[f"{name}.codes"], tensors[f"{name}.scale"]
        out[name] = scale * (codes.float() + info["shift"]) / info["n"]
    return out
