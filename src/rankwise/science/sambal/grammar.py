"""SAMBAL's synthetic English-like world: a lexicon with semantic classes, a feature-expanded PCFG
with selectional restrictions and world facts, and sentences that keep their derivation.

Every sentence is a :class:`Sentence`: its tokens (:class:`Token`: word, tag, features, lemma), its
derivation tree (nested tuples ``(label, child, ...)`` whose leaves are token indices) and its clauses
(token indices of subject, verb, object, recipient) for the selectional-restriction count. A tree's
labels are the nonterminals of the feature-expanded CFG (``NP.sg``, ``VP.pl.past``, ``VT.sg.pres``),
so :meth:`SyntheticGrammar.check` decides grammaticality from the kept derivation alone (every node a
rule of :meth:`SyntheticGrammar.rules`, every preterminal's word in the lexicon for that label, the
``a``/``an`` rule), and :meth:`SyntheticGrammar.parses` cross-checks with nltk's chart parser on
:meth:`SyntheticGrammar.cfg_text` (offline; nltk imported inside).

The rules, probabilities and lexicon sizes are written down in ``docs/methods/sambal.md``.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

from rankwise.core.validate import check_int, check_unit
from rankwise.science.sambal.world import ADJS, ADVT, ANY, DET_P, DETS, FRAMES, NOUNS, NUMBERS, PREPS, TENSES, VERBS

__all__ = ["CONTENT_TAGS", "FUNCTION_TAGS", "Sentence", "SyntheticGrammar", "Token", "as_token"]

CONTENT_TAGS = frozenset({"N", "PROPN", "V", "ADJ", "ADV"})
FUNCTION_TAGS = frozenset({"DET", "PRON", "AUX", "P", "TO", "IN", "COMP", "ADVT", "NUM", "PUNCT"})
VOWELS = frozenset("aeiou")


class Token(NamedTuple):
    """One token: ``features`` is a sorted tuple of ``(name, value)`` pairs; ``lemma`` its lemma."""

    word: str
    tag: str
    features: tuple[tuple[str, str], ...] = ()
    lemma: str = ""

    @property
    def feats(self) -> dict[str, str]:
        return dict(self.features)


def as_token(x: Any) -> Token:
    """A :class:`Token` from a Token, or a ``(word, tag, features)`` tuple whose features (a mapping
    or pairs) may hold ``lemma`` (default: the word). Raises ``ValueError``/``TypeError`` on bad input."""
    if isinstance(x, Token):
        return x
    if not isinstance(x, (tuple, list)) or len(x) not in (3, 4):
        raise TypeError(f"a token must be (word, tag, features), got {x!r}")
    word, tag, feats = x[0], x[1], x[2]
    if not isinstance(word, str) or not word or any(c.isspace() for c in word):
        raise ValueError(f"a token's word must be a non-empty str without spaces, got {word!r}")
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"a token's tag must be a non-empty str, got {tag!r}")
    f = dict(feats or {})
    lemma = x[3] if len(x) == 4 else f.pop("lemma", word)
    f.pop("lemma", None)
    return Token(word, tag, tuple(sorted((str(k), str(v)) for k, v in f.items())), str(lemma))


@dataclass(frozen=True)
class Sentence:
    """A sentence with its derivation. ``clauses``: ``(subject, verb, object, recipient)`` token indices
    (``-1`` where absent); ``meta``: what the generator knows (``fact``: the world fact it states)."""

    tokens: tuple[Token, ...]
    tree: tuple
    clauses: tuple[tuple[int, int, int, int], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def words(self) -> list[str]:
        return [t.word for t in self.tokens]

    @property
    def text(self) -> str:
        return " ".join(self.words)

    def replace_tokens(self, tokens: Sequence[Token]) -> "Sentence":
        if len(tokens) != len(self.tokens):
            raise ValueError(f"replace_tokens: {len(tokens)} tokens for a sentence of {len(self.tokens)}")
        return Sentence(tuple(tokens), self.tree, self.clauses, dict(self.meta))


@functools.lru_cache(maxsize=None)
def _nouns_of(classes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n, (_, c) in NOUNS.items() if c in classes)


@functools.lru_cache(maxsize=None)
def _verbs_of(frame: str) -> tuple[str, ...]:
    return tuple(v for v, r in VERBS.items() if r[2] == frame)


@functools.lru_cache(maxsize=None)
def _adjs_for(cls: str | None) -> tuple[str, ...]:
    return tuple(a for a, cs in ADJS.items() if cls in cs)


def _article(next_word: str) -> str:
    return "an" if next_word[:1] in VOWELS else "a"


class _Builder:
    """Accumulates tokens while a sampler builds a tree."""

    def __init__(self) -> None:
        self.tokens: list[Token] = []
        self.clauses: list[tuple[int, int, int, int]] = []
        self.facts: list[tuple[str, str, str]] = []

    def leaf(self, label: str, word: str, tag: str, lemma: str = "", **feats: str) -> tuple:
        self.tokens.append(Token(word, tag, tuple(sorted(feats.items())), lemma or word))
        return (label, len(self.tokens) - 1)


# --------------------------------------------------------------------------------------------------


@dataclass
class SyntheticGrammar:
    """The seeded synthetic world (spec "Reproduction at small scale"; rules in docs/methods/sambal.md).

    ``seed`` fixes the lemma frequency ranks (Zipf weights ``1 / rank^zipf``), the ``n_facts`` world facts
    (subject, transitive verb, object triples that respect the selectional restrictions; their reverses
    never occur in the natural corpus) and the held-out (subject noun, verb) combinations (a share
    ``heldout`` of each verb's allowed subjects, never a fact's), which the natural corpus never uses and
    the syntax probes always use.
    """

    seed: int = 0
    n_facts: int = 200
    p_fact: float = 0.5
    heldout: float = 0.15
    zipf: float = 0.8
    p_adj: float = 0.2
    p_rc: float = 0.15
    p_pp: float = 0.15
    p_adv: float = 0.2
    p_past: float = 0.4
    frame_p: tuple[float, ...] = (0.25, 0.4, 0.1, 0.1, 0.15)  # intr, tr, ditr, clausal, loc

    def __post_init__(self) -> None:
        check_int("SyntheticGrammar.seed", self.seed, 0)
        check_int("SyntheticGrammar.n_facts", self.n_facts, 1)
        for name in ("p_fact", "heldout", "p_adj", "p_rc", "p_pp", "p_adv", "p_past"):
            check_unit(f"SyntheticGrammar.{name}", getattr(self, name))
        if len(self.frame_p) != len(FRAMES) or abs(sum(self.frame_p) - 1) > 1e-9 or min(self.frame_p) < 0:
            raise ValueError(f"SyntheticGrammar.frame_p must be {len(FRAMES)} probabilities summing to 1, "
                             f"got {self.frame_p!r}")
        rng = random.Random(self.seed)
        self.weights: dict[str, float] = {}
        for table in (NOUNS, VERBS, ADJS):
            order = sorted(table)
            rng.shuffle(order)
            self.weights.update({w: 1.0 / (i + 1) ** self.zipf for i, w in enumerate(order)})
        tr = sorted(v for v, r in VERBS.items() if r[2] == "tr")
        facts: set[tuple[str, str, str]] = set()
        tries = 0
        while len(facts) < self.n_facts:
            tries += 1
            if tries > 100 * self.n_facts:
                raise ValueError(f"SyntheticGrammar.n_facts={self.n_facts} is more than the world holds")
            v = rng.choice(tr)
            s, o = rng.choice(self.nouns_of(VERBS[v][3])), rng.choice(self.nouns_of(VERBS[v][4]))
            if s != o and (o, v, s) not in facts:
                facts.add((s, v, o))
        self.facts: tuple[tuple[str, str, str], ...] = tuple(sorted(facts))
        fact_sv = {(s, v) for s, v, _ in self.facts}
        self.heldout_pairs: frozenset[tuple[str, str]] = frozenset(
            (n, v) for v in sorted(VERBS) for n in self.nouns_of(VERBS[v][3])
            if (n, v) not in fact_sv and rng.random() < self.heldout)
        self._reverse = {(o, v, s) for s, v, o in self.facts}
        self._rules, self._lexical = self._build_rules()
        self._cum: dict[tuple[str, ...], list[float]] = {}
        self._subj: dict[str, list[str]] = {}

    @classmethod
    def default(cls, seed: int = 0) -> "SyntheticGrammar":
        return cls(seed=seed)

    # ---------------------------------------------------------------------------------------- lexicon
    @staticmethod
    def nouns_of(classes: Iterable[str]) -> list[str]:
        return list(_nouns_of(tuple(classes)))

    @staticmethod
    def noun_class(lemma: str) -> str | None:
        r = NOUNS.get(lemma)
        return r[1] if r else None

    @staticmethod
    def noun_form(lemma: str, number: str) -> str:
        return lemma if number == "sg" else NOUNS[lemma][0]

    @staticmethod
    def verb_form(lemma: str, number: str, tense: str) -> str:
        r = VERBS[lemma]
        return r[1] if tense == "past" else (r[0] if number == "sg" else lemma)

    @staticmethod
    def verbs_of(frame: str) -> list[str]:
        return list(_verbs_of(frame))

    def lexical_entries(self) -> list[tuple[str, str, dict[str, str], str]]:
        """Every content word form: ``(word, tag, features, lemma)`` (what :class:`Lexicon` indexes)."""
        out = []
        for n, (pl, _) in NOUNS.items():
            for num, w in (("sg", n), ("pl", pl)):
                out.append((w, "N", {"number": num, "count": "count", "proper": "no"}, n))
        for v, (s3, past, frame, *_r) in VERBS.items():
            for form, w in (("pres", v), ("pres3sg", s3), ("past", past)):
                out.append((w, "V", {"form": form, "frame": frame}, v))
        for a in ADJS:
            out.append((a, "ADJ", {"degree": "pos"}, a))
        return out

    def vocabulary(self) -> list[str]:
        """Every word the grammar can produce (function words, punctuation and content forms), sorted."""
        words = {w for w, *_ in self.lexical_entries()} | {"an", "that", "to", "in", "."} | set(PREPS)
        words |= set(ADVT.values()) | {d for ds in DETS.values() for d in ds}
        return sorted(words)

    # ---------------------------------------------------------------------------------------- rules
    def _build_rules(self) -> tuple[set[tuple[str, tuple[str, ...]]], dict[str, set[str]]]:
        R: set[tuple[str, tuple[str, ...]]] = set()
        L: dict[str, set[str]] = {"PUNCT": {"."}, "COMP": {"that"}, "TO": {"to"}, "IN": {"in"},
                                  "P": set(PREPS), "ADJ": set(ADJS)}
        for t in TENSES:
            R |= {("ROOT", (f"CL.{t}", "PUNCT")), ("ROOT", (f"ADVT.{t}", f"CL.{t}", "PUNCT"))}
            L[f"ADVT.{t}"] = {ADVT[t]}
        for n in NUMBERS:
            L[f"DET.{n}"] = set(DETS[n]) | ({"an"} if n == "sg" else set())
            L[f"N.{n}"] = {self.noun_form(x, n) for x in NOUNS}
            R |= {(f"NP.{n}", (f"DET.{n}", f"NOM.{n}")), (f"NP.{n}", (f"DET.{n}", f"NOM.{n}", f"RC.{n}")),
                  (f"NP.{n}", (f"DET.{n}", f"NOM.{n}", "PP")), (f"NPS.{n}", (f"DET.{n}", f"NOM.{n}")),
                  (f"NOM.{n}", (f"N.{n}",)), (f"NOM.{n}", ("ADJ", f"N.{n}")), ("PP", ("P", f"NPS.{n}"))}
            for t in TENSES:
                for k, frame in (("VI", "intr"), ("VT", "tr"), ("VD", "ditr"), ("VC", "clausal"), ("VL", "loc")):
                    L[f"{k}.{n}.{t}"] = {self.verb_form(v, n, t) for v in self.verbs_of(frame)}
                R.add((f"CL.{t}", (f"NP.{n}", f"VP.{n}.{t}")))
                R.add((f"RC.{n}", ("COMP", f"VPS.{n}.{t}")))
                R.add((f"VP.{n}.{t}", (f"VI.{n}.{t}",)))
                R.add((f"VPS.{n}.{t}", (f"VI.{n}.{t}",)))
                for m in NUMBERS:
                    R.add((f"RC.{n}", ("COMP", f"NPS.{m}", f"VT.{m}.{t}")))
                    R.add((f"VP.{n}.{t}", (f"VT.{n}.{t}", f"NPS.{m}")))
                    R.add((f"VPS.{n}.{t}", (f"VT.{n}.{t}", f"NPS.{m}")))
                    R.add((f"VP.{n}.{t}", (f"VL.{n}.{t}", "IN", f"NPS.{m}")))
                    for k2 in NUMBERS:
                        R.add((f"VP.{n}.{t}", (f"VD.{n}.{t}", f"NPS.{m}", "TO", f"NPS.{k2}")))
                    for t2 in TENSES:
                        R.add((f"VP.{n}.{t}", (f"VC.{n}.{t}", "COMP", f"CL.{t2}")))
        return R, L

    def rules(self) -> set[tuple[str, tuple[str, ...]]]:
        """The phrase rules ``(lhs, rhs labels)`` of the feature-expanded CFG (start symbol ``ROOT``)."""
        return set(self._rules)

    def lexical(self) -> dict[str, set[str]]:
        """Preterminal label -> the words it rewrites to."""
        return {k: set(v) for k, v in self._lexical.items()}

    def cfg_text(self) -> str:
        """The feature-expanded CFG in nltk's notation (``nltk.CFG.fromstring``)."""
        lines = ["ROOT -> " + " | ".join(" ".join(r) for lhs, r in sorted(self._rules) if lhs == "ROOT")]
        for lhs in sorted({lhs for lhs, _ in self._rules} - {"ROOT"}):
            lines.append(f"{lhs} -> " + " | ".join(" ".join(r) for l2, r in sorted(self._rules) if l2 == lhs))
        for lhs, words in sorted(self._lexical.items()):
            lines.append(f"{lhs} -> " + " | ".join(f"'{w}'" for w in sorted(words)))
        return "\n".join(lines).replace(".", "_").replace("'_'", "'.'")

    def parses(self, words: Sequence[str] | str) -> bool:
        """Whether nltk's chart parser finds a parse of ``words`` under :meth:`cfg_text` (syntax only: the
        ``a``/``an`` rule is :meth:`check`'s). Needs nltk (offline)."""
        import nltk

        if not hasattr(self, "_parser"):
            self._parser = nltk.ChartParser(nltk.CFG.fromstring(self.cfg_text()))
        ws = words.split() if isinstance(words, str) else list(words)
        vocab = set(self.vocabulary())
        if not ws or any(w not in vocab for w in ws):
            return False
        for _ in self._parser.parse(ws):
            return True
        return False

    def check(self, sentence: Sentence) -> bool:
        """Grammaticality from the kept derivation: the tree's nodes are rules, its leaves are the
        tokens in order, each preterminal's word is in the lexicon for its label, and every ``a``/``an``
        matches the next word's first letter."""
        leaves: list[int] = []

        def walk(node: Any) -> bool:
            if not isinstance(node, tuple) or len(node) < 2:
                return False
            label, kids = node[0], node[1:]
            if len(kids) == 1 and isinstance(kids[0], int):
                i = kids[0]
                leaves.append(i)
                return 0 <= i < len(sentence.tokens) and sentence.tokens[i].word in self._lexical.get(label, ())
            if (label, tuple(k[0] if isinstance(k, tuple) else "?" for k in kids)) not in self._rules:
                return False
            return all(walk(k) for k in kids)

        if not sentence.tokens or sentence.tree[:1] != ("ROOT",) or not walk(sentence.tree):
            return False
        if leaves != list(range(len(sentence.tokens))):
            return False
        ws = sentence.words
        return all(ws[i + 1][:1] in VOWELS if w == "an" else ws[i + 1][:1] not in VOWELS
                   for i, w in enumerate(ws[:-1]) if w in ("a", "an"))

    def violates_selection(self, sentence: Sentence) -> bool:
        """Whether a clause breaks a selectional restriction (subject/object/recipient class of its verb)."""
        for s, v, o, r in sentence.clauses:
            verb = VERBS.get(sentence.tokens[v].lemma)
            if verb is None:
                return True
            for idx, allowed in ((s, verb[3]), (o, verb[4]), (r, verb[5])):
                if idx >= 0 and self.noun_class(sentence.tokens[idx].lemma) not in allowed:
                    return True
        return False

    def states_reverse_fact(self, sentence: Sentence) -> bool:
        """Whether a transitive clause states the reverse of a world fact."""
        tk = sentence.tokens
        return any(o >= 0 and (tk[s].lemma, tk[v].lemma, tk[o].lemma) in self._reverse
                   for s, v, o, _ in sentence.clauses)

    # ---------------------------------------------------------------------------------------- sampling
    def _pick(self, rng: random.Random, options: Sequence[str]) -> str:
        key = tuple(options)
        cw = self._cum.get(key)
        if cw is None:
            cw = self._cum[key] = list(itertools.accumulate(self.weights[o] for o in key))
        return rng.choices(key, cum_weights=cw)[0]

    def _subjects(self, verb: str) -> list[str]:
        """The allowed, not held-out subjects of ``verb``."""
        out = self._subj.get(verb)
        if out is None:
            out = self._subj[verb] = [n for n in _nouns_of(VERBS[verb][3]) if (n, verb) not in self.heldout_pairs]
        return out

    def _noun_phrase(self, b: _Builder, rng: random.Random, lemma: str, number: str, simple: bool,
                     tense: str) -> tuple:
        label = "NPS" if simple else "NP"
        det_i = len(b.tokens)
        det = rng.choices(DETS[number], weights=DET_P[number])[0]
        kids: list[tuple] = [b.leaf(f"DET.{number}", det, "DET", number=number)]
        cls = self.noun_class(lemma)
        if rng.random() < self.p_adj:
            adj = self._pick(rng, _adjs_for(cls))
            nom = ("NOM." + number, b.leaf("ADJ", adj, "ADJ", adj, degree="pos"))
        else:
            nom = ("NOM." + number,)
        head = b.leaf(f"N.{number}", self.noun_form(lemma, number), "N", lemma, number=number, count="count",
                      proper="no")
        nom = nom + (head,)
        kids.append(nom)
        if det == "a":  # the a/an rule looks at the next word
            b.tokens[det_i] = b.tokens[det_i]._replace(word=_article(b.tokens[det_i + 1].word))
        if not simple:
            u = rng.random()
            if u < self.p_rc:
                kids.append(self._relative(b, rng, lemma, number, tense))
            elif u < self.p_rc + self.p_pp:
                p = b.leaf("P", rng.choice(PREPS), "P")
                kids.append(("PP", p, self._noun_phrase(b, rng, self._pick(rng, list(NOUNS)), rng.choice(NUMBERS),
                                                        True, tense)))
        return (f"{label}.{number}", *kids)

    def _ok_subject(self, noun: str, verb: str) -> bool:
        return (noun, verb) not in self.heldout_pairs

    def _relative(self, b: _Builder, rng: random.Random, head: str, number: str, tense: str) -> tuple:
        head_i = len(b.tokens) - 1
        comp = b.leaf("COMP", "that", "COMP")
        t2 = "past" if rng.random() < self.p_past else "pres"
        cls = self.noun_class(head)
        if rng.random() < 0.5:  # subject relative: "the dog that sees the cats"
            frames = [f for f in ("intr", "tr") if any(cls in VERBS[v][3] for v in self.verbs_of(f))]
            frame = rng.choice(frames)
            verbs = [v for v in self.verbs_of(frame) if cls in VERBS[v][3] and self._ok_subject(head, v)]
            if not verbs:
                verbs = [v for v in self.verbs_of(frame) if cls in VERBS[v][3]]
            v = self._pick(rng, verbs)
            vi = len(b.tokens)
            k = "VI" if frame == "intr" else "VT"
            vleaf = b.leaf(f"{k}.{number}.{t2}", self.verb_form(v, number, t2), "V", v, frame=frame,
                           form=self._form(number, t2))
            if frame == "intr":
                b.clauses.append((head_i, vi, -1, -1))
                return (f"RC.{number}", comp, (f"VPS.{number}.{t2}", vleaf))
            o = self._object(rng, head, v)
            m = rng.choice(NUMBERS)
            np = self._noun_phrase(b, rng, o, m, True, t2)
            b.clauses.append((head_i, vi, len(b.tokens) - 1, -1))
            return (f"RC.{number}", comp, (f"VPS.{number}.{t2}", vleaf, np))
        # object relative: "the dog that the cats see"
        verbs = [v for v in self.verbs_of("tr") if cls in VERBS[v][4]]
        if not verbs:
            return self._relative_subject_only(b, rng, head_i, comp, head, number, t2)
        v = self._pick(rng, verbs)
        s = self._pick(rng, [n for n in self.nouns_of(VERBS[v][3]) if self._ok_subject(n, v)
                             and (n, v, head) not in self._reverse])
        m = rng.choice(NUMBERS)
        np = self._noun_phrase(b, rng, s, m, True, t2)
        vi = len(b.tokens)
        vleaf = b.leaf(f"VT.{m}.{t2}", self.verb_form(v, m, t2), "V", v, frame="tr", form=self._form(m, t2))
        b.clauses.append((vi - 1, vi, head_i, -1))
        return (f"RC.{number}", comp, np, vleaf)

    def _relative_subject_only(self, b: _Builder, rng: random.Random, head_i: int, comp: tuple, head: str,
                               number: str, t2: str) -> tuple:
        cls = self.noun_class(head)
        v = self._pick(rng, [v for v in self.verbs_of("intr") if cls in VERBS[v][3]])
        vi = len(b.tokens)
        vleaf = b.leaf(f"VI.{number}.{t2}", self.verb_form(v, number, t2), "V", v, frame="intr",
                       form=self._form(number, t2))
        b.clauses.append((head_i, vi, -1, -1))
        return (f"RC.{number}", comp, (f"VPS.{number}.{t2}", vleaf))

    @staticmethod
    def _form(number: str, tense: str) -> str:
        return "past" if tense == "past" else ("pres3sg" if number == "sg" else "pres")

    def _object(self, rng: random.Random, subj: str, verb: str) -> str:
        opts = [n for n in self.nouns_of(VERBS[verb][4]) if n != subj and (subj, verb, n) not in self._reverse]
        return self._pick(rng, opts)

    def _clause(self, b: _Builder, rng: random.Random, tense: str, depth: int) -> tuple:
        fp = list(self.frame_p)
        if depth > 0:
            fp[FRAMES.index("clausal")] = 0.0
        frame = rng.choices(FRAMES, weights=fp)[0]
        fact = None
        if frame == "tr" and rng.random() < self.p_fact:
            fact = rng.choice(self.facts)
            s, v = fact[0], fact[1]
        else:
            v = self._pick(rng, self.verbs_of(frame))
            s = self._pick(rng, self._subjects(v))
        n = rng.choice(NUMBERS)
        subj = self._noun_phrase(b, rng, s, n, False, tense)
        s_i = self._head_index(subj)
        vi = len(b.tokens)
        k = {"intr": "VI", "tr": "VT", "ditr": "VD", "clausal": "VC", "loc": "VL"}[frame]
        vleaf = b.leaf(f"{k}.{n}.{tense}", self.verb_form(v, n, tense), "V", v, frame=frame, form=self._form(n, tense))
        vp: tuple = (f"VP.{n}.{tense}", vleaf)
        clause = [s_i, vi, -1, -1]
        if frame in ("tr", "ditr", "loc"):
            if frame == "loc":
                vp += (b.leaf("IN", "in", "IN"),)
            o = fact[2] if fact else self._object(rng, s, v)
            o_np = self._noun_phrase(b, rng, o, rng.choice(NUMBERS), True, tense)
            clause[2] = len(b.tokens) - 1
            vp += (o_np,)
            if frame == "ditr":
                vp += (b.leaf("TO", "to", "TO"),)
                r = self._pick(rng, [x for x in self.nouns_of(VERBS[v][5]) if x != s])
                vp += (self._noun_phrase(b, rng, r, rng.choice(NUMBERS), True, tense),)
                clause[3] = len(b.tokens) - 1
        elif frame == "clausal":
            vp += (b.leaf("COMP", "that", "COMP"),)
            t2 = "past" if rng.random() < self.p_past else "pres"
            vp += (self._clause(b, rng, t2, depth + 1),)
        b.clauses.append(tuple(clause))  # type: ignore[arg-type]
        if fact is not None:
            b.facts.append(fact)
        return (f"CL.{tense}", subj, vp)

    @staticmethod
    def _head_index(np: tuple) -> int:
        """Token index of an NP's head noun (its NOM's last leaf)."""
        nom = np[2]
        return nom[-1][1]

    def sample_one(self, rng: random.Random) -> Sentence:
        b = _Builder()
        tense = "past" if rng.random() < self.p_past else "pres"
        kids: list[tuple] = []
        if rng.random() < self.p_adv:
            kids.append(b.leaf(f"ADVT.{tense}", ADVT[tense], "ADVT", tense=tense))
        kids.append(self._clause(b, rng, tense, 0))
        kids.append(b.leaf("PUNCT", ".", "PUNCT"))
        return Sentence(tuple(b.tokens), ("ROOT", *kids), tuple(b.clauses),
                        {"facts": tuple(b.facts)})

    def sample(self, n: int, seed: int = 0) -> list[Sentence]:
        """``n`` natural sentences (selectional restrictions kept, facts at rate ``p_fact`` of transitive
        clauses, held-out subject-verb combinations never used), deterministic in ``seed``."""
        check_int("SyntheticGrammar.sample n", n, 0)
        rng = random.Random(f"sambal-corpus-{self.seed}-{seed}")
        return [self.sample_one(rng) for _ in range(n)]

    def sample_documents(self, n_docs: int, sentences_per_doc: int, seed: int = 0) -> list[list[Sentence]]:
        """``n_docs`` documents of ``sentences_per_doc`` sentences (for ``scope="document"``)."""
        check_int("SyntheticGrammar.sample_documents sentences_per_doc", sentences_per_doc, 1)
        flat = self.sample(n_docs * sentences_per_doc, seed)
        return [flat[i:i + sentences_per_doc] for i in range(0, len(flat), sentences_per_doc)]

    def iter_tokens(self, sentences: Iterable[Sentence]) -> Iterator[str]:
        for s in sentences:
            yield from s.words

    def probes(self, kind: str, n: int = 1000, seed: int = 0) -> list[Any]:
        """Minimal pairs of one probe set: ``syntax``, ``knowledge``, ``conflict`` or one syntax phenomenon
        (``agreement_rc``, ``agreement_pp``, ``transitivity``, ``tense``); see :mod:`.probes`."""
        from rankwise.science.sambal.probes import make_probes

        return make_probes(self, kind, n, seed)
