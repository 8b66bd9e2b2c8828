"""RankTuner's loss vs plain cross-entropy: step time and peak memory at LLM vocabulary sizes.

The timed call is one loss step on a logits tensor that stands in for an LM head's output: the loss of
``(positions, V)`` float32 logits (requires grad) against random labels, then ``backward()`` to the
logits. Anchor: ``torch.nn.functional.cross_entropy`` (token mean), what plain SFT computes.
``rankwise-ranktuner`` adds the rank pass (one float32 sort per position for E[R], one comparison pass
for R, in chunks of 2^24 elements, under ``no_grad``) and the weighted reduction. Two vocabularies:
32k (Llama-2 / Mistral) and 152k (Qwen2); 256 target positions (8 sequences of 32 completion tokens).
The model's own forward/backward is not included, so the ratio is an upper bound on RankTuner's
share of a real training step.

Run ``python -m benchmarks.run ranktuner`` (``--smoke`` for a tiny check).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case

POSITIONS = 256


def _step(impl: str, V: int, n: int = POSITIONS) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.train.ranktuner import RankTunerLoss

        g = torch.Generator().manual_seed(0)
        logits = torch.randn(n, V, generator=g).requires_grad_(True)
        labels = torch.randint(0, V, (n,), generator=g)
        loss_fn = RankTunerLoss() if impl == "rankwise-ranktuner" else None

        def run() -> None:
            logits.grad = None
            loss = (torch.nn.functional.cross_entropy(logits, labels) if loss_fn is None
                    else loss_fn(logits, labels))
            loss.backward()

        return run

    return factory


def _case(V: int, n: int = POSITIONS, repeats: int = 7) -> Case:
    impls = {k: _step(k, V, n) for k in ("torch-cross-entropy", "rankwise-ranktuner")}
    return Case(f"loss_step_V{V // 1000}k" if V >= 1000 else f"loss_step_V{V}", impls, anchor="torch-cross-entropy",
                params={"vocab": V, "positions": n, "dtype": "float32", "chunk_elements": 1 << 24},
                repeats=repeats, warmup=1)


CASES = [_case(32_000), _case(152_064)]
SMOKE_CASES = [_case(1000, n=32, repeats=1)]
