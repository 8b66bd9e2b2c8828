"""CDKA: component-designed Kronecker adapters (ICML 2026, "Diving into Kronecker Adapters: Component Design Matters").

A frozen linear layer ``W0 (d_out, d_in)`` gets a sum of ``r`` Kronecker components::

    ΔW = s * sum_{k<r} B_k ⊗ A_k,    B_k: (d_out/r1, r2),   A_k: (r1, d_in/r2),   s = alpha / sqrt(r)

(``s = alpha / r`` with ``use_rslora=False``). Block ``(p, q)`` of ``B_k ⊗ A_k`` is ``B_k[p, q] * A_k``,
so ``rank(ΔW) <= r * r1 * r2`` while the adapter holds only ``P = r * ((d_out/r1) * r2 + r1 * (d_in/r2))``
parameters. With ``r1 = r2 = 1`` a component is an outer product and CDKA *is* rank-``r`` LoRA; with
``r = 1`` it is a single Kronecker adapter (LoKr-like).

The component design comes from the Van Loan rearrangement ``R`` (:func:`rearrange`): with
``m1 = d_out/r1, n1 = r2, m2 = r1, n2 = d_in/r2``, ``R(B ⊗ A) = vec(B) vec(A)^T`` (row-major vec), so the
best ``sum_{k<r} B_k ⊗ A_k`` approximation of a matrix is the rank-``r`` truncated SVD of its
rearrangement. For the full fine-tuning gradient ``G = dL/dW0`` (averaged over calibration batches)
the *alignment score* of a configuration is::

    align(r1, r2, r) = sum_{k<=r} sigma_k(R(G))^2 / ||G||_F^2      in [0, 1]

the fraction of the first full-fine-tuning step that the adapter family can express. Per adapted
layer (``config_mode="aligned"``) CDKA enumerates every ``(r1, r2, r)`` with ``r1 | d_out``,
``r2 | d_in`` and ``P`` within ``budget_tolerance`` of the per-matrix budget, and keeps the one with
the largest alignment (ties: more components ``r``, then ``P`` closest to the budget, then the
smallest ``(r1, r2)``). ``config_mode="fixed"`` takes ``(r1, r2, r)`` from the config.

Initialisation (``init="gradient"``, the official recipe): the top-``r`` singular triplets
``(u_k, sigma_k, v_k)`` of ``R(-G)`` give ``vec(B_k) = c sqrt(sigma_k/sigma_1) u_k`` and
``vec(A_k) = c sqrt(sigma_k/sigma_1) v_k`` (``c = init_scale = 1/sqrt(1024)``); the initial update is
removed so that the model's output at step 0 is the pretrained one. The paper stores the residual
``W0 - s sum B_k(0) ⊗ A_k(0)`` as the frozen weight; rankwise keeps ``W0`` untouched and stores the
initial factors as frozen buffers ``B0, A0`` instead, computing ``W0 x + s (sum B_k ⊗ A_k - sum B0_k ⊗ A0_k) x``.
Both define the same function and the same merged weight; this form keeps disable / several named
adapters / the base-model fingerprint exact (see docs/methods/cdka.md). ``init="zero"``: ``A_k``
Kaiming-uniform, ``B_k = 0`` (no offset).

The forward pass never forms ``ΔW``: with ``X = x.reshape(r2, d_in/r2)`` (row-major),
``(B ⊗ A) vec(X) = vec(B X A^T)``; cost ``O(r (r1 d_in + d_out r2))`` per token (:func:`kron_apply`).

Usage::

    from rankwise.adapt.cdka import CDKAConfig, adapt, merge, report, save_adapter
    adapt(model, CDKAConfig(budget="lora_r8"), calib=batches, loss_fn=lambda m, b: m(**b).loss)
    print(report(model))        # per layer: (r1, r2, r), parameters, alignment
    ...train the parameters with requires_grad...
    merge(model)                # exact: W = W0 + s sum (B_k ⊗ A_k - B0_k ⊗ A0_k)

Storage: factors are held as stacks ``A (r, r1, d_in/r2)`` and ``B (r, d_out/r1, r2)``;
:func:`to_official_layout` / :func:`from_official_layout` convert to the official code's stacked
matrices (``(r*r1, d_in/r2)`` with component ``i`` in rows ``i::r``, ``(d_out/r1, r*r2)`` with
component ``i`` in columns ``i::r``).
"""

from __future__ import annotations

from rankwise.adapt.cdka.config import (  # noqa: F401
    CDKAConfig,
    CONFIG_FILE,
    CONFIG_MODES,
    INITS,
    LossFn,
    parse_budget,
    TIE_RTOL,
    WEIGHTS_FILE,
)
from rankwise.adapt.cdka.functional import (  # noqa: F401
    alignment,
    alignment_curve,
    candidates,
    CDKAChoice,
    check_shape,
    choose_configuration,
    divisors,
    from_official_layout,
    gradient_init,
    kron_apply,
    kron_delta,
    kron_rearrange,
    num_parameters,
    NumericalError,
    rearrange,
    squared_singular_values,
    to_official_layout,
)
from rankwise.adapt.cdka.layer import (  # noqa: F401
    AdapterLayer,
    CDKALinear,
    RankwiseError,
    validate_adapter_name,
)
from rankwise.adapt.cdka.model import (  # noqa: F401
    adapt,
    adapter_names,
    apply_cdka,
    CDKA,
    cdka_layers,
    collect_gradients,
    default_loss,
    delete_adapter,
    disable_adapters,
    enable_adapters,
    load_adapter,
    merge,
    register,
    replace_module,
    report,
    save_adapter,
    Selector,
    set_active,
    unload,
    unmerge,
)

__all__ = [
    "CDKAChoice",
    "CDKAConfig",
    "CDKALinear",
    "adapt",
    "adapter_names",
    "alignment",
    "alignment_curve",
    "apply_cdka",
    "candidates",
    "cdka_layers",
    "choose_configuration",
    "collect_gradients",
    "delete_adapter",
    "disable_adapters",
    "divisors",
    "enable_adapters",
    "from_official_layout",
    "gradient_init",
    "kron_apply",
    "kron_delta",
    "load_adapter",
    "merge",
    "num_parameters",
    "parse_budget",
    "rearrange",
    "report",
    "squared_singular_values",
    "save_adapter",
    "set_active",
    "to_official_layout",
    "unload",
    "unmerge",
]
