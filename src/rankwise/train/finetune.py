"""A small, general fine-tuning loop for sequence classification, shared by the adapters' reproductions.

It trains any ``nn.Module`` that maps tokenizer outputs to HF-style outputs (an object or dict with
``logits`` of shape ``(batch, num_labels)``, or the logits tensor itself) on ``(text, label)`` pairs:
a full model, a LoRA/PEFT-adapted one, or any other adapter. Whatever ``requires_grad`` is trained.

    from rankwise.train.finetune import FinetuneConfig, finetune
    res = finetune(model, tokenizer, train, test, FinetuneConfig(lr=1e-3, epochs=1, batch_size=16))
    res.losses, res.accuracy, res.step_times

Pieces, usable on their own (e.g. to train two implementations in lock step on the same batches):

* :func:`make_batches`: the deterministic batch sequence (order from ``seed``; tokenized once;
  padded to the longest text of each batch, truncated at ``max_length``);
* :class:`Trainer`: one model + optimizer + schedule; :meth:`Trainer.step` does forward, cross-entropy,
  backward, clipping, the optimizer and scheduler steps, and records the loss and the step time;
* :func:`lockstep`: several trainers on the same batches, alternating which goes first each step, so
  that their step times are measured under the same machine conditions;
* :func:`evaluate`: accuracy, mean loss and logits on a labelled set, in eval mode, without gradients.

Determinism: the data order comes from ``seed``; every training step runs under
``torch.manual_seed(step_seed)`` on a forked RNG (``step_seed`` derived from ``seed`` and the step
index), so dropout masks depend only on (seed, step), not on what else the process did, and two
models with the same module structure draw the same masks. The caller's global RNG is untouched.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive, check_unit

__all__ = [
    "Batch",
    "EvalResult",
    "ExtraLoss",
    "FinetuneConfig",
    "FinetuneResult",
    "OptimizerFactory",
    "Trainer",
    "evaluate",
    "finetune",
    "lockstep",
    "make_batches",
    "num_steps",
    "trainable_parameters",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
#: ``extra_loss(model, batch, outputs, step) -> scalar tensor``: a term added to the cross-entropy of step
#: ``step`` (0-based), after the forward pass that produced ``outputs`` (a method's auxiliary loss)
ExtraLoss = Callable[[nn.Module, "Batch", Any, int], torch.Tensor]
SCHEDULES = ("constant", "linear")
LENGTH_WINDOW = 16  # batches per length-sorted window with group_by_length


@dataclass(frozen=True)
class FinetuneConfig:
    """Hyper-parameters of :func:`finetune`.

    Attributes:
        lr: peak learning rate of the default optimizer (AdamW) and of the schedule.
        epochs: passes over the training set (fractions allowed); used when ``steps`` is None.
        steps: number of optimizer steps (overrides ``epochs``); the data order wraps into new epochs.
        batch_size: training examples per step (the last batch of an epoch may be smaller).
        max_length: tokenizer truncation, in tokens; batches are padded to their longest text.
        weight_decay: decoupled weight decay of the default AdamW.
        betas, eps: AdamW's.
        schedule: ``"linear"`` (warm-up then linear decay to 0, the BERT/LoRA recipe) or ``"constant"``
            (warm-up then constant).
        warmup_ratio: fraction of the steps spent warming up linearly from 0, in [0, 1).
        grad_clip: clip the global gradient norm of the trained parameters to this (None: no clipping).
        eval_batch_size: batch size of :func:`evaluate`.
        group_by_length: form batches of texts of similar token length (less padding, so less
            compute for the same data; as ``transformers``' ``group_by_length``): each epoch's shuffled
            order is cut into windows of ``LENGTH_WINDOW`` batches, each window sorted by length and
            cut into batches, and the batches of the epoch shuffled.
        seed: data order and per-step dropout seeds.
    """

    lr: float = 1e-3
    epochs: float = 1.0
    steps: int | None = None
    batch_size: int = 16
    max_length: int = 64
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "linear"
    warmup_ratio: float = 0.06
    grad_clip: float | None = 1.0
    eval_batch_size: int = 64
    group_by_length: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("FinetuneConfig.lr", self.lr)
        check_positive("FinetuneConfig.epochs", self.epochs)
        check_int("FinetuneConfig.steps", self.steps, 1, allow_none=True)
        check_int("FinetuneConfig.batch_size", self.batch_size, 1)
        check_int("FinetuneConfig.max_length", self.max_length, 2)
        check_number("FinetuneConfig.weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"FinetuneConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(check_unit(f"FinetuneConfig.betas[{i}]", b, high_open=True)
                                                for i, b in enumerate(self.betas)))
        check_positive("FinetuneConfig.eps", self.eps)
        check_choice("FinetuneConfig.schedule", self.schedule, SCHEDULES)
        check_unit("FinetuneConfig.warmup_ratio", self.warmup_ratio, high_open=True)
        check_positive("FinetuneConfig.grad_clip", self.grad_clip, allow_none=True)
        check_int("FinetuneConfig.eval_batch_size", self.eval_batch_size, 1)
        check_bool("FinetuneConfig.group_by_length", self.group_by_length)
        check_int("FinetuneConfig.seed", self.seed, 0)


@dataclass
class Batch:
    """One tokenized batch: ``inputs`` (tokenizer outputs, each ``(batch, seq)``) and ``labels`` ``(batch,)``."""

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device) -> "Batch":
        if self.labels.device == device:
            return self
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.labels.to(device))


@dataclass
class EvalResult:
    """What :func:`evaluate` measures: accuracy, mean cross-entropy, and the logits ``(n, num_labels)``."""

    accuracy: float
    loss: float
    logits: torch.Tensor


@dataclass
class FinetuneResult:
    """What :func:`finetune` reports.

    ``losses[i]`` is the training loss of step i (the batch mean, before the update) and
    ``step_times[i]`` its wall time in seconds (forward + backward + optimizer step); ``accuracy``,
    ``test_loss`` and ``logits`` are on the test set (None without one).
    """

    losses: list[float]
    step_times: list[float]
    accuracy: float | None
    test_loss: float | None
    logits: torch.Tensor | None
    steps: int
    trainable_parameters: int
    total_parameters: int
    wall_time_s: float
    lrs: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# data


def _check_examples(data: Sequence[tuple[str, int]], what: str) -> tuple[list[str], list[int]]:
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise TypeError(f"{what} must be a sequence of (text, label) pairs, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{what} is empty")
    texts, labels = [], []
    for i, item in enumerate(data):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{what}[{i}] must be a (text, label) pair, got {item!r:.80}")
        text, label = item
        if not isinstance(text, str):
            raise TypeError(f"{what}[{i}]: text must be a str, got {type(text).__name__}")
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"{what}[{i}]: label must be an int >= 0, got {label!r}")
        texts.append(text)
        labels.append(label)
    return texts, labels


def _tokenize(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {k: v for k, v in dict(enc).items() if isinstance(v, torch.Tensor)}


def num_steps(n_examples: int, config: FinetuneConfig) -> int:
    """Optimizer steps that ``config`` asks for on ``n_examples`` training examples."""
    if config.steps is not None:
        return config.steps
    return max(1, math.ceil(config.epochs * math.ceil(n_examples / config.batch_size)))


def _token_lengths(tokenizer: Any, texts: list[str], max_length: int) -> list[int]:
    enc = _tokenize(tokenizer, texts, max_length)
    if "attention_mask" in enc:
        return enc["attention_mask"].sum(1).tolist()
    return [len(t.split()) for t in texts]  # a tokenizer without a mask: words as a proxy


def _epoch_batches(order: list[int], config: FinetuneConfig, lengths: list[int] | None,
                   gen: torch.Generator) -> list[list[int]]:
    bs = config.batch_size
    if lengths is None:
        return [order[i:i + bs] for i in range(0, len(order), bs)]
    window = bs * LENGTH_WINDOW
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: -lengths[i])  # stable: ties keep the shuffle
        batches += [chunk[i:i + bs] for i in range(0, len(chunk), bs)]
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def make_batches(tokenizer: Any, data: Sequence[tuple[str, int]], config: FinetuneConfig,
                 steps: int | None = None) -> list[Batch]:
    """The training batches of ``config`` (``steps`` of them; default :func:`num_steps`), deterministic.

    Each epoch visits every example once, in an order drawn from ``torch.Generator(seed)`` (grouped
    by length with ``config.group_by_length``); an epoch may end with a smaller batch. Tokenized once
    here, so lock-stepped trainers share the tensors.
    """
    texts, labels = _check_examples(data, "train")
    steps = num_steps(len(texts), config) if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    lengths = _token_lengths(tokenizer, texts, config.max_length) if config.group_by_length else None
    gen = torch.Generator().manual_seed(config.seed)
    out: list[Batch] = []
    while len(out) < steps:
        order = torch.randperm(len(texts), generator=gen).tolist()
        for idx in _epoch_batches(order, config, lengths, gen):
            out.append(Batch(_tokenize(tokenizer, [texts[i] for i in idx], config.max_length),
                             torch.tensor([labels[i] for i in idx], dtype=torch.long)))
            if len(out) == steps:
                break
    return out


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        logits = out
    elif isinstance(out, Mapping) and "logits" in out:
        logits = out["logits"]
    elif hasattr(out, "logits"):
        logits = out.logits
    else:
        raise TypeError(f"the model must return logits (a tensor, or an object/dict with .logits); "
                        f"got {type(out).__name__}")
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ValueError(f"logits must have shape (batch, num_labels), got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    return logits


def _check_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if int(labels.max()) >= logits.shape[-1]:
        raise ValueError(f"label {int(labels.max())} is out of range for a model with {logits.shape[-1]} "
                         f"outputs (labels must be in [0, {logits.shape[-1] - 1}])")


def _device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# training


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters with ``requires_grad`` (each once, in model order)."""
    return [p for p in model.parameters() if p.requires_grad]



def apply_update(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any,
                 grad_clip: float | None, lrs: list[float]) -> None:
    """One update after ``backward``: clip the gradient norm (when ``grad_clip`` is set), record the
    learning rate used into ``lrs``, step the optimizer and the schedule, clear the gradients."""
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    lrs.append(float(optimizer.param_groups[0]["lr"]))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

class Trainer:
    """A model, its optimizer and learning-rate schedule; :meth:`step` trains on one :class:`Batch`.

    ``optimizer``: an optimizer already built over the model's trainable parameters, or a factory
    ``f(params) -> Optimizer`` called with them, or None (``torch.optim.AdamW`` with ``config``'s lr,
    betas, eps and weight decay; its fused implementation when the parameters allow it). ``total_steps`` sizes the schedule (warm-up ``ceil(warmup_ratio * total_steps)``
    steps, then constant or linear decay to 0 at ``total_steps``).

    ``extra_loss`` (default None: plain cross-entropy): ``f(model, batch, outputs, step) -> scalar`` added
    to the cross-entropy of every step, called right after the forward pass (so it can read what the
    forward recorded, e.g. routing weights); the logged loss is the sum, and ``extra_losses[i]`` the
    term of step i.
    """

    def __init__(self, model: nn.Module, config: FinetuneConfig, total_steps: int,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
                 extra_loss: ExtraLoss | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(config, FinetuneConfig):
            raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if extra_loss is not None and not callable(extra_loss):
            raise TypeError(f"extra_loss must be callable (model, batch, outputs, step) -> loss, "
                            f"got {type(extra_loss).__name__}")
        self.model = model
        self.extra_loss = extra_loss
        self.config = config
        self.total_steps = total_steps
        self.params = trainable_parameters(model)
        if not self.params:
            raise ValueError("the model has no trainable parameter (every requires_grad is False); "
                             "unfreeze what should be trained")
        if optimizer is None:
            # the fused kernel (one pass over all tensors) when every parameter allows it: the same
            # algorithm as the per-tensor loop, several times faster when many parameters are trained
            fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in self.params)
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                self.params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                fused=fused or None)
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer = optimizer
        elif callable(optimizer):
            self.optimizer = optimizer(self.params)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, "
                                "not a torch.optim.Optimizer")
        else:
            raise TypeError(f"optimizer must be an Optimizer, a factory f(params) -> Optimizer, or None; "
                            f"got {type(optimizer).__name__}")
        warm = math.ceil(config.warmup_ratio * total_steps)
        decay = config.schedule == "linear"

        def factor(step: int) -> float:  # multiplier of the optimizer's lr before update number step+1
            if step < warm:
                return (step + 1) / (warm + 1)
            if not decay:
                return 1.0
            return max(0.0, (total_steps - step) / max(1, total_steps - warm))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.device = _device(model)
        self.step_seeds = torch.randint(0, 2**62, (total_steps,),
                                        generator=torch.Generator().manual_seed(config.seed)).tolist()
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.lrs: list[float] = []
        self.extra_losses: list[float] = []

    @property
    def steps_done(self) -> int:
        return len(self.losses)

    def step(self, batch: Batch) -> float:
        """One update on ``batch``; returns the batch's mean cross-entropy (before the update), plus
        ``extra_loss`` when the trainer has one.

        Raises :class:`~rankwise.core.errors.NumericalError` on a non-finite loss (the parameters are
        not updated) and ``RuntimeError`` past ``total_steps``.
        """
        i = self.steps_done
        if i >= self.total_steps:
            raise RuntimeError(f"Trainer was sized for {self.total_steps} steps; all of them are done")
        batch = batch.to(self.device)
        self.model.train()
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.step_seeds[i])
            outputs = self.model(**batch.inputs)
            logits = _logits(outputs)
            if i == 0:
                _check_labels(logits, batch.labels)
            loss = nn.functional.cross_entropy(logits.float(), batch.labels)
            extra = None
            if self.extra_loss is not None:
                extra = self.extra_loss(self.model, batch, outputs, i)
                if not isinstance(extra, torch.Tensor) or extra.ndim != 0:
                    shape = f" of shape {tuple(extra.shape)}" if isinstance(extra, torch.Tensor) else ""
                    raise TypeError(f"extra_loss must return a scalar tensor, got {type(extra).__name__}{shape}")
                loss = loss + extra.to(loss.dtype)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                lr = float(self.optimizer.param_groups[0]["lr"])
                raise NumericalError(f"training loss is {float(loss.detach())} at step {i} (lr {lr:g}); "
                                     "lower the learning rate or check the inputs")
            loss.backward()
        apply_update(self.params, self.optimizer, self.scheduler, self.config.grad_clip, self.lrs)
        dt = time.perf_counter() - t0
        value = float(loss.detach())
        if extra is not None:
            self.extra_losses.append(float(extra.detach()))
        self.losses.append(value)
        self.step_times.append(dt)
        return value


def lockstep(trainers: Mapping[str, Trainer], batches: Iterable[Batch],
             callback: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, list[float]]:
    """Train several trainers on the same batches, one step each per batch, alternating who goes first.

    Step i runs the trainers in the given order when i is even and in reverse order when i is odd,
    so that neither always runs right after the other. Returns the loss curves by name;
    ``callback(i, {name: loss})`` is called after each step.
    """
    names = list(trainers)
    if not names:
        raise ValueError("lockstep needs at least one trainer")
    for i, batch in enumerate(batches):
        losses = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            losses[name] = trainers[name].step(batch)
        if callback is not None:
            callback(i, losses)
    return {n: list(t.losses) for n, t in trainers.items()}


# --------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(model: nn.Module, tokenizer: Any, data: Sequence[tuple[str, int]], *, max_length: int = 64,
             batch_size: int = 64) -> EvalResult:
    """Accuracy, mean cross-entropy and logits ``(n, num_labels)`` (float32, CPU) of ``model`` on ``data``.

    Runs in eval mode (dropout off) and restores the model's previous mode.
    """
    texts, labels = _check_examples(data, "test")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    device = _device(model)
    was_training = model.training
    model.eval()
    chunks = []
    try:
        for start in range(0, len(texts), batch_size):
            inputs = _tokenize(tokenizer, texts[start:start + batch_size], max_length)
            chunks.append(_logits(model(**{k: v.to(device) for k, v in inputs.items()})).float().cpu())
    finally:
        model.train(was_training)
    logits = torch.cat(chunks)
    y = torch.tensor(labels, dtype=torch.long)
    _check_labels(logits, y)
    if not torch.isfinite(logits).all():
        raise NumericalError("evaluate(): the model produced non-finite logits")
    loss = float(nn.functional.cross_entropy(logits.double(), y))
    acc = float((logits.argmax(-1) == y).double().mean())
    return EvalResult(accuracy=acc, loss=loss, logits=logits)


def finetune(model: nn.Module, tokenizer: Any, train: Sequence[tuple[str, int]],
             test: Sequence[tuple[str, int]] | None = None, config: FinetuneConfig | None = None,
             optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
             callback: Callable[[int, float], None] | None = None,
             extra_loss: ExtraLoss | None = None) -> FinetuneResult:
    """Fine-tune ``model`` (its trainable parameters) on ``train``; evaluate on ``test``.

    ``model(**tokenizer(texts))`` must return logits ``(batch, num_labels)`` (see the module
    docstring); labels are ints in ``[0, num_labels)``. ``optimizer`` as in :class:`Trainer`.
    ``callback(step, loss)`` runs after each step; ``extra_loss`` as in :class:`Trainer`. The model is
    left in the mode it was in.
    """
    config = FinetuneConfig() if config is None else config
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}")
    if test is not None:
        _check_examples(test, "test")
    t0 = time.perf_counter()
    batches = make_batches(tokenizer, train, config)
    was_training = model.training
    trainer = Trainer(model, config, len(batches), optimizer, extra_loss=extra_loss)
    try:
        for i, batch in enumerate(batches):
            loss = trainer.step(batch)
            if callback is not None:
                callback(i, loss)
    finally:
        model.train(was_training)
    ev = None if test is None else evaluate(model, tokenizer, test, max_length=config.max_length,
                                            batch_size=config.eval_batch_size)
    return FinetuneResult(
        losses=list(trainer.losses), step_times=list(trainer.step_times),
        accuracy=None if ev is None else ev.accuracy, test_loss=None if ev is None else ev.loss,
        logits=None if ev is None else ev.logits, steps=len(batches),
        trainable_parameters=sum(p.numel() for p in trainer.params),
        total_parameters=sum(p.numel() for p in model.parameters()),
        wall_time_s=time.perf_counter() - t0, lrs=list(trainer.lrs))
