"""Artefact I/O: atomic writes, safetensors with JSON metadata, validation on load, base-model fingerprints.

Everything rankwise saves (adapters, compressed models, statistics, reproduction results) goes
through this module, so that three promises hold everywhere:

* **No partial files.** :func:`atomic_write_bytes`, :func:`atomic_write_text` and
  :func:`save_tensors` write into a temporary file *in the target's folder*, ``fsync`` it and
  ``os.replace`` it onto the target; on any failure (an exception, a ``KeyboardInterrupt``) the
  temporary file is removed and the target is untouched (the old version, if any, stays).
  :func:`atomic_dir` does the same for a whole artefact directory: it is written into a temporary
  sibling and renamed into place only when the ``with`` block succeeds.
* **Nothing is unpickled.** Tensors are stored with ``safetensors``; metadata is JSON.
* **Loads are checked.** :func:`load_tensors` rejects truncated or corrupt files, checks each
  tensor's SHA-256 digest, and checks names, shapes and dtypes against what the caller expects;
  every problem raises :class:`~rankwise.core.errors.ArtifactError` naming the file.

File format of :func:`save_tensors` (a plain safetensors file, readable by any safetensors loader)
---------------------------------------------------------------------------------------------------
The safetensors header metadata (a ``str -> str`` map) holds two keys:

``"format": "pt"``
    the convention of the Hugging Face ecosystem;
``"rankwise"``
    one JSON document ``{"version": 1, "metadata": <caller's metadata>, "sha256": {name: hex}}``:
    the caller's metadata (any JSON-serialisable dict, written with ``allow_nan=False``) and the
    SHA-256 digest of each tensor's raw bytes (row-major, native dtype), checked on load so that a
    flipped byte in the tensor data (which safetensors itself cannot see) is caught.

The metadata lives in the header rather than in a sidecar JSON so that one file is a complete,
self-describing artefact that cannot drift from its tensors. Directory artefacts (adapters) may add
human-readable JSON files next to it (see :mod:`rankwise.core.peft_format`).

Base-model fingerprint
----------------------
:func:`model_fingerprint` identifies the base model an artefact belongs to, so that an adapter
saved for one model is not silently applied to another. It is ``"sha256:" + hexdigest`` of, over
the base parameters sorted by name: ``name``, ``shape`` and ``dtype``, followed by a deterministic
sample of the parameter's values (:data:`FINGERPRINT_SAMPLES` = 16 elements at the evenly spaced flat
positions ``(i * (n - 1)) // 15``, ``i = 0..15``, first and last included; all of them when the
parameter has fewer than 16), hashed as raw bytes in the parameter's dtype. Buffers are not included.
"Base" parameters are those of the model with every adapter wrapper replaced by the layer it wraps:
a module that sets ``is_rankwise_wrapper = True`` and has a ``base_layer`` contributes the
parameters of ``base_layer`` under its own name (no ``.base_layer`` component) and none of its
adapter parameters. A wrapper may also provide ``fingerprint_values``, a map from the parameter
names of ``base_layer`` to value samples taken when it wrapped the layer (see
:func:`value_sample`); those are used instead of the current values, so that merging an adapter
into the base weights (which changes them) and unmerging it (which restores them only up to
rounding) do not change the fingerprint. The fingerprint therefore does not change when adapters
are added, removed, merged or unmerged, and does change when any base parameter is renamed,
reshaped, cast, or when one of the sampled values differs.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import torch
from torch import nn

from rankwise.core.errors import ArtifactError

log = logging.getLogger(__name__)

__all__ = [
    "FINGERPRINT_SAMPLES",
    "FORMAT_VERSION",
    "TensorExpect",
    "atomic_dir",
    "atomic_write_bytes",
    "atomic_write_text",
    "base_parameters",
    "check_fingerprint",
    "load_tensors",
    "model_fingerprint",
    "read_json",
    "read_metadata",
    "save_tensors",
    "tensor_digest",
    "value_sample",
    "write_dir",
    "write_json",
]

FORMAT_VERSION = 1
_META_KEY = "rankwise"
FINGERPRINT_SAMPLES = 16
_FINGERPRINT_TAG = b"rankwise-fingerprint-v1\n"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

PathLike = Union[str, "os.PathLike[str]"]
# What load_tensors accepts per name: a tensor (its shape and dtype), or (shape, dtype) where shape is
# a sequence of ints / None (any size) or None (any shape), and dtype a torch.dtype or None (any).
TensorExpect = Union[torch.Tensor, tuple[Union[Sequence[Union[int, None]], None], Union[torch.dtype, None]]]


# ------------------------------------------------------------------------------------------------
# atomic writes
# ------------------------------------------------------------------------------------------------

def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


_FILE_MODE = 0o666 & ~_umask()
_DIR_MODE = 0o777 & ~_umask()


def _ensure_dir(folder: Path, what: Path) -> None:
    """Create ``folder`` (and parents) if needed; raise ArtifactError naming ``what`` otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(f"cannot write {what}: cannot create directory {folder} "
                            f"({e.strerror or e})") from e
    if not folder.is_dir():
        raise ArtifactError(f"cannot write {what}: {folder} is not a directory")


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms/filesystems cannot open directories; durability is best-effort
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def _atomic_file(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and ``os.replace`` it onto ``path``.

    On any exception (including ``KeyboardInterrupt``) the temporary file is removed and ``path`` is
    left as it was. ``OSError`` raised while writing is turned into ArtifactError naming ``path``.
    """
    path = Path(path)
    parent = path.parent
    _ensure_dir(parent, path)
    if path.is_dir():
        raise ArtifactError(f"cannot write {path}: it is a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        os.close(fd)
    except OSError as e:
        raise ArtifactError(f"cannot write {path}: directory {parent} is not writable "
                            f"({e.strerror or e})") from e
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _FILE_MODE)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and not isinstance(e, ArtifactError):
            raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    _fsync_path(parent, directory=True)


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, ``os.replace``).

    Missing parent folders are created. Returns the path. Raises ArtifactError naming the path when
    the folder cannot be created or written.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes: data must be bytes, got {type(data).__name__}")
    with _atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
    return Path(path)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text: text must be str, got {type(text).__name__}")
    return atomic_write_bytes(path, text.encode(encoding))


def write_json(path: PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (NaN/inf rejected: they are not JSON)."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot write {path}: metadata is not JSON-serialisable ({e})") from e
    return atomic_write_text(path, text + "\n")


def read_json(path: PathLike) -> dict[str, Any]:
    """Read a JSON object from ``path``; a missing, unreadable or malformed file raises ArtifactError."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not a valid JSON file ({e})") from e
    if not isinstance(obj, dict):
        raise ArtifactError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


# A run killed while writing leaves its temporary directory behind; this marker inside it says which
# process wrote it, so that the next write of the same artefact can tell a dead writer's leftovers from
# a write still in progress.
WRITER_MARKER = ".rankwise-writer.json"


def _mark_writer(tmp: Path) -> None:
    (tmp / WRITER_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def _writer_gone(tmp: Path) -> bool:
    """The marker of ``tmp`` names a process of this host that no longer runs."""
    try:
        info = json.loads((tmp / WRITER_MARKER).read_text())
        pid, host = int(info["pid"]), info["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # the process exists and belongs to someone else
        return False
    return False


def clean_stale_siblings(directory: PathLike) -> list[Path]:
    """Delete what killed writes of ``directory`` left beside it; warn about what cannot be proven stale.

    :func:`atomic_dir` writes into ``.<name>.XXXXXXXX.tmp`` and, when replacing, moves the old version
    to ``.<name>.XXXXXXXX.old``. Removed here: ``.tmp`` directories whose writer (recorded in
    :data:`WRITER_MARKER`) no longer runs on this host, and ``.old`` directories when ``directory``
    itself exists (the replacement finished; only the deletion was interrupted). Anything else that
    matches is left in place with a warning. Returns the paths removed.
    """
    d = Path(directory)
    if not d.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(d.name)}\.[a-z0-9_]{{8}}\.(tmp|old)")
    removed = []
    for p in sorted(d.parent.iterdir()):
        m = pattern.fullmatch(p.name)
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        kind = m.group(1)
        if (kind == "tmp" and _writer_gone(p)) or (kind == "old" and d.is_dir()):
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
                log.info("removed %s, left by an interrupted write of %s", p, d)
                continue
        if kind == "old":
            log.warning("%s holds a previous version of %s left by an interrupted overwrite; rename it back "
                        "or delete it", p, d)
        else:
            log.warning("%s is the temporary directory of a write of %s that is still running or was "
                        "interrupted; delete it if no rankwise process is writing there", p, d)
    return removed



@contextlib.contextmanager
def atomic_dir(path: PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Write a whole artefact directory atomically.

    Yields a fresh temporary directory, a sibling of ``path``; write the artefact's files into it.
    When the block succeeds, the files are fsynced and the directory is renamed to ``path``; when
    it raises, the temporary directory is deleted and ``path`` is untouched. Leftovers of earlier
    writes of ``path`` that were killed are cleaned up first (:func:`clean_stale_siblings`); the
    temporary directory holds :data:`WRITER_MARKER` while it is being written (removed before the
    rename, so it never appears in ``path``).

    An existing empty directory at ``path`` is replaced. An existing non-empty one raises
    ArtifactError unless ``overwrite=True``, in which case it is moved aside, the new directory is
    renamed into place, and the old one is deleted (it is put back if that rename fails).
    """
    path = Path(path)
    parent = path.parent
    _ensure_dir(parent, path)
    clean_stale_siblings(path)
    if path.exists() and not path.is_dir():
        raise ArtifactError(f"cannot write directory {path}: a file of that name exists")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ArtifactError(f"cannot write {path}: the directory exists and is not empty "
                            "(pass overwrite=True to replace it)")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        raise ArtifactError(f"cannot write {path}: directory {parent} is not writable "
                            f"({e.strerror or e})") from e
    try:
        _mark_writer(tmp)
        yield tmp
        (tmp / WRITER_MARKER).unlink(missing_ok=True)
        os.chmod(tmp, _DIR_MODE)
        for root, _dirs, files in os.walk(tmp):
            for fname in files:
                _fsync_path(Path(root) / fname)
            _fsync_path(Path(root), directory=True)
        if path.is_dir() and any(path.iterdir()):
            old = parent / f".{path.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)  # replaces an empty directory atomically on POSIX
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, ArtifactError):
            raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    _fsync_path(parent, directory=True)


def write_dir(path: PathLike, fill: Callable[[Path], None], *, overwrite: bool | None,
              own_files: Sequence[str] = ()) -> Path:
    """Write an artefact directory atomically: ``fill(tmp)`` writes the files into :func:`atomic_dir`'s
    temporary sibling. ``overwrite``: None replaces an existing directory only if it holds nothing but
    ``own_files`` (what a previous save of this artefact left); True replaces any; False refuses a
    non-empty one."""
    path = Path(path)
    if overwrite is None:
        overwrite = path.is_dir() and all(p.is_file() and p.name in own_files for p in path.iterdir())
    with atomic_dir(path, overwrite=bool(overwrite)) as tmp:
        fill(tmp)
    return path


# ------------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------------

def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's raw bytes: row-major, in its own dtype (shape/dtype not included)."""
    return hashlib.sha256(_raw_bytes(t)).hexdigest()


def save_tensors(path: PathLike, tensors: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, Any] | None = None) -> Path:
    """Save named tensors and a JSON metadata dict to one safetensors file, atomically.

    ``metadata`` must be JSON-serialisable (NaN/inf are rejected). Tensors are written from CPU, in
    their own dtype, contiguous; tensors that share memory are written as separate copies. The
    per-tensor SHA-256 digests go into the header (see the module docstring).
    """
    from safetensors.torch import save_file

    if not isinstance(tensors, Mapping):
        raise TypeError(f"save_tensors: tensors must be a dict name -> Tensor, got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_tensors: tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_tensors: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        c = t.detach().to("cpu").contiguous()
        if c.numel():
            ptr = c.untyped_storage().data_ptr()
            if ptr in storages:  # safetensors refuses tensors that share memory: write a copy
                c = c.clone()
                ptr = c.untyped_storage().data_ptr()
            storages.add(ptr)
        out[name] = c
    doc = {"version": FORMAT_VERSION, "metadata": dict(metadata or {}),
           "sha256": {name: tensor_digest(t) for name, t in out.items()}}
    try:
        header = {"format": "pt", _META_KEY: json.dumps(doc, sort_keys=True, allow_nan=False)}
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot write {path}: metadata is not JSON-serialisable ({e})") from e
    with _atomic_file(path) as tmp:
        save_file(out, str(tmp), metadata=header)
    return Path(path)


def _check_container(path: Path) -> None:
    """Clear messages for the commonest damage before safetensors parses the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror or e})") from e
    if size < 8 or len(head) < 8:
        raise ArtifactError(f"{path}: truncated or not a safetensors file ({size} bytes)")
    n = int.from_bytes(head, "little")
    if n > _MAX_HEADER or n == 0:
        raise ArtifactError(f"{path}: not a safetensors file (header length {n} is implausible)")
    if 8 + n > size:
        raise ArtifactError(f"{path}: truncated (header says {n} bytes, the file holds {size - 8})")


def read_metadata(path: PathLike) -> dict[str, Any]:
    """The caller metadata of a file written by :func:`save_tensors` (tensors are not read).

    For a safetensors file written by another tool, the raw header metadata (``str -> str``) is
    returned instead.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    _check_container(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise ArtifactError(f"{path}: corrupt safetensors file ({e})") from e
    doc = _parse_doc(path, header)
    return header if doc is None else doc["metadata"]


def _parse_doc(path: Path, header: Mapping[str, str]) -> dict[str, Any] | None:
    raw = header.get(_META_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: corrupt rankwise metadata in the header ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict) \
            or not isinstance(doc.get("sha256", {}), dict):
        raise ArtifactError(f"{path}: malformed rankwise metadata in the header")
    version = doc.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"{path}: written by a newer rankwise (format version {version!r}; "
                            f"this one reads up to {FORMAT_VERSION}); upgrade rankwise")
    return doc


def _shape_ok(want: Sequence[int | None] | None, got: tuple[int, ...]) -> bool:
    if want is None:
        return True
    want = tuple(want)
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


def load_tensors(
    path: PathLike,
    expect: Mapping[str, TensorExpect] | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
    allow_nonfinite: bool = False,
    fingerprint: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a safetensors file and check it; returns ``(tensors, metadata)``.

    ``metadata`` is the dict given to :func:`save_tensors` (for a file written by another tool: the
    raw header metadata). Raises ArtifactError, naming the file, when:

    * the file is missing, truncated, or not valid safetensors;
    * a tensor's SHA-256 differs from the digest in the header (``verify``; files without digests,
      e.g. written by PEFT, are not verified);
    * ``expect`` is given and a name is missing, or (``strict``) a name is unexpected, or a shape
      or dtype differs (``expect[name]`` is a tensor or ``(shape, dtype)`` with ``None`` wildcards);
    * a floating-point tensor holds NaN or inf (unless ``allow_nonfinite``);
    * ``fingerprint`` is given and differs from ``metadata["fingerprint"]``.

    Nothing is unpickled. Tensors are copied out of the memory map (the file may be replaced later).
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory, expected a safetensors file")
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    _check_container(path)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as e:  # safetensors' own error types (SafetensorError, ...)
        raise ArtifactError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    doc = _parse_doc(path, header)
    metadata: dict[str, Any] = dict(header) if doc is None else doc["metadata"]

    if doc is not None and verify:
        digests = doc.get("sha256", {})
        if set(digests) != set(tensors):
            raise ArtifactError(f"{path}: the header lists tensors {sorted(digests)} but the file holds "
                                f"{sorted(tensors)}")
        bad = [n for n, t in tensors.items() if tensor_digest(t) != digests[n]]
        if bad:
            raise ArtifactError(f"{path}: corrupt data: checksum mismatch in tensor(s) {bad[:5]}"
                                f"{' ...' if len(bad) > 5 else ''}")

    if expect is not None:
        problems: list[str] = []
        missing = [n for n in expect if n not in tensors]
        if missing:
            problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if strict:
            extra = [n for n in tensors if n not in expect]
            if extra:
                problems.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        for n, spec in expect.items():
            if n not in tensors:
                continue
            if isinstance(spec, torch.Tensor):
                want_shape, want_dtype = tuple(spec.shape), spec.dtype
            else:
                want_shape, want_dtype = spec
            t = tensors[n]
            if not _shape_ok(want_shape, tuple(t.shape)):
                problems.append(f"{n}: shape {tuple(t.shape)}, expected {tuple(want_shape)}")
            if want_dtype is not None and t.dtype != want_dtype:
                problems.append(f"{n}: dtype {t.dtype}, expected {want_dtype}")
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
            raise ArtifactError(f"{path}: does not fit: {shown}")

    if not allow_nonfinite:
        bad = [n for n, t in tensors.items()
               if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())]
        if bad:
            raise ArtifactError(f"{path}: tensor(s) {bad[:5]} hold NaN or inf")

    if fingerprint is not None:
        check_fingerprint(metadata.get("fingerprint"), fingerprint, source=str(path), required=True)
    return tensors, metadata


# ------------------------------------------------------------------------------------------------
# base-model fingerprint
# ------------------------------------------------------------------------------------------------

def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def value_sample(t: torch.Tensor, k: int = FINGERPRINT_SAMPLES) -> torch.Tensor:
    """The deterministic value sample of :func:`model_fingerprint`: ``k`` evenly spaced flat elements.

    Positions ``(i * (n - 1)) // (k - 1)`` for ``i = 0..k-1`` of the flattened tensor (all elements
    when ``n <= k``); returned as a detached CPU copy in the tensor's dtype.
    """
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= k:
        return flat.to("cpu", copy=True)
    idx = torch.tensor([(i * (n - 1)) // (k - 1) for i in range(k)], dtype=torch.long, device=flat.device)
    return flat.index_select(0, idx).to("cpu", copy=True)


def _excluder(exclude: str | Sequence[str] | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if exclude is None:
        return lambda name: False
    if callable(exclude):
        return lambda name: bool(exclude(name))
    pats = [exclude] if isinstance(exclude, str) else list(exclude)
    if not all(isinstance(p, str) for p in pats):
        raise TypeError(f"exclude must be a glob pattern, a list of patterns or a callable, got {exclude!r}")
    return lambda name: any(fnmatch.fnmatchcase(name, p) or name == p or name.startswith(p + ".")
                            for p in pats)


def base_parameters(model: nn.Module) -> list[tuple[str, torch.nn.Parameter, torch.Tensor | None]]:
    """The base parameters of ``model`` as ``(name, parameter, cached value sample or None)``.

    Adapter wrappers (``is_rankwise_wrapper = True`` with a ``base_layer``) are seen through: their
    ``base_layer``'s parameters appear under the wrapper's name, their own parameters do not. Shared
    (tied) parameters appear once, under the first name met. See the module docstring.
    """
    out: list[tuple[str, torch.nn.Parameter, torch.Tensor | None]] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, prefix: str, overrides: dict[str, torch.Tensor]) -> None:
        base = getattr(mod, "base_layer", None)
        if getattr(mod, "is_rankwise_wrapper", False) and isinstance(base, nn.Module):
            cached = getattr(mod, "fingerprint_values", None) or {}
            ov = dict(overrides)
            ov.update({_join(prefix, k): v for k, v in cached.items()})
            visit(base, prefix, ov)
            return
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = _join(prefix, pname)
            out.append((full, p, overrides.get(full)))
        for cname, child in mod.named_children():
            visit(child, _join(prefix, cname), overrides)

    visit(model, "", {})
    return out


def model_fingerprint(model: nn.Module, exclude: str | Sequence[str] | Callable[[str], bool] | None = None) -> str:
    """A short identity of the base model: ``"sha256:<hex>"`` (see the module docstring for the recipe).

    ``exclude``: parameter names to leave out (glob patterns, names/prefixes, or a predicate), e.g. a
    classification head that the user retrains.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fingerprint: expected an nn.Module, got {type(model).__name__}")
    skip = _excluder(exclude)
    h = hashlib.sha256(_FINGERPRINT_TAG)
    entries = sorted([e for e in base_parameters(model) if not skip(e[0])], key=lambda e: e[0])
    for name, p, cached in entries:
        h.update(f"{name}|{tuple(p.shape)}|{str(p.dtype)}\n".encode())
        if p.is_meta:
            h.update(b"<meta>\n")
            continue
        sample = cached.to(p.dtype) if cached is not None else value_sample(p)
        h.update(_raw_bytes(sample))
    return "sha256:" + h.hexdigest()


def check_fingerprint(saved: str | None, model_or_fingerprint: nn.Module | str, *, source: str = "artefact",
                      required: bool = False, exclude: str | Sequence[str] | Callable[[str], bool] | None = None
                      ) -> None:
    """Raise ArtifactError when an artefact's saved fingerprint does not match the model's.

    ``saved`` None (an artefact without a fingerprint, e.g. a PEFT directory) passes unless
    ``required``.
    """
    if saved is None:
        if required:
            raise ArtifactError(f"{source}: no base-model fingerprint recorded")
        return
    actual = (model_or_fingerprint if isinstance(model_or_fingerprint, str)
              else model_fingerprint(model_or_fingerprint, exclude=exclude))
    if saved != actual:
        raise ArtifactError(
            f"{source} was saved for a different base model: its fingerprint is {saved[:23]}..., this "
            f"model's is {actual[:23]}... (parameter names, shapes, dtypes or values differ). Load it "
            "into the model it was trained on, or pass check_base=False to skip this check.")
