"""The reproduction skeleton: a reproduction declares *what* it measures; the skeleton does the rest.

A reproduction module ``rankwise.repro.<id>`` subclasses :class:`Reproduction` and declares

* ``id`` and ``claim`` (the paper's headline claim, one sentence);
* ``settings``: one :class:`Settings` instance per mode (``"smoke"``, ``"quick"``, ``"full"``), of
  its own frozen dataclass whose fields (model, targets, data sizes, budgets, seeds, ...) are public
  and documented (:func:`setting`); a user changes them with ``rankwise reproduce <id> --set key=value``
  or ``reproduce(id, overrides={...})``;
* ``measure(settings, seed) -> record``: one seed's numbers (any object the module likes);
  optionally ``measure_joint(settings, records)`` for what needs every seed at once or runs once;
* ``table(settings, records)``, ``preconditions(settings, records)``, ``checks(settings, records)``
  (each :class:`~rankwise.repro.result.ClaimCheck` labelled ``kind="claim"`` or ``"wiring"``, with
  paired per-example ``samples`` where it compares rows on the same examples),
  ``figures(settings, records, out_dir)``, and optionally ``notes``, ``config`` and ``extra``;

and binds ``REPRODUCTION = TheClass`` and ``run = TheClass.run`` at module level. :func:`execute`
(what ``run`` calls) validates the mode and seeds, applies the overrides, creates and probes the
output folder, times the run (wall and CPU), measures, evaluates, saves the figures atomically
(:func:`save_figure`), records the environment and the overrides, and writes ``result.json``.

The global random generators (Python's ``random``, NumPy's legacy ``np.random``, torch's CPU generator and
the CUDA generators already in use) are seeded before each ``measure`` call from ``(id, seed)``, before
``measure_joint`` from ``(id, seeds)``, and restored to the caller's states when the run ends: a result
depends on its seeds only, never on what ran earlier in the process (a report runs many), and a
reproduction that seeds a global generator itself does not leak that into the next one.
See ``docs/reproductions-howto.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import tempfile
import time
import types
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Generic, Iterator, Mapping, Sequence, TypeVar

from rankwise.core import validate as V
from rankwise.repro.inputs import ensure_writable, resolve_seeds, validate_mode
from rankwise.repro.result import DEFAULT_SEEDS, ClaimCheck, Precondition, ReproResult, Table, environment

R = TypeVar("R")
S = TypeVar("S", bound="Settings")

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def setting(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
            choices: Sequence[Any] | None = None) -> Any:
    """A documented settings field: its default, what it means, and (optionally) its allowed range
    (``lo`` / ``hi``, inclusive) or choices, checked on construction and on every override."""
    meta = {"doc": doc, "lo": lo, "hi": hi, "choices": None if choices is None else tuple(choices)}
    if isinstance(default, (list, dict, set)):
        raise TypeError("settings fields are immutable: use a tuple, not a list/dict/set")
    return dataclasses.field(default=default, metadata=meta)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True
    return tp, False


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


def _parse(name: str, text: str, tp: Any) -> Any:
    """Parse the command-line string ``text`` into the type ``tp`` of settings field ``name``."""
    inner, optional = _strip_optional(tp)
    t = text.strip()
    if optional and t.lower() in ("none", "null"):
        return None
    origin = typing.get_origin(inner)
    try:
        if inner is bool:
            if t.lower() in _TRUE:
                return True
            if t.lower() in _FALSE:
                return False
            raise ValueError
        if inner is int:
            return int(t)
        if inner is float:
            return float(t)
        if inner is str:
            return t
        if origin is typing.Literal:
            args = typing.get_args(inner)
            return t if all(isinstance(a, str) for a in args) else type(args[0])(t)
        if origin is tuple:
            if t.startswith("["):
                return _tupled(json.loads(t))
            args = typing.get_args(inner)
            parts = [p for p in (x.strip() for x in t.split(",")) if p] if t else []
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_parse(name, p, args[0]) for p in parts)
            if args and len(args) != len(parts):
                raise ValueError
            return tuple(_parse(name, p, a) for p, a in zip(parts, args)) if args else tuple(parts)
        return _tupled(json.loads(t))
    except (ValueError, TypeError, json.JSONDecodeError):
        shown = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        raise ValueError(f"cannot read {text!r} as {shown} for setting {name!r}") from None


def _check_type(field: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` with :mod:`rankwise.core.validate`; returns it
    converted to the plain type (an int given for a float field becomes a float)."""
    inner, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{field} must not be None")
    origin = typing.get_origin(inner)
    if inner is bool:
        return V.check_bool(field, value)
    if inner is int:
        return V.check_int(field, value)
    if inner is float:
        return V.check_number(field, value)
    if inner is str:
        return V.check_str(field, value, allow_empty=True)
    if origin is typing.Literal:
        return V.check_choice(field, value, typing.get_args(inner))
    if origin is tuple:
        if isinstance(value, list):
            value = tuple(value)
        if not isinstance(value, tuple):
            raise ValueError(f"{field} must be a tuple, got {value!r}")
        args = typing.get_args(inner)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(f"{field}[{i}]", v, args[0]) for i, v in enumerate(value))
        if args:
            if len(args) != len(value):
                raise ValueError(f"{field} must hold {len(args)} values, got {value!r}")
            return tuple(_check_type(f"{field}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        return value
    return value


def _leaves(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``(name[i][j], leaf)`` for every non-tuple leaf of a (nested) tuple value."""
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}[{i}]", v)
    else:
        yield name, value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Base of every reproduction's settings: a frozen dataclass, one instance per mode.

    Subclasses are ``@dataclasses.dataclass(frozen=True, kw_only=True)`` with fields declared by
    :func:`setting`. Every field is type-checked (and range-checked where the field says so) with
    :mod:`rankwise.core.validate` on construction; a subclass adds cross-field rules in
    :meth:`validate`. Messages read ``"<Class>.<field> must be ..., got <value>"``.
    """

    seeds: tuple[int, ...] | None = setting(None, "seeds run when the caller gives none (None: the mode's "
                                                  "default, DEFAULT_SEEDS)")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        cls = type(self).__name__
        for f in dataclasses.fields(self):
            name = f"{cls}.{f.name}"
            value = _check_type(name, getattr(self, f.name), hints[f.name])
            m = f.metadata
            if value is not None and m.get("choices") is not None:
                V.check_choice(name, value, m["choices"])
            if value is not None and (m.get("lo") is not None or m.get("hi") is not None):
                for where, v in _leaves(name, value):
                    if isinstance(v, int) and not isinstance(v, bool):
                        V.check_int(where, v, m.get("lo"), m.get("hi"))
                    elif isinstance(v, float):
                        V.check_number(where, v, m.get("lo"), m.get("hi"))
            object.__setattr__(self, f.name, value)
        if self.seeds is not None:
            if not self.seeds:
                raise ValueError(f"{cls}.seeds must not be empty")
            for s in self.seeds:
                V.check_int(f"{cls}.seeds", s, 0)
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"{cls}.seeds must be distinct, got {self.seeds!r}")
        self.validate()

    def validate(self) -> None:
        """Cross-field rules of a subclass (raise ValueError naming the field); default: none."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def docs(cls) -> dict[str, str]:
        """``{field: what it means}``."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    def with_overrides(self: S, overrides: Mapping[str, Any] | None) -> S:
        """A copy with ``overrides`` applied: strings are parsed to the field's type (``"0.5"``,
        ``"a,b"`` for a tuple, ``"none"``, ``"true"``), other values are taken as they are; then
        everything is validated. An unknown key raises ValueError naming the allowed ones."""
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            raise TypeError(f"overrides must be a mapping of setting names to values, got {type(overrides).__name__}")
        names = self.field_names()
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise ValueError(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                             f"{type(self).__name__}; the settings are: {', '.join(names)}")
        hints = typing.get_type_hints(type(self))
        changes = {k: _parse(k, v, hints[k]) if isinstance(v, str) and hints[k] is not str else v
                   for k, v in overrides.items()}
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def canonical_overrides(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        """``overrides`` as the typed, JSON-able values they give (``{"rank": "4"}`` -> ``{"rank": 4}``),
        keys sorted: what the result records and the cache key hashes, so that ``--set rank=4`` and
        ``overrides={"rank": 4}`` are the same run."""
        if not overrides:
            return {}
        values = self.with_overrides(overrides).to_json()
        return {k: values[k] for k in sorted(overrides)}


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return [_jsonable(v) for v in x]
    return x


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """``["key=value", ...]`` (the ``--set`` options) -> ``{key: value}``; a malformed or repeated
    item raises ValueError."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        if key in out:
            raise ValueError(f"setting {key!r} given twice")
        out[key] = value
    return out


def normalise_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Overrides as a JSON-able dict with sorted keys (what the cache key and the report record)."""
    if not overrides:
        return {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a mapping of setting names to values, got {type(overrides).__name__}")
    return {str(k): (v if isinstance(v, (str, int, float, bool, type(None))) else _jsonable(v))
            for k, v in sorted(overrides.items())}


# --------------------------------------------------------------------------------------------------
# Records and figures


class Records(Generic[R]):
    """The per-seed records of one run, in seed order, and what ``measure_joint`` returned."""

    def __init__(self, seeds: Sequence[int], by_seed: Mapping[int, R], joint: Any = None) -> None:
        self.seeds = list(seeds)
        self.by_seed = dict(by_seed)
        self.joint = joint

    def __getitem__(self, seed: int) -> R:
        return self.by_seed[seed]

    def __iter__(self) -> Iterator[R]:
        return iter(self.by_seed[s] for s in self.seeds)

    def __len__(self) -> int:
        return len(self.seeds)

    def items(self) -> list[tuple[int, R]]:
        return [(s, self.by_seed[s]) for s in self.seeds]

    @property
    def first(self) -> R:
        return self.by_seed[self.seeds[0]]


def merge_in_order(parts: Sequence[Any]) -> Any:
    """Join per-seed structures in seed order: dicts merge key by key (first-seen key order), lists
    concatenate, anything else keeps the first value. For modules whose per-seed results fill nested
    ``{name: [value per seed]}`` collections."""
    parts = list(parts)
    if not parts:
        return None
    if all(isinstance(p, dict) for p in parts):
        keys: dict[Any, None] = {}
        for p in parts:
            keys.update(dict.fromkeys(p))
        return {k: merge_in_order([p[k] for p in parts if k in p]) for k in keys}
    if all(isinstance(p, list) for p in parts):
        return [x for p in parts for x in p]
    return parts[0]


def save_figure(fig: Any, path: Path | str, **kwargs: Any) -> str:
    """Save a matplotlib figure atomically (temporary file + ``os.replace``) and close it; return its
    file name. Keyword arguments go to ``savefig`` (default ``dpi=110``)."""
    path = Path(path)
    kwargs.setdefault("dpi", 110)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix or ".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, **kwargs)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path.name


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def global_seed(id: str, part: str) -> int:
    """The seed (``0 <= s < 2**32``) of the global generators for one part of reproduction ``id``'s run."""
    digest = hashlib.sha256(f"rankwise.repro/{id}/{part}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@contextmanager
def _global_generators() -> Iterator[Any]:
    """Restore Python's, NumPy's and torch's global generators on exit; yields ``reseed(seed)``, which
    seeds all of them (CUDA's too, through ``torch.manual_seed``)."""
    import numpy as np
    import torch

    py_state, np_state = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []

    def reseed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    try:
        with torch.random.fork_rng(devices=cuda):
            yield reseed
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


# --------------------------------------------------------------------------------------------------
# The declaration


class Reproduction(Generic[S, R]):
    """Base of a paper's reproduction; see the module docstring and ``docs/reproductions-howto.md``.

    A fresh instance runs each reproduction, so a subclass may keep what several seeds share (a
    loaded model, reference embeddings) on ``self`` during :meth:`measure`.
    """

    id: ClassVar[str]
    claim: ClassVar[str]
    settings: ClassVar[Mapping[str, Settings]]
    threads: ClassVar[int | None] = None  # torch threads while measuring (None: leave as is)

    # ---- what a reproduction declares
    def running(self) -> Any:
        """A context manager held while measuring (default: none; e.g. ``threadpool_limits(1)``)."""
        return contextlib.nullcontext()

    def measure(self, settings: S, seed: int) -> R:
        raise NotImplementedError

    def measure_joint(self, settings: S, records: Records[R]) -> Any:
        """What needs every seed at once or runs once per run (default: nothing)."""
        return None

    def table(self, settings: S, records: Records[R]) -> Table:
        raise NotImplementedError

    def preconditions(self, settings: S, records: Records[R]) -> list[Precondition]:
        return []

    def checks(self, settings: S, records: Records[R]) -> list[ClaimCheck]:
        raise NotImplementedError

    def figures(self, settings: S, records: Records[R], out_dir: Path) -> list[str]:
        return []

    def notes(self, settings: S, records: Records[R]) -> str:
        return ""

    def config(self, settings: S, records: Records[R]) -> dict[str, Any]:
        """What the result records as its configuration, besides the settings (default: nothing)."""
        return {}

    def extra(self, settings: S, records: Records[R]) -> dict[str, Any]:
        return {}

    # ---- provided
    @classmethod
    def settings_for(cls, mode: str, overrides: Mapping[str, Any] | None = None) -> Settings:
        """The settings of ``mode`` with ``overrides`` applied (validated)."""
        if mode not in cls.settings:
            raise ValueError(f"mode must be one of {', '.join(cls.settings)}; got {mode!r}")
        return cls.settings[mode].with_overrides(overrides)

    @classmethod
    def run(cls, mode: str, seeds: Sequence[int] | None, out_dir: Path | str,
            overrides: Mapping[str, Any] | None = None) -> ReproResult:
        """The reproduction contract's ``run(mode, seeds, out_dir)`` (plus ``overrides``)."""
        return execute(cls(), mode, seeds, out_dir, overrides)


def _seeds(mode: str, seeds: Sequence[int] | None, settings: Settings) -> list[int]:
    if seeds is None and settings.seeds is not None:
        seeds = settings.seeds
    return resolve_seeds(mode, seeds if seeds is not None else DEFAULT_SEEDS[mode])


def execute(repro: Reproduction[Any, Any], mode: str, seeds: Sequence[int] | None, out_dir: Path | str,
            overrides: Mapping[str, Any] | None = None) -> ReproResult:
    """Run ``repro`` in ``mode``: everything around its declarations (see the module docstring)."""
    mode = validate_mode(mode)
    settings = type(repro).settings_for(mode, overrides)
    seed_list = _seeds(mode, seeds, settings)
    out = ensure_writable(out_dir)
    t0, c0 = time.perf_counter(), time.process_time()
    with _threads(repro.threads), _global_generators() as reseed, repro.running():
        per_seed: dict[int, Any] = {}
        for s in seed_list:
            reseed(global_seed(repro.id, f"seed={s}"))
            per_seed[s] = repro.measure(settings, s)
        records: Records[Any] = Records(seed_list, per_seed)
        reseed(global_seed(repro.id, "joint:" + ",".join(map(str, seed_list))))
        records.joint = repro.measure_joint(settings, records)
        table = repro.table(settings, records)
        pre = repro.preconditions(settings, records)
        checks = repro.checks(settings, records)
        figures = repro.figures(settings, records, out)
        notes = repro.notes(settings, records)
        config = repro.config(settings, records)
        extra = repro.extra(settings, records)
    config = {**config, "settings": settings.to_json()}
    result = ReproResult(id=repro.id, mode=mode, seeds=seed_list, claim=repro.claim, table=table, checks=checks,
                         figures=list(figures), notes=notes, config=config, extra=extra, preconditions=list(pre),
                         overrides=type(repro).settings[mode].canonical_overrides(overrides),
                         environment=environment(seed_list))
    result.wall_time_s = time.perf_counter() - t0
    result.cpu_time_s = time.process_time() - c0
    result.save(out)
    return result
