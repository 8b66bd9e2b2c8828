"""VAPT / VPT: the spec's correctness checks and bad inputs (VAPT is not a Linear adapter, so it has its own
contract here instead of joining the adapter matrix): prompt-only save/load, backbone unchanged after
training, ``vpt_depth = L`` equals VPT-deep, generated prompts zero at init, sequence length
``prefix + N_p + N`` at every layer, the parameter formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise import zoo
from rankwise.adapt import vapt
from rankwise.adapt.vapt import VAPTConfig
from rankwise.core import registry
from rankwise.core.errors import ArtifactError, NumericalError

SPEC = dict(num_prompts=8, kernel_size=2, mlp_hidden=4, vpt_depth=1)  # the spec's small-scale example


def _vit(seed: int = 0, **kw):
    return zoo.tiny_vit(seed=seed, num_labels=5, image_size=16, **kw)


def _deit(seed: int = 0):
    from transformers import DeiTConfig, DeiTForImageClassificationWithTeacher

    cfg = DeiTConfig(image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=4, intermediate_size=64, num_labels=3)
    with zoo.models.seeded(seed):
        return DeiTForImageClassificationWithTeacher(cfg).eval()


def _images(n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


def _train(model: nn.Module, steps: int = 5, seed: int = 0) -> None:
    x = _images(8, seed)
    y = torch.arange(8) % 5
    opt = torch.optim.AdamW(vapt.trainable_parameters(model), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(pixel_values=x).logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _layer_inputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The input each encoder layer's base layer receives (after the prompt surgery)."""
    seen: list[torch.Tensor] = []
    hooks = [layer.base_layer.register_forward_pre_hook(lambda m, a, kw: seen.append(a[0] if a else kw["hidden_states"]),
                                                        with_kwargs=True)
             for _, layer in vapt.vapt_layers(model)]
    try:
        with torch.no_grad():
            model(pixel_values=x)
    finally:
        for h in hooks:
            h.remove()
    return seen


# --------------------------------------------------------------------------------------------------
# the parameter formula


def test_parameter_count_matches_the_spec_example():
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC))
    assert vapt.count_parameters(model) == 1660  # 8*64 + 3*(2*64 + 4 + 10*8) + 2*64*4
    assert vapt.num_parameters(VAPTConfig(**SPEC), 64, 4, (4, 4)) == 1660
    deep = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC, method="vpt-deep"))
    assert vapt.count_parameters(deep) == 2048 > 1660  # 4*8*64


@pytest.mark.parametrize("kw", [dict(share_projector=False), dict(channelwise_kernel=False), dict(vpt_depth=2),
                                dict(kernel_size=3, mlp_hidden=2), dict(method="vpt-shallow"), dict(vpt_depth=4)])
def test_parameter_count_matches_the_formula(kw):
    cfg = VAPTConfig(**{**SPEC, **kw})
    model = vapt.apply_vapt(_vit(), cfg)
    assert vapt.count_parameters(model) == vapt.expected_parameters(model, cfg)
    head = sum(p.numel() for p in model.classifier.parameters())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == vapt.count_parameters(model) + head


# --------------------------------------------------------------------------------------------------
# layout and initialisation


@pytest.mark.parametrize("method", ["vapt", "vpt-deep", "vpt-shallow"])
def test_sequence_length_at_every_layer_and_output_layout(method):
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC, method=method))
    x = _images()
    inputs = _layer_inputs(model, x)
    assert [t.shape[1] for t in inputs] == [1 + 8 + 16] * 4
    out = model.vit(pixel_values=x).last_hidden_state
    assert out.shape == (4, 1 + 16, 64)  # the prompts are dropped after the last layer


def test_cls_stays_first_and_patches_keep_their_order():
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC, method="vpt-deep", prompt_dropout=0.0))
    x = _images()
    seen = {}
    last = vapt.vapt_layers(model)[-1][1].base_layer
    h = last.register_forward_hook(lambda m, a, o: seen.setdefault("inner", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        enc = model.vit.embeddings(x)
        inputs = _layer_inputs(model, x)
        out = model.vit(pixel_values=x).last_hidden_state
    h.remove()
    assert torch.equal(inputs[0][:, 0], enc[:, 0])            # [CLS] at index 0
    assert torch.equal(inputs[0][:, 1 + 8:], enc[:, 1:])       # patches in order after the prompts
    inner = seen["inner"]
    assert torch.equal(out, model.vit.layernorm(torch.cat([inner[:, :1], inner[:, 9:]], dim=1)))


def test_generated_prompts_are_zero_at_init():
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC))
    inputs = _layer_inputs(model, _images())
    for layer in (1, 2, 3):
        assert torch.equal(inputs[layer][:, 1:9], torch.zeros(4, 8, 64))
    assert inputs[0][:, 1:9].abs().sum() > 0  # the static layer-0 prompts are not


def test_vpt_depth_L_equals_vpt_deep():
    a = vapt.apply_vapt(_vit(), VAPTConfig(**{**SPEC, "vpt_depth": 4}))
    b = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC, method="vpt-deep"))
    assert not vapt.prompts_of(a).generators and vapt.count_parameters(a) == vapt.count_parameters(b)
    for pa, pb in zip(vapt.prompt_parameters(a), vapt.prompt_parameters(b)):
        assert torch.equal(pa, pb)
    x = _images()
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a(pixel_values=x).logits, b(pixel_values=x).logits)


def test_unload_gives_the_backbone_back():
    model = _vit()
    x = _images()
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    vapt.apply_vapt(model, VAPTConfig(**SPEC))
    _train(model, 2)
    head = {k: v.clone() for k, v in model.classifier.state_dict().items()}
    vapt.unload(model)
    assert not vapt.vapt_layers(model)
    model.classifier.load_state_dict({k: v for k, v in _vit().classifier.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(model(pixel_values=x).logits, ref)
    assert head


def test_channelwise_conv_equals_a_loop_over_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, 4, generator=g)
    k = torch.randn(1, 1, 2, 2, generator=g)
    out = vapt.channelwise_conv(x, k)
    for c in range(5):
        ref = nn.functional.conv2d(x[:, c:c + 1], k)
        assert torch.allclose(out[:, c:c + 1], ref, atol=1e-6)
    per = torch.randn(5, 1, 2, 2, generator=g)
    out2 = vapt.channelwise_conv(x, per)
    assert torch.allclose(out2[:, 3:4], nn.functional.conv2d(x[:, 3:4], per[3:4]), atol=1e-6)


# --------------------------------------------------------------------------------------------------
# training


def test_backbone_frozen_and_unchanged_after_training_prompts_depend_on_input():
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC, conv_dropout=0.0, mlp_dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.vit.named_parameters() if "prompts." not in n}
    assert not any(p.requires_grad for n, p in model.vit.named_parameters() if "prompts." not in n)
    prompts0 = [p.detach().clone() for p in vapt.prompt_parameters(model)]
    _train(model, 5)
    after = {n: p for n, p in model.vit.named_parameters() if "prompts." not in n}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert any(not torch.equal(a, b) for a, b in zip(prompts0, vapt.prompt_parameters(model)))
    # the generated prompts of two different images differ (input-adaptive experts)
    inputs = _layer_inputs(model, _images(2, seed=7))
    p2 = inputs[2][:, 1:9]
    assert (p2[0] - p2[1]).abs().max() > 1e-6
    # and the Jacobian of P_2 w.r.t. the input is non-zero
    x = _images(1, seed=3).requires_grad_(True)
    seen = []
    h = vapt.vapt_layers(model)[2][1].base_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model(pixel_values=x)
    h.remove()
    (g,) = torch.autograd.grad(seen[0][:, 1:9].sum(), x)
    assert g.abs().max() > 0


# --------------------------------------------------------------------------------------------------
# the prompt-only checkpoint


def test_save_load_bit_exact_and_fingerprint(tmp_path):
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC))
    _train(model, 3)
    path = vapt.save_vapt(model, tmp_path / "vapt.safetensors")
    from rankwise.core import io

    tensors, meta = io.load_tensors(path)
    assert not any(k.startswith("vit.") for k in tensors)  # the backbone is not written
    assert sum(t.numel() for k, t in tensors.items() if k.startswith("prompts.")) == 1660
    fresh = _vit()
    vapt.load_vapt(fresh, path)
    for a, b in zip(vapt.trainable_parameters(model), vapt.trainable_parameters(fresh)):
        assert torch.equal(a, b)
    x = _images()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(pixel_values=x).logits, fresh(pixel_values=x).logits)
    assert vapt.read_config(path) == VAPTConfig(**SPEC)
    other = _vit(seed=1)  # another backbone
    with pytest.raises(ArtifactError, match="different base model"):
        vapt.load_vapt(other, path)
    assert not vapt.vapt_layers(other)  # unchanged
    vapt.load_vapt(other, path, check_base=False)
    assert vapt.vapt_layers(other)


def test_load_refuses_corrupt_and_mismatched(tmp_path):
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC))
    path = vapt.save_vapt(model, tmp_path / "v.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    fresh = _vit()
    with pytest.raises(ArtifactError):
        vapt.load_vapt(fresh, bad)
    with pytest.raises(ArtifactError):
        vapt.load_vapt(fresh, tmp_path / "missing.safetensors")
    vapt.apply_vapt(fresh, VAPTConfig(**SPEC, method="vpt-deep"))
    with pytest.raises(ArtifactError, match="saved with"):
        vapt.load_vapt(fresh, path)
    assert vapt.prompts_of(fresh).config.method == "vpt-deep"


# --------------------------------------------------------------------------------------------------
# DeiT-style backbones (CLS + distillation token)


def test_deit_with_distillation_token():
    model = _deit()
    x = _images(2)
    cfg = VAPTConfig(num_prompts=3, kernel_size=2, mlp_hidden=4)
    vapt.apply_vapt(model, cfg)
    bb = vapt.find_backbone(model)
    assert bb.num_prefix == 2
    assert [t.shape[1] for t in _layer_inputs(model, x)] == [2 + 3 + 16] * 3
    assert vapt.count_parameters(model) == vapt.num_parameters(cfg, 32, 3, (4, 4))
    assert set(vapt.head_names(model)) == {"cls_classifier.weight", "cls_classifier.bias",
                                           "distillation_classifier.weight", "distillation_classifier.bias"}
    with torch.no_grad():
        assert model(pixel_values=x).logits.shape == (2, 3)


# --------------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs():
    with pytest.raises(ValueError, match="kernel_size=5 exceeds the 4x4 patch grid"):
        vapt.apply_vapt(_vit(), VAPTConfig(kernel_size=5))
    with pytest.raises(ValueError, match="vpt_depth=5 exceeds the 4 layers"):
        vapt.apply_vapt(_vit(), VAPTConfig(vpt_depth=5))
    with pytest.raises(TypeError, match="ViT backbone"):
        vapt.apply_vapt(zoo.tiny_llama(), VAPTConfig())
    with pytest.raises(TypeError, match="ViT backbone"):
        vapt.apply_vapt(nn.Linear(3, 3), VAPTConfig())
    for kw, msg in ((dict(num_prompts=0), "VAPTConfig.num_prompts must be an int >= 1"),
                    (dict(mlp_hidden=0), "VAPTConfig.mlp_hidden must be an int >= 1"),
                    (dict(method="vpt"), "VAPTConfig.method must be one of"),
                    (dict(conv_dropout=1.0), "VAPTConfig.conv_dropout must be a number in"),
                    (dict(vpt_depth=0), "VAPTConfig.vpt_depth must be an int >= 1")):
        with pytest.raises(ValueError, match=msg):
            VAPTConfig(**kw)
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC))
    with pytest.raises(ValueError, match="already has VAPT prompts"):
        vapt.apply_vapt(model, VAPTConfig(**SPEC))
    with pytest.raises(ValueError, match="doesn't match|size"):  # transformers' own check
        model(pixel_values=torch.rand(1, 1, 20, 20))
    with pytest.raises(ValueError, match="patch grid"):  # interpolated position embeddings: VAPT's check
        model(pixel_values=torch.rand(1, 1, 20, 20), interpolate_pos_encoding=True)
    deep = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC, method="vpt-deep"))
    with torch.no_grad():
        assert deep(pixel_values=torch.rand(1, 1, 20, 20), interpolate_pos_encoding=True).logits.shape == (1, 5)


def test_nan_in_generated_prompts_names_the_layer():
    model = vapt.apply_vapt(_vit(), VAPTConfig(**SPEC))
    with torch.no_grad():
        vapt.prompts_of(model).generators["2"].proj.bias.fill_(float("nan"))
    with pytest.raises(NumericalError, match="layer 2"):
        model(pixel_values=_images(1))


def test_registered():
    entry = registry.get("vapt")
    assert entry.entry is vapt.apply_vapt and entry.config is VAPTConfig
    assert registry.status("vapt") in ("implemented", "reproduced")
    assert entry.extras["methods"] == ("vapt", "vpt-deep", "vpt-shallow")
