"""Text tasks from the corpus and image tasks from scikit-learn digits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rankwise.core.errors import RankwiseError
from rankwise.zoo import UnknownTaskError, digits_task, digits_tasks, text_task, text_tasks
from rankwise.zoo.tasks import MAX_CHARS, snippet


@pytest.fixture(scope="module")
def all_tasks() -> dict:
    return {name: text_task(name) for name in text_tasks()}


def test_at_least_eight_distinct_tasks(all_tasks: dict) -> None:
    assert len(all_tasks) >= 8
    label_sets = {tuple(t.labels) + (t.name,) for t in all_tasks.values()}
    assert len(label_sets) == len(all_tasks)
    assert len({t.description for t in all_tasks.values()}) == len(all_tasks)


@pytest.mark.parametrize("name", text_tasks())
def test_text_task_balanced_disjoint(name: str, all_tasks: dict) -> None:
    t = all_tasks[name]
    k = len(t.labels)
    assert k >= 2 and t.num_labels == k and len(set(t.labels)) == k
    for part in (t.train, t.test):
        counts = Counter(y for _, y in part)
        assert set(counts) == set(range(k))
        assert len(set(counts.values())) == 1, f"{name}: unbalanced {counts}"
        assert all(isinstance(x, str) and 0 < len(x) <= MAX_CHARS for x, _ in part)
    train_texts = [x for x, _ in t.train]
    test_texts = [x for x, _ in t.test]
    assert len(set(train_texts)) == len(train_texts)
    assert not set(train_texts) & set(test_texts)
    assert len(t.train) >= 150 and len(t.test) >= 40
    assert len(t.train) > len(t.test)


def test_text_task_deterministic_and_seeded() -> None:
    a = text_task("kind", seed=3)
    b = text_task("kind", seed=3)
    c = text_task("kind", seed=4)
    assert a == b
    assert a.test == c.test, "the test split does not depend on the seed"
    assert a.train != c.train
    assert Counter(y for _, y in a.train) == Counter(y for _, y in c.train)


def test_max_train_and_max_test_keep_balance() -> None:
    t = text_task("topic", seed=0, max_train=80, max_test=40)
    assert len(t.train) == 80 and len(t.test) == 40
    assert set(Counter(y for _, y in t.train).values()) == {10}
    with pytest.raises(ValueError, match="max_train"):
        text_task("topic", max_train=3)
    with pytest.raises(TypeError, match="max_test"):
        text_task("topic", max_test=2.5)  # type: ignore[arg-type]


def test_unknown_task_name_suggests_closest() -> None:
    with pytest.raises(UnknownTaskError, match="did you mean 'topic'"):
        text_task("topik")
    with pytest.raises(ValueError, match="known:"):
        text_task("no-such-task-at-all")
    with pytest.raises(RankwiseError, match="did you mean 'odd_even'"):
        digits_task("odd_evn")
    with pytest.raises(TypeError):
        text_task(3)  # type: ignore[arg-type]


def test_snippet_cuts_at_word_boundary() -> None:
    text = "word " * 100
    s = snippet(text, 23)
    assert s == "word word word word" and len(s) <= 23
    assert snippet("  a\n\n b\tc ") == "a b c"


@pytest.mark.parametrize("name", digits_tasks())
def test_digits_task_shapes_balance(name: str) -> None:
    t = digits_task(name)
    k = t.num_labels
    assert k >= 2
    for x, y in ((t.x_train, t.y_train), (t.x_test, t.y_test)):
        assert x.dtype == torch.float32 and x.ndim == 4 and x.shape[1:] == (1, 8, 8)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
        assert y.dtype == torch.int64 and len(y) == len(x)
        counts = torch.bincount(y, minlength=k)
        assert int(counts.min()) == int(counts.max()) > 0
    assert len(t.x_train) > 3 * len(t.x_test)
    # no image appears in both splits (digits has no exact duplicates across the balanced draw)
    tr = {tuple(v.flatten().tolist()) for v in t.x_train}
    assert not any(tuple(v.flatten().tolist()) in tr for v in t.x_test)


def test_digits_task_deterministic_seeded_and_resized() -> None:
    a = digits_task("odd_even", seed=1)
    b = digits_task("odd_even", seed=1)
    c = digits_task("odd_even", seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    big = digits_task("digits10", image_size=16)
    assert big.x_train.shape[1:] == (1, 16, 16) and big.image_size == 16
    assert float(big.x_train.max()) <= 1.0
    inv = digits_task("inverted")
    plain = digits_task("digits10")
    assert torch.allclose(inv.x_train, 1.0 - plain.x_train)
    with pytest.raises(ValueError, match="image_size"):
        digits_task("digits10", image_size=4)
    with pytest.raises(ValueError, match="test_fraction"):
        digits_task("digits10", test_fraction=1.5)
