"""RACS, Alice and WinQ under torch.distributed DDP (gloo, 2 processes on one machine).

Each rank trains on its half of a global batch; DDP all-reduces (averages) the gradients, so the
optimizers see exactly the full-batch gradient and the parameters after N steps must equal
single-process training on the whole batch, up to float summation order.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

STEPS = 4
WORLD = 2
SCENARIOS = ("racs", "alice", "winq")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _train(scenario: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """STEPS optimizer steps of ``scenario`` on ``model`` (plain or DDP-wrapped) with ``batch``."""
    from rankwise.train.qat import QATConfig, WinQCallback, prepare_qat
    from rankwise.train.racs_alice import RACS, Alice

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    mats = [p for p in inner.parameters() if p.ndim == 2]
    vecs = [p for p in inner.parameters() if p.ndim == 1]
    groups = [{"params": mats}, {"params": vecs, "use_adamw": True, "lr": 1e-2}]
    if scenario == "racs":
        opt = RACS(groups, lr=0.1)
    elif scenario == "alice":
        opt = Alice(groups, lr=0.02, rank=3, leading_basis=2, update_interval=2)
    else:
        opt = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    cb = WinQCallback(STEPS, reset_every=2, sigma_w=1e-2, sigma_c=1e-3, symmetric=True, seed=5) if scenario == "winq" else None
    for step in range(1, STEPS + 1):
        if cb is None:
            _loss(model, batch).backward()
        else:
            cb.training_step(model, batch, _loss)
        opt.step()
        opt.zero_grad()
        if cb is not None:
            cb.on_step_end(model, step)
    return [p.detach().clone() for p in inner.parameters()]


def _prepared(scenario: str) -> nn.Module:
    from rankwise.train.qat import QATConfig, prepare_qat

    model = _model()
    return prepare_qat(model, QATConfig(w_bits=2)) if scenario == "winq" else model


def _worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Rendezvous through a file and gloo pairs on the loopback device: no port is picked ahead of time, so a
    # concurrent test (pytest-xdist runs the Flower deployment test beside this one) cannot take it first.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'rendezvous'}", rank=rank,
                            world_size=WORLD)
    try:
        x, y = _data()
        half = x.shape[0] // WORLD
        local = (x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
        results = {}
        for scenario in SCENARIOS:
            ddp = nn.parallel.DistributedDataParallel(_prepared(scenario))
            results[scenario] = _train(scenario, ddp, local)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[torch.Tensor]]]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(out),), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_matches_single_process_full_batch(ddp_results, scenario):
    single = _train(scenario, _prepared(scenario), _data())
    for rank in range(WORLD):
        got = ddp_results[rank][scenario]
        assert len(got) == len(single)
        for a, b in zip(got, single):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (scenario, rank, float((a - b).abs().max()))
    # the ranks stay bit-identical to each other (same all-reduced gradients, deterministic optimizers)
    assert all(torch.equal(a, b) for a, b in zip(ddp_results[0][scenario], ddp_results[1][scenario]))
    # and training moved the parameters
    assert not all(torch.equal(a, b) for a, b in zip(single, [p.detach() for p in _prepared(scenario).parameters()]))
