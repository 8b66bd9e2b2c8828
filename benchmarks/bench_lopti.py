"""Lopti's update vs plain GRPO's: wall time of the update of one rollout batch (rollout excluded).

The timed call is ``GRPOTrainer.update(rollout)`` on a fixed rollout batch (prompts and completions drawn
at random from the vocabulary, rewards random in {0, 1}, ``logp_old`` from the policy): the forward,
backward, clipping and AdamW step(s). Anchor: plain GRPO (one stage). ``rankwise-lopti`` runs two stages
(low- then high-probability tokens: two forwards, two backwards, two optimiser steps), so the spec expects
about 2x; ``rankwise-ar`` adds one elementwise reweighting (expected ~1x). Rollout (generation) cost, the
same for every row, is not included, so the ratio is an upper bound on Lopti's share of a training step.
Models: a tiny Llama the size of the reproduction's policy (2 layers, hidden 128, B = 16 x 8 completions
of 4 tokens) and a larger one (4 layers, hidden 512, B = 8 x 8 completions of 64 tokens).

Run ``python -m benchmarks.run lopti`` (``--smoke`` for a tiny check).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case, Goal

VOCAB = 18


def _setup(hidden: int, layers: int, B: int, P: int, T: int, hooks: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from transformers import LlamaConfig, LlamaForCausalLM

        from rankwise.train.lopti import (AdvantageReweighting, GRPOConfig, GRPOTrainer, Lopti, Rollout,
                                          completion_logps, group_advantages)

        g = torch.Generator().manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=P + T + 8,
                          tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        prompt = torch.randint(4, VOCAB, (B, P), generator=g)
        comp = torch.randint(4, VOCAB, (B, T), generator=g)
        pmask, cmask = torch.ones_like(prompt), torch.ones_like(comp)
        rewards = torch.randint(0, 2, (B,), generator=g).float()
        G = 8
        with torch.no_grad():
            logp_old = completion_logps(model, prompt, pmask, comp, cmask)
        # a trained policy's split: half the tokens below the threshold (the quantile variant at 0.5)
        hook = {"grpo": [], "ar": [AdvantageReweighting(0.3)], "lopti": [Lopti(0.5, quantile=True)]}[hooks]
        tr = GRPOTrainer(model, None, lambda **_: [0.0] * B, GRPOConfig(num_generations=G, max_completion_length=T),
                         optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), token_hooks=hook)
        rollout = Rollout(prompt, pmask, comp, cmask, [""] * B, rewards, group_advantages(rewards, G), logp_old,
                          None, G)

        def run() -> None:
            tr.update(rollout)

        return run

    return factory


def _case(name: str, hidden: int, layers: int, B: int, P: int, T: int, repeats: int = 9) -> Case:
    impls = {f"rankwise-{h}": _setup(hidden, layers, B, P, T, h) for h in ("grpo", "ar", "lopti")}
    return Case(name, impls, anchor="rankwise-grpo",
                params={"hidden": hidden, "layers": layers, "completions": B, "prompt_tokens": P,
                        "completion_tokens": T, "vocab": VOCAB},
                repeats=repeats, warmup=1,
                goals=(Goal("Lopti's update costs <= 2.2x GRPO's (two stages)", impl="rankwise-lopti", max_ratio=2.2),
                       Goal("AR's update costs <= 1.1x GRPO's", impl="rankwise-ar", max_ratio=1.1)))


CASES = [_case("update_h128_L2_B128_T4", 128, 2, 128, 6, 4), _case("update_h512_L4_B64_T64", 512, 4, 64, 16, 64)]
SMOKE_CASES = [_case("update_smoke", 16, 1, 16, 4, 3, repeats=1)]
