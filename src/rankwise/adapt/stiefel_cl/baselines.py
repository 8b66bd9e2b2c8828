"""The continual learners compared in the EBLoRA paper, behind one interface (:class:`ContinualLearner`).

* :class:`EBLoRALearner`: :class:`~rankwise.adapt.stiefel_cl.EBLoRAContinual` (balanced factors on the
  restricted Stiefel manifold, RiemannianAdamW, F at energy ε);
* :class:`SequentialLoRA`: a fresh PEFT LoRA per task (``peft.LoraConfig``, ``get_peft_model``), merged with
  ``merge_and_unload`` after the task: what users run today;
* :class:`OLoRA`: the same PEFT LoRA plus O-LoRA's penalty ``λ Σ_{j<t} Σ_layers ||A_t A_j^T||_F^2`` keeping the
  new ``A`` (r x d_in) orthogonal to the earlier tasks' ``A``;
* :class:`InfLoRALike`: the same PEFT LoRA with ``A``'s rows kept in the complement of the protected input
  basis F (projected at the start and after every step, ``A <- A (I - F F^T)``), F grown by the same GPM rule
  as EBLoRA's, but ``B``, ``A`` unconstrained (imbalanced): the ablation closest to EBLoRA.

Every learner adapts the Linear layers its ``target`` names (PEFT ``target_modules`` semantics for the PEFT
ones), at the same rank and ``alpha``; ``loss_fn(model, batch)`` is the loss of the gradient passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from rankwise.adapt.stiefel_cl.config import EBLoRAConfig
from rankwise.adapt.stiefel_cl.continual import EBLoRAContinual
from rankwise.adapt.stiefel_cl.functional import factored_spectrum_ratio, gpm_update
from rankwise.core.calibration import LossFn, gradient_pass
from rankwise.core.validate import check_choice, check_int, check_number, check_positive

__all__ = ["LEARNERS", "ContinualLearner", "EBLoRALearner", "InfLoRALike", "OLoRA", "SequentialLoRA", "make_learner"]

LEARNERS = ("eblora", "lora", "olora", "inflora")


class ContinualLearner:
    """What the task loop (:func:`rankwise.adapt.stiefel_cl.runner.run_continual`) needs from a method.

    ``model`` is the whole model (encoder and heads); the learner adapts the encoder's target layers.
    Per task: :meth:`begin_task` (new adapter), :meth:`optimizer` (over the adapter and ``head_params``),
    :meth:`penalty` (added to the task loss, or None), :meth:`after_step` (a constraint after each step),
    :meth:`end_task` (merge; returns ``{layer: σ_1/σ_r of ΔW_t}``).
    """

    name = "?"

    def __init__(self, model: nn.Module, target: Iterable[str], rank: int, alpha: float,
                 loss_fn: LossFn | None = None) -> None:
        self.model = model
        self.target = tuple(target)
        self.rank = check_int(f"{type(self).__name__}.rank", rank, 1)
        self.alpha = check_positive(f"{type(self).__name__}.alpha", alpha)
        self.loss_fn = loss_fn

    def begin_task(self, grad_batches: list[Any], name: str) -> None:
        raise NotImplementedError

    def optimizer(self, lr: float, head_params: Iterable[nn.Parameter], head_lr: float) -> torch.optim.Optimizer:
        raise NotImplementedError

    def penalty(self) -> torch.Tensor | None:
        return None

    def after_step(self) -> None:
        return None

    def end_task(self, grad_batches: list[Any]) -> dict[str, float]:
        raise NotImplementedError

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a resumed run needs beyond the model's weights: ``(tensors, JSON metadata)``."""
        return {}, {}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], tasks_done: int) -> None:
        """Inverse of :meth:`state` on a model whose weights are those after ``tasks_done`` tasks."""
        return None


class EBLoRALearner(ContinualLearner):
    name = "eblora"

    def __init__(self, model: nn.Module, target: Iterable[str], rank: int, alpha: float,
                 loss_fn: LossFn | None = None, *, energy_threshold: float = 0.99, grad_batches: int = 8,
                 direction_lr_scale: float | None = None, seed: int = 0) -> None:
        super().__init__(model, target, rank, alpha, loss_fn)
        cfg = EBLoRAConfig(rank=rank, alpha=alpha, energy_threshold=energy_threshold, target=self.target,
                           grad_batches=grad_batches, direction_lr_scale=direction_lr_scale, seed=seed)
        self.cl = EBLoRAContinual(model, cfg, loss_fn=loss_fn)
        self.last_optimizer = None
        #: a folder: each task's update is also written as a PEFT LoRA directory ``<folder>/<task>`` before it merges
        self.peft_export: str | Path | None = None

    def begin_task(self, grad_batches: list[Any], name: str) -> None:
        self.cl.begin_task(grad_batches, name)

    def optimizer(self, lr: float, head_params: Iterable[nn.Parameter], head_lr: float) -> torch.optim.Optimizer:
        self.last_optimizer = self.cl.optimizer(lr=lr, extra_params=list(head_params), extra_lr=head_lr)
        return self.last_optimizer

    def end_task(self, grad_batches: list[Any]) -> dict[str, float]:
        if self.peft_export is not None:
            self.cl.export_peft(Path(self.peft_export) / self.cl.current, overwrite=True)
        return dict(self.cl.end_task(grad_batches).spectrum_ratio)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.cl.state_tensors()

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], tasks_done: int) -> None:
        self.cl = EBLoRAContinual.from_state(self.model, tensors, meta, apply_deltas=False, loss_fn=self.loss_fn)


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "lora_A") and isinstance(getattr(m, "lora_A"), nn.ModuleDict) and "default" in m.lora_A]


def _peel(name: str) -> str:
    """A module name of the PEFT-wrapped model as it is in the plain model."""
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


class SequentialLoRA(ContinualLearner):
    """A new PEFT LoRA per task (B = 0, A Kaiming), trained with AdamW, ``merge_and_unload`` at the end."""

    name = "lora"

    def __init__(self, model: nn.Module, target: Iterable[str], rank: int, alpha: float,
                 loss_fn: LossFn | None = None, *, seed: int = 0) -> None:
        super().__init__(model, target, rank, alpha, loss_fn)
        self.seed = seed
        self.peft_model: Any = None
        self.holder: Any = None
        self.tasks_done = 0

    def _inject(self) -> None:
        import peft

        cfg = peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target), lora_dropout=0.0)
        with torch.random.fork_rng(devices=[]):  # PEFT draws A from the global RNG
            torch.manual_seed(self.seed * 1000 + self.tasks_done)
            self.peft_model = peft.get_peft_model(self.model, cfg)

    def begin_task(self, grad_batches: list[Any], name: str) -> None:
        self._inject()

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.peft_model.named_parameters() if "lora_" in n]

    def optimizer(self, lr: float, head_params: Iterable[nn.Parameter], head_lr: float) -> torch.optim.Optimizer:
        heads = [p for p in head_params]
        for p in heads:
            p.requires_grad_(True)
        return torch.optim.AdamW([{"params": self.adapter_parameters(), "lr": lr}, {"params": heads, "lr": head_lr}],
                                 weight_decay=0.0)

    @torch.no_grad()
    def spectra(self) -> dict[str, float]:
        out = {}
        for n, m in _lora_layers(self.peft_model):
            B, A = m.lora_B["default"].weight, m.lora_A["default"].weight
            out[_peel(n)] = factored_spectrum_ratio(B * m.scaling["default"], A)
        return out

    def end_task(self, grad_batches: list[Any]) -> dict[str, float]:
        ratios = self.spectra()
        self.before_merge()
        merged = self.peft_model.merge_and_unload()
        if merged is not self.model:
            raise RuntimeError("merge_and_unload returned another model object than the one adapted")
        self.peft_model = None
        self.tasks_done += 1
        for p in self.model.parameters():
            p.requires_grad_(False)
        return ratios

    def before_merge(self) -> None:
        return None

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], tasks_done: int) -> None:
        self.tasks_done = tasks_done


class OLoRA(SequentialLoRA):
    """PEFT LoRA with O-LoRA's orthogonality penalty ``λ Σ_{j<t} Σ_layers ||A_t A_j^T||_F^2`` (λ = ``lam``)."""

    name = "olora"

    def __init__(self, model: nn.Module, target: Iterable[str], rank: int, alpha: float,
                 loss_fn: LossFn | None = None, *, lam: float = 0.1, seed: int = 0) -> None:
        super().__init__(model, target, rank, alpha, loss_fn, seed=seed)
        self.lam = check_number("OLoRA.lam", lam, 0.0)
        self.previous: dict[str, list[torch.Tensor]] = {}
        self._pairs: list[tuple[nn.Parameter, list[torch.Tensor]]] = []

    def begin_task(self, grad_batches: list[Any], name: str) -> None:
        super().begin_task(grad_batches, name)
        self._pairs = [(m.lora_A["default"].weight, self.previous.get(_peel(n), []))
                       for n, m in _lora_layers(self.peft_model)]

    def penalty(self) -> torch.Tensor | None:
        terms = [(A @ P.T).square().sum() for A, olds in self._pairs for P in olds]
        if not terms:
            return None
        return self.lam * torch.stack(terms).sum()

    def before_merge(self) -> None:
        for n, m in _lora_layers(self.peft_model):
            self.previous.setdefault(_peel(n), []).append(m.lora_A["default"].weight.detach().clone())

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return ({f"A/{n}/{k}": A for n, As in self.previous.items() for k, A in enumerate(As)},
                {"layers": {n: len(As) for n, As in self.previous.items()}})

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], tasks_done: int) -> None:
        super().restore(tensors, meta, tasks_done)
        self.previous = {n: [tensors[f"A/{n}/{k}"] for k in range(int(c))] for n, c in meta["layers"].items()}


class InfLoRALike(SequentialLoRA):
    """PEFT LoRA with ``A <- A (I - F F^T)`` at the start and after every step; F by the GPM rule at ``ε``."""

    name = "inflora"

    def __init__(self, model: nn.Module, target: Iterable[str], rank: int, alpha: float,
                 loss_fn: LossFn | None = None, *, energy_threshold: float = 0.99, grad_batches: int = 8,
                 seed: int = 0) -> None:
        super().__init__(model, target, rank, alpha, loss_fn, seed=seed)
        self.energy_threshold = check_number("InfLoRALike.energy_threshold", energy_threshold, 0.0, 1.0,
                                             low_open=True)
        self.grad_batches = grad_batches
        self.bases: dict[str, torch.Tensor] = {}
        self._pairs: list[tuple[nn.Parameter, torch.Tensor]] = []

    def begin_task(self, grad_batches: list[Any], name: str) -> None:
        super().begin_task(grad_batches, name)
        self._pairs = [(m.lora_A["default"].weight, self.bases[_peel(n)])
                       for n, m in _lora_layers(self.peft_model) if _peel(n) in self.bases]
        self.after_step()

    @torch.no_grad()
    def after_step(self) -> None:
        for A, F in self._pairs:
            A.sub_((A @ F) @ F.T)

    def end_task(self, grad_batches: list[Any]) -> dict[str, float]:
        names = [_peel(n) for n, _ in _lora_layers(self.peft_model)]
        ratios = super().end_task(grad_batches)
        weights = {n: self.model.get_submodule(n).weight for n in names}
        sums, count = gradient_pass(self.model, weights, grad_batches, self.loss_fn, max_batches=self.grad_batches,
                                    who="InfLoRA-like")
        if count == 0:
            raise ValueError("the gradient loader yielded no batch")
        for n in names:
            up = gpm_update(self.bases.get(n), sums[n] / count, self.energy_threshold, name=n)
            self.bases[n] = up.F
        return ratios

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {f"F/{n}": F for n, F in self.bases.items()}, {"layers": list(self.bases)}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], tasks_done: int) -> None:
        super().restore(tensors, meta, tasks_done)
        self.bases = {n: tensors[f"F/{n}"] for n in meta["layers"]}


def make_learner(method: str, model: nn.Module, target: Iterable[str], rank: int, alpha: float,
                 loss_fn: LossFn | None = None, *, energy_threshold: float = 0.99, olora_lambda: float = 0.1,
                 grad_batches: int = 8, seed: int = 0) -> ContinualLearner:
    """The learner ``method`` (one of :data:`LEARNERS`) on ``model``."""
    check_choice("continual method", method, LEARNERS)
    if method == "eblora":
        return EBLoRALearner(model, target, rank, alpha, loss_fn, energy_threshold=energy_threshold,
                             grad_batches=grad_batches, seed=seed)
    if method == "lora":
        return SequentialLoRA(model, target, rank, alpha, loss_fn, seed=seed)
    if method == "olora":
        return OLoRA(model, target, rank, alpha, loss_fn, lam=olora_lambda, seed=seed)
    return InfLoRALike(model, target, rank, alpha, loss_fn, energy_threshold=energy_threshold,
                       grad_batches=grad_batches, seed=seed)
