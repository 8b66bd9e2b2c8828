"""SAES-SVD: the correctness checks and bad inputs of shared/methods/saes_svd.md."""

from __future__ import annotations

import copy

import math

import pytest
import torch

from rankwise.compress import saes_svd as saes
from rankwise.compress.saes_svd import cealc as saes_cealc
from rankwise.core.errors import NumericalError

D = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def problem(m=12, n=10, N=80, seed=0, drift=0.3):
    """Random W, X (compressed-upstream inputs) and X_f (FP inputs), columns = tokens, correlated inputs."""
    g = gen(seed)
    W = torch.randn(m, n, generator=g, dtype=D)
    mix = torch.randn(n, n, generator=g, dtype=D) / math.sqrt(n) + torch.eye(n, dtype=D)
    X_f = mix @ torch.randn(n, N, generator=g, dtype=D)
    X = X_f + drift * torch.randn(n, N, generator=g, dtype=D)
    return W, X, X_f


def stats(X, X_f):
    return X @ X.T, (X_f - X) @ X.T


def svdllm(W, H, rank, lam):
    """SVD-LLM(W) on H: [W S]_r S^{-1} with S S^T = H + lam I (reference written independently)."""
    S = torch.linalg.cholesky(H + lam * torch.eye(H.shape[0], dtype=D))
    U, s, Vh = torch.linalg.svd(W @ S)
    Wr = U[:, :rank] @ torch.diag(s[:rank]) @ Vh[:rank]
    return torch.linalg.solve_triangular(S, Wr, upper=False, left=False)


# ---------------------------------------------------------------- CEALC closed form


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.9])
def test_delta_zero_equals_svd_llm_for_any_beta(beta):
    W, X, _ = problem(seed=1)
    H = X @ X.T
    f = saes.cealc_factors(W, H, torch.zeros_like(H), beta, 4)
    lam = 1e-6 * float(torch.diagonal(H).mean())
    ref = svdllm(W, H, 4, lam)
    torch.testing.assert_close(f.product(), ref, rtol=1e-8, atol=1e-10)
    # X == X_f gives Delta = 0 through the statistics as well
    H2, Dl = stats(X, X)
    assert float(Dl.abs().max()) == 0.0
    torch.testing.assert_close(saes.cealc_factors(W, H2, Dl, beta, 4).product(), ref, rtol=1e-8, atol=1e-10)


def test_beta_zero_is_sequential_svd_llm_even_with_drift():
    W, X, X_f = problem(seed=2)
    H, Dl = stats(X, X_f)
    lam = 1e-6 * float(torch.diagonal(H).mean())
    torch.testing.assert_close(saes.cealc_factors(W, H, Dl, 0.0, 5).product(), svdllm(W, H, 5, lam),
                               rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8])
def test_cholesky_and_symmetric_whiteners_agree(beta):
    W, X, X_f = problem(seed=3)
    H, Dl = stats(X, X_f)
    a = saes.cealc_factors(W, H, Dl, beta, 6, whitener="cholesky").product()
    b = saes.cealc_factors(W, H, Dl, beta, 6, whitener="symmetric").product()
    torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_factor_shapes_and_balance():
    W, X, X_f = problem(m=9, n=14, seed=4)
    H, Dl = stats(X, X_f)
    f = saes.cealc_factors(W, H, Dl, 0.4, 3)
    assert f.A.shape == (9, 3) and f.B.shape == (3, 14) and f.A.dtype == D
    G, wh = saes.cealc_target(W, H, Dl, 0.4)
    s = torch.linalg.svdvals(G)[:3]
    # A = U_r Sigma^{1/2}: column norms of A are sqrt(sigma); B S = Sigma^{1/2} V^T has the same row norms
    torch.testing.assert_close(f.A.norm(dim=0), s.sqrt(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close((f.B @ wh.S).norm(dim=1), s.sqrt(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [5, 6])
def test_closed_form_beats_random_rank_r_perturbations(seed):
    m, n, r = 8, 7, 3
    W, X, X_f = problem(m=m, n=n, N=60, seed=seed)
    H, Dl = stats(X, X_f)
    alpha = 0.7
    beta = saes.beta_from_alpha(alpha)
    f = saes.cealc_factors(W, H, Dl, beta, r, ridge=0.0)
    best = saes.cealc_objective(W, f.product(), X, X_f, alpha)
    g = gen(100 + seed)
    worse = 0
    for i in range(300):
        eps = 10.0 ** (-3 + 3 * i / 300)  # perturbation sizes from 1e-3 to 1 (relative)
        A = f.A + eps * f.A.norm() * torch.randn(m, r, generator=g, dtype=D) / math.sqrt(m * r)
        B = f.B + eps * f.B.norm() * torch.randn(r, n, generator=g, dtype=D) / math.sqrt(r * n)
        worse += saes.cealc_objective(W, A @ B, X, X_f, alpha) >= best * (1 - 1e-12)
    assert worse == 300
    # and the plain truncation of W and SVD-LLM (beta = 0) are worse on Eq. 3
    U, s, Vh = torch.linalg.svd(W)
    assert saes.cealc_objective(W, U[:, :r] * s[:r] @ Vh[:r], X, X_f, alpha) > best
    assert saes.cealc_objective(W, saes.cealc_factors(W, H, Dl, 0.0, r, ridge=0.0).product(), X, X_f, alpha) > best


def test_full_rank_beta_zero_reproduces_layer_on_calibration_data():
    W, X, X_f = problem(m=10, n=10, seed=7)
    H, Dl = stats(X, X_f)
    f = saes.cealc_factors(W, H, Dl, 0.0, 10)
    torch.testing.assert_close(f.product() @ X, W @ X, rtol=1e-9, atol=1e-9)


def test_alpha_beta_maps():
    assert saes.beta_from_alpha(1.0) == 0.5
    assert saes.alpha_from_beta(0.5) == pytest.approx(1.0)
    assert saes.beta_interval((0.25, 0.75), "alpha") == pytest.approx((0.2, 3 / 7))
    assert saes.beta_interval((0.25, 0.75), "beta") == (0.25, 0.75)


def test_saes_rank_is_fraction_removed():
    assert saes.saes_rank(384, 384, 0.6) == 76  # the spec's example: keep 40% of 384 x 384
    assert saes.saes_rank(1536, 384, 0.2) == math.floor(0.8 * 1536 * 384 / 1920)
    assert saes.saes_rank(4, 4, 0.999) == 1


# ---------------------------------------------------------------- ACES


def aces_problem(seed=8, m=16, n=12, r=4):
    W, X, X_f = problem(m=m, n=n, N=120, seed=seed, drift=0.6)
    H, Dl = stats(X, X_f)
    G0, wh = saes.cealc_target(W, H, Dl, 0.0)
    G1, _ = saes.cealc_target(W, H, Dl, 0.5)
    S_l, D_l = G0, 2.0 * (G1 - G0)
    return W, H, Dl, S_l, D_l, r


def test_aces_coefficients_match_definition():
    W, H, Dl, S_l, D_l, r = aces_problem()
    coef = saes.aces_coefficients(S_l, D_l, r)
    U, _, Vh = torch.linalg.svd(S_l)
    PL = torch.eye(S_l.shape[0], dtype=D) - U[:, :r] @ U[:, :r].T
    PR = torch.eye(S_l.shape[1], dtype=D) - Vh[:r].T @ Vh[:r]
    Sp, Dp = PL @ S_l @ PR, PL @ D_l @ PR
    assert coef.a == pytest.approx(float((Sp * Sp).sum()), rel=1e-10)
    assert coef.b == pytest.approx(float((Sp * Dp).sum()), rel=1e-8, abs=1e-12)
    assert coef.c == pytest.approx(float((Dp * Dp).sum()), rel=1e-10)
    # the surrogate is exact at beta = 0: the tail ratio of S_l itself
    assert saes.aces_surrogate(coef, 0.0) == pytest.approx(1 - saes.retained_energy_ratio(S_l, r), rel=1e-10)


@pytest.mark.parametrize("seed", [8, 9, 10, 11])
def test_aces_quadratic_roots_and_grid_argmin(seed):
    W, H, Dl, S_l, D_l, r = aces_problem(seed=seed)
    coef = saes.aces_coefficients(S_l, D_l, r)
    q2, q1, q0 = coef.quadratic()
    scale = max(abs(q2), abs(q1), abs(q0))
    for lo, hi in [(0.25, 0.75), (0.0, 0.99), (0.05, 0.4)]:
        res = saes.aces_beta(W, H, Dl, r, bounds=(lo, hi), beta_cap=0.99)
        assert lo <= res.beta <= hi
        for root in res.roots:  # the quadratic of Eq. 19 vanishes at the roots it returns
            assert abs(q2 * root**2 + q1 * root + q0) <= 1e-9 * scale * (1 + root * root)
        grid = torch.linspace(lo, hi, 10001, dtype=D)
        vals = saes.aces_surrogate(coef, grid)
        assert abs(res.beta - float(grid[int(vals.argmin())])) <= 1e-3
        assert res.rho_surrogate <= float(vals.min()) + 1e-12


def test_aces_stationary_points_are_stationary():
    # a hand-made set of coefficients with two interior stationary points
    coef = saes.AcesCoefficients(a=1.0, b=-1.0, c=1.5, A0=4.0, B0=-0.5, C0=3.0)
    roots = saes.aces_stationary_points(coef)
    assert roots
    h = 1e-6
    for r0 in roots:
        d = (saes.aces_surrogate(coef, r0 + h) - saes.aces_surrogate(coef, r0 - h)) / (2 * h)
        assert abs(d) < 1e-6


def test_aces_guardrails_cap_and_shrink():
    W, H, Dl, S_l, D_l, r = aces_problem(seed=9)
    free = saes.aces_beta(W, H, Dl, r, bounds=(0.0, 0.99), beta_cap=0.99)
    capped = saes.aces_beta(W, H, Dl, r, bounds=(0.0, 0.99), beta_cap=0.1)
    assert capped.beta <= 0.1 + 1e-15
    shrunk = saes.aces_beta(W, H, Dl, r, bounds=(0.0, 0.99), beta_cap=0.99, shrink=0.5)
    assert all(c <= 0.99 * 0.5 + 1e-15 for c in shrunk.candidates)
    assert free.beta >= 0.0


def test_aces_delta_zero_returns_lower_bound_without_solving():
    W, X, _ = problem(seed=12)
    H = X @ X.T
    res = saes.aces_beta(W, H, torch.zeros_like(H), 3, bounds=(0.3, 0.6))
    assert res.beta == 0.3 and res.reason == "delta_zero" and res.roots == []


def test_aces_energy_objective_and_c_zero():
    W, H, Dl, S_l, D_l, r = aces_problem(seed=10)
    res = saes.aces_beta(W, H, Dl, r, objective="energy", bounds=(0.0, 0.9), beta_cap=0.95)
    coef = res.coefficients
    assert res.beta == pytest.approx(min(max(-coef.b / coef.c, 0.0), 0.9))
    # c == 0: D lies entirely in the kept subspace of S -> beta_min
    m, n, r = 6, 5, 2
    U = torch.linalg.qr(torch.randn(m, m, generator=gen(1), dtype=D)).Q
    V = torch.linalg.qr(torch.randn(n, n, generator=gen(2), dtype=D)).Q
    S = U[:, :4] @ torch.diag(torch.tensor([5.0, 4.0, 1.0, 0.5], dtype=D)) @ V[:, :4].T
    Dm = U[:, :2] @ V[:, :2].T
    c = saes.aces_coefficients(S, Dm, r)
    assert c.c == pytest.approx(0.0, abs=1e-20)
    beta, *_rest, reason = saes_cealc._aces_pick(c, 0.2, 0.7, 0.95, 1.0, "energy")
    assert beta == 0.2 and reason == "energy_c_zero"


def test_aces_refinement_runs_and_stays_in_interval():
    W, H, Dl, S_l, D_l, r = aces_problem(seed=11)
    res = saes.aces_beta(W, H, Dl, r, refine=True)
    assert res.reason in ("refined", "delta_zero")
    assert 0.25 <= res.beta <= 0.75


def test_aces_picks_good_exact_rer_on_most_random_layers():
    """The FS-FOA choice is never much worse than the interval ends in exact RER (spec secondary claim)."""
    good = 0
    for seed in range(10):
        W, H, Dl, S_l, D_l, r = aces_problem(seed=20 + seed)
        res = saes.aces_beta(W, H, Dl, r)
        rer = lambda b: saes.retained_energy_ratio(S_l + b * D_l, r)  # noqa: E731
        good += rer(res.beta) >= max(rer(0.25), rer(0.75)) - 1e-3
    assert good >= 8


# ---------------------------------------------------------------- streaming statistics (Alg. 1)


@pytest.mark.parametrize("splits", [[80], [1, 79], [13, 27, 40], [40, 40]])
def test_streaming_statistics_equal_one_shot(splits):
    _, X, X_f = problem(n=10, N=80, seed=13)
    acc = saes.PairedAccumulator(10)
    start = 0
    for k in splits:
        acc.update(X[:, start:start + k].T, X_f[:, start:start + k].T)
        start += k
    ps = acc.paired()
    N = 80
    torch.testing.assert_close(ps.H, (2 / N) * X @ X.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ps.Delta, (2 / N) * (X_f - X) @ X.T, rtol=1e-12, atol=1e-12)
    assert ps.tokens == N


def test_streaming_statistics_mask_padding():
    _, X, X_f = problem(n=6, N=20, seed=14)
    x, xf = X.T.reshape(2, 10, 6), X_f.T.reshape(2, 10, 6)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    acc = saes.PairedAccumulator(6)
    acc.update(x, xf, mask)
    keep = mask.reshape(-1).bool()
    Xk, Xfk = X[:, keep], X_f[:, keep]
    torch.testing.assert_close(acc.paired().H, (2 / 17) * Xk @ Xk.T)
    torch.testing.assert_close(acc.paired().Delta, (2 / 17) * (Xfk - Xk) @ Xk.T)


def test_streaming_statistics_reject_mismatched_batches_and_empty():
    acc = saes.PairedAccumulator(4)
    with pytest.raises(ValueError, match="identical batches"):
        acc.update(torch.randn(2, 5, 4), torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match="empty calibration"):
        acc.paired()


# ---------------------------------------------------------------- bad input


def test_bad_ranks_and_ratios():
    W, X, X_f = problem(seed=15)
    H, Dl = stats(X, X_f)
    for r in (0, -1, 11):
        with pytest.raises(ValueError, match="rank"):
            saes.cealc_factors(W, H, Dl, 0.5, r)
    with pytest.raises(TypeError):
        saes.cealc_factors(W, H, Dl, 0.5, 2.0)
    for ratio in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="compression_ratio"):
            saes.saes_rank(10, 10, ratio)


def test_bad_alpha_beta_and_bounds():
    W, X, X_f = problem(seed=16)
    H, Dl = stats(X, X_f)
    for b in (-0.1, 1.0, 2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beta"):
            saes.cealc_factors(W, H, Dl, b, 2)
    for a in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            saes.beta_from_alpha(a)
    with pytest.raises(ValueError, match="lower bound exceeds"):
        saes.aces_beta(W, H, Dl, 2, bounds=(0.7, 0.3))
    with pytest.raises(ValueError, match="beta_cap"):
        saes.aces_beta(W, H, Dl, 2, beta_cap=1.0)
    with pytest.raises(ValueError, match="shrink"):
        saes.aces_beta(W, H, Dl, 2, shrink=0.0)
    with pytest.raises(ValueError, match="aces_objective"):
        saes.aces_beta(W, H, Dl, 2, objective="tail")


def test_non_finite_statistics_and_failed_cholesky_name_the_layer():
    W, X, X_f = problem(seed=17)
    H, Dl = stats(X, X_f)
    Hbad = H.clone()
    Hbad[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="layer 'enc.q'"):
        saes.cealc_factors(W, Hbad, Dl, 0.5, 2, name="enc.q")
    # an indefinite "covariance" cannot be whitened even after all ridge retries
    Hneg = -torch.eye(10, dtype=D)
    Hneg[0, 0] = 100.0
    for wh in ("cholesky", "symmetric"):
        with pytest.raises(NumericalError, match="enc.k"):
            saes.cealc_factors(W, Hneg, Dl, 0.5, 2, name="enc.k", whitener=wh)
    with pytest.raises(ValueError, match="H must be"):
        saes.cealc_factors(W, H[:5, :5], Dl, 0.5, 2)


def test_singular_h_is_rescued_by_ridge():
    W, X, X_f = problem(n=10, N=6, seed=18)  # 6 tokens < 10 features: H is singular
    H, Dl = stats(X, X_f)
    f = saes.cealc_factors(W, H, Dl, 0.5, 3)
    assert torch.isfinite(f.product()).all()
    with pytest.raises(NumericalError):
        saes.cealc_factors(W, H, Dl, 0.5, 3, ridge=0.0)


# ---------------------------------------------------------------- through the shared pipeline


def _bert(seed: int = 0, layers: int = 3):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    return BertModel(cfg).eval()


def _batches(n: int = 3, seed: int = 0, vocab: int = 64):
    g = gen(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (4, 8), generator=g)
        am = torch.ones(4, 8, dtype=torch.long)
        am[1, 5:] = 0
        out.append({"input_ids": ids, "attention_mask": am})
    return out


class _Recorder(saes.SAESMethod):
    """Keeps the paired statistics it was given (for checks of the closed loop)."""

    name = "saes-svd-recorder-test"
    seen: dict = {}

    def fit(self, name, layer, rank, stats=None, paired=None):
        # a shallow copy: the block-sequential runner releases each block's statistics buffers once
        # the block is fitted (compress.calibration.release_stats), the copy keeps the tensors alive
        type(self).seen[name] = copy.copy(paired)
        return super().fit(name, layer, rank, stats, paired)


def test_pipeline_closed_loop_statistics():
    from rankwise.compress.base import register_layer_method
    from rankwise.compress.pipeline import CompressConfig, compress
    from rankwise.core.stats import collect

    from rankwise.compress import base

    model = _bert()
    bs = _batches()
    fp_stats = collect(_bert(), bs, "re:.*layer\\.2\\.attention\\.self\\.query", kinds=("input_cov",))
    _Recorder.seen = {}
    register_layer_method(_Recorder)
    try:
        rep = compress(model, CompressConfig(method=_Recorder.name, ratio=0.5), bs)
    finally:  # keep the test-only method out of the registry other tests iterate over
        base._METHODS.pop(_Recorder.name, None)
    seen = _Recorder.seen
    assert len(seen) == 18 and rep.extra["mode"] == "blocks" and rep.extra["feed"] == "compressed"
    # nothing upstream of block 0's first group is compressed: Delta = 0 there, and ACES returns beta_min
    first = seen["encoder.layer.0.attention.self.query"]
    assert float(first.Delta.abs().max()) == 0.0
    assert rep.layers[0].info["aces_reason"] == "delta_zero" and rep.layers[0].info["beta"] == 0.25
    # block 2's inputs changed because blocks 0-1 were compressed: H != the FP model's X^T X, Delta != 0
    later = seen["encoder.layer.2.attention.self.query"]
    H_fp = fp_stats["encoder.layer.2.attention.self.query"].input_cov(normalized=False)
    assert later.tokens == fp_stats["encoder.layer.2.attention.self.query"].n_tokens == 3 * 29
    assert float((later.H - H_fp).abs().max()) > 1e-4 * float(H_fp.abs().max())
    assert float(later.Delta.abs().max()) > 0
    # every layer's beta lies in the ACES interval and its RER is a ratio
    for l in rep.layers:
        lo, hi = l.info["interval"]
        assert lo <= l.info["beta"] <= hi and 0 < l.info["rer_exact"] <= 1


def test_pipeline_beta_zero_equals_svd_llm_fed_by_the_compressed_model():
    from rankwise.compress.pipeline import CompressConfig, compress

    bs = _batches(seed=1)
    a, b = _bert(), _bert()
    compress(a, saes.SAESConfig(compression_ratio=0.5, beta=0.0), bs)
    compress(b, CompressConfig(method="svd-llm", ratio=0.5, feed="compressed"), bs, mode="blocks")
    for (na, ma), (nb, mb) in zip(a.named_modules(), b.named_modules()):
        if hasattr(ma, "to_dense"):
            torch.testing.assert_close(ma.to_dense(), mb.to_dense(), rtol=1e-4, atol=1e-6)


def test_saes_svd_compress_entry_and_report():
    from rankwise.core.layers import LowRankLinear
    from rankwise.core.registry import get

    model = _bert(layers=2)
    cfg = saes.SAESConfig(compression_ratio=0.5, targets=("query", "value"))
    rep = get("saes_svd").entry(model, cfg, _batches(seed=2))  # compress(model, config, calib)
    assert isinstance(rep, saes.SAESReport)
    assert set(rep.ranks) == {f"encoder.layer.{i}.attention.self.{t}" for i in range(2) for t in ("query", "value")}
    assert all(r == saes.saes_rank(16, 16, 0.5) for r in rep.ranks.values())
    assert set(rep.beta_per_layer) == set(rep.ranks) and rep.seconds_aces >= 0
    assert all(v is not None for v in rep.rer_surrogate.values())
    assert isinstance(model.encoder.layer[1].attention.self.value, LowRankLinear)
    assert not isinstance(model.encoder.layer[1].attention.self.key, LowRankLinear)
    out = model(**_batches()[0]).last_hidden_state
    assert torch.isfinite(out).all()


def test_pipeline_empty_calibration_and_bad_options():
    from rankwise.compress.pipeline import CompressConfig, compress
    from rankwise.core.stats import CalibrationError

    model = _bert(layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CalibrationError, match="empty"), pytest.warns(DeprecationWarning, match="saes_svd_compress"):
        saes.saes_svd_compress(model, [], saes.SAESConfig())
    with pytest.raises(TypeError, match="unknown SAES-SVD option"):
        compress(model, CompressConfig(method="saes-svd", ratio=0.5, options={"alpha": 1.0}), _batches())
    with pytest.raises(ValueError, match="beta"):
        compress(model, CompressConfig(method="saes-svd", ratio=0.5, options={"beta": 1.5}), _batches())
    with pytest.raises(ValueError, match="feed='compressed'"):
        CompressConfig(method="saes-svd", ratio=0.5, feed="original")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kw,field", [
    (dict(compression_ratio=1.0), "compression_ratio"), (dict(compression_ratio=-0.1), "compression_ratio"),
    (dict(beta=1.0), "beta"), (dict(beta=-0.2), "beta"), (dict(beta="fixed"), "beta"),
    (dict(beta=float("nan")), "beta"), (dict(beta_bounds=(0.8, 0.2)), "lower bound"),
    (dict(beta_bounds=(0.2, 1.0)), "beta_bounds"), (dict(bounds_on="gamma"), "bounds_on"),
    (dict(beta_cap=1.0), "beta_cap"), (dict(shrink=0.0), "shrink"), (dict(aces_objective="x"), "aces_objective"),
    (dict(ridge=-1.0), "ridge"), (dict(ridge_retries=-1), "ridge_retries"), (dict(whitener="qr"), "whitener"),
    (dict(targets=()), "targets"),
])
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        saes.SAESConfig(**kw)


def test_config_alpha_bounds_and_defaults():
    cfg = saes.SAESConfig(bounds_on="alpha")
    assert cfg.interval == pytest.approx((0.2, 3 / 7))
    d = saes.SAESConfig()
    assert (d.beta, d.beta_bounds, d.beta_cap, d.shrink, d.aces_objective, d.refine, d.ridge) == \
        ("aces", (0.25, 0.75), 0.95, 1.0, "ratio", False, 1e-6)
    cc = saes.SAESConfig(compression_ratio=0.6).to_compress_config()
    assert cc.method == "saes-svd" and cc.ratio == pytest.approx(0.4)


class _WordTokenizer:
    """A whitespace tokenizer with the Hugging Face call signature the reproductions use (ids = word index + 1)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def _ids(self, text: str, max_length: int) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 1) for w in text.split()][:max_length]

    def __call__(self, texts, padding=False, truncation=False, max_length=512, return_tensors=None):
        ids = [self._ids(t, max_length if truncation else 10 ** 9) for t in texts]
        if not padding:
            return {"input_ids": ids}
        width = max(len(i) for i in ids)
        return {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])}


def test_repro_batches_are_length_sorted_and_keep_every_sentence():
    from rankwise.repro import saes_svd as repro

    texts = [" ".join(f"w{j}" for j in range(n)) + f" s{k}" for k, n in enumerate([9, 2, 30, 5, 5, 70, 1, 12, 3])]
    tok = _WordTokenizer()
    batches = repro._batches(tok, texts, 4)
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 1]
    lengths = [int(n) for b in batches for n in b["attention_mask"].sum(1)]
    assert lengths == sorted(lengths) and lengths[-1] == repro.MAX_LEN  # truncated at MAX_LEN, sorted
    got = sorted(tuple(row[m.bool()].tolist()) for b in batches for row, m in zip(b["input_ids"], b["attention_mask"]))
    want = sorted(tuple(i) for i in tok(texts, truncation=True, max_length=repro.MAX_LEN)["input_ids"])
    assert got == want
    padded = sum(b["attention_mask"].numel() for b in batches)
    unsorted = sum(len(texts[i:i + 4]) * max(len(t) for t in tok(texts[i:i + 4], truncation=True,
                                                                 max_length=repro.MAX_LEN)["input_ids"])
                   for i in range(0, len(texts), 4))
    assert padded < unsorted
