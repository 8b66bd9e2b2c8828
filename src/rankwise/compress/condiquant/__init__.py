"""CondiQuant: lower the condition number of each weight before low-bit post-training quantization.

Liu et al., "CondiQuant: Condition Number Based Low-Bit Quantization for Image Super-Resolution",
ICML 2026 (arXiv 2502.15478). Spec: ``shared/methods/condiquant.md``.

A relative perturbation of a layer's input (the activation quantization error) is amplified by at most
``kappa(W) = sigma_max / sigma_min`` (Eq. 5). Because the calibration features ``X`` are nearly rank
deficient, ``W`` can be moved where ``X`` does not look without changing ``X W``: proximal gradient
descent on ``||X W - X W0||^2 / (2 L) + lambda G(W)`` with a singular-value prox (Eq. 7) lowers kappa at a
fixed output, in place and with zero inference overhead; ordinary PTQ follows::

    from rankwise.compress.condiquant import CondiQuantConfig, condition_model, ptq_quantize
    report = condition_model(model, calib, CondiQuantConfig(prox="spread", skip=("head", "tail")))
    print(report.summary())                      # kappa before -> after, lambda, output error per layer
    qmodel = ptq_quantize(model, calib, w_bits=3, a_bits=3, observer="minmax")
    qmodel.save("sr_w3a3.safetensors")           # int8-coded weights + scales, same layer shapes

Layout: ``config`` (:class:`CondiQuantConfig`, :data:`LAMBDA_GRID`), ``condition`` (the pure math: kappa,
the ``spread`` / ``shave`` prox, the PGD loop, the lambda search of one matrix), ``model``
(:func:`condition_model`: ``X^T X`` from :mod:`rankwise.core.stats`, Linear and Conv2d layers, a 1x1 conv
being a Linear over channels), ``ptq`` (:func:`ptq_quantize`: W2A2-W8A8, MinMax and Percentile observers).
"""

from rankwise.compress.condiquant.condition import (
    LayerResult,
    MatrixResult,
    condition_matrix,
    condition_weight,
    kappa,
    output_grad,
    output_loss,
    prox_shave,
    prox_spread,
    rel_output_err,
    singular_values,
)
from rankwise.compress.condiquant.config import LAMBDA_GRID, PROXES, SPEC_LAMBDA_GRID, CondiQuantConfig
from rankwise.compress.condiquant.model import (
    CondiQuantReport,
    collect_xtx,
    condition_model,
    layer_matrix,
    layer_rows,
    target_layers,
)
from rankwise.compress.condiquant.ptq import (
    OBSERVERS,
    QuantizedModel,
    QuantLayer,
    act_qparams,
    check_bits,
    dequantize,
    fake_quant_act,
    fake_quant_weight,
    levels,
    load_quantized,
    ptq_quantize,
    weight_qparams,
)
from rankwise.core.registry import register

__all__ = [
    "CondiQuantConfig", "LAMBDA_GRID", "SPEC_LAMBDA_GRID", "PROXES", "condition_model", "CondiQuantReport", "ptq_quantize",
    "QuantizedModel", "QuantLayer", "load_quantized", "OBSERVERS", "LayerResult", "MatrixResult",
    "condition_matrix", "condition_weight", "kappa", "singular_values", "prox_spread", "prox_shave",
    "output_loss", "output_grad", "rel_output_err", "collect_xtx", "layer_matrix", "layer_rows",
    "target_layers", "act_qparams", "weight_qparams", "check_bits", "dequantize", "fake_quant_act",
    "fake_quant_weight", "levels",
]

register("condiquant", config=CondiQuantConfig, entry=condition_model, module=__name__)
