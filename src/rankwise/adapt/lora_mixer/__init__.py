"""LoRA-Mixer: token-routed LoRA experts inside the projections, with the Routing Specialization Loss.

Paper: "LoRA-Mixer: Coordinate Modular LoRA Experts Through Serial Attention Routing" (Li et al.,
ICLR 2026, arXiv 2507.00029). Equation numbers are those of the ICLR version.

Each targeted projection ``W (d_out, d_in)`` (attention Q, K, V, O; ``in_proj``/``out_proj`` of SSM
blocks) gets ``E`` LoRA experts ``s_e B_e A_e`` (PEFT naming: ``A_e (r_e, d_in)``, ``B_e (d_out, r_e)``,
``s_e = alpha / r_e``) and a per-token router ``p(x) = softmax(W_r x)``, ``W_r (E, d_in)`` (Eq. 4)::

    y = W x + sum_e  g_e(x) * s_e B_e A_e dropout(x)

so the routed update flows on serially into the attention/SSM mixer. The gate ``g`` depends on the
fusion mode: ``"soft"`` (training: ``g = p``, all experts, fully differentiable), ``"topk"`` (inference:
the ``K = min(top_k_infer, E)`` largest ``p_e``, ties to the lowest index, renormalised to sum 1 unless
``renormalize=False``; with ``K = E`` exactly the soft gate) or ``"hard"`` (stage 1 of the hard-soft
scheme: a one-hot gate from each example's domain label, :func:`hard_routing`). By default the model's
``train()``/``eval()`` mode picks soft/top-K; :func:`fusion` forces one.

Routing Specialization Loss (Sec. 3.3, Eq. 3 and 5), per adapted layer over the N (non-padding) tokens::

    p_bar_i = mean_x p_i(x);   f_bar_i = share of the top-k routing slots taken by expert i (no gradient)
    L_RSL   = alpha * E * sum_i p_bar_i f_bar_i  + entropy_sign * lambda * mean_x H(p(x))

(the factor E — Switch Transformer's normalisation — makes the balance term equal alpha at uniform
routing, as the spec's check states; Eq. 3 prints it without E, which only rescales alpha).

``entropy_sign = +1`` (default) *lowers* the per-token entropy when minimised (sharp, selective
routing: the mechanism the paper describes); ``-1`` is Eq. 5 as printed (raises it). With
``lambda = 0`` it is the plain auxiliary loss of Eq. 3. :func:`rsl_loss` sums it over the layers;
:func:`preserve_loss` is Eq. 11, ``beta * sum ||theta_i - theta_i^(0)||^2`` over loaded experts.

Experts come from :func:`adapt` (new: ``A`` Kaiming-uniform, ``B = 0``, router ``N(0, 0.02^2)``) or
from existing LoRAs (``experts=[...]``: PEFT/rankwise LoRA directories, rankwise ``AdapterState``
files or objects), frozen by default — the plug-and-play regime, where only the router trains.

A routed mixture depends on the input, so it cannot be merged into ``W``: :func:`merge` raises.
"""

from __future__ import annotations

from rankwise.adapt.lora_mixer.config import (  # noqa: F401
    AdapterState,
    CONFIG_FILE,
    DEFAULT_TARGET,
    ExpertSource,
    F_DEFINITIONS,
    FUSIONS,
    LOG_FLOOR,
    LoRAMixerConfig,
    num_parameters,
    SHARE,
    STAGES,
    WEIGHTS_FILE,
)
from rankwise.adapt.lora_mixer.functional import (  # noqa: F401
    normalized_entropy,
    rsl_terms,
    topk_gate,
)
from rankwise.adapt.lora_mixer.layer import (  # noqa: F401
    AdapterLayer,
    LoRAMixerLinear,
    NumericalError,
    RankwiseError,
)
from rankwise.adapt.lora_mixer.model import (  # noqa: F401
    adapt,
    adapter_names,
    apply_lora_mixer,
    delete_adapter,
    disable_adapters,
    enable_adapters,
    fusion,
    hard_routing,
    load_adapter,
    LORA_MIXER,
    merge,
    mixer_layers,
    preserve_loss,
    register,
    replace_module,
    routing_stats,
    rsl_loss,
    save_adapter,
    Selector,
    set_active,
    set_stage,
    unload,
    unmerge,
)

__all__ = [
    "FUSIONS",
    "LoRAMixerConfig",
    "LoRAMixerLinear",
    "adapt",
    "adapter_names",
    "apply_lora_mixer",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "fusion",
    "hard_routing",
    "load_adapter",
    "merge",
    "mixer_layers",
    "normalized_entropy",
    "preserve_loss",
    "routing_stats",
    "rsl_loss",
    "rsl_terms",
    "save_adapter",
    "set_active",
    "set_stage",
    "topk_gate",
    "unload",
    "unmerge",
]
