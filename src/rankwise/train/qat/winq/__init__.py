"""WinQ: faster quantization-aware training by periodic interpolation resets and noise-injected
gradients (ICML 2026, arXiv 2605.17471).

WinQ adds two cheap operations to any weight-only QAT method (here: the quantizers of
:mod:`rankwise.train.qat.baselines`, ParetoQ's by default):

1. **Periodic interpolation reset** (the "window" re-initialisation). Every ``K`` optimizer steps
   (never at step 0, never at the last step), in ``no_grad`` and without noise, every quantized
   layer's latent weights move toward the quantization grid::

       W <- alpha W + (1 - alpha) Q_b(W; c)            (default alpha = 0.2, K = T / 4)

   ``Q_b(W; c)`` is unchanged by this move as long as ``W`` stays in its rounding cell, which a
   convex combination with ``Q_b(W)`` guarantees for the fixed per-channel scales, so the quantized
   model (and its loss) does not change at the reset; the distance ``||W - Q(W)||`` shrinks by
   ``alpha``. The optimizer state and the learning-rate schedule are not touched.
2. **Noise-injected gradients**. At every step the loss and gradient are taken at
   ``Q_b(W + U; c + U_c)`` with ``U ~ N(0, sigma_w^2 I)``, ``U_c ~ N(0, sigma_c^2 I)`` (pre-quantization
   noise), so training descends ``E f(W + U) ~ f(W) + sigma^2/2 tr(H)``, which pushes the latent
   weights out of flat saddle regions. ``symmetric=True`` (the default, a choice: the Noise Stability
   Optimization estimator of the same group) evaluates ``+U`` and ``-U`` and averages the two
   gradients, which cancels the odd terms (exact on a quadratic); ``symmetric=False`` is the cheaper
   one-sided estimator. ``num_perturbs`` draws are averaged.

Usage, framework-agnostic (no HF Trainer needed)::

    model = prepare_qat(model, QATConfig(w_bits=2))
    winq = WinQCallback(total_steps=T, reset_every=T // 4, alpha=0.2, sigma_w=1e-3, sigma_c=1e-3)
    for step in range(1, T + 1):
        loss = winq.training_step(model, batch, loss_fn)   # noisy forward/backward(s)
        opt.step(); opt.zero_grad(); winq.on_step_end(model, step)
    export_quantized(model, "model_w2.safetensors")
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.core.errors import RankwiseError
from rankwise.core.registry import register
from rankwise.core.validate import check_bool, check_int, check_number, check_positive, check_unit
from rankwise.train.qat.baselines import QATConfig, QuantLinear, check_and_clamp_, prepare_qat, quant_layers

__all__ = [
    "WinQCallback",
    "WinQConfig",
    "distance_to_grid",
    "interpolation_reset",
    "perturbed_gradient",
    "winq",
]


@dataclass(frozen=True)
class WinQConfig:
    """WinQ hyper-parameters (paper defaults: alpha 0.2, K = T/4, sigma_w = sigma_c = 1e-3).

    ``reset_every``: K in optimizer steps (``None``: a quarter of the total steps). ``alpha`` in
    [0, 1] (1 disables the reset: ``W`` is kept bit for bit). ``sigma_w``, ``sigma_c`` >= 0 (0
    disables the noise: one clean forward/backward, bit-identical to plain QAT). ``symmetric``:
    average the gradients at +U and -U. ``num_perturbs`` >= 1 draws per step. ``relative_sigma``:
    scale both sigmas per layer by ``RMS(W) / sigma_ref_rms`` (the reproduction's choice for tiny
    models, whose weights are larger than an LLM's ~0.02). ``seed``: the noise generator's seed.
    """

    reset_every: int | None = None
    alpha: float = 0.2
    sigma_w: float = 1e-3
    sigma_c: float = 1e-3
    symmetric: bool = True
    num_perturbs: int = 1
    relative_sigma: bool = False
    sigma_ref_rms: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("WinQConfig.reset_every", self.reset_every, 1, allow_none=True)
        check_unit("WinQConfig.alpha", self.alpha)
        check_number("WinQConfig.sigma_w", self.sigma_w, 0.0)
        check_number("WinQConfig.sigma_c", self.sigma_c, 0.0)
        check_bool("WinQConfig.symmetric", self.symmetric)
        check_int("WinQConfig.num_perturbs", self.num_perturbs, 1)
        check_bool("WinQConfig.relative_sigma", self.relative_sigma)
        check_positive("WinQConfig.sigma_ref_rms", self.sigma_ref_rms)
        check_int("WinQConfig.seed", self.seed, 0)


# --------------------------------------------------------------------------------------------------
# pure pieces


@torch.no_grad()
def interpolation_reset(model: nn.Module, alpha: float) -> list[tuple[str, float, float]]:
    """``W <- alpha W + (1 - alpha) Q_b(W; c)`` on every :class:`QuantLinear` (no noise, no grad).

    Returns ``[(layer, ||W - Q(W)|| before, after)]``. Scales are not changed.
    """
    a = check_unit("alpha", alpha)
    out = []
    for name, layer in quant_layers(model):
        q = layer.quantized_weight(noisy=False)
        before = float((layer.weight - q).norm())
        if a != 1.0:
            layer.weight.mul_(a).add_(q, alpha=1.0 - a)
        out.append((name, before, float((layer.weight - layer.quantized_weight(noisy=False)).norm())))
    return out


@torch.no_grad()
def distance_to_grid(model: nn.Module) -> float:
    """``sqrt(sum over layers ||W - Q(W)||_F^2)`` of a prepared model (float64 accumulation)."""
    total = 0.0
    for _, layer in quant_layers(model):
        total += float((layer.weight.double() - layer.quantized_weight(noisy=False).double()).square().sum())
    return math.sqrt(total)


def perturbed_gradient(fn: Callable[[Sequence[torch.Tensor]], torch.Tensor], params: Sequence[torch.Tensor],
                       sigma: float, generator: torch.Generator, symmetric: bool = True,
                       num_perturbs: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Noise-injected gradient estimate of ``E_U f(theta + U)``, ``U ~ N(0, sigma^2 I)``.

    ``fn`` maps a list of tensors (same shapes as ``params``) to a scalar. Returns ``(mean loss,
    gradients)``: the mean over ``num_perturbs`` draws of ``grad f(theta + U)`` (one-sided) or of
    ``(grad f(theta + U) + grad f(theta - U)) / 2`` (symmetric; exact for a quadratic ``f``).
    """
    sigma = check_number("sigma", sigma, 0.0)
    check_int("num_perturbs", num_perturbs, 1)
    base = [p.detach() for p in params]
    grads = [torch.zeros_like(p) for p in base]
    losses = []
    signs = (1.0, -1.0) if symmetric else (1.0,)
    count = num_perturbs * len(signs)
    for _ in range(num_perturbs):
        noise = [torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) * sigma for p in base]
        for sgn in signs:
            point = [(p + sgn * u).requires_grad_(True) for p, u in zip(base, noise)]
            loss = fn(point)
            gs = torch.autograd.grad(loss, point)
            for acc, g in zip(grads, gs):
                acc.add_(g / count)
            losses.append(loss.detach())
    return torch.stack(losses).mean(), grads


# --------------------------------------------------------------------------------------------------
# the callback


class WinQCallback:
    """WinQ for a hand-written (or any) training loop; see the module docstring for the loop.

    Args:
        total_steps: the number of optimizer steps T of the run (K defaults to T // 4; a reset at
            step T is skipped, it would not change the exported model).
        config: a :class:`WinQConfig`; keyword overrides (``reset_every=..., alpha=...``) are applied
            on top of it.
    """

    def __init__(self, total_steps: int, config: WinQConfig | None = None, **overrides: Any):
        self.total_steps = check_int("total_steps", total_steps, 1)
        config = config or WinQConfig()
        if not isinstance(config, WinQConfig):
            raise TypeError(f"config must be a WinQConfig, got {type(config).__name__}")
        self.config = replace(config, **overrides) if overrides else config
        k = self.config.reset_every if self.config.reset_every is not None else max(1, self.total_steps // 4)
        if k > self.total_steps:
            raise ValueError(f"reset_every={k} must be <= total_steps={self.total_steps}")
        self.reset_every = k
        self.generator = torch.Generator().manual_seed(self.config.seed)
        #: steps at which a reset was applied, with the total distance to the grid before/after
        self.resets: list[tuple[int, float, float]] = []

    # ------------------------------------------------------------------ noise
    @property
    def noisy(self) -> bool:
        return self.config.sigma_w > 0 or self.config.sigma_c > 0

    def _sample(self, layers: list[QuantLinear]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        cfg = self.config
        out = []
        for layer in layers:
            w = layer.weight
            factor = 1.0
            if cfg.relative_sigma:
                factor = float(w.detach().double().square().mean().sqrt()) / cfg.sigma_ref_rms
            u = torch.randn(w.shape, generator=self.generator, dtype=torch.float32).to(w) * (cfg.sigma_w * factor)
            uc = None
            if layer.clip is not None:
                uc = torch.randn(layer.clip.shape, generator=self.generator, dtype=torch.float32).to(layer.clip)
                uc = uc * (cfg.sigma_c * factor)
            out.append((u, uc))
        return out

    def training_step(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        """Forward/backward of ``loss_fn(model, batch)`` at the noise-perturbed quantized weights.

        Gradients accumulate into ``.grad`` (call ``optimizer.step()`` afterwards), averaged over the
        ``num_perturbs`` x (2 if symmetric) passes. With both sigmas 0 this is exactly one clean pass.
        Returns the mean loss (detached).
        """
        layers = [m for _, m in quant_layers(model)]
        if not layers:
            raise RankwiseError("WinQ: the model has no QuantLinear layer; call prepare_qat(model, QATConfig(...)) first")
        if not self.noisy:
            loss = loss_fn(model, batch)
            loss.backward()
            return loss.detach()
        signs = (1.0, -1.0) if self.config.symmetric else (1.0,)
        count = self.config.num_perturbs * len(signs)
        total = None
        try:
            for _ in range(self.config.num_perturbs):
                noise = self._sample(layers)
                for sgn in signs:
                    for layer, (u, uc) in zip(layers, noise):
                        layer.noise_w = u if sgn > 0 else -u
                        layer.noise_c = None if uc is None else (uc if sgn > 0 else -uc)
                    loss = loss_fn(model, batch)
                    (loss / count).backward()
                    total = loss.detach() if total is None else total + loss.detach()
        finally:
            for layer in layers:
                layer.noise_w = None
                layer.noise_c = None
        return total / count

    # ------------------------------------------------------------------ reset
    def on_step_end(self, model: nn.Module, step: int) -> bool:
        """Call after ``optimizer.step()`` with the 1-based step count. Clamps scales, checks for
        non-finite weights (raising :class:`~rankwise.core.errors.NumericalError` with the layer),
        and applies the interpolation reset when ``step % K == 0`` and ``step < total_steps``.
        Returns whether a reset happened."""
        step = check_int("step", step, 1)
        check_and_clamp_(model)
        if step % self.reset_every != 0 or step >= self.total_steps or self.config.alpha == 1.0:
            return False
        before = distance_to_grid(model)
        interpolation_reset(model, self.config.alpha)
        self.resets.append((step, before, distance_to_grid(model)))
        return True

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "total_steps": self.total_steps,
                "generator": self.generator.get_state(), "resets": [list(r) for r in self.resets]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cfg = WinQConfig(**state["config"])
        if cfg != self.config or state["total_steps"] != self.total_steps:
            raise RankwiseError("WinQCallback.load_state_dict: the saved config / total_steps differ from this callback's")
        self.generator.set_state(state["generator"])
        self.resets = [tuple(r) for r in state["resets"]]


def winq(model: nn.Module, config: WinQConfig | None = None, total_steps: int = 1000,
         qat: QATConfig | None = None) -> WinQCallback:
    """Prepare ``model`` for QAT (``qat``, ParetoQ 2-bit by default) unless it already holds
    :class:`QuantLinear` layers, and return the :class:`WinQCallback` for a run of ``total_steps``."""
    if not quant_layers(model):
        prepare_qat(model, qat or QATConfig())
    elif qat is not None:
        raise RankwiseError("winq: the model is already prepared for QAT; pass qat=None")
    return WinQCallback(total_steps, config)


register("winq", config=WinQConfig, entry=winq)
