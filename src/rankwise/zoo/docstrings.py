"""A deterministic offline text corpus: docstrings of a fixed list of standard-library modules.

The corpus is built on the fly from the running interpreter (nothing is downloaded or shipped):
for each module of :data:`MODULES` it collects the module docstring, then, in sorted name order,
the docstrings of the classes and functions *defined* in that module (``__module__`` equal to the
module or to its C accelerator, e.g. ``_heapq`` for ``heapq``) and of the methods, class methods and
static methods found in each such class's own ``__dict__`` (inherited docstrings are not copied).
Every object is visited once (the first module in list order that exposes it wins).
Docstrings are cleaned with :func:`inspect.cleandoc`; empty ones are skipped.

The modules are grouped into eight topics (:data:`GROUPS`). Each topic contributes one module to
``"calib"``, one to ``"eval"`` and the rest (six to eight) to ``"train"`` (:data:`SPLIT_OF`), so
calibration and evaluation text never share a module with each other or with training text, and
every split covers every topic.

The content depends on the CPython version (and, for a few modules such as ``os`` and ``socket``, on
the platform); :attr:`Corpus.info` records both together with a SHA-256 of the content, so a result
can state exactly which corpus it used. Licence: the docstrings are part of CPython and distributed
under the Python Software Foundation License (PSF-2.0).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import platform
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "GROUPS",
    "MODULES",
    "SPLITS",
    "SPLIT_OF",
    "Corpus",
    "Document",
    "corpus",
]

#: The topic groups and their modules, in the fixed order the corpus is built in.
GROUPS: dict[str, tuple[str, ...]] = {
    "text": ("string", "textwrap", "difflib", "re", "shlex", "unicodedata", "locale", "gettext", "codecs",
             "html.parser"),
    "numbers": ("math", "cmath", "statistics", "fractions", "decimal", "random", "numbers", "operator"),
    "containers": ("collections", "heapq", "bisect", "functools", "itertools", "copy", "enum", "array",
                   "weakref", "dataclasses"),
    "files": ("os", "posixpath", "pathlib", "shutil", "glob", "fnmatch", "tempfile", "fileinput", "stat",
              "filecmp"),
    "formats": ("json", "csv", "configparser", "pickle", "base64", "zipfile", "tarfile", "lzma", "gzip",
                "struct"),
    "internet": ("urllib.parse", "urllib.request", "http.client", "http.cookiejar", "email.message",
                 "email.utils", "smtplib", "ftplib", "ipaddress", "socket"),
    "concurrency": ("threading", "queue", "concurrent.futures._base", "asyncio.tasks", "asyncio.locks",
                    "asyncio.events", "asyncio.queues", "subprocess", "sched", "selectors"),
    "devtools": ("inspect", "dis", "traceback", "unittest.case", "doctest", "logging", "argparse", "typing",
                 "warnings", "pprint"),
}

#: The modules of each held-out split (one per topic group); every other module is "train".
_HELD_OUT: dict[str, tuple[str, ...]] = {
    "calib": ("textwrap", "random", "enum", "tempfile", "zipfile", "http.client", "asyncio.locks",
              "argparse"),
    "eval": ("re", "fractions", "functools", "shutil", "csv", "ftplib", "queue", "traceback"),
}

SPLITS: tuple[str, ...] = ("train", "calib", "eval")

#: All modules in build order.
MODULES: tuple[str, ...] = tuple(m for mods in GROUPS.values() for m in mods)
GROUP_OF: dict[str, str] = {m: g for g, mods in GROUPS.items() for m in mods}
SPLIT_OF: dict[str, str] = {
    m: next((s for s, held in _HELD_OUT.items() if m in held), "train") for m in MODULES
}

LICENCE = ("Python Software Foundation License (PSF-2.0): the docstrings are part of CPython "
           "(https://github.com/python/cpython), read from the running interpreter")

#: Bump when the extraction rules change (it is part of the hash input, so caches keyed on the
#: corpus hash are invalidated).
EXTRACTION_VERSION = 1

_KINDS = ("module", "class", "function", "method")


@dataclass(frozen=True)
class Document:
    """One docstring of the corpus.

    ``qualname`` is ``""`` for a module docstring, ``"Class"`` for a class, ``"func"`` for a
    module-level function and ``"Class.method"`` for a method. ``kind`` is one of
    ``"module"``, ``"class"``, ``"function"``, ``"method"``. ``group`` is the module's topic group and
    ``split`` its corpus split.
    """

    module: str
    qualname: str
    kind: str
    text: str
    group: str
    split: str

    @property
    def key(self) -> str:
        """``module:qualname``, unique within the corpus."""
        return f"{self.module}:{self.qualname}"


@dataclass
class Corpus:
    """The docstring corpus. ``documents`` is in build order (module list order, then names sorted)."""

    documents: list[Document]
    info: dict[str, Any] = field(default_factory=dict)

    def split(self, name: str) -> list[Document]:
        """The documents of one split: ``"train"``, ``"calib"`` or ``"eval"`` (disjoint by module)."""
        _check_split(name)
        return [d for d in self.documents if d.split == name]

    def text(self, split: str | None = None, sep: str = "\n\n") -> str:
        """The docstrings of ``split`` (all documents when ``None``) joined by ``sep``."""
        docs = self.documents if split is None else self.split(split)
        return sep.join(d.text for d in docs)

    def modules(self, split: str | None = None) -> list[str]:
        """The modules of ``split`` (all when ``None``), in build order."""
        if split is not None:
            _check_split(split)
        return [m for m in MODULES if split is None or SPLIT_OF[m] == split]

    def __len__(self) -> int:
        return len(self.documents)


def _check_split(name: str) -> None:
    if name not in SPLITS:
        raise ValueError(f"split={name!r} is not a corpus split; choose one of {list(SPLITS)}")


def _accepts(obj: Any, modname: str) -> bool:
    """Whether ``obj`` is defined in ``modname`` (or in its C accelerator module)."""
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return False
    accel = {"_" + modname.split(".")[-1], "_" + modname.split(".")[0]}
    return owner == modname or owner in accel


def _doc(obj: Any, own: bool = False) -> str | None:
    """The cleaned docstring of ``obj``; with ``own``, only one set in the class's own ``__dict__``."""
    doc = vars(obj).get("__doc__") if own else getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    text = inspect.cleandoc(doc).strip()
    return text or None


_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)
_METHOD_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                 types.ClassMethodDescriptorType)


def _module_documents(modname: str, seen: set[int]) -> list[tuple[str, str, str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(modname)
    out: list[tuple[str, str, str]] = []
    doc = _doc(module)
    if doc:
        out.append(("", "module", doc))
    for name, obj in sorted(vars(module).items()):
        if id(obj) in seen or not _accepts(obj, modname):
            continue
        if inspect.isclass(obj):
            seen.add(id(obj))
            doc = _doc(obj, own=True)
            if doc:
                out.append((name, "class", doc))
            for mname, member in sorted(vars(obj).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if not isinstance(member, _METHOD_TYPES) or id(member) in seen:
                    continue
                seen.add(id(member))
                doc = _doc(member)
                if doc:
                    out.append((f"{name}.{mname}", "method", doc))
        elif isinstance(obj, _FUNCTION_TYPES):
            seen.add(id(obj))
            doc = _doc(obj)
            if doc:
                out.append((name, "function", doc))
    return out


def _extract() -> list[tuple[str, str, str, str]]:
    """(module, qualname, kind, text) of every docstring, in build order (runs in a clean interpreter)."""
    seen: set[int] = set()
    return [(m, q, k, t) for m in MODULES for q, k, t in _module_documents(m, seen)]


def _extract_clean() -> tuple[list[tuple[str, str, str, str]], str]:
    """Run :func:`_extract` in a fresh, isolated interpreter (``python -I -S this_file``).

    Libraries monkeypatch the standard library at import time (``transformers`` adds
    ``logging.Logger.warning_advice``, others replace ``typing``/``inspect`` helpers), so reading
    docstrings in the calling process would make the corpus depend on what was imported before.
    A fresh interpreter without ``site`` sees only the standard library. Falls back to the current
    process (with a warning, recorded in ``Corpus.info["extraction"]``) if no interpreter can be run.
    """
    if sys.executable:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", os.path.abspath(__file__)],
                capture_output=True, check=True, timeout=120,
                env={"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8",
                     **{k: os.environ[k] for k in ("PATH", "SYSTEMROOT") if k in os.environ}},
            )
            rows = json.loads(proc.stdout.decode("utf-8"))
            return [tuple(r) for r in rows], "isolated-interpreter"  # type: ignore[misc]
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            logger.warning("could not extract the corpus in a clean interpreter (%s); extracting in this "
                           "process, where imported libraries may have patched the standard library", exc)
    return _extract(), "in-process"


@functools.lru_cache(maxsize=1)
def _build() -> tuple[tuple[Document, ...], str, str]:
    rows, how = _extract_clean()
    docs = tuple(Document(m, q, k, t, GROUP_OF[m], SPLIT_OF[m]) for m, q, k, t in rows)
    h = hashlib.sha256()
    h.update(f"rankwise-corpus-v{EXTRACTION_VERSION}\n".encode())
    for d in docs:
        h.update(json.dumps([d.module, d.qualname, d.kind, d.text, d.group, d.split]).encode("utf-8"))
        h.update(b"\n")
    return docs, h.hexdigest(), how


def corpus() -> Corpus:
    """The standard-library docstring corpus (built once per process, a few hundred milliseconds).

    Returns a fresh :class:`Corpus` (its ``documents`` list may be modified by the caller without
    affecting later calls). ``Corpus.info`` holds the Python version, platform, SHA-256 of the
    content, counts per split and kind, and the licence.
    """
    docs, digest, how = _build()
    counts = {s: sum(1 for d in docs if d.split == s) for s in SPLITS}
    info: dict[str, Any] = {
        "name": "stdlib-docstrings",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": sys.platform,
        "sha256": digest,
        "extraction_version": EXTRACTION_VERSION,
        "extraction": how,
        "n_documents": len(docs),
        "n_modules": len(MODULES),
        "n_chars": sum(len(d.text) for d in docs),
        "documents_per_split": counts,
        "chars_per_split": {s: sum(len(d.text) for d in docs if d.split == s) for s in SPLITS},
        "documents_per_kind": {k: sum(1 for d in docs if d.kind == k) for k in _KINDS},
        "modules_per_split": {s: [m for m in MODULES if SPLIT_OF[m] == s] for s in SPLITS},
        "groups": {g: list(m) for g, m in GROUPS.items()},
        "licence": LICENCE,
    }
    return Corpus(documents=list(docs), info=info)


if __name__ == "__main__":  # the clean-interpreter extraction of _extract_clean()
    sys.stdout.write(json.dumps(_extract()))
