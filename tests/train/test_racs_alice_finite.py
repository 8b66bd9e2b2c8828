"""The finiteness check folded into the RACS / Alice step (issue 20, item 5).

The check no longer reads every gradient a second time (``torch.isfinite(grad.sum())``); it is taken on
reductions the step needs anyway, before any state is written. These tests hold the new path to the old
one: a NaN or Inf in a single entry is still caught (skip leaves parameters and state bit-identical, raise
raises), and finite gradients give bit-identical results to a reference copy of the old code path.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch

from rankwise.core.errors import NumericalError
from rankwise.train.lowmem_base import TINY, norm_growth_limit, racs_scale, state_dtype
from rankwise.train.racs_alice import RACS, Alice
from rankwise.train.racs_alice.alice import _P_FLOOR, alice_switch


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# reference: the code path before the fold (full-gradient sum check, then the monolithic matrix step)


def _old_step(opt: Any, matrix_step: Any) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, state = p.grad, opt.state[p]
            if not bool(torch.isfinite(grad.sum())):
                continue
            state["shape"] = tuple(p.shape)
            state["step"] = int(state.get("step", 0)) + 1
            lr = float(group["lr"])
            if group["weight_decay"] != 0:
                p.mul_(1.0 - lr * group["weight_decay"])
            matrix_step(p, grad, state, group)


def _old_racs_matrix_step(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    dtype = state_dtype(p)
    g = grad.reshape(grad.shape[0], -1).to(dtype)
    m, n = g.shape
    if "s" not in state:
        state["s"] = torch.zeros(m, dtype=dtype, device=p.device)
        state["q"] = torch.ones(n, dtype=dtype, device=p.device)
        state["phi"] = torch.zeros((), dtype=dtype, device=p.device)
    s, q, phi = state["s"], state["q"], state["phi"]
    beta = group["beta"]
    g2 = g.square()
    if group["normalize"]:
        s.mul_(beta).add_((g2 @ q) / (q @ q).clamp_min(TINY), alpha=1 - beta)
        q.mul_(beta).add_((g2.T @ s) / (s @ s).clamp_min(TINY), alpha=1 - beta)
    else:
        s.lerp_(g2.mean(dim=1), 1 - beta)
        q.lerp_(g2.mean(dim=0), 1 - beta)
    g_hat = racs_scale(g, s, q, group["eps"], out=g2)
    norm = torch.linalg.vector_norm(g_hat)
    eta = norm_growth_limit(norm, phi, group["gamma"])
    phi.copy_(eta * norm)
    coeff = eta * (-float(group["lr"]) * group["alpha"])
    if g_hat.dtype == p.dtype:
        p.addcmul_(g_hat.view_as(p), coeff.to(p.dtype))
    else:
        p.add_((g_hat * coeff).view_as(p).to(p.dtype))


def _old_alice_matrix_step(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    dtype = state_dtype(p)
    g = grad.reshape(grad.shape[0], -1).to(dtype)
    transposed = g.shape[0] > g.shape[1]
    if transposed:
        g = g.T
    m, n = g.shape
    r = min(group["rank"], m)
    lead = min(group["leading_basis"], r)
    beta1, beta2, beta3 = group["betas"]
    t = state["step"]
    if "U" not in state:
        state["Q"] = torch.zeros(r, r, dtype=dtype, device=p.device)
        state["M"] = torch.zeros(r, n, dtype=dtype, device=p.device)
        state["V"] = torch.zeros(r, n, dtype=dtype, device=p.device)
        state["p"] = torch.zeros(n, dtype=dtype, device=p.device)
        state["phi"] = torch.zeros((), dtype=dtype, device=p.device)
        state["U"] = alice_switch(g, None, None, beta3, lead, r)
    elif t % group["update_interval"] == 0:
        u_old = state["U"]
        u_new = alice_switch(g, u_old, state["Q"], beta3, lead, r)
        rot = u_new.T @ u_old
        state["Q"] = rot @ state["Q"] @ rot.T
        state["U"] = u_new
    u, q, mom, var, pc, phi = (state[k] for k in ("U", "Q", "M", "V", "p", "phi"))
    sigma = u.T @ g
    q.mul_(beta3).add_(sigma @ sigma.T, alpha=1 - beta3)
    mom.lerp_(sigma, 1 - beta1)
    var.mul_(beta2).addcmul_(sigma, sigma, value=1 - beta2)
    k = math.sqrt(m - r) if m > r else 0.0
    scale = -float(group["lr"]) * group["alpha"]
    inner = mom / (var.sqrt() + group["eps"]) * scale
    pv = p.view(p.shape[0], -1) if p.is_contiguous() and p.dtype == dtype else None
    if pv is not None and transposed:
        pv = pv.T
    if k > 0:
        resid = g - u @ sigma
        pc.mul_(beta1).add_(resid.square().sum(dim=0), alpha=1 - beta1).clamp_(min=_P_FLOOR)
        resid.mul_(torch.rsqrt(pc).unsqueeze(0))
        norm = k * torch.linalg.vector_norm(resid)
        eta = norm_growth_limit(norm, phi, group["gamma"])
        phi.copy_(eta * norm)
        coeff = eta * (k * group["alpha_c"] * scale)
    else:
        pc.mul_(beta1).clamp_(min=_P_FLOOR)
        phi.zero_()
    if pv is not None:
        pv.addmm_(u, inner)
        if k > 0:
            pv.add_(resid.mul_(coeff))
    else:
        update = u @ inner
        if k > 0:
            update.add_(resid.mul_(coeff))
        if transposed:
            update = update.T
        p.add_(update.reshape(p.shape).to(p.dtype))


# --------------------------------------------------------------------------------------------------

SHAPES = [(6, 9), (9, 6), (4, 3, 2)]  # wide, tall (Alice transposes), 3-D (reshaped)
CASES = [
    (RACS, dict(lr=0.05), _old_racs_matrix_step),
    (RACS, dict(lr=0.05, normalize=False, weight_decay=0.1), _old_racs_matrix_step),
    (Alice, dict(lr=0.02, rank=2, leading_basis=1, update_interval=3, weight_decay=0.1), _old_alice_matrix_step),
    (Alice, dict(lr=0.02, rank=9, leading_basis=2, update_interval=2), _old_alice_matrix_step),  # r = m: no residual
]


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(*s, generator=_gen(i)).to(dtype)) for i, s in enumerate(SHAPES)]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=_gen(100 * step + i)).to(p.dtype) for i, p in enumerate(params)]


def _state_copy(opt: Any) -> list[dict]:
    return [copy.deepcopy(opt.state[p]) for g in opt.param_groups for p in g["params"]]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_finite_gradients_are_bit_identical_to_the_old_path(case: int, dtype: torch.dtype) -> None:
    cls, kw, old_matrix_step = CASES[case]
    new_p, old_p = _params(dtype), _params(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Alice clips rank 9 on the smaller matrices
        new_opt, old_opt = cls(new_p, **kw), cls(old_p, **kw)
    for t in range(7):  # several switches of Alice (update_interval 2 and 3)
        for a, b, g in zip(new_p, old_p, _grads(t, new_p)):
            a.grad, b.grad = g.clone(), g.clone()
        if t == 4:  # a zero gradient on one matrix (all-zero statistics)
            new_p[0].grad.zero_()
            old_p[0].grad.zero_()
        new_opt.step()
        with torch.no_grad():
            _old_step(old_opt, old_matrix_step)
    for a, b in zip(new_p, old_p):
        assert torch.equal(a, b)
    assert _same(_state_copy(new_opt), _state_copy(old_opt))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("at_step", [0, 1, 2])  # first step (no state), a plain step, an Alice switch step
def test_single_nonfinite_entry_is_caught_and_leaves_everything_untouched(case: int, bad: float,
                                                                          at_step: int) -> None:
    cls, kw, _ = CASES[case]
    params = _params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = cls(params, **kw)
        opt_raise = cls(_params(), nonfinite="raise", **kw)
    for t in range(at_step):
        for p, g in zip(params, _grads(t, params)):
            p.grad = g
        opt.step()
    before_p = [p.detach().clone() for p in params]
    before_s = _state_copy(opt)
    for i, p in enumerate(params):
        p.grad = _grads(at_step, params)[i]
        p.grad.view(-1)[p.numel() // 2 + i] = bad  # one entry of each matrix, at a different place
    with pytest.warns(RuntimeWarning, match="non-finite gradient") as rec:
        opt.step()
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == len(params)
    for a, b in zip(params, before_p):
        assert torch.equal(a.detach(), b)
    assert _same(_state_copy(opt), before_s)
    assert [s[0] for s in opt.nonfinite_skips] == [at_step + 1] * len(params)
    assert [s[3] for s in opt.nonfinite_skips] == [tuple(p.shape) for p in params]
    for q, p in zip(opt_raise.param_groups[0]["params"], params):
        q.grad = p.grad.clone()
    with pytest.raises(NumericalError, match=r"non-finite gradient \(NaN/Inf\) for parameter 0 of param group 0"):
        opt_raise.step()
    # a finite gradient afterwards steps normally
    for p, g in zip(params, _grads(9, params)):
        p.grad = g
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p.detach(), b) for p, b in zip(params, before_p))


def test_adamw_routed_parameters_keep_their_check() -> None:
    for cls, kw in ((RACS, {}), (Alice, dict(rank=2, leading_basis=1))):
        w = torch.nn.Parameter(torch.ones(4, 5))
        b = torch.nn.Parameter(torch.ones(5))
        opt = cls([{"params": [w]}, {"params": [b], "use_adamw": True}], **kw)
        w.grad = torch.randn(4, 5, generator=_gen(1))
        b.grad = torch.randn(5, generator=_gen(2))
        b.grad[3] = float("nan")
        with pytest.warns(RuntimeWarning, match="parameter 0 of param group 1"):
            opt.step()
        assert torch.equal(b.detach(), torch.ones(5)) and not opt.state[b]
        assert not torch.equal(w.detach(), torch.ones(4, 5))
        assert opt.nonfinite_skips == [(1, 1, 0, (5,))]
