"""VAPT configuration: :class:`VAPTConfig` and the parameter count of the spec (:func:`num_parameters`)."""

from __future__ import annotations

from dataclasses import dataclass

from rankwise.core.validate import check_bool, check_choice, check_int, check_unit

#: the three prompt schemes one module implements
METHODS = ("vapt", "vpt-deep", "vpt-shallow")


@dataclass(frozen=True)
class VAPTConfig:
    """VAPT / VPT hyper-parameters (defaults: the official VAPT configs for ViT-B/16).

    Attributes:
        num_prompts: ``N_p``, prompt tokens inserted after the [CLS] (and distillation) token.
        method: ``"vapt"`` (static prompts for the first ``vpt_depth`` layers, then prompts generated
            from the previous layer's patch tokens), ``"vpt-deep"`` (static prompts at every layer) or
            ``"vpt-shallow"`` (static prompts at the input only, carried through the layers).
        vpt_depth: layers that take static prompts under ``"vapt"`` (``1 <= vpt_depth <= L``;
            ``vpt_depth = L`` is VPT-deep). Ignored by the two VPT methods.
        kernel_size: ``K`` of the K x K convolution over the patch grid (no padding).
        mlp_hidden: ``h``, the hidden width of the bottleneck feature projector.
        share_projector: one feature projector for all generated layers (else one per layer).
        channelwise_kernel: one K x K kernel shared by every hidden channel (else one per channel).
        prompt_dropout: dropout on the static prompts (VPT's prompt dropout), in [0, 1).
        conv_dropout: ``Dropout2d`` after the convolution, in [0, 1).
        mlp_dropout: dropout on the projector's hidden activation, in [0, 1).
        train_head: keep the classification head(s) trainable (the backbone is always frozen).
        check_finite: raise :class:`~rankwise.core.errors.NumericalError` naming the layer when a
            generated prompt holds NaN or inf (one host read per generated layer and forward).
        seed: seeds the initialisation of the static prompts, kernels and projector (None: global RNG).
    """

    num_prompts: int = 10
    method: str = "vapt"
    vpt_depth: int = 1
    kernel_size: int = 2
    mlp_hidden: int = 8
    share_projector: bool = True
    channelwise_kernel: bool = True
    prompt_dropout: float = 0.1
    conv_dropout: float = 0.1
    mlp_dropout: float = 0.1
    train_head: bool = True
    check_finite: bool = True
    seed: int | None = 0

    def __post_init__(self) -> None:
        c = "VAPTConfig"
        check_int(f"{c}.num_prompts", self.num_prompts, 1)
        check_choice(f"{c}.method", self.method, METHODS)
        check_int(f"{c}.vpt_depth", self.vpt_depth, 1)
        check_int(f"{c}.kernel_size", self.kernel_size, 1)
        check_int(f"{c}.mlp_hidden", self.mlp_hidden, 1)
        for name in ("share_projector", "channelwise_kernel", "train_head", "check_finite"):
            check_bool(f"{c}.{name}", getattr(self, name))
        for name in ("prompt_dropout", "conv_dropout", "mlp_dropout"):
            object.__setattr__(self, name, check_unit(f"{c}.{name}", getattr(self, name), high_open=True))
        check_int(f"{c}.seed", self.seed, 0, allow_none=True)

    def static_layers(self, num_layers: int) -> int:
        """How many layers take static (learned, input-independent) prompts in an ``L``-layer model."""
        if self.method == "vpt-shallow":
            return 1
        if self.method == "vpt-deep":
            return num_layers
        return min(self.vpt_depth, num_layers)

    def generated_layers(self, num_layers: int) -> int:
        """How many layers take prompts generated from the previous layer (VAPT only)."""
        return num_layers - self.static_layers(num_layers) if self.method == "vapt" else 0


def num_parameters(config: VAPTConfig, hidden: int, num_layers: int, grid: tuple[int, int]) -> int:
    """Added trainable parameters (head excluded) of ``config`` on a ViT with hidden size ``d``, ``L`` layers
    and a ``H x W`` patch grid: the spec's formula.

    ``S N_p d`` static prompts (``S`` static layers) plus, per generated layer, LayerNorm ``2d``, kernel ``K^2``
    (``d K^2`` with per-channel kernels) and token-wise projector ``(H'W' + 1) N_p`` (``H' = H - K + 1``), plus
    the bias-free bottleneck MLP ``2 d h`` (once when shared, else per generated layer). For the spec's
    small-scale example (d = 64, L = 4, 4 x 4 grid, N_p = 8, K = 2, h = 4, vpt_depth = 1): 1,660.
    """
    h, w = grid
    k = config.kernel_size
    static = config.static_layers(num_layers)
    gen = config.generated_layers(num_layers)
    total = static * config.num_prompts * hidden
    if gen:
        spatial = (h - k + 1) * (w - k + 1)
        kernel = k * k * (1 if config.channelwise_kernel else hidden)
        total += gen * (2 * hidden + kernel + (spatial + 1) * config.num_prompts)
        total += (1 if config.share_projector else gen) * 2 * hidden * config.mlp_hidden
    return total
