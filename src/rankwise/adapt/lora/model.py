"""LoRA on a whole model: :func:`adapt`, the PEFT export, and the adapter API (:data:`LORA`, an
:class:`~rankwise.core.adapters.AdapterMethod` defined with the PEFT format in :mod:`rankwise.core.peft_format`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rankwise.adapt.lora.config import LoraConfig
from rankwise.core.lora import add_lora, base_module_names, get_state, set_state
from rankwise.core.peft_format import LORA, import_peft, write_adapter_dir
from rankwise.core.registry import register
from rankwise.core.select import Selector


merge = LORA.merge
unmerge = LORA.unmerge
save_adapter = LORA.save_adapter
load_adapter = LORA.load_adapter


def adapt(model: nn.Module, config: LoraConfig | None = None, target: Selector = None,
          name: str = "default") -> nn.Module:
    """Add LoRA adapter ``name`` to ``model`` in place and return it.

    ``target`` (a type, name pattern(s) or predicate) overrides ``config.target``. The new adapter
    becomes the active (and only trainable) one; every non-LoRA parameter is frozen. Ranks above
    ``min(in_features, out_features)`` of a layer raise ``ValueError`` naming the layer; a selector
    that matches no Linear layer raises ``SelectionError``. On any error the model is unchanged.
    """
    config = LORA.start_adapt(model, config, LoraConfig, None)  # add_lora checks the name and merges
    gen = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    add_lora(model, config.target if target is None else target, name, rank=config.rank, alpha=config.alpha,
             use_rslora=config.use_rslora, dropout=config.dropout, init=config.init, generator=gen)
    return model


def export_peft(model: nn.Module, directory: str | Path, name: str = "default",
                base_model_name_or_path: str | None = None, *, overwrite: bool | None = None) -> Path:
    """Write adapter ``name`` as a PEFT LoRA directory that ``PeftModel.from_pretrained(base, directory)`` loads.

    Same files as :func:`save_adapter`, with ``base_model_name_or_path`` recorded in the config.
    Ranks/scalings that differ per module are written as ``rank_pattern``/``alpha_pattern``.
    """
    return write_adapter_dir(get_state(model, name), directory, name=name,
                             module_names=base_module_names(model),
                             base_model_name_or_path=base_model_name_or_path, overwrite=overwrite)


def load_peft(model: nn.Module, directory: str | Path, name: str = "default", *,
              check_base: bool = True) -> nn.Module:
    """Load a PEFT (or rankwise) LoRA directory into ``model`` as adapter ``name``; returns the model.

    The model is checked before it is changed (shapes; the fingerprint when the directory has one
    and ``check_base``); on error it is unchanged. The loaded adapter becomes the active one.
    """
    state = import_peft(directory, model)
    set_state(model, state, name, check_base=check_base, source=str(directory))
    return model


register("lora", config=LoraConfig, entry=adapt, adapter=LORA)
