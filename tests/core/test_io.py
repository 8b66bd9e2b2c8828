"""Artefact I/O: atomic writes, safetensors round trips, rejection of damaged or mismatched files, fingerprints."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from rankwise.core import io
from rankwise.core.errors import ArtifactError, RankwiseError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(5, 7, generator=g),
        "w.f64": torch.randn(3, generator=g, dtype=torch.float64),
        "w.f16": torch.randn(4, 4, generator=g).half(),
        "w.bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "idx": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 6, generator=g).t(),  # non-contiguous input
    }


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------

def test_atomic_write_roundtrip_and_overwrite(tmp_path):
    p = io.atomic_write_bytes(tmp_path / "sub" / "x.bin", b"\x00\x01hello")
    assert p.read_bytes() == b"\x00\x01hello"
    io.atomic_write_text(p, "h\u00e9llo \u2713")
    assert p.read_text(encoding="utf-8") == "h\u00e9llo \u2713"
    assert _listing(tmp_path / "sub") == ["x.bin"]  # no temp files left
    assert (p.stat().st_mode & 0o777) != 0o600  # respects the umask like open() would
    with pytest.raises(TypeError):
        io.atomic_write_bytes(p, "not bytes")
    with pytest.raises(TypeError):
        io.atomic_write_text(p, b"not text")


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_interrupted_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch, where):
    target = tmp_path / "result.json"
    target.write_text("old")
    if where == "write":
        real_open = open

        class Boom:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[: len(data) // 2])  # half the data reaches the disk, then the "crash"
                raise KeyboardInterrupt

        monkeypatch.setattr("builtins.open", lambda *a, **k: Boom(real_open(*a, **k)))
    elif where == "fsync":
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    else:
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises((KeyboardInterrupt, ArtifactError, RuntimeError)):
        io.atomic_write_text(target, "new content " * 100)
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert _listing(tmp_path) == ["result.json"]


def test_interrupted_save_tensors_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.torch as st

    real = st.save_file

    def half_then_crash(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        raise MemoryError("simulated crash mid-write")

    monkeypatch.setattr(st, "save_file", half_then_crash)
    with pytest.raises(MemoryError):
        io.save_tensors(tmp_path / "t.safetensors", _tensors())
    assert _listing(tmp_path) == []


def test_killed_process_never_leaves_a_partial_target(tmp_path):
    """A SIGKILL just before the rename: the target keeps its old content (only a hidden temp may remain)."""
    target = tmp_path / "a.safetensors"
    io.save_tensors(target, {"x": torch.zeros(3)}, {"v": "old"})
    script = textwrap.dedent(f"""
        import os, signal, torch
        from rankwise.core import io
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        io.save_tensors({str(target)!r}, {{"x": torch.ones(1000)}}, {{"v": "new"}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9
    tensors, meta = io.load_tensors(target)
    assert meta == {"v": "old"} and torch.equal(tensors["x"], torch.zeros(3))
    assert [p for p in tmp_path.iterdir() if not p.name.startswith(".")] == [target]


def test_unwritable_directory_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "plainfile"
    blocker.write_text("x")
    with pytest.raises(ArtifactError, match=str(blocker / "out.json")):
        io.atomic_write_text(blocker / "out.json", "{}")
    with pytest.raises(ArtifactError, match=str(blocker / "t.safetensors")):
        io.save_tensors(blocker / "t.safetensors", {"x": torch.zeros(1)})
    with pytest.raises(ArtifactError, match="is a directory"):
        io.atomic_write_text(tmp_path, "x")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(ArtifactError, match=r"not writable \(Permission denied\)") as info:
        io.atomic_write_text(tmp_path / "ro" / "out.json", "{}")
    assert str(tmp_path / "ro") in str(info.value)
    assert isinstance(info.value, RankwiseError)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ArtifactError, match="not writable"):
            io.atomic_write_text(ro / "x.txt", "x")
    finally:
        ro.chmod(0o700)


def test_atomic_dir(tmp_path):
    with io.atomic_dir(tmp_path / "art") as d:
        (d / "a.txt").write_text("1")
        assert d.parent == tmp_path and d.name != "art"
    assert _listing(tmp_path / "art") == ["a.txt"]
    with pytest.raises(ZeroDivisionError):
        with io.atomic_dir(tmp_path / "fail") as d:
            (d / "a.txt").write_text("1")
            1 / 0
    assert _listing(tmp_path) == ["art"]
    with pytest.raises(ArtifactError, match="overwrite=True"):
        with io.atomic_dir(tmp_path / "art"):
            pass
    with pytest.raises(RuntimeError):  # a failed overwrite keeps the old directory
        with io.atomic_dir(tmp_path / "art", overwrite=True) as d:
            (d / "b.txt").write_text("2")
            raise RuntimeError
    assert _listing(tmp_path / "art") == ["a.txt"]
    with io.atomic_dir(tmp_path / "art", overwrite=True) as d:
        (d / "b.txt").write_text("2")
    assert _listing(tmp_path / "art") == ["b.txt"]
    (tmp_path / "empty").mkdir()
    with io.atomic_dir(tmp_path / "empty") as d:
        (d / "c.txt").write_text("3")
    assert _listing(tmp_path / "empty") == ["c.txt"]
    assert _listing(tmp_path) == ["art", "empty"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="a file of that name exists"):
        with io.atomic_dir(tmp_path / "file"):
            pass


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------

def test_tensors_roundtrip_bit_exact(tmp_path):
    src = _tensors()
    src["alias"] = src["w.f32"][1]  # shares memory with another tensor
    meta = {"name": "x", "nested": {"a": [1, 2.5, None], "b": "\u2713"}, "fingerprint": "sha256:abc"}
    io.save_tensors(tmp_path / "t.safetensors", src, meta)
    got, got_meta = io.load_tensors(tmp_path / "t.safetensors")
    assert got_meta == meta
    assert got.keys() == src.keys()
    for k, v in src.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert io.read_metadata(tmp_path / "t.safetensors") == meta


def test_expectations_checked(tmp_path):
    path = io.save_tensors(tmp_path / "t.safetensors", {"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    tensors, _ = io.load_tensors(path, expect={"a": ((2, 3), torch.float32), "b": torch.zeros(4)})
    assert set(tensors) == {"a", "b"}
    io.load_tensors(path, expect={"a": ((None, 3), None)}, strict=False)
    cases = [
        ({"a": ((2, 3), None)}, r"unexpected \['b'\]"),
        ({"a": ((2, 3), None), "b": ((4,), None), "c": (None, None)}, r"missing \['c'\]"),
        ({"a": ((3, 2), None), "b": (None, None)}, r"a: shape \(2, 3\), expected \(3, 2\)"),
        ({"a": ((2, 3), torch.float16), "b": (None, None)}, r"a: dtype torch.float32, expected torch.float16"),
        ({"a": ((2, 3, 1), None), "b": (None, None)}, r"a: shape \(2, 3\), expected \(2, 3, 1\)"),
    ]
    for expect, msg in cases:
        with pytest.raises(ArtifactError, match=msg) as info:
            io.load_tensors(path, expect=expect)
        assert str(path) in str(info.value)


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate_data", "truncate_header", "empty",
                                    "garbage", "huge_header_len"])
def test_damaged_files_rejected(tmp_path, damage):
    path = io.save_tensors(tmp_path / "t.safetensors", _tensors(), {"k": "v"})
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if damage == "flip_data":
        data[8 + n + 3] ^= 0x01
    elif damage == "flip_header":
        data[8 + n // 2] ^= 0x20 if data[8 + n // 2] != ord(" ") else 0x01
    elif damage == "truncate_data":
        data = data[: len(data) - 7]
    elif damage == "truncate_header":
        data = data[: 8 + n // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "garbage":
        data = bytearray(os.urandom(256))
        data[:8] = (100).to_bytes(8, "little")
    else:
        data[:8] = (2**62).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as info:
        io.load_tensors(path)
    msg = str(info.value)
    assert str(path) in msg
    assert any(w in msg for w in ("corrupt", "truncated", "not a safetensors", "malformed")), msg


def test_missing_and_directory_paths(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        io.load_tensors(tmp_path / "nope.safetensors")
    with pytest.raises(ArtifactError, match="is a directory"):
        io.load_tensors(tmp_path)


def test_nonfinite_rejected_unless_allowed(tmp_path):
    path = io.save_tensors(tmp_path / "t.safetensors", {"a": torch.tensor([1.0, float("nan")]), "i": torch.arange(2)})
    with pytest.raises(ArtifactError, match=r"\['a'\] hold NaN or inf"):
        io.load_tensors(path)
    tensors, _ = io.load_tensors(path, allow_nonfinite=True)
    assert torch.isnan(tensors["a"][1])


def test_metadata_must_be_json(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        io.save_tensors(tmp_path / "t.safetensors", {"a": torch.zeros(1)}, {"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        io.save_tensors(tmp_path / "t.safetensors", {"a": torch.zeros(1)}, {"x": float("nan")})
    with pytest.raises(TypeError):
        io.save_tensors(tmp_path / "t.safetensors", {"a": [1, 2]})
    assert _listing(tmp_path) == []


def test_foreign_safetensors_file_loads_unverified(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.ones(2)}, str(tmp_path / "f.safetensors"), metadata={"format": "pt"})
    tensors, meta = io.load_tensors(tmp_path / "f.safetensors")
    assert meta == {"format": "pt"} and torch.equal(tensors["x"], torch.ones(2))


def test_newer_format_rejected(tmp_path):
    from safetensors.torch import save_file

    doc = json.dumps({"version": io.FORMAT_VERSION + 1, "metadata": {}, "sha256": {}})
    save_file({"x": torch.ones(2)}, str(tmp_path / "f.safetensors"), metadata={"rankwise": doc})
    with pytest.raises(ArtifactError, match="newer rankwise"):
        io.load_tensors(tmp_path / "f.safetensors")


def test_json_helpers(tmp_path):
    io.write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    assert io.read_json(tmp_path / "a.json") == {"a": [1, 2], "b": 1}
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ArtifactError, match="not a valid JSON"):
        io.read_json(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        io.read_json(tmp_path / "list.json")


# --------------------------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------------------------

def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 40), nn.LayerNorm(40), nn.Linear(40, 3))


def test_value_sample_positions():
    t = torch.arange(100.0)
    assert io.value_sample(t).tolist() == [float((i * 99) // 15) for i in range(16)]
    assert io.value_sample(torch.arange(5.0)).tolist() == [0, 1, 2, 3, 4]


def test_fingerprint_properties(tmp_path):
    a = _net()
    fp = io.model_fingerprint(a)
    assert fp.startswith("sha256:") and len(fp) == 7 + 64
    assert io.model_fingerprint(copy.deepcopy(a)) == fp == io.model_fingerprint(_net())
    assert io.model_fingerprint(_net(1)) != fp
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[0].weight[0, 0] += 1.0  # a sampled position (the first element)
    assert io.model_fingerprint(b) != fp
    assert io.model_fingerprint(copy.deepcopy(a).double()) != fp
    renamed = nn.Sequential()
    for i, m in enumerate(copy.deepcopy(a)):
        renamed.add_module(f"l{i}", m)
    assert io.model_fingerprint(renamed) != fp
    c = copy.deepcopy(a)
    with torch.no_grad():
        c[2].weight.add_(1.0)  # a head the user retrains
    assert io.model_fingerprint(c, exclude="2") == io.model_fingerprint(a, exclude="2") != fp
    assert io.model_fingerprint(c, exclude=["2.*"]) == io.model_fingerprint(a, exclude=lambda n: n.startswith("2."))
    io.check_fingerprint(fp, a)
    io.check_fingerprint(None, a)
    with pytest.raises(ArtifactError, match="different base model"):
        io.check_fingerprint(fp, _net(1), source="x")
    with pytest.raises(ArtifactError, match="no base-model fingerprint"):
        io.check_fingerprint(None, a, required=True)
    path = io.save_tensors(tmp_path / "t.safetensors", {"x": torch.zeros(1)}, {"fingerprint": fp})
    io.load_tensors(path, fingerprint=fp)
    with pytest.raises(ArtifactError, match="different base model"):
        io.load_tensors(path, fingerprint=io.model_fingerprint(_net(1)))


def test_fingerprint_sees_through_wrappers():
    class Wrap(nn.Module):
        is_rankwise_wrapper = True

        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.extra = nn.Parameter(torch.ones(3))
            self.fingerprint_values = {n: io.value_sample(p) for n, p in base.named_parameters()}

    a = _net()
    fp = io.model_fingerprint(a)
    w = copy.deepcopy(a)
    w[0] = Wrap(w[0])
    assert io.model_fingerprint(w) == fp
    with torch.no_grad():
        w[0].base_layer.weight.add_(0.5)  # e.g. an adapter merged into the weight: the cached sample is used
    assert io.model_fingerprint(w) == fp
    assert [n for n, _, _ in io.base_parameters(w)] == [n for n, _ in a.named_parameters()]


def test_tied_parameters_counted_once():
    m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    m[1].weight = m[0].weight
    assert [n for n, _, _ in io.base_parameters(m)] == ["0.weight"]


def test_atomic_dir_cleans_leftovers_of_killed_writes(tmp_path, caplog):
    """Any artefact directory (adapters, finetune checkpoints, compressed models) written through
    atomic_dir: a dead writer's .tmp and a finished overwrite's .old are removed at the next write; a
    .tmp whose writer still runs is left, with a warning."""
    import json
    import subprocess
    import sys

    from rankwise.core import io

    target = tmp_path / "adapter"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    dead = tmp_path / ".adapter.abcd1234.tmp"
    dead.mkdir()
    (dead / io.WRITER_MARKER).write_text(json.dumps({"pid": proc.pid, "host": __import__("socket").gethostname()}))
    alive = tmp_path / ".adapter.efgh5678.tmp"
    alive.mkdir()
    (alive / io.WRITER_MARKER).write_text(json.dumps({"pid": os.getppid(),
                                                      "host": __import__("socket").gethostname()}))
    with io.atomic_dir(target) as tmp:
        assert (tmp / io.WRITER_MARKER).exists()
        (tmp / "a.txt").write_text("one")
    assert not dead.exists() and alive.exists()
    assert not (target / io.WRITER_MARKER).exists() and (target / "a.txt").read_text() == "one"
    old = tmp_path / ".adapter.ijkl9012.old"
    old.mkdir()
    with io.atomic_dir(target, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("two")
    assert not old.exists() and (target / "a.txt").read_text() == "two"
    assert alive.exists()
    assert not list(tmp_path.glob(".adapter.*.old"))
