"""VAPT's modules: the prompt generator of one layer, the feature projector, the prompt bank
(:class:`VAPTPrompts`, every trainable tensor of the method) and the wrapper that puts prompts into a
ViT layer's input (:class:`PromptedLayer`).

Token layout inside the encoder: ``[prefix (1 or 2: [CLS], DeiT's distillation token), prompts (N_p),
patches (N = H W)]``. Layer 0's wrapper inserts the prompts after the prefix; a later layer's wrapper
replaces the prompt slots (static prompts, or prompts generated from the patch tokens it receives) or,
for VPT-shallow, leaves them; the last layer's wrapper drops them again, so the encoder's output (and
everything after it: final LayerNorm, pooler, heads) sees the backbone's own layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.adapt.vapt.config import VAPTConfig
from rankwise.core.errors import NumericalError


def channelwise_conv(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Depthwise K x K convolution without padding of ``x (B, d, H, W)``.

    ``kernel (1, 1, K, K)``: the same 2-D filter for every channel (VAPT's ``channelwise=True``);
    ``kernel (d, 1, K, K)``: one filter per channel. Returns ``(B, d, H - K + 1, W - K + 1)``.
    """
    d = x.shape[1]
    weight = kernel.expand(d, 1, *kernel.shape[-2:]) if kernel.shape[0] == 1 else kernel
    return F.conv2d(x, weight, groups=d)


class FeatureProjector(nn.Module):
    """Residual bottleneck MLP without biases: ``G + W2 drop(relu(W1 G))`` (W1: d -> h, W2: h -> d)."""

    def __init__(self, hidden: int, bottleneck: int, dropout: float) -> None:
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck, bias=False)
        self.up = nn.Linear(bottleneck, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return g + self.up(self.dropout(torch.relu(self.down(g))))


class PromptGenerator(nn.Module):
    """One generated layer's own parts: LayerNorm over the patch tokens, the K x K kernel, and the
    zero-initialised token-wise projector ``R^{H'W'} -> R^{N_p}`` (weight and bias)."""

    def __init__(self, hidden: int, grid: tuple[int, int], num_prompts: int, kernel_size: int,
                 channelwise: bool, eps: float) -> None:
        super().__init__()
        self.grid = grid
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.kernel = nn.Parameter(torch.empty(1 if channelwise else hidden, 1, kernel_size, kernel_size))
        spatial = (grid[0] - kernel_size + 1) * (grid[1] - kernel_size + 1)
        self.proj = nn.Linear(spatial, num_prompts)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()

    def pooled(self, patches: torch.Tensor, dropout: nn.Module) -> torch.Tensor:
        """``G (B, N_p, d)`` from the patch tokens ``(B, N, d)``: norm, grid, conv, Dropout2d, projector."""
        b, n, d = patches.shape
        x = self.norm(patches).transpose(1, 2).reshape(b, d, *self.grid)
        x = dropout(channelwise_conv(x, self.kernel))
        return self.proj(x.flatten(2)).transpose(1, 2)


class VAPTPrompts(nn.Module):
    """Every trainable tensor of VAPT / VPT for one backbone, under stable names.

    ``static.<l>`` (N_p, d) for the static layers; ``generators.<l>.{norm.weight, norm.bias, kernel,
    proj.weight, proj.bias}`` for the generated layers; ``projector.{down,up}.weight`` (shared) or
    ``projectors.<l>.{down,up}.weight``. :meth:`before` and :meth:`after` do the token surgery of layer ``l``.
    """

    def __init__(self, config: VAPTConfig, *, hidden: int, num_layers: int, grid: tuple[int, int],
                 num_prefix: int, num_channels: int, patch: tuple[int, int], eps: float = 1e-12) -> None:
        super().__init__()
        self.config = config
        self.hidden, self.num_layers, self.grid = hidden, num_layers, grid
        self.num_prefix, self.num_patches = num_prefix, grid[0] * grid[1]
        self.n_static = config.static_layers(num_layers)
        n_p = config.num_prompts
        self.static = nn.ParameterList([nn.Parameter(torch.empty(n_p, hidden)) for _ in range(self.n_static)])
        self.generators = nn.ModuleDict({
            str(layer): PromptGenerator(hidden, grid, n_p, config.kernel_size, config.channelwise_kernel, eps)
            for layer in range(self.n_static, self.n_static + config.generated_layers(num_layers))})
        self.projector: nn.Module | None = None
        self.projectors: nn.ModuleDict | None = None
        if self.generators:
            if config.share_projector:
                self.projector = FeatureProjector(hidden, config.mlp_hidden, config.mlp_dropout)
            else:
                self.projectors = nn.ModuleDict({k: FeatureProjector(hidden, config.mlp_hidden, config.mlp_dropout)
                                                 for k in self.generators})
        self.prompt_dropout = nn.Dropout(config.prompt_dropout)
        self.conv_dropout = nn.Dropout2d(config.conv_dropout)
        self._init(num_channels * patch[0] * patch[1])

    @torch.no_grad()
    def _init(self, patch_inputs: int) -> None:
        gen = torch.Generator().manual_seed(self.config.seed) if self.config.seed is not None else None
        bound = math.sqrt(6.0 / (patch_inputs + self.hidden))  # VPT's xavier-uniform bound over the patch fan-in

        def uniform(t: torch.Tensor, b: float) -> None:
            t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * b)

        for p in self.static:
            uniform(p, bound)
        for g in self.generators.values():
            g.kernel.copy_(torch.randn(g.kernel.shape, generator=gen))  # N(0, 1), as the official code
        for proj in ([self.projector] if self.projector is not None else list((self.projectors or {}).values())):
            for lin in (proj.down, proj.up):  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                uniform(lin.weight, 1.0 / math.sqrt(lin.in_features))

    # -- token surgery ------------------------------------------------------------------------------
    def prompts(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The prompts fed to ``layer`` for the encoder input ``x`` of that layer (None: keep the slots)."""
        b = x.shape[0]
        if layer < self.n_static:
            return self.prompt_dropout(self.static[layer].unsqueeze(0).expand(b, -1, -1))
        key = str(layer)
        if key not in self.generators:
            return None  # VPT-shallow: the prompt tokens flow on
        patches = x[:, self.num_prefix + self.config.num_prompts:]
        g = self.generators[key].pooled(patches, self.conv_dropout)
        proj = self.projector if self.projector is not None else self.projectors[key]
        p = proj(g)
        if self.config.check_finite and not bool(torch.isfinite(p).all()):
            raise NumericalError(f"VAPT: the prompts generated for layer {layer} hold NaN or inf")
        return p

    def before(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s input with its prompts in place: ``[prefix, P_layer, patches]``."""
        n = self.num_prefix
        if layer == 0:
            got = x.shape[1] - n
            if self.generators and got != self.num_patches:
                raise ValueError(
                    f"VAPT was set up for a {self.grid[0]}x{self.grid[1]} patch grid ({self.num_patches} patch "
                    f"tokens) but the input has {got}: the images differ from the backbone's configured size "
                    "(VAPT's token-wise projectors need that grid; VPT-deep / VPT-shallow accept interpolated "
                    "position embeddings)")
            p = self.prompts(0, x)
            return torch.cat([x[:, :n], p.to(x.dtype), x[:, n:]], dim=1)
        p = self.prompts(layer, x)
        if p is None:
            return x
        return torch.cat([x[:, :n], p.to(x.dtype), x[:, n + self.config.num_prompts:]], dim=1)

    def after(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """The last layer drops the prompt slots, so the encoder's output has the backbone's layout."""
        if layer != self.num_layers - 1:
            return out
        n = self.num_prefix
        return torch.cat([out[:, :n], out[:, n + self.config.num_prompts:]], dim=1)


class PromptedLayer(nn.Module):
    """A ViT encoder layer with VAPT's prompts around it (``base_layer`` unchanged, frozen).

    Layer 0's wrapper owns the :class:`VAPTPrompts` (a registered child ``prompts``, so ``model.to``,
    ``state_dict`` and optimizers see it once); the others hold a plain reference. ``is_rankwise_wrapper``
    makes :func:`rankwise.core.io.model_fingerprint` see through to the base layer.
    """

    is_rankwise_wrapper = True

    def __init__(self, base_layer: nn.Module, index: int, bank: VAPTPrompts) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.index = index
        if index == 0:
            self.prompts = bank
        else:
            object.__setattr__(self, "_bank", bank)

    @property
    def bank(self) -> VAPTPrompts:
        return self.prompts if self.index == 0 else self._bank

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mask = args[0] if args else kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            raise ValueError("VAPT does not support an attention mask (the prompt tokens change the sequence length)")
        out = self.base_layer(self.bank.before(self.index, hidden_states), *args, **kwargs)
        if isinstance(out, tuple):  # older transformers return (hidden_states, ...)
            return (self.bank.after(self.index, out[0]),) + tuple(out[1:])
        return self.bank.after(self.index, out)
