"""ULD-Net's encrypted inference: CPU time per encrypted image, ULD-Net vs the post-hoc polynomial baseline.

* ``uldnet_encrypted_latency``: the reproduction's one-hidden-block MLP 64 -> 64 -> 10 (seeded random
  weights, PolyNorm's V-bar set to 1: timing needs no training) as ULD-Net (PolyNorm + PolyAct degree 2,
  counted depth 7) and as the post-hoc baseline (degree-8 Chebyshev 1/sqrt + degree-7 ReLU fit, depth 11),
  each exported with ``export_ckks`` (128-bit security, 40-bit outer / 30-bit inner primes: both land on
  N = 16384, 9 vs 13 primes). Timed: encrypt one image, evaluate, decrypt (keys are made before timing,
  one context per implementation). Anchor: the post-hoc baseline; goal (spec claim 3): ULD-Net <= 0.6x.
* ``SMOKE_CASES``: width 8, one activation layer each (PolyAct degree 2 vs a degree-3 ReLU fit), N = 8192.

Needs TenSEAL (``rankwise[he]``); without it the module has no case. Run ``python -m benchmarks.run uldnet``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case, Goal

_HAS_HE = importlib.util.find_spec("tenseal") is not None


def _uld(width: int, out: int, full: bool) -> nn.Sequential:
    from rankwise.science import uldnet

    torch.manual_seed(0)
    m = uldnet.convert(uldnet.mlp((width, width, out)), uldnet.ULDConfig(act_dropout=0.0))
    for n in uldnet.polynorms(m):
        n.num_batches_tracked += 1
    if not full:
        m[1] = nn.Identity()
    return m.eval()


def _posthoc(width: int, out: int, full: bool) -> nn.Sequential:
    from rankwise.science import uldnet

    torch.manual_seed(0)
    m = uldnet.mlp((width, width, out))
    if full:
        return uldnet.posthoc(m, torch.rand(256, width)).eval()
    m[1] = nn.Identity()
    return uldnet.posthoc(m, torch.rand(8, width), relu_degree=3).eval()


def _factory(build: Callable[[int, int, bool], nn.Module], width: int, out: int, full: bool) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science import uldnet

        he = uldnet.export_ckks(build(width, out, full))
        he.context  # keys before timing
        x = torch.rand(width)
        return lambda: he.infer_encrypted(x)
    return factory


def _case(name: str, width: int, out: int, full: bool, repeats: int) -> Case:
    impls = {"post-hoc": _factory(_posthoc, width, out, full), "ULD-Net": _factory(_uld, width, out, full)}
    goals = (Goal("ULD-Net's encrypted latency per image <= 0.6x the post-hoc baseline's (spec claim 3)",
                  impl="ULD-Net", max_ratio=0.6),) if full else ()
    return Case(name, impls, anchor="post-hoc", params={"model": f"MLP {width}-{width}-{out}", "security": 128,
                                                        "primes": "40 outer / 30 inner"},
                repeats=repeats, warmup=1, goals=goals)


CASES = [_case("uldnet_encrypted_latency", 64, 10, True, 5)] if _HAS_HE else []
SMOKE_CASES = [_case("uldnet_encrypted_latency_smoke", 8, 4, False, 1)] if _HAS_HE else []
