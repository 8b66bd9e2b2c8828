"""VAPT on a whole model: :func:`apply_vapt`, the prompt-only checkpoint (:func:`save_vapt`,
:func:`load_vapt`), :func:`unload` and the queries the training code needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.adapt.vapt.config import VAPTConfig, num_parameters
from rankwise.adapt.vapt.layer import PromptedLayer, VAPTPrompts
from rankwise.core import io
from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.core.registry import register

KIND = "rankwise.vapt"
FORMAT_VERSION = 1
SUPPORTED = "transformers' ViTModel / DeiTModel or a model built on one (ViTForImageClassification, " \
            "DeiTForImageClassification, DeiTForImageClassificationWithTeacher, ...)"


@dataclass(frozen=True)
class Backbone:
    """Where a ViT's parts are: the base model, its encoder layers, its token layout and its head."""

    base: nn.Module
    prefix: str  # the base model's attribute name in the top model ("" when the model is the base)
    layers: nn.ModuleList
    hidden: int
    grid: tuple[int, int]
    patch: tuple[int, int]
    image_size: tuple[int, int]
    num_channels: int
    num_prefix: int
    eps: float

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "num_layers": self.num_layers, "grid": list(self.grid),
                "patch": list(self.patch), "image_size": list(self.image_size), "num_prefix": self.num_prefix}


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _vit_bases() -> tuple[type, ...]:
    from transformers import DeiTModel, ViTModel

    return (ViTModel, DeiTModel)


def find_backbone(model: nn.Module) -> Backbone:
    """The ViT inside ``model``; TypeError naming what is supported for anything else."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_vapt: model must be an nn.Module, got {type(model).__name__}")
    bases = _vit_bases()
    prefix = ""
    base = model
    if not isinstance(model, bases):
        prefix = getattr(model, "base_model_prefix", "") or ""
        base = getattr(model, prefix, None) if prefix else None
        if not isinstance(base, bases):
            raise TypeError(f"VAPT needs a ViT backbone with a patch grid: {SUPPORTED}; got "
                            f"{type(model).__name__}")
    emb = base.embeddings
    pe = emb.patch_embeddings
    encoder = getattr(base, "encoder", None)
    layers = getattr(encoder, "layer", None) if encoder is not None else getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise TypeError(f"{type(model).__name__}: cannot find the encoder layers (encoder.layer or layers)")
    image, patch = _pair(pe.image_size), _pair(pe.patch_size)
    grid = (image[0] // patch[0], image[1] // patch[1])
    if grid[0] * grid[1] != int(pe.num_patches):
        raise TypeError(f"{type(model).__name__}: {pe.num_patches} patches do not form the {grid[0]}x{grid[1]} "
                        "grid of its image and patch sizes")
    num_prefix = 1 + int(getattr(emb, "distillation_token", None) is not None)
    cfg = base.config
    return Backbone(base=base, prefix=prefix, layers=layers, hidden=int(cfg.hidden_size), grid=grid, patch=patch,
                    image_size=image, num_channels=int(pe.num_channels), num_prefix=num_prefix,
                    eps=float(getattr(cfg, "layer_norm_eps", 1e-12)))


def vapt_layers(model: nn.Module) -> list[tuple[str, PromptedLayer]]:
    """``(name, PromptedLayer)`` of every prompted encoder layer, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PromptedLayer)]


def prompts_of(model: nn.Module) -> VAPTPrompts:
    """The :class:`VAPTPrompts` of a model :func:`apply_vapt` prepared; RankwiseError otherwise."""
    layers = vapt_layers(model)
    if not layers:
        raise RankwiseError(f"{type(model).__name__} has no VAPT prompts (call apply_vapt first)")
    return layers[0][1].bank


def head_names(model: nn.Module) -> list[str]:
    """Parameter names outside the ViT base model (the classification head(s)); empty for a bare ViTModel."""
    bb = find_backbone(model) if not vapt_layers(model) else None
    prefix = bb.prefix if bb is not None else _prefix(model)
    if not prefix:
        return []
    return [n for n, _ in model.named_parameters() if not n.startswith(prefix + ".")]


def _prefix(model: nn.Module) -> str:
    return "" if isinstance(model, _vit_bases()) else (getattr(model, "base_model_prefix", "") or "")


def apply_vapt(model: nn.Module, config: VAPTConfig | None = None) -> nn.Module:
    """Add VAPT (or VPT-deep / VPT-shallow, ``config.method``) prompts to a transformers ViT, in place.

    Every encoder layer is wrapped in a :class:`PromptedLayer`; the backbone's parameters are frozen;
    the prompt parameters and (``config.train_head``) the classification head are trainable. The
    generated prompts start at exactly zero (zero token-wise projectors). Errors, raised before the model
    changes: a model without a ViT patch grid (TypeError), ``kernel_size`` above the grid, ``vpt_depth``
    above the number of layers, a model that already has prompts (ValueError).
    """
    config = VAPTConfig() if config is None else config
    if not isinstance(config, VAPTConfig):
        raise TypeError(f"apply_vapt: config must be a VAPTConfig, got {type(config).__name__}")
    bb = find_backbone(model)
    if any(isinstance(m, PromptedLayer) for m in bb.layers):
        raise ValueError("this model already has VAPT prompts; unload() them first")
    if config.method == "vapt":
        if config.vpt_depth > bb.num_layers:
            raise ValueError(f"VAPTConfig.vpt_depth={config.vpt_depth} exceeds the {bb.num_layers} layers of "
                             f"this model; choose 1 <= vpt_depth <= {bb.num_layers}")
        if config.generated_layers(bb.num_layers) and config.kernel_size > min(bb.grid):
            raise ValueError(f"VAPTConfig.kernel_size={config.kernel_size} exceeds the {bb.grid[0]}x{bb.grid[1]} patch "
                             f"grid of this model; choose kernel_size <= {min(bb.grid)}")
    dtype = next(bb.base.parameters()).dtype
    device = next(bb.base.parameters()).device
    bank = VAPTPrompts(config, hidden=bb.hidden, num_layers=bb.num_layers, grid=bb.grid, num_prefix=bb.num_prefix,
                       num_channels=bb.num_channels, patch=bb.patch, eps=bb.eps).to(device=device, dtype=dtype)
    heads = set(head_names(model))
    for name, p in model.named_parameters():
        p.requires_grad_(config.train_head and name in heads)
    for i in range(bb.num_layers):
        bb.layers[i] = PromptedLayer(bb.layers[i], i, bank)
    bank.train(model.training)
    return model


def unload(model: nn.Module) -> nn.Module:
    """Remove the prompts: every :class:`PromptedLayer` gives its base layer back (the backbone stays frozen)."""
    bb = find_backbone(model)
    for i, layer in enumerate(bb.layers):
        if isinstance(layer, PromptedLayer):
            bb.layers[i] = layer.base_layer
    return model


def prompt_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The prompt parameters (head excluded)."""
    return list(prompts_of(model).parameters())


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What an optimizer should update: the prompt parameters and the trainable head parameters."""
    seen: set[int] = set()
    out = []
    for p in list(prompt_parameters(model)) + [p for p in model.parameters() if p.requires_grad]:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def count_parameters(model: nn.Module) -> int:
    """The added prompt parameters (head excluded); equals :func:`num_parameters` of the config."""
    return sum(p.numel() for p in prompt_parameters(model))


def expected_parameters(model: nn.Module, config: VAPTConfig) -> int:
    """The spec's formula for ``config`` on ``model``'s backbone (:func:`~rankwise.adapt.vapt.config.num_parameters`)."""
    bb = find_backbone(model)
    return num_parameters(config, bb.hidden, bb.num_layers, bb.grid)


def fingerprint(model: nn.Module) -> str:
    """The backbone's fingerprint: every base parameter except the head(s) (which a task retrains)."""
    skip = set(head_names(model))
    return io.model_fingerprint(model, exclude=lambda n: n in skip)


# --------------------------------------------------------------------------------------------------
# the prompt-only checkpoint


def _tensors(model: nn.Module, include_head: bool) -> dict[str, torch.Tensor]:
    out = {f"prompts.{k}": v for k, v in prompts_of(model).state_dict().items()}
    if include_head:
        params = dict(model.named_parameters())
        out.update({f"head.{n}": params[n] for n in head_names(model)})
    return out


def save_vapt(model: nn.Module, path: str | Path, *, include_head: bool = True) -> Path:
    """Save the prompts (and, with ``include_head``, the head) of ``model`` to one safetensors file, atomically.

    The header metadata records the config, the backbone's layout and its fingerprint (head excluded),
    so :func:`load_vapt` refuses another backbone. The backbone's own weights are not written.
    """
    bank = prompts_of(model)
    bb = find_backbone(model)
    meta = {"kind": KIND, "version": FORMAT_VERSION, "config": dataclasses.asdict(bank.config),
            "backbone": bb.describe(), "fingerprint": fingerprint(model), "include_head": include_head,
            "head": head_names(model) if include_head else []}
    return io.save_tensors(path, _tensors(model, include_head), meta)


def read_config(path: str | Path) -> VAPTConfig:
    """The :class:`VAPTConfig` recorded in a checkpoint written by :func:`save_vapt`."""
    meta = io.read_metadata(path)
    return _config_from(meta, Path(path))


def _config_from(meta: dict[str, Any], path: Path) -> VAPTConfig:
    if meta.get("kind") != KIND:
        raise ArtifactError(f"{path}: not a rankwise VAPT checkpoint (kind={meta.get('kind')!r})")
    raw = meta.get("config")
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path}: the metadata lacks the VAPT config")
    fields = {f.name for f in dataclasses.fields(VAPTConfig)}
    try:
        return VAPTConfig(**{k: v for k, v in raw.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: bad VAPT config in the metadata ({e})") from e


def load_vapt(model: nn.Module, path: str | Path, *, check_base: bool = True) -> nn.Module:
    """Load a :func:`save_vapt` checkpoint into ``model`` (prompts added with the recorded config if it has
    none); returns the model. Tensors load bit-exactly.

    ArtifactError, with the model unchanged, for a missing, corrupt or foreign file, another backbone
    (fingerprint; skip with ``check_base=False``), other prompt shapes, or prompts of another config.
    """
    path = Path(path)
    tensors, meta = io.load_tensors(path)
    config = _config_from(meta, path)
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), fingerprint(model), source=str(path))
    had = bool(vapt_layers(model))
    if had and prompts_of(model).config != config:
        raise ArtifactError(f"{path}: saved with {config}, but the model's prompts use {prompts_of(model).config}")
    if not had:
        try:
            apply_vapt(model, config)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{path} does not fit this model: {e}") from e
    try:
        _install(model, tensors, path)
    except ArtifactError:
        if not had:
            unload(model)
        raise
    return model


@torch.no_grad()
def _install(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    want = _tensors(model, include_head=any(k.startswith("head.") for k in tensors))
    problems = [f"missing {sorted(set(want) - set(tensors))[:4]}"] if set(want) - set(tensors) else []
    if set(tensors) - set(want):
        problems.append(f"unexpected {sorted(set(tensors) - set(want))[:4]}")
    problems += [f"{k}: shape {tuple(tensors[k].shape)}, expected {tuple(v.shape)}"
                 for k, v in want.items() if k in tensors and tensors[k].shape != v.shape]
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    for k, v in want.items():
        v.copy_(tensors[k])


register("vapt", config=VAPTConfig, entry=apply_vapt, save=save_vapt, load=load_vapt,
         trainable=trainable_parameters, count=count_parameters, read_config=read_config,
         methods=("vapt", "vpt-deep", "vpt-shallow"), default_lr=3e-3)
