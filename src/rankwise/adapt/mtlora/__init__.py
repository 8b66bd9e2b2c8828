"""mtLoRA: scalable multi-task LoRA (Tian, Ledent, Sun; ICLR 2026, arXiv 2603.01526).

mtLoRA starts from HydraLoRA's asymmetric mixture (one shared down-projection ``A (r, d_in)``, ``E``
expert up-projections ``B_i (d_out, r)``, a per-token softmax router) and changes three things:

1. **Block-level adaptation.** One adapter per transformer block, parallel to the FFN sub-block
   (``placement="ffn"``, the paper's default; ``"attention"`` or ``"both"`` also exist): with ``x``
   the input of the FFN, the block computes ``FFN(x) + Adapter(x)``; the adapter bypasses the FFN's
   non-linearity. ``placement="component"`` puts the same adapter on individual linear layers
   (``Linear(x) + Adapter(x)``), which with a coarse router and no spectral term is HydraLoRA.
2. **Fine-grained routing (FGR).** The ``d_out`` output dimensions are split into ``G = d_out /
   group_size`` contiguous groups, each with its own softmax over the experts::

       logits = W_r x  (W_r: (E G, d_in)),  reshaped (G, E);  g = softmax over E within each group
       Adapter(x) = (alpha / r) * sum_i  g_i(x) ⊙ B_i (A dropout(x))        (g_i repeated group_size times)

   ``group_size = d_out`` is HydraLoRA's coarse router.
3. **Spectral-aware regularisation** of every expert ``B_i`` (:func:`spectral_penalty`): with the
   (detached) singular values ``sigma`` of ``B_i``, weights ``w_k = exp(-sigma_k / mean(sigma))`` and
   ``c = ||B_i||_F / sqrt(r)`` (detached), ``L_spec(B_i) = sum_{k,l} (w_k w_l (G - c^2 I)_{kl})^2``;
   low singular directions are pushed to orthogonality, high ones (the shared knowledge) left free.

The training loss is ``L_task + balance_alpha * L_bal + spectral_lambda * L_spec`` with HydraLoRA's
load-balance term ``L_bal`` (squared coefficient of variation of the mean routing weights over the
experts, summed over adapters) and ``L_spec`` added only on scheduled steps (every
``spectral_every`` steps); :func:`mtlora_regularizers` computes both from the last forward pass.

Which basis the spectral weights act in is a choice (the spec allows either):
``spectral_basis="singular"`` (default) expresses the Gram matrix in ``B_i``'s own right-singular
basis (``V^T B^T B V``), so that weight ``w_k`` multiplies exactly the k-th singular direction;
``"column"`` is the official code's variant, which multiplies the weight of the k-th largest
singular value onto the k-th column index of ``B_i``.

Usage::

    from rankwise.adapt.mtlora import MtLoRAConfig, adapt, mtlora_regularizers
    model = adapt(hf_model, MtLoRAConfig(rank=8, alpha=32, num_experts=4, routing_group_size=192,
                                         spectral_lambda=0.5, spectral_every=50))
    for step, batch in enumerate(loader):
        loss = task_loss(model(**batch)) + mtlora_regularizers(model, step)
        ...

A routed mixture is input dependent, and a block-level adapter reads the FFN's input and writes to
its output around a non-linearity, so mtLoRA cannot be folded into the base weights: :func:`merge`
raises :class:`~rankwise.core.errors.RankwiseError` saying so.
"""

from __future__ import annotations

from rankwise.adapt.mtlora.config import (  # noqa: F401
    BASES,
    BLOCK_PAIRS,
    CONFIG_FILE,
    CV_EPS,
    hydralora_config,
    MtLoRAConfig,
    num_parameters,
    PLACEMENTS,
    WEIGHTS_FILE,
)
from rankwise.adapt.mtlora.functional import (  # noqa: F401
    balance_loss,
    NumericalError,
    routing_weights,
    spectral_due,
    spectral_penalty,
    spectral_weights,
)
from rankwise.adapt.mtlora.layer import (  # noqa: F401
    AdapterLayer,
    MtLoRALinear,
    RankwiseError,
    replace_module,
)
from rankwise.adapt.mtlora.model import (  # noqa: F401
    adapt,
    adapter_names,
    apply_mtlora,
    delete_adapter,
    disable_adapters,
    enable_adapters,
    load_adapter,
    matcher,
    merge,
    MTLORA,
    mtlora_layers,
    mtlora_regularizers,
    register,
    routing_report,
    save_adapter,
    select,
    SelectionError,
    Selector,
    set_active,
    spectrum_report,
    unload,
    unmerge,
)

__all__ = [
    "PLACEMENTS",
    "MtLoRAConfig",
    "MtLoRALinear",
    "adapt",
    "adapter_names",
    "apply_mtlora",
    "balance_loss",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "hydralora_config",
    "load_adapter",
    "merge",
    "mtlora_layers",
    "mtlora_regularizers",
    "num_parameters",
    "routing_report",
    "routing_weights",
    "save_adapter",
    "set_active",
    "spectral_due",
    "spectral_penalty",
    "spectral_weights",
    "spectrum_report",
    "unload",
    "unmerge",
]
