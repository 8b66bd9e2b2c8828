"""SAMBAL's probe sets: minimal pairs generated from the synthetic grammar (templates in
docs/methods/sambal.md).

* syntax (``agreement_rc``, ``agreement_pp``, ``transitivity``, ``tense``; a quarter each): both members
  use the same words but one, the ungrammatical member breaks one rule; every subject-verb pair is one
  of the grammar's held-out combinations (never seen in the natural corpus), and every sentence is
  selectionally plausible;
* ``knowledge``: plausible vs implausible, both grammatical, same words: half selectional pairs (``the
  wolves eat the plums`` vs ``the plums eat the wolves``), half world facts vs their reverse;
* ``conflict``: grammatical-but-implausible (``sentence_good``: ``the plums eat the wolf``) vs
  ungrammatical-but-plausible (``sentence_bad``: ``the wolf eat the plums``); same words.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from rankwise.core.validate import check_choice, check_int
from rankwise.science.sambal.evaluate import MinimalPair
from rankwise.science.sambal.world import NOUNS, NUMBERS, PREPS, VERBS

__all__ = ["PHENOMENA", "PROBE_SETS", "make_probes"]

PHENOMENA = ("agreement_rc", "agreement_pp", "transitivity", "tense")
PROBE_SETS = ("syntax", "knowledge", "conflict") + PHENOMENA
FIELD = {"knowledge": "knowledge", "conflict": "conflict", **{p: "syntax" for p in PHENOMENA}}
_OTHER = {"sg": "pl", "pl": "sg"}


class _Gen:
    def __init__(self, g: Any, rng: random.Random):
        self.g, self.rng = g, rng
        self.held = sorted(g.heldout_pairs)
        self.last_kind: str | None = None  # knowledge / conflict: "fact" or "selection"

    def np(self, lemma: str, n: str) -> list[str]:
        return ["the", self.g.noun_form(lemma, n)]

    def held_pair(self, frames: tuple[str, ...], classes: tuple[str, ...] = ("animate",)) -> tuple[str, str]:
        opts = [(s, v) for s, v in self.held if VERBS[v][2] in frames and self.g.noun_class(s) in classes]
        return self.rng.choice(opts)

    def obj(self, v: str, avoid: str) -> str:
        return self.rng.choice([o for o in self.g.nouns_of(VERBS[v][4]) if o != avoid])

    def vf(self, v: str, n: str, t: str = "pres") -> str:
        return self.g.verb_form(v, n, t)

    # -------------------------------------------------------------------------------- syntax
    def agreement_rc(self) -> tuple[list[str], list[str]]:
        h, v = self.held_pair(("intr",))
        n = self.rng.choice(NUMBERS)
        m = _OTHER[n]
        if self.rng.random() < 0.5:  # object relative: the H that the A see V
            v2 = self.rng.choice([x for x in self.g.verbs_of("tr") if "animate" in VERBS[x][4]])
            a = self.rng.choice([x for x in self.g.nouns_of(VERBS[v2][3]) if x != h])
            pre = self.np(h, n) + ["that"] + self.np(a, m) + [self.vf(v2, m)]
        else:  # subject relative: the H that see the A V
            v2 = self.rng.choice(self.g.verbs_of("tr"))
            a = self.obj(v2, h)
            pre = self.np(h, n) + ["that", self.vf(v2, n)] + self.np(a, m)
        return pre + [self.vf(v, n), "."], pre + [self.vf(v, m), "."]

    def agreement_pp(self) -> tuple[list[str], list[str]]:
        h, v = self.held_pair(("intr",))
        n = self.rng.choice(NUMBERS)
        a = self.rng.choice([x for x in NOUNS if x != h])
        pre = self.np(h, n) + [self.rng.choice(PREPS)] + self.np(a, _OTHER[n])
        return pre + [self.vf(v, n), "."], pre + [self.vf(v, _OTHER[n]), "."]

    def transitivity(self) -> tuple[list[str], list[str]]:
        n = self.rng.choice(NUMBERS)
        t = self.rng.choice(("pres", "past"))
        s, vt = self.held_pair(("tr",))
        vi = self.rng.choice([x for x in self.g.verbs_of("intr") if "animate" in VERBS[x][3]])
        subj = self.np(s, n)
        if self.rng.random() < 0.5:  # missing object: "the dog sleeps ." vs "the dog sees ."
            return subj + [self.vf(vi, n, t), "."], subj + [self.vf(vt, n, t), "."]
        o = self.np(self.obj(vt, s), self.rng.choice(NUMBERS))  # object after an intransitive verb
        return subj + [self.vf(vt, n, t)] + o + ["."], subj + [self.vf(vi, n, t)] + o + ["."]

    def tense(self) -> tuple[list[str], list[str]]:
        s, v = self.held_pair(("intr", "tr"))
        n = self.rng.choice(NUMBERS)
        rest = (self.np(self.obj(v, s), self.rng.choice(NUMBERS)) if VERBS[v][2] == "tr" else []) + ["."]
        past, pres = self.vf(v, n, "past"), self.vf(v, n, "pres")
        if self.rng.random() < 0.5:
            return ["yesterday"] + self.np(s, n) + [past] + rest, ["yesterday"] + self.np(s, n) + [pres] + rest
        return ["now"] + self.np(s, n) + [pres] + rest, ["now"] + self.np(s, n) + [past] + rest

    # -------------------------------------------------------------------------------- semantics
    def plausible_triple(self, fact: bool) -> tuple[str, str, str]:
        """A true triple whose reverse is implausible: a world fact (reverse never stated) or a
        selectional triple (reverse breaks a restriction)."""
        if fact:
            return self.rng.choice(self.g.facts)
        while True:
            v = self.rng.choice(self.g.verbs_of("tr"))
            s = self.rng.choice(self.g.nouns_of(VERBS[v][3]))
            o = self.obj(v, s)
            if self.g.noun_class(o) not in VERBS[v][3] or self.g.noun_class(s) not in VERBS[v][4]:
                return s, v, o

    def knowledge(self) -> tuple[list[str], list[str]]:
        fact = self.rng.random() < 0.5
        self.last_kind = "fact" if fact else "selection"
        s, v, o = self.plausible_triple(fact)
        n, t = self.rng.choice(NUMBERS), self.rng.choice(("pres", "past"))
        verb = self.vf(v, n, t)
        return self.np(s, n) + [verb] + self.np(o, n) + ["."], self.np(o, n) + [verb] + self.np(s, n) + ["."]

    def conflict(self) -> tuple[list[str], list[str]]:
        fact = self.rng.random() < 0.5
        self.last_kind = "fact" if fact else "selection"
        s, v, o = self.plausible_triple(fact)
        ns = self.rng.choice(NUMBERS)
        no = _OTHER[ns]
        verb = self.vf(v, no)  # agrees with the object's number
        good = self.np(o, no) + [verb] + self.np(s, ns) + ["."]  # grammatical, implausible
        bad = self.np(s, ns) + [verb] + self.np(o, no) + ["."]  # ungrammatical, plausible
        return good, bad


def make_probes(grammar: Any, kind: str, n: int = 1000, seed: int = 0) -> list[MinimalPair]:
    """``n`` distinct minimal pairs of probe set ``kind`` (one of :data:`PROBE_SETS`) from ``grammar`` (a
    :class:`~rankwise.science.sambal.SyntheticGrammar`); ``syntax`` splits
    ``n`` over the four phenomena. Deterministic in ``(grammar.seed, seed)``."""
    check_choice("make_probes kind", kind, PROBE_SETS)
    check_int("make_probes n", n, 1)
    kinds = PHENOMENA if kind == "syntax" else (kind,)
    out: list[MinimalPair] = []
    for j, k in enumerate(kinds):
        want = n // len(kinds) + (1 if j < n % len(kinds) else 0)
        rng = random.Random(f"sambal-probes-{grammar.seed}-{seed}-{k}")
        gen = _Gen(grammar, rng)
        make: Callable[[], tuple[list[str], list[str]]] = getattr(gen, k)
        seen: set[str] = set()
        tries = 0
        while len(seen) < want:
            tries += 1
            if tries > 50 * want:
                raise ValueError(f"make_probes: the grammar holds fewer than {want} distinct {k} pairs")
            good, bad = make()
            g, b = " ".join(good), " ".join(bad)
            if g in seen or g == b:
                continue
            seen.add(g)
            extra = {"kind": gen.last_kind} if gen.last_kind else None
            out.append(MinimalPair(g, b, uid=k, field=FIELD[k], pair_id=len(seen) - 1, extra=extra))
    return out
