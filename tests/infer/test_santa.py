"""SANTA's torch reference: the spec's correctness checks, its bad inputs, and the transformers patch."""

from __future__ import annotations

import math

import pytest
import torch

from rankwise.infer import santa
from rankwise.infer.santa import (
    SCHEMES,
    SantaConfig,
    dense_decode,
    iid_mse,
    sample_counts,
    santa_decode,
    ternary_query,
    tile_budgets,
    topk_decode,
)


def _cache(B=2, H=8, Hkv=2, n=200, d=16, qscale=2.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, d, generator=g) * qscale
    k = torch.randn(B, n, Hkv, d, generator=g)
    v = torch.randn(B, n, Hkv, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _probs(R=6, n=50, seed=0, peak=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(R, n, generator=g) * peak, -1)


VARIANTS = [(s, None, "fixed") for s in SCHEMES] + [(s, 16, b) for s in SCHEMES for b in ("fixed", "proportional")]


@pytest.mark.parametrize("scheme,tile,budget", VARIANTS)
def test_counts_sum_to_the_budgets(scheme, tile, budget):
    p = _probs()
    for step in range(5):
        sc = sample_counts(p, 24, scheme, tile, budget, seed=1, step=step)
        T = sc.budgets.shape[1]
        L = 50 if tile is None else tile
        per_tile = torch.nn.functional.pad(sc.counts, (0, T * L - 50)).view(6, T, L).sum(-1)
        assert torch.equal(per_tile, sc.budgets)
        if tile is None:
            assert (sc.counts.sum(-1) == 24).all()
        assert (sc.counts >= 0).all() and (sc.counts[p == 0] == 0).all()


def test_systematic_counts_are_floor_or_ceil_of_S_p():
    p = _probs(R=20, n=300)
    S = 64
    for step in range(10):
        c = sample_counts(p, S, "systematic", seed=0, step=step).counts.double()
        x = S * p.double()
        assert ((c == torch.floor(x)) | (c == torch.ceil(x))).all()
        assert (c[x >= 1] >= 1).all()  # every row with S p_i >= 1 is read


def test_integer_S_p_gives_the_exact_output():
    # S >= n and S p_i integer: systematic counts are S p_i exactly, so the estimate is the dense output
    B, H, Hkv, n, d = 2, 4, 2, 8, 16
    q, k, v = _cache(B, H, Hkv, n, d)
    s = torch.log(torch.tensor([1, 2, 3, 2, 4, 1, 2, 1], dtype=torch.float32))  # p = counts / 16
    k = torch.zeros(B, n, Hkv, d)
    q = torch.zeros(B, H, d)
    q[..., 0] = 1.0
    k[..., 0] = s.view(1, n, 1) * math.sqrt(d)
    for seed in range(5):
        out = santa_decode(q, k, v, num_samples=32, scheme="systematic", seed=seed)
        torch.testing.assert_close(out, dense_decode(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,tile,budget", VARIANTS)
def test_one_hot_softmax_returns_that_value_row(scheme, tile, budget):
    B, H, Hkv, n, d = 2, 4, 2, 40, 8
    _, k, v = _cache(B, H, Hkv, n, d)
    q = torch.zeros(B, H, d)
    q[..., 0] = 1e4
    k = torch.zeros(B, n, Hkv, d)
    k[:, 17, :, 0] = 1.0
    for seed in range(4):
        out = santa_decode(q, k, v, 8, scheme, tile, budget, seed=seed)
        expect = v[:, 17].repeat_interleave(H // Hkv, dim=1)
        assert torch.equal(out, expect)


@pytest.mark.parametrize("scheme,tile,budget", VARIANTS)
def test_unbiased_within_monte_carlo_error(scheme, tile, budget):
    q, k, v = _cache(B=1, H=2, Hkv=1, n=64, d=8)
    o = dense_decode(q, k, v).double()
    R = 600  # repeats ride in the batch: each batch row has its own hashed stream
    rep = (lambda t: t.expand(R, *t.shape[1:]).contiguous())
    outs = santa_decode(rep(q), rep(k), rep(v), 8, scheme, tile, budget, seed=7).double()
    err = outs.mean(0) - o[0]  # [H, d]
    sd = outs.std(0)
    assert (err.abs() <= 4 * sd / math.sqrt(R) + 1e-6).all()


def test_iid_mse_matches_its_closed_form():
    q, k, v = _cache(B=1, H=1, Hkv=1, n=32, d=4)
    p = torch.softmax(torch.einsum("bhd,bnhd->bhn", q, k) / 2.0, -1)[0, 0].double()
    o = dense_decode(q, k, v)[0, 0].double()
    R = 3000
    rep = (lambda t: t.expand(R, *t.shape[1:]).contiguous())
    outs = santa_decode(rep(q), rep(k), rep(v), 4, "iid", seed=3)[:, 0].double()
    mse = ((outs - o) ** 2).sum(-1).mean()
    expect = iid_mse(p, v[0, :, 0].double(), 4)
    assert abs(float(mse) - float(expect)) < 0.1 * float(expect)


def test_variance_reduction_at_the_spec_operating_point():
    q, k, v = _cache(B=1, H=4, Hkv=1, n=512, d=64)
    o = dense_decode(q, k, v)
    mse = {}
    rep = (lambda t: t.expand(150, *t.shape[1:]).contiguous())
    for scheme in SCHEMES:
        outs = santa_decode(rep(q), rep(k), rep(v), 64, scheme, seed=0)
        mse[scheme] = float(((outs - o) ** 2).sum(-1).mean())
    assert mse["systematic"] < mse["iid"] and mse["stratified"] < mse["iid"]


def test_one_tile_equals_untiled_systematic():
    q, k, v = _cache(n=100)
    for step in range(3):
        a = santa_decode(q, k, v, 20, "systematic", None, seed=5, step=step)
        b = santa_decode(q, k, v, 20, "systematic", 100, "proportional", seed=5, step=step)
        c = santa_decode(q, k, v, 20, "systematic", 4096, "fixed", seed=5, step=step)
        assert torch.equal(a, b) and torch.equal(a, c)


def test_proportional_budgets():
    P = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.97, 0.01, 0.01, 0.01]])
    St = tile_budgets(P, 10, "proportional")
    assert St.tolist() == [[5, 3, 2, 0], [10, 1, 1, 1]]  # largest remainder, then >= 1 where P_t > 0
    assert tile_budgets(P, 10, "fixed").tolist() == [[3, 3, 3, 0], [3, 3, 3, 3]]


def test_gqa_heads_read_only_their_kv_head():
    B, H, Hkv, n, d = 1, 4, 2, 30, 4
    q, k, v = _cache(B, H, Hkv, n, d)
    v2 = v.clone()
    v2[:, :, 1] = float("nan")  # heads 0-1 use KV head 0 only
    out = santa_decode(q, k, v2, 8, seed=0)
    assert torch.isfinite(out[:, :2]).all() and torch.isnan(out[:, 2:]).all()
    out, info = santa_decode(q, k, v, 8, seed=0, return_info=True)
    assert out.shape == (B, H, d)
    assert info.rows_read.shape == (B, H) and info.kv_rows_read.shape == (B, Hkv)
    assert (info.rows_read <= 8).all() and (info.kv_rows_read <= 16).all()
    assert (info.kv_rows_read >= info.rows_read.view(B, Hkv, 2).amax(-1)).all()


def test_dtype_preserved_and_fp32_inside():
    q, k, v = _cache(dtype=torch.bfloat16)
    out = santa_decode(q, k, v, 16, seed=0)
    assert out.dtype == torch.bfloat16
    ref = santa_decode(q.float(), k.float(), v.float(), 16, seed=0)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_num_samples_above_n_reads_at_most_n_rows():
    q, k, v = _cache(n=10)
    out, info = santa_decode(q, k, v, 1000, seed=0, return_info=True)
    assert (info.rows_read <= 10).all()
    torch.testing.assert_close(out, dense_decode(q, k, v), atol=0.05, rtol=0.05)


def test_seeding_per_step_and_generator():
    q, k, v = _cache()
    a = santa_decode(q, k, v, 16, seed=1, step=0)
    assert torch.equal(a, santa_decode(q, k, v, 16, seed=1, step=0))
    assert not torch.equal(a, santa_decode(q, k, v, 16, seed=1, step=1))
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert torch.equal(santa_decode(q, k, v, 16, generator=g1), santa_decode(q, k, v, 16, generator=g2))
    # a head's draw does not depend on the rest of the batch
    b0, i0 = santa_decode(q[:1], k[:1], v[:1], 16, seed=1, step=0, return_info=True)
    _, ia = santa_decode(q, k, v, 16, seed=1, step=0, return_info=True)
    assert torch.equal(i0.counts, ia.counts[:1])
    torch.testing.assert_close(b0, a[:1], rtol=1e-6, atol=1e-6)


def test_mask_excludes_rows():
    q, k, v = _cache(B=2, n=50)
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[1, 30:] = False
    out, info = santa_decode(q, k, v, 200, seed=0, mask=mask, return_info=True)
    assert (info.counts[1, :, 30:] == 0).all() and info.rows_valid.tolist() == [50, 30]
    torch.testing.assert_close(dense_decode(q, k, v, mask=mask)[1], dense_decode(q[1:], k[1:, :30], v[1:, :30])[0])


def test_topk_baseline():
    q, k, v = _cache(n=40)
    torch.testing.assert_close(topk_decode(q, k, v, 40), dense_decode(q, k, v), atol=1e-5, rtol=1e-5)
    out, info = topk_decode(q, k, v, 5, return_info=True)
    assert (info.rows_read == 5).all() and out.shape == q.shape


def test_ternary_query_is_unbiased_and_ternary():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, generator=g)
    for tau in (None, 0.8):
        draws = ternary_query(q.expand(4000, 3, 16), tau, seed=2)
        t = q.abs().amax(-1, keepdim=True) if tau is None else torch.full((3, 1), tau)
        kept = (q.abs() >= t)
        ok = (draws == 0) | (draws.abs() - t).abs().lt(1e-6) | ((draws == q) & kept)
        assert ok.all()
        sd = draws.std(0).clamp_min(1e-3)
        assert ((draws.mean(0) - q).abs() <= 4 * sd / math.sqrt(4000)).all()
    qq, k, v = _cache(n=30)
    out, info = santa_decode(qq, k, v, 16, seed=0, ternary=True, return_info=True)
    assert torch.isfinite(out).all() and (info.key_features_read <= 16).all()


@pytest.mark.parametrize("bad,match", [
    (dict(num_samples=0), "num_samples"),
    (dict(scheme="gumbel"), "scheme"),
    (dict(budget="even"), "budget"),
])
def test_bad_arguments(bad, match):
    q, k, v = _cache()
    args = dict(num_samples=8)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        santa_decode(q, k, v, **args)


def test_bad_inputs():
    q, k, v = _cache()
    qn = q.clone()
    qn[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        santa_decode(qn, k, v, 8, seed=0)
    kn = k.clone()
    kn[1, 3, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        santa_decode(q, kn, v, 8, seed=0)
    with pytest.raises(ValueError, match="empty"):
        santa_decode(q, k[:, :0], v[:, :0], 8, seed=0)
    with pytest.raises(ValueError, match="no valid"):
        santa_decode(q, k, v, 8, seed=0, mask=torch.zeros(2, 200, dtype=torch.bool))
    with pytest.raises(ValueError, match="head dim"):
        santa_decode(q[..., :8], k, v, 8, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        santa_decode(q[:, :7], k, v, 8, seed=0)


def test_generator_on_another_device_is_refused():
    q, k, v = _cache()

    class FakeGen:
        device = torch.device("cuda")

    with pytest.raises(ValueError, match="generator is on cuda"):
        santa_decode(q, k, v, 8, generator=FakeGen())  # type: ignore[arg-type]


def test_config_validation():
    with pytest.raises(ValueError, match="SantaConfig.num_samples"):
        SantaConfig(num_samples=0)
    with pytest.raises(ValueError, match="SantaConfig.scheme"):
        SantaConfig(scheme="x")
    with pytest.raises(ValueError, match="SantaConfig.tau"):
        SantaConfig(tau=-1.0)


# --------------------------------------------------------------------------------------------------
# the transformers patch


@pytest.fixture(scope="module")
def gqa_smoke():
    from rankwise.zoo import tiny_lm

    return tiny_lm("gqa-smoke")


def test_patch_generate_and_unpatch(gqa_smoke):
    model, tok = gqa_smoke
    ids = tok("def parse(x):\n    return", return_tensors="pt").input_ids
    before = model.config._attn_implementation
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    santa.patch_attention(model, SantaConfig(num_samples=100_000))  # S >> n: every row read
    try:
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        st = santa.santa_stats(model)
        assert st["fallback_calls"] == 1 and st["estimated_calls"] == 5  # 1 layer: prefill + 5 decode steps
        assert st["fraction_read"] == 1.0
        assert torch.equal(out, ref)
        santa.patch_attention(model, SantaConfig(num_samples=4))
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert out.shape == ref.shape and santa.santa_stats(model)["fraction_read"] < 0.5
    finally:
        santa.unpatch_attention(model)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="not patched"):
        santa.unpatch_attention(model)


def test_patch_teacher_forced_window_respects_causality(gqa_smoke):
    model, tok = gqa_smoke
    ids = tok("def parse(x):\n    return x + 1\n\nclass Foo:\n    pass", return_tensors="pt").input_ids
    with torch.no_grad():
        dense = model(ids).logits
        santa.patch_attention(model, SantaConfig(num_samples=10_000, decode_only=False))
        try:
            full = model(ids).logits  # every query position sampled under its causal mask, S >> n
            santa.patch_attention(model, SantaConfig(num_samples=2, decode_only=False, seed=3))
            a = model(ids).logits
            b = model(ids[:, :5]).logits  # the first 5 positions see only their own prefix
        finally:
            santa.unpatch_attention(model)
    torch.testing.assert_close(full, dense, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(a).all() and b.shape[1] == 5


def test_patch_rejects_non_models():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        santa.patch_attention(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="SantaConfig"):
        santa.patch_attention(torch.nn.Linear(2, 2), config={"num_samples": 4})  # type: ignore[arg-type]


def test_patch_batched_generate_with_left_padding(gqa_smoke):
    model, tok = gqa_smoke
    a = tok("def parse(x):\n    return x + 1", return_tensors="pt").input_ids[0]
    b = tok("class Foo:", return_tensors="pt").input_ids[0]
    pad = tok.eos_token_id
    ids = torch.full((2, len(a)), pad)
    ids[0] = a
    ids[1, len(a) - len(b):] = b
    am = torch.zeros_like(ids)
    am[0] = 1
    am[1, len(a) - len(b):] = 1
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=pad)
    ref = model.generate(ids, **kw)
    santa.patch_attention(model, SantaConfig(num_samples=100_000))
    try:
        out = model.generate(ids, **kw)
        st = santa.santa_stats(model)
    finally:
        santa.unpatch_attention(model)
    assert torch.equal(out, ref)  # padded rows are never sampled; S >> n reads every valid row
    assert st["rows_valid"] < st["estimated_calls"] * 2 * 8 * out.shape[1]
