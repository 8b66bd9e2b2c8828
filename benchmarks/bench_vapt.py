"""VAPT training and inference steps on the zoo's tiny ViT, side by side with VPT-deep, VPT-shallow and PEFT LoRA.

The model is :func:`rankwise.zoo.tiny_vit` at 16 x 16 (patch 4: a 4 x 4 grid, d = 64, 4 layers, 10 classes;
random weights: timing does not depend on pretraining), backbone frozen, head trainable. Prompt methods use
the VAPT reproduction's sizes (N_p = 8, K = 2, h = 4, vpt_depth = 1); PEFT LoRA is rank 2 on ``query`` /
``value`` (2,048 parameters, VPT-deep's count). Batch: 32 random images.

Cases (``ratio_vs_anchor`` < 1: faster than the anchor, PEFT LoRA):

* ``vapt_train_step``: forward, cross-entropy, backward, ``torch.optim.AdamW`` step, ``zero_grad``;
* ``vapt_forward``: one inference forward pass (eval mode, no gradients).

``params.added_parameters`` gives each implementation's trainable parameters besides the head. Run
``python -m benchmarks.run vapt`` (well under a minute on a free core).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case

BATCH = 32
IMPLS = ("peft-lora-r2", "rankwise-vapt", "rankwise-vpt-deep", "rankwise-vpt-shallow")


@functools.lru_cache(maxsize=1)
def _base() -> nn.Module:
    from rankwise import zoo

    return zoo.tiny_vit(seed=0, num_labels=10, image_size=16)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(BATCH, 1, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _build(impl: str) -> nn.Module:
    model = copy.deepcopy(_base())
    if impl == "peft-lora-r2":
        import peft

        cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], modules_to_save=["classifier"])
        return peft.get_peft_model(model, cfg)
    from rankwise.adapt import vapt

    method = impl[len("rankwise-"):]
    return vapt.apply_vapt(model, vapt.VAPTConfig(num_prompts=8, kernel_size=2, mlp_hidden=4, method=method))


def added_parameters(impl: str) -> int:
    model = _build(impl)
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "classifier" not in n)


def _train_step(impl: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        model = _build(impl).train()
        x, y = _inputs()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def run() -> float:
            loss = nn.functional.cross_entropy(model(pixel_values=x).logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return run
    return factory


def _forward(impl: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        model = _build(impl).eval()
        x, _ = _inputs()

        def run() -> torch.Tensor:
            with torch.no_grad():
                return model(pixel_values=x).logits
        return run
    return factory


def _params() -> dict[str, Any]:
    return {"batch": BATCH, "image": 16, "grid": "4x4", "hidden": 64, "layers": 4, "num_prompts": 8,
            "kernel_size": 2, "mlp_hidden": 4, "lora": "r=2 on query/value",
            "added_parameters": {"peft-lora-r2": 2048, "rankwise-vapt": 1660, "rankwise-vpt-deep": 2048,
                                 "rankwise-vpt-shallow": 512}}


CASES = [
    Case("vapt_train_step", {k: _train_step(k) for k in IMPLS}, anchor="peft-lora-r2", params=_params(),
         repeats=20, warmup=3),
    Case("vapt_forward", {k: _forward(k) for k in IMPLS}, anchor="peft-lora-r2", params=_params(),
         repeats=20, warmup=3),
]
