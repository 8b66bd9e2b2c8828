"""GRPO through TRL: the plain ``trl.GRPOTrainer`` baseline, Advantage Reweighting as its subclass, and the
parity of this package's loss with ``GRPOTrainer._compute_loss``.

* :func:`trl_grpo_config` maps a :class:`~rankwise.train.lopti.GRPOConfig` (the same field names) to a
  ``trl.GRPOConfig`` for a CPU run: ``prompts_per_step`` prompts x G completions per optimiser step
  (``per_device_train_batch_size = prompts x G``, one generation per step, no accumulation), constant
  learning rate, AdamW without weight decay, clipping ``max_grad_norm``, no saving or reporting.
* :class:`ARGRPOTrainer` (built on demand by :func:`ar_trainer_class`, so TRL is imported only when used):
  after TRL's ``_generate_and_score_completions`` it replaces the ``(B,)`` advantages by the ``(B, T)``
  reweighted ones, ``[alpha * pi_old + 1 - alpha] * A`` (TRL's ``_compute_loss`` accepts ``(B, T)``
  advantages from subclasses), with ``pi_old`` from one no-grad forward of the rollout policy.
* :func:`grpo_trainer` builds either trainer; with ``beta > 0`` TRL builds its reference model from
  ``config._name_or_path``, so the policy is first saved to a local directory (``policy_dir``, default a
  temporary one) and the trainer gets the policy loaded back from there.
* :func:`trl_loss` / :func:`trl_parity_inputs`: TRL's ``_compute_loss`` on given tensors (the parity test).
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rankwise.train.lopti.config import AdvantageReweighting, GRPOConfig

__all__ = ["ar_trainer_class", "grpo_trainer", "trl_grpo_config", "trl_loss", "trl_parity_inputs"]


def trl_grpo_config(config: GRPOConfig, *, prompts_per_step: int, steps: int, lr: float,
                    output_dir: str | None = None, **overrides: Any) -> Any:
    """A ``trl.GRPOConfig`` with ``config``'s GRPO fields and a CPU training set-up (see the module docstring)."""
    from trl import GRPOConfig as TRLGRPOConfig

    kw: dict[str, Any] = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="rankwise-grpo-"), max_steps=steps,
        per_device_train_batch_size=prompts_per_step * config.num_generations, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=config.num_generations, num_iterations=config.num_iterations,
        epsilon=config.epsilon, epsilon_high=config.epsilon_high, beta=config.beta, loss_type=config.loss_type,
        scale_rewards=config.scale_rewards, temperature=config.temperature,
        max_completion_length=config.max_completion_length, max_grad_norm=config.max_grad_norm or 0.0,
        reward_weights=list(config.reward_weights) if config.reward_weights else None, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=config.seed, data_seed=config.seed,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, bf16=False, fp16=False, top_k=0, top_p=1.0, log_completions=False)
    kw.update(overrides)
    return TRLGRPOConfig(**kw)


_AR_CLASS: list[type] = []


def ar_trainer_class() -> type:
    """``ARGRPOTrainer``: a ``trl.GRPOTrainer`` whose advantages are reweighted per token (AR)."""
    if _AR_CLASS:
        return _AR_CLASS[0]
    from trl import GRPOTrainer as TRLGRPOTrainer

    class ARGRPOTrainer(TRLGRPOTrainer):  # type: ignore[misc, valid-type]
        """``trl.GRPOTrainer`` with Advantage Reweighting: ``reweighting=AdvantageReweighting(alpha)``."""

        def __init__(self, *args: Any, reweighting: AdvantageReweighting | None = None, **kwargs: Any) -> None:
            self.reweighting = reweighting if reweighting is not None else AdvantageReweighting()
            if not isinstance(self.reweighting, AdvantageReweighting):
                raise TypeError(f"reweighting must be an AdvantageReweighting, got {type(reweighting).__name__}")
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            old = out.get("old_per_token_logps")
            if old is None:  # TRL skips it when the policy has not moved since the rollout
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
                att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
                with torch.no_grad():
                    old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, att,
                                                                        out["completion_ids"].size(1))
            out["advantages"] = self.reweighting.reweight(out["advantages"], old.detach())
            return out

    _AR_CLASS.append(ARGRPOTrainer)
    return ARGRPOTrainer


@contextlib.contextmanager
def _quiet() -> Any:
    """No progress bars or notices from transformers/datasets while TRL builds models (the reference too)."""
    import datasets
    from transformers.utils import logging as hf_logging

    state = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(), datasets.is_progress_bar_enabled())
    hf_logging.disable_progress_bar(), hf_logging.set_verbosity_error(), datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(state[1])
        if state[0]:
            hf_logging.enable_progress_bar()
        if state[2]:
            datasets.enable_progress_bars()


def _save_and_reload(model: torch.nn.Module, tokenizer: Any, policy_dir: str | Path | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = Path(policy_dir) if policy_dir is not None else Path(tempfile.mkdtemp(prefix="rankwise-grpo-policy-"))
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=next(iter(model.parameters())).dtype)


def grpo_trainer(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]],
                 reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]], config: GRPOConfig, *,
                 prompts_per_step: int, steps: int, lr: float, reweighting: AdvantageReweighting | None = None,
                 policy_dir: str | Path | None = None, **overrides: Any) -> Any:
    """A ``trl.GRPOTrainer`` (or, with ``reweighting``, an ``ARGRPOTrainer``) on ``rows`` (dicts with a
    ``"prompt"`` and the reward functions' columns). With ``config.beta > 0`` the policy is saved to
    ``policy_dir`` and reloaded from it (the trainer's ``.model`` is then that copy, not ``model``)."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer as TRLGRPOTrainer

    if not rows or any("prompt" not in r for r in rows):
        raise ValueError("rows must be a non-empty sequence of dicts with a 'prompt'")
    args = trl_grpo_config(config, prompts_per_step=prompts_per_step, steps=steps, lr=lr, **overrides)
    cls = TRLGRPOTrainer if reweighting is None else ar_trainer_class()
    extra = {} if reweighting is None else {"reweighting": reweighting}
    with _quiet():
        if config.beta > 0:
            model = _save_and_reload(model, tokenizer, policy_dir)
        trainer = cls(model=model, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(list(rows)),
                      processing_class=tokenizer, **extra)
    trainer.remove_callback(PrinterCallback)
    return trainer


def trl_parity_inputs(rollout: Any, advantages: torch.Tensor | None = None,
                      loss_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """The ``inputs`` dict TRL's ``_compute_loss`` reads, from a :class:`~rankwise.train.lopti.Rollout`.

    ``loss_mask`` (``(B, T)``) restricts the loss to some tokens without changing the attention (TRL's
    ``tool_mask``): a one-hot mask makes the ``bnpo`` loss that one token's per-token loss.
    """
    out: dict[str, Any] = {
        "prompt_ids": rollout.prompt_ids, "prompt_mask": rollout.prompt_mask,
        "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
        "advantages": rollout.advantages if advantages is None else advantages,
        "old_per_token_logps": rollout.logp_old,
        "num_items_in_batch": rollout.completion_mask.sum()}
    if rollout.logp_ref is not None:
        out["ref_per_token_logps"] = rollout.logp_ref
    if loss_mask is not None:
        out["tool_mask"] = loss_mask
    return out


def trl_loss(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``trainer._compute_loss(trainer.model, inputs)`` in training mode, one accumulation step."""
    if getattr(trainer, "current_gradient_accumulation_steps", None) is None:
        trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer._compute_loss(trainer.model, inputs)
