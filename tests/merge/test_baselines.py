"""Merge-then-compress baselines: rules, spaces, truncation, and agreement with PEFT's add_weighted_adapter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.core.lora import AdapterState
from rankwise.merge import MergeConfig, merged_deltas, mtc_merge, truncate
from rankwise.merge.baselines import merge_tensors

MODS = ("q", "v")


def lora(seed: int, m: int = 24, n: int = 20, r: int = 4, scaling: float = 0.5) -> AdapterState:
    g = torch.Generator().manual_seed(seed)
    f = {k: {"lora_A": torch.randn(r, n, generator=g), "lora_B": torch.randn(m, r, generator=g)} for k in MODS}
    return AdapterState({"rank": r, "alpha": scaling * r}, f, {k: scaling for k in MODS})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_ties_rule_by_hand():
    x = torch.tensor([[3.0, -1.0, 0.5, 2.0], [-2.0, -4.0, 1.0, -0.1], [1.0, 2.0, -0.2, 0.0]], dtype=torch.float64)
    out = merge_tensors(x, "ties", density=0.5)
    # trimmed: t0 keeps 3, 2; t1 keeps -2, -4; t2 keeps 1, 2
    # sums: [2, -2, 0, 2] -> signs [+, -, (overall sum 2 > 0 -> +), +]
    assert torch.allclose(out, torch.tensor([2.0, -4.0, 0.0, 2.0], dtype=torch.float64))


def test_dare_rules():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(merge_tensors(x, "dare", drop_rate=0.0, seeds=[1, 2, 3]), x.sum(0))
    d = merge_tensors(x, "dare", drop_rate=0.5, seeds=[1, 2, 3])
    assert not torch.allclose(d, x.sum(0))
    assert torch.equal(d, merge_tensors(x, "dare", drop_rate=0.5, seeds=[1, 2, 3]))
    with pytest.raises(ValueError, match="seed"):
        merge_tensors(x, "dare", drop_rate=0.5)


def test_truncate_is_eckart_young_and_iso():
    d = torch.randn(30, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    B, A = truncate(d, 5)
    U, S, Vh = torch.linalg.svd(d, full_matrices=False)
    assert torch.allclose(B @ A, (U[:, :5] * S[:5]) @ Vh[:5], atol=1e-10)
    assert torch.allclose(B.norm(dim=0), A.norm(dim=1), atol=1e-10)  # balanced split
    Bi, Ai = truncate(d, 5, isotropic=True)
    s = torch.linalg.svdvals(Bi @ Ai)[:5]
    assert torch.allclose(s, S[:5].mean().expand(5), atol=1e-10)
    Bp, Ap = truncate(d[:3], 5)  # only 3 directions exist: zero-padded to rank 5
    assert Bp.shape == (3, 5) and Ap.shape == (5, 20) and torch.allclose(Bp @ Ap, d[:3], atol=1e-10)


@pytest.mark.parametrize("rule", ["ta", "ties", "mean", "iso_c"])
def test_spaces_agree_for_linear_rules_and_rank(rule):
    ads = [lora(i) for i in range(3)]
    outs = {sp: mtc_merge(ads, MergeConfig(rank=4, rule=rule, space=sp, scale=1.0)) for sp in ("full", "knots", "core")}
    for sp, o in outs.items():
        assert o.ranks() == {"q": 4, "v": 4}
        s = torch.linalg.svdvals(o.delta_weight("q", torch.float64))
        assert float(s[4:].max()) < 1e-8 * float(s[0])
    if rule in ("ta", "mean", "iso_c"):  # linear rules: every space gives the truncated sum (mean)
        for sp in ("knots", "core"):
            assert rel(outs[sp].delta_weight("q"), outs["full"].delta_weight("q")) < 1e-5
    else:  # TIES acts on different coordinates in each space
        assert rel(outs["core"].delta_weight("q"), outs["full"].delta_weight("q")) > 1e-3


def test_untruncated_reference_and_scale():
    ads = [lora(i) for i in range(3)]
    full = merged_deltas(ads, MergeConfig(rule="ta", scale=0.5), rank=None)
    assert torch.allclose(full["v"], 0.5 * sum(a.delta_weight("v", torch.float64) for a in ads), atol=1e-10)
    trunc = merged_deltas(ads, MergeConfig(rank=4, rule="ta", scale=0.5))
    assert int(torch.linalg.matrix_rank(trunc["v"])) == 4


def test_dare_order_independent():
    ads = [lora(i) for i in range(3)]
    cfg = MergeConfig(rank=4, rule="dare_ties", drop_rate=0.3)
    a, b = mtc_merge(ads, cfg), mtc_merge(ads[::-1], cfg)
    assert rel(a.delta_weight("q"), b.delta_weight("q")) < 1e-5


@pytest.mark.parametrize("kwargs, field", [({"rank": 0}, "rank"), ({"space": "weird"}, "space"),
                                           ({"density": 0}, "density"), ({"drop_rate": -0.1}, "drop_rate"),
                                           ({"rule": "x"}, "rule")])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MergeConfig(**kwargs)


def test_rank_above_layer_size():
    with pytest.raises(ValueError, match="min\\(out, in\\)"):
        mtc_merge([lora(0, m=6, n=5)], MergeConfig(rank=6))


# ------------------------------------------------------------------------------------------------- PEFT peer

class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(20, 24)
        self.v = nn.Linear(20, 24)

    def forward(self, x):
        return self.q(x) + self.v(x)


def _peft_model(n_adapters: int = 3):
    import peft

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=2, target_modules=list(MODS), init_lora_weights=False)
    model = peft.get_peft_model(_Tiny(), cfg, adapter_name="a0")
    for i in range(1, n_adapters):
        model.add_adapter(f"a{i}", cfg)
    states = []
    for i in range(n_adapters):
        f, s = {}, {}
        for m in MODS:
            layer = getattr(model.base_model.model, m)
            f[m] = {"lora_A": layer.lora_A[f"a{i}"].weight.detach().clone(),
                    "lora_B": layer.lora_B[f"a{i}"].weight.detach().clone()}
            s[m] = layer.scaling[f"a{i}"]
        states.append(AdapterState({"rank": 4, "alpha": 2.0}, f, s))
    return model, states


@pytest.mark.parametrize("ctype, rule", [("svd", "ta"), ("ties_svd", "ties")])
def test_full_space_matches_peft_add_weighted_adapter(ctype, rule):
    model, states = _peft_model()
    lam = 0.7
    model.add_weighted_adapter(["a0", "a1", "a2"], [lam] * 3, "merged", combination_type=ctype, svd_rank=4,
                               density=0.25)
    ours = mtc_merge(states, MergeConfig(rank=4, rule=rule, space="full", density=0.25, scale=lam))
    for m in MODS:
        layer = getattr(model.base_model.model, m)
        theirs = layer.get_delta_weight("merged")
        assert rel(ours.delta_weight(m), theirs) < 1e-4
