"""Quantization-aware training: weight fake-quantizers (STE min-max, LSQ, ParetoQ's SEQ / sign /
ternary), the quantized linear layer and export (:mod:`.baselines`), and WinQ (:mod:`.winq`).

torchao's own QAT (the ``peers`` extra) runs as a peer row in the WinQ reproduction's quick mode.
"""

from rankwise.train.qat.baselines import (
    QUANTIZERS,
    QATConfig,
    QuantLinear,
    check_and_clamp_,
    dequantize,
    distinct_levels,
    export_quantized,
    fake_quant,
    load_quantized,
    prepare_qat,
    quant_layers,
    quantize_codes,
)
from rankwise.train.qat.winq import (
    WinQCallback,
    WinQConfig,
    distance_to_grid,
    interpolation_reset,
    perturbed_gradient,
    winq,
)

__all__ = [
    "QATConfig",
    "QUANTIZERS",
    "QuantLinear",
    "WinQCallback",
    "WinQConfig",
    "check_and_clamp_",
    "dequantize",
    "distance_to_grid",
    "distinct_levels",
    "export_quantized",
    "fake_quant",
    "interpolation_reset",
    "load_quantized",
    "perturbed_gradient",
    "prepare_qat",
    "quant_layers",
    "quantize_codes",
    "winq",
]
