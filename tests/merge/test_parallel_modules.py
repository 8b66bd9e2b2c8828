"""Merges run their independent modules on a few threads (map_modules): same result, errors, thread count."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rankwise.core.lora import AdapterState
from rankwise.merge import CtMConfig, MergeConfig, ctm_merge, mtc_merge
from rankwise.merge.common import map_modules

MODS = tuple(f"layers.{i}.q" for i in range(5))


def lora(seed: int, m: int = 96, n: int = 80, r: int = 16) -> AdapterState:
    g = torch.Generator().manual_seed(seed)
    f = {k: {"lora_A": torch.randn(r, n, generator=g), "lora_B": torch.randn(m, r, generator=g)} for k in MODS}
    return AdapterState({"rank": r, "alpha": float(r)}, f, {k: 1.0 for k in MODS})


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _merged(fn, ads, cfg, n_threads: int) -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(n_threads)
    out = fn(ads, cfg)
    assert torch.get_num_threads() == n_threads  # restored after the worker threads
    return out.factors


@pytest.mark.parametrize("fn, cfg", [(ctm_merge, CtMConfig(rank=8, rule="ta")),
                                     (ctm_merge, CtMConfig(rank=8, rule="ties", density=0.5)),
                                     (mtc_merge, MergeConfig(rank=8, rule="ta", space="core"))])
def test_result_does_not_depend_on_the_thread_count(threads, fn, cfg):
    # R = 4 x 16 = 64: CtM's warm-started HOOI and its factored products are on
    ads = [lora(i) for i in range(4)]
    one, two, three = (_merged(fn, ads, cfg, n) for n in (1, 2, 3))
    for mod in MODS:
        for k in ("lora_A", "lora_B"):
            # every module runs on one intra-op thread in each case: the same bits
            assert torch.equal(one[mod][k], two[mod][k]) and torch.equal(one[mod][k], three[mod][k]), (mod, k)


def test_parallel_ctm_equals_its_module_by_module_definition(threads):
    from rankwise.merge.ctm import ctm_merge_layer

    ads = [lora(i) for i in range(4)]
    cfg = CtMConfig(rank=8, rule="ta")
    torch.set_num_threads(2)
    out = ctm_merge(ads, cfg)
    torch.set_num_threads(1)
    for mod in MODS:
        res = ctm_merge_layer([a.factors[mod]["lora_B"] * a.scaling[mod] for a in ads],
                              [a.factors[mod]["lora_A"] for a in ads], cfg, name=mod)
        expect = res.B @ res.A
        got = out.delta_weight(mod, torch.float64)
        assert float((got - expect).norm() / expect.norm()) < 1e-6, mod  # float32 output factors


def test_full_space_merges_stay_one_module_at_a_time(threads, monkeypatch):
    # each module of a full-space merge holds dense m x n matrices: running several at once would
    # multiply the peak memory by the thread count
    import rankwise.merge.mtc as mtc

    seen = []
    real = mtc.map_modules
    monkeypatch.setattr(mtc, "map_modules", lambda fn, items, workers=None: seen.append(workers) or real(fn, items, workers))
    torch.set_num_threads(2)
    ads = [lora(i) for i in range(3)]
    for space in ("full", "knots", "core"):
        mtc_merge(ads, MergeConfig(rank=4, rule="ties", space=space))
    assert seen == [1, 1, None]


def test_map_modules_keeps_order_and_uses_one_intra_op_thread(threads):
    torch.set_num_threads(2)
    seen = []

    def fn(x: int) -> tuple[int, int, str]:
        time.sleep(0.01 * (5 - x))  # later items finish first
        seen.append(x)
        return x, torch.get_num_threads(), threading.current_thread().name

    out = map_modules(fn, range(5))
    assert [o[0] for o in out] == list(range(5))
    assert all(o[1] == 1 for o in out)
    assert all(o[2].startswith("rankwise-merge") for o in out)
    assert len({o[2] for o in out}) == 2
    assert torch.get_num_threads() == 2


def test_map_modules_runs_here_with_one_worker(threads):
    torch.set_num_threads(2)
    main = threading.current_thread().name
    out = map_modules(lambda x: (threading.current_thread().name, torch.get_num_threads()), [0, 1], workers=1)
    assert out == [(main, 2), (main, 2)]
    assert map_modules(lambda x: x, []) == []


def test_map_modules_raises_the_first_failure_in_order(threads):
    torch.set_num_threads(2)

    def fn(x: int) -> int:
        if x == 1:
            time.sleep(0.05)
            raise ValueError("module 1")
        if x == 2:
            raise KeyError("module 2")  # fails first in time, later in order
        return x

    with pytest.raises(ValueError, match="module 1"):
        map_modules(fn, range(6))
    assert torch.get_num_threads() == 2


def test_an_error_in_a_worker_reaches_the_caller_with_its_module(threads, monkeypatch):
    import rankwise.merge.ctm as ctm
    from rankwise.core.errors import NumericalError

    real = ctm.ctm_merge_layer

    def layer(Bs, As, config, *, seeds=None, name="layer"):
        if name == "layers.3.q":
            raise NumericalError(f"CtM produced non-finite factors at {name}")
        return real(Bs, As, config, seeds=seeds, name=name)

    monkeypatch.setattr(ctm, "ctm_merge_layer", layer)
    torch.set_num_threads(2)
    ads = [lora(i) for i in range(4)]
    before = {m: ads[0].factors[m]["lora_B"].clone() for m in MODS}
    with pytest.raises(NumericalError, match="layers.3.q"):
        ctm_merge(ads, CtMConfig(rank=8))
    assert torch.get_num_threads() == 2
    assert all(torch.equal(before[m], ads[0].factors[m]["lora_B"]) for m in MODS)  # inputs untouched
