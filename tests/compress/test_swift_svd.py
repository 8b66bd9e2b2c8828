"""Swift-SVD: the correctness checks and bad inputs of its spec (shared/methods/swift_svd.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise.compress import (
    CompressConfig,
    SwiftSVDConfig,
    calibrate,
    compress,
    plain_svd_factors,
    svd_llm_factors,
    swift_svd_compress,
    swift_svd_factors,
    uniform_rank,
)
from rankwise.compress.swift_svd import (
    allocation_scores,
    block_influence,
    dynamic_ranks,
    normalize_influence,
    output_covariance,
    swift_svd_error,
    swift_svd_spectrum,
)
from rankwise.core.errors import NumericalError
from rankwise.core.layers import LowRankLinear
from rankwise.core.stats import CalibrationError, StatsCollector

F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(m: int, n: int, N: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    W = torch.randn(m, n, generator=g, dtype=F64)
    # correlated inputs with a decaying spectrum, so that activation-aware and plain SVD differ
    X = torch.randn(N, n, generator=g, dtype=F64) @ torch.diag(torch.logspace(0, -2, n, dtype=F64)) \
        @ torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64)).Q
    return W, X


def _err(W: torch.Tensor, X: torch.Tensor, f) -> float:
    return float(((X @ W.mT) - X @ (f.A @ f.B).mT).square().sum())


def _bert(seed: int = 0, layers: int = 2):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    return BertModel(cfg).eval()


def _batches(n: int = 3, seed: int = 0, vocab: int = 64):
    g = _gen(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (3, 8), generator=g)
        am = torch.ones(3, 8, dtype=torch.long)
        am[1, 5:] = 0
        out.append({"input_ids": ids, "attention_mask": am})
    return out


# ----------------------------------------------------------------------------------------------
# the closed form


@pytest.mark.parametrize("m,n", [(12, 20), (20, 12)])
def test_error_equals_tail_eigenvalues_and_svd_llm(m, n):
    W, X = _problem(m, n, N=80)
    C = output_covariance(W, X)
    lam, _ = swift_svd_spectrum(C)
    H = X.mT @ X
    for k in range(1, min(m, n) + 1):
        f = swift_svd_factors(W, C, k)
        e_swift = _err(W, X, f)
        assert e_swift == pytest.approx(float(lam[k:].sum()), rel=1e-8, abs=1e-9)
        assert swift_svd_error(C, k) == pytest.approx(float(lam[k:].sum()), rel=1e-12, abs=1e-12)
        f_llm, _ = svd_llm_factors(W, H, k, damping=0.0)
        assert e_swift == pytest.approx(_err(W, X, f_llm), rel=1e-8, abs=1e-9)


def test_factors_are_vk_and_vk_transpose_w():
    W, X = _problem(10, 14, N=50)
    C = output_covariance(W, X)
    lam, V = torch.linalg.eigh(C)
    Vk = V.flip(1)[:, :4]
    f = swift_svd_factors(W, C, 4)
    assert f.B.shape == (4, 14) and f.A.shape == (10, 4)
    # same subspace (eigenvectors are defined up to sign)
    assert torch.allclose(f.A @ f.A.mT, Vk @ Vk.mT, atol=1e-10)
    assert torch.allclose(f.B, f.A.mT @ W, atol=1e-12)


@pytest.mark.parametrize("m,n", [(12, 20), (20, 12)])
def test_full_rank_reproduces_the_layer(m, n):
    g = _gen(1)
    lin = nn.Linear(n, m)
    X = torch.randn(64, n, generator=g)
    C = output_covariance(lin.weight, X)
    f = swift_svd_factors(lin, C, min(m, n))
    low = LowRankLinear.from_linear(lin, factors=f)
    with torch.no_grad():
        assert (low(X) - lin(X)).abs().max() < 1e-5


def test_incremental_accumulation_is_independent_of_split_and_order():
    g = _gen(2)
    lin = nn.Linear(10, 7).double()
    X = torch.randn(48, 10, generator=g, dtype=F64)
    one = output_covariance(lin.weight, X)
    for split, order in ([4, 20, 24], [0, 1, 2]), ([16, 16, 16], [2, 0, 1]), ([1] * 48, list(range(47, -1, -1))):
        chunks = list(torch.split(X, split))
        model = nn.Sequential(lin)
        col = StatsCollector(model, target="0", kinds=("output_cov",))
        with col:
            for i in order:
                with torch.no_grad():
                    model(chunks[i])
        C = col.results()["0"].output_cov(normalized=False)
        assert torch.allclose(C, one, rtol=1e-10, atol=1e-12)


def test_error_is_non_increasing_in_rank():
    W, X = _problem(16, 24, N=60, seed=3)
    C = output_covariance(W, X)
    errs = [_err(W, X, swift_svd_factors(W, C, k)) for k in range(1, 17)]
    assert all(a >= b - 1e-9 * errs[0] for a, b in zip(errs, errs[1:]))
    assert errs[-1] < 1e-9 * errs[0]


def test_lowrank_layer_shape_and_parameter_count():
    lin = nn.Linear(24, 16)
    X = torch.randn(40, 24, generator=_gen(4))
    f = swift_svd_factors(lin, output_covariance(lin.weight, X), 5)
    low = LowRankLinear.from_linear(lin, factors=f)
    assert low(torch.randn(2, 3, 24)).shape == (2, 3, 16)
    assert sum(p.numel() for p in low.parameters()) == 5 * (24 + 16) + 16 == low.num_parameters


def test_whitened_inputs_give_plain_svd():
    g = _gen(5)
    W = torch.randn(9, 12, generator=g, dtype=F64)
    X = torch.linalg.qr(torch.randn(40, 12, generator=g, dtype=F64)).Q  # X^T X = I
    assert torch.allclose(X.mT @ X, torch.eye(12, dtype=F64), atol=1e-12)
    C = output_covariance(W, X)
    for k in (1, 4, 9):
        a = swift_svd_factors(W, C, k).product()
        b = plain_svd_factors(W, k).product()
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)


def test_works_without_damping_when_input_covariance_is_singular():
    W, X = _problem(8, 30, N=12, seed=6)  # 12 tokens < 30 input features: X^T X singular
    H = X.mT @ X
    with pytest.raises(NumericalError):
        svd_llm_factors(W, H, 4, damping=0.0, name="ffn_out")
    C = output_covariance(W, X)
    lam, _ = swift_svd_spectrum(C)
    f = swift_svd_factors(W, C, 4)
    assert _err(W, X, f) == pytest.approx(float(lam[4:].sum()), rel=1e-8, abs=1e-12)
    f_damped, _ = svd_llm_factors(W, H, 4)  # the damped version runs and is (nearly) as good, never better
    assert _err(W, X, f) <= _err(W, X, f_damped) * (1 + 1e-9) + 1e-12


# ----------------------------------------------------------------------------------------------
# rank allocation


def test_dynamic_ranks_meet_the_budget_exactly():
    g = _gen(7)
    for trial in range(25):
        L = int(torch.randint(1, 7, (1,), generator=g))
        shapes, types, imp, eps = {}, {}, {}, {}
        kinds = {"q": (16, 16), "o": (16, 16), "up": (40, 16), "down": (16, 40)}
        for l in range(L):
            for t, shp in kinds.items():
                n = f"b.{l}.{t}"
                shapes[n], types[n] = shp, t
                imp[n] = 1.0 + float(torch.rand(1, generator=g))
                eps[n] = float(torch.rand(1, generator=g)) * 10 ** float(torch.randint(-3, 4, (1,), generator=g))
        rho = float(torch.rand(1, generator=g)) * 0.99 + 0.01
        ranks = dynamic_ranks(shapes, types, imp, eps, rho)
        for t, (m, n) in kinds.items():
            names = [x for x in shapes if types[x] == t]
            assert sum(ranks[x] for x in names) == L * uniform_rank(m, n, rho)
            assert all(1 <= ranks[x] <= min(m, n) for x in names)


def test_dynamic_ranks_follow_the_scores():
    shapes = {f"l{i}": (32, 32) for i in range(4)}
    types = {n: "q" for n in shapes}
    eps = {n: 5.0 for n in shapes}
    imp = {"l0": 1.0, "l1": 1.3, "l2": 1.7, "l3": 2.0}
    r = dynamic_ranks(shapes, types, imp, eps, 0.4, alpha=2.5)
    assert r["l0"] <= r["l1"] <= r["l2"] <= r["l3"] and r["l0"] < r["l3"]
    # equal scores: the uniform rank everywhere
    flat = dynamic_ranks(shapes, types, {n: 1.5 for n in shapes}, eps, 0.4)
    assert set(flat.values()) == {uniform_rank(32, 32, 0.4)}
    # higher local loss proxy -> lower score for alpha > 1: (log(1 + eps))^(1 - alpha)
    s = allocation_scores([1.0, 1.0], [1.0, 100.0], alpha=2.5)
    assert s[0] > s[1]
    # ratio 1 keeps floor(m n / (m + n)) = 16 units per layer on average, each layer at most full rank 32
    full = dynamic_ranks(shapes, types, imp, eps, 1.0)
    assert sum(full.values()) == 4 * 16 and max(full.values()) <= 32


def test_dynamic_ranks_clip_at_full_rank_and_redistribute():
    shapes = {n: (8, 8) for n in "abcde"}
    types = {n: "t" for n in shapes}
    imp = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 1.0}
    r = dynamic_ranks(shapes, types, imp, {n: 1.0 for n in shapes}, 0.99, alpha=8.0)
    k_u = uniform_rank(8, 8, 0.99)  # 3; budget 15, base 1 each, a's share of the remaining 10 exceeds 8
    assert r["a"] == 8  # clipped at the full rank
    assert sum(r.values()) == 5 * k_u and min(r.values()) >= 1
    assert sorted(r[n] for n in "bcde") == [1, 2, 2, 2]  # the leftover units go one each, in score order


def test_influence_and_normalisation():
    g = _gen(8)
    a = torch.randn(2, 5, 6, generator=g)
    b = torch.randn(2, 5, 6, generator=g)
    mask = torch.ones(2, 5)
    mask[0, 3:] = 0
    s, c = block_influence(a, b, mask)
    keep = mask.reshape(-1) != 0
    cos = torch.nn.functional.cosine_similarity(a.reshape(-1, 6)[keep].double(), b.reshape(-1, 6)[keep].double())
    assert c == 8 and s == pytest.approx(float((1 - cos).sum()), rel=1e-12)
    tilde = normalize_influence([0.1, 0.4, 0.25])
    assert tilde[0] == 1.0 and 1.9999 < tilde[1] < 2.0 and 1.0 < tilde[2] < 2.0


# ----------------------------------------------------------------------------------------------
# through the pipeline


def test_swift_equals_svd_llm_per_layer_on_a_transformer():
    model = _bert()
    batches = _batches(4)
    errs = {}
    for meth in ("swift-svd", "svd-llm", "svd", "asvd"):
        m = copy.deepcopy(model)
        rep = compress(m, CompressConfig(method=meth, ratio=0.4), calib=batches)
        errs[meth] = rep.layer_errors
    for name, e in errs["swift-svd"].items():
        assert e == pytest.approx(errs["svd-llm"][name], rel=1e-4, abs=1e-7)
        assert e <= errs["svd"][name] + 1e-7 and e <= errs["asvd"][name] + 1e-7


def test_bias_stays_on_the_up_factor_and_out_of_the_covariance():
    model = _bert()
    batches = _batches(2)
    cal = calibrate(model, batches, CompressConfig(method="swift-svd", measure_error=False))
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for m in shifted.modules():
            if isinstance(m, nn.Linear) and m is shifted.encoder.layer[1].output.dense:
                m.bias.add_(3.0)  # changes only this layer's output, not its input
    cal2 = calibrate(shifted, batches, CompressConfig(method="swift-svd", measure_error=False))
    name = "encoder.layer.1.output.dense"
    # equal up to float32 rounding of the forward (with the bias folded in, C would grow by ~9 N per entry)
    assert torch.allclose(cal.stats[name].output_cov(normalized=False), cal2.stats[name].output_cov(normalized=False),
                          rtol=1e-4, atol=1e-8)
    m = copy.deepcopy(model)
    compress(m, SwiftSVDConfig(param_ratio=0.4, allocation="uniform"), calib=batches)
    low = m.get_submodule(name)
    assert isinstance(low, LowRankLinear) and low.down.bias is None
    assert torch.equal(low.up.bias, model.get_submodule(name).bias)


def test_zero_output_layer_gives_zero_matrix_with_a_warning():
    lin = nn.Linear(6, 5)
    C = torch.zeros(5, 5, dtype=F64)
    with pytest.warns(RuntimeWarning, match="zero"):
        f = swift_svd_factors(lin, C, 2, name="dead")
    assert float(f.product().abs().max()) == 0.0


def test_calibration_is_reused_across_ratios():
    model = _bert()
    batches = _batches(3)
    cal = calibrate(model, batches, SwiftSVDConfig())
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = compress(a, SwiftSVDConfig(param_ratio=0.3), calibration=cal)
    assert cal.cache and any(k.startswith("swift-svd") for k in cal.cache)
    with pytest.warns(DeprecationWarning, match="swift_svd_compress"):
        rb = swift_svd_compress(b, batches, SwiftSVDConfig(param_ratio=0.3))  # the deprecated alias
    assert ra.ranks == rb.ranks
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = copy.deepcopy(model)
    with pytest.warns(DeprecationWarning):
        rc = swift_svd_compress(c, cal, SwiftSVDConfig(param_ratio=0.6))
    assert sum(rc.ranks.values()) > sum(ra.ranks.values())


def test_dynamic_allocation_through_the_pipeline_meets_type_budgets():
    model = _bert(layers=3)
    rep = compress(model, SwiftSVDConfig(param_ratio=0.4), calib=_batches(3))
    assert rep.extra["influence"] is not None and len(rep.extra["influence"]) == 3
    by_type: dict[str, list[int]] = {}
    for lr in rep.layers:
        t = lr.name.split(".", 3)[3]
        by_type.setdefault(t, []).append(lr.rank)
        m, n = lr.shape
    for lr in rep.layers:
        t = lr.name.split(".", 3)[3]
        m, n = lr.shape
        assert sum(by_type[t]) == 3 * uniform_rank(m, n, 0.4)


def test_registry_entry_and_config_defaults():
    from rankwise.core import registry

    e = registry.get("swift_svd")
    assert e.entry is compress and e.config is SwiftSVDConfig
    cfg = SwiftSVDConfig()
    assert cfg.param_ratio == 0.4 and cfg.alpha == 2.5 and cfg.allocation == "dynamic"
    assert cfg.accumulate_dtype == torch.float64
    cc = cfg.to_compress_config()
    assert cc.method == "swift-svd" and cc.ratio == 0.4 and cc.allocation == "dynamic"


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("k", [0, -1, 13])
def test_rank_out_of_range_raises_naming_the_layer(k):
    W, X = _problem(12, 20, N=30)
    with pytest.raises(ValueError, match="my.layer"):
        swift_svd_factors(W, output_covariance(W, X), k, name="my.layer")


def test_explicit_rank_out_of_range_in_the_pipeline():
    model = _bert()
    name = "encoder.layer.0.attention.self.query"
    with pytest.raises(ValueError, match="attention.self.query"):
        compress(model, CompressConfig(method="swift-svd", allocation={name: 17}), calib=_batches(1))
    assert isinstance(model.get_submodule(name), nn.Linear)


@pytest.mark.parametrize("ratio", [0.0, -0.2, 1.5, float("nan"), float("inf")])
def test_param_ratio_out_of_range(ratio):
    with pytest.raises(ValueError, match="param_ratio"):
        SwiftSVDConfig(param_ratio=ratio)
    with pytest.raises(ValueError, match="ratio"):
        CompressConfig(method="swift-svd", ratio=ratio)


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="allocation"):
        SwiftSVDConfig(allocation="effective_rank")
    with pytest.raises(ValueError, match="SwiftSVDConfig.accumulate_dtype must be a floating torch.dtype"):
        SwiftSVDConfig(accumulate_dtype=torch.int32)
    with pytest.raises(ValueError, match="SwiftSVDConfig.param_ratio"):
        SwiftSVDConfig(param_ratio=True)


def test_hook_never_fired_is_an_error_not_plain_svd():
    model = _bert()
    model.unused = nn.Linear(16, 16)
    with pytest.raises(CalibrationError, match="unused"):
        compress(model, CompressConfig(method="swift-svd"), calib=_batches(1), target="unused")
    assert isinstance(model.unused, nn.Linear)


def test_nan_in_the_covariance_names_the_layer():
    C = torch.eye(4, dtype=F64)
    C[1, 2] = float("nan")
    with pytest.raises(NumericalError, match="enc.q"):
        swift_svd_spectrum(C, name="enc.q")
    model = _bert()
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight[0, 0] = float("inf")
    with pytest.raises(NumericalError, match="encoder.layer.0"):
        compress(model, CompressConfig(method="swift-svd"), calib=_batches(1))


def test_calibration_last_dim_mismatch_raises():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="in_features"):
        compress(model, CompressConfig(method="swift-svd"), calib=[torch.randn(5, 9)], target=nn.Linear)
    assert all(isinstance(model[i], nn.Linear) for i in (0, 2))


def test_conv1d_target_is_a_type_error():
    from transformers import GPT2Config, GPT2Model

    model = GPT2Model(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16)).eval()
    with pytest.raises(TypeError, match="Conv1D"):
        compress(model, CompressConfig(method="swift-svd"), calib=[{"input_ids": torch.zeros(1, 4, dtype=torch.long)}],
                 target="c_attn")


def test_repro_batches_keep_pairs_together_in_length_order():
    from rankwise.repro import swift_svd as repro

    vocab: dict[str, int] = {}

    def tok(texts, padding=False, truncation=False, max_length=512, return_tensors=None):
        ids = [[vocab.setdefault(w, len(vocab) + 1) for w in t.split()][:max_length] for t in texts]
        if not padding:
            return {"input_ids": ids}
        width = max(len(i) for i in ids)
        return {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])}

    rng = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 90, (2 * 19,), generator=rng).tolist()
    pairs = [(" ".join(f"a{i}x{j}" for j in range(lens[2 * i])), " ".join(f"b{i}x{j}" for j in range(lens[2 * i + 1])))
             for i in range(19)]
    batches = repro._batches(tok, pairs)
    assert [b["input_ids"].shape[0] for b in batches] == [16, 16, 6]  # 8 + 8 + 3 pairs
    seen, longest = [], []
    for b in batches:
        k = b["input_ids"].shape[0] // 2
        rows = [tuple(r[m.bool()].tolist()) for r, m in zip(b["input_ids"], b["attention_mask"])]
        for i in range(k):  # row i is a_i, row k + i its partner b_i
            a, bb = rows[i], rows[k + i]
            seen.append((a, bb))
            longest.append(max(len(a), len(bb)))
    want = [tuple(tuple(x) for x in tok([a, b], truncation=True, max_length=repro.MAX_LENGTH)["input_ids"])
            for a, b in pairs]
    assert sorted(seen) == sorted(want)
    assert longest == sorted(longest) and max(longest) == repro.MAX_LENGTH
    assert repro._batches(tok, []) == []


def test_repro_seed_draws_the_calibration_pairs_not_the_evaluation_set():
    from rankwise.repro import swift_svd as repro

    c0, e0, p0 = repro._data(0, 8, 16)
    c1, e1, p1 = repro._data(1, 8, 16)
    assert e0 == e1 and len(e0) == 16  # one fixed evaluation draw, shared by the seeds
    assert p0 != p1 and len(p0) == len(p1) == 8 and c0 == [s for p in p0 for s in p]
    assert repro._data(0, 8, 16) == (c0, e0, p0)  # deterministic
    assert not set(e0) & set(c0 + c1)  # disjoint splits


# ----------------------------------------------------------------------------------------------
# the exact reduction for layers wider at the output (m > n) and the float32 bound


@pytest.mark.parametrize("m,n,N", [(96, 24, 200), (200, 50, 30), (24, 96, 200), (64, 64, 100)])
def test_reduction_matches_the_full_eigendecomposition(m, n, N):
    from rankwise.compress.swift_svd import swift_svd_spectrum

    W, X = _problem(m, n, N, seed=m + n)
    C = output_covariance(W, X)
    lam_full, V_full = swift_svd_spectrum(C)
    lam, V = swift_svd_spectrum(C, weight=W)
    assert V.shape == (m, min(m, n))  # reduced to the n x n problem only when m > n
    assert lam.shape == (m,)
    # spectrum: same eigenvalues to 1e-12 of the largest (the m - n extra ones are zero)
    assert float((lam - lam_full).abs().max()) <= 1e-12 * float(lam_full[0])
    for k in (1, min(m, n, N) // 2, min(m, n) - 1):
        f_red = swift_svd_factors(W, None, k, spectrum=(lam, V))
        f_full = swift_svd_factors(W, None, k, spectrum=(lam_full, V_full))
        # the factors are unique up to the signs of the eigenvectors; their product is unique
        P_red, P_full = f_red.A @ f_red.B, f_full.A @ f_full.B
        if k < min(n, N):  # inside the data's rank there is an eigengap
            assert float((P_red - P_full).norm() / P_full.norm()) <= 1e-10
        assert _err(W, X, f_red) == pytest.approx(swift_svd_error(lam_full, k), rel=1e-9, abs=1e-9 * float(lam[0]))


def test_reduction_falls_back_when_C_is_not_in_the_span_of_W():
    from rankwise.compress.swift_svd import swift_svd_spectrum

    W, X = _problem(40, 10, 100)
    C = output_covariance(torch.randn(40, 10, generator=_gen(5), dtype=F64), X)  # another weight's statistics
    lam, V = swift_svd_spectrum(C, weight=W)
    lam_full, _ = swift_svd_spectrum(C)
    assert V.shape == (40, 40) and torch.allclose(lam, lam_full)
    with pytest.raises(ValueError, match="rows"):
        swift_svd_spectrum(C, weight=W[:5])


@pytest.mark.parametrize("m,n", [(120, 30), (30, 120), (80, 80)])
def test_float32_factors_are_within_the_documented_bound(m, n):
    from rankwise.compress.swift_svd import float32_excess_bound, swift_svd_spectrum

    W, X = _problem(m, n, 4 * max(m, n), seed=7)
    C = output_covariance(W, X)
    lam = swift_svd_spectrum(C, weight=W)[0]
    for k in (2, min(m, n) // 3, min(m, n) - 2):
        e64 = _err(W, X, swift_svd_factors(W, C, k))
        f32 = swift_svd_factors(W.float(), C, k, dtype=torch.float32)
        e32 = _err(W, X, type(f32)(f32.B.double(), f32.A.double()))
        bound = float32_excess_bound(lam, k, min(m, n))
        assert e64 == pytest.approx(swift_svd_error(lam, k), rel=1e-9, abs=1e-10 * float(lam[0]))
        assert abs(e32 - e64) <= bound
        assert bound <= 1e-2 * float(lam[0])  # the bound itself is small at these sizes


def test_swift_svd_info_reports_the_float32_bound():
    W, X = _problem(48, 12, 100)
    lin = nn.Linear(12, 48).double()
    with torch.no_grad():
        lin.weight.copy_(W)
    model = nn.Sequential(lin)
    rep = compress(model, SwiftSVDConfig(param_ratio=0.5, allocation="uniform", compute_dtype=torch.float32),
                   calib=[X[:50], X[50:]], target=nn.Linear)
    (layer,) = rep.layers
    assert 0 <= layer.info["float32_excess_bound_rel"] < 1e-2


# ----------------------------------------------------------------------------------------------
# larger than memory: compress_checkpoint on a sharded checkpoint


def _llama_wide(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # intermediate 40 > hidden 16: gate/up are wider at the output and go through the reduction
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def test_compress_checkpoint_of_sharded_llama_is_identical_to_whole_mode(tmp_path, monkeypatch):
    import rankwise.compress.blockwise as blockwise
    import rankwise.compress.checkpoint as checkpoint
    from rankwise.compress import compress_checkpoint, load_compressed

    base = _llama_wide()
    base.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()  # sharded input
    g = _gen(3)
    batches = [{"input_ids": torch.randint(0, 64, (2, 12), generator=g)} for _ in range(3)]
    cfg = SwiftSVDConfig(param_ratio=0.5, allocation="uniform")

    calls = {"allocator": 0, "released": []}
    real_fix, real_release = checkpoint.fix_mmap_threshold, blockwise.release_stats
    monkeypatch.setattr(checkpoint, "fix_mmap_threshold", lambda *a: calls.__setitem__("allocator", 1) or real_fix(*a))
    monkeypatch.setattr(blockwise, "release_stats", lambda s: calls["released"].append(real_release(s)))

    whole = copy.deepcopy(base)
    rw = compress(whole, cfg, calib=batches, mode="whole")
    rc = compress_checkpoint(tmp_path / "src", cfg, batches, tmp_path / "out")
    assert calls["allocator"] == 1  # the allocator is handled inside compress_checkpoint
    # every block's float64 buffers were dropped once its layers were fitted (7 targets x (m^2) float64)
    assert len(calls["released"]) == 3 and all(b > 0 for b in calls["released"])
    assert rc.ranks == rw.ranks and rc.layer_errors == rw.layer_errors
    back = load_compressed(tmp_path / "out")
    with torch.no_grad():
        for b in batches:
            assert torch.equal(back(**b).logits, whole(**b).logits)


def test_release_stats_drops_every_buffer():
    from rankwise.compress.calibration import release_stats

    lin = nn.Sequential(nn.Linear(6, 9))
    with StatsCollector(lin, target=nn.Linear, kinds=("output_cov", "input_cov")) as col:
        lin(torch.randn(20, 6))
    stats = col.results()
    (st,) = stats.values()
    assert st.yty is not None and st.xtx is not None
    freed = release_stats(stats)
    assert freed >= 8 * (9 * 9 + 6 * 6)
    assert st.yty is None and st.xtx is None and st.n_tokens == 20


@pytest.mark.parametrize("m,n,N", [(96, 24, 200), (200, 50, 30), (33, 32, 80)])
def test_reduction_from_the_input_covariance_matches_the_full_eigendecomposition(m, n, N):
    # m > n: Q^T C Q = R H R^T, so the n x n problem needs only H = X^T X (C is never formed)
    from rankwise.compress.swift_svd import swift_svd_spectrum

    W, X = _problem(m, n, N, seed=3 * m + n)
    C, H = output_covariance(W, X), X.mT @ X
    lam_full, V_full = swift_svd_spectrum(C)
    lam, V = swift_svd_spectrum(None, weight=W, input_cov=H)
    assert V.shape == (m, n) and lam.shape == (m,)
    assert float((lam - lam_full).abs().max()) <= 1e-12 * float(lam_full[0])
    for k in (1, min(n, N) // 2, n - 1):
        f_h = swift_svd_factors(W, None, k, input_cov=H)
        f_full = swift_svd_factors(W, None, k, spectrum=(lam_full, V_full))
        if k < min(n, N):
            assert float((f_h.A @ f_h.B - f_full.A @ f_full.B).norm() / (f_full.A @ f_full.B).norm()) <= 1e-10
        assert _err(W, X, f_h) == pytest.approx(swift_svd_error(lam_full, k), rel=1e-9, abs=1e-9 * float(lam[0]))
    with pytest.raises(ValueError, match=rf"must be \({n}, {n}\)"):
        swift_svd_spectrum(None, weight=W, input_cov=H[:-1, :-1])


def test_pipeline_collects_only_the_input_covariance_of_wide_layers(monkeypatch):
    # a layer wider at the output gets X^T X (n x n), never Y^T Y (m x m): its spectrum is R H R^T,
    # whether or not the error is measured; a layer narrower at the output gets Y^T Y
    import rankwise.compress.swift_svd as sw
    from rankwise.compress import calibrate

    calls = []
    real = sw._spectrum_from_input_cov
    monkeypatch.setattr(sw, "_spectrum_from_input_cov", lambda *a: calls.append(1) or real(*a))
    W, X = _problem(48, 12, 100)
    for measure in (True, False):
        cfg = CompressConfig(method="swift-svd", ratio=0.5, allocation="uniform", measure_error=measure)
        model = nn.Sequential(nn.Linear(12, 48).double(), nn.Linear(48, 12).double())
        with torch.no_grad():
            model[0].weight.copy_(W)
        cal = calibrate(model, [X[:50], X[50:]], cfg, target=nn.Linear)
        assert cal.stats["0"].kinds == ("input_cov",)
        assert "output_cov" in cal.stats["1"].kinds and ("input_cov" in cal.stats["1"].kinds) == measure
        rep = compress(model, cfg, calibration=cal, target=nn.Linear)
        assert calls == [1] * (1 if measure else 2)
        k = model[0].rank
        reference = swift_svd_factors(W, output_covariance(W, X), k)  # the Q^T C Q path, from C
        ref = reference.A @ reference.B
        got = model[0].up.weight.detach() @ model[0].down.weight.detach()
        assert float((got - ref).norm() / ref.norm()) <= 1e-9
        C = output_covariance(W, X)
        assert rep.layers[0].info["predicted_rel_error"] == pytest.approx(
            swift_svd_error(C, k) / float(C.trace()), rel=1e-9)


def test_float32_factors_from_the_input_covariance_are_within_the_documented_bound():
    from rankwise.compress.swift_svd import float32_excess_bound, swift_svd_spectrum

    W, X = _problem(120, 30, 480, seed=11)
    H = X.mT @ X
    lam = swift_svd_spectrum(None, weight=W, input_cov=H)[0]
    for k in (2, 10, 28):
        e64 = _err(W, X, swift_svd_factors(W, None, k, input_cov=H))
        f32 = swift_svd_factors(W.float(), None, k, input_cov=H, dtype=torch.float32)
        e32 = _err(W, X, type(f32)(f32.B.double(), f32.A.double()))
        assert abs(e32 - e64) <= float32_excess_bound(lam, k, 30)
