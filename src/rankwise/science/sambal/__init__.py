"""SAMBAL: grammatical nonsense by constrained relexicalisation; tiny LMs that learn syntax without
semantics.

Paper: "Learning syntax without semantics: Disentangled tiny language models" (ICML 2026 poster 61539;
only the abstract was recoverable). Spec: ``shared/methods/sambal.md``; the grammar, lexicon, probe
templates and model sizes are this library's design, written down in ``docs/methods/sambal.md``.

* :class:`SyntheticGrammar` -- a seeded English-like world (lexicon with semantic classes, a
  feature-expanded PCFG, selectional restrictions, 200 world facts); sentences keep their derivation, so
  :meth:`~SyntheticGrammar.check` decides grammaticality without a parser (:meth:`~SyntheticGrammar.parses`
  cross-checks with nltk's chart parser, offline);
* :class:`Lexicon` (``from_grammar``, ``from_tagged`` for externally tagged corpora) and
  :class:`Relexicalizer` (``scope="sentence" | "document"``, ``frequency_matched``, ``on_unknown``): the
  relexicalisation that keeps category, features and frame and breaks meaning;
* :func:`make_probes` / :meth:`SyntheticGrammar.probes` -- syntax, knowledge and conflict minimal pairs;
* :func:`minimal_pair_accuracy` -- summed log-probability comparison of a causal LM on BLiMP-format
  jsonl (in and out), ties counting half.

Example::

    grammar = SyntheticGrammar.default(seed=0)
    relex = Relexicalizer(Lexicon.from_grammar(grammar), scope="sentence", seed=0)
    nonsense = [relex(s) for s in grammar.sample(10_000)]      # Sentence objects, derivations kept
    assert all(grammar.check(s) for s in nonsense)
    acc = minimal_pair_accuracy(model, tokenizer, grammar.probes("agreement_rc")).accuracy
"""

from __future__ import annotations

from rankwise.core.registry import register
from rankwise.science.sambal.evaluate import (
    MinimalPair,
    MinimalPairResult,
    minimal_pair_accuracy,
    read_pairs,
    sentence_logprobs,
    write_pairs,
)
from rankwise.science.sambal.grammar import CONTENT_TAGS, FUNCTION_TAGS, Sentence, SyntheticGrammar, Token, as_token
from rankwise.science.sambal.probes import PHENOMENA, PROBE_SETS, make_probes
from rankwise.science.sambal.relex import (
    Lexicon,
    RelexStats,
    Relexicalizer,
    fix_articles,
    random_replacement,
    shuffle_words,
)

__all__ = [
    "CONTENT_TAGS",
    "FUNCTION_TAGS",
    "PHENOMENA",
    "PROBE_SETS",
    "Lexicon",
    "MinimalPair",
    "MinimalPairResult",
    "RelexStats",
    "Relexicalizer",
    "Sentence",
    "SyntheticGrammar",
    "Token",
    "as_token",
    "fix_articles",
    "make_probes",
    "minimal_pair_accuracy",
    "random_replacement",
    "read_pairs",
    "sentence_logprobs",
    "shuffle_words",
    "write_pairs",
]

register("sambal", config=SyntheticGrammar, entry=Relexicalizer)
