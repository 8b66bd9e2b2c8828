"""AgentVocab: the spec's correctness checks and bad inputs, on the zoo's smoke tiny LM and seeded traces."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from rankwise import zoo
from rankwise.infer.agentvocab import (
    MARKERS,
    AgentVocab,
    AgentVocabConfig,
    add_markers,
    call_text,
    continued_bpe,
    exact_match,
    expand_model,
    expanded_tokenizer,
    is_marker_safe,
    parse_call,
    parse_calls,
    render,
    render_corpus,
    sft_example,
    subtoken_ids,
    token_counts,
)
from rankwise.zoo.agent_traces import TOOLS, agent_traces


@pytest.fixture(scope="module")
def base() -> tuple[torch.nn.Module, object]:
    model, tok = zoo.tiny_lm("smoke")
    tok, added = add_markers(model, tok, MARKERS)
    assert added == list(MARKERS)
    return model, tok


@pytest.fixture(scope="module")
def rendered() -> list:
    return render_corpus(agent_traces(150, 0))[0]


@pytest.fixture(scope="module")
def selected(base, rendered) -> tuple[AgentVocab, list]:
    model, tok = base
    av = AgentVocab(tok, AgentVocabConfig(structural_budget=24, content_budget=8, min_freq=5, grad_samples=4,
                                          grad_max_length=256))
    cands = av.mine(rendered, grad_model=model)
    return av, av.select_reachable(cands, rendered)


def test_generator_is_seeded_and_documented() -> None:
    assert len(TOOLS) == 30 and all(1 <= len(t["parameters"]["properties"]) <= 4 for t in TOOLS)
    a, b = agent_traces(20, 3), agent_traces(20, 3)
    assert a == b and a != agent_traces(20, 4)
    for t in a:
        call = t["messages"][1]["tool_calls"][0]
        assert call["name"] in {x["name"] for x in t["tools"]} and len(t["tools"]) == 2
        request = t["messages"][0]["content"]
        for v in call["arguments"].values():  # argument values are copied into the request
            if isinstance(v, (str, int)) and not isinstance(v, bool):
                assert str(v) in request


def test_render_segments_prompt_and_parser(rendered) -> None:
    for r in rendered[:20]:
        assert "".join(s.text for s in r.segments) == r.text and r.text.startswith(r.prompt)
        assert r.prompt.endswith("<|im_start|>assistant\n")
        assert parse_call(call_text(r.call)) == r.call and exact_match(parse_call(r.text[len(r.prompt):]), r.call)
        assert r.text[r.train_spans[0][0]:].startswith("<tool_call>")
        # keys structural, argument values content
        kinds = {s.text: s.kind for s in r.segments}
        assert kinds['"name": '] == "s"
    assert parse_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> junk <tool_call>{bad') == \
        [{"name": "f", "arguments": {}}]
    assert parse_call("no call here") is None
    gold = {"name": "f", "arguments": {"n": 1}}
    assert not exact_match({"name": "f", "arguments": {"n": 1.0}}, gold)
    assert not exact_match({"name": "f", "arguments": {"n": True}}, {"name": "f", "arguments": {"n": 1}})


def test_round_trip_with_t0_and_expanded(base, rendered, selected) -> None:
    _, tok = base
    av, tokens = selected
    new, _ = av.expand(None, tokens)
    texts = [r.text for r in rendered] + ["héllo wörld ✓ 😀\n\t  <tool_call> </tool_call", '{"name": "x"}}\n']
    for t in (tok, new):
        for s in texts:
            ids = t(s, add_special_tokens=False)["input_ids"]
            assert t.decode(ids, clean_up_tokenization_spaces=False) == s


def test_new_ids_old_ids_and_plain_text(base, selected) -> None:
    _, tok = base
    av, tokens = selected
    new, _ = av.expand(None, tokens)
    v0 = len(tok)
    assert len(new) == v0 + len(tokens)
    assert new.convert_tokens_to_ids([c.text for c in tokens]) == list(range(v0, v0 + len(tokens)))
    assert all(new.convert_ids_to_tokens(i) == tok.convert_ids_to_tokens(i) for i in range(v0))
    plain = "Return the number of items in the list."
    assert not any(c.text in plain for c in tokens)
    assert new(plain, add_special_tokens=False)["input_ids"] == tok(plain, add_special_tokens=False)["input_ids"]


def test_mean_init_is_exact_and_k_zero_changes_nothing(base, selected) -> None:
    model0, tok = base
    av, tokens = selected
    model = copy.deepcopy(model0)
    _, model = av.expand(model, tokens)
    subs = subtoken_ids(tok, [c.text for c in tokens])
    w, h = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    w0, h0 = model0.get_input_embeddings().weight, model0.get_output_embeddings().weight
    for j, ids in enumerate(subs):
        assert torch.equal(w[len(tok) + j], w0[ids].mean(0)) and torch.equal(h[len(tok) + j], h0[ids].mean(0))
    assert torch.equal(w[:len(tok)], w0[:len(tok)])
    # K = 0: tokenizer and weights unchanged
    m2 = copy.deepcopy(model0)
    new, _ = av.expand(m2, [])
    assert len(new) == len(tok)
    assert all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), model0.state_dict().values()))


def test_tied_and_padded_embeddings(base) -> None:
    _, tok = base
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    padded = -(-len(tok) // 64) * 64 + 64  # rounded up to a multiple of 64, with padding rows
    m = LlamaForCausalLM(LlamaConfig(vocab_size=padded, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    tokens = ['{"name": "', '", "arguments": {"']
    before = m.get_input_embeddings().weight.detach().clone()
    info = expand_model(m, tok, tokens)
    w = m.get_input_embeddings().weight
    assert info["ids"] == [len(tok), len(tok) + 1] and w.shape[0] == padded  # padding rows reused, not collided
    assert m.get_output_embeddings().weight is w  # still tied
    for i, ids in zip(info["ids"], subtoken_ids(tok, tokens)):
        assert torch.equal(w[i], before[ids].mean(0))
    # too many tokens for the padding: grows to the next multiple of 64
    many = [f"tok{i}_" for i in range(padded - len(tok) + 3)]
    expand_model(m, tok, many)
    assert m.get_input_embeddings().weight.shape[0] % 64 == 0
    assert m.get_input_embeddings().weight.shape[0] >= len(tok) + len(many)


def test_reachability_and_corpus_never_grows(base, rendered, selected) -> None:
    _, tok = base
    av, tokens = selected
    assert tokens and {c.stream for c in tokens} == {"structural", "content"}
    new, _ = av.expand(None, tokens)
    texts = [r.text for r in rendered]
    emitted = {i for ids in new(texts, add_special_tokens=False)["input_ids"] for i in ids}
    assert all(i in emitted for i in range(len(tok), len(new)))
    assert sum(token_counts(new, texts)) < sum(token_counts(tok, texts))
    assert all(is_marker_safe(c.text) for c in tokens)
    rep = av.compression_report(rendered, new)
    assert rep.total_after < rep.total_before and rep.new_tokens == len(tokens)


def test_marker_safety_and_skips(base, rendered) -> None:
    assert not is_marker_safe('"}\n<tool_')  # would split <tool_call>
    assert not is_marker_safe("call>\n{")
    assert not is_marker_safe("x</tool_call>")
    assert is_marker_safe('{"name": "')
    _, tok = base
    from rankwise.infer.agentvocab import mine_structural

    cands = mine_structural(rendered, tok, min_freq=5)
    assert all(len(c.base_ids) >= 2 for c in cands)  # single T0 tokens are skipped
    assert len({c.text for c in cands}) == len(cands)


def test_budget_larger_than_reachable_warns(base, rendered) -> None:
    _, tok = base
    av = AgentVocab(tok, AgentVocabConfig(min_freq=5))
    cands = av.mine(rendered[:30])
    with pytest.warns(UserWarning, match="budget"):
        out = av.select_reachable(cands, rendered[:30], structural_budget=100_000, content_budget=0)
    assert out


def test_bad_inputs(base) -> None:
    _, tok = base
    with pytest.raises(ValueError, match="0 of 0"):
        render_corpus([])
    bad = [{"tools": [], "messages": [{"role": "user", "content": "hi"}]}, {"x": 1}]
    with pytest.raises(ValueError, match="2 of 2 records rejected"):
        render_corpus(bad)
    rec = agent_traces(1, 0)[0]
    rec["messages"][0]["content"] = "bad \udcff byte"
    with pytest.raises(ValueError, match="record 0.*UTF-8"):
        render(rec, 0)
    with pytest.raises(ValueError, match="AgentVocabConfig.structural_budget must be an int >= 0, got -1"):
        AgentVocabConfig(structural_budget=-1)
    with pytest.raises(ValueError, match="content_budget"):
        AgentVocab(tok).select_reachable({"structural": [], "content": []}, [], content_budget=-2)
    with pytest.raises(ValueError, match="already in the vocabulary"):
        expanded_tokenizer(tok, ["<tool_call>"])
    with pytest.raises(ValueError, match="duplicates"):
        expanded_tokenizer(tok, ["ab_", "ab_"])


def test_sft_labels_cover_assistant_turns_only(base, rendered) -> None:
    _, tok = base
    r = rendered[0]
    ids, labels = sft_example(tok, r, 4096)
    trained = tok.decode([int(i) for i, l in zip(ids, labels) if l != -100], clean_up_tokenization_spaces=False)
    assert trained == "".join(r.text[a:b] for a, b in r.train_spans)
    short_ids, short_labels = sft_example(tok, r, 64)  # left truncation keeps the assistant turns
    assert len(short_ids) == 64 and (short_labels != -100).any()


def test_continued_bpe_contrast(base, rendered) -> None:
    _, tok = base
    texts = [r.text for r in rendered]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new, added = continued_bpe(tok, texts, 20)
    assert len(added) == 20 and len(new) == len(tok) + 20
    for s in texts[:10]:
        assert new.decode(new(s, add_special_tokens=False)["input_ids"], clean_up_tokenization_spaces=False) == s
    assert sum(token_counts(new, texts)) < sum(token_counts(tok, texts))
