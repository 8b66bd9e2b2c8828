"""A GRPO loop on any causal LM with token hooks (Advantage Reweighting, Lopti), as in TRL's GRPOTrainer.

    from rankwise.train.lopti import GRPOConfig, GRPOTrainer, AdvantageReweighting, Lopti
    trainer = GRPOTrainer(model, tokenizer, reward_fn, GRPOConfig(num_generations=8, beta=0.001,
                          max_completion_length=4), optimizer=torch.optim.AdamW(model.parameters(), lr=5e-4),
                          token_hooks=[AdvantageReweighting(alpha=0.3), Lopti(eta=0.5)])
    metrics = trainer.step(prompts, answer=answers)     # one rollout batch, then its update(s)

* ``reward_fn`` has TRL's reward-function signature: ``f(prompts=..., completions=..., completion_ids=...,
  **columns) -> list[float]`` (one value per completion; the keyword columns are the ``step`` keywords,
  each prompt's value repeated for its G completions). A list of them is summed with ``reward_weights``.
* Rollout (:meth:`GRPOTrainer.rollout`): each prompt repeated G times (contiguous groups), left-padded,
  sampled with ``model.generate`` (temperature, ``top_k=0``, ``top_p=1``, TRL's defaults) under a forked RNG
  seeded from ``(seed, step)``; the completion runs up to and including the first EOS (TRL's mask).
  ``logp_old`` (and ``logp_ref`` when ``beta > 0``) are computed once, without gradient, right after.
* Update (:meth:`GRPOTrainer.update`): the advantage hooks (``reweight``) turn the ``(B,)`` group
  advantages into ``(B, T)``; a split hook (``stages``, Lopti) cuts the completion tokens into stages, each
  an optimiser step on the loss restricted to its tokens (normalised by its own token count; a stage
  with no token is skipped: no step, no weight decay, no Adam state update). Every stage uses the
  rollout's ``logp_old``, so a later stage's ratio shows what the earlier stage moved.
* Reference model (``beta > 0``): the one given, else the policy with its PEFT adapter disabled (a LoRA
  policy), else a frozen deep copy (a warning says it doubles the memory).
"""

from __future__ import annotations

import copy
import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from rankwise.train.lopti.config import GRPOConfig
from rankwise.train.lopti.loss import aggregate, group_advantages, k3_kl, per_token_loss, token_logps

__all__ = ["GRPOTrainer", "Rollout", "completion_logps", "sample_completions"]

logger = logging.getLogger(__name__)
RewardFn = Callable[..., Sequence[Any]]


@dataclass
class Rollout:
    """One rollout batch: ``B = prompts x G`` completions, prompts left-padded ``(B, P)``, completions
    right-padded ``(B, T)``; per completion its reward and group advantage ``(B,)``; per token the rollout
    policy's ``logp_old`` and (``beta > 0``) the reference's ``logp_ref`` ``(B, T)``."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    completions: list[str]
    rewards: torch.Tensor
    advantages: torch.Tensor
    logp_old: torch.Tensor
    logp_ref: torch.Tensor | None
    num_generations: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask.sum())


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad with")
    return int(pad)


def sample_completions(model: nn.Module, tokenizer: Any, prompts: Sequence[str], num_generations: int,
                       max_new_tokens: int, temperature: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(prompt_ids, prompt_mask, completion_ids, completion_mask)``: G samples per prompt (contiguous).

    Sampling uses the global RNG (call it under a seeded ``torch.random.fork_rng``). The completion mask
    covers the tokens up to and including the first EOS; the rest is padding.
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty sequence of strings")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("every prompt must be a str")
    pad, eos = _pad_id(tokenizer), tokenizer.eos_token_id
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(num_generations)]
    if any(not x for x in ids):
        raise ValueError("a prompt tokenizes to no token")
    P = max(len(x) for x in ids)
    dev = next(iter(model.parameters())).device
    prompt_ids = torch.full((len(ids), P), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), P), dtype=torch.long)
    for i, x in enumerate(ids):
        prompt_ids[i, P - len(x):] = torch.tensor(x, dtype=torch.long)
        prompt_mask[i, P - len(x):] = 1
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=prompt_ids.to(dev), attention_mask=prompt_mask.to(dev), do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, eos_token_id=eos)
    except RuntimeError as e:  # torch.multinomial refuses NaN/inf probabilities
        if "probability tensor" not in str(e):
            raise
        from rankwise.core.errors import NumericalError

        raise NumericalError("the policy produced non-finite logits while sampling completions; it has diverged "
                             "or its weights are corrupt") from None
    finally:
        model.train(was)
    comp = out[:, P:].cpu()
    is_eos = comp == eos if eos is not None else torch.zeros_like(comp, dtype=torch.bool)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(ids),), comp.shape[1]))
    mask = (torch.arange(comp.shape[1])[None, :] <= first[:, None]).long()
    comp = comp.masked_fill(mask == 0, pad)
    return prompt_ids, prompt_mask, comp, mask


def completion_logps(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """``(B, T)`` log-probabilities of the completion tokens (logits divided by ``temperature``), with the
    model's forward on ``cat(prompt, completion)`` and the joint attention mask (as TRL computes them)."""
    dev = next(iter(model.parameters())).device
    input_ids = torch.cat([prompt_ids, completion_ids], 1).to(dev)
    attention = torch.cat([prompt_mask, completion_mask], 1).to(dev)
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, P - 1:P + T - 1]
    return token_logps(logits, completion_ids.to(dev), completion_mask.to(dev), temperature)


class GRPOTrainer:
    """GRPO with token hooks on any causal LM (see the module docstring).

    ``optimizer`` defaults to AdamW (lr 1e-6, TRL's default rate, no weight decay) over the trainable
    parameters; ``token_hooks``: objects with ``reweight(advantages, logp_old)`` (applied in order) and at
    most one with ``stages(logp_old, mask)``.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, reward_fn: RewardFn | Sequence[RewardFn],
                 config: GRPOConfig | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 ref_model: nn.Module | None = None, token_hooks: Sequence[Any] = ()) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        config = GRPOConfig() if config is None else config
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
        if not fns or not all(callable(f) for f in fns):
            raise TypeError("reward_fn must be a callable or a non-empty list of callables")
        if config.reward_weights is not None and len(config.reward_weights) != len(fns):
            raise ValueError(f"GRPOConfig.reward_weights has {len(config.reward_weights)} weights for "
                             f"{len(fns)} reward functions")
        self.reweighters = [h for h in token_hooks if hasattr(h, "reweight")]
        splitters = [h for h in token_hooks if hasattr(h, "stages")]
        unknown = [h for h in token_hooks if not hasattr(h, "reweight") and not hasattr(h, "stages")]
        if unknown:
            raise TypeError(f"token hook {unknown[0]!r} has neither reweight() nor stages()")
        if len(splitters) > 1:
            raise ValueError("at most one token hook may split the update into stages (one Lopti)")
        self.splitter = splitters[0] if splitters else None
        self.model, self.tokenizer, self.config, self.reward_fns = model, tokenizer, config, fns
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameter (every requires_grad is False)")
        self.optimizer = optimizer if optimizer is not None else torch.optim.AdamW(self.params, lr=1e-6,
                                                                                     weight_decay=0.0)
        self.ref_model = ref_model
        self._ref_is_adapter = False
        if config.beta > 0 and ref_model is None:
            if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
                self._ref_is_adapter = True
            else:
                warnings.warn("GRPOTrainer: beta > 0 and no ref_model; using a frozen copy of the policy "
                              "(doubles the model's memory)", RuntimeWarning, stacklevel=2)
                self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.steps_done = 0
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ rollout

    @contextlib.contextmanager
    def _reference(self) -> Iterator[nn.Module]:
        if self._ref_is_adapter:
            with self.model.disable_adapter():  # type: ignore[operator]
                yield self.model
        else:
            yield self.ref_model  # type: ignore[misc]

    def _rewards(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list[Any]]) -> torch.Tensor:
        G, B = self.config.num_generations, len(completions)
        weights = self.config.reward_weights or (1.0,) * len(self.reward_fns)
        total = torch.zeros(B, dtype=torch.float32)
        for k, fn in enumerate(self.reward_fns):
            vals = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if not isinstance(vals, (list, tuple, torch.Tensor)) or len(vals) != B:
                raise ValueError(f"reward function {k} returned {len(vals) if hasattr(vals, '__len__') else vals!r} "
                                 f"values for {B} completions")
            for i, v in enumerate(vals):
                bad = v is None or not isinstance(v, (int, float, torch.Tensor)) or not torch.isfinite(
                    torch.as_tensor(float(v)))
                if bad:
                    raise ValueError(f"reward function {k} returned {v!r} for completion {i} of prompt {i // G} "
                                     f"({prompts[i]!r:.40}); rewards must be finite numbers")
            total += weights[k] * torch.tensor([float(v) for v in vals], dtype=torch.float32)
        return total

    def rollout(self, prompts: Sequence[str], **columns: Sequence[Any]) -> Rollout:
        """Sample G completions per prompt, score them, and compute advantages, ``logp_old``, ``logp_ref``."""
        cfg, G = self.config, self.config.num_generations
        prompts = list(prompts) if not isinstance(prompts, str) else prompts
        for name, col in columns.items():
            if isinstance(col, str) or len(col) != len(prompts):
                raise ValueError(f"column {name!r} must have one value per prompt ({len(prompts)})")
        seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(
            cfg.seed * 1_000_003 + self.steps_done)))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pids, pmask, cids, cmask = sample_completions(self.model, self.tokenizer, prompts, G,
                                                          cfg.max_completion_length, cfg.temperature)
        rep = [p for p in prompts for _ in range(G)]
        ids_list = [c[m.bool()].tolist() for c, m in zip(cids, cmask)]
        texts = self.tokenizer.batch_decode(ids_list, skip_special_tokens=True)
        rep_cols = {k: [v for v in col for _ in range(G)] for k, col in columns.items()}
        rewards = self._rewards(rep, texts, ids_list, rep_cols)
        adv = group_advantages(rewards, G, cfg.scale_rewards)
        with torch.no_grad():
            logp_old = completion_logps(self.model, pids, pmask, cids, cmask, cfg.temperature)
            logp_ref = None
            if cfg.beta > 0:
                with self._reference() as ref:
                    logp_ref = completion_logps(ref, pids, pmask, cids, cmask, cfg.temperature)
        return Rollout(pids, pmask, cids, cmask, texts, rewards, adv, logp_old.detach(), logp_ref, G)

    # ------------------------------------------------------------------ update

    def token_advantages(self, rollout: Rollout) -> torch.Tensor:
        """The ``(B, T)`` (or ``(B, 1)`` without hooks) advantages after the reweighting hooks."""
        adv = rollout.advantages.unsqueeze(1).to(rollout.logp_old.device)
        for hook in self.reweighters:
            adv = hook.reweight(adv, rollout.logp_old)
        return adv

    def stages(self, rollout: Rollout) -> list[tuple[str, torch.Tensor]]:
        mask = rollout.completion_mask.to(rollout.logp_old.device)
        if self.splitter is None:
            return [("all", mask)]
        return self.splitter.stages(rollout.logp_old, mask)

    def loss(self, rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """The stage loss (with gradient) of ``rollout`` over ``mask`` and its statistics."""
        cfg = self.config
        logp = completion_logps(self.model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                rollout.completion_mask, cfg.temperature)
        per_tok, ratio = per_token_loss(logp, rollout.logp_old, advantages, epsilon_low=cfg.epsilon_low,
                                        epsilon_high=cfg.clip_high, beta=cfg.beta, logp_ref=rollout.logp_ref)
        loss = aggregate(per_tok, mask, cfg.loss_type, cfg.max_completion_length)
        if not torch.isfinite(loss):
            from rankwise.core.errors import NumericalError

            raise NumericalError(f"GRPO loss is {float(loss.detach())} at step {self.steps_done}")
        with torch.no_grad():
            m = mask.bool()
            adv = advantages.expand_as(ratio)
            clipped = ((ratio < 1 - cfg.epsilon_low) & (adv < 0)) | ((ratio > 1 + cfg.clip_high) & (adv > 0))
            stats = {"loss": float(loss.detach()), "clip_ratio": float(clipped[m].float().mean()),
                     "ratio_dev": float((ratio[m] - 1).abs().max()) if m.any() else 0.0}
            if rollout.logp_ref is not None:
                stats["kl"] = float(k3_kl(logp.detach(), rollout.logp_ref)[m].mean())
        return loss, stats

    def update(self, rollout: Rollout) -> dict[str, Any]:
        """The optimiser step(s) of one rollout batch (``num_iterations`` x stages); returns statistics."""
        cfg = self.config
        t0 = time.perf_counter()
        out: dict[str, Any] = {"n_tokens": rollout.n_tokens, "stages": []}
        if rollout.n_tokens == 0:
            warnings.warn(f"GRPO step {self.steps_done}: every completion is empty; the update is skipped",
                          RuntimeWarning, stacklevel=2)
            out["skipped"] = True
            return out
        adv = self.token_advantages(rollout)
        stages = self.stages(rollout)
        if self.splitter is not None:
            low = dict(stages)["low"]
            out["low_share"] = float(low.sum()) / rollout.n_tokens
        was = self.model.training
        self.model.train()
        try:
            for _ in range(cfg.num_iterations):
                for name, mask in stages:
                    if int(mask.sum()) == 0:
                        out["stages"].append({"stage": name, "skipped": True})
                        continue
                    loss, stats = self.loss(rollout, adv, mask)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.max_grad_norm is not None:
                        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    out["stages"].append({"stage": name, "n_tokens": int(mask.sum()), **stats})
        finally:
            self.model.train(was)
        out["update_s"] = time.perf_counter() - t0
        done = [s for s in out["stages"] if not s.get("skipped")]
        for k in ("loss", "clip_ratio", "kl"):
            vals = [s[k] for s in done if k in s]
            if vals:
                out[k] = sum(vals) / len(vals)
        return out

    def step(self, prompts: Sequence[str], **columns: Sequence[Any]) -> dict[str, Any]:
        """One rollout batch on ``prompts`` and its update; returns rewards, KL, clip fraction, Lopti's low share."""
        t0 = time.perf_counter()
        r = self.rollout(prompts, **columns)
        t1 = time.perf_counter()
        metrics = self.update(r)
        G = r.num_generations
        metrics.update({"step": self.steps_done, "reward": float(r.rewards.mean()),
                        "reward_std": float(r.rewards.std()),
                        "frac_reward_zero_std": float((r.rewards.view(-1, G).std(1) == 0).float().mean()),
                        "rollout_s": t1 - t0})
        self.steps_done += 1
        self.history.append(metrics)
        return metrics
