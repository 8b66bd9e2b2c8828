import types

import pytest
import torch
from torch import nn

from rankwise.core.errors import ArtifactError, NumericalError, SelectionError
from rankwise.core.stats import CalibrationError, LayerStats, StatsCollector, collect

D = torch.float64
ALL = ("input_cov", "input_mean", "input_abs_mean", "output_cov", "output_mean", "kfac", "fisher_diag")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Net(nn.Module):
    """fc1 -> tanh -> fc2, plus an unused head; tokens (B, T, 6) -> (B, T, 4)."""

    def __init__(self, dtype=D):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.enc = nn.ModuleDict({"fc1": nn.Linear(6, 5, dtype=dtype), "fc2": nn.Linear(5, 4, dtype=dtype)})
        self.head = nn.Linear(4, 2, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))

    def forward(self, x, scale=1.0):
        return self.enc["fc2"](torch.tanh(self.enc["fc1"](x * scale)))


def sq_loss(out, batch):
    return (out ** 2).sum() + out.sum()


def data(n_samples=10, T=3, seed=0):
    return torch.randn(n_samples, T, 6, generator=torch.Generator().manual_seed(seed), dtype=D)


def reference(model, X):
    """One-shot statistics on the concatenated data, with autograd for the gradients."""
    fc1, fc2 = model.enc["fc1"], model.enc["fc2"]
    h_in = X.requires_grad_(False)
    y1 = fc1(h_in)
    a = torch.tanh(y1)
    y2 = fc2(a)
    loss = sq_loss(y2, None)
    g1, g2 = torch.autograd.grad(loss, [y1, y2])
    ref = {}
    for name, x, y, g, lay in (("enc.fc1", h_in, y1, g1, fc1), ("enc.fc2", a, y2, g2, fc2)):
        x2, y2_, g2_ = x.reshape(-1, x.shape[-1]).detach(), (y - lay.bias).reshape(-1, y.shape[-1]).detach(), g.reshape(-1, g.shape[-1])
        per_sample = torch.einsum("btm,btn->bmn", g, x.detach())
        ref[name] = dict(xtx=x2.T @ x2, x_sum=x2.sum(0), x_abs_sum=x2.abs().sum(0), yty=y2_.T @ y2_,
                         y_sum=y2_.sum(0), kfac_xtx=x2.T @ x2, gtg=g2_.T @ g2_,
                         fisher_sample=per_sample.square().sum(0), n=x2.shape[0])
    return ref


def splits(X, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(X[i:i + s])
        i += s
    assert i == X.shape[0]
    return out


def test_statistics_equal_one_shot_computation():
    model = Net()
    X = data()
    ref = reference(model, X)
    st = collect(model, splits(X, [3, 3, 4]), "re:enc\\..*", ALL, loss_fn=sq_loss, fisher="sample")
    assert list(st) == ["enc.fc1", "enc.fc2"]
    for name, r in ref.items():
        s = st[name]
        assert s.n_tokens == s.n_grad_tokens == r["n"] == 30 and s.n_fisher == 10
        for f in ("xtx", "x_sum", "x_abs_sum", "yty", "y_sum", "kfac_xtx", "gtg"):
            assert torch.allclose(getattr(s, f), r[f], rtol=1e-10, atol=1e-12), f
        assert torch.allclose(s.fisher, r["fisher_sample"], rtol=1e-10, atol=1e-12)
        assert s.xtx.dtype == D
        assert torch.allclose(s.input_cov(), r["xtx"] / 30)
        assert torch.allclose(s.input_cov(normalized=False), r["xtx"])
        assert torch.allclose(s.output_cov(), r["yty"] / 30)
        assert torch.allclose(s.input_mean(), r["x_sum"] / 30)
        assert torch.allclose(s.input_abs_mean(), r["x_abs_sum"] / 30)
        assert torch.allclose(s.output_mean(), r["y_sum"] / 30)
        A, G = s.kfac_factors()
        assert torch.allclose(A, r["xtx"] / 30) and torch.allclose(G, r["gtg"] / 30)
        assert torch.allclose(s.grad_cov(), G)
        assert torch.allclose(s.fisher_diag(), r["fisher_sample"] / 10)
        assert torch.allclose(s.fisher_rows(normalized=False), r["fisher_sample"].sum(1))


def test_centered_covariance_and_output_bias():
    model = Net()
    X = data()
    st = collect(model, [X], "enc.fc1", ("input_cov", "input_mean", "output_cov"), output_bias=True)["enc.fc1"]
    x2 = X.reshape(-1, 6)
    assert torch.allclose(st.input_cov(centered=True), torch.cov(x2.T, correction=0), atol=1e-12)
    y = model.enc["fc1"](x2).detach()
    assert st.output_bias and torch.allclose(st.output_cov(normalized=False), y.T @ y)
    with pytest.raises(CalibrationError, match="output_mean"):
        st.output_cov(centered=True)
    with pytest.raises(CalibrationError, match="not collected"):
        st.kfac_factors()


def test_invariant_to_batch_split_and_order():
    model = Net()
    X = data(12)
    kinds = ("input_cov", "output_cov", "input_mean", "kfac", "fisher_diag")
    a = collect(model, splits(X, [12]), "enc.*", kinds, loss_fn=sq_loss, fisher="sample")
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    b = collect(model, splits(X[perm], [1, 5, 2, 4]), "enc.*", kinds, loss_fn=sq_loss, fisher="sample")
    for name in a:
        for f, t in a[name].tensors().items():
            assert torch.allclose(t, getattr(b[name], f), rtol=1e-10, atol=1e-12), (name, f)


def test_per_batch_fisher_is_sum_of_squared_batch_gradients():
    model = Net()
    X = data(9)
    batches = splits(X, [2, 3, 4])
    st = collect(model, batches, "enc.fc1", ("fisher_diag",), loss_fn=sq_loss)["enc.fc1"]
    w = model.enc["fc1"].weight
    ref = torch.zeros_like(w)
    for b in batches:
        (g,) = torch.autograd.grad(sq_loss(model(b), None), [w])
        ref += g ** 2
    assert st.n_fisher == 3 and not st.fisher_per_sample
    assert torch.allclose(st.fisher_diag(normalized=False), ref, rtol=1e-10)
    assert w.grad is None  # the collector never populates .grad


def test_module_called_twice_squares_the_summed_gradient():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3, dtype=D)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    model = Shared()
    X = torch.randn(4, 3, dtype=D)
    for mode in ("batch", "sample"):
        st = collect(model, [X[:2], X[2:]], "fc", ("fisher_diag", "input_cov"), loss_fn=sq_loss, fisher=mode)["fc"]
        ref = torch.zeros(3, 3, dtype=D)
        for b in ([X[:2], X[2:]] if mode == "batch" else [X[i:i + 1] for i in range(4)]):
            (g,) = torch.autograd.grad(sq_loss(model(b), None), [model.fc.weight])
            ref += g ** 2
        assert torch.allclose(st.fisher, ref, rtol=1e-10), mode
        assert st.n_tokens == 8  # both calls counted


def test_frozen_model_and_flags_untouched():
    model = Net().requires_grad_(False)
    model.train()
    st = collect(model, [data(4)], "enc.fc2", ("kfac",), loss_fn=sq_loss)
    assert st["enc.fc2"].n_grad_tokens == 12
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert model.training and all(m.training for m in model.modules())


def test_eval_mode_makes_dropout_deterministic():
    model = nn.Sequential(nn.Linear(4, 8, dtype=D), nn.Dropout(0.5), nn.Linear(8, 2, dtype=D)).train()
    X = torch.randn(16, 4, dtype=D)
    a = collect(model, [X], "2", ("input_cov",))["2"]
    b = collect(model, [X], "2", ("input_cov",))["2"]
    assert torch.equal(a.xtx, b.xtx) and model.training
    h = model[0](X).detach()
    assert torch.allclose(a.xtx, h.T @ h)


def test_collector_memory_constant_in_number_of_batches():
    model = Net()
    col = StatsCollector(model, "enc.*", ALL, fisher="sample")
    sizes = []
    with col:
        for i in range(12):
            col.run(data(3, seed=i), loss_fn=sq_loss)
            sizes.append(col.state_numel())
            assert all(lay.pending is None for lay in col.layers.values())
    assert len(set(sizes)) == 1
    assert sizes[0] == (36 + 6 + 6 + 25 + 5 + 36 + 25 + 30) + (25 + 5 + 5 + 16 + 4 + 25 + 16 + 20)


def test_attention_mask_excludes_padding():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 5, dtype=D)

        def forward(self, input_ids, attention_mask):
            return self.fc(input_ids)

    model = M()
    X = data(4, T=5)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    st = collect(model, [{"input_ids": X, "attention_mask": mask}], "fc", ("input_cov", "kfac"),
                 loss_fn=sq_loss)["fc"]
    kept = X[mask.bool()]
    assert st.n_tokens == st.n_grad_tokens == int(mask.sum()) == kept.shape[0]
    assert torch.allclose(st.xtx, kept.T @ kept)
    assert torch.allclose(st.kfac_xtx, kept.T @ kept)
    nomask = collect(model, [{"input_ids": X, "attention_mask": mask}], "fc", ("input_cov",), mask=None)["fc"]
    assert nomask.n_tokens == 20


def test_nan_input_raises_naming_layer_and_removes_hooks():
    model = Net()
    X = data(4)
    X[1, 2, 3] = float("nan")
    with pytest.raises(NumericalError, match="enc.fc1"):
        collect(model, [data(2), X], "enc.*", ("input_cov",))
    assert all(not m._forward_hooks for m in model.modules())
    model2 = Net()
    with torch.no_grad():
        model2.enc["fc2"].weight[0, 0] = float("inf")
    with pytest.raises(NumericalError, match="enc.fc2"):
        collect(model2, [data(2)], "enc.*", ("output_cov",))


def test_hooks_removed_after_error_in_user_forward():
    model = Net()

    def bad_forward(m, batch):
        m(batch)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        collect(model, [data(2)], None, ("input_cov", "kfac"), forward=bad_forward, loss_fn=sq_loss)
    assert all(not m._forward_hooks for m in model.modules())
    col = StatsCollector(model, "enc.*")
    with pytest.raises(ValueError):
        with col:
            assert all(model.enc[k]._forward_hooks for k in ("fc1", "fc2"))
            raise ValueError("user error")
    assert not col.attached and all(not m._forward_hooks for m in model.modules())


def test_empty_calibration_and_unreached_layers():
    model = Net()
    with pytest.raises(CalibrationError, match="empty"):
        collect(model, [], "enc.*")
    with pytest.raises(CalibrationError, match="head"):
        collect(model, [data(2)], None, ("input_cov",))  # head is never called
    with pytest.raises(CalibrationError, match="no gradient"):
        collect(model, [data(2)], "enc.fc1", ("kfac",), loss_fn=lambda o, b: torch.zeros((), requires_grad=True))
    with pytest.raises(CalibrationError, match="zero"):
        collect(model, [data(2)], "enc.fc1", ("kfac",), loss_fn=lambda o, b: (o * 0).sum())
    with pytest.raises(CalibrationError, match="zero"):
        collect(model, [data(2)], "enc.fc1", ("fisher_diag",), loss_fn=lambda o, b: (o * 0).sum())
    mask = torch.zeros(2, 3)
    with pytest.raises(CalibrationError, match="masked"):
        collect(model, [data(2)], "enc.*", mask=mask)
    st = LayerStats("x", 2, 2, xtx=torch.zeros(2, 2, dtype=D))
    with pytest.raises(CalibrationError, match="zero tokens"):
        st.input_cov()


def test_bad_arguments():
    model = Net()
    with pytest.raises(ValueError, match="kinds"):
        StatsCollector(model, "enc.*", ("input_covariance",))
    with pytest.raises(ValueError, match="fisher"):
        StatsCollector(model, "enc.*", ("fisher_diag",), fisher="token")
    with pytest.raises(SelectionError, match="Available"):
        StatsCollector(model, "decoder.*")
    with pytest.raises(ValueError, match="need a loss"):
        collect(model, [data(2)], "enc.*", ("kfac",))
    with pytest.raises(ValueError, match="scalar"):
        collect(model, [data(2)], "enc.*", ("kfac",), loss_fn=lambda o, b: o)
    with pytest.raises(NumericalError, match="loss"):
        collect(model, [data(2)], "enc.*", ("kfac",), loss_fn=lambda o, b: o.sum() * float("nan"))
    with pytest.raises(RuntimeError, match="attach"):
        StatsCollector(model, "enc.*").run(data(2))
    with pytest.raises(TypeError):
        StatsCollector("not a model")

    class TupleOut(nn.Module):
        def forward(self, x):
            return x * 2, x

    tm = nn.Sequential(nn.Linear(6, 6, dtype=D), TupleOut())
    assert collect(tm, [data(2)], "1", ("input_cov",), types=None)["1"].n_tokens == 6
    with pytest.raises(TypeError, match="not a tensor"):
        collect(tm, [data(2)], "1", ("kfac",), types=None, loss_fn=lambda o, b: o[0].sum())


def test_batches_as_dict_tuple_tensor_and_custom_forward():
    model = Net()
    X = data(4)
    ref = collect(model, [X], "enc.fc1")["enc.fc1"].xtx
    assert torch.allclose(collect(model, [(X, 1.0)], "enc.fc1")["enc.fc1"].xtx, ref)
    assert torch.allclose(collect(model, [{"x": X, "scale": 1.0}], "enc.fc1")["enc.fc1"].xtx, ref)
    st = collect(model, [{"feats": X}], "enc.fc1", forward=lambda m, b: m(b["feats"]), progress=True)
    assert torch.allclose(st["enc.fc1"].xtx, ref)

    class HF(nn.Module):  # a model that returns an object with .loss, like transformers
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x, labels):
            out = self.net(x)
            return types.SimpleNamespace(loss=((out - labels) ** 2).sum(), logits=out)

    hf = HF()
    st = collect(hf, [{"x": X, "labels": torch.zeros(4, 3, 4, dtype=D)}], "net.enc.fc2", ("kfac",))
    assert st["net.enc.fc2"].n_grad_tokens == 12


def test_manual_update_and_own_training_loop():
    model = Net()
    X = data(5)
    hooked = collect(model, [X], "enc.fc1", ("input_cov", "output_cov", "kfac"), loss_fn=sq_loss)["enc.fc1"]
    # the same through update(): outputs computed from the weight, gradients supplied
    fc1 = model.enc["fc1"]
    y1 = fc1(X)
    (g1,) = torch.autograd.grad(sq_loss(model.enc["fc2"](torch.tanh(y1)), None), [y1])
    col = StatsCollector(model, "enc.fc1", ("input_cov", "output_cov", "kfac"))
    col.update("enc.fc1", X[:2], grad_outputs=g1[:2])
    col.update("enc.fc1", X[2:], grad_outputs=g1[2:])
    man = col.results()["enc.fc1"]
    for f, t in hooked.tensors().items():
        assert torch.allclose(t, getattr(man, f), rtol=1e-10, atol=1e-12), f
    with pytest.raises(KeyError, match="targets"):
        col.update("enc.fc2", X)
    with pytest.raises(ValueError, match="grad_outputs"):
        col.update("enc.fc1", X)
    # own loop: forward + loss.backward() with the hooks attached
    with StatsCollector(model, "enc.fc1", ("input_cov", "kfac")) as col2:
        sq_loss(model(X), None).backward()
        model.zero_grad()
    own = col2.results()["enc.fc1"]
    assert torch.allclose(own.gtg, hooked.gtg, rtol=1e-10) and torch.allclose(own.xtx, hooked.xtx)


def test_wrong_feature_dim_rejected():
    model = Net()
    col = StatsCollector(model, "enc.fc1")
    with pytest.raises(ValueError, match="in_features"):
        col.update("enc.fc1", torch.randn(3, 7))


def test_layerstats_tensors_round_trip_and_merge():
    model = Net()
    X = data(6)
    whole = collect(model, [X], "enc.*", ALL, loss_fn=sq_loss, fisher="sample")
    a = collect(model, [X[:2]], "enc.*", ALL, loss_fn=sq_loss, fisher="sample")
    b = collect(model, [X[2:]], "enc.*", ALL, loss_fn=sq_loss, fisher="sample")
    for name, s in whole.items():
        t = s.to_tensors()
        assert all(isinstance(v, torch.Tensor) for v in t.values())
        back = LayerStats.from_tensors(name, t)
        assert all(torch.equal(getattr(back, f), v) for f, v in s.tensors().items())
        assert (back.n_tokens, back.n_fisher, back.fisher_per_sample, back.kinds) == (s.n_tokens, s.n_fisher, True, s.kinds)
        merged = a[name].merge(b[name])
        assert merged.n_tokens == s.n_tokens and merged.n_fisher == s.n_fisher
        for f, v in s.tensors().items():
            assert torch.allclose(getattr(merged, f), v, rtol=1e-10, atol=1e-12)
    t = whole["enc.fc1"].to_tensors()
    with pytest.raises(ArtifactError, match="shape"):
        LayerStats.from_tensors("enc.fc1", {**t, "xtx": torch.zeros(3, 3, dtype=D)})
    with pytest.raises(ArtifactError, match="missing"):
        LayerStats.from_tensors("enc.fc1", {k: v for k, v in t.items() if k != "n_tokens"})
    with pytest.raises(ArtifactError, match="unknown"):
        LayerStats.from_tensors("enc.fc1", {**t, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="in_features"):
        whole["enc.fc1"].merge(whole["enc.fc2"])
    bad = LayerStats.from_tensors("enc.fc1", {**t, "xtx": t["xtx"] * float("inf")})
    with pytest.raises(NumericalError, match="enc.fc1"):
        bad.check_finite()


def test_float32_model_statistics_in_float64():
    model = Net(dtype=torch.float32)
    X = data(4).float()
    st = collect(model, [X], "enc.fc1", ("input_cov", "output_cov"))["enc.fc1"]
    assert st.xtx.dtype == D and st.yty.dtype == D
    x2 = X.reshape(-1, 6).double()
    assert torch.allclose(st.xtx, x2.T @ x2, rtol=1e-12)
    W = model.enc["fc1"].weight.double()
    y = x2 @ W.T
    assert torch.allclose(st.yty, y.T @ y, rtol=1e-5)


def test_layer_kinds_collect_a_subset_per_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 12), nn.Linear(12, 4)).double()
    x = torch.randn(30, 4, dtype=torch.float64)
    wide = lambda n, m: ("input_cov",) if m.out_features > m.in_features else ("output_cov", "input_cov")
    with StatsCollector(model, kinds=("output_cov", "input_cov"), layer_kinds=wide) as col:
        col.run(x)
    st = col.results()
    assert st["0"].kinds == ("input_cov",) and st["0"].yty is None
    assert set(st["1"].kinds) == {"input_cov", "output_cov"}
    h = model[0](x).detach()
    assert torch.allclose(st["1"].xtx, h.T @ h) and torch.allclose(st["0"].xtx, x.T @ x)
    # the same numbers as a collector of all kinds
    with StatsCollector(model, kinds=("output_cov", "input_cov")) as full:
        full.run(x)
    assert torch.equal(full.results()["1"].yty, st["1"].yty)
    for bad in (lambda n, m: ("fisher_diag",), lambda n, m: ()):
        with pytest.raises(ValueError, match="subset of the collector's kinds"):
            StatsCollector(model, kinds=("output_cov", "input_cov"), layer_kinds=bad)
