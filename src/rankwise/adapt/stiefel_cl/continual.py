"""``EBLoRAContinual``: the EBLoRA task loop on one model (spec steps 1-5), with its state saved and resumed.

    cl = EBLoRAContinual(model, EBLoRAConfig(rank=4, alpha=8), loss_fn=loss)
    for task in tasks:
        cl.begin_task(task.grad_batches)            # gradient SVD init (F removed), s = 0
        opt = cl.optimizer(lr=1e-3, extra_params=head.parameters())
        for batch in task.train_batches:
            loss(cl.model, batch).backward(); opt.step(); opt.zero_grad()
        cl.end_task(task.grad_batches)              # merge ΔW_t, update F (energy ε)
    cl.save("eblora_state.safetensors")             # F of every layer + every task's (U, V, s, c)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from rankwise.adapt.stiefel_cl.config import EBLoRAConfig
from rankwise.adapt.stiefel_cl.functional import empty_basis, factored_spectrum_ratio, gpm_update
from rankwise.adapt.stiefel_cl.layer import EBLoRALinear
from rankwise.adapt.stiefel_cl.model import EBLORA, adapt, collect_gradients, export_peft, make_optimizer
from rankwise.adapt.stiefel_cl.optimizer import RiemannianAdamW
from rankwise.core import io
from rankwise.core.adapters import wrap_layer
from rankwise.core.calibration import LossFn
from rankwise.core.errors import ArtifactError, RankwiseError
from rankwise.core.select import Selector

__all__ = ["EBLoRAContinual", "TaskRecord", "STATE_KIND"]

STATE_KIND = "rankwise.stiefel_cl.state"


@dataclass
class TaskRecord:
    """What :meth:`EBLoRAContinual.end_task` measured for one task: per layer the magnitude ``s``, ``σ_1/σ_r``
    of ``ΔW_t``, the protected columns added and the basis size after the update."""

    name: str
    magnitude: dict[str, float] = field(default_factory=dict)
    spectrum_ratio: dict[str, float] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    protected: dict[str, int] = field(default_factory=dict)

    def worst_ratio(self) -> float:
        return max(self.spectrum_ratio.values()) if self.spectrum_ratio else float("nan")


class EBLoRAContinual:
    """Continual learning with EBLoRA on ``model`` (in place): one balanced adapter per task, merged at its end.

    ``target`` (default ``config.target``) picks the layers once, at the first task; ``loss_fn(model, batch)``
    is the loss of the gradient passes (default: the output's ``.loss``). :attr:`tasks` holds a
    :class:`TaskRecord` per finished task; :attr:`deltas` every task's factors ``{task: {layer: (U, V, s, c)}}``.
    """

    def __init__(self, model: nn.Module, config: EBLoRAConfig | None = None, target: Selector = None,
                 loss_fn: LossFn | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"EBLoRAContinual: model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = EBLoRAConfig() if config is None else config
        if not isinstance(self.config, EBLoRAConfig):
            raise TypeError(f"EBLoRAContinual: config must be an EBLoRAConfig, got {type(self.config).__name__}")
        self.target = self.config.target if target is None else target
        self.loss_fn = loss_fn
        self.tasks: list[TaskRecord] = []
        self.deltas: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]] = {}
        self.current: str | None = None
        self._layers: list[str] | None = None

    # -- the loop -------------------------------------------------------------------------------
    def layers(self) -> list[tuple[str, EBLoRALinear]]:
        return EBLORA.layers(self.model)

    def begin_task(self, grad_loader: Iterable[Any], name: str | None = None) -> str:
        """Start task ``name`` (default ``task<k>``): gradient initialisation of a new adapter, ``s = 0``."""
        if self.current is not None:
            raise RankwiseError(f"task {self.current!r} is still open; call end_task first")
        name = name or f"task{len(self.tasks)}"
        if name in self.deltas:
            raise ValueError(f"a task named {name!r} was learned already; choose another name")
        target = self.target if self._layers is None else self._layers
        adapt(self.model, self.config, target=target, name=name, calib=grad_loader, loss_fn=self.loss_fn)
        self._layers = [n for n, _ in self.layers()]
        self.current = name
        return name

    def optimizer(self, lr: float = 1e-3, weight_decay: float = 0.0, *, betas: tuple[float, float] = (0.9, 0.999),
                  eps: float = 1e-8, direction_lr_scale: float | None = None,
                  extra_params: Iterable[nn.Parameter] = (), extra_lr: float | None = None) -> RiemannianAdamW:
        """:class:`RiemannianAdamW` over the open task's U, V, s (and ``extra_params``, e.g. the task's head)."""
        if self.current is None:
            raise RankwiseError("no task is open; call begin_task first")
        scale = self.config.lr_scale if direction_lr_scale is None else direction_lr_scale
        return make_optimizer(self.model, self.current, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                              direction_lr_scale=scale, extra_params=extra_params, extra_lr=extra_lr)

    def export_peft(self, directory: str | Path, **kwargs: Any) -> Path:
        """The open task's update as a PEFT LoRA directory (before :meth:`end_task`), see :func:`export_peft`."""
        if self.current is None:
            raise RankwiseError("no task is open; export a task's update before end_task")
        return export_peft(self.model, directory, self.current, **kwargs)

    def end_task(self, grad_loader: Iterable[Any]) -> TaskRecord:
        """Merge ``ΔW_t`` into the weights, then update each layer's F from the task's gradient at the trained
        model (GPM, ``config.energy_threshold``). Returns the task's :class:`TaskRecord`."""
        if self.current is None:
            raise RankwiseError("no task is open; call begin_task first")
        name = self.current
        layers = self.layers()
        rec = TaskRecord(name)
        factors = {}
        for lname, layer in layers:
            if name not in layer.eblora_U:
                continue
            U, V = layer.eblora_U[name].detach().clone(), layer.eblora_V[name].detach().clone()
            s = layer.eblora_s[name].detach().clone()
            c = layer.scaling[name]
            factors[lname] = (U, V, s, c)
            rec.magnitude[lname] = float(s)
            rec.spectrum_ratio[lname] = (factored_spectrum_ratio(float(c * s) * U, V.T) if float(s) != 0.0
                                         else float("nan"))
        self._merge_and_drop(name)
        hits = [(n, layer) for n, layer in layers if n in factors]
        grads = collect_gradients(self.model, hits, grad_loader, self.loss_fn, self.config.grad_batches)
        for lname, layer in hits:
            up = gpm_update(layer.protected, grads[lname], self.config.energy_threshold, name=lname)
            layer.set_protected(up.F)
            rec.added[lname] = up.added
            rec.protected[lname] = int(up.F.shape[1])
        self.deltas[name] = factors
        self.tasks.append(rec)
        self.current = None
        return rec

    def _merge_and_drop(self, name: str) -> None:
        """Fold adapter ``name`` into the base weights for good (the wrappers stay: they hold F)."""
        EBLORA.set_active(self.model, name)
        EBLORA.merge(self.model)
        for _, layer in self.layers():
            if name in layer.merged_adapters:
                layer.merged_adapters = []
            if name in layer.eblora_U:
                layer._drop_adapter(name)

    # -- state -------------------------------------------------------------------------------------
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, metadata)`` of :meth:`save`."""
        tensors: dict[str, torch.Tensor] = {}
        for lname, layer in self.layers():
            tensors[f"F/{lname}"] = layer.protected.detach()
        tasks = []
        for rec in self.tasks:
            for lname, (U, V, s, _) in self.deltas[rec.name].items():
                tensors[f"delta/{rec.name}/{lname}/U"] = U
                tensors[f"delta/{rec.name}/{lname}/V"] = V
                tensors[f"delta/{rec.name}/{lname}/s"] = s
            tasks.append({"name": rec.name, "scaling": {k: v[3] for k, v in self.deltas[rec.name].items()},
                          "magnitude": rec.magnitude, "added": rec.added, "protected": rec.protected,
                          "spectrum_ratio": {k: (None if not math.isfinite(v) else v)
                                             for k, v in rec.spectrum_ratio.items()}})
        cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.config).items()}
        meta = {"kind": STATE_KIND, "config": cfg, "layers": [n for n, _ in self.layers()], "tasks": tasks}
        return tensors, meta

    def save(self, path: str | Path) -> Path:
        """Write F of every layer and every finished task's factors to one safetensors file (atomically)."""
        if self.current is not None:
            raise RankwiseError(f"task {self.current!r} is open; save after end_task")
        tensors, meta = self.state_tensors()
        return io.save_tensors(path, tensors, meta)

    @classmethod
    def load(cls, model: nn.Module, path: str | Path, *, apply_deltas: bool = True,
             loss_fn: LossFn | None = None) -> "EBLoRAContinual":
        """Rebuild the driver from :meth:`save`'s file on ``model``: wrap the saved layers, restore each F
        bit-exactly and, with ``apply_deltas`` (``model`` is the original base model), merge every saved task's
        ``c s U V^T`` in the original order, which reproduces the trained weights bit-exactly."""
        tensors, meta = io.load_tensors(path)
        return cls.from_state(model, tensors, meta, apply_deltas=apply_deltas, loss_fn=loss_fn, source=str(path))

    @classmethod
    def from_state(cls, model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                   apply_deltas: bool = True, loss_fn: LossFn | None = None,
                   source: str = "EBLoRA state") -> "EBLoRAContinual":
        """:meth:`load` from ``(tensors, metadata)`` as :meth:`state_tensors` gives them."""
        path = source
        if meta.get("kind") != STATE_KIND:
            raise ArtifactError(f"{path}: not an EBLoRA continual state (kind={meta.get('kind')!r})")
        try:
            cfg = dict(meta["config"])
            cfg["target"] = tuple(cfg["target"])
            config = EBLoRAConfig(**cfg)
            layer_names = list(meta["layers"])
            tasks = list(meta["tasks"])
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{path}: malformed EBLoRA state metadata ({e})") from e
        cl = cls(model, config, target=layer_names, loss_fn=loss_fn)
        missing = [n for n in layer_names if f"F/{n}" not in tensors]
        if missing:
            raise ArtifactError(f"{path}: no protected basis for layers {missing[:3]}")
        with EBLORA.all_or_nothing(model):
            wrapped = {}
            for lname in layer_names:
                try:
                    mod = model.get_submodule(lname)
                except AttributeError:
                    raise ArtifactError(f"{path}: layer {lname!r} does not exist in this model") from None
                if not isinstance(mod, (nn.Linear, EBLoRALinear)):
                    raise ArtifactError(f"{path}: layer {lname!r} is a {type(mod).__name__}, not nn.Linear")
                wrapped[lname] = wrap_layer(model, lname, mod, EBLoRALinear)
                wrapped[lname].set_protected(tensors[f"F/{lname}"])
            for t in tasks:
                tname = t["name"]
                cl.deltas[tname] = {}
                for lname, c in t["scaling"].items():
                    U, V, s = (tensors[f"delta/{tname}/{lname}/{k}"] for k in ("U", "V", "s"))
                    cl.deltas[tname][lname] = (U, V, s, float(c))
                    if apply_deltas:
                        wrapped[lname].set_factors(tname, U, V, s, float(c))
                        wrapped[lname].set_active(tname)
                if apply_deltas:
                    cl._merge_and_drop(tname)
                cl.tasks.append(TaskRecord(tname, dict(t["magnitude"]),
                                           {k: (float("nan") if v is None else v)
                                            for k, v in t["spectrum_ratio"].items()},
                                           dict(t["added"]), dict(t["protected"])))
        cl._layers = layer_names
        return cl

    def reset_protection(self) -> None:
        """Forget every layer's protected subspace (F empty)."""
        for _, layer in self.layers():
            layer.set_protected(empty_basis(layer.in_features))
