"""SAMBAL: the spec's correctness checks, the minimal-pair scorer and bad inputs."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from rankwise.core.errors import NumericalError
from rankwise.science.sambal import (
    CONTENT_TAGS,
    PHENOMENA,
    Lexicon,
    MinimalPair,
    Relexicalizer,
    SyntheticGrammar,
    Token,
    as_token,
    minimal_pair_accuracy,
    read_pairs,
    write_pairs,
)


@pytest.fixture(scope="module")
def grammar() -> SyntheticGrammar:
    return SyntheticGrammar.default(seed=0)


@pytest.fixture(scope="module")
def sample(grammar: SyntheticGrammar) -> list:
    return grammar.sample(400, seed=3)


@pytest.fixture(scope="module")
def relexed(grammar: SyntheticGrammar, sample: list) -> list:
    relex = Relexicalizer(Lexicon.from_grammar(grammar), seed=0)
    return [relex(s) for s in sample]


class _Vocab:
    """A tokenizer over the grammar's words (callable text -> ids) with a BOS id."""

    def __init__(self, words: list[str]):
        self.ids = {w: i + 1 for i, w in enumerate(words)}
        self.bos_token_id = 0

    def __call__(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]


class _Logits(torch.nn.Module):
    """Logits fixed per vocabulary id (the same at every position)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.row = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return type("O", (), {"logits": self.row.expand(*input_ids.shape, -1)})()


# ------------------------------------------------------------------------------------------ grammar

def test_generated_sentences_are_grammatical(grammar, sample) -> None:
    assert all(grammar.check(s) for s in sample)
    assert all(s.text.endswith(" .") for s in sample)
    assert not any(grammar.violates_selection(s) for s in sample)  # the natural corpus: 0%
    assert not any(grammar.states_reverse_fact(s) for s in sample)
    assert any(s.meta["facts"] for s in sample)
    held = grammar.heldout_pairs
    assert not any((s.tokens[c[0]].lemma, s.tokens[c[1]].lemma) in held for s in sample for c in s.clauses)


def test_generated_sentences_parse_with_nltk(grammar, sample) -> None:
    pytest.importorskip("nltk")
    assert all(grammar.parses(s.words) for s in sample[:12])
    assert not grammar.parses("the dogs runs .")
    assert not grammar.parses("the dog sleeps the cat .")
    assert not grammar.parses("the dog sees .")


def test_check_refuses_broken_derivations(grammar, sample) -> None:
    s = sample[0]
    verb = next(i for i, t in enumerate(s.tokens) if t.tag == "V")
    t = s.tokens[verb]
    other = grammar.verb_form(t.lemma, "pl" if t.feats["form"] == "pres3sg" else "sg", "pres")
    if other != t.word:  # an agreement error in a present-tense clause
        assert not grammar.check(s.replace_tokens([*s.tokens[:verb], t._replace(word=other), *s.tokens[verb + 1:]]))
    det = [Token("a", "DET"), Token("apple", "N")]
    bad = type(s)(tuple(det + [Token("falls", "V"), Token(".", "PUNCT")]),
                  ("ROOT", ("CL.pres", ("NP.sg", ("DET.sg", 0), ("NOM.sg", ("N.sg", 1))), ("VP.sg.pres", ("VI.sg.pres", 2))),
                   ("PUNCT", 3)))
    assert not grammar.check(bad)  # "a apple"
    good = bad.replace_tokens([Token("an", "DET"), *bad.tokens[1:]])
    assert grammar.check(good)


def test_determinism(grammar) -> None:
    assert [s.text for s in grammar.sample(30, seed=1)] == [s.text for s in SyntheticGrammar(seed=0).sample(30, seed=1)]
    assert [s.text for s in grammar.sample(30, seed=1)] != [s.text for s in grammar.sample(30, seed=2)]


# ------------------------------------------------------------------------------------------ relexicalisation

def test_relexicalised_tokens_keep_category_and_features(sample, relexed) -> None:
    n_content = 0
    for a, b in zip(sample, relexed):
        assert a.tree == b.tree and a.clauses == b.clauses
        for ta, tb in zip(a.tokens, b.tokens):
            if ta.tag in CONTENT_TAGS:
                n_content += 1
                assert (ta.tag, ta.features) == (tb.tag, tb.features)
                assert ta.lemma != tb.lemma  # every bucket of the default lexicon has >= 2 lemmas
            elif ta.word in ("a", "an"):
                assert tb.word in ("a", "an")
            else:
                assert ta == tb  # function words untouched
    assert n_content > 1000


def test_relexicalised_sentences_stay_grammatical(grammar, relexed) -> None:
    assert all(grammar.check(s) for s in relexed)  # 100% from the kept derivation
    assert sum(grammar.violates_selection(s) for s in relexed) / len(relexed) >= 0.5
    pytest.importorskip("nltk")
    assert all(grammar.parses(s.words) for s in relexed[:10])


def test_articles_are_regenerated(grammar) -> None:
    lex = Lexicon.from_entries([("dog", "N", {"number": "sg"}), ("owl", "N", {"number": "sg"})])
    out = Relexicalizer(lex, seed=0)([("a", "DET", {}), ("dog", "N", {"number": "sg"}), ("sleeps", "V", {})]
                                     [:2] + [(".", "PUNCT", {})])
    assert [t.word for t in out] == ["an", "owl", "."]


def test_relexicalisation_is_deterministic_and_scoped(grammar, sample) -> None:
    lex = Lexicon.from_grammar(grammar)
    r1, r2, r3 = Relexicalizer(lex, seed=5), Relexicalizer(lex, seed=5), Relexicalizer(lex, seed=6)
    a, b, c = ([r(s).text for s in sample[:50]] for r in (r1, r2, r3))
    assert a == b and a != c  # same seed, same corpus
    # document scope: one mapping per document
    doc = [s for s in sample if any(t.lemma == "dog" for t in s.tokens)][:5]
    assert len(doc) >= 2
    out = Relexicalizer(lex, scope="document", seed=1).document(doc)
    images = {tb.lemma for sa, sb in zip(doc, out) for ta, tb in zip(sa.tokens, sb.tokens) if ta.lemma == "dog"}
    assert len(images) == 1


def test_bucket_of_one_is_kept_and_counted() -> None:
    lex = Lexicon.from_entries([("cat", "N", {"number": "sg"}), ("dogs", "N", {"number": "pl", "lemma": "dog"}),
                                ("cats", "N", {"number": "pl", "lemma": "cat"})])
    r = Relexicalizer(lex, seed=0)
    out = r([("the", "DET", {}), ("cat", "N", {"number": "sg"}), ("cats", "N", {"number": "pl", "lemma": "cat"})])
    assert [t.word for t in out] == ["the", "cat", "dogs"]
    assert r.stats.kept_singleton == 1 and r.stats.replaced == 1


def test_frequency_matched_draws_within_band() -> None:
    entries = [(w, "N", {"number": "sg"}) for w in ("a1", "a2", "a3", "b1", "b2", "b3")]
    freq = {"a1": 1000, "a2": 1100, "a3": 900, "b1": 3, "b2": 3, "b3": 2}
    lex = Lexicon.from_entries(entries, freq)
    r = Relexicalizer(lex, frequency_matched=True, seed=0)
    for _ in range(50):
        assert r([("a1", "N", {"number": "sg"})])[0].word in ("a2", "a3")
        assert r([("b1", "N", {"number": "sg"})])[0].word in ("b2", "b3")
    with pytest.raises(ValueError, match="frequencies"):
        Relexicalizer(Lexicon.from_entries(entries), frequency_matched=True)


def test_from_tagged_plugin() -> None:
    words = ["the", "dog", "barks", "the", "cat", "meows"]
    tags = ["DET", "N", "V", "DET", "N", "V"]
    feats = [{}, {"number": "sg"}, {"form": "pres3sg", "frame": "intr", "lemma": "bark"}, {}, {"number": "sg"},
             {"form": "pres3sg", "frame": "intr", "lemma": "meow"}]
    lex = Lexicon.from_tagged(words, tags, feats)
    assert lex.freq == {"dog": 1, "bark": 1, "cat": 1, "meow": 1}
    out = Relexicalizer(lex, seed=0)(list(zip(words[:3], tags[:3], feats[:3])))
    assert [t.word for t in out] == ["the", "cat", "meows"]
    with pytest.raises(ValueError, match="differ in length"):
        Lexicon.from_tagged(words, tags[:2], feats)


def test_relexicaliser_bad_inputs(grammar) -> None:
    lex = Lexicon.from_grammar(grammar)
    r = Relexicalizer(lex)
    with pytest.raises(KeyError, match="no lexicon bucket for key .*'N'.*'dual'"):
        r([("dogz", "N", {"number": "dual"})])
    keep = Relexicalizer(lex, on_unknown="keep")
    assert keep([("dogz", "N", {"number": "dual"})])[0].word == "dogz" and keep.stats.unknown_kept == 1
    with pytest.raises(ValueError, match="empty sentence"):
        r([])
    with pytest.raises(ValueError, match="Sentence or a list"):
        r("the dog runs .")
    with pytest.raises(ValueError, match="non-empty str"):
        r([(3, "N", {})])
    with pytest.raises(ValueError, match="Relexicalizer.scope"):
        Relexicalizer(lex, scope="corpus")
    with pytest.raises(TypeError, match="Lexicon"):
        Relexicalizer({})
    with pytest.raises(ValueError, match="frame_p"):
        SyntheticGrammar(frame_p=(0.5, 0.5))
    with pytest.raises(TypeError, match="token"):
        as_token("dog")


# ------------------------------------------------------------------------------------------ probes

def test_probes_are_minimal_pairs_with_the_right_grammaticality(grammar) -> None:
    syn = grammar.probes("syntax", 40)
    assert len(syn) == 40 and Counter(p.uid for p in syn) == {k: 10 for k in PHENOMENA}
    know, conf = grammar.probes("knowledge", 20), grammar.probes("conflict", 20)
    for p in know + conf:
        assert sorted(p.good.split()) == sorted(p.bad.split())  # the same words
    assert {p.extra["kind"] for p in know} == {"fact", "selection"}
    fact = next(p for p in know if p.extra["kind"] == "fact").good.split()
    lemma = {grammar.noun_form(n, m): n for n in grammar.nouns_of(("animate", "food", "place", "tool"))
             for m in ("sg", "pl")}
    assert any(lemma[fact[1]] == s and lemma[fact[4]] == o for s, _, o in grammar.facts)
    for p in syn:
        assert len(p.good.split()) == len(p.bad.split())
    assert grammar.probes("syntax", 40) == syn  # deterministic
    pytest.importorskip("nltk")
    assert all(grammar.parses(p.good) for p in syn[::4] + conf[:5] + know[:5])
    assert not any(grammar.parses(p.bad) for p in syn[::4] + conf[:5])
    assert all(grammar.parses(p.bad) for p in know[:5])  # knowledge: both members grammatical
    with pytest.raises(ValueError, match="kind"):
        grammar.probes("semantics")


# ------------------------------------------------------------------------------------------ scoring

def test_ties_count_half(grammar) -> None:
    tok = _Vocab(grammar.vocabulary())
    pairs = grammar.probes("syntax", 20)
    res = minimal_pair_accuracy(_Logits(torch.zeros(len(tok.ids) + 1)), tok, pairs)
    assert res.accuracy == 0.5 and res.ties == 20 and res.unequal_length == 0


def test_accuracy_follows_log_probabilities(grammar) -> None:
    tok = _Vocab(grammar.vocabulary())
    row = torch.zeros(len(tok.ids) + 1)
    row[tok.ids["runs"]] = 5.0  # prefers every sentence holding "runs"
    pairs = [MinimalPair("the dog runs .", "the dog run .", uid="a"), MinimalPair("the dogs run .", "the dogs runs .", uid="b"),
             MinimalPair("the dog runs .", "the dog .", uid="c")]
    res = minimal_pair_accuracy(_Logits(row), tok, pairs)
    assert res.scores[:2] == [1.0, 0.0] and res.by_uid == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert res.unequal_length == 1 and res.records[2]["unequal_length"]  # flagged, still scored (sum log-prob)
    lp = torch.log_softmax(row.double(), -1)
    expect = float(lp[tok.ids["the"]] + lp[tok.ids["dog"]] + lp[tok.ids["runs"]] + lp[tok.ids["."]])
    assert math.isclose(res.records[0]["logprob_good"], expect, rel_tol=1e-12)


def test_jsonl_round_trip(tmp_path, grammar) -> None:
    pairs = grammar.probes("conflict", 6)
    path = write_pairs(tmp_path / "pairs.jsonl", pairs)
    back = read_pairs(path)
    assert back == pairs
    first = json.loads(path.read_text().splitlines()[0])
    assert {"sentence_good", "sentence_bad", "UID", "field", "pairID"} <= set(first)
    tok = _Vocab(grammar.vocabulary())
    res = minimal_pair_accuracy(_Logits(torch.zeros(len(tok.ids) + 1)), tok, path, out=tmp_path / "scored.jsonl")
    scored = read_pairs(tmp_path / "scored.jsonl")
    assert [p.good for p in scored] == [p.good for p in pairs]
    assert scored[0].extra["score"] == 0.5 and res.n == 6


def test_scoring_bad_inputs(tmp_path, grammar) -> None:
    tok = _Vocab(grammar.vocabulary())
    model = _Logits(torch.zeros(len(tok.ids) + 1))
    with pytest.raises(ValueError, match="identical"):
        MinimalPair("the dog runs .", "the  dog runs .")
    with pytest.raises(ValueError, match="empty sentence"):
        MinimalPair("", "the dog runs .")
    with pytest.raises(ValueError, match="must be a str"):
        MinimalPair(["the"], "the dog runs .")
    with pytest.raises(ValueError, match="no pairs"):
        minimal_pair_accuracy(model, tok, [])
    (tmp_path / "bad.jsonl").write_text('{"sentence_good": "the dog runs ."}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*sentence_bad"):
        read_pairs(tmp_path / "bad.jsonl")
    (tmp_path / "nojson.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_pairs(tmp_path / "nojson.jsonl")
    with pytest.raises(NumericalError, match="non-finite"):
        minimal_pair_accuracy(_Logits(torch.full((len(tok.ids) + 1,), float("nan"))), tok,
                              [MinimalPair("the dog runs .", "the dog run .")])
    with pytest.raises(ValueError, match="prefix_ids"):
        minimal_pair_accuracy(model, lambda t: [1, 2], [MinimalPair("the dog runs .", "the dog run .")])
