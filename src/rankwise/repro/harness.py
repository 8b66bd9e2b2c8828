"""Run one paper's reproduction: resolve its module, check the output folder, use the cache,
validate what the module returns and save it.

:func:`reproduce` is what ``rankwise reproduce`` and ``rankwise report`` call. A reproduction module
``rankwise.repro.<id>`` declares a :class:`~rankwise.repro.skeleton.Reproduction` (``REPRODUCTION``: its
settings per mode, ``measure``, ``checks``, ``preconditions``, ``figures``), whose ``run`` does the
per-run work (timing, environment, atomic figures, ``result.json``); a module that does not yet use
the skeleton defines ``run(mode, seeds, out_dir) -> ReproResult`` itself. The harness adds everything
around it:

* ``overrides`` (``rankwise reproduce ID --set key=value``) change the mode's settings; they are
  validated before anything runs, recorded in the result and part of the cache key;

* the id is normalised by the registry (``swift-svd`` -> ``swift_svd``; an unknown id raises with the
  closest known id), and a paper without a reproduction module raises
  :class:`ReproductionUnavailable` naming its status;
* the output folder is created and probed for writability *before* anything runs;
* results are cached under ``<cache>/repro/<id>/<key>/`` (``<cache>`` is ``$RANKWISE_CACHE_DIR`` or
  ``platformdirs.user_cache_dir("rankwise")``). The key hashes the mode, the seeds, the overrides, the torch and
  Python versions and the source code of the reproduction module together with every ``rankwise``
  module it imports, transitively, found by reading the ``import`` statements of each file with
  :mod:`ast` (imports inside functions count; imports computed at run time do not). A cache entry
  holds ``result.json`` and the figures and is copied into the output folder on a hit;
* the returned result is checked against the contract (type, id, mode, seeds, claim checks, figures
  present in the output folder); the wall time and the environment are filled in if the module left
  them empty; ``result.json`` is written atomically.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any, Iterator, Mapping, Sequence

import rankwise
from rankwise.core import registry
from rankwise.core.errors import RankwiseError
from rankwise.repro.result import (
    DEFAULT_SEEDS,
    MODES,
    ClaimCheck,
    ReproResult,
    Table,
    atomic_write_text,
    environment,
)
from rankwise.repro.inputs import ensure_writable, resolve_seeds, validate_mode
from rankwise.repro.skeleton import Reproduction, normalise_overrides

__all__ = ["reproduce", "load_result", "load_module", "reproduction_class", "available", "cache_dir", "cache_key",
           "code_files", "code_version", "default_out_dir", "ensure_writable", "resolve_seeds", "validate_mode",
           "ReproductionUnavailable", "ReproContractError", "DEFAULT_SEEDS", "MODES"]

log = logging.getLogger(__name__)

CACHE_ENV = "RANKWISE_CACHE_DIR"
# Bump when the layout of a cache entry or the meaning of the key changes.
CACHE_FORMAT = 1


class ReproductionUnavailable(RankwiseError):
    """The paper exists but has no reproduction module (yet)."""


class ReproContractError(RankwiseError):
    """A reproduction module returned something that breaks the reproduction contract."""


# --------------------------------------------------------------------------------------------------
# Inputs


def default_out_dir(id: str) -> Path:
    """Where ``rankwise reproduce ID`` writes by default: ``runs/<id>`` in the working directory."""
    return Path("runs") / id


def available() -> list[str]:
    """Ids (papers, then references) that have a reproduction module."""
    return [i for i in registry.all_ids() if registry.has_reproduction(i)]


def load_module(id: str) -> ModuleType:
    """Import ``rankwise.repro.<id>``; raise :class:`ReproductionUnavailable` if there is none."""
    key = registry.normalize_id(id)
    name = f"rankwise.repro.{key}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise  # the module exists but one of its own imports is missing
        try:
            status = registry.status(key)
        except Exception:  # a broken method module elsewhere must not hide this message
            status = "not reproduced"
        have = ", ".join(available()) or "none yet"
        raise ReproductionUnavailable(
            f"{key!r} has no reproduction yet (status: {status}); reproductions available: {have}"
        ) from None


# --------------------------------------------------------------------------------------------------
# Code version: the source of a module and of every rankwise module it imports, transitively


def _package_root() -> Path:
    return Path(rankwise.__file__).resolve().parent


def _module_path(name: str) -> Path | None:
    """The source file of the rankwise module ``name`` (a file path; nothing is imported)."""
    parts = name.split(".")
    if parts[0] != "rankwise":
        return None
    base = _package_root().joinpath(*parts[1:])
    candidates = [base / "__init__.py"]
    if len(parts) > 1:
        candidates.insert(0, base.with_name(base.name + ".py"))
    return next((c for c in candidates if c.is_file()), None)


def _static_imports(name: str, path: Path, source: str) -> set[str]:
    """Names of the rankwise modules (and candidate modules) that ``source`` imports."""
    tree = ast.parse(source, filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                bits = package.split(".") if package else []
                if node.level - 1 > len(bits):
                    continue
                base = bits[: len(bits) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod:
                found.add(mod)
            found.update(f"{mod}.{a.name}" if mod else a.name for a in node.names if a.name != "*")
    out: set[str] = set()
    for m in found:
        if m == "rankwise" or m.startswith("rankwise."):
            parts = m.split(".")
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))  # parents run too
    return out


def code_files(module: ModuleType) -> dict[str, Path] | None:
    """The module's own file and every rankwise module it imports statically, transitively.

    Returns ``{module name: source path}``, or ``None`` when the module's source is not available
    (then its results are not cached).
    """
    file = getattr(module, "__file__", None)
    if not file or not str(file).endswith(".py") or not Path(file).is_file():
        return None
    files: dict[str, Path] = {}
    todo: list[tuple[str, Path]] = [(module.__name__, Path(file))]
    while todo:
        name, path = todo.pop()
        if name in files:
            continue
        files[name] = path
        for dep in _static_imports(name, path, path.read_text(encoding="utf-8")):
            if dep not in files:
                p = _module_path(dep)
                if p is not None:
                    todo.append((dep, p))
    return files


def code_version(module: ModuleType) -> str | None:
    """A sha256 over the sources listed by :func:`code_files` (``None`` if not available)."""
    files = code_files(module)
    if files is None:
        return None
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name].read_bytes()).digest())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    """Root of the reproduction cache: ``$RANKWISE_CACHE_DIR/repro`` or the user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser() / "repro"
    import platformdirs

    return Path(platformdirs.user_cache_dir("rankwise")) / "repro"


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "?"


def cache_key(id: str, mode: str, seeds: Sequence[int], code: str,
              overrides: Mapping[str, Any] | None = None) -> str:
    """The cache key: hashes the format, id, mode, seeds, code version, settings overrides, and the
    torch and Python versions."""
    payload = {"format": CACHE_FORMAT, "id": id, "mode": mode, "seeds": list(seeds), "code": code,
               "overrides": normalise_overrides(overrides),
               "torch": _torch_version(), "python": ".".join(platform.python_version_tuple()[:2])}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and src.resolve() == dst.resolve():
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_cached(entry: Path, out: Path, key: str, mode: str, seeds: list[int],
                 overrides: dict[str, Any]) -> ReproResult | None:
    file = entry / "result.json"
    if not file.is_file():
        return None
    try:
        result = ReproResult.load(file)
        problems = _contract_problems(result, key, mode, seeds, entry, overrides)
        if problems:
            raise ReproContractError("; ".join(problems))
    except Exception as e:  # a damaged entry is a miss, never an error
        log.warning("ignoring damaged cache entry %s: %s", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    for name in result.figures:
        _copy_atomic(entry / name, out / name)
    atomic_write_text(out / "result.json", file.read_text(encoding="utf-8"))
    result.cache_hit = True
    result.source_dir = out
    log.info("%s (%s, seeds %s): cached result from %s", key, mode, seeds, entry)
    return result


def _store(entry: Path, out: Path, result: ReproResult, code: str) -> None:
    """Copy ``result.json`` and the figures from ``out`` into the cache entry (best effort)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            for name in ["result.json", *result.figures]:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(out / name, tmp / name)
            meta = {"id": result.id, "mode": result.mode, "seeds": list(result.seeds), "code": code,
                    "overrides": result.overrides, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
            os.rename(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (entry / "result.json").is_file():
                raise
            return  # another process stored the same entry first
        # One entry per (id, mode, seeds, overrides): drop the entries of older code versions.
        for other in entry.parent.iterdir():
            if other == entry or other.name.startswith(".") or not other.is_dir():
                continue
            try:
                m = json.loads((other / "meta.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if (m.get("mode") == result.mode and m.get("seeds") == list(result.seeds)
                    and m.get("overrides", {}) == result.overrides):
                shutil.rmtree(other, ignore_errors=True)
    except OSError as e:
        log.warning("could not store %s in the cache (%s): %s", result.id, entry, e)


# --------------------------------------------------------------------------------------------------
# Result checks


def _contract_problems(result: object, key: str, mode: str, seeds: list[int], folder: Path,
                       overrides: dict[str, Any] | None = None) -> list[str]:
    if not isinstance(result, ReproResult):
        return [f"run() must return a ReproResult, got {type(result).__name__}"]
    problems = []
    if result.id != key:
        problems.append(f"result.id is {result.id!r}, expected {key!r}")
    if result.mode != mode:
        problems.append(f"result.mode is {result.mode!r}, expected {mode!r}")
    if [int(s) for s in result.seeds] != list(seeds):
        problems.append(f"result.seeds is {list(result.seeds)}, expected {list(seeds)}")
    if result.overrides != (overrides or {}):
        problems.append(f"result.overrides is {result.overrides}, expected {overrides or {}}")
    if not isinstance(result.claim, str) or not result.claim.strip():
        problems.append("result.claim is empty")
    if not isinstance(result.table, Table):
        problems.append(f"result.table must be a Table, got {type(result.table).__name__}")
    if not result.checks:
        problems.append("result.checks is empty (a reproduction checks at least one claim)")
    elif not all(isinstance(c, ClaimCheck) for c in result.checks):
        problems.append("result.checks must hold ClaimCheck objects")
    for name in result.figures:
        p = PurePosixPath(str(name))
        if p.is_absolute() or ".." in p.parts:
            problems.append(f"figure {name!r} must be a file name relative to the output folder")
        elif not (folder / name).is_file():
            problems.append(f"figure {name!r} is listed but missing from {folder}")
    return problems


@contextmanager
def _spinner(enabled: bool, text: str) -> Iterator[None]:
    if not enabled:
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        bar.add_task(text, total=None)
        yield


# --------------------------------------------------------------------------------------------------
# The entry point


def reproduction_class(module: ModuleType) -> type[Reproduction] | None:
    """The :class:`~rankwise.repro.skeleton.Reproduction` a module declares (``REPRODUCTION``), if any."""
    cls = getattr(module, "REPRODUCTION", None)
    return cls if isinstance(cls, type) and issubclass(cls, Reproduction) else None


def reproduce(
    id: str,
    mode: str = "quick",
    seeds: Sequence[int] | None = None,
    out_dir: Path | str | None = None,
    use_cache: bool = True,
    progress: bool = False,
    *,
    overrides: Mapping[str, Any] | None = None,
    module: ModuleType | None = None,
) -> ReproResult:
    """Run (or fetch from the cache) the reproduction of paper ``id``.

    Args:
        id: a spec id of :data:`~rankwise.core.registry.PAPERS` or a reference id (``swift-svd`` is
            accepted for ``swift_svd``).
        mode: ``"smoke"``, ``"quick"`` (default) or ``"full"``.
        seeds: the seeds to run; default: the mode's settings' ``seeds``, else ``DEFAULT_SEEDS[mode]``.
        out_dir: where ``result.json`` and the figures go; default ``runs/<id>``.
        use_cache: read and write the reproduction cache; ``False`` always recomputes and leaves the
            cache untouched.
        progress: show a spinner with the elapsed time on stderr.
        overrides: settings to change from the mode's defaults, ``{name: value}``; values may be
            strings as typed on the command line (``{"rank": "4", "targets": "query,value"}``). They
            are validated before anything runs, recorded in the result and part of the cache key.
            See ``<module>.REPRODUCTION.settings[mode]`` for the names.
        module: run this module instead of importing ``rankwise.repro.<id>`` (for tests and for
            reproductions that live outside the package).

    Returns:
        The validated :class:`ReproResult`; ``result.cache_hit`` tells whether it came from the
        cache and ``result.source_dir`` is ``out_dir``.

    Raises:
        UnknownMethodError: unknown id (the message suggests the closest one).
        ReproductionUnavailable: the paper has no reproduction module.
        PermissionError: ``out_dir`` cannot be written (raised before anything runs).
        ReproContractError: the module's ``run`` returned a result that breaks the contract.
        ValueError, TypeError: bad ``mode``, ``seeds`` or ``overrides``.
    """
    mode = validate_mode(mode)
    key = registry.normalize_id(id)
    mod = module if module is not None else load_module(key)
    cls = reproduction_class(mod)
    norm = normalise_overrides(overrides)
    if cls is not None:
        settings = cls.settings_for(mode, overrides)  # validates the overrides before anything runs
        norm = cls.settings[mode].canonical_overrides(overrides)
        if seeds is None and settings.seeds is not None:
            seeds = settings.seeds
        run = functools.partial(cls.run, overrides=overrides)
    else:
        if norm:
            raise ValueError(f"{key} has no settings to override (its module does not use the reproduction "
                             f"skeleton); got {', '.join(norm)}")
        run = getattr(mod, "run", None)
        if not callable(run):
            raise ReproContractError(f"{mod.__name__} defines no run(mode, seeds, out_dir) function")
    seeds = resolve_seeds(mode, seeds)
    out = ensure_writable(out_dir if out_dir is not None else default_out_dir(key))

    entry: Path | None = None
    code: str | None = None
    if use_cache:
        code = code_version(mod)
        if code is None:
            log.info("%s: source not available, not caching", mod.__name__)
        else:
            entry = cache_dir() / key / cache_key(key, mode, seeds, code, norm)
            hit = _load_cached(entry, out, key, mode, seeds, norm)
            if hit is not None:
                return hit

    log.info("%s: running %s (%s, seeds %s, overrides %s) into %s", key, mod.__name__, mode, seeds, norm, out)
    load0 = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    t0, c0 = time.perf_counter(), time.process_time()
    with _spinner(progress, f"reproducing {key} ({mode}, seeds {', '.join(map(str, seeds))})"):
        result = run(mode, list(seeds), out)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0

    problems = _contract_problems(result, key, mode, seeds, out, norm)
    if problems:
        raise ReproContractError(f"{mod.__name__}.run broke the reproduction contract: "
                                 + "; ".join(problems))
    assert isinstance(result, ReproResult)
    if not result.wall_time_s:
        result.wall_time_s = wall
    if not result.cpu_time_s:
        result.cpu_time_s = cpu
    if not result.environment:
        result.environment = environment(seeds)
    if load0 is not None:  # with "loadavg" at the end: was the machine idle while this ran?
        result.environment.setdefault("loadavg_start", load0)
    result.save(out)
    result.cache_hit = False
    if entry is not None and code is not None:
        _store(entry, out, result, code)
    return result


def load_result(folder: Path | str) -> ReproResult:
    """Read a saved result (``folder/result.json``), e.g. to rebuild a report without rerunning."""
    return ReproResult.load(folder)
