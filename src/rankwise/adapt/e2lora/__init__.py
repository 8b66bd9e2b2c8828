"""E²LoRA: LoRA factors shared across adjacent layers, intervals and ranks set by gradient proxy entropy (ICLR 2026).

"E²LoRA: Efficient and Effective Low-Rank Adaptation with Entropy-Guided Adaptive Sharing" (Li, Ye, Ye, He,
Chen; OpenReview IQttyo0460). The paper's equation numbers were not available to us; the steps below are
numbered as in the spec (shared/methods/e2lora.md, "Method").

For each *module type* (the targeted Linear layers whose names differ only in the layer index, e.g.
``encoder.layer.*.attention.self.query``) with ``N`` layers and pretrained weights ``W_l (d_out, d_in)``:

1. one calibration pass of the frozen model gives ``G_l = dL/dW_l`` (averaged over ``calib_batches``);
2. proxy entropy (Gaussian differential entropy of the elements of ``G_l``, natural log)::

       H(G_l) = log sigma_l + 1/2 log(2 pi) + 1/2                     (sigma_l: element std of G_l)

3. joint entropy ``H(G_i, G_j)`` = the same formula on the concatenation ``[vec G_i ; vec G_j]``;
   ``I = H_i + H_j - H_ij`` and the relative mutual information ``RMI_ij = I / min(H_i, H_j)``;
4. adaptive thresholds ``tau_m = mean_{k != m} RMI_mk``;
5. Local-Similarity Sharing (LSS): greedy contiguous intervals; an interval started at ``s`` takes the
   next layer ``j`` while ``RMI_sj >= tau_s``;
6. Heterogeneous Rank Allocation (HRA): ``H_k = max_{l in I_k} H_l``, ``F_k = H_k / sum_i H_i``,
   ``r_k = round(F_k * K * r0)`` (``K`` intervals, ``r0 = rank``), clamped to ``>= 1``;
7. sharing: interval ``k`` holds ONE pair ``A_k (r_k, d_in)`` (Kaiming-uniform, a = sqrt 5),
   ``B_k (d_out, r_k)`` (zeros) used by every layer of the interval: ``ΔW_l = (alpha / r_k) B_k A_k``.
   The ``sharing="sharelora"`` variant (E²ShareLoRA) keeps one ``A`` per type at ``max_k r_k`` rows,
   each layer using ``A[:r_k(l)]`` with its own ``B_l (d_out, r_k(l))``.

The plan (entropies, RMI matrix, thresholds, intervals, ranks) is an :class:`E2LoRAPlan` computed once
before training by :func:`plan_e2lora`; :func:`apply_e2lora` installs it; :func:`adapt` does both.
Shared factors are the same ``nn.Parameter`` objects in every layer of an interval, so their gradient
is the sum of the per-layer gradients and an optimizer sees each once (``model.parameters()``
de-duplicates). Merging adds each layer's ``ΔW_l`` to its own base weight.

Usage::

    from rankwise.adapt.e2lora import E2LoRAConfig, adapt, get_plan, merge, save_adapter
    adapt(model, E2LoRAConfig(rank=8, alpha=16), calib=batches, loss_fn=lambda m, b: m(**b).loss)
    plan = get_plan(model)
    print(plan.intervals, plan.ranks, plan.num_parameters())
    ...train the parameters that require grad (and your task head)...
    merge(model)
"""

from __future__ import annotations

from rankwise.adapt.e2lora.config import (  # noqa: F401
    CONFIG_FILE,
    DEFAULT_DEPTH_REGEX,
    E2LoRAConfig,
    GRANULARITIES,
    HRA_SCORES,
    LossFn,
    ROUNDINGS,
    SHARINGS,
    SIGMA_SIGN_CHANGE,
    SIMILARITIES,
    THRESHOLDS,
    WEIGHTS_FILE,
)
from rankwise.adapt.e2lora.functional import (  # noqa: F401
    adaptive_thresholds,
    allocate_ranks,
    entropy_from_std,
    NumericalError,
    partition,
    proxy_entropy,
    similarity_matrix,
)
from rankwise.adapt.e2lora.plan import (  # noqa: F401
    ArtifactError,
    E2LoRAPlan,
    io,
    TypePlan,
)
from rankwise.adapt.e2lora.layer import (  # noqa: F401
    AdapterLayer,
    E2LoRALinear,
    RankwiseError,
    validate_adapter_name,
)
from rankwise.adapt.e2lora.model import (  # noqa: F401
    adapt,
    adapter_names,
    apply_e2lora,
    collect_gradients,
    default_loss,
    delete_adapter,
    disable_adapters,
    E2LORA,
    e2lora_layers,
    enable_adapters,
    get_plan,
    group_layers,
    load_adapter,
    merge,
    plan_e2lora,
    register,
    replace_module,
    save_adapter,
    Selector,
    set_active,
    trainable_parameters,
    uniform_plan,
    unload,
    unmerge,
)

__all__ = [
    "E2LoRAConfig",
    "E2LoRALinear",
    "E2LoRAPlan",
    "TypePlan",
    "adapt",
    "adapter_names",
    "adaptive_thresholds",
    "allocate_ranks",
    "apply_e2lora",
    "collect_gradients",
    "delete_adapter",
    "disable_adapters",
    "e2lora_layers",
    "enable_adapters",
    "entropy_from_std",
    "get_plan",
    "group_layers",
    "load_adapter",
    "merge",
    "partition",
    "plan_e2lora",
    "proxy_entropy",
    "similarity_matrix",
    "save_adapter",
    "set_active",
    "trainable_parameters",
    "uniform_plan",
    "unload",
    "unmerge",
]
