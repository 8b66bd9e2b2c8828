"""Module surgery for ULD-Net: :func:`convert` (norms -> PolyNorm, activations -> PolyAct, max-pool ->
avg-pool) and :func:`posthoc` (the baseline: a trained ReLU/LayerNorm network with ReLU and ``1/sqrt``
replaced by fitted polynomials), plus the digits MLP of the reproduction."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from rankwise.core import surgery
from rankwise.science.uldnet.config import ULDConfig
from rankwise.science.uldnet.layers import ChebNorm, PolyAct, PolyFitAct, PolyNorm, fit_inv_sqrt, fit_relu

__all__ = ["ACTIVATIONS", "convert", "mlp", "non_polynomial_modules", "posthoc", "polynorms"]

#: Activations :func:`convert` replaces by PolyAct.
ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU)
#: Modules that are polynomial at inference as they are.
POLYNOMIAL = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.AvgPool1d, nn.AvgPool2d, nn.Flatten, nn.Identity, nn.Dropout,
              PolyNorm, PolyAct, PolyFitAct, ChebNorm)


def _norm_shape(m: nn.Module) -> tuple[tuple[int, ...], Tensor | None, Tensor | None] | None:
    if isinstance(m, nn.LayerNorm):
        return tuple(m.normalized_shape), m.weight, m.bias
    if isinstance(m, nn.BatchNorm1d):
        return (m.num_features,), m.weight, m.bias
    if isinstance(m, nn.BatchNorm2d):
        return (m.num_features, 1, 1), m.weight, m.bias
    if isinstance(m, nn.GroupNorm) and m.num_groups == 1:
        return (m.num_channels, 1, 1), m.weight, m.bias
    return None


def convert(model: nn.Module, config: ULDConfig | None = None) -> nn.Module:
    """Turn ``model`` into a ULD-Net in place and return it (spec "Operator replacements").

    LayerNorm / BatchNorm1d / BatchNorm2d / GroupNorm(1, C) -> :class:`PolyNorm` (per-sample axis;
    their affine weights are kept), ReLU / GELU / SiLU / Tanh / Sigmoid / LeakyReLU / ELU ->
    :class:`PolyAct`, MaxPool -> AvgPool of the same window. All-or-nothing (``core.surgery``). Other
    modules are left as they are; :func:`non_polynomial_modules` lists what is still not polynomial.
    """
    cfg = config or ULDConfig()
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert needs an nn.Module, got {type(model).__name__}")
    plan: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not name:
            continue
        spec = _norm_shape(m)
        if spec is not None:
            shape, w, b = spec
            new: nn.Module = PolyNorm(shape, cfg, affine=w is not None)
            if w is not None:
                with torch.no_grad():
                    new.weight.copy_(w.detach().reshape(shape))
                    new.bias.copy_(b.detach().reshape(shape))
            plan.append((name, new))
        elif isinstance(m, ACTIVATIONS):
            plan.append((name, PolyAct(cfg)))
        elif cfg.maxpool_to_avgpool and isinstance(m, (nn.MaxPool1d, nn.MaxPool2d)):
            cls = nn.AvgPool1d if isinstance(m, nn.MaxPool1d) else nn.AvgPool2d
            plan.append((name, cls(m.kernel_size, m.stride, m.padding)))
    with surgery.transaction(model):
        for name, new in plan:
            surgery.replace_module(model, name, new)
    return model


def non_polynomial_modules(model: nn.Module) -> list[str]:
    """Names (and types) of the leaf modules that are not polynomial at inference."""
    out = []
    for name, m in model.named_modules():
        if name and not list(m.children()) and not isinstance(m, POLYNOMIAL):
            out.append(f"{name} ({type(m).__name__})")
    return out


def polynorms(model: nn.Module) -> list[PolyNorm]:
    return [m for m in model.modules() if isinstance(m, PolyNorm)]


def mlp(sizes: Iterable[int] = (64, 64, 64, 10), norm: str = "layernorm", act: str = "relu",
        config: ULDConfig | None = None, seed: int = 0) -> nn.Sequential:
    """The reproduction's MLP: ``Linear -> norm -> act`` per hidden layer, then a Linear head.

    ``norm``/``act``: ``"layernorm"``/``"relu"`` (the plaintext reference; :func:`convert` turns it into
    ULD-Net) or ``"polynorm"``/``"polyact"`` (built converted). Seeds torch's global generator with ``seed``
    (``torch.manual_seed``) before building, so the initialisation and the dropout of a training that
    follows are reproducible."""
    sizes = [int(s) for s in sizes]
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"mlp sizes must be >= 2 positive ints, got {sizes}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.LayerNorm(sizes[i + 1]), nn.ReLU()]
    layers.append(nn.Linear(sizes[-2], sizes[-1]))
    model = nn.Sequential(*layers)
    if norm == "polynorm" or act == "polyact":
        convert(model, config)
    return model


@torch.no_grad()
def posthoc(model: nn.Module, calib: Tensor | Iterable[Tensor], relu_bound: float = 6.0, relu_degree: int = 7,
            norm_degree: int = 8, margin: tuple[float, float] = (0.8, 1.2)) -> nn.Module:
    """The post-hoc baseline (in place): ReLU -> least-squares degree-``relu_degree`` polynomial on
    ``[-relu_bound, relu_bound]``; LayerNorm (per-sample) -> :class:`ChebNorm`, whose ``1/sqrt`` is a
    degree-``norm_degree`` Chebyshev fit on ``[margin[0] * min, margin[1] * max]`` of the variances
    each LayerNorm sees on ``calib`` (inputs, or an iterable of input batches)."""
    batches = [calib] if isinstance(calib, Tensor) else list(calib)
    norms = {n: m for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    seen: dict[str, list[Tensor]] = {n: [] for n in norms}

    def hook(name: str):
        def fn(mod, inp, out):
            x = inp[0]
            seen[name].append(x.var(dim=tuple(range(x.dim() - len(mod.normalized_shape), x.dim())),
                                    unbiased=False).reshape(-1))
        return fn

    was = model.training
    model.eval()
    handles = [m.register_forward_hook(hook(n)) for n, m in norms.items()]
    try:
        for xb in batches:
            model(xb)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    relu = fit_relu(relu_bound, relu_degree)
    plan: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ReLU):
            plan.append((name, PolyFitAct(relu, f"ReLU on [-{relu_bound:g}, {relu_bound:g}]")))
        elif name in norms:
            v = torch.cat(seen[name]).double()
            lo, hi = margin[0] * float(v.min()), margin[1] * float(v.max())
            new = ChebNorm(m.normalized_shape, fit_inv_sqrt(lo, hi, norm_degree, m.eps), lo, hi, m.eps)
            if m.weight is not None:
                new.weight.copy_(m.weight)
                new.bias.copy_(m.bias)
            plan.append((name, new))
    with surgery.transaction(model):
        for name, new in plan:
            surgery.replace_module(model, name, new)
    return model
