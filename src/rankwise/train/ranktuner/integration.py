"""RankTuner (and every token-weighted baseline) inside TRL's ``SFTTrainer``.

TRL's ``SFTTrainer(compute_loss_func=f)`` calls ``f(outputs, labels, num_items_in_batch=n)`` with the
model's outputs (``outputs.logits`` ``(B, T, V)``) and the *unshifted* labels ``(B, T)`` (prompt and
padding at -100 when ``completion_only_loss``); :func:`trl_loss_func` shifts them and calls a loss with
cross-entropy's signature, passing ``n`` (the valid tokens of the whole optimizer step) as the divisor
of the mean, as TRL's own losses do under gradient accumulation. ``loss_type="nll"`` and ``"dft"`` are
TRL's built-in rows; :func:`sft_trainer` builds either kind on the same :func:`sft_config`, so every
arm of a comparison trains through the same trainer, data order and schedule.

TRL 1.16 marks ``compute_loss_func`` deprecated (and runs one extra no-grad forward per step for its
logged metrics); it still works, and :func:`sft_trainer` silences that one warning. TRL and
``datasets`` are imported inside the functions.
"""

from __future__ import annotations

import inspect
import tempfile
import warnings
from typing import Any, Callable, Sequence

import torch

__all__ = ["TRL_LOSS_TYPES", "examples_dataset", "sft_config", "sft_trainer", "trl_loss_func"]

TRL_LOSS_TYPES = ("nll", "dft")


def trl_loss_func(loss_fn: Callable[..., torch.Tensor], log: list[dict[str, float]] | None = None
                  ) -> Callable[..., torch.Tensor]:
    """Adapt ``loss_fn(logits, labels)`` (aligned, class dim last) to TRL's ``compute_loss_func``.

    The returned callable takes ``(outputs, labels, num_items_in_batch=None)``; it shifts
    (``logits[:, :-1]``, ``labels[:, 1:]``) and forwards ``num_items_in_batch`` as ``num_items`` when
    ``loss_fn`` accepts it (every :class:`~rankwise.train.ranktuner.TokenWeightedLoss` does). With a
    ``log`` list, each call of a :class:`~rankwise.train.ranktuner.TokenWeightedLoss` appends its weight
    statistics (``mean_weight``, ``max_weight``, ``clamped_frac``, ``loss``).
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (logits, labels) -> loss, got {type(loss_fn).__name__}")
    target = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        takes_items = "num_items" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes_items = False

    def compute_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        if labels is None:
            raise ValueError("compute_loss_func needs the batch's labels; the data collator produced none")
        shifted_logits, shifted_labels = logits[:, :-1], labels[:, 1:]
        kw: dict[str, Any] = {}
        if takes_items and num_items_in_batch is not None:
            kw["num_items"] = num_items_in_batch
        if log is not None and takes_items:  # a TokenWeightedLoss: it can return its statistics
            loss, stats = loss_fn(shifted_logits, shifted_labels, return_stats=True, **kw)
            log.append({"loss": float(loss.detach()), **{k: stats[k] for k in
                                                           ("mean_weight", "max_weight", "clamped_frac")}})
            return loss
        return loss_fn(shifted_logits, shifted_labels, **kw)

    compute_loss_func.loss_fn = loss_fn  # type: ignore[attr-defined]
    return compute_loss_func


def examples_dataset(examples: Sequence[Any]) -> Any:
    """A ``datasets.Dataset`` in TRL's prompt-completion format from objects with ``as_trl()`` or
    ``{"prompt", "completion"}`` dicts."""
    from datasets import Dataset

    rows = [e.as_trl() if hasattr(e, "as_trl") else dict(e) for e in examples]
    if not rows:
        raise ValueError("examples is empty")
    for i, r in enumerate(rows):
        if set(r) != {"prompt", "completion"} or not all(isinstance(v, str) for v in r.values()):
            raise ValueError(f"examples[{i}] must have str 'prompt' and 'completion', got {r!r:.80}")
    return Dataset.from_list(rows)


def sft_config(*, steps: int, batch_size: int = 32, lr: float = 1e-3, seed: int = 0, max_length: int = 128,
               loss_type: str = "nll", warmup_ratio: float = 0.0, scheduler: str = "constant",
               weight_decay: float = 0.0, grad_clip: float = 1.0, output_dir: str | None = None,
               **overrides: Any) -> Any:
    """A ``trl.SFTConfig`` for a CPU comparison: ``steps`` optimizer steps of ``batch_size`` examples,
    AdamW at ``lr``, completion-only loss, no saving, no reporting, no progress bar, seeded."""
    from trl import SFTConfig

    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {TRL_LOSS_TYPES}, got {loss_type!r}")
    kw: dict[str, Any] = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="rankwise-sft-"), max_steps=steps,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=1, learning_rate=lr,
        lr_scheduler_type=scheduler, warmup_steps=int(round(warmup_ratio * steps)), weight_decay=weight_decay,
        max_grad_norm=grad_clip, seed=seed, data_seed=seed, max_length=max_length, loss_type=loss_type,
        completion_only_loss=True, packing=False, report_to="none", save_strategy="no", logging_steps=1,
        logging_strategy="steps", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, bf16=False,
        fp16=False, remove_unused_columns=True, eval_strategy="no")
    kw.update(overrides)
    return SFTConfig(**kw)


def sft_trainer(model: torch.nn.Module, tokenizer: Any, train: Sequence[Any], arm: str | Callable[..., Any],
                **config: Any) -> Any:
    """A ``trl.SFTTrainer`` for one arm: ``arm`` is ``"nll"`` / ``"dft"`` (TRL's own losses) or a loss with
    cross-entropy's signature (e.g. ``RankTunerLoss()``), passed as ``compute_loss_func``.

    ``train``: examples (see :func:`examples_dataset`); ``config``: :func:`sft_config`'s keywords.
    """
    from trl import SFTTrainer

    if isinstance(arm, str):
        if arm not in TRL_LOSS_TYPES:
            raise ValueError(f"arm must be one of {TRL_LOSS_TYPES} or a loss callable, got {arm!r}")
        args, func = sft_config(loss_type=arm, **config), None
    else:
        args, func = sft_config(loss_type="nll", **config), trl_loss_func(arm)
    import datasets
    from transformers import PrinterCallback

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*compute_loss_func.*deprecated", category=FutureWarning)
            trainer = SFTTrainer(model=model, args=args, train_dataset=examples_dataset(train),
                                 processing_class=tokenizer, compute_loss_func=func)
    finally:
        if bars:
            datasets.enable_progress_bars()
    trainer.remove_callback(PrinterCallback)  # disable_tqdm would otherwise print every log line
    return trainer
