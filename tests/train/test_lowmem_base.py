"""The train family base (rankwise.train.lowmem_base) and the old module paths of RACS and Alice."""

from __future__ import annotations

import pytest
import torch

import rankwise.train.alice as old_alice
import rankwise.train.racs as old_racs
from rankwise.train import lowmem_base
from rankwise.train.lowmem_base import adamw_step, check_betas, racs_stats_step_
from rankwise.train.racs_alice import RACS, Alice, AliceConfig, RACSConfig
from rankwise.train.riemannian_lora import AdamS, AdamSConfig


def test_old_paths_reexport_the_same_objects():
    assert old_racs.RACS is RACS and old_racs.RACSConfig is RACSConfig
    assert old_racs.LowMemOptimizer is lowmem_base.LowMemOptimizer
    assert old_racs.split_params_for_lowmem is lowmem_base.split_params_for_lowmem
    assert old_racs.norm_growth_limit is lowmem_base.norm_growth_limit
    assert old_alice.Alice is Alice and old_alice.AliceConfig is AliceConfig
    for name in old_racs.__all__:
        assert hasattr(old_racs, name)
    for name in old_alice.__all__:
        assert hasattr(old_alice, name)


def test_adamw_step_matches_torch_adamw():
    g = torch.Generator().manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    p = torch.nn.Parameter(p_ref.detach().clone())
    ref = torch.optim.AdamW([p_ref], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)
    state: dict = {}
    group = {"lr": 1e-2, "adamw_betas": (0.8, 0.95), "adamw_eps": 1e-6}
    for _ in range(4):
        grad = torch.randn(5, 3, generator=g)
        p_ref.grad = grad.clone()
        ref.step()
        state["step"] = state.get("step", 0) + 1
        with torch.no_grad():
            adamw_step(p, grad, state, group)
    assert torch.allclose(p, p_ref, atol=1e-7, rtol=0)


def test_racs_stats_step_is_the_warm_fixed_point_step():
    g2 = torch.rand(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s, q = torch.zeros(4, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    racs_stats_step_(s, q, g2, 0.5)
    s_ref = 0.5 * (g2 @ torch.ones(6, dtype=torch.float64)) / 6
    q_ref = 0.5 + 0.5 * (g2.T @ s_ref) / (s_ref @ s_ref)
    assert torch.allclose(s, s_ref) and torch.allclose(q, q_ref)


def test_from_config_and_betas_checks():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    assert isinstance(RACS.from_config([w], RACSConfig(lr=0.1)), RACS)
    with pytest.raises(TypeError, match="instance of RACSConfig, got AliceConfig"):
        RACS.from_config([w], AliceConfig())
    with pytest.raises(TypeError, match="instance of AdamSConfig"):
        AdamS.from_config([], RACSConfig())
    assert AdamS.config_class is AdamSConfig
    assert check_betas("b", [0.5, 0], 2) == (0.5, 0.0)
    with pytest.raises(ValueError, match=r"^b must be a tuple of 3 numbers in \[0, 1\), got \(0.5, 0.5\)$"):
        check_betas("b", (0.5, 0.5), 3)
    with pytest.raises(ValueError, match=r"^b\[1\] must be a number in \[0, 1\), got 1.0$"):
        check_betas("b", (0.5, 1.0), 2)


def test_wrong_types_stay_type_errors_for_optimizer_callers():
    with pytest.raises(TypeError, match="rank"):
        AliceConfig(rank=2.5)
    with pytest.raises(TypeError, match="param group 0: use_adamw"):
        RACS([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "use_adamw": 1}])
