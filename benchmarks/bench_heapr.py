"""HEAPr: parameters and forward time of a pruned MoE against the unpruned (fused) transformers model.

* ``heapr_forward_moe``: a seeded random Qwen2-MoE with the shape of the reproduction's model (hidden 128,
  4 layers, 8 routed experts top-2 of FFN 64, shared expert 128, vocab 2048; ``zoo.tiny_moe``), a forward
  pass of 8 x 128 tokens under ``no_grad``. Implementations: ``fused`` (transformers 5's fused experts,
  the anchor), ``unfused`` (``unfuse_experts``, the same function: its cost is the per-expert modules),
  ``HEAPr p=0.25`` (global ranking from one calibration batch; widths unequal) and ``drop 2/8``
  (frequency expert dropping, the same parameter count). The parameter counts are in the case's
  ``params`` (``parameters``). No goal: the spec claims fewer parameters and FLOPs, not a wall-clock speed-up at this size.
* ``SMOKE_CASES``: the default ``tiny_moe`` (hidden 64, 2 layers), 2 x 32 tokens.

Run ``python -m benchmarks.run heapr`` (JSON in ``benchmarks/results/heapr.json``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from benchmarks.harness import Case

P = 0.25


def _models(shape: dict[str, Any], tokens: tuple[int, int]) -> tuple[dict[str, torch.nn.Module], torch.Tensor]:
    from rankwise import zoo
    from rankwise.compress import heapr

    fused = zoo.tiny_moe(seed=0, **shape)
    vocab = fused.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, vocab, tokens, generator=gen)]
    x = torch.randint(0, vocab, tokens, generator=gen)
    unfused = copy.deepcopy(fused)
    heapr.unfuse_experts(unfused)
    stats = heapr.calibrate(unfused, calib)
    pruned = copy.deepcopy(unfused)
    cfg = heapr.HEAPrConfig(prune_ratio=P)
    heapr.heapr_prune(pruned, heapr.atom_scores(pruned, stats, cfg), cfg)
    dropped = copy.deepcopy(unfused)
    heapr.drop_experts(dropped, heapr.expert_frequency(stats), int(P * unfused.config.num_experts))
    return {"fused": fused, "unfused": unfused, f"HEAPr p={P:g}": pruned, "drop 2/8": dropped}, x


def _case(name: str, shape: dict[str, Any], tokens: tuple[int, int], repeats: int) -> Case:
    cache: dict[str, Any] = {}

    def models() -> tuple[dict[str, torch.nn.Module], torch.Tensor]:
        if not cache:
            cache["m"] = _models(shape, tokens)
        return cache["m"]

    counts: dict[str, int] = {}  # filled when the models are built: the JSON holds the params dict itself

    def factory(key: str) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            ms, x = models()
            counts.update({k: sum(p.numel() for p in mm.parameters()) for k, mm in ms.items()})
            m = ms[key]

            def call() -> Any:
                with torch.no_grad():
                    return m(input_ids=x).logits
            return call
        return make

    keys = ("fused", "unfused", f"HEAPr p={P:g}", "drop 2/8")
    params: dict[str, Any] = {"model": "zoo.tiny_moe " + ", ".join(f"{k}={v}" for k, v in shape.items()),
                              "tokens": list(tokens), "prune_ratio": P, "parameters": counts}
    return Case(name, {k: factory(k) for k in keys}, anchor="fused", params=params, repeats=repeats, warmup=2)


MOE = dict(hidden_size=128, num_hidden_layers=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
           intermediate_size=344, vocab_size=2048)
CASES = [_case("heapr_forward_moe", MOE, (8, 128), repeats=10)]
SMOKE_CASES = [_case("heapr_forward_moe_smoke", {}, (2, 32), repeats=1)]
