"""LoRA, the reference low-rank adapter (Hu et al., 2021), with PEFT interop both ways.

    h = W0 x + s * B A x,   A: (r, in) ~ kaiming-uniform (or Gaussian),  B: (out, r) = 0,
    s = alpha / r  (alpha / sqrt(r) with rsLoRA)                                  (Hu et al. Eq. 3)

Usage::

    from rankwise.adapt.lora import LoraConfig, adapt, merge, save_adapter, export_peft
    model = adapt(model, LoraConfig(rank=8, alpha=16, target=("query", "value")))
    ...train...
    save_adapter(model, "my_adapter")            # rankwise directory == PEFT directory + fingerprint
    export_peft(model, "for_peft", base_model_name_or_path="sentence-transformers/all-MiniLM-L6-v2")

The layer and the adapter state live in :mod:`rankwise.core.lora`, the PEFT directory format and the
model-level API (:data:`LORA`) in :mod:`rankwise.core.peft_format` (both shared with merging, federated
training and the LoRA optimizers); this package is the method: its config (``config.py``), the entry
point and the PEFT export (``model.py``), and re-exports of the shared names.

Directory format (``save_adapter`` and ``export_peft`` write the same thing)
---------------------------------------------------------------------------
``adapter_config.json``
    a PEFT ``LoraConfig`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``target_modules``,
    ``rank_pattern``/``alpha_pattern`` for modules whose rank/alpha differ from the most common
    one, ``use_rslora``, ``lora_dropout``, ``bias: "none"``, ...);
``adapter_model.safetensors``
    keys ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r), as
    PEFT names them; the safetensors header additionally holds rankwise metadata (adapter name,
    config, exact per-module scaling, base-model fingerprint, per-tensor SHA-256, see
    :mod:`rankwise.core.io`), which PEFT ignores.

So ``peft.PeftModel.from_pretrained(base, directory)`` loads what rankwise saves, and
:func:`load_adapter` / :func:`load_peft` load what PEFT saves (standard LoRA on ``nn.Linear`` only;
DoRA, bias training, ``modules_to_save``, embedding/conv targets, base-modifying initialisations
such as PiSSA/OLoRA/LoftQ/CorDA/LoRA-GA and the other PEFT variants are rejected with a clear error).
A directory written by PEFT carries no fingerprint, so only shapes are checked when it is loaded.
"""

from __future__ import annotations

from rankwise.adapt.lora.config import LoraConfig
from rankwise.adapt.lora.model import adapt, export_peft, load_adapter, load_peft, merge, save_adapter, unmerge
from rankwise.core.lora import (  # noqa: F401  (the layer and the adapter state live in core)
    INITS,
    AdapterState,
    LoraLinear,
    add_lora,
    adapter_names,
    base_module_names,
    check_state_fits,
    delete_adapter,
    disable_adapters,
    enable_adapters,
    get_state,
    lora_layers,
    lora_scaling,
    merge_adapters,
    set_active,
    set_state,
    unload,
    unmerge_adapters,
)
from rankwise.core.peft_format import (  # noqa: F401  (the PEFT directory format, shared with merging)
    CONFIG_FILE,
    LORA,
    WEIGHTS_FILE,
    import_peft,
    peft_config_dict,
    write_adapter_dir,
)

__all__ = [
    "AdapterState",
    "LoraConfig",
    "LoraLinear",
    "adapt",
    "adapter_names",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "export_peft",
    "get_state",
    "import_peft",
    "load_adapter",
    "load_peft",
    "lora_layers",
    "merge",
    "save_adapter",
    "set_active",
    "set_state",
    "unload",
    "unmerge",
]
