import pytest
import torch
from torch import nn

from rankwise.core import linalg
from rankwise.core.layers import KroneckerLinear, LowRankLinear, validate_rank

D = torch.float64


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def linear(n, m, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n, m, bias=bias, dtype=dtype)


@pytest.mark.parametrize("n,m", [(12, 7), (7, 12), (9, 9)])
def test_lowrank_exact_at_full_rank(n, m):
    lin = linear(n, m)
    lr = LowRankLinear.from_linear(lin, min(n, m))
    x = torch.randn(3, 5, n, generator=gen(1))
    y = lr(x)
    assert y.shape == (3, 5, m)
    assert (y - lin(x)).abs().max() < 1e-5
    assert (lr.to_dense() - lin.weight).abs().max() < 1e-5
    assert lr.to_dense().shape == (m, n)


def test_lowrank_error_equals_truncated_svd():
    lin = linear(20, 15, dtype=D)
    s = torch.linalg.svdvals(lin.weight.detach())
    for k in (1, 4, 10):
        for bal in ("sqrt", "left", "right"):
            lr = LowRankLinear.from_linear(lin, k, balance=bal)
            err = float(torch.linalg.matrix_norm(lin.weight.detach() - lr.to_dense()) ** 2)
            assert err == pytest.approx(float((s[k:] ** 2).sum()), rel=1e-10)
        x = torch.randn(4, 20, generator=gen(2), dtype=D)
        assert torch.allclose(lr(x), x @ lr.to_dense().T + lin.bias, atol=1e-12)


def test_lowrank_parameter_count_and_structure():
    lr = LowRankLinear(30, 10, 4)
    assert lr.num_parameters == 4 * (30 + 10) + 10 == sum(p.numel() for p in lr.parameters())
    assert LowRankLinear.parameter_count(30, 10, 4, bias=False) == 160
    nb = LowRankLinear(30, 10, 4, bias=False)
    assert nb.bias is None and nb.num_parameters == sum(p.numel() for p in nb.parameters())
    assert set(lr.state_dict()) == {"down.weight", "up.weight", "up.bias"}
    assert lr.down.weight.shape == (4, 30) and lr.up.weight.shape == (10, 4)
    assert "rank=4" in repr(lr)


def test_lowrank_keeps_dtype_device_and_grad_flag():
    lin = linear(8, 6, dtype=D).requires_grad_(False)
    lr = LowRankLinear.from_linear(lin, 3)
    assert lr.down.weight.dtype == D and lr.up.bias.dtype == D
    assert lr.down.weight.device == lin.weight.device
    assert not any(p.requires_grad for p in lr.parameters())
    lr32 = LowRankLinear.from_linear(linear(8, 6, bias=False), 2)
    assert lr32.up.weight.dtype == torch.float32 and lr32.bias is None


def test_lowrank_from_factors_and_validation():
    B, A = torch.randn(3, 8, dtype=D), torch.randn(5, 3, dtype=D)
    bias = torch.randn(5, dtype=D)
    lr = LowRankLinear.from_factors(B, A, bias)
    assert torch.allclose(lr.to_dense(), A @ B) and torch.equal(lr.bias.detach(), bias)
    f = linalg.lowrank_factors(torch.randn(5, 8, dtype=D), 3)
    assert torch.allclose(LowRankLinear.from_factors(*f).to_dense(), f.product())
    lin = linear(8, 5, dtype=D)
    lr2 = LowRankLinear.from_linear(lin, factors=(B, A))
    assert torch.allclose(lr2.to_dense(), A @ B) and torch.equal(lr2.bias, lin.bias)
    with pytest.raises(ValueError, match="order"):
        LowRankLinear.from_factors(A, B)  # swapped
    with pytest.raises(ValueError, match="bias"):
        LowRankLinear.from_factors(B, A, torch.zeros(4))
    with pytest.raises(ValueError, match="do not fit"):
        LowRankLinear.from_linear(linear(9, 5), factors=(B, A))
    with pytest.raises(ValueError, match="disagrees"):
        LowRankLinear.from_linear(lin, 2, factors=(B, A))
    with pytest.raises(ValueError, match="non-finite"):
        LowRankLinear.from_factors(B, A * float("nan"))
    for bad in (0, 6, -2):
        with pytest.raises(ValueError, match="out of range"):
            LowRankLinear(8, 5, bad)
        with pytest.raises(ValueError, match="out of range"):
            LowRankLinear.from_linear(lin, bad)
    with pytest.raises(TypeError):
        LowRankLinear(8, 5, 2.5)
    with pytest.raises(TypeError):
        LowRankLinear.from_linear(nn.Conv1d(3, 3, 1), 2)
    with pytest.raises(ValueError, match="rank or factors"):
        LowRankLinear.from_linear(lin)
    assert validate_rank(5, 8, 5) == 5


def test_lowrank_to_linear_round_trip():
    lin = linear(6, 9, dtype=D)
    back = LowRankLinear.from_linear(lin, 6).to_linear()
    assert torch.allclose(back.weight, lin.weight, atol=1e-12) and torch.equal(back.bias, lin.bias)


def test_kronecker_linear_forward_equals_dense():
    kl = KroneckerLinear(12, 10, in_factors=(3, 4), out_factors=(2, 5), terms=2, dtype=D, generator=gen(0))
    W = kl.to_dense()
    assert W.shape == (10, 12)
    assert torch.allclose(W, torch.kron(kl.A[0], kl.B[0]) + torch.kron(kl.A[1], kl.B[1]))
    x = torch.randn(2, 3, 12, generator=gen(1), dtype=D)
    assert torch.allclose(kl(x), x @ W.T + kl.bias, atol=1e-12)
    kl(x).sum().backward()
    assert kl.A.grad is not None and kl.B.grad is not None
    assert kl.num_parameters == sum(p.numel() for p in kl.parameters()) == 2 * (2 * 3 + 5 * 4) + 10


def test_kronecker_from_dense_exact_for_kronecker_weight():
    A, B = torch.randn(4, 2, dtype=D), torch.randn(3, 5, dtype=D)
    lin = nn.Linear(10, 12, dtype=D)
    with torch.no_grad():
        lin.weight.copy_(torch.kron(A, B))
    kl = KroneckerLinear.from_dense(lin, in_factors=(2, 5), out_factors=(4, 3))
    assert torch.allclose(kl.to_dense(), lin.weight, atol=1e-12)
    x = torch.randn(7, 10, dtype=D)
    assert torch.allclose(kl(x), lin(x), atol=1e-12)
    assert kl.A.dtype == D


def test_kronecker_validation_and_defaults():
    kl = KroneckerLinear(64, 36, bias=False)
    assert kl.in_factors == (8, 8) and kl.out_factors == (6, 6) and kl.bias is None
    assert KroneckerLinear(7, 6).in_factors == (1, 7)
    with pytest.raises(ValueError, match="in_factors"):
        KroneckerLinear(12, 10, in_factors=(5, 3))
    with pytest.raises(ValueError, match="out_factors"):
        KroneckerLinear(12, 10, out_factors=(2, 2, 2))
    with pytest.raises(ValueError, match="terms"):
        KroneckerLinear(4, 4, in_factors=(2, 2), out_factors=(2, 2), terms=5)
    with pytest.raises(ValueError):
        KroneckerLinear(0, 4)
    with pytest.raises(ValueError, match="last dim"):
        kl(torch.randn(3, 63))
