"""P2D: the spec's correctness checks (ALPS W1 vs scipy, masks, GQA, counts, order invariance) and bad inputs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from rankwise.core.errors import ArtifactError
from rankwise.train.p2d import (
    P2D,
    HEAD_SCORES,
    HeadSelection,
    P2DConfig,
    aer,
    distribution_distance,
    encode_pool,
    find_attention,
    head_gradients,
    head_mask,
    head_scores,
    head_vector,
    load_heads,
    loss_data,
    random_data,
    random_heads,
    restrict_to_heads,
    save_heads,
    select_heads,
    wasserstein1,
)
from rankwise.train.sft import SFTConfig, sft
from rankwise.zoo.synthetic import P2DWorld

WORLD = P2DWorld()


@pytest.fixture(scope="module")
def tok():
    return WORLD.tokenizer()


def _llama(tok, heads: int = 4, kv: int = 2, hidden: int = 32, layers: int = 2, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(cfg).eval()


def _gpt2(tok) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def pool():
    return WORLD.pool(60, seed=3)


# --------------------------------------------------------------------------------------------------
# ALPS scores


def test_w1_closed_form_matches_scipy_on_random_vectors() -> None:
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    for n in (2, 7, 300, 3 * 16 * 32):
        u0, up = torch.randn(n, generator=g), torch.randn(n, generator=g) * 2
        P, Q = torch.softmax(u0, 0), torch.softmax(up, 0)
        x = torch.linspace(0, 1, n, dtype=torch.float64).numpy()
        ref = stats.wasserstein_distance(x, x, P.double().numpy(), Q.double().numpy())
        assert wasserstein1(P, Q) == pytest.approx(ref, rel=1e-6, abs=1e-15)
        assert distribution_distance(u0, up) == pytest.approx(ref, rel=1e-6, abs=1e-15)
    assert wasserstein1(P, P) == 0.0
    # close distributions (a small W1 from nearly equal CDFs), as a short proxy fine-tune produces
    u0 = torch.randn(6144, generator=g)
    P, Q = torch.softmax(u0, 0), torch.softmax(u0 + 0.01 * torch.randn(6144, generator=g), 0)
    x = torch.linspace(0, 1, 6144, dtype=torch.float64).numpy()
    ref = stats.wasserstein_distance(x, x, P.double().numpy(), Q.double().numpy())
    assert wasserstein1(P, Q) == pytest.approx(ref, rel=1e-6)


def test_every_score_is_zero_for_identical_vectors_and_positive_otherwise() -> None:
    g = torch.Generator().manual_seed(1)
    u = torch.randn(96, generator=g)
    for kind in HEAD_SCORES:
        assert distribution_distance(u, u.clone(), kind) == 0.0
        assert distribution_distance(u, u + 0.5 * torch.randn(96, generator=g), kind) > 0.0


def test_scores_zero_without_proxy_steps_and_ignore_w_o(tok, pool) -> None:
    model = _llama(tok)
    p = P2D(model, tok, proxy_steps=0)
    sel = p.localize_heads(p.probe_set(pool))
    assert torch.equal(sel.scores, torch.zeros_like(sel.scores))
    other = copy.deepcopy(model)
    with torch.no_grad():
        for lay in find_attention(other):
            lay.o.weight.add_(1.0)
    for kind in HEAD_SCORES:
        assert float(head_scores(model, other, kind).abs().max()) == 0.0
        w = find_attention(other)[1].q.weight
        keep = w[0, 0].item()
        with torch.no_grad():
            w[0, 0] += 1.0  # head 0 of layer 1 moves, nothing else
        s = head_scores(model, other, kind)
        assert s[1, 0] > 0 and float(s.abs().sum() - s[1, 0]) == 0.0
        with torch.no_grad():
            w[0, 0] = keep


def test_head_vector_uses_the_kv_group_slice(tok) -> None:
    model = _llama(tok, heads=4, kv=2, hidden=32)
    lay = find_attention(model)[0]
    d = lay.head_dim
    u = head_vector(lay, 3)  # group 1
    assert u.numel() == 3 * d * 32
    assert torch.equal(u[d * 32:2 * d * 32], lay.k.weight[d:2 * d].reshape(-1))


def test_selected_counts_and_tie_break() -> None:
    s = torch.zeros(4, 8, dtype=torch.float64)
    assert len(select_heads(s, 0.1)) == 3  # floor(3.2)
    assert [h[:2] for h in select_heads(s, 0.1)] == [(0, 0), (0, 1), (0, 2)]
    assert len(select_heads(s, 0.001)) == 1
    assert len(select_heads(s, 1.0)) == 32
    s[3, 7] = 1.0
    assert select_heads(s, 0.01)[0][:2] == (3, 7)
    assert len(random_heads((4, 8), 0.1, seed=5).heads) == 3


# --------------------------------------------------------------------------------------------------
# gradient masks


def _one_step(model: nn.Module, tok, data) -> None:
    sft(model, tok, data, SFTConfig(lr=1e-2, steps=1, batch_size=8, weight_decay=0.0, grad_clip=None, seed=0))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_one_step_changes_only_the_selected_slices(tok, pool, kind) -> None:
    model = _llama(tok, heads=4, kv=2) if kind == "llama" else _gpt2(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    heads = [(0, 1), (1, 3)]
    with restrict_to_heads(model, heads) as r:
        _one_step(model, tok, pool[:16])
        masks = {id(p): m for p, m in r.masks.items()}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(("attn" in n) for n in changed), changed
    for n, p in model.named_parameters():
        diff = p.detach() != before[n]
        if id(p) in masks:
            assert not (diff & (masks[id(p)] == 0)).any(), n
        else:
            assert not diff.any(), n  # embeddings, MLP, norms, o_proj / c_proj bias: byte-identical
    lay = find_attention(model)[0]
    d = lay.head_dim
    if kind == "llama":  # q rows of head 1 move; k rows of group 0 (heads 0, 1) move, of group 1 do not
        assert (model.model.layers[0].self_attn.q_proj.weight != before["model.layers.0.self_attn.q_proj.weight"])[
            d:2 * d].any()
        kdiff = model.model.layers[0].self_attn.k_proj.weight != before["model.layers.0.self_attn.k_proj.weight"]
        assert kdiff[:d].any() and not kdiff[d:].any()
        odiff = model.model.layers[1].self_attn.o_proj.weight != before["model.layers.1.self_attn.o_proj.weight"]
        assert odiff[:, 3 * d:].any() and not odiff[:, :3 * d].any()
    assert all(p.requires_grad for p in model.parameters())  # restored on exit


def test_gqa_rule_kv_slice_trainable_iff_a_query_head_of_its_group_is(tok) -> None:
    model = _llama(tok, heads=4, kv=2, layers=1)
    lay = find_attention(model)[0]
    d = lay.head_dim
    for heads, groups in (([(0, 0)], [0]), ([(0, 2)], [1]), ([(0, 1), (0, 3)], [0, 1])):
        with restrict_to_heads(model, heads) as r:
            m = r.masks[lay.k.weight]
            for g in range(2):
                assert bool(m[g * d:(g + 1) * d].all()) == (g in groups)
                assert bool(m[g * d:(g + 1) * d].any()) == (g in groups)


def test_all_heads_all_data_equals_attention_only_fine_tuning(tok, pool) -> None:
    a, b = _llama(tok), _llama(tok)
    with restrict_to_heads(a, torch.ones(2, 4, dtype=torch.bool)):
        _one_step(a, tok, pool)
    attn = {id(p) for lay in find_attention(b) for m in (lay.q, lay.k, lay.v, lay.o) for p in m.parameters()}
    for p in b.parameters():
        p.requires_grad_(id(p) in attn)
    _one_step(b, tok, pool)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


# --------------------------------------------------------------------------------------------------
# data scores


def test_batched_head_gradients_equal_one_sample_at_a_time(tok, pool) -> None:
    model = _llama(tok)
    mask = head_mask([(0, 2), (1, 0)], 2, 4)
    enc = encode_pool(tok, pool[:8], dedup=False)
    batched, bad = head_gradients(model, enc, mask, batch_size=8)
    one = torch.cat([head_gradients(model, encode_pool(tok, [e], dedup=False), mask)[0] for e in pool[:8]])
    assert bad == 0
    torch.testing.assert_close(batched, one, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("affinity", ["grad_norm", "activation", "grad_cosine"])
def test_selection_is_invariant_to_the_pool_order(tok, pool, affinity) -> None:
    model = _llama(tok)
    p = P2D(model, tok, proxy_steps=2, head_fraction=0.25, data_fraction=0.2, affinity=affinity)
    p.localize_heads(pool[:8])
    sel = p.select_data(pool)
    perm = torch.randperm(len(pool), generator=torch.Generator().manual_seed(7)).tolist()
    sel2 = p.select_data([pool[i] for i in perm])
    assert len(sel.indices) == round(0.2 * len(pool))
    assert [pool[i].text for i in sel.indices] == [pool[perm[j]].text for j in sel2.indices]
    assert set(p.timings) == {"proxy", "select"}


def test_empty_responses_and_duplicates_are_excluded_with_a_warning(tok, pool) -> None:
    model = _llama(tok)
    data = list(pool[:10]) + [("task:copy 1 2 3 4 5 =>", "")] + [pool[0]]
    p = P2D(model, tok, proxy_steps=0, data_fraction=1.0)
    with pytest.warns(RuntimeWarning, match="no response token"):
        sel = p.select_data(data, [(0, 0)])
    assert sel.no_response == [10] and sel.duplicates == [11]
    assert sorted(sel.indices) == list(range(10))
    assert torch.isnan(sel.affinities[10]) and torch.isnan(sel.affinities[11])


def test_nan_gradients_are_excluded_and_counted(tok, pool) -> None:
    model = _llama(tok)
    lay = find_attention(model)[0]

    def poison(mod, inp, out):  # sample 0 of every batch gets a NaN query
        out = out.clone()
        out[0, 0, 0] = float("nan")
        return out

    h = lay.q.register_forward_hook(poison)
    try:
        p = P2D(model, tok, proxy_steps=0, data_fraction=0.5, batch_size=4)
        sel = p.select_data(pool[:8], [(0, 0)])
    finally:
        h.remove()
    assert sel.nonfinite == 2
    assert 0 not in sel.indices and 4 not in sel.indices and len(sel.indices) == 4


def test_baselines(tok, pool) -> None:
    model = _llama(tok)
    r = random_data(pool, 0.1, seed=0)
    assert len(r.indices) == 6 and r.indices == random_data(pool, 0.1, seed=0).indices
    ld = loss_data(model, tok, pool, 0.1)
    assert len(ld.indices) == 6
    assert float(ld.affinities[ld.indices[0]]) == float(ld.affinities.nan_to_num(-1).max())


def test_lora_baseline_through_peft(tok) -> None:
    pytest.importorskip("peft")
    from rankwise.train.p2d import lora_model

    m = lora_model(_llama(tok), rank=2)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)

    # the adapter's initialisation depends on `seed` only, and the caller's generator is left alone
    def a_factors(seed: int, prior: int) -> list[torch.Tensor]:
        base = _llama(tok)
        torch.manual_seed(prior)
        before = torch.get_rng_state()
        out = [p.detach().clone() for n, p in lora_model(base, rank=2, seed=seed).named_parameters()
               if "lora_A" in n]
        assert torch.equal(torch.get_rng_state(), before)
        return out

    a, b, c = a_factors(0, 1), a_factors(0, 2), a_factors(1, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="seed"):
        lora_model(_llama(tok), rank=2, seed=-1)


# --------------------------------------------------------------------------------------------------
# persistence, AER


def test_head_mask_round_trip(tmp_path, tok, pool) -> None:
    model = _llama(tok)
    p = P2D(model, tok, proxy_steps=2, head_fraction=0.3)
    sel = p.localize_heads(pool[:8])
    path = p.save_heads(tmp_path / "heads.safetensors")
    back = load_heads(path, 2, 4)
    assert torch.equal(back.mask, sel.mask) and torch.equal(back.scores, sel.scores)
    assert back.heads == sel.heads and back.meta["head_score"] == "wasserstein"
    assert P2D(model, tok).load_heads(path).heads == sel.heads
    with pytest.raises(ArtifactError, match="the model has"):
        load_heads(path, 3, 4)
    (tmp_path / "junk.safetensors").write_bytes(b"nonsense")
    with pytest.raises(ArtifactError):
        load_heads(tmp_path / "junk.safetensors")


def test_aer() -> None:
    r = aer(1.0, 2.0, 4.0, 70.0)
    assert r["aer"] == pytest.approx(0.1) and r["speedup"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="t_ref"):
        aer(1.0, 1.0, 1.0, 0.0)


# --------------------------------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("field", ["head_fraction", "data_fraction"])
@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, float("nan")])
def test_fractions_outside_unit_interval(field, value) -> None:
    with pytest.raises(ValueError, match=f"P2DConfig.{field}"):
        P2DConfig(**{field: value})
    with pytest.raises(ValueError):
        select_heads(torch.zeros(2, 2), value)


def test_empty_pool_or_probe(tok) -> None:
    p = P2D(_llama(tok), tok, proxy_steps=1)
    with pytest.raises(ValueError, match="empty"):
        p.localize_heads([])
    with pytest.raises(ValueError, match="empty"):
        p.select_data([], [(0, 0)])
    with pytest.raises(ValueError, match="empty"):
        random_data([], 0.1)


def test_unknown_architecture_lists_supported_names() -> None:
    with pytest.raises(ValueError, match="q_proj/k_proj/v_proj/o_proj.*c_attn/c_proj.*register_attention_finder"):
        P2D(nn.Sequential(nn.Linear(4, 4)), None)


def test_hidden_not_divisible_by_heads() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(30, 30) for _ in range(4))

    with pytest.raises(ValueError, match="not divisible by the number of heads 4"):
        find_attention(nn.Sequential(Attn()))


def test_head_mask_and_selection_errors(tok) -> None:
    model = _llama(tok)
    with pytest.raises(ValueError, match="outside"):
        restrict_to_heads(model, [(5, 0)])
    with pytest.raises(ValueError, match="no head"):
        restrict_to_heads(model, torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="shaped"):
        restrict_to_heads(model, torch.ones(3, 4, dtype=torch.bool))
    assert all(p.requires_grad for p in model.parameters())  # nothing half-done
    with pytest.raises(ValueError, match="NaN"):
        select_heads(torch.tensor([[float("nan")]]), 0.5)
    with pytest.raises(ValueError, match="localize_heads"):
        P2D(model, tok).select_data([("a", "b")])


def test_select_entry_point_head_sources(tok, pool) -> None:
    from rankwise.train.p2d import select

    model = _llama(tok)
    cfg = P2DConfig(proxy_steps=1, data_fraction=0.1)
    data, heads, timings = select(model, tok, pool, "loss", cfg, "all")
    assert heads.mask.all() and len(data.indices) == 6 and "select" in timings
    with pytest.raises(ValueError, match="the model has"):
        select(model, tok, pool, "p2d", cfg, HeadSelection(torch.ones(3, 4, dtype=torch.bool), torch.zeros(3, 4)))
    with pytest.raises(ValueError, match="heads must be"):
        select(model, tok, pool, "random", cfg, "best")
    with pytest.raises(ValueError, match="method"):
        select(model, tok, pool, "magic", cfg)
