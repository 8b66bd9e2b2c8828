"""A small, shared causal-LM pretraining loop for comparing optimizers and QAT schemes on CPU.

Everything a pretraining comparison needs besides the model and the text, which the caller passes
in (the reproductions take them from :mod:`rankwise.zoo`; a user passes their own):

* :func:`byte_stream` -- byte-level tokenisation (ids = UTF-8 bytes, 0..255; documents separated by
  a 0 byte, which never occurs in text);
* :func:`random_batch` / :func:`eval_windows` -- training windows at random offsets drawn from a
  ``torch.Generator`` (the same seed gives every optimizer the same batches) and fixed consecutive
  evaluation windows;
* :func:`lr_factor` -- linear warm-up then cosine decay;
* :func:`make_optimizer` -- the optimizers under comparison by name, all on the same parameter
  split (:func:`~rankwise.train.lowmem_base.split_params_for_lowmem`: 2-D block weights vs embeddings /
  LM head / norms, which always get AdamW): ``adamw`` (``torch.optim.AdamW``), ``adafactor``
  (``torch.optim.Adafactor``), ``galore`` (``galore_torch.GaLoreAdamW``), ``racs``, ``alice``
  (rankwise), ``racs_port``, ``alice_port`` (pytorch-optimizer's ports);
* :func:`pretrain` -- the loop: seeded batches, scheduled learning rate, periodic validation loss
  (float64 accumulation), optimizer-state bytes and time per step; a non-finite training loss stops
  the run and marks it diverged (never silently).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.train.lowmem_base import optimizer_state_bytes, split_params_for_lowmem

__all__ = [
    "OPTIMIZERS",
    "MultiOptimizer",
    "PretrainResult",
    "byte_stream",
    "eval_loss",
    "eval_windows",
    "lr_factor",
    "make_optimizer",
    "matrix_state_bytes",
    "pretrain",
    "random_batch",
    "steps_to_reach",
]

OPTIMIZERS: tuple[str, ...] = ("adamw", "adafactor", "galore", "racs", "alice", "racs_port", "alice_port")
DOC_SEPARATOR = 0


# --------------------------------------------------------------------------------------------------
# data


def byte_stream(texts: Iterable[str]) -> torch.Tensor:
    """UTF-8 bytes of ``texts`` concatenated, each document followed by a 0 byte; 1-D int64."""
    parts: list[bytes] = []
    for t in texts:
        if not isinstance(t, str):
            raise TypeError(f"byte_stream needs str documents, got {type(t).__name__}")
        parts.append(t.encode("utf-8") + bytes([DOC_SEPARATOR]))
    if not parts:
        raise ValueError("byte_stream: no documents")
    data = b"".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def random_batch(stream: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len`` tokens at uniform random offsets: (batch_size, seq_len)."""
    n = stream.numel() - seq_len
    if n < 1:
        raise ValueError(f"the stream has {stream.numel()} tokens, not more than seq_len={seq_len}")
    starts = torch.randint(0, n + 1, (batch_size, 1), generator=generator)
    return stream[starts + torch.arange(seq_len)]


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``stream``: (n, seq_len), at most ``max_windows``."""
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(f"the stream has {stream.numel()} tokens, fewer than seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * seq_len].view(n, seq_len)


def lr_factor(step: int, total: int, warmup: int, final: float = 0.0) -> float:
    """Multiplier of the peak learning rate at 0-based ``step``: linear warm-up over ``warmup`` steps
    to 1, then cosine decay to ``final`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def eval_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over every predicted token of ``windows`` (float64 sum).

    ``model(input_ids=...)`` must return an object with ``.logits`` (a Hugging Face causal LM).
    Raises :class:`NumericalError` on a non-finite loss. The model's train/eval mode is restored.
    """
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch).logits[:, :-1]
            nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                              batch[:, 1:].reshape(-1), reduction="sum")
            if not torch.isfinite(nll):
                raise NumericalError("eval_loss: the model produced a non-finite loss")
            total += float(nll)
            count += batch[:, 1:].numel()
    finally:
        model.train(was)
    return total / count


# --------------------------------------------------------------------------------------------------
# optimizers


class MultiOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one (e.g. a port's optimizer on the matrices + AdamW on the rest).

    ``param_groups`` is the concatenation of the parts' groups (the same dicts, so setting a group's
    ``lr`` reaches the part), ``state`` the union of their states.
    """

    def __init__(self, parts: Sequence[torch.optim.Optimizer]):  # noqa: D107 - no super().__init__ on purpose
        if not parts:
            raise ValueError("MultiOptimizer needs at least one optimizer")
        self.parts = list(parts)
        self.defaults = {}
        self._optimizer_step_pre_hooks = {}  # type: ignore[assignment]
        self._optimizer_step_post_hooks = {}  # type: ignore[assignment]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for p in self.parts for g in p.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        out: dict[Any, Any] = {}
        for p in self.parts:
            out.update(p.state)
        return out

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self.parts:
            p.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parts:
            p.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"parts": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for p, sd in zip(self.parts, state_dict["parts"], strict=True):
            p.load_state_dict(sd)


def make_optimizer(name: str, model: nn.Module, lr: float, other_lr: float | None = None,
                   **hp: Any) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) for ``model``.

    ``adamw`` and ``adafactor`` optimise every parameter with ``lr``. The others put the 2-D block
    weights (:func:`split_params_for_lowmem`) on their low-memory rule with ``lr`` and everything else
    on AdamW with ``other_lr`` (default ``lr``). ``hp``: ``rank``, ``update_interval``
    (``galore``, ``alice``, ``alice_port``), ``leading_basis`` (Alice), ``scale`` (GaLore's alpha,
    default 0.25); remaining keys go to the optimizer's constructor.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is unknown; choose one of {list(OPTIMIZERS)}")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr={lr!r} must be a positive number")
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, **hp)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=0.0, **hp)
    groups = split_params_for_lowmem(model)
    olr = lr if other_lr is None else other_lr
    hp = dict(hp)
    if name == "galore":
        from galore_torch import GaLoreAdamW

        gal = {"params": groups["matrix"], "rank": hp.pop("rank", 128), "update_proj_gap": hp.pop("update_interval", 200),
               "scale": hp.pop("scale", 0.25), "proj_type": hp.pop("proj_type", "std")}
        spec = [gal] + ([{"params": groups["other"], "lr": olr}] if groups["other"] else [])
        return GaLoreAdamW(spec, lr=lr, weight_decay=0.0, no_deprecation_warning=True, **hp)
    if name in ("racs", "alice"):
        from rankwise.train.racs_alice import RACS, Alice

        spec = [{"params": groups["matrix"]}]
        if groups["other"]:
            spec.append({"params": groups["other"], "use_adamw": True, "lr": olr})
        return RACS(spec, lr=lr, **hp) if name == "racs" else Alice(spec, lr=lr, **hp)
    # the pytorch-optimizer ports on the matrices, torch AdamW on the rest
    import pytorch_optimizer

    cls = pytorch_optimizer.RACS if name == "racs_port" else pytorch_optimizer.Alice
    parts: list[torch.optim.Optimizer] = [cls(groups["matrix"], lr=lr, **hp)]
    if groups["other"]:
        parts.append(torch.optim.AdamW(groups["other"], lr=olr, betas=(0.9, 0.999), weight_decay=0.0))
    return MultiOptimizer(parts)


def matrix_state_bytes(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> int:
    """Bytes of the optimizer state held for ``params`` only (e.g. the low-memory matrices)."""
    ids = {id(p) for p in params}
    sub = type("Sub", (), {})()
    sub.state = {p: s for p, s in optimizer.state.items() if id(p) in ids}
    return optimizer_state_bytes(sub)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# the loop


@dataclass
class PretrainResult:
    """What :func:`pretrain` measured."""

    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    state_bytes: int = 0
    seconds_per_step: float = float("nan")
    diverged: bool = False
    diverged_at: int | None = None

    @property
    def final_loss(self) -> float:
        """The last validation loss (``inf`` for a diverged run)."""
        if self.diverged or not self.eval_losses:
            return float("inf")
        return self.eval_losses[-1]


def pretrain(model: nn.Module, optimizer: torch.optim.Optimizer, train_stream: torch.Tensor,
             eval_data: torch.Tensor, steps: int, *, seq_len: int = 128, batch_size: int = 16, seed: int = 0,
             warmup: int | None = None, eval_every: int = 50, final_lr: float = 0.0, grad_clip: float | None = None,
             step_hook: Callable[[int], None] | None = None,
             loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> PretrainResult:
    """Train ``model`` for ``steps`` optimizer steps; validation loss at step 0, every ``eval_every``
    steps and at the end.

    Batches come from ``torch.Generator().manual_seed(seed)``. Each group's learning rate is its
    initial value times :func:`lr_factor` (``warmup`` defaults to 5 % of ``steps``). ``loss_fn(model,
    batch)`` defaults to the causal-LM loss ``model(input_ids=b, labels=b).loss``; it must call
    nothing but the forward (the loop does the backward). ``step_hook(step)`` runs after each
    optimizer step (1-based). A non-finite training loss stops the run with ``diverged=True``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive int")
    if eval_every < 1:
        raise ValueError(f"eval_every={eval_every} must be >= 1")
    warmup = max(1, round(0.05 * steps)) if warmup is None else warmup
    base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
    gen = torch.Generator().manual_seed(seed)
    loss_fn = loss_fn or (lambda m, b: m(input_ids=b, labels=b).loss)
    res = PretrainResult()
    res.eval_steps.append(0)
    res.eval_losses.append(eval_loss(model, eval_data))
    model.train()
    t_train = 0.0
    for step in range(steps):
        batch = random_batch(train_stream, seq_len, batch_size, gen)
        f = lr_factor(step, steps, warmup, final_lr)
        for g, base in zip(optimizer.param_groups, base_lrs):
            g["lr"] = base * f
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        if not torch.isfinite(loss):
            res.diverged, res.diverged_at = True, step
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        t_train += time.perf_counter() - t0
        res.train_losses.append(float(loss.detach()))
        if step_hook is not None:
            step_hook(step + 1)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            try:
                res.eval_losses.append(eval_loss(model, eval_data))
            except NumericalError:
                res.diverged, res.diverged_at = True, step + 1
                break
            res.eval_steps.append(step + 1)
    for g, base in zip(optimizer.param_groups, base_lrs):
        g["lr"] = base
    res.state_bytes = optimizer_state_bytes(optimizer)
    done = len(res.train_losses)
    res.seconds_per_step = t_train / done if done else float("nan")
    return res


def steps_to_reach(eval_steps: Sequence[int], eval_losses: Sequence[float], target: float) -> float:
    """First step at which the validation curve reaches ``target`` (linear interpolation between
    evaluation points); ``inf`` when it never does."""
    if len(eval_steps) != len(eval_losses):
        raise RankwiseError("eval_steps and eval_losses differ in length")
    prev_s, prev_l = None, None
    for s, l in zip(eval_steps, eval_losses):
        if l <= target:
            if prev_s is None or prev_l is None or prev_l == l:
                return float(s)
            return prev_s + (prev_l - target) / (prev_l - l) * (s - prev_s)
        prev_s, prev_l = s, l
    return float("inf")
