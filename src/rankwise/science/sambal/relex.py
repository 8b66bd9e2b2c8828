"""Constrained relexicalisation (spec "Method", steps 1-6): the lexicon index and the relexicaliser,
plus the two unconstrained controls of the spec's baselines.

The key of a content token is ``(category, feature bundle)``; the verb's subcategorisation frame is one
of its features, so the key is the spec's ``(category, features, frame)``. A bucket maps each lemma
with a form under that key to the form. A replacement is drawn uniformly from the bucket minus the
original lemma (or, ``frequency_matched=True``, from the lemmas of the same log2-frequency band, the
nearest non-empty band when the own band holds only the original). The mapping is per lemma class
(the key without its inflectional features), fresh per sentence (``scope="sentence"``) or per document
(``scope="document"``), so every form of one lemma maps to the same new lemma within the scope and the
features are kept, hence agreement. ``a``/``an`` is regenerated after replacement; function words
(every tag outside ``CONTENT_TAGS``) are never replaced.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from rankwise.core.validate import check_bool, check_choice, check_int
from rankwise.science.sambal.grammar import CONTENT_TAGS, VOWELS, Sentence, SyntheticGrammar, Token, as_token

__all__ = ["INFLECTIONAL", "Lexicon", "RelexStats", "Relexicalizer", "random_replacement", "shuffle_words"]

#: features that inflect a lemma (the rest of the bundle is the lemma's class: frame, countability, ...)
INFLECTIONAL = frozenset({"number", "form", "degree", "tense", "person"})
Key = tuple[str, tuple[tuple[str, str], ...]]


def _key(tok: Token) -> Key:
    return (tok.tag, tok.features)


def _class_key(tok: Token) -> Key:
    return (tok.tag, tuple((k, v) for k, v in tok.features if k not in INFLECTIONAL))


@dataclass
class Lexicon:
    """``buckets[(category, features)] = {lemma: form}`` and ``freq[lemma]`` (counts or weights)."""

    buckets: dict[Key, dict[str, str]] = field(default_factory=dict)
    freq: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_entries(cls, entries: Iterable[Any], freq: Mapping[str, float] | None = None) -> "Lexicon":
        """From ``(word, tag, features[, lemma])`` entries (features may hold ``lemma``)."""
        lex = cls()
        for e in entries:
            tok = as_token(e)
            if tok.tag not in CONTENT_TAGS:
                continue
            bucket = lex.buckets.setdefault(_key(tok), {})
            old = bucket.get(tok.lemma)
            if old is not None and old != tok.word:
                raise ValueError(f"Lexicon: lemma {tok.lemma!r} has two forms {old!r} and {tok.word!r} "
                                 f"under key {_key(tok)}")
            bucket[tok.lemma] = tok.word
        if freq is not None:
            lex.freq = {str(k): float(v) for k, v in freq.items()}
        return lex

    @classmethod
    def from_grammar(cls, grammar: SyntheticGrammar) -> "Lexicon":
        """Every content form of the synthetic grammar; frequencies are the grammar's Zipf weights."""
        return cls.from_entries(grammar.lexical_entries(), grammar.weights)

    @classmethod
    def from_tagged(cls, tokens: Sequence[str], tags: Sequence[str], features: Sequence[Mapping[str, str]]) -> "Lexicon":
        """From an externally tagged corpus (e.g. spaCy/Stanza output mapped to these tags): parallel
        lists of words, tags and feature dicts (with ``lemma``; default the word). Frequencies are the
        lemma counts."""
        if not (len(tokens) == len(tags) == len(features)):
            raise ValueError(f"Lexicon.from_tagged: tokens, tags and features differ in length "
                             f"({len(tokens)}, {len(tags)}, {len(features)})")
        entries = [(w, t, dict(f)) for w, t, f in zip(tokens, tags, features)]
        counts = Counter(as_token(e).lemma for e in entries if e[1] in CONTENT_TAGS)
        return cls.from_entries(entries, counts)

    def count(self, sentences: Iterable[Sentence | Sequence[Any]]) -> "Lexicon":
        """Replace the frequencies by lemma counts of content tokens in ``sentences``; returns self."""
        c: Counter[str] = Counter()
        for s in sentences:
            for t in (s.tokens if isinstance(s, Sentence) else s):
                tok = as_token(t)
                if tok.tag in CONTENT_TAGS:
                    c[tok.lemma] += 1
        self.freq = dict(c)
        return self

    def band(self, lemma: str) -> int:
        """The log2-frequency band of ``lemma`` (``floor(log2(freq))``, weights scaled so the most
        frequent lemma has 2^20)."""
        top = max(self.freq.values(), default=1.0)
        f = self.freq.get(lemma, 0.0)
        return -1 if f <= 0 else int(math.floor(math.log2(f / top * 2**20)))

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets.values())


@dataclass
class RelexStats:
    """What :class:`Relexicalizer` did: replaced tokens, kept tokens (bucket of one), unknown keys kept
    (``on_unknown="keep"``), frequency-band fallbacks."""

    replaced: int = 0
    kept_singleton: int = 0
    unknown_kept: int = 0
    band_fallback: int = 0


class Relexicalizer:
    """Replace every content token by a random lemma with the same category and feature bundle.

    ``scope``: ``"sentence"`` (a fresh mapping per call) or ``"document"`` (one mapping per
    :meth:`document`, or until :meth:`reset`). ``on_unknown``: ``"error"`` (a token whose key is not in the
    lexicon raises ``KeyError`` naming the key) or ``"keep"`` (kept and counted). Deterministic in
    ``seed``. ``__call__`` takes a :class:`Sentence` (returns one, derivation kept) or a list of
    ``(word, tag, features)`` tokens (returns a list of :class:`Token`).
    """

    def __init__(self, lexicon: Lexicon, scope: str = "sentence", frequency_matched: bool = False, seed: int = 0,
                 on_unknown: str = "error"):
        if not isinstance(lexicon, Lexicon):
            raise TypeError(f"Relexicalizer.lexicon must be a Lexicon, got {type(lexicon).__name__}")
        self.lexicon = lexicon
        self.scope = check_choice("Relexicalizer.scope", scope, ("sentence", "document"))
        self.frequency_matched = check_bool("Relexicalizer.frequency_matched", frequency_matched)
        self.seed = check_int("Relexicalizer.seed", seed, 0)
        self.on_unknown = check_choice("Relexicalizer.on_unknown", on_unknown, ("error", "keep"))
        if frequency_matched and not lexicon.freq:
            raise ValueError("Relexicalizer.frequency_matched needs a lexicon with frequencies (Lexicon.count)")
        self.stats = RelexStats()
        self._rng = random.Random(f"sambal-relex-{seed}")
        self._map: dict[tuple[Key, str], str] = {}

    def reset(self) -> None:
        """Forget the current mapping (start a new document)."""
        self._map = {}

    def _draw(self, bucket: Mapping[str, str], lemma: str) -> str | None:
        others = sorted(x for x in bucket if x != lemma)
        if not others:
            return None
        if self.frequency_matched:
            own = self.lexicon.band(lemma)
            by_band: dict[int, list[str]] = {}
            for x in others:
                by_band.setdefault(self.lexicon.band(x), []).append(x)
            if own in by_band:
                others = by_band[own]
            else:
                self.stats.band_fallback += 1
                others = by_band[min(by_band, key=lambda b: (abs(b - own), b))]
        return others[self._rng.randrange(len(others))]

    def relex_tokens(self, tokens: Sequence[Any]) -> list[Token]:
        toks = [as_token(t) for t in tokens]
        if not toks:
            raise ValueError("Relexicalizer: empty sentence")
        if self.scope == "sentence":
            self.reset()
        out: list[Token] = []
        for tok in toks:
            if tok.tag not in CONTENT_TAGS:
                out.append(tok)
                continue
            bucket = self.lexicon.buckets.get(_key(tok))
            if not bucket:
                if self.on_unknown == "keep":
                    self.stats.unknown_kept += 1
                    out.append(tok)
                    continue
                raise KeyError(f"Relexicalizer: no lexicon bucket for key {_key(tok)} (token {tok.word!r}); "
                               "pass on_unknown='keep' to keep such tokens")
            mkey = (_class_key(tok), tok.lemma)
            new = self._map.get(mkey)
            if new is None or new not in bucket:
                new = self._draw(bucket, tok.lemma)
                if new is None:
                    self.stats.kept_singleton += 1
                    out.append(tok)
                    continue
                self._map[mkey] = new
            self.stats.replaced += 1
            out.append(Token(bucket[new], tok.tag, tok.features, new))
        return fix_articles(out)

    def __call__(self, sentence: Sentence | Sequence[Any]) -> Any:
        if isinstance(sentence, Sentence):
            return sentence.replace_tokens(self.relex_tokens(sentence.tokens))
        if isinstance(sentence, (str, bytes)) or not isinstance(sentence, Sequence):
            raise ValueError(f"Relexicalizer: pass a Sentence or a list of (word, tag, features) tokens, "
                             f"got {type(sentence).__name__}")
        return self.relex_tokens(sentence)

    def document(self, sentences: Sequence[Any]) -> list[Any]:
        """Relexicalise one document (one mapping for all of it when ``scope="document"``)."""
        self.reset()
        return [self(s) for s in sentences]

    def corpus(self, documents: Sequence[Sequence[Any]]) -> list[list[Any]]:
        return [self.document(d) for d in documents]


def fix_articles(tokens: list[Token]) -> list[Token]:
    """Regenerate ``a``/``an`` from the next word's first letter (spec step 5)."""
    out = list(tokens)
    for i, t in enumerate(out[:-1]):
        if t.word in ("a", "an"):
            w = "an" if out[i + 1].word[:1] in VOWELS else "a"
            out[i] = t._replace(word=w, lemma="a")
    return out


def random_replacement(sentence: Sentence, words: Sequence[str], rng: random.Random) -> list[str]:
    """Control: every content token replaced by a uniformly random content word of any category
    (destroys syntax)."""
    return [rng.choice(words) if t.tag in CONTENT_TAGS else t.word for t in sentence.tokens]


def shuffle_words(sentence: Sentence, rng: random.Random) -> list[str]:
    """Control: the sentence's words (final punctuation kept last) in random order (destroys syntax, keeps
    lexical co-occurrence)."""
    ws = sentence.words
    body, tail = (ws[:-1], ws[-1:]) if ws and ws[-1] == "." else (ws, [])
    body = list(body)
    rng.shuffle(body)
    return body + tail
