"""GFWSVD: the correctness checks and bad inputs of shared/methods/gfwsvd.md."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rankwise.compress import gfwsvd as gf
from rankwise.compress.gfwsvd import fisher as gff
from rankwise.core.errors import NumericalError
from rankwise.core.stats import CalibrationError, collect

D = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grads(S=40, m=6, n=5, seed=0):
    """Per-sample gradients with correlated rows and columns (a non-trivial Fisher)."""
    g = gen(seed)
    L = torch.randn(m, m, generator=g, dtype=D) / math.sqrt(m) + torch.eye(m, dtype=D)
    R = torch.randn(n, n, generator=g, dtype=D) / math.sqrt(n) + torch.eye(n, dtype=D)
    return L @ torch.randn(S, m, n, generator=g, dtype=D) @ R.T + 0.3 * torch.randn(S, m, n, generator=g, dtype=D)


def rel(a, b):
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


# ---------------------------------------------------------------- MFF


@pytest.mark.parametrize("seed", [0, 1])
def test_mff_matches_explicit_nearest_kronecker(seed):
    G = grads(seed=seed)  # m n = 30 <= 400: F is 30 x 30
    F = gf.explicit_fisher(G)
    P_ref, Q_ref = gf.nearest_kronecker_fisher(F, 6, 5)
    kf = gf.mff_from_gradients(G, iters=500, tol=1e-13)
    assert kf.converged
    assert rel(kf.kron(), torch.kron(P_ref, Q_ref)) < 1e-4
    # and it is the best Kronecker approximation: its error is the rearranged matrix's tail
    R = torch.linalg.svdvals(gf.explicit_fisher(G).reshape(5, 6, 5, 6).permute(0, 2, 1, 3).reshape(25, 36))
    err = float(torch.linalg.matrix_norm(F - kf.kron()) ** 2)
    assert err == pytest.approx(float((R[1:] ** 2).sum()), rel=1e-6)
    assert kf.sigma == pytest.approx(float(R[0]), rel=1e-8)


def test_explicit_fisher_uses_column_stacking():
    G = grads(S=3, m=3, n=2, seed=3)
    F = gf.explicit_fisher(G)
    i, j, k, l = 2, 1, 0, 1  # F[(j m + i), (l m + k)] = mean_s G_s[i, j] G_s[k, l]
    assert float(F[j * 3 + i, l * 3 + k]) == pytest.approx(float((G[:, i, j] * G[:, k, l]).mean()))


def test_kronecker_exact_fisher_is_reproduced():
    g = gen(4)
    S, m, n = 25, 5, 4
    v = torch.randn(n, generator=g, dtype=D)
    u = torch.randn(S, m, generator=g, dtype=D)
    G = u[:, :, None] * v[None, None, :]  # G_s = u_s v^T
    kf = gf.mff_from_gradients(G, iters=10)
    torch.testing.assert_close(kf.kron(), gf.explicit_fisher(G), rtol=1e-10, atol=1e-12)
    assert kf.converged and kf.iters <= 3


def test_factors_symmetric_psd_and_invariant_to_loss_scale():
    G = grads(S=30, m=7, n=6, seed=5)
    a = gf.mff_from_gradients(G, iters=10)
    b = gf.mff_from_gradients(3.0 * G, iters=10)
    for kf in (a, b):
        for M in (kf.P, kf.Q):
            torch.testing.assert_close(M, M.T, rtol=0, atol=0)
            assert float(torch.linalg.eigvalsh(M).min()) >= -1e-10 * float(torch.linalg.eigvalsh(M).max())
    torch.testing.assert_close(a.P, b.P, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(9.0 * a.Q, b.Q, rtol=1e-12, atol=1e-12)
    W = torch.randn(7, 6, generator=gen(6), dtype=D)
    torch.testing.assert_close(gf.gfwsvd_factors(W, a.P, a.Q, 3).product(), gf.gfwsvd_factors(W, b.P, b.Q, 3).product(),
                               rtol=1e-9, atol=1e-12)


def test_token_factors_equal_explicit_gradients():
    """G_s^T Q G_s computed as X_s^T (D_s Q D_s^T) X_s equals the explicit product."""
    g = gen(7)
    B, T, n, m = 4, 6, 5, 3
    X = torch.randn(B, T, n, generator=g, dtype=D)
    Dg = torch.randn(B, T, m, generator=g, dtype=D)
    sf = gf.SampleFactors(n, m)
    sf.add(X[:2], Dg[:2])
    sf.add(X[2:], Dg[2:])
    G = Dg.mT @ X  # (B, m, n)
    Q = torch.randn(m, m, generator=g, dtype=D)
    P = torch.randn(n, n, generator=g, dtype=D)
    torch.testing.assert_close(sf.p_step(Q), (G.mT @ Q @ G).sum(0))
    torch.testing.assert_close(sf.q_step(P), (G @ P @ G.mT).sum(0))
    torch.testing.assert_close(sf.row_fisher(), G.square().sum((0, 2)))
    assert sf.samples == 4 and sf.tokens == 24


# ---------------------------------------------------------------- closed form


def objective(W, Wr, P, Q):
    return gf.gfwsvd_objective(W, Wr, P, Q, damping=1e-4)


def test_closed_form_beats_random_candidates_and_plain_svd():
    G = grads(S=50, m=8, n=7, seed=8)
    kf = gf.mff_from_gradients(G, iters=20)
    W = torch.randn(8, 7, generator=gen(9), dtype=D)
    r = 3
    f = gf.gfwsvd_factors(W, kf.P, kf.Q, r)
    best = objective(W, f.product(), kf.P, kf.Q)
    g = gen(10)
    for i in range(500):
        eps = 10.0 ** (-3 + 3 * i / 500)
        A = f.A + eps * f.A.norm() * torch.randn(8, r, generator=g, dtype=D) / math.sqrt(8 * r)
        B = f.B + eps * f.B.norm() * torch.randn(r, 7, generator=g, dtype=D) / math.sqrt(7 * r)
        assert objective(W, A @ B, kf.P, kf.Q) >= best * (1 - 1e-12)
    U, s, Vh = torch.linalg.svd(W)
    assert objective(W, U[:, :r] * s[:r] @ Vh[:r], kf.P, kf.Q) > best


def test_identity_factors_equal_plain_svd():
    W = torch.randn(9, 6, generator=gen(11), dtype=D)
    f = gf.gfwsvd_factors(W, torch.eye(6, dtype=D), torch.eye(9, dtype=D), 4)
    U, s, Vh = torch.linalg.svd(W)
    torch.testing.assert_close(f.product(), U[:, :4] * s[:4] @ Vh[:4], rtol=1e-10, atol=1e-12)


def test_diagonal_row_fisher_equals_fwsvd():
    g = gen(12)
    W = torch.randn(9, 6, generator=g, dtype=D)
    fw = torch.rand(9, generator=g, dtype=D) + 0.1
    f = gf.gfwsvd_factors(W, torch.eye(6, dtype=D), torch.diag(fw), 3, damping=0.0)
    Dm = torch.diag(fw.sqrt())
    U, s, Vh = torch.linalg.svd(Dm @ W)
    ref = torch.diag(1 / fw.sqrt()) @ (U[:, :3] * s[:3] @ Vh[:3])
    torch.testing.assert_close(f.product(), ref, rtol=1e-10, atol=1e-12)


def test_input_covariance_with_identity_q_equals_svd_llm():
    g = gen(13)
    W = torch.randn(7, 8, generator=g, dtype=D)
    X = torch.randn(50, 8, generator=g, dtype=D) @ (torch.eye(8, dtype=D) + 0.5 * torch.randn(8, 8, generator=g, dtype=D))
    H = X.T @ X
    f = gf.gfwsvd_factors(W, H, torch.eye(7, dtype=D), 3, damping=0.0)
    S = torch.linalg.cholesky(H)
    U, s, Vh = torch.linalg.svd(W @ S)
    ref = torch.linalg.solve_triangular(S, U[:, :3] * s[:3] @ Vh[:3], upper=False, left=False)
    torch.testing.assert_close(f.product(), ref, rtol=1e-9, atol=1e-11)


def test_full_rank_reproduces_w_and_objective_non_increasing_in_rank():
    G = grads(S=40, m=6, n=5, seed=14)
    kf = gf.mff_from_gradients(G)
    W = torch.randn(6, 5, generator=gen(15), dtype=D)
    torch.testing.assert_close(gf.gfwsvd_factors(W, kf.P, kf.Q, 5).product(), W, rtol=1e-10, atol=1e-10)
    vals = [objective(W, gf.gfwsvd_factors(W, kf.P, kf.Q, r).product(), kf.P, kf.Q) for r in range(1, 6)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(vals, vals[1:]))
    assert vals[-1] < 1e-8 * vals[0]


def test_predicted_loss_increase_is_the_quadratic_form():
    G = grads(S=20, m=4, n=3, seed=16)
    kf = gf.mff_from_gradients(G)
    dW = torch.randn(4, 3, generator=gen(17), dtype=D)
    lam_p = 1e-4 * float(torch.diagonal(kf.P).mean())
    lam_q = 1e-4 * float(torch.diagonal(kf.Q).mean())
    Fk = torch.kron(kf.P + lam_p * torch.eye(3, dtype=D), kf.Q + lam_q * torch.eye(4, dtype=D))
    v = dW.T.reshape(-1)
    assert gf.predicted_loss_increase(dW, kf.P, kf.Q) == pytest.approx(0.5 * float(v @ Fk @ v), rel=1e-10)
    wh = gf.kronecker_whiteners(kf.P, kf.Q)
    assert gf.predicted_loss_increase(dW, whiteners=wh) == pytest.approx(0.5 * float(v @ Fk @ v), rel=1e-10)
    with pytest.raises(ValueError, match="whiteners"):
        gf.predicted_loss_increase(dW)


def test_gfwsvd_rank():
    assert gf.gfwsvd_rank(384, 1536, 0.3) == math.floor(0.3 * 384 * 1536 / 1920)
    assert gf.gfwsvd_rank(384, 1536, 0.3, rank_multiple=8) % 8 == 0
    assert gf.gfwsvd_rank(4, 4, 0.01) == 1
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="param_ratio"):
            gf.gfwsvd_rank(4, 4, bad)


# ---------------------------------------------------------------- per-sample gradients from hooks


class Tiny(nn.Module):
    def __init__(self, n=5, h=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(n, h)
        self.fc2 = nn.Linear(h, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batches(seed=0, n_batches=3, B=4, T=5):
    g = gen(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(B, T, 5, generator=g)
        y = torch.randn(B, T, 3, generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T - 2:] = 0
        out.append({"x": x, "y": y, "attention_mask": mask})
    return out


def fwd(model, b):
    return model(b["x"])


def loss_fn(out, b):  # a sum of per-sequence losses over non-padding tokens
    m = b["attention_mask"].unsqueeze(-1).to(out.dtype)
    return (((out - b["y"]) ** 2) * m).sum()


def per_sample_grads(model, bs, name):
    mod = dict(model.named_modules())[name]
    out = []
    for b in bs:
        for i in range(b["x"].shape[0]):
            one = {k: v[i:i + 1] for k, v in b.items()}
            model.zero_grad()
            loss_fn(fwd(model, one), one).backward()
            out.append(mod.weight.grad.detach().double().clone())
    return torch.stack(out)


def test_hook_per_sample_gradients_match_autograd_and_model_is_untouched():
    model = Tiny()
    bs = batches()
    cfg = gf.GFWSVDConfig(power_iters=50, tol=1e-12, targets=("fc1", "fc2"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    fac = gf.collect_kronecker_fisher(model, bs, loss_fn, cfg, forward=fwd)
    model.requires_grad_(True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    assert list(fac) == ["fc1", "fc2"]
    for name in ("fc1", "fc2"):
        G = per_sample_grads(model, bs, name)
        ref = gf.mff_from_gradients(G, iters=50, tol=1e-12)
        assert fac[name].samples == 12
        assert rel(fac[name].kron(), ref.kron()) < 1e-5
        torch.testing.assert_close(fac[name].row_fisher, G.square().sum(2).mean(0), rtol=1e-5, atol=1e-8)


def test_row_fisher_equals_core_stats_per_sample_fisher():
    model = Tiny()
    bs = batches(seed=1)
    fac = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(targets=("fc1",)), forward=fwd)
    st = collect(model, bs, "fc1", kinds=("fisher_diag",), forward=fwd, loss_fn=loss_fn, fisher="sample")["fc1"]
    torch.testing.assert_close(fac["fc1"].row_fisher, st.fisher_rows(), rtol=1e-6, atol=1e-10)


def test_recompute_storage_and_layer_groups_equal_token_storage():
    model = Tiny()
    bs = batches(seed=2)
    base = dict(power_iters=6, tol=0.0, targets=("fc1", "fc2"))
    a = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(**base), forward=fwd)
    b = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(storage="recompute", **base), forward=fwd)
    c = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(layers_per_pass=1, **base), forward=fwd)
    d = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(compute_dtype=torch.float32, **base), forward=fwd)
    for k in ("fc1", "fc2"):
        assert rel(d[k].kron(), a[k].kron()) < 1e-4
        for other in (b, c):
            torch.testing.assert_close(a[k].P, other[k].P, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(a[k].Q, other[k].Q, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(a[k].row_fisher, other[k].row_fisher, rtol=1e-10, atol=1e-12)
        assert a[k].iters == 6


def test_kfac_ablation_equals_core_stats_kfac():
    model = Tiny()
    bs = batches(seed=3)
    fac = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(approximation="kfac", targets=("fc2",)), forward=fwd)
    st = collect(model, bs, "fc2", kinds=("kfac",), forward=fwd, loss_fn=loss_fn)["fc2"]
    A, Gm = st.kfac_factors()
    torch.testing.assert_close(fac["fc2"].P, A, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(fac["fc2"].Q, Gm, rtol=1e-6, atol=1e-9)
    assert fac["fc2"].kind == "kfac"


def test_shared_pass_samples_give_the_same_factors_and_statistics():
    """One backward pass (collect_sample_factors) serves GFWSVD, K-FAC, FWSVD's row Fisher and the input statistics."""
    model = Tiny()
    bs = batches(seed=4)
    cfg = gf.GFWSVDConfig(power_iters=6, tol=0.0, targets=("fc1", "fc2"))
    samples = gf.collect_sample_factors(model, bs, loss_fn, target=["fc1", "fc2"], forward=fwd)
    assert list(samples) == ["fc1", "fc2"] and all(s.samples == 12 for s in samples.values())
    a = gf.collect_kronecker_fisher(model, bs, loss_fn, cfg, forward=fwd)
    b = gf.factors_from_samples(samples, cfg)
    k = gf.factors_from_samples(samples, gf.GFWSVDConfig(approximation="kfac"), row_fisher=False)
    kref = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(approximation="kfac", targets=("fc1", "fc2")),
                                       forward=fwd)
    st = gf.layer_stats_from_samples(samples)
    ref = collect(model, bs, ["fc1", "fc2"], kinds=("input_cov", "input_abs_mean"), forward=fwd)
    for name in ("fc1", "fc2"):
        torch.testing.assert_close(a[name].P, b[name].P, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a[name].Q, b[name].Q, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a[name].row_fisher, b[name].row_fisher, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(k[name].P, kref[name].P, rtol=1e-10, atol=1e-12)
        assert k[name].row_fisher is None
        # every non-padding token gets a gradient here, so the kept tokens are exactly the masked tokens
        assert st[name].n_tokens == ref[name].n_tokens == samples[name].tokens
        torch.testing.assert_close(st[name].input_cov(), ref[name].input_cov(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(st[name].input_abs_mean(), ref[name].input_abs_mean(), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="empty"):
        gf.factors_from_samples({})
    with pytest.raises(TypeError, match="SampleFactors"):
        gf.factors_from_samples({"fc1": a["fc1"]})
    with pytest.raises(CalibrationError, match="empty"):
        gf.collect_sample_factors(model, [], loss_fn, target=["fc1"], forward=fwd)


def test_fwsvd_from_shared_row_fisher_equals_pipeline_fwsvd():
    """FWSVD(fisher='sample') fitted from the shared pass's row Fisher = the pipeline's FWSVD with its own pass."""
    import copy

    from rankwise.compress.base import uniform_rank
    from rankwise.compress.pipeline import CompressConfig, compress
    from rankwise.compress.svd_baselines import fwsvd_factors

    model = Tiny(n=5, h=6)
    bs = batches(seed=5)
    fac = gf.collect_kronecker_fisher(model, bs, loss_fn, gf.GFWSVDConfig(targets=("fc1",)), forward=fwd)
    ref = copy.deepcopy(model)
    compress(ref, CompressConfig(method="fwsvd", ratio=0.5, options={"fisher": "sample"}), bs, target=["fc1"],
             mode="whole", forward=fwd, loss_fn=loss_fn)
    m, n = model.fc1.weight.shape
    f = fwsvd_factors(model.fc1.weight, fac["fc1"].row_fisher, uniform_rank(m, n, 0.5))
    torch.testing.assert_close(f.product().float(), ref.fc1.to_dense(), rtol=1e-5, atol=1e-6)


def test_mff_iterates_with_diagonal_start_and_bucketed_blocks_match_explicit_gradients():
    """Ragged samples (lengths 1..20, several buckets) through the token factors = explicit per-sample gradients."""
    g = gen(7)
    m, n, lengths = 6, 5, [1, 20, 3, 7, 7, 12, 2, 9, 15, 4, 11, 5, 8, 6, 19, 10, 13]
    sf = gf.SampleFactors(n, m)
    Gs = []
    for T in lengths:
        X = torch.randn(1, T, n, generator=g, dtype=D)
        Dg = torch.randn(1, T, m, generator=g, dtype=D)
        sf.add(X, Dg)
        Gs.append(Dg[0].mT @ X[0])
    G = torch.stack(Gs)
    Q = torch.randn(m, m, generator=g, dtype=D)
    Q = Q @ Q.mT
    torch.testing.assert_close(sf.p_step(Q), torch.einsum("smn,mk,skl->nl", G, Q, G), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sf.p_step(torch.eye(m, dtype=D) * 0.5), 0.5 * torch.einsum("smn,sml->nl", G, G),
                               rtol=1e-10, atol=1e-10)
    P = torch.randn(n, n, generator=g, dtype=D)
    P = P @ P.mT
    torch.testing.assert_close(sf.q_step(P), torch.einsum("smn,nk,slk->ml", G, P, G), rtol=1e-10, atol=1e-10)
    ref = gf.mff_from_gradients(G, iters=30, tol=0.0)
    got = gf.mff(sf, iters=30, tol=0.0)
    assert rel(got.kron(), ref.kron()) < 1e-8


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_space_mff_equals_explicit_iteration(dtype):
    """Few tokens on wide layers: MFF iterated on the per-sample token blocks = the explicit half-steps."""
    g = gen(11)
    m, n, lengths = 30, 25, [1, 20, 3, 7, 7, 12, 2, 9, 15, 4, 11, 5, 8, 6, 19, 10, 13]
    sf = gf.SampleFactors(n, m, compute_dtype=dtype)
    mix = torch.randn(m, m, generator=g, dtype=D)
    for i in range(0, len(lengths), 5):
        ls = lengths[i:i + 5]
        X = torch.randn(len(ls), max(ls), n, generator=g, dtype=D)
        Dg = torch.randn(len(ls), max(ls), m, generator=g, dtype=D) @ mix
        for j, L in enumerate(ls):
            Dg[j, L:] = 0  # padding: no gradient
        sf.add(X, Dg)
    tol_close = 1e-12 if dtype == torch.float64 else 1e-5
    for iters, tol in ((3, 0.0), (200, 1e-6), (200, 1e-9)):
        ref = gff._mff(gff._StoredOperator({"l": sf}), {"l": (m, n)}, {"l": sf.samples}, iters, tol)["l"]
        got = gff._mff_token_space(sf, iters, tol, name="l")
        assert rel(got.P, ref.P) < tol_close and rel(got.Q, ref.Q) < tol_close
        assert abs(got.sigma - ref.sigma) < tol_close * ref.sigma
        assert abs(float(torch.linalg.matrix_norm(got.P)) - 1.0) < 1e-12
        if dtype == torch.float64:
            assert (got.iters, got.converged) == (ref.iters, ref.converged)
    # the dispatcher picks the token space only where it is clearly cheaper
    explicit, token = gff._token_space_cost(sf, 10)
    assert gff._use_token_space(sf, 10) == (token < 0.5 * explicit)
    wide = gf.SampleFactors(200, 300)
    wide.add(torch.randn(2, 6, 200, generator=g, dtype=D), torch.randn(2, 6, 300, generator=g, dtype=D))
    assert gff._use_token_space(wide, 5)
    kf = gf.mff(wide, iters=5, tol=0.0)
    ref = gff._mff(gff._StoredOperator({"w": wide}), {"w": (300, 200)}, {"w": 2}, 5, 0.0)["w"]
    assert rel(kf.P, ref.P) < 1e-10 and rel(kf.Q, ref.Q) < 1e-10
    zero = gf.SampleFactors(200, 300)
    zero.add(torch.randn(2, 6, 200, generator=g, dtype=D), torch.zeros(2, 6, 300, dtype=D))
    with pytest.raises(CalibrationError, match="zero"):
        gf.mff(zero, iters=3)


# ---------------------------------------------------------------- bad input


def test_layer_without_gradient_is_named():
    with pytest.raises(CalibrationError, match="unused"):
        gf.collect_kronecker_fisher(Tiny(), batches(), loss_fn, gf.GFWSVDConfig(targets=("fc1", "unused")), forward=fwd)


def test_all_zero_gradients_explain_that_a_task_loss_is_needed():
    model = Tiny()
    with pytest.raises(CalibrationError, match="task loss"):
        gf.collect_kronecker_fisher(model, batches(), lambda out, b: (out * 0).sum(), gf.GFWSVDConfig(targets=("fc1",)),
                                    forward=fwd)


def test_nan_gradients_and_empty_data():
    model = Tiny()
    with pytest.raises(NumericalError):
        gf.collect_kronecker_fisher(model, batches(), lambda out, b: (out * float("nan")).sum(),
                                    gf.GFWSVDConfig(targets=("fc1",)), forward=fwd)
    bad = batches()
    bad[1]["x"][0, 0, 0] = float("inf")
    with pytest.raises(NumericalError):
        gf.collect_kronecker_fisher(model, bad, loss_fn, gf.GFWSVDConfig(targets=("fc1",)), forward=fwd)
    with pytest.raises(CalibrationError, match="empty"):
        gf.collect_kronecker_fisher(model, [], loss_fn, gf.GFWSVDConfig(targets=("fc1",)), forward=fwd)
    with pytest.raises(ValueError, match="re-iterable"):
        gf.collect_kronecker_fisher(model, iter(batches()), loss_fn,
                                    gf.GFWSVDConfig(storage="recompute", targets=("fc1",)), forward=fwd)


def test_single_sample_warns():
    model = Tiny()
    one = [{k: v[:1] for k, v in batches()[0].items()}]
    with pytest.warns(RuntimeWarning, match="rank-deficient") as caught:
        fac = gf.collect_kronecker_fisher(model, one, loss_fn, gf.GFWSVDConfig(targets=("fc1",)), forward=fwd)
    assert any("rank-deficient" in str(w.message) for w in caught)
    assert set(fac) == {"fc1"}  # the factors are still returned


def test_bad_rank_and_non_pd_factors():
    W = torch.randn(4, 3, dtype=D)
    P, Q = torch.eye(3, dtype=D), torch.eye(4, dtype=D)
    for r in (0, 4, -2):
        with pytest.raises(ValueError, match="rank"):
            gf.gfwsvd_factors(W, P, Q, r)
    negP = torch.diag(torch.tensor([1.0, -50.0, -50.0], dtype=D))  # not PSD; no damping can fix it
    with pytest.raises(NumericalError, match="input-side.*fc9"):
        gf.gfwsvd_factors(W, negP, Q, 2, name="fc9")
    with pytest.raises(ValueError, match="need P"):
        gf.gfwsvd_factors(W, Q, P, 2)


@pytest.mark.parametrize("kw,field", [
    (dict(param_ratio=0.0), "param_ratio"), (dict(param_ratio=1.2), "param_ratio"),
    (dict(power_iters=0), "power_iters"), (dict(damping=-1.0), "damping"), (dict(damping=float("nan")), "damping"),
    (dict(rank_multiple=0), "rank_multiple"), (dict(approximation="diag"), "approximation"), (dict(storage="disk"), "storage"),
    (dict(layers_per_pass=0), "layers_per_pass"), (dict(targets=()), "targets"),
])
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        gf.GFWSVDConfig(**kw)


def test_save_and_load_factors_round_trip(tmp_path):
    pytest.importorskip("rankwise.core.io")
    model = Tiny()
    fac = gf.collect_kronecker_fisher(model, batches(), loss_fn, gf.GFWSVDConfig(targets=("fc1", "fc2")), forward=fwd)
    path = gf.save_factors(fac, tmp_path / "kron.safetensors")
    back = gf.load_factors(path)
    assert list(back) == list(fac)
    for k in fac:
        assert torch.equal(back[k].P, fac[k].P) and torch.equal(back[k].Q, fac[k].Q)
        assert torch.equal(back[k].row_fisher, fac[k].row_fisher)
        assert back[k].samples == fac[k].samples and back[k].iters == fac[k].iters


# ---------------------------------------------------------------- through the shared pipeline


def _bert(seed: int = 0, layers: int = 2):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    return BertModel(cfg).eval()


def _text_batches(n=3, seed=0):
    g = gen(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        am = torch.ones(4, 8, dtype=torch.long)
        am[2, 6:] = 0
        out.append({"input_ids": ids, "attention_mask": am, "target": torch.randn(4, 16, generator=g)})
    return out


def _bert_forward(model, b):
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state


def _bert_loss(h, b):  # per-sequence regression of the mean-pooled state (a sum over sequences)
    m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
    pooled = (h * m).sum(1) / m.sum(1)
    return ((pooled - b["target"]) ** 2).sum()


def test_pipeline_gfwsvd_matches_direct_factors_and_reports():
    from rankwise.compress.pipeline import CompressConfig, compress
    from rankwise.core.layers import LowRankLinear

    bs = _text_batches()
    cfg = gf.GFWSVDConfig(param_ratio=0.5, power_iters=5)
    a = _bert()
    rep = compress(a, cfg, bs, forward=_bert_forward, loss_fn=_bert_loss)
    assert rep.method == "gfwsvd" and len(rep.layers) == 12
    assert all(isinstance(l.info["predicted_loss_increase"], float) and l.rel_error is not None for l in rep.layers)
    # the same through collect_kronecker_fisher + gfwsvd_compress(model, factors, cfg)
    b = _bert()
    fac = gf.collect_kronecker_fisher(b, bs, _bert_loss, cfg, forward=_bert_forward,
                                      target=lambda n, m: isinstance(m, nn.Linear) and ".layer." in n)
    rep2 = compress(b, cfg, prepared=fac, target=list(fac))
    assert rep2.ranks == rep.ranks and all(l.rel_error is None for l in rep2.layers)  # no data, no error report
    for (na, ma), (nb, mb) in zip(a.named_modules(), b.named_modules()):
        assert na == nb
        if isinstance(ma, LowRankLinear):
            torch.testing.assert_close(ma.to_dense(), mb.to_dense(), rtol=1e-5, atol=1e-7)
    # the deprecated gfwsvd_compress: the factor path goes through the same pipeline, bit for bit
    d = _bert()
    with pytest.warns(DeprecationWarning, match="gfwsvd_compress"):
        rep4 = gf.gfwsvd_compress(d, fac, cfg)
    assert rep4.ranks == rep.ranks and rep4.extra["mode"] == "whole"
    assert all(torch.equal(x, y) for x, y in zip(b.state_dict().values(), d.state_dict().values()))
    # and with calibration data, at an explicit per-layer rank map
    c = _bert()
    ranks = {n: 3 for n in rep.ranks}
    with pytest.warns(DeprecationWarning):
        rep3 = gf.gfwsvd_compress(c, bs, cfg, loss_fn=_bert_loss, forward=_bert_forward, ranks=ranks)
    assert set(rep3.ranks.values()) == {3}
    with pytest.raises(TypeError, match="KroneckerFactors"):
        compress(_bert(), cfg, prepared={"x": 1}, target=list(fac))


def test_gfwsvd_reuses_factors_across_ratios_and_rank_multiple():
    bs = _text_batches(seed=1)
    m0 = _bert()
    fac = gf.collect_kronecker_fisher(m0, bs, _bert_loss, gf.GFWSVDConfig(), forward=_bert_forward,
                                      target="re:.*intermediate\\.dense")
    for ratio in (0.3, 0.6):
        m = _bert()
        rep = gf.gfwsvd_compress(m, fac, gf.GFWSVDConfig(param_ratio=ratio))
        assert all(r == gf.gfwsvd_rank(32, 16, ratio) for r in rep.ranks.values())
    rep = gf.gfwsvd_compress(_bert(), fac, gf.GFWSVDConfig(param_ratio=0.9, rank_multiple=4))
    assert all(r % 4 == 0 for r in rep.ranks.values())


def test_gfwsvd_pipeline_bad_inputs_leave_model_unchanged():
    from rankwise.compress.pipeline import CompressConfig, compress

    model = _bert(layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="loss"):
        compress(model, CompressConfig(method="gfwsvd", ratio=0.5), _text_batches(), forward=_bert_forward)
    with pytest.raises(CalibrationError, match="task loss"):
        compress(model, CompressConfig(method="gfwsvd", ratio=0.5), _text_batches(), forward=_bert_forward,
                 loss_fn=lambda h, b: (h * 0).sum())
    with pytest.raises(TypeError, match="unknown GFWSVD option"):
        compress(model, CompressConfig(method="gfwsvd", ratio=0.5, options={"beta": 1}), _text_batches())
    with pytest.raises(ValueError, match="empty"):
        gf.gfwsvd_compress(model, {}, gf.GFWSVDConfig())
    with pytest.raises(ValueError, match="does not have"):
        gf.gfwsvd_compress(model, {"nope": gf.KroneckerFactors(torch.eye(2), torch.eye(2))}, gf.GFWSVDConfig())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m).__name__ != "LowRankLinear" for m in model.modules())


def test_registry_entry():
    from rankwise.core.registry import get

    from rankwise.compress import compress

    e = get("gfwsvd")
    assert e.config is gf.GFWSVDConfig and e.entry is compress
    d = gf.GFWSVDConfig()
    assert (d.power_iters, d.tol, d.damping, d.rank_multiple, d.approximation) == (10, 1e-6, 1e-4, 1, "mff")
