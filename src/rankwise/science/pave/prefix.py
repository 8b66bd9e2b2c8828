"""Specs on the top layers only: :class:`TopEncoder` runs the top layers of a BERT-style encoder on cached
outputs of the frozen layers below.

When ``PaveConfig.layers`` adapts only the top layers, the layers below never change (theta_0 is frozen and
runs in eval mode), so their outputs can be computed once per text and every spec step runs only the top
layers: pass ``TopEncoder(model, layers)`` and ``{"hidden": h, "attention_mask": m}`` to
:func:`rankwise.science.pave.spec_from_inputs`. Module names stay those of the full model
(``encoder.layer.4.attention.self.query``), so the spec's tensors and its A draws are the same as on the
full model (the fingerprint covers the top layers only).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["TopEncoder"]


class TopEncoder(nn.Module):
    """Copies of ``layers`` of ``model.encoder.layer`` (a BERT-style encoder) under their full-model names.

    ``forward(hidden (B, L, H), attention_mask (B, L)) -> hidden (B, L, H)``, the output of the last layer.
    """

    def __init__(self, model: nn.Module, layers: tuple[int, ...]) -> None:
        super().__init__()
        stack = getattr(getattr(model, "encoder", None), "layer", None)
        if not isinstance(stack, nn.ModuleList):
            raise TypeError(f"TopEncoder needs a BERT-style encoder with encoder.layer, got {type(model).__name__}")
        if not layers or any(not 0 <= i < len(stack) for i in layers):
            raise ValueError(f"layers must be indices in [0, {len(stack)}), got {layers!r}")
        self.config: Any = model.config
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleDict({str(i): copy.deepcopy(stack[i]) for i in sorted(layers)})

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        m4 = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        for layer in self.encoder.layer.values():
            hidden = layer(hidden, attention_mask=m4)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return hidden
