"""Save and load compressed models; read checkpoints block by block.

Directory format of a compressed model (written atomically: the directory appears only complete)::

    out/
      config.json                 the transformers config of the base model (when it has one)
      model.safetensors           the compressed model's state dict (LowRankLinear: *.down.weight,
                                  *.up.weight, *.up.bias), with per-tensor SHA-256 digests in the header
      tokenizer files             when a tokenizer is given (``save_compressed(..., tokenizer=)``)
      rankwise_compression.json   {"format": "rankwise-compressed", "version": 2, "method", "architecture",
                                   "architecture_module", "base_fingerprint", "layers": {name: {"in", "out",
                                   "rank", "bias", "dtype"}}, "params", "report",
                                   "files": {name: sha256}}

``files`` holds the SHA-256 of every other file of the directory except the safetensors weights
(which carry per-tensor digests): ``config.json``, the tokenizer files, the shard index. Loading
checks them, so an edited ``config.json`` (``num_attention_heads``, ``hidden_act``,
``layer_norm_eps``, ...) or tokenizer raises :class:`~rankwise.core.errors.ArtifactError` instead of
building a different model. Directories of format version 1 (rankwise before the digests) carry no
``files``: they load, with a logged warning that their config and tokenizer are not covered.

Everything (weights, config, tokenizer, metadata) is written into a hidden temporary sibling
``.<name>.XXXXXXXX.tmp`` that is renamed into place in one step; ``overwrite`` moves the previous
directory aside as ``.<name>.XXXXXXXX.old`` and deletes it after the rename. A run killed while
writing leaves such siblings behind; the next write to the same directory deletes the temporary
ones whose writer process is gone (a marker file inside records it) and an ``.old`` one whose
directory exists, and logs a warning for any other it cannot prove stale.

:func:`~rankwise.compress.pipeline.compress_checkpoint` writes the same format with one shard per
block (``model-00001-of-000NN.safetensors``, the last shard holding the non-block tensors) and a
``model.safetensors.index.json`` (the Hugging Face ``weight_map`` layout).

:func:`load_compressed` rebuilds the model: the architecture from ``config.json`` (parameters on the
meta device, no random initialisation), every compressed layer replaced by a ``LowRankLinear`` of the
recorded rank, then the saved tensors assigned (shapes, dtypes, names and digests checked; nothing is
unpickled). The loaded model's outputs are bit-identical to the saved model's. Models that are not
``transformers`` models load into a fresh instance the caller passes (``model=``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.base import CompressionReport
from rankwise.core import io
from rankwise.core.errors import ArtifactError
from rankwise.core.layers import LowRankLinear
from rankwise.core.surgery import count_parameters, replace_module

Tensor = torch.Tensor

__all__ = ["save_compressed", "load_compressed", "read_compression_metadata", "build_skeleton",
           "CheckpointReader", "ShardWriter", "param_entries", "fingerprint_from_samples", "check_output_dir",
           "verify_files", "is_compressed_dir", "META_FILE", "WEIGHTS_FILE", "INDEX_FILE"]

log = logging.getLogger(__name__)

FORMAT = "rankwise-compressed"
VERSION = 2  # 2: "files" digests (config.json, tokenizer, index) in the metadata
META_FILE = "rankwise_compression.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------
# skeletons with parameters on the meta device


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers is moved to the meta device (buffers stay real).

    Construction allocates each parameter with ``torch.empty`` (no page is touched) and immediately
    replaces it by a meta tensor, so building a large model costs no memory and no initialisation.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            self._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _config_dtype(config: Any) -> torch.dtype | None:
    d = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else None


def build_skeleton(config: Any, model_class: type | None = None) -> nn.Module:
    """A ``transformers`` model of ``config``'s architecture with every parameter on the meta device (eval mode).

    ``model_class`` defaults to ``transformers.<config.architectures[0]>``; parameters take the
    config's dtype when it states one.
    """
    import transformers

    cls = model_class
    if cls is None:
        archs = getattr(config, "architectures", None) or []
        if not archs:
            raise ArtifactError("the config names no architecture (config.architectures is empty); pass model_class=")
        cls = getattr(transformers, archs[0], None)
        if cls is None:
            raise ArtifactError(f"transformers has no class {archs[0]!r} (config.architectures); pass model_class=")
    try:
        with params_on_meta():
            model = cls(config)
    except Exception as e:  # a config that does not fit the class (edited, or another architecture's)
        raise ArtifactError(f"cannot build {getattr(cls, '__name__', cls)} from this config "
                            f"({type(e).__name__}: {' '.join(str(e).split())})") from e
    dt = _config_dtype(config)
    if dt is not None:
        for mod in model.modules():
            for n, p in list(mod._parameters.items()):
                if p is not None and p.is_floating_point() and p.dtype != dt:
                    mod._parameters[n] = nn.Parameter(p.to(dt), requires_grad=p.requires_grad)
    return model.eval()


def param_entries(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of the model's base parameters, as :func:`rankwise.core.io.model_fingerprint` sees them."""
    return [(n, tuple(p.shape), p.dtype) for n, p, _ in io.base_parameters(model)]


def fingerprint_from_samples(entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                             samples: Mapping[str, Tensor]) -> str:
    """:func:`rankwise.core.io.model_fingerprint` computed from recorded value samples instead of a live model.

    ``entries`` from :func:`param_entries` (taken while the parameters were the base ones), ``samples``
    ``{name: io.value_sample(param)}`` recorded when each parameter was materialised. Lets a model that
    is never whole in memory get the fingerprint its loaded version would have.
    """
    h = hashlib.sha256(io._FINGERPRINT_TAG)
    for name, shape, dtype in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}|{tuple(shape)}|{str(dtype)}\n".encode())
        if name not in samples:
            raise ArtifactError(f"no value sample recorded for parameter {name!r}; cannot fingerprint the base model")
        h.update(io._raw_bytes(samples[name].to(dtype)))
    return "sha256:" + h.hexdigest()


# ----------------------------------------------------------------------------------------------
# reading a checkpoint piece by piece


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor key -> shard file) of a sharded checkpoint's index file."""
    wm = io.read_json(index).get("weight_map")
    if not isinstance(wm, dict):
        raise ArtifactError(f"{index}: no weight_map")
    return wm


class CheckpointReader:
    """Lazy access to the tensors of a ``save_pretrained`` directory (safetensors, single file or sharded)."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        if not d.is_dir():
            raise ArtifactError(f"{d}: no such model directory")
        if not (d / "config.json").is_file():
            raise ArtifactError(f"{d}: no config.json (expected a save_pretrained directory)")
        self.dir = d
        self.config = read_config(d)
        self.key_file: dict[str, Path] = {}
        index = d / INDEX_FILE
        if index.is_file():
            for k, f in _weight_map(index).items():
                self.key_file[k] = d / f
        elif (d / WEIGHTS_FILE).is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
                    for k in f.keys():
                        self.key_file[k] = d / WEIGHTS_FILE
            except Exception as e:
                raise ArtifactError(f"{d / WEIGHTS_FILE}: corrupt safetensors file ({e})") from e
        else:
            raise ArtifactError(f"{d}: no model.safetensors (or sharded index); only safetensors checkpoints are read "
                                "(pickled pytorch_model.bin files are never loaded)")
        self._handles: dict[Path, Any] = {}

    def _source_key(self, model: nn.Module, name: str) -> str | None:
        if name in self.key_file:
            return name
        prefix = getattr(model, "base_model_prefix", "") or ""
        if prefix:
            if f"{prefix}.{name}" in self.key_file:
                return f"{prefix}.{name}"
            if name.startswith(prefix + ".") and name[len(prefix) + 1:] in self.key_file:
                return name[len(prefix) + 1:]
        return None

    def get(self, key: str) -> Tensor:
        from safetensors import safe_open

        path = self.key_file[key]
        try:
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(key)
        except Exception as e:
            raise ArtifactError(f"{path}: cannot read tensor {key!r} ({e})") from e
        # Not copied: the tensor is backed by the shard's file mapping, so its pages are clean page cache
        # that the kernel can drop under memory pressure (a cgroup cap), not anonymous memory. Each live
        # tensor keeps a mapping of its whole shard, which counts against an address-space cap
        # (RLIMIT_DATA), not against memory in use (benchmarks/large_checkpoint.py: copies made the 2 GB
        # run exceed a 1 GB cgroup cap that the mapped tensors stay under).
        return t

    def _owners(self, model: nn.Module, predicate: Callable[[str], bool]
                ) -> dict[int, list[tuple[nn.Module, str, str]]]:
        owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for mname, mod in model.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                full = f"{mname}.{pname}" if mname else pname
                owners.setdefault(id(p), []).append((mod, pname, full))
        return {k: v for k, v in owners.items() if any(predicate(full) for _, _, full in v)}

    def materialize(self, model: nn.Module, predicate: Callable[[str], bool],
                    samples: dict[str, Tensor] | None = None) -> list[str]:
        """Load the parameters whose name satisfies ``predicate`` (tied copies included) and the
        persistent buffers found in the checkpoint. Returns the parameter names loaded."""
        loaded: list[str] = []
        for _, group in self._owners(model, predicate).items():
            mod0, pname0, _ = group[0]
            old = mod0._parameters[pname0]
            key = next((k for k in (self._source_key(model, full) for _, _, full in group) if k is not None), None)
            if key is None:
                raise ArtifactError(f"{self.dir}: the checkpoint has no tensor for parameter(s) "
                                    f"{[full for _, _, full in group]}")
            t = self.get(key)
            if tuple(t.shape) != tuple(old.shape):
                raise ArtifactError(f"{self.dir}: tensor {key!r} has shape {tuple(t.shape)}, the model expects "
                                    f"{tuple(old.shape)}")
            new = nn.Parameter(t.to(old.dtype).contiguous(), requires_grad=False)
            for mod, pname, full in group:
                mod._parameters[pname] = new
                loaded.append(full)
                if samples is not None and full not in samples:
                    samples[full] = io.value_sample(new)
        for mname, mod in model.named_modules():
            for bname, b in mod._buffers.items():
                full = f"{mname}.{bname}" if mname else bname
                if b is None or bname in mod._non_persistent_buffers_set or not predicate(full):
                    continue
                key = self._source_key(model, full)
                if key is not None:
                    t = self.get(key)
                    if tuple(t.shape) == tuple(b.shape):
                        mod._buffers[bname] = t.to(b.dtype).contiguous()
        return loaded

    @staticmethod
    def release(model: nn.Module, names: Sequence[str] | None = None, module: nn.Module | None = None) -> None:
        """Move parameters back to the meta device (buffers stay): those named, or all of ``module``."""
        wanted = None if names is None else set(names)
        root = module if module is not None else model
        done: dict[int, nn.Parameter] = {}  # keeps tied parameters tied
        for mname, mod in root.named_modules(remove_duplicate=False):
            for pname, p in list(mod._parameters.items()):
                if p is None or p.is_meta:
                    continue
                full = f"{mname}.{pname}" if mname else pname
                if wanted is None or full in wanted or id(p) in done:
                    if id(p) not in done:
                        done[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                    mod._parameters[pname] = done[id(p)]

    def read_nonblock(self, model: nn.Module, predicate: Callable[[str], bool]) -> dict[str, Tensor]:
        """State-dict entries (parameters and persistent buffers) whose name satisfies ``predicate``,
        read from the checkpoint (buffers not in it: the model's own values), in the model's dtypes."""
        out: dict[str, Tensor] = {}
        sd = model.state_dict(keep_vars=True)
        aliases: dict[int, list[str]] = {}
        for k, v in sd.items():
            aliases.setdefault(id(v), []).append(k)
        for k, v in sd.items():
            if not predicate(k):
                continue
            key = next((s for s in (self._source_key(model, a) for a in [k] + aliases[id(v)]) if s is not None), None)
            if key is not None:
                t = self.get(key).to(v.dtype).contiguous()
            elif not v.is_meta:
                t = v.detach().clone()
            else:
                raise ArtifactError(f"{self.dir}: the checkpoint has no tensor {k!r}")
            out[k] = t
        return out


# ----------------------------------------------------------------------------------------------
# writing


def _layers_of(model: nn.Module) -> dict[str, dict[str, Any]]:
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, LowRankLinear):
            out[n] = {"in": m.in_features, "out": m.out_features, "rank": m.rank, "bias": m.up.bias is not None,
                      "dtype": str(m.up.weight.dtype).replace("torch.", "")}
    return out


def _metadata(model: nn.Module, report: CompressionReport | None, fingerprint: str | None,
              params: int, files: Mapping[str, str]) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION,
        "method": report.method if report is not None else None,
        "architecture": type(model).__name__, "architecture_module": type(model).__module__,
        "base_fingerprint": fingerprint,
        "layers": _layers_of(model),
        "params": params,
        "params_before": report.params_before if report is not None else None,
        "report": report.to_json() if report is not None else None,
        "files": dict(sorted(files.items())),
    }


def _write_config(model: nn.Module, folder: Path, config: Any = None) -> bool:
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained") and hasattr(cfg, "to_json_string"):
        cfg.save_pretrained(str(folder))
        return True
    return False


def _write_tokenizer(tokenizer: Any, folder: Path) -> None:
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer must have save_pretrained (a transformers tokenizer), got {type(tokenizer).__name__}")
    try:
        tokenizer.save_pretrained(str(folder))
    except Exception as e:
        raise ArtifactError(f"cannot save the tokenizer ({type(e).__name__}: {' '.join(str(e).split())})") from e


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of the files the metadata covers: all but the weights (own digests), the metadata, the marker."""
    return {p.name: _sha256_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in (META_FILE, io.WRITER_MARKER) and not p.name.endswith(".safetensors")}


clean_stale_siblings = io.clean_stale_siblings  # public here since format version 2


def check_output_dir(directory: str | Path, *, overwrite: bool = False) -> Path:
    """Check, before any work, that ``directory`` can be written: not a file, empty or ``overwrite``, and
    the nearest existing parent writable. Raises :class:`~rankwise.core.errors.ArtifactError` otherwise."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ArtifactError(f"cannot write {d}: a file of that name exists")
    if d.is_dir() and any(d.iterdir()) and not overwrite:
        raise ArtifactError(f"cannot write {d}: the directory exists and is not empty (pass overwrite=True, "
                            "--overwrite on the command line, to replace it)")
    anc = d.absolute().parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ArtifactError(f"cannot write {d}: {anc} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rankwise-probe.", dir=anc))
    except OSError as e:
        raise ArtifactError(f"cannot write {d}: directory {anc} is not writable ({e.strerror or e})") from None
    return d


def save_compressed(model: nn.Module, directory: str | Path, report: CompressionReport | None = None, *,
                    base_fingerprint: str | None = None, overwrite: bool = False, tokenizer: Any = None) -> Path:
    """Write a compressed model to ``directory`` (config, safetensors weights, tokenizer, rankwise metadata),
    atomically: everything goes into a temporary sibling that is renamed into place in one step.

    ``base_fingerprint`` defaults to the one :func:`~rankwise.compress.pipeline.compress` recorded in
    ``report.extra["base_fingerprint"]``. ``tokenizer`` (anything with ``save_pretrained``) is saved
    with the model, so that the directory is a complete ``--model`` for the other commands. An existing
    non-empty directory raises :class:`~rankwise.core.errors.ArtifactError` unless ``overwrite``.
    Leftovers of an earlier killed write are cleaned up first (see the module docstring). Returns the
    directory.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if report is not None and not isinstance(report, CompressionReport):
        raise TypeError(f"report must be a CompressionReport, got {type(report).__name__}")
    layers = _layers_of(model)
    if not layers:
        raise ValueError("the model has no LowRankLinear layer: compress it first (rankwise.compress.compress)")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("the model has parameters on the meta device; cannot save it")
    fp = base_fingerprint or (report.extra.get("base_fingerprint") if report is not None else None)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    directory = Path(directory)
    with io.atomic_dir(directory, overwrite=overwrite) as tmp:
        _write_config(model, tmp)
        if tokenizer is not None:
            _write_tokenizer(tokenizer, tmp)
        io.save_tensors(tmp / WEIGHTS_FILE, sd, metadata={"format": FORMAT, "version": VERSION})
        io.write_json(tmp / META_FILE, _metadata(model, report, fp, count_parameters(model), _file_digests(tmp)))
    return directory


class ShardWriter:
    """Writes a compressed checkpoint shard by shard into a temporary directory, renamed in place at the end."""

    def __init__(self, directory: str | Path, n_shards: int, overwrite: bool = False):
        self.directory = Path(directory)
        self.n = n_shards
        self.overwrite = overwrite
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self._stack: contextlib.ExitStack | None = None
        self.tmp: Path | None = None

    def __enter__(self) -> "ShardWriter":
        self._stack = contextlib.ExitStack()
        self.tmp = self._stack.enter_context(io.atomic_dir(self.directory, overwrite=self.overwrite))
        return self

    def __exit__(self, *exc: Any) -> bool:
        assert self._stack is not None
        return bool(self._stack.__exit__(*exc))

    def shard_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{self.n:05d}.safetensors"

    def write_block(self, i: int, tensors: Mapping[str, Tensor]) -> None:
        assert self.tmp is not None
        name = self.shard_name(i)
        clean = {k: v.detach() for k, v in tensors.items()}
        bad = [k for k, v in clean.items() if v.is_meta]
        if bad:
            raise ArtifactError(f"cannot write shard {name}: tensors {bad[:5]} are not materialised")
        io.save_tensors(self.tmp / name, clean, metadata={"format": FORMAT, "version": VERSION})
        for k, v in clean.items():
            self.weight_map[k] = name
            self.total += v.numel() * v.element_size()

    def finish(self, model: nn.Module, report: CompressionReport, *, fingerprint: str | None, config: Any,
               tokenizer: Any = None) -> None:
        assert self.tmp is not None
        io.write_json(self.tmp / INDEX_FILE, {"metadata": {"total_size": self.total, "format": FORMAT},
                                             "weight_map": dict(sorted(self.weight_map.items()))})
        _write_config(model, self.tmp, config)
        if tokenizer is not None:
            _write_tokenizer(tokenizer, self.tmp)
        io.write_json(self.tmp / META_FILE, _metadata(model, report, fingerprint, report.params_after,
                                                      _file_digests(self.tmp)))


# ----------------------------------------------------------------------------------------------
# loading


def read_config(directory: str | Path) -> Any:
    """The transformers config of a model directory; an empty, garbled or unknown ``config.json`` raises
    :class:`~rankwise.core.errors.ArtifactError` naming it (transformers would raise ``OSError``/``ValueError``)."""
    from transformers import AutoConfig

    d = Path(directory)
    path = d / "config.json"
    if not path.is_file():
        raise ArtifactError(f"{d}: no config.json (expected a save_pretrained directory)")
    io.read_json(path)  # empty, not JSON, not an object: one clear line
    try:
        return AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, TypeError, ... for bad configs
        raise ArtifactError(f"{path}: not a valid transformers config ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]})") from e


def read_compression_metadata(directory: str | Path) -> dict[str, Any]:
    """The ``rankwise_compression.json`` of a compressed-model directory, validated."""
    d = Path(directory)
    if not d.is_dir():
        raise ArtifactError(f"{d}: no such directory")
    meta = io.read_json(d / META_FILE)
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{d / META_FILE}: not a rankwise compressed model (format {meta.get('format')!r})")
    v = meta.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ArtifactError(f"{d / META_FILE}: malformed format version {v!r}")
    if v > VERSION:
        raise ArtifactError(f"{d / META_FILE}: format version {v!r} is newer than this rankwise reads ({VERSION})")
    files = meta.get("files")
    if v >= 2:
        if not isinstance(files, dict) or not all(
                isinstance(k, str) and _SAFE_NAME.fullmatch(k) and isinstance(h, str) and _HEX64.fullmatch(h)
                for k, h in files.items()):
            raise ArtifactError(f"{d / META_FILE}: malformed or missing file digests ('files')")
    layers = meta.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ArtifactError(f"{d / META_FILE}: no compressed layers listed")
    for n, spec in layers.items():
        if not isinstance(spec, dict) or not all(isinstance(spec.get(k), int) and spec[k] > 0
                                                 for k in ("in", "out", "rank")):
            raise ArtifactError(f"{d / META_FILE}: layer {n!r} has a malformed entry {spec!r}")
        if spec["rank"] > min(spec["in"], spec["out"]):
            raise ArtifactError(f"{d / META_FILE}: layer {n!r} has rank {spec['rank']} > min(in, out)")
    return meta


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_compressed_dir(directory: str | Path) -> bool:
    """``directory`` holds a rankwise compressed model (its metadata file), valid or not."""
    return (Path(directory) / META_FILE).is_file()


def verify_files(directory: str | Path, meta: Mapping[str, Any] | None = None) -> None:
    """Check the files the metadata's digests cover (``config.json``, tokenizer files, shard index).

    Raises :class:`~rankwise.core.errors.ArtifactError` naming the first file that is missing or differs,
    or a ``config.json`` that appeared after saving. Directories of format version 1 have no digests:
    a warning is logged and nothing is checked.
    """
    d = Path(directory)
    meta = read_compression_metadata(d) if meta is None else meta
    files = meta.get("files")
    if meta.get("version", 1) < 2 or files is None:
        log.warning("%s was written by an older rankwise (format version %s): its config.json and tokenizer "
                    "files are not covered by an integrity check; save it again to cover them", d,
                    meta.get("version"))
        return
    for name, digest in sorted(files.items()):
        f = d / name
        if not f.is_file():
            raise ArtifactError(f"{f}: missing (the compressed model was saved with it)")
        if _sha256_file(f) != digest:
            raise ArtifactError(f"{f}: modified after the compressed model was saved (its SHA-256 differs from "
                                f"the one in {META_FILE}); restore it or compress again")
    if (d / "config.json").is_file() and "config.json" not in files:
        raise ArtifactError(f"{d / 'config.json'}: added after the compressed model was saved (it was saved "
                            "without one); remove it, or pass model= to load into your own instance")


def _load_weights(d: Path, expect: Mapping[str, Any]) -> dict[str, Tensor]:
    index = d / INDEX_FILE
    if index.is_file():
        wm = _weight_map(index)
        files = sorted(set(wm.values()))
        out: dict[str, Tensor] = {}
        for f in files:
            if "/" in f or "\\" in f or f.startswith("."):
                raise ArtifactError(f"{index}: bad shard name {f!r}")
            part, _ = io.load_tensors(d / f, {k: expect[k] for k in wm if wm[k] == f and k in expect}, strict=False)
            out.update(part)
        extra = [k for k in out if k not in expect]
        missing = [k for k in expect if k not in out]
        if extra or missing:
            raise ArtifactError(f"{d}: weights do not fit the model (missing {missing[:5]}, unexpected {extra[:5]})")
        return out
    tensors, _ = io.load_tensors(d / WEIGHTS_FILE, expect, strict=True)
    return tensors


def load_compressed(directory: str | Path, model: nn.Module | None = None, *,
                    model_class: type | None = None) -> nn.Module:
    """Rebuild a compressed model saved by :func:`save_compressed` (or ``compress_checkpoint``).

    Without ``model`` the architecture is built from ``config.json`` (``transformers`` models; the
    class recorded in the metadata, or ``model_class``). With ``model`` (any ``nn.Module`` of the base
    architecture, e.g. a freshly constructed one), that instance is restructured in place and its
    weights replaced. Returns the model in eval mode; raises
    :class:`~rankwise.core.errors.ArtifactError` on a missing, corrupt or mismatching artefact.
    """
    d = Path(directory)
    meta = read_compression_metadata(d)
    verify_files(d, meta)
    if model is None:
        if not (d / "config.json").is_file():
            raise ArtifactError(f"{d}: no config.json; this model is not a transformers model, pass model= (a fresh "
                                f"instance of {meta.get('architecture')!r}) to load into")
        config = read_config(d)
        cls = model_class
        if cls is None:
            import transformers

            arch, mod = meta.get("architecture"), str(meta.get("architecture_module", ""))
            cls = getattr(transformers, arch, None) if mod.startswith("transformers") else None
            if cls is None:
                raise ArtifactError(f"{d}: architecture {arch!r} ({mod}) is not a transformers class; pass model=")
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise ArtifactError(f"{d}: architecture {arch!r} is not a model class; pass model=")
        model = build_skeleton(config, cls)
    elif not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name, spec in meta["layers"].items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ArtifactError(f"{d}: compressed layer {name!r} does not exist in the model") from None
        if isinstance(old, LowRankLinear):
            old_in, old_out = old.in_features, old.out_features
        elif isinstance(old, nn.Linear):
            old_in, old_out = old.in_features, old.out_features
        else:
            raise ArtifactError(f"{d}: layer {name!r} is a {type(old).__name__}, expected an nn.Linear")
        if (old_in, old_out) != (spec["in"], spec["out"]):
            raise ArtifactError(f"{d}: layer {name!r} is {old_in} -> {old_out} in the model but {spec['in']} -> "
                                f"{spec['out']} in the artefact")
        dtype = getattr(torch, str(spec.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise ArtifactError(f"{d}: layer {name!r} has an unknown dtype {spec.get('dtype')!r}")
        new = LowRankLinear(spec["in"], spec["out"], spec["rank"], bias=bool(spec.get("bias", True)),
                            device="meta", dtype=dtype)
        new.requires_grad_(False)
        replace_module(model, name, new)
    expect = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    tensors = _load_weights(d, expect)
    model.load_state_dict(tensors, strict=True, assign=True)
    left = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ArtifactError(f"{d}: tensors {left[:5]} were not restored")
    return model.eval()
