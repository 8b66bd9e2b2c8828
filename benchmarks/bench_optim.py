"""Optimizer step time and state memory on LLM-shaped weights: RACS and Alice vs AdamW, GaLore and
pytorch-optimizer's RACS / Alice ports.

One ``Case`` per weight shape (4096 x 4096: a LLaMA-7B attention projection; 11008 x 4096: its MLP
up/gate projection), every optimizer side by side, anchored on ``torch.optim.AdamW`` (the
single-tensor loop, ``foreach=False``), with AdamW's ``foreach=True`` and ``fused=True`` (the CPU fused
kernel) as rows too, so that a ratio is never flattered by a slow anchor. Each factory
builds the weight with a fixed random gradient and takes one step *before* timing, so the state
initialisation (Alice's first eigenbasis, GaLore's first SVD) is excluded; the timed calls are plain
steps (Alice's subspace switch and GaLore's SVD happen every 200 steps, amortised, not timed here).
Alice and GaLore use rank 256 (the ports' default), Alice ``leading_basis`` 40.

Besides time and the harness' per-implementation peak RSS, each case records the exact optimizer
state bytes (``params["state_bytes"]``, summed over the state tensors after the first step).

Run: ``python -m benchmarks.run optim`` (about 3-5 minutes on 2 cores, most of it GaLore's SVD and the
Alice port's m x m products at initialisation, each paid again in the memory subprocesses).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from benchmarks.harness import Case

RANK = 256


def _build(kind: str, p: nn.Parameter) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW([p], lr=1e-3, foreach=False)
    if kind == "adamw_foreach":
        return torch.optim.AdamW([p], lr=1e-3, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW([p], lr=1e-3, fused=True)
    if kind == "galore":
        from galore_torch import GaLoreAdamW

        return GaLoreAdamW([{"params": [p], "rank": RANK, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}],
                           lr=1e-3, no_deprecation_warning=True)
    if kind == "racs":
        from rankwise.train.racs import RACS

        return RACS([p], lr=1e-2)
    if kind == "alice":
        from rankwise.train.alice import Alice

        return Alice([p], lr=0.02, rank=RANK, leading_basis=40, update_interval=200)
    if kind == "racs_port":
        from pytorch_optimizer import RACS as PortRACS

        return PortRACS([p], lr=1e-2)
    if kind == "alice_port":
        from pytorch_optimizer import Alice as PortAlice

        return PortAlice([p], lr=0.02, rank=RANK, leading_basis=40, update_interval=200)
    raise ValueError(kind)


def _factory(kind: str, shape: tuple[int, int], params: dict[str, Any]) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.train.racs import optimizer_state_bytes

        g = torch.Generator().manual_seed(0)
        p = nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        p.grad = torch.randn(shape, generator=g) * 1e-3
        opt = _build(kind, p)
        opt.step()  # state initialisation outside the timing
        params.setdefault("state_bytes", {})[kind] = optimizer_state_bytes(opt)
        return opt.step
    return factory


def _case(shape: tuple[int, int], repeats: int) -> Case:
    params: dict[str, Any] = {"shape": list(shape), "rank": RANK, "param_bytes": shape[0] * shape[1] * 4}
    kinds = ("adamw", "adamw_foreach", "adamw_fused", "galore", "racs", "racs_port", "alice", "alice_port")
    # the factory already took the first step (state initialisation); one more untimed step warms up
    return Case(f"step_{shape[0]}x{shape[1]}", impls={k: _factory(k, shape, params) for k in kinds}, anchor="adamw",
                params=params, repeats=repeats, warmup=1)


CASES = [_case((4096, 4096), repeats=7), _case((11008, 4096), repeats=5)]
