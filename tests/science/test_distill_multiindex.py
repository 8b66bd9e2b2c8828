"""Correctness checks and bad inputs of Distill-MIM (spec ``shared/methods/distill_multiindex.md``)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rankwise.core.errors import ArtifactError
from rankwise.science import distill_multiindex as dm


@pytest.fixture(scope="module")
def task() -> dm.MultiIndexTask:
    return dm.MultiIndexTask(d=12, r=2, seed=3)


def test_stage1_gradient_closed_form_equals_autograd(task: dm.MultiIndexTask) -> None:
    for scheme in ("iid", "symmetric"):
        alg = dm.TwoLayerAlg(width=10, dtype="float64", init_scheme=scheme)
        p = alg.init(task.d, k=3, seed=1)
        data = task.sample(50, seed=2, dtype=torch.float64)
        W = p.W.clone().requires_grad_(True)
        f = alg.forward(dm.NetParams(W, p.b, p.a), data.x)
        loss = (((f - data.y) ** 2) / 2).mean(dim=1).sum()
        (g_auto,) = torch.autograd.grad(loss, W)
        g_closed = alg.stage1_gradient(p, data.x, data.y)
        assert torch.allclose(g_auto, g_closed, atol=1e-12)
        # the ReLU formula written out: (1/n) sum (f - y) a_j 1[w_j.x + b_j > 0] x
        z = data.x @ p.W[0].T + p.b[0]
        manual = (((f[0] - data.y)[:, None] * (z > 0) * p.a[0]).T @ data.x) / 50
        assert torch.allclose(manual, g_closed[0], atol=1e-12)


def test_symmetric_init_has_zero_output() -> None:
    alg = dm.TwoLayerAlg(width=8, dtype="float64")
    p = alg.init(5, k=2, seed=0)
    assert torch.allclose(alg.forward(p, torch.randn(7, 5, dtype=torch.float64)), torch.zeros(2, 7, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(p.W.norm(dim=2), torch.ones(2, 8, dtype=torch.float64))
    assert set(p.a.abs().flatten().tolist()) == {1 / 8}


def test_real_data_as_s1_matches_exactly(task: dm.MultiIndexTask) -> None:
    alg = dm.TwoLayerAlg(width=16, dtype="float64")
    real = task.sample(300, seed=4, dtype=torch.float64)
    real1, real2 = real.split(200)
    p = alg.init(task.d, k=4, seed=5)
    assert float(dm.gradient_matching_loss(alg, p, real1.x, real1.y, real1.x, real1.y)) == 0.0
    ref = alg.train(real1, seed=9, stage2=real2)
    s1 = dm.RegressionData(real1.x.clone(), real1.y.clone())
    again = alg.train(s1, seed=9, stage2=real2)
    assert torch.equal(ref.W, again.W) and torch.equal(ref.a, again.a)


def test_ridge_readout_equals_lstsq() -> None:
    alg = dm.TwoLayerAlg(width=6, dtype="float64", ridge=1e-2)
    g = torch.Generator().manual_seed(0)
    Phi = torch.rand(1, 40, 6, generator=g, dtype=torch.float64)
    y = torch.randn(40, generator=g, dtype=torch.float64)
    a = alg.readout(Phi, y)[0]
    n = 40
    A = torch.cat([Phi[0] / math.sqrt(n), math.sqrt(1e-2) * torch.eye(6, dtype=torch.float64)])
    rhs = torch.cat([y / math.sqrt(n), torch.zeros(6, dtype=torch.float64)])
    ref = torch.linalg.lstsq(A, rhs[:, None]).solution[:, 0]
    assert torch.allclose(a, ref, atol=1e-10)


def test_stage2_gradient_steps_reach_the_least_squares_oracle(task: dm.MultiIndexTask) -> None:
    alg = dm.TwoLayerAlg(width=16, dtype="float64")
    real = task.sample(600, seed=6, dtype=torch.float64)
    dist = dm.GradientMatchingDistiller(alg, m1=4, steps=20, stage2_steps=2000, stage2_lr=5e-2, stage2_redraw=False,
                                        stage2_inits=3, seed=1)
    ds = dist.fit(real)
    r2 = real.split(dist.split_point(real.n))[1]
    prob = dist.stage2_problem(ds, r2, seed=dist.config.seed + 1)
    y_oracle = prob.lstsq_labels()
    a_gd = prob.readout(alg, ds.y2)
    a_ls = prob.readout(alg, y_oracle.to(ds.y2.dtype))
    rel = float((a_gd - a_ls).norm() / a_ls.norm())
    assert rel < 1e-2
    assert ds.history.stage2_loss[-1] < ds.history.stage2_loss[0]


def test_energy_ratio_of_random_inputs_is_r_over_d() -> None:
    t = dm.MultiIndexTask(d=40, r=4, seed=0)
    x = torch.randn(20_000, 40, generator=torch.Generator().manual_seed(0))
    assert abs(t.energy_ratio(x) - 4 / 40) < 0.01
    assert t.energy_ratio(t.U.T * 3.0) == pytest.approx(1.0)


def test_task_links_and_variance() -> None:
    t = dm.MultiIndexTask(d=10, r=3, seed=1)
    data = t.sample(100_000, seed=0, dtype=torch.float64)
    assert abs(float(data.y.mean())) < 0.05
    assert float(data.y.var()) == pytest.approx(t.variance, rel=0.05)
    assert t.variance == pytest.approx(2.0)
    with pytest.warns(UserWarning, match="information exponent 3"):
        h = dm.MultiIndexTask(d=10, r=2, link="he3")
    assert h.information_exponent == 3
    assert float(h.sample(100_000, seed=1, dtype=torch.float64).y.var()) == pytest.approx(6.0, rel=0.05)
    c = dm.MultiIndexTask(d=6, r=2, link=lambda z: z[:, 0] * z[:, 1])
    assert c.variance == pytest.approx(1.0, rel=0.05)
    # y depends on x only through U^T x
    x = torch.randn(5, 10, dtype=torch.float64)
    perp = torch.randn(5, 10, dtype=torch.float64)
    perp = perp - perp @ t.U @ t.U.T
    assert torch.allclose(t.f(x), t.f(x + perp), atol=1e-10)


def test_determinism_and_inits_redrawn(task: dm.MultiIndexTask) -> None:
    alg = dm.TwoLayerAlg(width=16)
    real = task.sample(400, seed=7)
    kw = dict(m1=4, steps=6, stage2_steps=4, inits_per_step=3, real_batch=100, seed=2)
    a = dm.GradientMatchingDistiller(alg, **kw).fit(real)
    b = dm.GradientMatchingDistiller(alg, **kw).fit(real)
    assert torch.equal(a.x1, b.x1) and torch.equal(a.y2, b.y2)
    assert len(set(a.history.init_digests)) == 6  # every step drew new inits
    c = dm.GradientMatchingDistiller(alg, **{**kw, "seed": 3}).fit(real)
    assert not torch.equal(a.x1, c.x1)
    n1 = alg.train(a, seed=11)
    n2 = alg.train(b, seed=11)
    assert torch.equal(n1.a, n2.a)


def test_memory_accounting_and_save_load(task: dm.MultiIndexTask, tmp_path) -> None:
    alg = dm.TwoLayerAlg(width=16)
    ds = dm.GradientMatchingDistiller(alg, m1=5, steps=3, stage2_steps=3, inits_per_step=2).fit(task.sample(300, 1))
    assert ds.m1 == 5 and ds.m2 == 16
    assert ds.memory_numbers == 5 * (task.d + 1) + 16
    assert ds.memory_bytes == 4 * ds.memory_numbers + 8
    path = ds.save(tmp_path / "d.safetensors")
    back = dm.DistilledSet.load(path)
    assert torch.equal(back.x1, ds.x1) and torch.equal(back.y2, ds.y2) and back.seed2 == ds.seed2
    assert torch.equal(back.stage2_inputs(), ds.stage2_inputs())
    assert torch.equal(alg.train(back, seed=3).a, alg.train(ds, seed=3).a)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(ArtifactError):
        dm.DistilledSet.load(bad)


def test_equal_memory_baselines(task: dm.MultiIndexTask) -> None:
    real = task.sample(500, seed=8)
    assert dm.points_for_memory(392, 32) == 11
    assert dm.points_for_memory(3, 32) == 1
    sub = dm.random_subset(real, 11, seed=0)
    assert sub.n == 11
    kc = dm.k_center_subset(real, 11, seed=0)
    assert kc.n == 11 and len({tuple(r.tolist()) for r in kc.x}) == 11
    with pytest.raises(ValueError):
        dm.random_subset(real, 501)


def test_distillation_concentrates_on_the_task_subspace() -> None:
    """A small end-to-end run: the distilled inputs move into span(U) (energy well above r/d)."""
    t = dm.MultiIndexTask(d=16, r=1, seed=0)
    alg = dm.TwoLayerAlg(width=32)
    real = t.sample(3000, seed=1)
    ds = dm.GradientMatchingDistiller(alg, m1=2, steps=150, stage2_steps=5, inits_per_step=8,
                                      real_batch=1024, seed=0).fit(real)
    assert t.energy_ratio(ds.x1) > 3 / 16


# ------------------------------------------------------------------ bad input


def test_bad_task_and_alg_configs() -> None:
    with pytest.raises(ValueError, match="r must be in"):
        dm.MultiIndexTask(d=3, r=4)
    with pytest.raises(ValueError, match="r must be in"):
        dm.MultiIndexTask(d=3, r=0)
    with pytest.raises(ValueError, match="link"):
        dm.MultiIndexTask(d=3, r=1, link="cubic")
    with pytest.raises(ValueError, match="width"):
        dm.TwoLayerAlg(width=0)
    with pytest.raises(ValueError, match="eta1"):
        dm.TwoLayerAlg(eta1=-1.0)
    with pytest.raises(ValueError, match="ridge"):
        dm.TwoLayerAlg(ridge=0.0)
    with pytest.raises(ValueError, match="m1"):
        dm.DistillConfig(m1=0)
    with pytest.raises(ValueError, match="m1"):
        dm.GradientMatchingDistiller(dm.TwoLayerAlg(), m1=0)
    with pytest.raises(TypeError, match="unknown"):
        dm.GradientMatchingDistiller(dm.TwoLayerAlg(), m3=2)


def test_bad_data() -> None:
    with pytest.raises(ValueError, match="empty"):
        dm.RegressionData(torch.zeros(0, 4), torch.zeros(0))
    with pytest.raises(ValueError, match="NaN"):
        dm.RegressionData(torch.zeros(3, 4), torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="NaN"):
        dm.RegressionData(torch.full((3, 4), float("inf")), torch.zeros(3))
    with pytest.raises(ValueError, match="rows"):
        dm.RegressionData(torch.zeros(3, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="at least 2"):
        dm.GradientMatchingDistiller(dm.TwoLayerAlg(width=4)).fit(dm.RegressionData(torch.zeros(1, 3), torch.zeros(1)))
    with pytest.raises(TypeError):
        dm.TwoLayerAlg().train((torch.zeros(3, 2), torch.zeros(3)))  # type: ignore[arg-type]


def test_exploding_inputs_are_clipped_with_a_warning(task: dm.MultiIndexTask, monkeypatch) -> None:
    monkeypatch.setattr(dm, "CLIP_FACTOR", 1e-3)  # any real point exceeds this norm
    alg = dm.TwoLayerAlg(width=8)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ds = dm.GradientMatchingDistiller(alg, m1=3, steps=2, stage2_steps=1, inits_per_step=2).fit(task.sample(100, 0))
    assert any("clipped" in str(w.message) for w in rec)
    assert float(ds.x1.norm(dim=1).max()) <= 1e-3 * math.sqrt(task.d) * (1 + 1e-5)
    assert ds.history.clipped > 0


def test_registered() -> None:
    from rankwise.core import registry

    e = registry.get("distill_multiindex")
    assert e.config is dm.DistillConfig and e.entry is dm.distill
