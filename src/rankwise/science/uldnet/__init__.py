"""ULD-Net: ultra-low-degree fully polynomial networks with PolyNorm, for CKKS-encrypted inference.

Paper: "ULD-Net: Enabling Ultra-Low-Degree Fully Polynomial Networks for Homomorphically Encrypted
Inference" (ICLR 2026; spec ``shared/methods/uldnet.md``).

Layout: :mod:`.config` (:class:`ULDConfig`, PolyNorm's quadratic ``g``), :mod:`.layers` (:class:`PolyNorm`,
:class:`PolyAct`, the post-hoc baseline's :class:`PolyFitAct` / :class:`ChebNorm`), :mod:`.model`
(:func:`convert` by module surgery, :func:`posthoc`, :func:`mlp`), :mod:`.train` (warm-up switch and
variance penalties), :mod:`.he` (:func:`count_depth`, :func:`choose_parameters`, :func:`export_ckks` on
TenSEAL, imported lazily).

Example::

    from rankwise.science import uldnet
    cfg = uldnet.ULDConfig(act_degree=2, k=4.0, mu=2.0, lam1=1e-3, lam2=1e-2, warmup_frac=0.2)
    model = uldnet.convert(torch_model, cfg)        # norms -> PolyNorm, activations -> PolyAct
    uldnet.train(model, loader, epochs=40)          # warm-up, switch, L1/L2 penalties
    he = uldnet.export_ckks(model, security=128)    # depth, N, modulus chain
    logits = he.infer_encrypted(x); he.depth, he.poly_modulus_degree
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.science.uldnet.config import K_SUPPRESS, ULDConfig, g_coefficients, g_value
from rankwise.science.uldnet.he import (
    MAX_MODULUS_BITS,
    CKKSModel,
    DepthCount,
    DepthError,
    OpDepth,
    UnsupportedOpError,
    choose_parameters,
    count_depth,
    export_ckks,
    seal_primes,
)
from rankwise.science.uldnet.layers import ChebNorm, PolyAct, PolyFitAct, PolyNorm, PolyNormRangeWarning, cheb_eval
from rankwise.science.uldnet.model import convert, mlp, non_polynomial_modules, polynorms, posthoc
from rankwise.science.uldnet.train import TrainResult, mix_schedule, train, variance_penalty

__all__ = [
    "K_SUPPRESS", "MAX_MODULUS_BITS", "CKKSModel", "ChebNorm", "DepthCount", "DepthError", "OpDepth", "PolyAct",
    "PolyFitAct", "PolyNorm", "PolyNormRangeWarning", "TrainResult", "ULDConfig", "UnsupportedOpError",
    "cheb_eval", "choose_parameters", "convert", "count_depth", "export_ckks", "g_coefficients", "g_value",
    "mix_schedule", "mlp", "non_polynomial_modules", "polynorms", "posthoc", "seal_primes", "train",
    "variance_penalty",
]

register("uldnet", config=ULDConfig, entry=convert)
