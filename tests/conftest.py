"""Shared test set-up: offline, headless, modest on threads, no writes into the user's caches.

Environment (set before any test module imports torch, transformers or matplotlib):

* ``MPLBACKEND=Agg``: figures render without a display;
* ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``: nothing is fetched;
* ``torch.set_num_threads(1)``: the suite runs with ``pytest -n 2`` on 2 cores.

The reproduction cache is *not* redirected globally, because the zoo may keep expensive built
artefacts under the same cache directory; tests that run reproductions use the ``repro_cache``
fixture (a fresh ``RANKWISE_CACHE_DIR`` per test) or ``use_cache=False``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

os.environ["MPLBACKEND"] = "Agg"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # torch is a core dependency, but keep conftest importable without it
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture
def repro_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty reproduction cache for one test (``RANKWISE_CACHE_DIR``)."""
    root = tmp_path_factory.mktemp("rankwise-cache")
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(root))
    return root


# --------------------------------------------------------------------------------------------------
# A fake reproduction module, for the harness, report and CLI tests. It is written to a file so that
# its source can change during a test (the cache key hashes it). BEHAVIOUR selects a failure mode;
# CALLS records every run.

FAKE_SOURCE = '''
import struct
import zlib
from rankwise.repro.result import ClaimCheck, ReproResult, Table

CALLS = []
BEHAVIOUR = "ok"
ID = "lora"


def _png():
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = zlib.compress(b"\\x00\\xff\\x00\\x00")
    return (b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


def run(mode, seeds, out_dir):
    CALLS.append((mode, list(seeds), str(out_dir)))
    if BEHAVIOUR == "raise":
        raise RuntimeError("boom <script>alert(1)</script>")
    if BEHAVIOUR == "not_result":
        return 42
    t = Table(columns=["loss", "acc"], notes={"loss": "lower is better"})
    for s in seeds:
        t.add("method", "loss", 1.0 + 0.1 * s)
        t.add("method", "acc", 0.9)
        t.add("baseline", "loss", 1.5 + 0.1 * s)
        t.add("baseline", "acc", 0.8 - 0.01 * s)
    checks = [ClaimCheck("method has lower loss than baseline",
                         t.mean("baseline", "loss") - t.mean("method", "loss"), ">", 0.0, unit="nats")]
    (out_dir / "curve.png").write_bytes(_png())
    figures = ["curve.png"] + (["missing.png"] if BEHAVIOUR == "missing_figure" else [])
    result = ReproResult(id="other" if BEHAVIOUR == "wrong_id" else ID, mode=mode, seeds=list(seeds),
                         claim="The method beats the baseline.", table=t,
                         checks=[] if BEHAVIOUR == "no_checks" else checks, figures=figures,
                         notes="a fake <b>reproduction</b>", config={"steps": 3})
    if BEHAVIOUR != "bare":
        result.wall_time_s = 0.25
        result.environment = {"seeds": list(seeds), "torch": "fake"}
    result.save(out_dir)
    return result
'''

_counter = 0


def _load_fake(tmp_path: Path, behaviour: str = "ok", id: str = "lora", source: str = FAKE_SOURCE) -> ModuleType:
    """Write the fake reproduction to a file and import it under a unique name."""
    global _counter
    _counter += 1
    name = f"rankwise_fake_repro_{_counter}"
    folder = tmp_path / "fake_src"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.BEHAVIOUR = behaviour
    mod.ID = id
    return mod




@pytest.fixture
def load_fake(tmp_path: Path) -> Callable[..., ModuleType]:
    """``load_fake(behaviour="ok", id="lora", source=FAKE_SOURCE)`` -> a fresh fake reproduction module."""

    def load(behaviour: str = "ok", id: str = "lora", source: str = FAKE_SOURCE) -> ModuleType:
        return _load_fake(tmp_path, behaviour, id, source)

    return load
