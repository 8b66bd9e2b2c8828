"""Compress-then-Merge: the spec's correctness checks, properties and bad inputs."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rankwise.core.errors import RankwiseError
from rankwise.core.lora import AdapterState
from rankwise.merge import CtMConfig, MergeConfig, ctm_merge, merge_with_report, mtc_merge
from rankwise.merge.baselines import core_bases, core_matrices
from rankwise.merge.ctm import balance_norms, ctm_merge_layer, tucker2, tucker_objective

MODS = ("layers.0.q", "layers.0.v", "layers.1.q")


def lora(seed: int, m: int = 24, n: int = 20, r: int = 4, mods=MODS, scaling: float = 0.5,
         dtype=torch.float32, fingerprint: str | None = None) -> AdapterState:
    g = torch.Generator().manual_seed(seed)
    f = {k: {"lora_A": torch.randn(r, n, generator=g).to(dtype), "lora_B": torch.randn(m, r, generator=g).to(dtype)}
         for k in mods}
    return AdapterState({"rank": r, "alpha": scaling * r}, f, {k: scaling for k in mods}, fingerprint)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def scaled(ad: AdapterState, mod: str) -> tuple[torch.Tensor, torch.Tensor]:
    return ad.factors[mod]["lora_B"].double() * ad.scaling[mod], ad.factors[mod]["lora_A"].double()


def proj(U: torch.Tensor) -> torch.Tensor:
    return U @ U.T


# -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["ta", "mean", "ties", "dare", "dare_ties", "iso_c"])
def test_output_rank_at_most_r(rule):
    ads = [lora(i) for i in range(4)]  # R = 16
    out = ctm_merge(ads, CtMConfig(rank=3, rule=rule))
    assert out.ranks() == {m: 3 for m in MODS}
    assert out.scaling == {m: 1.0 for m in MODS} and out.config["alpha"] == 3.0
    for m in MODS:
        s = torch.linalg.svdvals(out.delta_weight(m, torch.float64))
        assert float(s[3:].max()) < 1e-6 * float(s[0])


def test_core_space_exactness():
    ads = [lora(i, r=3 + i) for i in range(3)]  # mixed ranks
    Bs, As = zip(*(scaled(a, "layers.0.q") for a in ads))
    U_B, V_A = core_bases(Bs, As)
    assert U_B.shape == (24, 12) and V_A.shape == (20, 12)
    M = core_matrices(U_B, V_A, Bs, As)
    for t in range(3):
        assert rel(U_B @ M[t] @ V_A.T, Bs[t] @ As[t]) < 1e-5


@pytest.mark.parametrize("rule", ["ta", "mean"])
def test_single_adapter_is_reproduced(rule):
    ad = lora(7)
    out = ctm_merge([ad], CtMConfig(rank=4, rule=rule, scale=1.0))
    for m in MODS:
        assert rel(out.delta_weight(m, torch.float64), ad.delta_weight(m, torch.float64)) < 1e-5


def test_identical_adapters_mean_returns_shared_adapter():
    ad = lora(3)
    out = ctm_merge([ad, ad.clone(), ad.clone()], CtMConfig(rank=4, rule="mean", scale=1.0))
    for m in MODS:
        assert rel(out.delta_weight(m, torch.float64), ad.delta_weight(m, torch.float64)) < 1e-5


def test_hooi_improves_on_hosvd_and_is_orthonormal():
    ads = [lora(i) for i in range(5)]
    Bs, As = zip(*(scaled(a, "layers.1.q") for a in ads))
    U_B, V_A = core_bases(Bs, As)
    M = balance_norms(core_matrices(U_B, V_A, Bs, As), 0.25)
    res = tucker2(M, 4, iters=1000, tol=1e-10)
    assert res.objective >= res.objective_init - 1e-9
    assert res.converged and res.iterations >= 1
    eye = torch.eye(4, dtype=torch.float64)
    assert torch.allclose(res.P.T @ res.P, eye, atol=1e-5) and torch.allclose(res.S.T @ res.S, eye, atol=1e-5)
    assert abs(tucker_objective(M, res.P, res.S) - res.objective) < 1e-9
    # HOOI: a stationary point beats random orthonormal subspaces
    g = torch.Generator().manual_seed(0)
    Q1 = torch.linalg.qr(torch.randn(20, 4, generator=g, dtype=torch.float64))[0]
    Q2 = torch.linalg.qr(torch.randn(20, 4, generator=g, dtype=torch.float64))[0]
    assert res.objective > tucker_objective(M, Q1, Q2)


def test_beta_zero_ignores_norm_scaling_beta_one_follows_it():
    ads = [lora(i, m=40, n=36) for i in range(4)]
    big = ads[0].clone()
    big.factors["layers.0.q"]["lora_B"] = big.factors["layers.0.q"]["lora_B"] * 10
    mod = "layers.0.q"

    def spaces(adapters, beta):
        Bs, As = zip(*(scaled(a, mod) for a in adapters))
        return ctm_merge_layer(Bs, As, CtMConfig(rank=4, beta=beta, hooi_tol=1e-12), name=mod)

    r0, r0b = spaces(ads, 0.0), spaces([big] + ads[1:], 0.0)
    assert float((proj(r0.U_r) - proj(r0b.U_r)).norm()) < 1e-2
    assert float((proj(r0.V_r) - proj(r0b.V_r)).norm()) < 1e-2
    r1, r1b = spaces(ads, 1.0), spaces([big] + ads[1:], 1.0)
    assert float((proj(r1.U_r) - proj(r1b.U_r)).norm()) > 0.1
    assert r1b.kept_energy[0] > r1.kept_energy[0] + 0.05  # the subspaces move toward the large adapter


def test_reduced_space_identity_and_energy():
    ads = [lora(i) for i in range(3)]
    Bs, As = zip(*(scaled(a, "layers.0.v") for a in ads))
    res = ctm_merge_layer(Bs, As, CtMConfig(rank=5, rule="ta", scale=1.0))
    total = sum(b @ a for b, a in zip(Bs, As))
    assert torch.allclose(res.U_r.T @ total @ res.V_r, res.C.sum(0), atol=1e-9)
    assert torch.allclose(res.B @ res.A, res.U_r @ res.C.sum(0) @ res.V_r.T, atol=1e-9)
    for t in range(3):
        full = Bs[t] @ As[t]
        assert abs(res.kept_energy[t] - float((res.U_r.T @ full @ res.V_r).norm() / full.norm())) < 1e-9
        assert 0.0 < res.kept_energy[t] <= 1.0 + 1e-12


def test_frobenius_sanity_vs_merge_then_compress():
    ads = [lora(i) for i in range(4)]
    ctm = ctm_merge(ads, CtMConfig(rank=4, rule="ta", scale=1.0))
    mtc = mtc_merge(ads, MergeConfig(rank=4, rule="ta", scale=1.0))
    for m in MODS:
        target = sum(a.delta_weight(m, torch.float64) for a in ads)
        e_ctm = float((ctm.delta_weight(m, torch.float64) - target).norm())
        e_mtc = float((mtc.delta_weight(m, torch.float64) - target).norm())
        assert e_ctm >= e_mtc - 1e-5


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_m_by_n_tensor_in_main_path():
    m, n, T, r = 1536, 1280, 4, 8
    ads = [lora(i, m=m, n=n, r=r, mods=("w",)) for i in range(T)]
    with _Shapes() as rec:
        out = ctm_merge(ads, CtMConfig(rank=r, rule="ties"))
    assert out.rank("w") == r
    assert rec.largest < m * n // 10  # O((m + n) R) only


def test_deterministic_and_order_independent():
    ads = [lora(i) for i in range(4)]
    for rule in ("ties", "ta", "dare", "dare_ties"):
        cfg = CtMConfig(rank=4, rule=rule)
        a, b = ctm_merge(ads, cfg), ctm_merge(ads, cfg)
        assert a.allclose(b)  # bitwise
        c = ctm_merge(ads[::-1], cfg)
        for m in MODS:
            assert rel(c.delta_weight(m, torch.float64), a.delta_weight(m, torch.float64)) < 1e-6


def test_rules_differ_and_scale_is_linear():
    ads = [lora(i) for i in range(3)]
    d = {rule: ctm_merge(ads, CtMConfig(rank=4, rule=rule, scale=1.0)).delta_weight("layers.0.q", torch.float64)
         for rule in ("ta", "ties", "mean")}
    assert rel(d["ta"], d["mean"] * 3) < 1e-6
    assert rel(d["ties"], d["ta"]) > 1e-3
    half = ctm_merge(ads, CtMConfig(rank=4, rule="ta", scale=0.5)).delta_weight("layers.0.q", torch.float64)
    assert rel(half, 0.5 * d["ta"]) < 1e-6


def test_iso_c_flattens_spectrum():
    ads = [lora(i) for i in range(3)]
    out = ctm_merge(ads, CtMConfig(rank=4, rule="iso_c", scale=1.0))
    s = torch.linalg.svdvals(out.delta_weight("layers.0.q", torch.float64))[:4]
    assert float(s.max() - s.min()) < 1e-6 * float(s.max())


def test_report_and_metadata():
    ads = [lora(i, fingerprint="abc") for i in range(3)]
    out, rep = merge_with_report(ads, CtMConfig(rank=4))
    assert out.fingerprint == "abc" and out.config["method"] == "ctm"
    assert out.config["merge"]["rule"] == "ties" and out.config["merge"]["beta"] == 0.25
    assert set(rep.kept_energy) == set(MODS) and len(rep.mean_kept_energy()) == 3
    assert all(h["converged"] for h in rep.hooi.values())


def test_mixed_ranks_and_dtypes():
    ads = [lora(0, r=2), lora(1, r=6, dtype=torch.float64), lora(2, r=4)]
    out = ctm_merge(ads, CtMConfig(rank=5))
    assert out.factors["layers.0.q"]["lora_A"].dtype == torch.float64
    b16 = [lora(0, dtype=torch.bfloat16), lora(1, dtype=torch.bfloat16)]
    o16 = ctm_merge(b16, CtMConfig(rank=4))
    assert o16.factors["layers.0.q"]["lora_B"].dtype == torch.bfloat16


def test_zero_adapter_is_skipped_with_warning(caplog):
    ads = [lora(i) for i in range(3)]
    z = ads[2].clone()
    for f in z.factors.values():
        f["lora_B"].zero_()
    with caplog.at_level(logging.WARNING):
        with_zero, rep = merge_with_report(ads[:2] + [z], CtMConfig(rank=4, rule="ta", scale=1.0))
    assert "zero" in caplog.text
    without = ctm_merge(ads[:2], CtMConfig(rank=4, rule="ta", scale=1.0))
    assert rel(with_zero.delta_weight("layers.0.q", torch.float64),
               without.delta_weight("layers.0.q", torch.float64)) < 1e-6
    assert rep.kept_energy["layers.0.q"][2] is None
    all_zero = ctm_merge([z], CtMConfig(rank=4))
    assert float(all_zero.delta_weight("layers.0.q").abs().max()) == 0.0


# ------------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, field", [
    ({"rank": 0}, "rank"), ({"rank": -3}, "rank"), ({"rank": 2.5}, "rank"), ({"beta": 1.5}, "beta"),
    ({"beta": -0.1}, "beta"), ({"density": 0.0}, "density"), ({"density": 1.2}, "density"),
    ({"drop_rate": 1.0}, "drop_rate"), ({"rule": "magic"}, "rule"), ({"scale": float("nan")}, "scale"),
    ({"hooi_iters": -1}, "hooi_iters"), ({"hooi_tol": -1e-3}, "hooi_tol"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CtMConfig(**kwargs)


def test_bad_adapter_lists():
    ads = [lora(i) for i in range(2)]
    with pytest.raises(ValueError, match="empty"):
        ctm_merge([], CtMConfig(rank=4))
    with pytest.raises(TypeError, match="AdapterState"):
        ctm_merge([ads[0], {"w": 1}], CtMConfig(rank=4))
    with pytest.raises(RankwiseError, match="layers.1.q"):
        ctm_merge([ads[0], lora(5, mods=MODS[:2])], CtMConfig(rank=4))
    with pytest.raises(RankwiseError, match="shape"):
        ctm_merge([ads[0], lora(5, m=30)], CtMConfig(rank=4))
    with pytest.raises(ValueError, match=r"R = .* = 8"):
        ctm_merge(ads, CtMConfig(rank=9))
    with pytest.raises(ValueError, match="min\\(out, in\\)"):
        ctm_merge([lora(i, m=6, n=5, r=4) for i in range(3)], CtMConfig(rank=6))
    with pytest.raises(RankwiseError, match="different base models"):
        ctm_merge([lora(0, fingerprint="aaa"), lora(1, fingerprint="bbb")], CtMConfig(rank=4))
    other = lora(1)
    other.config["base_model_name_or_path"] = "x/other"
    named = lora(0)
    named.config["base_model_name_or_path"] = "x/base"
    with pytest.raises(RankwiseError, match="different base models"):
        ctm_merge([named, other], CtMConfig(rank=4))
    dora = lora(1)
    dora.config["use_dora"] = True
    with pytest.raises(RankwiseError, match="unsupported adapter type"):
        ctm_merge([ads[0], dora], CtMConfig(rank=4))
    with pytest.raises(TypeError, match="CtMConfig"):
        ctm_merge(ads, MergeConfig(rank=4))


def test_nan_factor_is_named():
    ads = [lora(i) for i in range(2)]
    ads[1].factors["layers.0.v"]["lora_A"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"adapter 1.*layers.0.v"):
        ctm_merge(ads, CtMConfig(rank=4))


def test_rank_equal_to_R_is_exact_for_ta():
    ads = [lora(i, r=2) for i in range(3)]  # R = 6: the subspaces hold every adapter
    out = ctm_merge(ads, replace(CtMConfig(rank=6, rule="ta", scale=1.0)))
    for m in MODS:
        assert rel(out.delta_weight(m, torch.float64), sum(a.delta_weight(m, torch.float64) for a in ads)) < 1e-6


def test_search_finds_the_best_scale_on_a_validation_callback():
    from rankwise.merge.ctm import search

    ads = [lora(i) for i in range(3)]
    target = {m: 0.5 * sum(a.delta_weight(m, torch.float64) for a in ads) for m in MODS}

    def score(state: AdapterState) -> float:  # closeness to half the summed deltas
        return -sum(float((state.delta_weight(m, torch.float64) - target[m]).norm()) for m in MODS)

    best, s, history = search(ads, score, CtMConfig(rank=4, rule="ta", scale=1.0), lambdas=(0.25, 0.5, 1.0, 2.0),
                              betas=(0.0, 0.25))
    assert best.scale == 0.5 and s == max(h[1] for h in history)
    assert len(history) == len({tuple(h[0].values()) for h in history})  # each setting scored once
    assert all(h[0]["density"] == 0.25 for h in history)  # TA: the density is not searched
    with pytest.raises(TypeError, match="callable"):
        search(ads, 3.0)


def _lora_core(D, T, r_t, seed):
    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(D, r_t, generator=g, dtype=torch.float64) / D ** 0.5 for _ in range(T)]
    As = [torch.randn(r_t, D, generator=g, dtype=torch.float64) / D ** 0.5 for _ in range(T)]
    U_B, V_A = core_bases(Bs, As)
    return balance_norms(core_matrices(U_B, V_A, Bs, As), 0.25)


def _spy_warm(monkeypatch):
    import rankwise.merge.ctm as ctm

    seen = {"ok": 0, "failed": 0}
    real = ctm._Warm.__call__

    def spy(self, X, V0):
        out = real(self, X, V0)
        seen["ok" if out is not None else "failed"] += 1
        return out
    monkeypatch.setattr(ctm._Warm, "__call__", spy)
    return seen


@pytest.mark.parametrize("D,T,r_t,rank,tol", [(256, 8, 8, 8, 1e-10), (1024, 8, 16, 16, 1e-6), (512, 5, 16, 6, 1e-8)])
def test_warm_started_hooi_follows_the_eigh_iterates(monkeypatch, D, T, r_t, rank, tol):
    # the sweep updates from subspace iteration (warm start) are the exact eigh updates to ~1e-11: same
    # number of sweeps, same objective, same factors (up to the sign convention both apply)
    M = _lora_core(D, T, r_t, seed=D + T)
    b = tucker2(M, rank, tol=tol, warm=False)
    seen = _spy_warm(monkeypatch)
    a = tucker2(M, rank, tol=tol)
    assert seen["ok"] >= 5  # the warm path really ran
    assert a.iterations == b.iterations and a.converged == b.converged
    assert a.objective == pytest.approx(b.objective, rel=1e-12)
    assert float((a.P - b.P).abs().max()) < 1e-7 and float((a.S - b.S).abs().max()) < 1e-7


def test_factored_products_give_the_same_hooi(monkeypatch):
    import rankwise.merge.ctm as ctm

    # M_t = L_t K_t^T: the sweeps' products through the factors are the same products
    g = torch.Generator().manual_seed(5)
    L = torch.randn(6, 96, 12, generator=g, dtype=torch.float64)
    K = torch.randn(6, 96, 12, generator=g, dtype=torch.float64)
    M = L @ K.mT
    a, b = tucker2(M, 10, tol=1e-9), tucker2(M, 10, tol=1e-9, factors=(L, K))
    assert a.iterations == b.iterations > 3
    assert a.objective == pytest.approx(b.objective, rel=1e-12)
    assert float((a.P - b.P).abs().max()) < 1e-8 and float((a.S - b.S).abs().max()) < 1e-8
    with pytest.raises(ValueError, match="do not reproduce M"):
        tucker2(M, 10, factors=(L, 2 * K))
    with pytest.raises(ValueError, match=r"\(T, R, k\)"):
        tucker2(M, 10, factors=(L[:, :90], K[:, :90]))
    with pytest.raises(TypeError, match="pair of tensors"):
        tucker2(M, 10, factors=L)


def test_core_factors_reproduce_core_matrices():
    from rankwise.merge.common import core_factors

    g = torch.Generator().manual_seed(2)
    Bs = [torch.randn(40, r, generator=g, dtype=torch.float64) for r in (3, 5, 4)]  # unequal ranks: padding
    As = [torch.randn(r, 30, generator=g, dtype=torch.float64) for r in (3, 5, 4)]
    U_B, V_A = core_bases(Bs, As)
    L, K = core_factors(U_B, V_A, Bs, As)
    assert L.shape == K.shape == (3, 12, 5)
    M = torch.stack([(U_B.T @ b) @ (a @ V_A) for b, a in zip(Bs, As)])  # the definition, block by block
    assert torch.allclose(L @ K.mT, M, atol=1e-12) and torch.equal(core_matrices(U_B, V_A, Bs, As), L @ K.mT)


@pytest.mark.parametrize("ranks", [(3, 5, 4), (4, 4, 4)])
def test_core_space_is_core_bases_and_core_factors_in_one_call(ranks):
    from rankwise.merge.common import core_factors, core_space

    g = torch.Generator().manual_seed(3)
    Bs = [torch.randn(40, r, generator=g, dtype=torch.float32) for r in ranks]  # float32: converted once
    As = [torch.randn(r, 30, generator=g, dtype=torch.float32) for r in ranks]
    got = core_space(Bs, As)
    U_B, V_A = core_bases(Bs, As)
    want = (U_B, V_A, *core_factors(U_B, V_A, Bs, As))
    assert all(x.dtype == torch.float64 and torch.equal(x, y) for x, y in zip(got, want))


def test_ctm_layer_does_not_recheck_the_factors_it_built(monkeypatch):
    import rankwise.merge.ctm as ctm

    def refuse(*a, **k):
        raise AssertionError("ctm_merge_layer re-checked factors it built itself")

    monkeypatch.setattr(ctm, "_check_factors", refuse)
    g = torch.Generator().manual_seed(4)
    Bs = [torch.randn(96, 16, generator=g, dtype=torch.float64) / 10 for _ in range(5)]
    As = [torch.randn(16, 80, generator=g, dtype=torch.float64) / 10 for _ in range(5)]
    out = ctm.ctm_merge_layer(Bs, As, ctm.CtMConfig(rank=8))
    assert out.B.shape == (96, 8) and out.A.shape == (8, 80)
    with pytest.raises(AssertionError, match="re-checked"):  # the public tucker2 still checks
        M = torch.randn(5, 8, 8, generator=g, dtype=torch.float64)
        ctm.tucker2(M, 4, factors=(M, M))


def test_failed_warm_starts_back_off(monkeypatch):
    import rankwise.merge.ctm as ctm

    # every warm start fails (no product allowed beyond the first): after each failure the wait before the
    # next try doubles, so about log2(sweeps) attempts per factor, not one per update
    monkeypatch.setattr(ctm, "WARM_STEPS", 1)
    monkeypatch.setattr(ctm, "WARM_RESIDUAL", 0.0)
    seen = _spy_warm(monkeypatch)
    res = tucker2(_lora_core(256, 8, 8, seed=3), 8, tol=1e-10)
    assert res.iterations >= 40 and seen["ok"] == 0
    assert seen["failed"] <= 2 * (math.log2(res.iterations) + 2)


def test_warm_start_gives_up_on_a_slow_subspace_and_tucker2_falls_back_to_eigh(monkeypatch):
    import rankwise.merge.ctm as ctm

    # G's eigenvalues 3, 1, 1, 0.5: from a start half in the 0.5-eigenvector the error decays as 0.5^k, far
    # from the residual tolerance after WARM_STEPS products: no answer, the caller runs eigh
    X = torch.diag(torch.tensor([3.0, 1.0, 1.0, 0.5], dtype=torch.float64).sqrt())  # G = X X^T
    V0 = torch.linalg.qr(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)).Q
    assert ctm._Warm()(X, V0) is None
    # with a gap it converges to the top eigenspace; the Ritz basis is the eigh answer
    X2 = torch.diag(torch.tensor([3.0, 2.0, 0.01, 0.001], dtype=torch.float64).sqrt())
    Q, top = ctm._Warm()(X2, V0)
    assert float(top) == pytest.approx(5.0)
    assert torch.allclose(ctm._ritz(X2, Q).abs(), torch.eye(4, 2, dtype=torch.float64), atol=1e-10)
    # the measured rate predicts the products of the next update: one check suffices
    w = ctm._Warm()
    w(X2, V0)
    assert 0.0 < w.rate < 0.05  # lambda_3 / lambda_2 = 0.005, up to the residual's constant
    # no warm start allowed: every sweep falls back to eigh and gives exactly the eigh iterates
    monkeypatch.setattr(ctm, "WARM_STEPS", 0)
    M = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # R >= WARM_MIN_R
    a, b = tucker2(M, 3), tucker2(M, 3, warm=False)
    assert torch.equal(a.P, b.P) and torch.equal(a.S, b.S) and a.iterations == b.iterations


def _lora_factors(D, ranks, seed, beta=0.25):
    """Balanced core factors (L c, K) of random LoRAs and M = (L c) Kᵀ, as ctm_merge_layer builds them."""
    import rankwise.merge.ctm as ctm
    from rankwise.merge.common import core_space

    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(D, r, generator=g, dtype=torch.float64) / D ** 0.5 for r in ranks]
    As = [torch.randn(r, D, generator=g, dtype=torch.float64) / D ** 0.5 for r in ranks]
    _, _, L, K = core_space(Bs, As)
    c = ctm._balance_scale(L @ K.mT, beta)
    L = L * c[:, None, None]
    return L @ K.mT, L, K


def _spy_coords(monkeypatch):
    import rankwise.merge.ctm as ctm

    seen = {"updates": 0, "degenerate": 0}
    real = ctm._Coords.__call__

    def spy(self, *a):
        try:
            out = real(self, *a)
        except ctm._Degenerate:
            seen["degenerate"] += 1
            raise
        seen["updates"] += 1
        return out
    monkeypatch.setattr(ctm._Coords, "__call__", spy)
    return seen


@pytest.mark.parametrize("D,ranks,rank,tol", [(1024, [16] * 8, 16, 1e-6), (512, [16, 8, 24, 16, 12, 20], 12, 1e-8),
                                              (256, [8] * 12, 5, 1e-10)])
def test_sweeps_in_adapter_coordinates_follow_the_eigh_iterates(monkeypatch, D, ranks, rank, tol):
    # with M_t = L_t K_tᵀ given, the sweeps run on F = C N Cᵀ (T r x T r) instead of G (R x R): the same
    # nonzero spectrum, the same updates to ~1e-11 (equal and unequal ranks: padded factors)
    M, L, K = _lora_factors(D, ranks, seed=D + len(ranks))
    b = tucker2(M, rank, tol=tol, warm=False)
    seen = _spy_coords(monkeypatch)
    a = tucker2(M, rank, tol=tol, factors=(L, K))
    assert seen["updates"] >= 2 * a.iterations > 10 and seen["degenerate"] == 0  # every update in coordinates
    assert a.iterations == b.iterations and a.converged == b.converged
    assert a.objective == pytest.approx(b.objective, rel=1e-12)
    assert float((a.P - b.P).abs().max()) < 1e-7 and float((a.S - b.S).abs().max()) < 1e-7
    eye = torch.eye(rank, dtype=torch.float64)
    assert float((a.P.T @ a.P - eye).abs().max()) < 1e-12 and float((a.S.T @ a.S - eye).abs().max()) < 1e-12


def test_coordinates_are_used_only_where_they_are_smaller_and_not_on_degenerate_spectra(monkeypatch):
    import rankwise.merge.ctm as ctm

    seen = _spy_coords(monkeypatch)
    # T r > R (rank 12 from four rank-8 adapters: F would be 48 x 48 > R = 32 and R < WARM_MIN_R anyway)
    M, L, K = _lora_factors(128, [8] * 4, seed=1)
    tucker2(M, 12, factors=(L, K))
    M, L, K = _lora_factors(512, [16] * 8, seed=2)
    tucker2(M, 9, factors=(L, K), warm=False)  # warm=False: eigh in R-space, every sweep
    assert seen["updates"] == 0
    # eight adapters of rank 16 whose B_t have rank 1: G has rank <= 8 < r = 16, the kept eigenvalues include
    # zeros, so the coordinate map X U H^(-1/2) is undefined; the sweeps rerun in R-space from the same start
    g = torch.Generator().manual_seed(3)
    Bs = [torch.randn(300, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 16, generator=g, dtype=torch.float64)
          for _ in range(8)]
    As = [torch.randn(16, 300, generator=g, dtype=torch.float64) for _ in range(8)]
    from rankwise.merge.common import core_space
    _, _, L, K = core_space(Bs, As)
    M = L @ K.mT
    a, b = tucker2(M, 16, factors=(L, K)), tucker2(M, 16, warm=False)
    assert seen["degenerate"] == 1
    assert a.iterations == b.iterations and a.objective == pytest.approx(b.objective, rel=1e-10)


def test_warm_start_on_an_explicit_gram_matrix_is_the_factored_one():
    import rankwise.merge.ctm as ctm

    # _Warm(sym=True) takes G itself (one product per application) and accepts the same subspace
    g = torch.Generator().manual_seed(6)
    scale = torch.cat([torch.linspace(3.0, 2.0, 6), torch.linspace(0.3, 0.01, 74)]).to(torch.float64)  # a gap after 6
    Xt = torch.randn(96, 80, generator=g, dtype=torch.float64) * scale
    G = Xt.T @ Xt
    top = torch.linalg.eigh(G)[1][:, -6:]
    V0 = torch.linalg.qr(top + 1e-3 * torch.randn(80, 6, generator=g, dtype=torch.float64)).Q
    w = ctm._Warm(sym=True)
    Q1, e1 = w(G, V0)
    Q2, e2 = ctm._Warm()(Xt, V0)
    assert float((Q1 @ Q1.T - Q2 @ Q2.T).abs().max()) < 1e-9
    assert float(e1) == pytest.approx(float(e2), rel=1e-12)
    assert torch.allclose(w.H, Q1.T @ G @ Q1, atol=1e-10)


def test_core_bases_are_row_major_and_equal_the_wide_svd_basis():
    from rankwise.merge.common import sign_fix

    # V_A comes from the SVD of the tall A_catᵀ: the same sign-fixed basis as the right singular vectors of
    # the wide A_cat; both bases row-major (the lifts U_B P run ~8x slower in MKL with a column-major U_B)
    g = torch.Generator().manual_seed(7)
    Bs = [torch.randn(200, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    As = [torch.randn(6, 150, generator=g, dtype=torch.float64) for _ in range(3)]
    U_B, V_A = core_bases(Bs, As)
    assert U_B.is_contiguous() and V_A.is_contiguous()
    Vh = torch.linalg.svd(torch.cat(As, 0), full_matrices=False)[2]
    assert torch.allclose(V_A, sign_fix(Vh.T)[0], atol=1e-10)
    U = torch.linalg.svd(torch.cat(Bs, 1), full_matrices=False)[0]
    assert torch.allclose(U_B, sign_fix(U)[0], atol=1e-10)
