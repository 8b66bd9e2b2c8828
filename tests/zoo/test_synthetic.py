"""The synthetic worlds: tokenizers round-trip, generators are seeded, tags align, splits are disjoint."""

from __future__ import annotations

import pytest

from rankwise.zoo.synthetic import (
    AdditionWorld,
    ArithmeticWorld,
    Example,
    P2DWorld,
    SafetyWorld,
    char_tokenizer,
    completion_tags,
    word_tokenizer,
)


def test_word_tokenizer_roundtrip_and_specials():
    tok = word_tokenizer(["a", "b", "c"], vocab_size=10)
    assert len(tok) == 10
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("a b  c")["input_ids"]
    assert ids == [4, 5, 6]
    assert tok.decode(ids) == "a b c"
    assert tok("zz")["input_ids"] == [tok.unk_token_id]
    assert tok("a <eos>")["input_ids"] == [4, 2]


def test_char_tokenizer_each_char_one_token():
    tok = char_tokenizer("0123456789+= ")
    ids = tok("37+45=")["input_ids"]
    assert len(ids) == 6
    assert tok.decode(ids) == "37+45="
    assert tok("1 2<eos>")["input_ids"][-1] == tok.eos_token_id


def test_tokenizer_bad_inputs():
    with pytest.raises(ValueError, match="duplicate"):
        word_tokenizer(["a", "a"])
    with pytest.raises(ValueError, match="whitespace"):
        word_tokenizer(["a b"])
    with pytest.raises(TypeError):
        word_tokenizer("abc")
    with pytest.raises(ValueError, match="vocab_size"):
        word_tokenizer(["a"], vocab_size=3)
    with pytest.raises(ValueError, match="single character"):
        char_tokenizer(["ab"])


def test_arithmetic_world_template_tags_and_answer():
    w = ArithmeticWorld()
    tok = w.tokenizer()
    assert len(tok) == 300
    ex = w.example((2, 3, 4), (4, 5, 1), op="add")
    assert ex.prompt == "q 2 3 4 + 4 5 1 ;"
    assert ex.completion == " so 2 + 4 = 6 , so 3 + 5 = 8 , so 4 + 1 = 5 ; ans 6 8 5"
    rev = w.example((2, 3, 4), (4, 5, 1), op="add_rev")
    assert rev.meta["answer"] == "5 8 6" and w.parse_answer(rev.completion) == "5 8 6"
    assert completion_tags(rev, tok).count("answer") == 3
    assert rev.tags.count("syn") == 3
    with pytest.raises(ValueError, match="carry"):
        w.example((9, 9, 9), (1, 1, 1))


def test_arithmetic_world_seeded_split_and_fillers():
    w = ArithmeticWorld()
    tr, te = w.split(200, 50, seed=3)
    assert not set(tr) & set(te) and len(set(tr)) == 200
    assert w.split(200, 50, seed=3) == (tr, te)
    a = w.examples(tr, "add_rev", seed=1, filler_rate=0.5)
    assert a == w.examples(tr, "add_rev", seed=1, filler_rate=0.5)
    n_fill = sum("filler" in e.tags for e in a)
    assert 60 < n_fill < 140  # about half
    tok = w.tokenizer()
    for e in a[:50]:
        completion_tags(e, tok)
        conns = [wd for wd, t in zip(e.completion.split(), e.tags) if t == "syn"]
        assert set(conns) <= set(w.connectives)
    with pytest.raises(ValueError, match="distinct problems"):
        w.split(w.space, 1, seed=0)
    assert w.parse_answer("so ; ans 1 2 umm") == "1 2" and w.parse_answer("no answer") is None


def test_arithmetic_problem_index_covers_space():
    w = ArithmeticWorld(n_digits=2)
    pairs = {w.problem(i) for i in range(w.space)}
    assert len(pairs) == w.space == 36 * 55
    for a, b in pairs:
        assert all(x + y <= 9 for x, y in zip(a, b)) and a[0] >= 1 and b[0] >= 1


def test_addition_world_noise_and_reward():
    w = AdditionWorld()
    tr, te = w.split(300, 100, seed=0)
    assert not set(tr) & set(te)
    clean = w.examples(tr, seed=0)
    assert all(AdditionWorld.reward(e.completion, e) == 1.0 for e in clean)
    noisy = w.examples(tr, seed=0, noise=0.3)
    share = sum(e.meta["noisy"] for e in noisy) / len(noisy)
    assert 0.2 < share < 0.4
    for e in noisy:
        assert e.completion.isdigit() and (e.completion != e.meta["answer"]) == e.meta["noisy"]
    assert AdditionWorld.reward("82<eos>", w.example(37, 45)) == 1.0
    assert AdditionWorld.reward("83", w.example(37, 45)) == 0.0
    tok = w.tokenizer()
    assert len(tok(clean[0].text)["input_ids"]) == len(clean[0].text)


def test_safety_world_heldout_words_and_responses():
    w = SafetyWorld()
    held = set(w.harmful_words[-w.n_heldout:])
    train = w.harmful(200, seed=0)
    assert all(not (set(e.prompt.split()) & held) for e in train)
    test = w.harmful(50, seed=1, heldout=True, response="comply")
    assert all(set(e.prompt.split()) & held for e in test)
    assert all(e.completion.startswith(" COMPLY") for e in test)
    ben = w.benign(50, seed=0)
    assert all(not e.meta["harmful"] and "h_" not in e.prompt for e in ben)
    assert SafetyWorld.is_refusal(" REFUSE") and not SafetyWorld.is_refusal(" COMPLY 3")
    tok = w.tokenizer()
    assert tok.unk_token_id not in tok(test[0].text)["input_ids"]


def test_p2d_world_tasks_and_pool():
    w = P2DWorld()
    import torch

    g = torch.Generator().manual_seed(0)
    ex = w.example("sort_desc", g)
    digits = ex.prompt.split()[1:-1]
    assert ex.completion.split() == sorted(digits, reverse=True)
    add = w.example("add", g)
    a, b = add.prompt.split()[1:3], add.prompt.split()[4:6]
    assert add.meta["answer"].replace(" ", "") == str(int("".join(a)) + int("".join(b)))
    pool = w.pool(1000, seed=0)
    target = [e for e in pool if e.meta["task"] == "sort_desc"]
    assert len(target) == 500 and sum(e.meta["corrupted"] for e in target) == 200
    assert all(e.completion.split() != e.meta["answer"].split() for e in target if e.meta["corrupted"])
    assert w.pool(1000, seed=0) == pool
    with pytest.raises(ValueError):
        w.pool(10, seed=0, target_frac=0.8, corrupt_frac=0.5)
    tok = w.tokenizer()
    assert tok.unk_token_id not in tok(pool[0].text)["input_ids"]


def test_example_as_trl():
    e = Example("p", " c", ("x",))
    assert e.as_trl() == {"prompt": "p", "completion": " c"} and e.text == "p c"
