"""Intrinsic training dynamics: when a gradient flow on theta is a closed flow on z = phi(theta).

Paper: "Intrinsic training dynamics of deep neural networks" (Marcotte, Peyre, Gribonval),
arXiv 2508.07370, ICLR 2026. Spec: ``shared/methods/intrinsic_dynamics.md``.

The gradient flow ``theta' = -grad_theta l(phi(theta))`` moves the lifted variable as
``z' = J theta' = -J J^T grad l(z) = -M(theta) grad l(z)`` with ``J = d phi / d theta`` and the metric
``M(theta) = J J^T``. The flow of ``z`` is *intrinsic* when ``M(theta) = F(phi(theta), h(theta_0))`` for
conserved quantities ``h``. This module gives

* lifted systems with their conservation laws and, where one exists, the closed-form intrinsic
  velocity ``z' = -F(z, h) grad l(z)``: :class:`LinearFactorization` (``Z = U V^T``, lambda-balanced
  formula), :class:`DeepLinear` (balanced, Arora et al. 2018), :class:`ReLUNet` (one hidden layer,
  path-lifting ``z_j = a_j w_j``), :class:`DeepReLUPathLift` (criterion only), :class:`LinearODE`
  (``Z = prod (I + A_k/N)``, balanced; with its ``N -> infinity`` limit), :class:`CustomLift` (any
  ``phi`` given as a torch function);
* :func:`simulate_flow` (RK4 on the parameter flow: the ground truth) and :func:`intrinsic_flow`
  (RK4 on the lifted flow), :func:`euclidean_flow` (the naive ``z' = -grad l(z)`` baseline);
* :func:`check_criterion` (the kernel inclusion ``ker d phi ∩ ker d h ⊂ ker dM``, tested by ranks),
  :func:`level_set_counterexample` (two parameters with the same ``z`` and the same ``h`` but different
  metrics, found when the criterion fails) and :func:`conservation_law_count` (number of independent
  conservation laws of any ``phi`` from the rank of the Lie algebra its gradient fields generate).

Everything is float64 torch. Parameters are flat 1-D tensors ``theta`` (each system documents
its layout and has ``split``); ``z`` keeps its natural shape.

Layout of the package: :mod:`.common` (dtype, floors, Jacobians, PSD powers), :mod:`.losses`,
:mod:`.systems` (the lifted systems), :mod:`.flows` (the three flows and :class:`FlowResult`),
:mod:`.criterion` (criterion, counterexamples, conservation laws) and this module (the registered
entry point :func:`run_comparison`); every public name is importable from here.
"""

from __future__ import annotations

from typing import Any

from rankwise.core.registry import register
from rankwise.science.intrinsic_dynamics.common import NotIntrinsicError, psd_power
from rankwise.science.intrinsic_dynamics.criterion import (
    CriterionReport,
    check_criterion,
    conservation_law_count,
    level_set_counterexample,
)
from rankwise.science.intrinsic_dynamics.flows import (
    FlowResult,
    IntrinsicConfig,
    compare,
    euclidean_flow,
    intrinsic_flow,
    simulate_flow,
)
from rankwise.science.intrinsic_dynamics.losses import (
    CallableLoss,
    FrobeniusLoss,
    LeastSquaresLoss,
    Loss,
    ReLURegressionLoss,
)
from rankwise.science.intrinsic_dynamics.systems import (
    CustomLift,
    DeepLinear,
    DeepReLUPathLift,
    LiftedSystem,
    LinearFactorization,
    LinearODE,
    ReLUNet,
    ReLUPathLift,
)

__all__ = [
    "IntrinsicConfig",
    "FlowResult",
    "CriterionReport",
    "NotIntrinsicError",
    "LiftedSystem",
    "LinearFactorization",
    "DeepLinear",
    "ReLUNet",
    "ReLUPathLift",
    "DeepReLUPathLift",
    "LinearODE",
    "CustomLift",
    "FrobeniusLoss",
    "LeastSquaresLoss",
    "ReLURegressionLoss",
    "CallableLoss",
    "simulate_flow",
    "intrinsic_flow",
    "euclidean_flow",
    "compare",
    "check_criterion",
    "level_set_counterexample",
    "conservation_law_count",
    "psd_power",
    "run_comparison",
]

# --------------------------------------------------------------------------------------------------
# Registry entry point


def run_comparison(system: LiftedSystem, theta0: Any, loss: Loss, config: IntrinsicConfig | None = None
                   ) -> dict[str, Any]:
    """Parameter flow vs intrinsic flow (and the Euclidean guess) from ``theta0``: the registered entry point.

    Returns ``{"parameter": FlowResult, "intrinsic": FlowResult, "euclidean": FlowResult,
    "max_rel_error": float, "euclidean_rel_error": float, "conservation_residual": float,
    "criterion": CriterionReport}``.
    """
    cfg = config or IntrinsicConfig()
    th0 = system.check_theta(theta0)
    p = simulate_flow(system, th0, loss, cfg)
    i = intrinsic_flow(system, system.phi(th0).detach(), system.invariants(th0), loss, cfg)
    e = euclidean_flow(system.phi(th0).detach(), loss, cfg)
    return {"parameter": p, "intrinsic": i, "euclidean": e, "max_rel_error": float(compare(p, i).max()),
            "euclidean_rel_error": float(compare(p, e).max()),
            "conservation_residual": float(p.conservation_residual().max()),
            "criterion": check_criterion(system, th0)}


register("intrinsic_dynamics", config=IntrinsicConfig, entry=run_comparison)
