"""LoRA-S (AdamS, LRACS): the spec's correctness checks and bad inputs."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.lora import add_lora
from rankwise.train.riemannian_lora import (
    LRACS,
    AdamS,
    AdamSConfig,
    LoraPair,
    LRACSConfig,
    horizontal_lift,
    lora_factor_pairs,
    offset_init_,
    solve_gram_sylvester,
    tangent_projection,
)

D64 = torch.float64


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D64)


def _mnd(m: int = 9, n: int = 7, r: int = 3, seed: int = 0):
    return _rand(m, r, seed=seed), _rand(n, r, seed=seed + 1), _rand(m, n, seed=seed + 2)


def _cond_r(r: int, cond: float, seed: int = 5) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(_rand(r, r, seed=seed))
    return u @ torch.diag(torch.logspace(0, torch.log10(torch.tensor(cond)).item(), r, dtype=D64)) @ vh


# ------------------------------------------------------------------------------------------------ math


def test_sylvester_residual_and_scipy():
    scipy_linalg = pytest.importorskip("scipy.linalg")
    m, n, d = _mnd()
    gm, gn, c = m.T @ m, n.T @ n, m.T @ d @ n
    k = solve_gram_sylvester(gm, gn, c)
    p = gm @ gn
    assert torch.linalg.norm(p @ k + k @ p - c) / torch.linalg.norm(c) < 1e-10
    ref = torch.from_numpy(scipy_linalg.solve_sylvester(p.numpy(), p.numpy(), c.numpy()))
    assert torch.allclose(k, ref, rtol=1e-9, atol=1e-12)


def test_tangency_and_not_scaledgd():
    m, n, d = _mnd()
    dm, dn, _ = horizontal_lift(m, n, d)
    moved = dm @ n.T + m @ dn.T
    pt = tangent_projection(m, n, d)
    assert torch.linalg.norm(moved - pt) / torch.linalg.norm(pt) < 1e-10
    pu = m @ torch.linalg.solve(m.T @ m, m.T)
    pv = n @ torch.linalg.solve(n.T @ n, n.T)
    assert torch.linalg.norm(moved - (pu @ d + d @ pv)) / torch.linalg.norm(pt) > 1e-3


def test_structure_and_rank_one_closed_form():
    m, n, d = _mnd()
    dm, dn, k = horizontal_lift(m, n, d)
    gm, gn = m.T @ m, n.T @ n
    assert torch.allclose(m.T @ dm, k @ gm, rtol=1e-9, atol=1e-10)
    assert torch.allclose(dn.T @ n, gn @ k, rtol=1e-9, atol=1e-10)
    # the update is horizontal: orthogonal (inverse-Gram metric) to every vertical (M W, -N W^T)
    w = _rand(3, 3, seed=9)
    g = torch.trace(torch.linalg.solve(gm, (m @ w).T @ dm)) - torch.trace(torch.linalg.solve(gn, (n @ w.T).T @ dn))
    assert abs(float(g)) < 1e-9 * float(torch.linalg.norm(dm) * torch.linalg.norm(m @ w) + 1)
    m1, n1, d1 = _rand(6, 1, seed=3), _rand(4, 1, seed=4), _rand(6, 4, seed=5)
    _, _, k1 = horizontal_lift(m1, n1, d1)
    expected = (m1.T @ d1 @ n1) / (2 * (m1.T @ m1) * (n1.T @ n1))
    assert torch.allclose(k1, expected, rtol=1e-12)


def test_equivariance_under_gl_r():
    m, n, d = _mnd(r=4)
    r = _cond_r(4, 10.0)
    dm, dn, _ = horizontal_lift(m, n, d)
    dm2, dn2, _ = horizontal_lift(m @ r, n @ torch.linalg.inv(r).T, d)
    assert torch.allclose(dm2, dm @ r, rtol=1e-9, atol=1e-10)
    assert torch.allclose(dn2, dn @ torch.linalg.inv(r).T, rtol=1e-9, atol=1e-10)


def test_lift_of_horizontal_image_returns_it():
    m, n, d = _mnd()
    hm, hn, _ = horizontal_lift(m, n, d)
    image = hm @ n.T + m @ hn.T
    dm, dn, _ = horizontal_lift(m, n, image)
    assert torch.allclose(dm, hm, rtol=1e-8, atol=1e-10)
    assert torch.allclose(dn, hn, rtol=1e-8, atol=1e-10)


def test_rank_deficient_gram_raises_and_ridge_works():
    m, n, d = _mnd()
    with pytest.raises(NumericalError, match="offset_init_"):
        horizontal_lift(torch.zeros_like(m), n, d)
    dm, dn, k = horizontal_lift(torch.zeros_like(m), n, d, ridge=1e-3)
    assert torch.isfinite(dm).all() and torch.isfinite(dn).all() and torch.isfinite(k).all()


# ------------------------------------------------------------------------------------------------ models


def _toy(seed: int = 0, dtype=D64, r: int = 3, out: int = 8, inp: int = 6):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(inp, out, bias=False).to(dtype))
    add_lora(model, ["0"], rank=r, alpha=2.0 * r, generator=torch.Generator().manual_seed(seed))
    offset_init_(model, seed=seed, std=0.3)
    return model


def _x_of(model) -> torch.Tensor:
    layer = model[0]
    return layer.delta_weight("default").double()


def _toy_loss(model, target: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (model(x) - x @ target.T).pow(2).sum()


def test_grad_x_capture_matches_factor_grads():
    model = _toy()
    opt = AdamS(model, lr=1e-3)
    x = _rand(5, 3, 6, seed=7)
    model(x).square().sum().backward()
    layer = model[0]
    gx = opt.capture.grads[0]
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    assert torch.allclose(s * b.T @ gx, a.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(s * gx @ a.T, b.grad, rtol=1e-10, atol=1e-12)
    opt.zero_grad()
    assert not opt.capture.grads


def test_offset_init_keeps_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8).double())
    x = _rand(4, 6, seed=1)
    y0 = model(x).detach()
    add_lora(model, ["0"], rank=3, alpha=6.0)
    offset_init_(model, seed=3)
    assert torch.allclose(model(x), y0, atol=1e-12)
    assert float(torch.linalg.matrix_rank(model[0].lora_B["default"].weight)) == 3


def _reparametrise(model, cond: float = 10.0, seed: int = 5):
    layer = model[0]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    r = _cond_r(a.shape[0], cond, seed).to(a.dtype)
    with torch.no_grad():  # M R, N R^{-T}: B <- B R, A <- R^{-1} A
        b.copy_(b @ r)
        a.copy_(torch.linalg.solve(r, a))


@pytest.mark.parametrize("make", [lambda m: AdamS(m, lr=3e-3), lambda m: LRACS(m, lr=3e-2)], ids=["AdamS", "LRACS"])
def test_x_trajectory_is_invariant(make):
    target = _rand(8, 6, seed=11)
    xin = _rand(16, 6, seed=12)
    runs = []
    for reparam in (False, True):
        model = _toy()
        if reparam:
            _reparametrise(model)
        opt = make(model)
        for _ in range(30):
            opt.zero_grad()
            _toy_loss(model, target, xin).backward()
            opt.step()
        runs.append(_x_of(model))
    rel = torch.linalg.norm(runs[0] - runs[1]) / torch.linalg.norm(runs[0])
    assert rel < 1e-8


def test_adamw_is_not_invariant():
    target = _rand(8, 6, seed=11)
    xin = _rand(16, 6, seed=12)
    runs, start = [], []
    for reparam in (False, True):
        model = _toy()
        if reparam:
            _reparametrise(model)
        start.append(_x_of(model))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
        for _ in range(30):
            opt.zero_grad()
            _toy_loss(model, target, xin).backward()
            opt.step()
        runs.append(_x_of(model))
    assert torch.allclose(start[0], start[1], atol=1e-10)
    assert torch.linalg.norm(runs[0] - runs[1]) / torch.linalg.norm(runs[0] - start[0]) > 1e-2


def test_monotone_decrease_on_convex_toy():
    target = _rand(8, 6, seed=11)
    eye = torch.eye(6, dtype=D64)
    model = _toy()
    opt = AdamS(model, lr=1e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = _toy_loss(model, target, eye)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b <= a + 1e-12 for a, b in zip(losses, losses[1:]))
    assert losses[-1] < 0.8 * losses[0]
    assert "0" in opt.last_K and opt.last_K["0"].shape == (3, 3)


def test_state_dict_round_trip():
    target = _rand(8, 6, seed=11)
    xin = _rand(16, 6, seed=12)
    for cls, lr in ((AdamS, 3e-3), (LRACS, 3e-2)):
        model = _toy()
        opt = cls(model, lr=lr)
        for _ in range(3):
            opt.zero_grad()
            _toy_loss(model, target, xin).backward()
            opt.step()
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        twin = copy.deepcopy(model)
        opt2 = cls(twin, lr=lr)
        buf.seek(0)
        opt2.load_state_dict(torch.load(buf, weights_only=True))
        for mdl, o in ((model, opt), (twin, opt2)):
            for _ in range(3):
                o.zero_grad()
                _toy_loss(mdl, target, xin).backward()
                o.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def test_other_params_follow_torch_adam():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8).double())
    add_lora(model, ["0"], rank=2, alpha=4.0, freeze_base=False)
    model[0].base_layer.weight.requires_grad_(False)
    offset_init_(model, seed=1)
    bias = model[0].base_layer.bias
    twin_bias = bias.detach().clone().requires_grad_(True)
    opt = AdamS(model, lr=1e-3, other_lr=1e-2)
    ref = torch.optim.Adam([twin_bias], lr=1e-2)
    x = _rand(5, 6, seed=2)
    for _ in range(4):
        opt.zero_grad()
        ref.zero_grad()
        y = model(x)
        y.square().sum().backward()
        twin_bias.grad = bias.grad.clone()
        opt.step()
        ref.step()
    assert torch.allclose(bias, twin_bias, rtol=1e-12, atol=1e-14)


def test_peft_model_pairs():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential()
    base.add_module("proj", nn.Linear(6, 8))
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["proj"]))
    pairs = lora_factor_pairs(pm)
    assert len(pairs) == 1 and pairs[0].lora_A.shape == (2, 6) and pairs[0].scale == 2.0
    x = _rand(3, 6, seed=1).float()
    with pytest.raises(NumericalError, match="offset_init_"):
        opt = AdamS(pairs, lr=1e-3)
        pm(x).sum().backward()
        opt.step()
    y0 = pm(x).detach()
    offset_init_(pm, pairs, seed=0)
    assert torch.allclose(pm(x), y0, atol=1e-5)
    opt = AdamS(pairs, lr=1e-3)
    opt.zero_grad()
    pm(x).sum().backward()
    gx = opt.capture.grads[0]
    assert torch.allclose(pairs[0].scale * pairs[0].lora_B.T @ gx, pairs[0].lora_A.grad, rtol=1e-4, atol=1e-6)
    before = pairs[0].lora_A.detach().clone()
    opt.step()
    assert not torch.equal(before, pairs[0].lora_A)


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_hyperparameters():
    model = _toy()
    with pytest.raises(ValueError, match="lr"):
        AdamS(model, lr=-1e-3)
    with pytest.raises(ValueError, match="lr"):
        LRACS(model, lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        AdamS(model, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="gamma"):
        LRACSConfig(gamma=0.5)
    with pytest.raises(ValueError, match="ridge"):
        AdamSConfig(ridge=-1.0)
    with pytest.raises(ValueError, match="nonfinite"):
        AdamS(model, nonfinite="ignore")


def test_unpaired_and_mismatched_factors():
    model = _toy()
    del model[0].lora_B["default"]
    with pytest.raises(ValueError, match="unpaired"):
        lora_factor_pairs(model)
    a = nn.Parameter(torch.zeros(3, 6))
    b = nn.Parameter(torch.zeros(8, 2))
    with pytest.raises(ValueError, match="shape mismatch"):
        AdamS([LoraPair("bad", a, b, 1.0)], lr=1e-3)
    with pytest.raises(RankwiseError, match="no active LoRA"):
        lora_factor_pairs(nn.Linear(3, 3))


def test_nonfinite_and_sparse_gradients():
    model = _toy()
    xin = _rand(4, 6, seed=1)
    opt = AdamS(model, lr=1e-3)
    (model(xin).sum() * float("nan")).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NumericalError, match="non-finite gradient.*'0'"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    opt2 = AdamS(model, lr=1e-3, nonfinite="skip")
    opt2.zero_grad()
    (model(xin).sum() * float("inf")).backward()
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt2.step()
    assert opt2.skipped and all(torch.equal(p, q) for p, q in zip(before, model.parameters()))

    emb = nn.Embedding(5, 3, sparse=True)
    opt3 = AdamS(_toy(), lr=1e-3, other_params=emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt3.step()


def test_factor_grads_without_grad_x_raise():
    model = _toy()
    opt = AdamS(model, lr=1e-3, capture=False)
    model(_rand(2, 6, seed=0)).sum().backward()
    with pytest.raises(RankwiseError, match="G_X"):
        opt.step()


def test_lracs_direction_is_racs_on_x():
    from rankwise.train.racs import RACS

    model = _toy()
    opt = LRACS(model, lr=1e-2, capture=False)
    w = nn.Parameter(torch.zeros(8, 6, dtype=D64))
    racs = RACS([w], lr=1e-2)
    for t in range(3):
        gx = _rand(8, 6, seed=20 + t)
        d = opt._direction(gx.clone(), opt.state.setdefault("probe", {"step": t + 1}), opt.param_groups[0])
        before = w.detach().clone()
        w.grad = gx.clone()
        racs.step()
        assert torch.allclose(d, (before - w.detach()) / 1e-2, rtol=1e-10, atol=1e-14)


def test_ridge_trains_from_peft_zero_init():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False).double())
    add_lora(model, ["0"], rank=3, alpha=6.0, generator=torch.Generator().manual_seed(0))
    assert float(model[0].lora_B["default"].weight.detach().abs().sum()) == 0.0
    opt = AdamS(model, lr=1e-2, ridge=1e-3)
    target, xin = _rand(8, 6, seed=11), _rand(16, 6, seed=12)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = _toy_loss(model, target, xin)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert float(model[0].lora_B["default"].weight.detach().abs().sum()) > 0.0


def test_add_param_group_other_only():
    model = _toy()
    opt = AdamS(model, lr=1e-3)
    extra = nn.Parameter(torch.ones(3, dtype=D64))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.ones(3, dtype=D64)
    opt.step()
    assert not torch.equal(extra, torch.ones(3, dtype=D64))
    with pytest.raises(ValueError, match="fixed at construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 6)), nn.Parameter(torch.zeros(8, 2))],
                             "kind": "lora"})
