"""A small causal-LM supervised fine-tuning loop: prompt masking, a per-token loss hook, determinism.

It trains any causal LM (``model(input_ids=..., attention_mask=...)`` returning ``.logits`` ``(B, T, V)``)
on prompt-completion pairs (objects with ``.prompt``/``.completion`` or ``(prompt, completion)``
tuples), whatever has ``requires_grad``:

    from rankwise.train.sft import SFTConfig, sft, generate, exact_match
    res = sft(model, tokenizer, train, SFTConfig(lr=1e-3, steps=150, batch_size=32))
    outs = generate(model, tokenizer, [e.prompt for e in test], max_new_tokens=30)

* the loss of a step is ``loss_fn(logits[:, :-1], labels[:, 1:])`` with labels at -100 on the prompt
  (``mask_prompt``) and padding; ``loss_fn`` defaults to token-mean cross-entropy and may be any loss
  with cross-entropy's signature (``RankTunerLoss``, a baseline, ...);
* ``weight_fn(logits, labels) -> (B, T-1) weights`` is the simpler hook: the step loss is then
  ``sum(w.detach() * CE) / n_valid`` (the weights carry no gradient);
* determinism as in :mod:`rankwise.train.finetune`: the batch order comes from ``seed`` and every
  step runs under its own forked RNG seeded from ``(seed, step)``, so dropout depends on nothing
  else the process did;
* :func:`generate` decodes greedily (``model.generate``, ``do_sample=False``) in batches, left-padded;
  :func:`exact_match` compares decoded completions with references.

A non-finite loss raises :class:`~rankwise.core.errors.NumericalError` before the update (the model
is left as it was after the previous step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.core.errors import NumericalError
from rankwise.core.lmdata import IGNORE_INDEX, LMBatch, collate, encode_pair
from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive, check_unit
from rankwise.train.finetune import apply_update

__all__ = ["SFTConfig", "SFTResult", "SFTTrainer", "exact_match", "generate", "make_sft_batches", "pairs_of", "sft"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
WeightFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SFTConfig:
    """Hyper-parameters of :func:`sft` (AdamW; warm-up then constant or linear decay; clipping)."""

    lr: float = 1e-3
    steps: int = 100
    batch_size: int = 32
    max_length: int = 256
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "constant"
    warmup_ratio: float = 0.0
    grad_clip: float | None = 1.0
    mask_prompt: bool = True
    add_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("SFTConfig.lr", self.lr)
        check_int("SFTConfig.steps", self.steps, 1)
        check_int("SFTConfig.batch_size", self.batch_size, 1)
        check_int("SFTConfig.max_length", self.max_length, 2)
        check_number("SFTConfig.weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"SFTConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_unit(f"SFTConfig.betas[{i}]", b, high_open=True)
        check_choice("SFTConfig.schedule", self.schedule, ("constant", "linear"))
        check_unit("SFTConfig.warmup_ratio", self.warmup_ratio, high_open=True)
        check_positive("SFTConfig.grad_clip", self.grad_clip, allow_none=True)
        check_bool("SFTConfig.mask_prompt", self.mask_prompt)
        check_bool("SFTConfig.add_eos", self.add_eos)
        check_int("SFTConfig.seed", self.seed, 0)


@dataclass
class SFTResult:
    """``losses[i]``/``step_times[i]``: step i's loss (before the update) and wall time (s)."""

    losses: list[float]
    step_times: list[float]
    steps: int
    wall_time_s: float
    lrs: list[float] = field(default_factory=list)


def pairs_of(examples: Sequence[Any]) -> list[tuple[str, str]]:
    """``(prompt, completion)`` of each example (objects with those attributes, or 2-tuples)."""
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
        raise TypeError(f"examples must be a sequence, got {type(examples).__name__}")
    if not examples:
        raise ValueError("examples is empty")
    out = []
    for i, e in enumerate(examples):
        if hasattr(e, "prompt") and hasattr(e, "completion"):
            out.append((e.prompt, e.completion))
        elif isinstance(e, (tuple, list)) and len(e) == 2:
            out.append((e[0], e[1]))
        else:
            raise TypeError(f"examples[{i}] must have .prompt/.completion or be a (prompt, completion) pair")
    return out


def make_sft_batches(tokenizer: Any, examples: Sequence[Any], config: SFTConfig) -> list[LMBatch]:
    """The ``config.steps`` training batches: epochs of a seeded permutation, cut into ``batch_size``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad with")
    encoded = [encode_pair(tokenizer, p, c, config.add_eos) for p, c in pairs_of(examples)]
    gen = torch.Generator().manual_seed(config.seed)
    batches: list[LMBatch] = []
    while len(batches) < config.steps:
        order = torch.randperm(len(encoded), generator=gen).tolist()
        for s in range(0, len(order), config.batch_size):
            batches.append(collate([encoded[i] for i in order[s:s + config.batch_size]], pad,
                                   config.mask_prompt, config.max_length))
            if len(batches) == config.steps:
                break
    return batches


class SFTTrainer:
    """A causal LM, its AdamW and schedule; :meth:`step` trains on one :class:`~rankwise.core.lmdata.LMBatch`.

    ``loss_fn``: a loss with cross-entropy's signature on the shifted logits/labels (default: token
    mean CE); ``weight_fn``: per-token weights instead (mutually exclusive with ``loss_fn``).
    """

    def __init__(self, model: nn.Module, config: SFTConfig, loss_fn: LossFn | None = None,
                 weight_fn: WeightFn | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(config, SFTConfig):
            raise TypeError(f"config must be an SFTConfig, got {type(config).__name__}")
        if loss_fn is not None and weight_fn is not None:
            raise ValueError("pass loss_fn or weight_fn, not both")
        for name, fn in (("loss_fn", loss_fn), ("weight_fn", weight_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable (logits, labels) -> tensor, got {type(fn).__name__}")
        self.model, self.config, self.loss_fn, self.weight_fn = model, config, loss_fn, weight_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameter (every requires_grad is False)")
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        warm = math.ceil(config.warmup_ratio * config.steps)

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / (warm + 1)
            if config.schedule == "constant":
                return 1.0
            return max(0.0, (config.steps - step) / max(1, config.steps - warm))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.step_seeds = torch.randint(0, 2**62, (config.steps,),
                                        generator=torch.Generator().manual_seed(config.seed)).tolist()
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.lrs: list[float] = []

    def loss(self, batch: LMBatch) -> torch.Tensor:
        """The step loss of ``batch`` (with gradient) under the trainer's loss or weight hook."""
        p = next(iter(self.model.parameters()))
        logits = self.model(input_ids=batch.input_ids.to(p.device),
                            attention_mask=batch.attention_mask.to(p.device)).logits[:, :-1]
        labels = batch.labels[:, 1:].to(p.device)
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels)
        ce = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                         ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
        n = (labels != IGNORE_INDEX).sum().clamp(min=1)
        if self.weight_fn is None:
            return ce.sum() / n
        with torch.no_grad():
            w = self.weight_fn(logits.detach(), labels)
        if not isinstance(w, torch.Tensor) or w.shape != labels.shape:
            raise ValueError(f"weight_fn must return weights shaped like the labels {tuple(labels.shape)}, got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        return (w.detach().to(ce.dtype) * ce).sum() / n

    def step(self, batch: LMBatch) -> float:
        i = len(self.losses)
        if i >= self.config.steps:
            raise RuntimeError(f"SFTTrainer was sized for {self.config.steps} steps; all of them are done")
        self.model.train()
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.step_seeds[i])
            loss = self.loss(batch)
            if not torch.isfinite(loss):
                raise NumericalError(f"SFT loss is {float(loss.detach())} at step {i}; lower the learning rate "
                                     "or check the inputs")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        apply_update(self.params, self.optimizer, self.scheduler, self.config.grad_clip, self.lrs)
        self.losses.append(float(loss.detach()))
        self.step_times.append(time.perf_counter() - t0)
        return self.losses[-1]


def sft(model: nn.Module, tokenizer: Any, train: Sequence[Any], config: SFTConfig | None = None,
        loss_fn: LossFn | None = None, weight_fn: WeightFn | None = None,
        callback: Callable[[int, float], None] | None = None) -> SFTResult:
    """Fine-tune ``model`` on ``train`` for ``config.steps`` steps; the model is left in the mode it was in."""
    config = SFTConfig() if config is None else config
    t0 = time.perf_counter()
    batches = make_sft_batches(tokenizer, train, config)
    trainer = SFTTrainer(model, config, loss_fn, weight_fn)
    was = model.training
    try:
        for i, b in enumerate(batches):
            loss = trainer.step(b)
            if callback is not None:
                callback(i, loss)
    finally:
        model.train(was)
    return SFTResult(trainer.losses, trainer.step_times, len(batches), time.perf_counter() - t0, trainer.lrs)


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 32,
             batch_size: int = 64) -> list[str]:
    """Greedy completions of ``prompts`` (decoded, special tokens skipped), in eval mode, left-padded batches."""
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("batch_size", batch_size, 1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was = model.training
    model.eval()
    dev = next(iter(model.parameters())).device
    out: list[str] = []
    try:
        for s in range(0, len(prompts), batch_size):
            ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[s:s + batch_size]]
            T = max(len(x) for x in ids)
            inp = torch.full((len(ids), T), pad, dtype=torch.long)
            att = torch.zeros((len(ids), T), dtype=torch.long)
            for i, x in enumerate(ids):
                inp[i, T - len(x):] = torch.tensor(x, dtype=torch.long)
                att[i, T - len(x):] = 1
            gen = model.generate(input_ids=inp.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
            out += tokenizer.batch_decode(gen[:, T:], skip_special_tokens=True)
    finally:
        model.train(was)
    return out


def exact_match(predictions: Sequence[str | None], references: Sequence[str]) -> list[float]:
    """1.0 / 0.0 per pair: whether the prediction equals the reference (whitespace-normalised)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    norm = lambda s: None if s is None else " ".join(s.split())  # noqa: E731
    return [1.0 if norm(p) == norm(r) else 0.0 for p, r in zip(predictions, references)]
