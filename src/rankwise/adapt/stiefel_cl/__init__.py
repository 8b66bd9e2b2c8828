"""EBLoRA: energy-balanced LoRA on a restricted Stiefel manifold for continual learning (ICML 2026,
"Spectral Imbalance Causes Forgetting in Low-Rank Continual Adaptation", arXiv 2602.00722).

Per adapted linear layer ``W (d_out, d_in)`` and task ``t`` the update is::

    ΔW_t = c s U V^T,    U^T U = I (d_out x r),   V^T V = I (d_in x r),   F^T V = 0,   c = alpha / r

with one learnable magnitude ``s`` per layer, so every singular value of ``ΔW_t`` equals ``|c s|`` (a flat,
"energy-balanced" spectrum), and ``F`` (d_in x p, orthonormal) spanning the input directions earlier tasks
rely on. Per task (:class:`EBLoRAContinual`): ``U, V`` from the rank-r SVD of the averaged gradient with F
removed, ``G (I - F F^T)`` (``torch.svd_lowrank``), ``s = 0``; training with :class:`RiemannianAdamW`
(tangent projection, AdamW, direction step rescaled by ``sqrt(4096 / r)``, polar retraction); then the
GPM-style update of F at energy ``ε = 0.99`` and the merge of ``ΔW_t`` into ``W``.

In PEFT terms ``lora_B = c s U``, ``lora_A = V^T`` with ``lora_alpha = r`` (:func:`export_peft`). The
baselines of the paper's comparison (sequential PEFT LoRA, O-LoRA, an InfLoRA-like projected LoRA) and the
task-incremental loop with one head per task are :mod:`rankwise.adapt.stiefel_cl.baselines` and
:mod:`rankwise.adapt.stiefel_cl.runner`.
"""

from __future__ import annotations

from rankwise.adapt.stiefel_cl.config import BERT_TARGETS, GRAD_SCALING, EBLoRAConfig
from rankwise.adapt.stiefel_cl.continual import STATE_KIND, EBLoRAContinual, TaskRecord
from rankwise.adapt.stiefel_cl.functional import (
    GPMUpdate,
    balanced_spectrum,
    check_feasible,
    factored_spectrum_ratio,
    gpm_update,
    gradient_init,
    polar,
    project_out,
    project_tangent,
    random_directions,
    retract,
    spectrum_ratio,
)
from rankwise.adapt.stiefel_cl.layer import EBLoRALinear
from rankwise.adapt.stiefel_cl.model import (
    EBLORA,
    adapt,
    adapter_names,
    apply_eblora,
    collect_gradients,
    delete_adapter,
    disable_adapters,
    eblora_layers,
    enable_adapters,
    export_peft,
    load_adapter,
    make_optimizer,
    merge,
    peft_state,
    save_adapter,
    set_active,
    unload,
    unmerge,
)
from rankwise.adapt.stiefel_cl.optimizer import RiemannianAdamW

__all__ = [
    "BERT_TARGETS", "EBLORA", "EBLoRAConfig", "EBLoRAContinual", "EBLoRALinear", "GPMUpdate", "GRAD_SCALING",
    "RiemannianAdamW", "STATE_KIND", "TaskRecord", "adapt", "adapter_names", "apply_eblora", "balanced_spectrum",
    "check_feasible", "collect_gradients", "factored_spectrum_ratio", "delete_adapter", "disable_adapters", "eblora_layers", "enable_adapters",
    "export_peft", "gpm_update", "gradient_init", "load_adapter", "make_optimizer", "merge", "peft_state", "polar",
    "project_out", "project_tangent", "random_directions", "retract", "save_adapter", "set_active",
    "spectrum_ratio", "unload", "unmerge",
]
