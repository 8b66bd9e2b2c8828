"""EBLoRA (rankwise.adapt.stiefel_cl): the spec's correctness checks and bad inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise.adapt import stiefel_cl as eb
from rankwise.adapt.stiefel_cl import functional as fn
from rankwise.core.errors import NumericalError, RankwiseError


def _orth(d: int, r: int, seed: int) -> torch.Tensor:
    return fn.polar(torch.randn(d, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).float()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 16, generator=g)
    y = (X[:, :4].argmax(1) + seed) % 4
    return [(X[i:i + 16], y[i:i + 16]) for i in range(0, n, 16)]


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


# -- math ------------------------------------------------------------------------------------------

def test_projected_gradient_is_tangent_skew():
    U = _orth(20, 4, 0)
    g = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    S = U.T @ fn.project_tangent(U, g)
    torch.testing.assert_close(S, -S.T, atol=1e-6, rtol=0)
    assert S.abs().max() > 1e-3  # not trivially zero


def test_zero_step_retraction_is_identity():
    U = _orth(30, 5, 2)
    F = fn.polar(torch.randn(30, 3, dtype=torch.float64)).float()
    V = fn.polar(fn.project_out(F.double(), torch.randn(30, 5, dtype=torch.float64))).float()
    torch.testing.assert_close(fn.retract(U, U.clone(), 32.0), U, atol=1e-6, rtol=0)
    torch.testing.assert_close(fn.retract(V, V.clone(), 32.0, F), V, atol=1e-6, rtol=0)


def test_balanced_spectrum():
    U, V = _orth(24, 4, 3), _orth(16, 4, 4)
    sv = fn.balanced_spectrum(U, V, -0.37, 2.0)
    torch.testing.assert_close(sv, torch.full((4,), 0.74, dtype=torch.float64), atol=1e-6, rtol=0)
    assert fn.spectrum_ratio(2.0 * -0.37 * U @ V.T, 4) <= 1 + 1e-5
    B, A = torch.randn(24, 4, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    assert abs(fn.factored_spectrum_ratio(B, A) - fn.spectrum_ratio(B @ A, 4)) < 1e-9


def test_gpm_update_orthonormal_energy_and_rank():
    g = torch.Generator().manual_seed(5)
    G = torch.randn(12, 20, generator=g, dtype=torch.float64) @ torch.diag(torch.logspace(0, -3, 20, dtype=torch.float64))
    up = fn.gpm_update(None, G, 0.9)
    F = up.F.double()
    assert 0 < up.added == F.shape[1] <= 20
    torch.testing.assert_close(F.T @ F, torch.eye(F.shape[1], dtype=F.dtype), atol=1e-6, rtol=0)
    K = G.T
    assert float((F.T @ K).square().sum() / K.square().sum()) >= 0.9 - 1e-6
    assert up.retained >= 0.9
    # the residual already satisfies ε: nothing added
    again = fn.gpm_update(up.F, G, 0.9)
    assert again.added == 0 and again.F.shape == up.F.shape
    # ε = 1 caps at the number of directions with energy (never above d_in)
    full = fn.gpm_update(up.F, torch.randn(40, 20, dtype=torch.float64), 1.0)
    assert full.F.shape[1] <= 20
    Ff = full.F.double()
    torch.testing.assert_close(Ff.T @ Ff, torch.eye(Ff.shape[1], dtype=Ff.dtype), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_threshold_outside_unit_interval(bad):
    with pytest.raises(ValueError, match="energy_threshold"):
        eb.EBLoRAConfig(energy_threshold=bad)
    with pytest.raises(ValueError, match="energy_threshold"):
        fn.gpm_update(None, torch.randn(4, 6), bad)


def test_rank_exceeding_free_directions_is_a_clear_error():
    F = _orth(10, 8, 6)
    with pytest.raises(ValueError, match=r"rank 4 exceeds the free input directions .*10 - 8 = 2.*lower energy_threshold"):
        fn.gradient_init(torch.randn(12, 10), F, 4, name="fc")


def test_zero_gradient_falls_back_to_random_directions():
    F = _orth(10, 3, 7)
    G = torch.randn(12, 10) @ (F @ F.T)  # lies entirely in the protected subspace: G (I - F F^T) = 0
    with pytest.warns(UserWarning, match="random orthonormal"):
        U, V = fn.gradient_init(G, F, 4, name="fc")
    torch.testing.assert_close(U.T @ U, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(V.T @ V, torch.eye(4), atol=1e-5, rtol=0)
    assert float((F.T @ V).abs().max()) < 1e-5


def test_nan_gradient_names_the_layer():
    G = torch.randn(12, 10)
    G[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="layer 'enc.fc'"):
        fn.gradient_init(G, None, 2, name="enc.fc")


def test_gradient_init_spans_top_singular_subspace_outside_F():
    g = torch.Generator().manual_seed(8)
    # a gradient with a decaying spectrum, as real ones have (svd_lowrank with q = r needs a spectral gap)
    G = torch.randn(20, 15, generator=g, dtype=torch.float64) @ torch.diag(torch.logspace(0, -2, 15, dtype=torch.float64))
    F = _orth(15, 3, 9).double()
    U, V = fn.gradient_init(G, F, 3)
    Gt = G @ (torch.eye(15, dtype=torch.float64) - F @ F.T)
    Y, S, Zh = torch.linalg.svd(Gt)
    # V spans the top right singular vectors of G̃ (up to rotation): projector distance small
    P1, P2 = V.double() @ V.double().T, Zh[:3].T @ Zh[:3]
    assert float((P1 - P2).abs().max()) < 0.05  # randomized SVD (q = r, 4 power iterations): approximate
    assert float((F.T @ V.double()).abs().max()) < 1e-6


# -- the optimizer ---------------------------------------------------------------------------------

def _stiefel_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    F = _orth(24, 6, seed + 1)
    U = nn.Parameter(_orth(20, 4, seed + 2))
    V = nn.Parameter(fn.polar(fn.project_out(F.double(), torch.randn(24, 4, dtype=torch.float64, generator=g))).float())
    s = nn.Parameter(torch.tensor(0.0))
    T = torch.randn(20, 24, generator=g)
    return U, V, s, F, T


def test_many_steps_stay_on_the_restricted_manifold():
    U, V, s, F, T = _stiefel_problem()
    opt = eb.RiemannianAdamW([{"params": [U, V], "stiefel": True}, {"params": [s]}], lr=1e-2,
                             direction_lr_scale=32.0, protected={V: F})
    losses = []
    for _ in range(300):
        loss = (2.0 * s * U @ V.T - T).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    eye = torch.eye(4)
    U, V = U.detach(), V.detach()
    assert float((U.T @ U - eye).abs().max()) < 1e-5
    assert float((V.T @ V - eye).abs().max()) < 1e-5
    assert float((F.T @ V).abs().max()) < 1e-5
    assert losses[-1] < losses[0]
    errs = opt.orthogonality_errors()
    assert errs["orthogonality"] < 1e-5 and errs["feasibility"] < 1e-5


def test_state_dict_round_trip():
    def build():
        U, V, s, F, T = _stiefel_problem(3)
        opt = eb.RiemannianAdamW([{"params": [U, V], "stiefel": True}, {"params": [s]}], lr=1e-2,
                                 direction_lr_scale=8.0, protected={V: F})
        return U, V, s, T, opt

    def steps(U, V, s, T, opt, n):
        for _ in range(n):
            loss = (s * U @ V.T - T).square().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()

    a = build()
    steps(*a, 5)
    state = copy.deepcopy(a[4].state_dict())  # as torch.save + torch.load would give
    b = build()
    with torch.no_grad():
        for p, q in zip(a[:3], b[:3]):
            q.copy_(p)
    b[4].load_state_dict(state)
    steps(*a, 4)
    steps(*b, 4)
    for p, q in zip(a[:3], b[:3]):
        assert torch.equal(p, q)
    assert b[4].param_groups[0]["direction_lr_scale"] == 8.0


def test_optimizer_rejects_bad_settings():
    p = nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="tall matrix"):
        eb.RiemannianAdamW([{"params": [p], "stiefel": True}])
    with pytest.raises(ValueError, match="direction_lr_scale"):
        eb.RiemannianAdamW([p], direction_lr_scale=0.0)


def test_magnitude_alone_is_a_line_search_along_the_gradient():
    model = _mlp()
    batches = _data()
    eb.adapt(model, eb.EBLoRAConfig(rank=2, target=("2",)), calib=batches, loss_fn=_loss)
    layer = model.get_submodule("2")
    layer.eblora_U["default"].requires_grad_(False)
    layer.eblora_V["default"].requires_grad_(False)
    s = layer.eblora_s["default"]
    loss0 = sum(float(_loss(model, b)) for b in batches)
    loss = sum(_loss(model, b) for b in batches) / len(batches)
    loss.backward()
    assert float(s.grad) > 0  # descent moves s negative, along -G projected on the balanced subspace
    assert layer.eblora_U["default"].grad is None
    opt = torch.optim.SGD([s], lr=0.05)
    opt.step()
    assert float(s) < 0
    assert sum(float(_loss(model, b)) for b in batches) < loss0


# -- the continual driver --------------------------------------------------------------------------

def _three_tasks(model, threshold=0.9, target=("2",)):
    cl = eb.EBLoRAContinual(model, eb.EBLoRAConfig(rank=2, alpha=4, energy_threshold=threshold, target=target),
                            loss_fn=_loss)
    for t in range(3):
        batches = _data(t)
        cl.begin_task(batches)
        opt = cl.optimizer(lr=1e-2)
        for _ in range(5):
            for b in batches:
                loss = _loss(model, b)
                opt.zero_grad()
                loss.backward()
                opt.step()
        errs = opt.orthogonality_errors()
        assert errs["orthogonality"] < 1e-5 and errs["feasibility"] < 1e-5
        cl.end_task(batches)
    return cl


def test_task_start_is_the_previous_model_and_updates_are_balanced():
    model = _mlp()
    x = _data(9)[0][0]
    cl = eb.EBLoRAContinual(model, eb.EBLoRAConfig(rank=2, alpha=4, energy_threshold=0.9, target=("0", "2")),
                            loss_fn=_loss)
    for t in range(2):
        y0 = model(x)
        cl.begin_task(_data(t))
        assert torch.equal(model(x), y0)  # s = 0: exactly the previous model
        opt = cl.optimizer(lr=1e-2)
        for b in _data(t):
            _loss(model, b).backward()
            opt.step()
            opt.zero_grad()
        rec = cl.end_task(_data(t))
        assert all(abs(r - 1.0) < 1e-4 for r in rec.spectrum_ratio.values())
        for _, layer in cl.layers():
            F = layer.protected.double()
            torch.testing.assert_close(F.T @ F, torch.eye(F.shape[1], dtype=F.dtype), atol=1e-5, rtol=0)


def test_state_saves_and_reloads_bit_exactly(tmp_path):
    model = _mlp()
    cl = _three_tasks(model)
    path = cl.save(tmp_path / "state.safetensors")
    fresh = _mlp()
    cl2 = eb.EBLoRAContinual.load(fresh, path, loss_fn=_loss)
    x = _data(5)[0][0]
    assert torch.equal(fresh(x), model(x))
    for (n, a), (m, b) in zip(cl.layers(), cl2.layers()):
        assert n == m and torch.equal(a.protected, b.protected)
        assert torch.equal(a.base_layer.weight, b.base_layer.weight)
    assert [t.name for t in cl2.tasks] == ["task0", "task1", "task2"]
    for t in cl.deltas:
        for layer, (U, V, s, c) in cl.deltas[t].items():
            U2, V2, s2, c2 = cl2.deltas[t][layer]
            assert torch.equal(U, U2) and torch.equal(V, V2) and torch.equal(s, s2) and c == c2
    # resume: the next task continues from the restored bases
    cl2.begin_task(_data(3))
    assert cl2.current == "task3"


def test_task_update_exports_as_a_peft_lora_directory(tmp_path):
    peft = pytest.importorskip("peft")
    model = _mlp()
    base = _mlp()
    batches = _data()
    cl = eb.EBLoRAContinual(model, eb.EBLoRAConfig(rank=2, alpha=4, target=("0", "2")), loss_fn=_loss)
    cl.begin_task(batches)
    opt = cl.optimizer(lr=1e-2)
    for b in batches:
        _loss(model, b).backward()
        opt.step()
        opt.zero_grad()
    out = cl.export_peft(tmp_path / "peft")
    x = batches[0][0]
    y = model(x)
    loaded = peft.PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(loaded(x), y, atol=1e-5, rtol=0)
    state = eb.peft_state(model, "task0")
    layer = model.get_submodule("2")
    torch.testing.assert_close(state.factors["2"]["lora_B"] @ state.factors["2"]["lora_A"],
                               layer.delta_weight("task0"), atol=1e-6, rtol=0)


def test_full_protected_subspace_warns_and_stops_protecting():
    model = _mlp()
    cl = eb.EBLoRAContinual(model, eb.EBLoRAConfig(rank=2, target=("0",)), loss_fn=_loss)
    layer_name = "0"
    cl.begin_task(_data(0))
    cl.end_task(_data(0))
    layer = model.get_submodule(layer_name)
    layer.set_protected(torch.eye(16))
    with pytest.warns(UserWarning, match="stops protecting"):
        cl.begin_task(_data(1))
    assert layer.protected.shape[1] == 0


def test_bad_inputs():
    model = _mlp()
    with pytest.raises(ValueError, match="no batch"):
        eb.adapt(model, eb.EBLoRAConfig(rank=2, target=("0",)), calib=[], loss_fn=_loss)
    with pytest.raises(ValueError, match="gradient batches"):
        eb.adapt(model, eb.EBLoRAConfig(rank=2, target=("0",)), calib=None, loss_fn=_loss)
    with pytest.raises(ValueError, match="EBLoRAConfig.rank"):
        eb.EBLoRAConfig(rank=0)
    cl = eb.EBLoRAContinual(model, eb.EBLoRAConfig(rank=2, target=("0",)), loss_fn=_loss)
    with pytest.raises(RankwiseError, match="no task is open"):
        cl.end_task(_data())
    with pytest.raises(ValueError, match="exceeds the free input directions"):
        cl2 = eb.EBLoRAContinual(_mlp(), eb.EBLoRAConfig(rank=2, target=("0",)), loss_fn=_loss)
        cl2.begin_task(_data())
        cl2.end_task(_data())
        cl2.layers()[0][1].set_protected(fn.polar(torch.randn(16, 15, dtype=torch.float64)).float())
        cl2.begin_task(_data(1))


def test_registered():
    from rankwise.core import registry

    registry.discover()
    assert registry.get("stiefel_cl").config is eb.EBLoRAConfig
