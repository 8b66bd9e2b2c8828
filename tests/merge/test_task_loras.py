"""repro.kit.task_loras: deterministic training, cache round trip, one base-model identity for all tasks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankwise import zoo
from rankwise.merge import CtMConfig, ctm_merge
from rankwise.repro.ctm import SMOKE_RECIPE
from rankwise.repro.kit.task_loras import task_lora, task_lora_path


@pytest.fixture(scope="module")
def minilm():
    return zoo.minilm()


def test_deterministic_cached_and_mergeable(minilm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path))
    bert, tok = minilm
    a = task_lora("kind", 0, recipe=SMOKE_RECIPE, bert=bert, tokenizer=tok, cache=False)
    assert not task_lora_path("kind", 0, SMOKE_RECIPE).exists()  # cache=False writes nothing
    b = task_lora("kind", 0, recipe=SMOKE_RECIPE, bert=bert, tokenizer=tok)
    assert a.state.allclose(b.state) and torch.equal(a.head["weight"], b.head["weight"])  # same seed, same bits
    path = task_lora_path("kind", 0, SMOKE_RECIPE)
    assert (path / "adapter.safetensors").is_file() and (path / "info.json").is_file()
    c = task_lora("kind", 0, recipe=SMOKE_RECIPE)  # from the cache, without loading a model
    assert c.state.allclose(b.state) and c.metrics == b.metrics and c.labels == b.labels
    other = task_lora("topic", 0, recipe=SMOKE_RECIPE, bert=bert, tokenizer=tok, cache=False)
    assert other.state.fingerprint == b.state.fingerprint  # the task heads are not part of the base identity
    assert other.head["weight"].shape[0] == 8 and b.head["weight"].shape[0] == 3
    merged = ctm_merge([b.state, other.state], CtMConfig(rank=8))
    assert merged.modules() == b.state.modules() and set(merged.ranks().values()) == {8}
    different = task_lora("kind", 1, recipe=SMOKE_RECIPE, bert=bert, tokenizer=tok, cache=False)
    assert not different.state.allclose(b.state)


def test_encode_task_matches_prefix_and_is_shared_only_inside_the_block(minilm):
    from rankwise.repro.kit.cached_encoder import FrozenPrefix
    from rankwise.repro.kit.task_loras import encode_task, shared_encodings, task_data

    bert, tok = minilm
    prefix = FrozenPrefix(bert, tok, 5, 16)
    data = task_data("kind", 0, SMOKE_RECIPE).test
    ref_h, ref_m = prefix.encode([t for t, _ in data])  # unsorted, one chunk
    h, m, y = encode_task(prefix, data, chunk=8)  # length-sorted chunks, returned in data order
    assert torch.equal(m, ref_m) and y.tolist() == [c for _, c in data]
    real = m.bool()
    assert torch.allclose(h[real], ref_h[real], atol=1e-4)
    with shared_encodings():
        a = encode_task(prefix, data)
        b = encode_task(prefix, data)
        assert a[0] is b[0]  # the second call is served from the block's memo
        c = encode_task(prefix, data[:-1], keep=False)
        assert encode_task(prefix, data[:-1])[0] is not c[0]  # keep=False kept nothing
        with shared_encodings():  # re-entrant: the inner block sees the outer entries
            assert encode_task(prefix, data)[0] is a[0]
        assert encode_task(prefix, data)[0] is a[0]  # ... and leaving it does not drop them
    assert encode_task(prefix, data)[0] is not a[0]  # nothing is kept outside a block
