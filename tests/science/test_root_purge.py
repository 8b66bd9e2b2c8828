"""Correctness checks and bad inputs of Root Purge / RRR / DWRR (spec ``shared/methods/root_purge.md``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from rankwise.core.errors import ArtifactError
from rankwise.science import root_purge as rp

TRUE_ANGLES = (0.3, 1.1)


def _sines(T: int, phase: float = 0.4) -> np.ndarray:
    t = np.arange(T, dtype=np.float64)
    return np.sin(TRUE_ANGLES[0] * t) + 0.5 * np.cos(TRUE_ANGLES[1] * t + phase)


def _noisy(T: int = 600, sigma: float = 0.5, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return _sines(T) + sigma * rng.standard_normal(T)


# ------------------------------------------------------------------ OLS / RRR / DWRR


@pytest.mark.parametrize("instance_norm", [True, False])
def test_ols_reproduces_noise_free_ar_future(instance_norm: bool) -> None:
    s = _sines(400)
    X, Y = rp.make_windows(s[:300], 24, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # noise-free data are low rank (expected)
        W = rp.fit_ols(X, Y, instance_norm=instance_norm)
    Xt, Yt = rp.make_windows(s[250:], 24, 8)
    err = (rp.predict_linear(W, Xt, instance_norm) - Yt).abs().max()
    assert float(err) < 1e-6


def test_rrr_full_rank_and_dwrr_full_rank_equal_ols() -> None:
    X, Y = rp.make_windows(_noisy(), 20, 12)
    W = rp.fit_ols(X, Y)
    assert torch.allclose(rp.reduced_rank_regression(X, Y, rank=12), W, atol=1e-6)
    assert torch.allclose(rp.dwrr(W, rank=12), W, atol=1e-6)


def test_ranks_and_rrr_is_optimal_among_rank_r() -> None:
    X, Y = rp.make_windows(_noisy(seed=3), 20, 12)
    x, y = X[..., 0], Y[..., 0]
    path = rp.rrr_path(x, y)
    U, s, Vh = torch.linalg.svd(path.W_ols, full_matrices=False)
    for r in range(1, 13):
        w_rrr = path.weight(r)
        w_dw = rp.dwrr(path.W_ols, r)
        assert int(torch.linalg.matrix_rank(w_rrr, rtol=1e-9)) <= r
        assert int(torch.linalg.matrix_rank(w_dw, rtol=1e-9)) <= r
        mse_rrr = float(((rp.predict_linear(w_rrr, x) - y) ** 2).mean())
        mse_dw = float(((rp.predict_linear(w_dw, x) - y) ** 2).mean())
        assert mse_rrr <= mse_dw + 1e-12
        # one SVD gives every rank: path.weight(r) equals a fresh fit at rank r
        assert torch.allclose(rp.reduced_rank_regression(x, y, r), w_rrr, atol=1e-10)


def test_ols_matches_statsmodels() -> None:
    sm = pytest.importorskip("statsmodels.api")
    X, Y = rp.make_windows(_noisy(seed=1), 16, 4)
    x, y = X[..., 0].numpy(), Y[..., 0].numpy()
    W = rp.fit_ols(x, y, instance_norm=False).numpy()
    for h in range(4):
        params = sm.OLS(y[:, h], x).fit().params
        np.testing.assert_allclose(W[:, h], params, atol=1e-8)


def test_select_rank_uses_validation_and_returns_curve() -> None:
    s = _noisy(900, sigma=0.8, seed=2)
    X, Y = rp.make_windows(s[:500], 24, 24)
    Xv, Yv = rp.make_windows(s[500:700], 24, 24)
    sel = rp.select_rank(X, Y, Xv, Yv, method="rrr")
    assert sel.ranks == [6, 12, 18, 24]
    assert sel.rank == sel.ranks[int(np.argmin(sel.val_mse))]
    assert int(torch.linalg.matrix_rank(sel.weight, rtol=1e-9)) <= sel.rank
    assert rp.default_ranks(20, 15) == [6, 12, 15]


# ------------------------------------------------------------------ characteristic roots


def test_roots_of_one_step_model_match_generating_ar_roots() -> None:
    s = _sines(500)
    X, Y = rp.make_windows(s, 16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        W = rp.fit_ols(X, Y, instance_norm=False)
    roots = rp.characteristic_roots(W, instance_norm=False)
    true = rp.ar_roots([2 * np.cos(0.3) + 2 * np.cos(1.1), -(2 + 4 * np.cos(0.3) * np.cos(1.1)),
                        2 * np.cos(0.3) + 2 * np.cos(1.1), -1.0])
    np.testing.assert_allclose(np.sort_complex(true), np.sort_complex(np.exp(1j * np.array(
        [0.3, -0.3, 1.1, -1.1]))), atol=1e-9)
    assert rp.root_distance(roots, true) < 1e-5
    assert roots.shape == (16,)


def test_instance_norm_always_has_unit_root() -> None:
    W = torch.randn(12, 3, dtype=torch.float64)
    for step in (1, 2, 3):
        r = rp.characteristic_roots(W, step=step, instance_norm=True)
        assert r.shape == (12 - 1 + step,)
        assert np.min(np.abs(r - 1.0)) < 1e-6


def test_root_distance_is_a_matching() -> None:
    assert rp.root_distance([1.0, 1.0, 2.0], [1.0, 1.0]) == 0.0
    assert rp.root_distance([1.0, 3.0], [1.0, 1.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        rp.root_distance([1.0], [1.0, 2.0])


# ------------------------------------------------------------------ Root Purge loss


def _batch(B: int = 8, L: int = 10, H: int = 6, C: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, C, generator=g), torch.randn(B, H, C, generator=g)


def test_lambda_zero_gives_plain_mse_gradients() -> None:
    x, y = _batch()
    m1 = rp.LinearForecaster(10, 6, generator=torch.Generator().manual_seed(1))
    m2 = rp.LinearForecaster(10, 6, generator=torch.Generator().manual_seed(1))
    out = rp.RootPurgeLoss(lam=0.0)(m1, x, y)
    out["loss"].backward()
    torch.nn.functional.mse_loss(m2(x), y).backward()
    # identical up to float32 rounding (the loss subtracts the window mean from y instead of adding it to f)
    assert torch.allclose(m1.weight.grad, m2.weight.grad, rtol=0, atol=1e-7)
    assert torch.equal(out["loss"], out["fit"]) and float(out["purge"]) == 0.0


@pytest.mark.parametrize("L,H", [(10, 6), (6, 6), (4, 6)])
def test_residual_is_detached(L: int, H: int) -> None:
    x, y = _batch(L=L, H=H)
    model = rp.LinearForecaster(L, H, generator=torch.Generator().manual_seed(2))
    lam = 0.7
    g1 = torch.Generator().manual_seed(5)
    out = rp.RootPurgeLoss(lam=lam, generator=g1)(model, x, y)
    (out["loss"] - out["fit"]).backward()
    grad_purge = model.weight.grad.clone()
    # reference: the residual as a constant, the purge term through the second call only
    with torch.no_grad():
        m = x.mean(1, keepdim=True)
        r = (y - m) - model.core(x - m)
    g2 = torch.Generator().manual_seed(5)
    model.weight.grad = None
    e = rp.adapt_length(r, L, g2)
    ref = lam * max(L / H, 1.0) * torch.nn.functional.mse_loss(model.core(e), torch.zeros(e.shape[0], H, e.shape[2]))
    ref.backward()
    assert torch.allclose(grad_purge, model.weight.grad, atol=1e-6)


@pytest.mark.parametrize("L,H", [(10, 6), (6, 6), (4, 6), (9, 2)])
def test_adapt_length_gives_exactly_L_steps(L: int, H: int) -> None:
    e = torch.arange(1, 3 * H * 2 + 1, dtype=torch.float32).reshape(3, H, 2)
    out = rp.adapt_length(e, L, torch.Generator().manual_seed(0))
    assert out.shape == (3, L, 2)
    if L > H:  # each output column is a contiguous window of [0]*(L-H) + e + [0]*(L-H)
        for b in range(3):
            for c in range(2):
                padded = torch.cat([torch.zeros(L - H), e[b, :, c], torch.zeros(L - H)])
                wins = padded.unfold(0, L, 1)
                assert any(torch.equal(out[b, :, c], w) for w in wins)
    elif L < H:
        assert torch.equal(out, e[:, :L])
    else:
        assert torch.equal(out, e)


def test_purge_order_and_model_zero_target() -> None:
    x, y = _batch()
    model = rp.LinearForecaster(10, 6)
    o1 = rp.RootPurgeLoss(lam=1.0, order=1, generator=torch.Generator().manual_seed(0))(model, x, y)
    o2 = rp.RootPurgeLoss(lam=1.0, order=2, generator=torch.Generator().manual_seed(0))(model, x, y)
    oz = rp.RootPurgeLoss(lam=1.0, order=1, target="model_zero",
                          generator=torch.Generator().manual_seed(0))(model, x, y)
    assert torch.isclose(o1["fit"], o2["fit"])
    assert not torch.isclose(o1["purge"], o2["purge"])
    c = 10 / 6
    assert torch.isclose(o2["loss"], o2["fit"] + c ** 2 * o2["purge"])
    assert torch.isclose(oz["loss"], o1["loss"])  # bias-free model: f(0) = 0


def test_loss_wraps_any_module() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 6, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.transpose(1, 2)).transpose(1, 2)

    x, y = _batch()
    model = Plain()
    out = rp.RootPurgeLoss(lam=0.5, instance_norm=True, generator=torch.Generator().manual_seed(0))(model, x, y)
    out["loss"].backward()
    assert model.lin.weight.grad is not None and torch.isfinite(model.lin.weight.grad).all()
    # inference is unchanged by the wrapper
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_backbones_are_linear_maps() -> None:
    x, _ = _batch(L=24, H=12, C=1)
    for model in (rp.FrequencyLinearForecaster(24, 12, instance_norm=False), rp.DLinearForecaster(24, 12)):
        W = model.linear_weight()
        with torch.no_grad():
            assert torch.allclose(model(x)[..., 0], x[..., 0] @ W, atol=1e-5)


# ------------------------------------------------------------------ training


def test_ensemble_equals_single_training() -> None:
    s = _noisy(500, seed=4)
    X, Y = rp.make_windows(s[:300], 12, 6)
    Xv, Yv = rp.make_windows(s[300:], 12, 6)
    tc = rp.TrainConfig(steps=60, lr=1e-2, batch_size=16, val_every=20, seed=7)
    model = rp.LinearForecaster(12, 6, generator=torch.Generator().manual_seed(7))
    rp.train_forecaster(model, X, Y, tc, rp.RootPurgeConfig(lam=1.0), Xv, Yv)
    W, best = rp.fit_linear_ensemble(X[..., 0][None].float(), Y[..., 0][None].float(), [1.0], tc,
                                     X_val=Xv[..., 0][None], Y_val=Yv[..., 0][None])
    assert torch.allclose(W[0], model.linear_weight(), atol=1e-5)
    # per-member decoupled weight decay equals torch.optim.AdamW
    tcw = rp.TrainConfig(steps=40, lr=1e-2, batch_size=16, weight_decay=0.1, seed=3)
    model = rp.LinearForecaster(12, 6, generator=torch.Generator().manual_seed(3))
    rp.train_forecaster(model, X, Y, tcw)
    W, _ = rp.fit_linear_ensemble(X[..., 0][None].float(), Y[..., 0][None].float(), [0.0],
                                  rp.TrainConfig(steps=40, lr=1e-2, batch_size=16, seed=3), weight_decays=[0.1])
    assert torch.allclose(W[0], model.linear_weight(), atol=1e-5)


def test_root_purge_shrinks_small_singular_values() -> None:
    s = _noisy(800, sigma=0.8, seed=5)
    X, Y = rp.make_windows(s, 24, 24)
    x, y = X[..., 0][None].float(), Y[..., 0][None].float()
    tc = rp.TrainConfig(steps=400, lr=1e-2, batch_size=64, seed=0)
    W, _ = rp.fit_linear_ensemble(torch.cat([x, x]), torch.cat([y, y]), [0.0, 2.0], tc)
    assert rp.tail_singular_sum(W[1].double()) < rp.tail_singular_sum(W[0].double())
    top0, top1 = rp.singular_values(W[0].double())[0], rp.singular_values(W[1].double())[0]
    assert top1 > 0.5 * top0  # the large (signal) directions survive


# ------------------------------------------------------------------ estimator API


def test_forecaster_fit_predict_roots_save_load(tmp_path) -> None:
    rng = np.random.default_rng(0)
    T = 700
    series = np.stack([_sines(T), _sines(T, phase=1.3)], axis=1) + 0.3 * rng.standard_normal((T, 2))
    train, val = series[:500], series[500:]
    for method in ("ols", "rrr", "dwrr"):
        f = rp.Forecaster(24, 12, method=method).fit(train, val)
        assert f.weight.shape == (24, 12)
        out = f.predict(val[None, :24])
        assert isinstance(out, np.ndarray) and out.shape == (1, 12, 2)
        fc = f.forecast(torch.as_tensor(train))
        assert isinstance(fc, torch.Tensor) and fc.shape == (12, 2)
        assert f.roots().shape == (24,)
    f = rp.Forecaster(24, 12, method="rrr", channel_mode="individual").fit(train, val)
    assert f.weight.shape == (2, 24, 12)
    assert f.fit_.rank in (6, 12)
    path = f.save(tmp_path / "f.safetensors")
    g = rp.Forecaster.load(path)
    assert np.array_equal(g.weight, f.weight)
    assert np.array_equal(g.predict(val[None, :24]), f.predict(val[None, :24]))
    tr = rp.Forecaster(24, 12, method="root_purge", purge=rp.RootPurgeConfig(lam=1.0),
                       train=rp.TrainConfig(steps=50, val_every=10)).fit(train[:, 0], val[:, 0])
    assert tr.fit_.train[0].best_step > 0 and tr.forecast(train[:, 0]).shape == (12,)
    entry = rp.fit_forecaster(train[:, 0], 24, 12, method="ols")
    assert isinstance(entry, rp.Forecaster)


def test_instance_norm_shift_equivariance() -> None:
    f = rp.Forecaster(16, 8, method="ols").fit(_noisy(300))
    x = torch.as_tensor(_noisy(16, seed=9))[None]
    assert torch.allclose(f.predict(x + 5.0), f.predict(x) + 5.0, atol=1e-9)
    m = rp.LinearForecaster(16, 8)
    with torch.no_grad():
        assert torch.allclose(m(x.float() + 3.0), m(x.float()) + 3.0, atol=1e-5)


def test_statsmodels_ar_baseline() -> None:
    pytest.importorskip("statsmodels")
    s = _noisy(600, sigma=0.1)
    ar = rp.ARBaseline.fit(s[:400], maxlag=12)
    X, Y = rp.make_windows(s[400:], 24, 6)
    pred = ar.predict(X[..., 0], 6)
    assert pred.shape == (X.shape[0], 6)
    assert float(((pred - Y[..., 0].numpy()) ** 2).mean()) < 0.2


def test_registered() -> None:
    from rankwise.core import registry

    e = registry.get("root_purge")
    assert e.config is rp.RootPurgeConfig and e.entry is rp.fit_forecaster


# ------------------------------------------------------------------ bad input


def test_bad_ranks_name_both_dims() -> None:
    X, Y = rp.make_windows(_noisy(), 20, 12)
    W = rp.fit_ols(X, Y)
    for r in (0, 13, -1, 2.5):
        with pytest.raises(ValueError, match="L=20, H=12"):
            rp.reduced_rank_regression(X, Y, rank=r)
        with pytest.raises(ValueError, match="L=20, H=12"):
            rp.dwrr(W, rank=r)
    with pytest.raises(ValueError, match="rank"):
        rp.Forecaster(20, 12, method="rrr", rank=13)


def test_bad_shapes_and_values() -> None:
    X, Y = rp.make_windows(_noisy(), 20, 12)
    with pytest.raises(ValueError, match="empty"):
        rp.fit_ols(torch.zeros(0, 20), torch.zeros(0, 12))
    with pytest.raises(ValueError, match="different numbers of windows"):
        rp.fit_ols(X[:10], Y[:9])
    with pytest.raises(ValueError, match=r"\(L, H\) = \(20, 12\)"):
        rp.rrr_path(X, Y, W=torch.zeros(12, 20))
    Xn = X.clone()
    Xn[3, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        rp.fit_ols(Xn, Y)
    Yi = Y.clone()
    Yi[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="interpolation"):
        rp.fit_ols(X, Yi)
    with pytest.raises(ValueError, match="non-finite"):
        rp.Forecaster(20, 12, "ols").fit(np.array([1.0, np.nan] * 40))
    with pytest.raises(ValueError, match="shorter than lookback"):
        rp.make_windows(np.arange(31.0), 20, 12)
    with pytest.raises(ValueError, match="shorter than lookback"):
        rp.Forecaster(20, 12, "ols").fit(np.arange(31.0))
    with pytest.raises(TypeError):
        rp.make_windows("abc", 2, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_series"):
        rp.Forecaster(20, 12, "rrr").fit(_noisy())
    with pytest.raises(RuntimeError, match="not fitted"):
        rp.Forecaster(20, 12, "ols").predict(np.zeros((1, 20)))


def test_bad_configs() -> None:
    with pytest.raises(ValueError, match="lam"):
        rp.RootPurgeConfig(lam=-0.1)
    with pytest.raises(ValueError, match="order"):
        rp.RootPurgeConfig(order=0)
    with pytest.raises(ValueError, match="target"):
        rp.RootPurgeConfig(target="one")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lam"):
        rp.RootPurgeLoss(lam=float("nan"))
    with pytest.raises(ValueError, match="steps"):
        rp.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        rp.TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="method"):
        rp.Forecaster(4, 2, method="arima")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lams"):
        rp.fit_linear_ensemble(torch.zeros(2, 5, 4), torch.zeros(2, 5, 2), [0.0, -1.0])


def test_constant_series_warns_without_crashing() -> None:
    with pytest.warns(RuntimeWarning, match="numerical rank"):
        f = rp.Forecaster(10, 5, "ols").fit(np.full(60, 3.0))
    np.testing.assert_allclose(f.forecast(np.full(10, 3.0)), np.full(5, 3.0))
    with pytest.raises(ArtifactError):
        rp.Forecaster.load(__file__)
