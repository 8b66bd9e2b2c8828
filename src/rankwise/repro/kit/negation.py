"""The seeded "negated sentiment x topic" task of the MiniLM reproductions (cdka, psoft, e2lora, daf).

Sentences ``"<subject> was [not] <adjective> <filler>"``; label ``2 * topic + sentiment`` with topic 0 =
film, 1 = food and sentiment = polarity(adjective) XOR negation (1 = positive). The word lists are
parameters (issue 14, part 3): a reproduction exposes them as settings, so the task can be pointed at
other vocabularies (more subjects, other adjectives, fillers that carry no signal) without copying code.
The defaults give 2 x 12 subjects x 20 adjectives x 2 x 10 fillers = 9 600 distinct sentences.
"""

from __future__ import annotations

import random
from typing import Sequence

FILMS = ("the film", "the movie", "the documentary", "the sequel", "the thriller", "the comedy", "the drama",
         "the cartoon", "the musical", "the western", "the premiere", "the screenplay")
FOODS = ("the soup", "the pizza", "the salad", "the curry", "the dessert", "the bread", "the pasta", "the stew",
         "the sandwich", "the omelette", "the noodles", "the pie")
POSITIVE = ("good", "great", "excellent", "wonderful", "delightful", "superb", "pleasant", "brilliant",
            "lovely", "fantastic")
NEGATIVE = ("bad", "awful", "terrible", "dreadful", "boring", "poor", "horrible", "disappointing", "bland",
            "mediocre")
FILLERS = ("today", "last night", "at the festival", "this weekend", "for everyone", "in my opinion",
           "as expected", "again", "honestly", "on sunday")
LABELS = ("film-negative", "film-positive", "food-negative", "food-positive")


def negation_task(seed: int = 0, n_train: int = 2000, n_test: int = 1000, *, films: Sequence[str] = FILMS,
                  foods: Sequence[str] = FOODS, positive: Sequence[str] = POSITIVE,
                  negative: Sequence[str] = NEGATIVE, fillers: Sequence[str] = FILLERS
                  ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Seeded "negated sentiment x topic" sentences ``"<subject> was [not] <adjective> <filler>"``.

    Label ``2 * topic + sentiment`` (:data:`LABELS`). Train and test are disjoint sets of distinct
    sentences, drawn without replacement from all combinations of the word lists by
    ``random.Random(seed)``; classes are balanced. Each word list must be non-empty; a fillers entry may be
    the empty string (no filler).
    """
    if n_train < 4 or n_test < 4 or n_train % 4 or n_test % 4:
        raise ValueError(f"n_train and n_test must be positive multiples of 4, got {n_train}, {n_test}")
    for name, words in (("films", films), ("foods", foods), ("positive", positive), ("negative", negative),
                        ("fillers", fillers)):
        if isinstance(words, str) or not words or not all(isinstance(w, str) for w in words):
            raise ValueError(f"negation_task: {name} must be a non-empty sequence of strings, got {words!r}")
    rng = random.Random(seed)
    by_label: list[list[str]] = [[] for _ in LABELS]
    for topic, subjects in enumerate((films, foods)):
        for subj in subjects:
            for pol, adjs in ((1, positive), (0, negative)):
                for adj in adjs:
                    for neg in (False, True):
                        for fill in fillers:
                            text = f"{subj} was {'not ' if neg else ''}{adj} {fill}".rstrip()
                            by_label[2 * topic + (pol ^ int(neg))].append(text)
    by_label = [list(dict.fromkeys(v)) for v in by_label]  # repeated words would repeat sentences
    per_tr, per_te = n_train // 4, n_test // 4
    if per_tr + per_te > min(len(v) for v in by_label):
        raise ValueError(f"at most {min(len(v) for v in by_label) * 4} sentences exist; asked {n_train + n_test}")
    train, test = [], []
    for label, texts in enumerate(by_label):
        pick = rng.sample(texts, per_tr + per_te)
        train += [(t, label) for t in pick[:per_tr]]
        test += [(t, label) for t in pick[per_tr:]]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test
