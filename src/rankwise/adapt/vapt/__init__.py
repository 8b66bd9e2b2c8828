"""VAPT: visual adaptive prompt tuning (ICLR 2026, arXiv 2501.18936), with VPT-deep and VPT-shallow.

A frozen ViT (transformers' ``ViTModel`` / ``DeiTModel`` and the models built on them) with ``L`` layers,
hidden ``d`` and an ``H x W`` patch grid (``N = H W`` patch tokens) takes ``N_p`` prompt tokens after its
[CLS] (and DeiT's distillation) token. VPT learns them as free parameters: at the input only
(VPT-shallow) or a fresh set replacing the prompt slots at every layer (VPT-deep, ``L N_p d``
parameters). VAPT keeps static prompts for the first ``vpt_depth`` layers and *generates* the prompts of
every later layer ``l`` from the patch tokens ``X`` that layer ``l - 1`` produced::

    X~ = LayerNorm_l(X)  reshaped to a d x H x W map
    Y  = Dropout2d(conv_KxK(X~))          one K x K kernel shared by all d channels, no padding
    G  = (proj_l(flatten(Y)))^T           proj_l: R^{H'W'} -> R^{N_p}, zero-initialised (weight and bias)
    P_l = G + W2 relu(W1 G)               bottleneck MLP without biases, shared by the layers (h = 8)

so each prompt is a learned spatial pooling of the image's own features: an input-dependent prompt
expert instead of a constant one. The projectors start at zero, so every generated prompt is exactly zero
at initialisation. Parameters: ``vpt_depth N_p d`` + per generated layer ``2 d + K^2 + (H'W' + 1) N_p`` +
``2 d h`` (:func:`num_parameters`), fewer than VPT-deep's ``L N_p d`` at the paper's sizes.

Usage::

    from rankwise.adapt.vapt import VAPTConfig, apply_vapt, save_vapt, load_vapt, trainable_parameters
    apply_vapt(vit_classifier, VAPTConfig(num_prompts=8, kernel_size=2, mlp_hidden=4))
    opt = torch.optim.AdamW(trainable_parameters(vit_classifier), lr=3e-3)
    ...train...
    save_vapt(vit_classifier, "vapt.safetensors")      # prompts + head, with the backbone's fingerprint
    load_vapt(fresh_vit_classifier, "vapt.safetensors")
    VAPTConfig(method="vpt-deep")                      # or "vpt-shallow": VPT in the same module
"""

from __future__ import annotations

from rankwise.adapt.vapt.config import METHODS, VAPTConfig, num_parameters
from rankwise.adapt.vapt.layer import (
    FeatureProjector,
    PromptedLayer,
    PromptGenerator,
    VAPTPrompts,
    channelwise_conv,
)
from rankwise.adapt.vapt.model import (
    KIND,
    Backbone,
    apply_vapt,
    count_parameters,
    expected_parameters,
    find_backbone,
    fingerprint,
    head_names,
    load_vapt,
    prompt_parameters,
    prompts_of,
    read_config,
    save_vapt,
    trainable_parameters,
    unload,
    vapt_layers,
)

adapt = apply_vapt

__all__ = [
    "KIND",
    "METHODS",
    "Backbone",
    "FeatureProjector",
    "PromptGenerator",
    "PromptedLayer",
    "VAPTConfig",
    "VAPTPrompts",
    "adapt",
    "apply_vapt",
    "channelwise_conv",
    "count_parameters",
    "expected_parameters",
    "find_backbone",
    "fingerprint",
    "head_names",
    "load_vapt",
    "num_parameters",
    "prompt_parameters",
    "prompts_of",
    "read_config",
    "save_vapt",
    "trainable_parameters",
    "unload",
    "vapt_layers",
]
