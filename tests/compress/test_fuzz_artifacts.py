"""Fuzzing saved artefacts: a compressed-model directory (config.json, metadata, weights, tokenizer files)
and a LoRA adapter directory, damaged at random (byte flips, truncations, deletions, appended bytes,
JSON edits). Each load either gives exactly the saved model's outputs or raises a rankwise error:
never another exception type, never a silently different model (issue "Nothing silently wrong").

One damage per example (a format-1 downgrade of the metadata combined with a config edit is the one
documented gap: such directories load with a warning). Derandomised, so the suite is stable.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwise.compress.model_dir import load_model_dir
from rankwise.compress.serialization import save_compressed
from rankwise.core.errors import RankwiseError
from tests.compress import model_dirs as md

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.floats(-1e3, 1e3, allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=4)


PLAUSIBLE_STRINGS = ["relu", "gelu", "silu", "tanh", "float16", "bfloat16", "float32", "absolute", "relative_key",
                     "bert", "BertForMaskedLM", "BertModel", "svd", "lora", "[UNK]", "the"]


def _plausible(old: Any) -> st.SearchStrategy:
    """A value of the same kind as ``old``, near it: the edits most likely to load and change the model."""
    if isinstance(old, bool):
        return st.just(not old)
    if isinstance(old, int):
        return st.sampled_from([old - 1, old + 1, old * 2, old // 2, 0, 1])
    if isinstance(old, float):
        return st.sampled_from([old * 0.5, old * 2, old * 10 + 1e-6, -old, 0.0, old + 1e-3])
    if isinstance(old, str):
        flipped = old[:-1] + chr((ord(old[-1]) + 1) % 0x7F or 0x41) if old else "x"
        return st.sampled_from(PLAUSIBLE_STRINGS + [flipped, old.upper(), ""])
    return JSON_VALUES


def _paths(obj: Any, prefix: tuple = (), depth: int = 4) -> list[tuple]:
    out = [prefix] if prefix else []
    if depth and isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,), depth - 1)
    elif depth and isinstance(obj, list):
        for i, v in enumerate(obj[:4]):
            out += _paths(v, prefix + (i,), depth - 1)
    return out


def _damage(folder: Path, data: st.DataObject) -> str:
    """Apply one random damage to one file of ``folder``; returns what was done (for the failure report)."""
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    name = data.draw(st.sampled_from(files), label="file")
    path = folder / name
    raw = path.read_bytes()
    kinds = ["flip", "truncate", "delete", "append"] + (["json"] * 3 if name.endswith(".json") else [])
    kind = data.draw(st.sampled_from(kinds), label="kind")
    if kind == "flip":
        i = data.draw(st.integers(0, len(raw) - 1), label="at")
        x = data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(raw[:i] + bytes([raw[i] ^ x]) + raw[i + 1:])
        return f"{name}: byte {i} ^= {x}"
    if kind == "truncate":
        n = data.draw(st.integers(0, len(raw) - 1), label="to")
        path.write_bytes(raw[:n])
        return f"{name}: truncated to {n} of {len(raw)} bytes"
    if kind == "delete":
        path.unlink()
        return f"{name}: deleted"
    if kind == "append":
        extra = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
        path.write_bytes(raw + extra)
        return f"{name}: appended {extra!r}"
    obj = json.loads(raw)
    paths = _paths(obj)
    top = [q for q in paths if len(q) == 1]  # half of the edits on top-level fields (the config's own)
    where = data.draw(st.sampled_from(top) | st.sampled_from(paths), label="path") if top else ()
    parent = obj
    for k in where[:-1]:
        parent = parent[k]
    if where and isinstance(parent, dict) and data.draw(st.booleans(), label="remove"):
        del parent[where[-1]]
        what = "removed"
    else:
        current = parent[where[-1]] if where else obj
        value = data.draw(st.one_of(_plausible(current), _plausible(current), JSON_VALUES), label="value")
        if where:
            parent[where[-1]] = value
        else:
            obj = value
        what = f"= {value!r}"
    path.write_text(json.dumps(obj))
    return f"{name}: {'/'.join(map(str, where))} {what}"


# every word of the vocabulary, so that an edited vocabulary shows in the outputs
TEXTS = md.TEXTS + [" ".join(md.WORDS[i:i + 8]) for i in range(0, len(md.WORDS), 8)]


class Saved:
    """A saved directory and what it computes (short repr: hypothesis prints the test's arguments)."""

    def __init__(self, path: Path, reference: torch.Tensor, **extra: Any):
        self.path, self.reference = path, reference
        self.__dict__.update(extra)

    def __repr__(self) -> str:
        return f"Saved({self.path.name})"


def _check(load, reference: torch.Tensor, done: str) -> None:
    try:
        got = load()
    except RankwiseError:
        return
    except Exception as e:  # pragma: no cover - the failure this test exists to catch
        pytest.fail(f"{done}: raised {type(e).__name__} (not a rankwise error): {e}")
    assert torch.equal(got, reference), f"{done}: loaded without error but computes something else"


# ----------------------------------------------------------------------------------------------
# a compressed-model directory


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory):
    model, rep, tok = md.compressed(method="svd")
    d = save_compressed(model, tmp_path_factory.mktemp("fuzz") / "c", rep, tokenizer=tok)
    back, back_tok = load_model_dir(d)
    ref = md.outputs(back, back_tok, TEXTS)
    assert torch.equal(ref, md.outputs(model, tok, TEXTS))
    return Saved(d, ref)


@FUZZ
@given(data=st.data())
def test_a_damaged_compressed_model_directory_loads_identically_or_raises(compressed_dir, data):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "c"
        shutil.copytree(compressed_dir.path, d)
        done = _damage(d, data)

        def load() -> torch.Tensor:
            model, tok = load_model_dir(d)
            return md.outputs(model, tok, TEXTS)

        _check(load, compressed_dir.reference, done)


# ----------------------------------------------------------------------------------------------
# a LoRA adapter directory


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    from rankwise.adapt.lora import LoraConfig, adapt, save_adapter

    base = md.bert()
    model = adapt(copy.deepcopy(base), LoraConfig(rank=2, alpha=4, target=("query", "value")))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora" in n:  # B = 0 at init: give the adapter an effect the outputs can show
                p.copy_(torch.randn(p.shape, generator=g))
    d = save_adapter(model, tmp_path_factory.mktemp("fuzz") / "adapter")
    tok = md.tokenizer(tmp_path_factory.mktemp("tok"))
    ref = md.outputs(model, tok, TEXTS)
    assert not torch.equal(ref, md.outputs(base, tok, TEXTS))
    return Saved(d, ref, base=base, tok=tok)


@FUZZ
@given(data=st.data())
def test_a_damaged_adapter_directory_loads_identically_or_raises(adapter_dir, data):
    from rankwise.adapt.lora import load_adapter

    saved = adapter_dir
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "adapter"
        shutil.copytree(saved.path, d)
        done = _damage(d, data)

        def load() -> torch.Tensor:
            return md.outputs(load_adapter(copy.deepcopy(saved.base), d), saved.tok, TEXTS)

        _check(load, saved.reference, done)
