import math

import pytest
import torch

from rankwise.core import linalg
from rankwise.core.errors import NumericalError

D = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=gen(seed), dtype=D)


def low_rank(m, n, r, seed=0):
    return randn(m, r, seed=seed) @ randn(r, n, seed=seed + 1)


# ---------------------------------------------------------------- whitening


def test_damped_cholesky_full_rank_uses_documented_relative_floor():
    X = randn(200, 12)
    H = X.T @ X
    L, jitter, attempts = linalg.damped_cholesky(H)
    assert attempts == 1
    assert jitter == pytest.approx(1e-6 * float(torch.diagonal(H).mean()))
    assert torch.allclose(L @ L.T, H + jitter * torch.eye(12, dtype=D), rtol=1e-12, atol=1e-10)
    assert torch.equal(L, torch.tril(L))
    L0, j0, _ = linalg.damped_cholesky(H, damping=0.0)
    assert j0 == 0.0 and torch.allclose(L0 @ L0.T, H, rtol=1e-12, atol=1e-10)


def test_damped_cholesky_singular_covariance():
    X = randn(5, 20)  # 5 tokens, 20 features: X^T X has rank 5
    H = X.T @ X
    with pytest.raises(NumericalError, match="layer 'blk.fc'"):
        linalg.damped_cholesky(H, damping=0.0, name="blk.fc")
    L, jitter, attempts = linalg.damped_cholesky(H, damping=1e-6)
    scale = float(torch.diagonal(H).mean())
    # jitter is 1e-6 * mean(diag) * 10**(attempts - 1)
    assert jitter == pytest.approx(1e-6 * scale * 10 ** (attempts - 1))
    assert torch.isfinite(L).all()
    assert torch.allclose(L @ L.T, H + jitter * torch.eye(20, dtype=D), atol=1e-8 * scale)


def test_damped_cholesky_errors():
    with pytest.raises(NumericalError, match="mean diagonal"):
        linalg.damped_cholesky(torch.zeros(4, 4, dtype=D), name="z")
    H = -torch.eye(3, dtype=D) * 5
    H[0, 0] = 100.0  # mean diag positive, indefinite: every retry fails
    with pytest.raises(NumericalError, match="failed after 3 attempt"):
        linalg.damped_cholesky(H, retries=2)
    bad = torch.eye(3, dtype=D)
    bad[1, 1] = float("nan")
    with pytest.raises(NumericalError, match="non-finite"):
        linalg.damped_cholesky(bad, name="x")
    with pytest.raises(ValueError, match="square"):
        linalg.damped_cholesky(torch.ones(2, 3))
    with pytest.raises(ValueError, match="damping"):
        linalg.damped_cholesky(torch.eye(2), damping=-1.0)


def test_eigh_desc_sorted_and_floored():
    X = randn(4, 10)
    C = X.T @ X  # rank 4, six zero eigenvalues (slightly negative after rounding)
    lam, V = linalg.eigh_desc(C)
    assert (lam[:-1] >= lam[1:]).all()
    assert (lam >= 0).all()
    assert torch.allclose((V * lam) @ V.T, C, atol=1e-10)
    lam2, _ = linalg.eigh_desc(C, rel_floor=1e-3)
    assert float(lam2.min()) == pytest.approx(1e-3 * float(lam2[0]))


def test_sqrt_and_inverse_sqrt():
    X = randn(50, 8)
    C = X.T @ X
    R = linalg.sqrtm_psd(C)
    assert torch.allclose(R @ R, C, rtol=1e-10, atol=1e-10)
    assert torch.allclose(R, R.T)
    Ri = linalg.inv_sqrtm_psd(C, rel_floor=1e-12)
    assert torch.allclose(Ri @ C @ Ri, torch.eye(8, dtype=D), atol=1e-8)


def test_inverse_sqrt_floor_on_singular_covariance():
    X = randn(3, 6)
    C = X.T @ X  # rank 3
    rel = 1e-4
    Ri = linalg.inv_sqrtm_psd(C, rel_floor=rel)
    assert torch.isfinite(Ri).all()
    lam, V = linalg.eigh_desc(C)
    null = V[:, -1]  # a direction the data never excites
    # scaled by (rel * lam_max)^{-1/2}, not infinity
    assert float(null @ Ri @ null) == pytest.approx((rel * float(lam[0])) ** -0.5, rel=1e-8)
    with pytest.raises(NumericalError, match="layer 'q'"):
        linalg.inv_sqrtm_psd(torch.zeros(3, 3), name="q")
    with pytest.raises(ValueError, match="floor"):
        linalg.inv_sqrtm_psd(C, rel_floor=0.0)


def test_whitening_cholesky_and_eigh_give_same_truncation():
    W = randn(10, 16, seed=3)
    X = randn(100, 16, seed=4)
    H = X.T @ X
    S_c = linalg.whiten(H, method="cholesky", damping=0.0)
    S_e = linalg.whiten(H, method="eigh", rel_floor=1e-14)
    for k in (1, 4, 10):
        Pc = linalg.weighted_lowrank_factors(W, k, right=S_c).product()
        Pe = linalg.weighted_lowrank_factors(W, k, right=S_e).product()
        assert torch.allclose(Pc, Pe, rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="method"):
        linalg.whiten(H, method="svd")


# ---------------------------------------------------------------- SVD


def test_truncated_svd_eckart_young_and_rank_checks():
    M = randn(9, 7)
    s_all = torch.linalg.svdvals(M)
    for k in (1, 3, 7):
        U, S, Vh = linalg.truncated_svd(M, k)
        assert U.shape == (9, k) and S.shape == (k,) and Vh.shape == (k, 7)
        err = torch.linalg.matrix_norm(M - (U * S) @ Vh) ** 2
        assert float(err) == pytest.approx(float((s_all[k:] ** 2).sum()), abs=1e-10)
    for bad in (0, 8, -1):
        with pytest.raises(ValueError, match="rank"):
            linalg.truncated_svd(M, bad, name="lay")
    with pytest.raises(TypeError):
        linalg.truncated_svd(M, 2.0)
    M[0, 0] = float("inf")
    with pytest.raises(NumericalError):
        linalg.truncated_svd(M, 2)


def test_randomized_svd_close_to_exact_on_low_rank():
    M = low_rank(120, 80, 6, seed=5)
    U, S, Vh = linalg.randomized_svd(M, 6, seed=1)
    _, S_ex, _ = linalg.truncated_svd(M, 6)
    assert torch.allclose(S, S_ex, rtol=1e-10)
    assert torch.allclose((U * S) @ Vh, M, atol=1e-9 * float(M.abs().max()))
    assert torch.allclose(U.T @ U, torch.eye(6, dtype=D), atol=1e-12)
    # low rank plus small noise, rank below the true rank: near-optimal error
    N = M + 1e-3 * randn(120, 80, seed=9)
    U, S, Vh = linalg.randomized_svd(N, 4, oversample=8, power_iters=2, generator=gen(2))
    Ue, Se, Vhe = linalg.truncated_svd(N, 4)
    e_r = torch.linalg.matrix_norm(N - (U * S) @ Vh)
    e_x = torch.linalg.matrix_norm(N - (Ue * Se) @ Vhe)
    assert float(e_r) <= float(e_x) * (1 + 1e-6)
    assert torch.allclose(S, Se, rtol=1e-8)


def test_randomized_svd_deterministic_and_validated():
    M = randn(30, 20)
    a = linalg.randomized_svd(M, 3, seed=7)
    b = linalg.randomized_svd(M, 3, generator=gen(7))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="either"):
        linalg.randomized_svd(M, 3, seed=1, generator=gen(1))
    with pytest.raises(ValueError):
        linalg.randomized_svd(M, 3, oversample=-1)
    with pytest.raises(ValueError, match="rank"):
        linalg.randomized_svd(M, 21)


def test_factor_splitting():
    W = randn(8, 5)
    prods = []
    for bal in ("sqrt", "left", "right"):
        f = linalg.lowrank_factors(W, 3, balance=bal)
        assert f.B.shape == (3, 5) and f.A.shape == (8, 3) and f.rank == 3
        prods.append(f.product())
    assert torch.allclose(prods[0], prods[1]) and torch.allclose(prods[0], prods[2])
    f = linalg.lowrank_factors(W, 3, balance="sqrt")
    assert torch.allclose(f.A.norm(dim=0), f.B.norm(dim=1))  # sqrt(S) on both sides
    f = linalg.lowrank_factors(W, 3, balance="right")
    assert torch.allclose(f.A.T @ f.A, torch.eye(3, dtype=D), atol=1e-12)  # orthonormal up factor
    f = linalg.lowrank_factors(W, 3, balance="left")
    assert torch.allclose(f.B @ f.B.T, torch.eye(3, dtype=D), atol=1e-12)
    full = linalg.lowrank_factors(W, 5)
    assert torch.allclose(full.product(), W, atol=1e-12)
    fr = linalg.lowrank_factors(low_rank(8, 5, 2), 2, method="randomized", generator=gen(0))
    assert torch.allclose(fr.product(), low_rank(8, 5, 2), atol=1e-10)
    with pytest.raises(ValueError, match="balance"):
        linalg.lowrank_factors(W, 2, balance="middle")


def test_weighted_lowrank_is_activation_optimal():
    # SVD-LLM(W) closed form: [W S]_k S^{-1} minimises ||X W^T - X W_k^T||_F, and the minimum is
    # the sum of the discarded eigenvalues of W X^T X W^T (Swift-SVD's theorem).
    m, n, N, k = 7, 9, 40, 3
    W, X = randn(m, n, seed=1), randn(N, n, seed=2)
    H = X.T @ X
    S = linalg.damped_cholesky(H, damping=0.0).L
    Wk = linalg.weighted_lowrank_factors(W, k, right=S).product()
    err = float(torch.linalg.matrix_norm(X @ W.T - X @ Wk.T) ** 2)
    lam, _ = linalg.eigh_desc(W @ H @ W.T)
    assert err == pytest.approx(float(lam[k:].sum()), rel=1e-9)
    g = gen(3)
    for _ in range(50):  # no random rank-k perturbation does better
        P = Wk + 1e-2 * torch.randn(m, k, generator=g, dtype=D) @ torch.randn(k, n, generator=g, dtype=D)
        P = linalg.lowrank_factors(P, k).product()
        assert float(torch.linalg.matrix_norm(X @ W.T - X @ P.T) ** 2) >= err * (1 - 1e-12)


def test_weighted_lowrank_left_diagonal_and_shapes():
    W = randn(6, 4)
    d = torch.rand(6, generator=gen(1), dtype=D) + 0.1
    f = linalg.weighted_lowrank_factors(W, 2, left=torch.diag(d))
    U, S, Vh = linalg.truncated_svd(d[:, None] * W, 2)
    assert torch.allclose(f.product(), ((U * S) @ Vh) / d[:, None], atol=1e-12)
    assert torch.allclose(linalg.weighted_lowrank_factors(W, 2).product(), linalg.lowrank_factors(W, 2).product())
    with pytest.raises(ValueError, match="right must be 4 x 4"):
        linalg.weighted_lowrank_factors(W, 2, right=torch.eye(3))
    with pytest.raises(ValueError, match="left must be 6 x 6"):
        linalg.weighted_lowrank_factors(W, 2, left=torch.eye(4))
    with pytest.raises(NumericalError):
        linalg.weighted_lowrank_factors(W, 2, right=torch.diag(torch.tensor([1.0, 0.0, 1.0, 1.0])))


# ---------------------------------------------------------------- spectra


def test_effective_and_stable_rank():
    assert linalg.effective_rank(torch.eye(6)) == pytest.approx(6.0)
    assert linalg.effective_rank(low_rank(8, 8, 1)) == pytest.approx(1.0, abs=1e-6)
    assert linalg.effective_rank(torch.zeros(3, 3)) == 0.0
    s = torch.tensor([3.0, 1.0, 0.0])
    p = torch.tensor([0.75, 0.25], dtype=D)
    assert linalg.effective_rank(s) == pytest.approx(math.exp(float(-(p * p.log()).sum())))
    assert linalg.normalized_effective_rank(torch.eye(5)) == pytest.approx(1.0)
    e = linalg.effective_rank(randn(20, 10))
    assert 1.0 < e < 10.0
    assert linalg.stable_rank(torch.eye(4)) == pytest.approx(4.0)
    assert linalg.stable_rank(low_rank(6, 5, 1)) == pytest.approx(1.0)
    assert linalg.stable_rank(torch.tensor([2.0, 1.0])) == pytest.approx(1.25)
    with pytest.raises(ValueError):
        linalg.effective_rank(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError):
        linalg.stable_rank(torch.zeros(2, 2, 2))


# ---------------------------------------------------------------- orthogonalisation


def test_orthogonalize_qr_sign_fix_and_wide():
    M = randn(10, 4)
    Q = linalg.orthogonalize(M)
    assert torch.allclose(Q.T @ Q, torch.eye(4, dtype=D), atol=1e-12)
    R = Q.T @ M  # upper triangular with a positive diagonal
    assert torch.allclose(R, torch.triu(R), atol=1e-12) and (torch.diagonal(R) > 0).all()
    Qw = linalg.orthogonalize(M.T)
    assert Qw.shape == (4, 10) and torch.allclose(Qw @ Qw.T, torch.eye(4, dtype=D), atol=1e-12)


def test_polar_and_newton_schulz():
    M = randn(8, 5) + 3 * torch.eye(8, 5, dtype=D)
    P = linalg.orthogonalize(M, method="polar")
    U, _, Vh = torch.linalg.svd(M, full_matrices=False)
    assert torch.allclose(P, U @ Vh, atol=1e-12)
    Qr = linalg.orthogonalize(M, method="qr")
    assert torch.linalg.matrix_norm(M - P) <= torch.linalg.matrix_norm(M - Qr) + 1e-12
    NS = linalg.orthogonalize(M, method="newton_schulz")
    assert torch.allclose(NS, P, atol=1e-8)
    with pytest.raises(NumericalError):
        linalg.newton_schulz(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="method"):
        linalg.orthogonalize(M, method="gram")


# ---------------------------------------------------------------- Kronecker


def test_vec_unvec_identity():
    X = randn(3, 4)
    v = linalg.vec(X)
    assert torch.equal(v[:3], X[:, 0])  # column stacking
    assert torch.equal(linalg.unvec(v, 3, 4), X)
    A, B, Y = randn(5, 4, seed=1), randn(2, 3, seed=2), randn(3, 4, seed=3)
    assert torch.allclose(linalg.kron(A, B) @ linalg.vec(Y), linalg.vec(B @ Y @ A.T))
    with pytest.raises(ValueError):
        linalg.unvec(v, 5, 5)


def test_kron_matvec_equals_dense():
    A, B = randn(4, 3, seed=1), randn(5, 2, seed=2)
    K = torch.kron(A, B)
    x = randn(6, seed=3)
    X = randn(6, 7, seed=4)
    assert torch.allclose(linalg.kron_matvec(A, B, x), K @ x, atol=1e-12)
    assert torch.allclose(linalg.kron_matvec(A, B, X), K @ X, atol=1e-12)
    A2, B2 = randn(4, 3, seed=5), randn(5, 2, seed=6)
    assert torch.allclose(linalg.kron_sum_matvec([A, A2], [B, B2], X), (K + torch.kron(A2, B2)) @ X, atol=1e-12)
    xs = randn(2, 3, 6, seed=7)
    assert torch.allclose(linalg.kron_rowmajor_apply(A, B, xs), xs @ K.T, atol=1e-12)
    with pytest.raises(ValueError):
        linalg.kron_matvec(A, B, randn(5))
    with pytest.raises(ValueError):
        linalg.kron_sum_matvec([A], [], X)


def test_nearest_kronecker_exact_and_optimal():
    A, B = randn(3, 4, seed=1), randn(2, 5, seed=2)
    M = torch.kron(A, B)
    a, b = linalg.nearest_kronecker(M, (3, 4), (2, 5))
    assert a.shape == (1, 3, 4) and b.shape == (1, 2, 5)
    assert torch.allclose(torch.kron(a[0], b[0]), M, atol=1e-12)
    # sum of two Kronecker products is recovered with terms=2
    M2 = M + torch.kron(randn(3, 4, seed=3), randn(2, 5, seed=4))
    a, b = linalg.nearest_kronecker(M2, (3, 4), (2, 5), terms=2)
    assert torch.allclose(torch.kron(a[0], b[0]) + torch.kron(a[1], b[1]), M2, atol=1e-11)
    # for a generic matrix the error equals the rearrangement's tail and beats random candidates
    G = randn(6, 20, seed=5)
    a, b = linalg.nearest_kronecker(G, (3, 4), (2, 5))
    err = float(torch.linalg.matrix_norm(G - torch.kron(a[0], b[0])))
    s = torch.linalg.svdvals(linalg.kron_rearrange(G, (3, 4), (2, 5)))
    assert err == pytest.approx(float((s[1:] ** 2).sum().sqrt()), rel=1e-10)
    g = gen(0)
    for _ in range(20):
        c = a[0] + 0.05 * torch.randn(3, 4, generator=g, dtype=D)
        d = b[0] + 0.05 * torch.randn(2, 5, generator=g, dtype=D)
        assert float(torch.linalg.matrix_norm(G - torch.kron(c, d))) >= err - 1e-12


def test_nearest_kronecker_of_psd_fisher_is_psd():
    P = randn(4, 4, seed=1)
    P = P @ P.T
    Q = randn(3, 3, seed=2)
    Q = Q @ Q.T
    a, b = linalg.nearest_kronecker(torch.kron(P, Q), (4, 4), (3, 3))
    assert torch.linalg.eigvalsh(a[0]).min() > 0 and torch.linalg.eigvalsh(b[0]).min() > 0
    with pytest.raises(ValueError, match="shape"):
        linalg.kron_rearrange(torch.zeros(5, 5), (2, 2), (2, 2))
    with pytest.raises(ValueError, match="terms"):
        linalg.nearest_kronecker(torch.kron(P, Q), (4, 4), (3, 3), terms=10)
