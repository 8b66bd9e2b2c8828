"""PSOFT: the spec's correctness checks (identity at init, Cayley orthogonality and Neumann accuracy,
preserved geometry on either side, parameter count, LoRA-XS as a special case, merge), agreement with
PEFT's PSOFT, and the bad inputs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import rankwise_tests_adapt_contract as contract  # registered by conftest.py
from rankwise.adapt import psoft
from rankwise.core.errors import NumericalError, RankwiseError, SelectionError

TARGETS = ("query", "key", "value", "attention.output.dense")


def _random_q(r: int, norm: float, seed: int = 0) -> torch.Tensor:
    q = torch.randn(r * (r - 1) // 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    Q = psoft.skew_from_params(q, r)
    return q * (norm / float(torch.linalg.matrix_norm(Q, 2)))


def _set_core(model: nn.Module, seed: int, q_norm: float = 0.3) -> None:
    """Stand-in for training: a skew part of a given spectral norm and vectors near 1, per layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (_, layer) in enumerate(psoft.psoft_layers(model)):
            for c in layer.psoft.values():
                if c.q is not None:
                    c.q.copy_(_random_q(c.r, q_norm, seed + i))
                if c.R is not None:
                    c.R.add_(0.1 * torch.randn(c.R.shape, generator=g))
                for v in (c.alpha, c.beta):
                    if v is not None:
                        v.copy_(1 + 0.1 * torch.randn(v.shape, generator=g))


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------

def test_skew_parametrisation():
    q = torch.arange(1.0, 7.0)
    Q = psoft.skew_from_params(q, 4)
    torch.testing.assert_close(Q, -Q.T)
    assert Q[1, 0] == 1.0 and Q[2, 0] == 2.0 and Q[3, 0] == 3.0 and Q[2, 1] == 4.0  # PEFT's triu order, transposed
    with pytest.raises(ValueError, match="r\\(r-1\\)/2 = 6"):
        psoft.skew_from_params(torch.zeros(5), 4)


def test_exact_cayley_is_orthogonal_and_neumann_converges_at_the_predicted_rate():
    r = 12
    for norm in (0.3, 2.0):
        R = psoft.cayley(psoft.skew_from_params(_random_q(r, norm), r).float(), None)
        assert float(torch.linalg.matrix_norm(R.T @ R - torch.eye(r))) < 1e-5
    Q = psoft.skew_from_params(_random_q(r, 0.4, seed=1), r)
    exact = psoft.cayley(Q, None)
    errors = []
    for t in range(0, 8):
        err = float(torch.linalg.matrix_norm(psoft.cayley(Q, t) - exact, 2))
        # R - R_t = (I - Q) sum_{k > t} (-Q)^k: at most (1 + q) q^{t+1} / (1 - q) in spectral norm
        assert err <= (1 + 0.4) * 0.4 ** (t + 1) / (1 - 0.4) + 1e-12
        errors.append(err)
    assert all(b < a for a, b in zip(errors, errors[1:]))
    torch.testing.assert_close(psoft.cayley(Q, 0), torch.eye(r, dtype=Q.dtype) - Q)


@pytest.mark.parametrize("side", ["output", "input"])
def test_geometry_is_preserved_on_the_orthonormal_side(side):
    torch.manual_seed(0)
    W = torch.randn(40, 30, dtype=torch.float64)
    B, A, S = psoft.principal_factors(W, 8, side)
    U, S_full, Vh = torch.linalg.svd(W, full_matrices=False)
    torch.testing.assert_close(B @ A, (U[:, :8] * S_full[:8]) @ Vh[:8])
    M = psoft.cayley(psoft.skew_from_params(_random_q(8, 0.7), 8), None)  # alpha = beta = 1, exact Cayley
    eye = torch.eye(8, dtype=torch.float64)
    if side == "input":
        torch.testing.assert_close((B @ M).T @ (B @ M), eye, atol=1e-10, rtol=0)
        torch.testing.assert_close((B @ M @ A).T @ (B @ M @ A), A.T @ A, atol=1e-8, rtol=0)  # column Gram kept
    else:
        torch.testing.assert_close((M @ A) @ (M @ A).T, eye, atol=1e-10, rtol=0)
        torch.testing.assert_close((B @ M @ A) @ (B @ M @ A).T, B @ B.T, atol=1e-8, rtol=0)  # neuron angles kept


def test_trainable_count_and_budget_helper():
    assert psoft.num_parameters(38) == 38 * 37 // 2 + 2 * 38 == 779
    assert psoft.num_parameters(27, orth=False, train_alpha=False, train_beta=False) == 729
    assert psoft.rank_for_budget(768) == 38
    assert psoft.rank_for_budget(768, mode="floor") == 37
    model = contract.tiny_model("bert")
    psoft.adapt(model, psoft.PSOFTConfig(r=6), target=TARGETS)
    n_layers = len(psoft.psoft_layers(model))
    assert n_layers == 8
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == n_layers * (15 + 12)


def test_output_at_init_equals_pretrained_on_every_variant():
    y0 = contract.forward(contract.tiny_model("bert"), "bert")
    for cfg in (psoft.PSOFTConfig(r=8), psoft.PSOFTConfig(r=8, cayley="exact", singular_values_on="input"),
                psoft.PSOFTConfig(r=8, orth=False, train_alpha=False, train_beta=False)):
        model = psoft.adapt(contract.tiny_model("bert"), cfg, target=TARGETS)
        torch.testing.assert_close(contract.forward(model, "bert"), y0, atol=1e-5, rtol=0)


def test_without_orth_and_vectors_it_is_lora_xs_with_a_residual():
    torch.manual_seed(0)
    base = nn.Linear(24, 16)
    model = psoft.adapt(nn.Sequential(base), psoft.PSOFTConfig(r=5, orth=False, train_alpha=False,
                                                             train_beta=False), target="0")
    core = model[0].psoft["default"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["0.psoft.default.R"]
    with torch.no_grad():
        core.R.copy_(torch.randn(5, 5))
    x = torch.randn(6, 24)
    W_res = model[0].base_layer.weight - core.B @ core.A
    expected = x @ (W_res + core.B @ core.R @ core.A).T + model[0].base_layer.bias
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_merge_reproduces_unmerged_outputs_and_unload_gives_plain_layers():
    model = psoft.adapt(contract.tiny_model("bert"), psoft.PSOFTConfig(r=8), target=TARGETS)
    _set_core(model, 3)
    y = contract.forward(model, "bert")
    psoft.merge(model)
    torch.testing.assert_close(contract.forward(model, "bert"), y, atol=1e-5, rtol=0)
    psoft.unmerge(model)
    torch.testing.assert_close(contract.forward(model, "bert"), y, atol=1e-5, rtol=0)
    psoft.unload(model)
    assert not psoft.psoft_layers(model)
    torch.testing.assert_close(contract.forward(model, "bert"), y, atol=1e-5, rtol=0)


def test_training_steps_reduce_a_loss_and_the_report_tracks_orthogonality():
    model = psoft.adapt(contract.tiny_model("bert"), psoft.PSOFTConfig(r=8, train_alpha=False, train_beta=False,
                                                                       cayley="exact"), target=TARGETS)
    calib, loss_fn = contract._calibration("bert", 0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(6):
        loss = loss_fn(model, calib[0])
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0]
    rows = psoft.orthogonality_report(model)
    assert len(rows) == 8 and all(row["orth_error"] < 1e-5 for row in rows)  # exact Cayley, no vectors
    assert all(row["q_norm"] > 0 for row in rows)


# ------------------------------------------------------------------------------------------------
# PEFT's PSOFT
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("neumann,eps,scale", [(None, None, 0.05), (5, None, 0.05), (7, 0.5, 0.3)])
def test_same_function_as_peft_psoft_with_singular_values_on_the_output_side(neumann, eps, scale):
    """Same frozen factors and same (q, alpha, beta) -> same outputs; PEFT's t terms are our t - 2,
    PEFT's cayley_neumann_eps is our neumann_eps."""
    from peft import PsoftConfig, inject_adapter_in_model

    r = 6
    ref = contract.tiny_model("bert")
    y0 = contract.forward(ref, "bert")
    peft_cfg = PsoftConfig(r=r, target_modules=list(TARGETS), psoft_alpha=r,
                           use_cayley_neumann=neumann is not None,
                           num_cayley_neumann_terms=5 if neumann is None else neumann, cayley_neumann_eps=eps)
    peft_model = inject_adapter_in_model(peft_cfg, contract.tiny_model("bert"))
    ours = psoft.adapt(contract.tiny_model("bert"), psoft.PSOFTConfig(
        r=r, cayley="exact" if neumann is None else "neumann", neumann_terms=0 if neumann is None else neumann - 2,
        neumann_eps=eps), target=TARGETS)
    torch.testing.assert_close(contract.forward(peft_model, "bert"), y0, atol=1e-5, rtol=0)  # identity at init
    torch.testing.assert_close(contract.forward(ours, "bert"), y0, atol=1e-5, rtol=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (name, layer) in psoft.psoft_layers(ours):
            peft_layer = peft_model.get_submodule(name)
            A, B = peft_layer._get_psoft_ab_cache_buffers("default")
            s = peft_layer.scaling["default"]
            # our principal factors agree with PEFT's psoft_init up to the SVD's sign per direction
            core = layer.psoft["default"]
            torch.testing.assert_close(core.B @ core.A, s * B @ A, atol=1e-4, rtol=1e-4)
            core.A.copy_(A)
            core.B.copy_(s * B)
            R = peft_layer.psoft_R["default"]
            R.weight.copy_(scale * torch.randn(R.weight.shape, generator=g))
            R.vector_a.copy_(1 + 0.1 * torch.randn(r, generator=g))
            R.vector_b.copy_(1 + 0.1 * torch.randn(r, generator=g))
            core.q.copy_(R.weight)
            core.alpha.copy_(R.vector_a)
            core.beta.copy_(R.vector_b)
            torch.testing.assert_close(core.matrix(), R.get_matrix(), atol=1e-6, rtol=0)
    torch.testing.assert_close(contract.forward(ours, "bert"), contract.forward(peft_model, "bert"), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# bad input and edge cases
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=0), "rank must be"),
    (dict(cayley="pade"), "cayley"),
    (dict(neumann_terms=-1), "neumann_terms"),
    (dict(neumann_eps=1.0), "neumann_eps"),
    (dict(orth=1), "orth"),
    (dict(singular_values_on="both"), "singular_values_on"),
    (dict(dropout=-0.1), "dropout"),
    (dict(target=[]), "target"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        psoft.PSOFTConfig(**kwargs)


def test_rank_above_layer_size_is_rejected_without_changes():
    model = contract.tiny_model("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"r=33 for layer .* exceeds min\(in_features=32, out_features=32\)"):
        psoft.adapt(model, psoft.PSOFTConfig(r=33), target=TARGETS)
    assert not psoft.psoft_layers(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_r_equal_one_warns_and_trains_only_the_vectors():
    with pytest.warns(UserWarning, match="skew-symmetric part is empty"):
        model = psoft.adapt(contract.tiny_model("mlp"), psoft.PSOFTConfig(r=1), target=nn.Linear)
    names = [n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad]
    assert set(names) == {"q", "alpha", "beta"}
    assert all(p.numel() in (0, 1) for p in model.parameters() if p.requires_grad)


def test_neumann_warns_when_q_is_large():
    model = psoft.adapt(contract.tiny_model("mlp"), psoft.PSOFTConfig(r=6), target=nn.Linear)
    core = model[0].psoft["default"]
    with torch.no_grad():
        core.q.copy_(_random_q(6, 1.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward pass does not check (it would have to read the norm back)
        y = contract.forward(model, "mlp")
    assert torch.isfinite(y).all()
    with pytest.warns(UserWarning, match="spectral norm of Q is 1.500 > 0.9.*cayley='exact'") as caught:
        model.eval()  # the end of a training phase: checked here
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per adapter, not every time
        model.train()
        model.eval()
        y2 = contract.forward(model, "mlp")
        assert psoft.check_neumann(model) == []
    assert torch.equal(y, y2)
    fresh = psoft.adapt(contract.tiny_model("mlp"), psoft.PSOFTConfig(rank=6), target=nn.Linear)
    with torch.no_grad():
        fresh[0].psoft["default"].q.copy_(_random_q(6, 1.5))
    with pytest.warns(UserWarning, match="spectral norm of Q is 1.500"):
        assert psoft.check_neumann(fresh) == ["0/default"]


def test_debug_switch_checks_in_the_forward_pass(monkeypatch):
    from rankwise.adapt.psoft import layer as psoft_layer

    monkeypatch.setattr(psoft_layer, "SYNC_CHECKS", True)
    model = psoft.adapt(contract.tiny_model("mlp"), psoft.PSOFTConfig(rank=6), target=nn.Linear)
    with torch.no_grad():
        model[0].psoft["default"].q.copy_(_random_q(6, 1.5))
    with pytest.warns(UserWarning, match="spectral norm of Q is 1.500") as record:
        contract.forward(model, "mlp")
    assert any("spectral norm of Q" in str(w.message) for w in record)


def _no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way of reading a tensor value back to Python raise (a host sync on an accelerator)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("host synchronisation on the forward/backward path")
    for attr in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)


@pytest.mark.parametrize("cfg", [dict(), dict(cayley="exact"), dict(neumann_eps=0.5), dict(orth=False),
                                 dict(singular_values_on="input", neumann_terms=7)])
@pytest.mark.parametrize("q_norm", [0.3, 1.5])
def test_forward_and_backward_never_read_tensors_back_to_the_host(monkeypatch, cfg, q_norm):
    model = psoft.adapt(contract.tiny_model("mlp"), psoft.PSOFTConfig(rank=6, **cfg), target=nn.Linear)
    _set_core(model, 1, q_norm)
    x = contract.inputs("mlp")
    model.train()
    expected = contract.forward(model, "mlp", x)
    with monkeypatch.context() as m:
        _no_host_reads(m)
        y = model(x)
        y.square().sum().backward()
    assert torch.equal(y.detach(), expected)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _cayley_with_branch(Q: torch.Tensor, terms: int, eps: float) -> torch.Tensor:
    """The former implementation: rescale decided on the host."""
    norm = torch.linalg.matrix_norm(Q, "fro")
    if bool(torch.isfinite(norm.detach())) and float(norm.detach()) > eps:
        Q = Q * (eps / (norm + 1e-12))
    return psoft.cayley(Q, terms)


@pytest.mark.parametrize("norm", [0.0, 0.2, 0.5, 3.0])
def test_branch_free_rescaling_gives_the_same_values_and_gradients(norm):
    r, eps = 6, 0.5
    q0 = _random_q(r, norm) if norm else torch.zeros(r * (r - 1) // 2, dtype=torch.float64)
    outs = []
    for fn in (lambda Q: psoft.cayley(Q, 5, eps), lambda Q: _cayley_with_branch(Q, 5, eps)):
        q = q0.float().clone().requires_grad_(True)
        R = fn(psoft.skew_from_params(q, r))
        (R * torch.arange(r * r, dtype=R.dtype).reshape(r, r)).sum().backward()
        outs.append((R.detach(), q.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    Q = psoft.skew_from_params(q0, r)
    assert torch.equal(psoft.cayley(Q, None), psoft.cayley(Q, None, check=False))


def test_non_finite_and_rank_deficient_weights():
    model = nn.Sequential(nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="layer '0'.*NaN or inf"):
        psoft.adapt(model, psoft.PSOFTConfig(r=2), target="0")
    low = nn.Sequential(nn.Linear(8, 8))
    with torch.no_grad():
        low[0].weight.copy_(torch.outer(torch.randn(8), torch.randn(8)))  # rank one
    with pytest.warns(UserWarning, match="singular values of the weight are \\(numerically\\) zero"):
        psoft.adapt(low, psoft.PSOFTConfig(r=3), target="0")


def test_transformers_conv1d_layers_are_handled_by_transposition():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(12, 20))  # GPT-2 style: weight (in=20, out=12)
    x = torch.randn(3, 20)
    with torch.no_grad():
        y0 = model(x)
    psoft.adapt(model, psoft.PSOFTConfig(r=4), target="0")
    _set_core(model, 1)
    with torch.no_grad():
        torch.testing.assert_close(model(x) - y0, x @ model[0].delta_weight("default").T, atol=1e-5, rtol=0)
        y = model(x)
        psoft.merge(model)
        torch.testing.assert_close(model(x), y, atol=1e-5, rtol=0)


def test_selection_errors():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Conv2d(3, 3, 1), nn.Linear(8, 8))
    with pytest.raises(NotImplementedError, match="linear layers"):
        psoft.adapt(model, psoft.PSOFTConfig(r=2), target=nn.Conv2d)
    with pytest.raises(SelectionError, match="Available Linear layers: 2"):
        psoft.adapt(model, psoft.PSOFTConfig(r=2), target="missing")
    psoft.adapt(model, psoft.PSOFTConfig(r=2), target="2")
    with pytest.raises(ValueError, match="already has an adapter named 'default'"):
        psoft.adapt(model, psoft.PSOFTConfig(r=2), target="2")
    psoft.merge(model)
    with pytest.raises(RankwiseError, match="already merged"):
        psoft.merge(model)


def test_registered():
    from rankwise.core.registry import get

    entry = get("psoft")
    assert entry.config is psoft.PSOFTConfig and entry.entry is psoft.adapt


def test_neumann_eps_caps_the_generator_norm_and_silences_the_warning():
    r = 6
    Q = psoft.skew_from_params(_random_q(r, 3.0), r)
    R = psoft.cayley(Q, 5, eps=0.5)
    Qs = Q * (0.5 / float(torch.linalg.matrix_norm(Q, "fro")))
    torch.testing.assert_close(R, psoft.cayley(Qs, 5))
    model = psoft.adapt(contract.tiny_model("mlp"), psoft.PSOFTConfig(r=6, neumann_eps=0.5), target=nn.Linear)
    with torch.no_grad():
        model[0].psoft["default"].q.copy_(_random_q(6, 1.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        contract.forward(model, "mlp")
