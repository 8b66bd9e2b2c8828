"""SAMBAL: corpus generation and relexicalisation throughput, grammaticality checking, minimal-pair scoring.

* ``sambal_corpus``: 2000 sentences of the default synthetic world. Anchor: sampling alone; rows:
  sampling + relexicalisation (uniform, sentence scope), frequency-matched, document scope (20-sentence
  documents).
* ``sambal_check``: grammaticality of 50 relexicalised sentences from the kept derivation
  (``SyntheticGrammar.check``) vs nltk's chart parser on the same CFG (anchor; the parser is built before
  timing). Goal: the derivation check is at least 10x cheaper than parsing.
* ``sambal_scoring``: ``minimal_pair_accuracy`` on 200 syntax pairs (batches of 64) with the
  reproduction's GPT-2 ("full", 4 x 128; seeded random weights: timing needs no training) vs a loop of
  one forward per sentence with ``labels`` (what a user would write with ``transformers``; anchor), and
  the quarter-size model. Goal: batched scoring is not slower than the per-sentence loop.

``SMOKE_CASES`` are 50 sentences / 5 parses / 16 pairs. Run ``python -m benchmarks.run sambal``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

from benchmarks.harness import Case, Goal


def _grammar() -> Any:
    from rankwise.science.sambal import SyntheticGrammar

    return SyntheticGrammar.default(0)


def _corpus(kind: str, n: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science.sambal import Lexicon, Relexicalizer

        g = _grammar()
        lex = Lexicon.from_grammar(g)
        if kind == "sample":
            return lambda: g.sample(n, seed=0)
        if kind == "document scope":
            return lambda: Relexicalizer(lex, scope="document", seed=0).corpus(g.sample_documents(max(1, n // 20), 20))
        fm = kind == "sample + relex (frequency matched)"
        return lambda: [Relexicalizer(lex, frequency_matched=fm, seed=0)(s) for s in g.sample(n, seed=0)]
    return factory


def _check(kind: str, n: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science.sambal import Lexicon, Relexicalizer

        g = _grammar()
        relex = Relexicalizer(Lexicon.from_grammar(g), seed=0)
        sents = [relex(s) for s in g.sample(n, seed=1)]
        if kind == "derivation check":
            return lambda: [g.check(s) for s in sents]
        g.parses(sents[0].words)  # build the parser outside the timing
        return lambda: [g.parses(s.words) for s in sents]
    return factory


def _scoring(kind: str, n: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from transformers import GPT2Config, GPT2LMHeadModel

        from rankwise.science.sambal import minimal_pair_accuracy
        from rankwise.zoo.synthetic import word_tokenizer

        g = _grammar()
        tok = word_tokenizer(g.vocabulary())
        torch.manual_seed(0)
        width = 64 if kind == "batched (1/4 model)" else 128  # the reproduction's two sizes
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=width, n_layer=4,
                                           n_head=4)).eval()
        pairs = g.probes("syntax", n)
        eos = tok.eos_token_id
        if kind != "per-sentence loop":
            return lambda: minimal_pair_accuracy(model, tok, pairs, prefix_ids=[eos], batch_size=64)

        @torch.no_grad()
        def loop() -> list[float]:
            out = []
            for p in pairs:
                for text in (p.good, p.bad):
                    ids = torch.tensor([[eos] + tok(text, add_special_tokens=False)["input_ids"]])
                    out.append(-float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1))
            return out
        return loop
    return factory


_CORPUS = ("sample", "sample + relex", "sample + relex (frequency matched)", "document scope")
_SCORING = ("per-sentence loop", "batched", "batched (1/4 model)")
_HAS_NLTK = importlib.util.find_spec("nltk") is not None


def _cases(n_sent: int, n_parse: int, n_pairs: int, repeats: int) -> list[Case]:
    cases = [Case("sambal_corpus", {k: _corpus(k, n_sent) for k in _CORPUS}, anchor="sample",
                  params={"sentences": n_sent, "world": "SyntheticGrammar.default(0)"}, repeats=repeats, warmup=1)]
    if _HAS_NLTK:
        cases.append(Case("sambal_check", {k: _check(k, n_parse) for k in ("nltk chart parser", "derivation check")},
                          anchor="nltk chart parser", params={"sentences": n_parse}, repeats=repeats, warmup=1,
                          goals=(Goal("the kept derivation is >= 10x cheaper than parsing", impl="derivation check",
                                      max_ratio=0.1),)))
    cases.append(Case("sambal_scoring", {k: _scoring(k, n_pairs) for k in _SCORING}, anchor="per-sentence loop",
                      params={"pairs": n_pairs, "model": "GPT-2 4x128 (and 4x64), seeded random weights"},
                      repeats=repeats, warmup=1,
                      goals=(Goal("batched scoring is not slower than one forward per sentence", impl="batched",
                                  max_ratio=1.0),)))
    return cases


CASES = _cases(2000, 50, 200, 5)
SMOKE_CASES = _cases(50, 5, 16, 1)
