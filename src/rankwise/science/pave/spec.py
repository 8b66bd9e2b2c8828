"""The PAVE specification as data: :class:`PaveSpec`, its safetensors file, and the comparability check.

A spec is ``tau(D)`` (spec §2-§3): per adapted module the trained ``lora_B`` (out, r) (B starts at zero,
so ``tau = vec(B)``; A is the frozen shared projection, reproducible from ``a_seed`` and the module name,
and is not stored), then the head's ``weight`` (C, H) and ``bias`` (C,). Its metadata holds the base
model's fingerprint (:func:`rankwise.core.io.model_fingerprint` of the model *before* the adapter was
attached), the full :class:`~rankwise.science.pave.config.PaveConfig` and what the fine-tune saw.

File format (one safetensors file written atomically by :func:`rankwise.core.io.save_tensors`): tensors
``"<module>.lora_B"``, ``"head.weight"``, ``"head.bias"``; metadata ``{"kind": "rankwise.pave_spec",
"version": 1, "config": {...}, "fingerprint": "sha256:...", "modules": [...], "info": {...}}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from rankwise.core import io
from rankwise.core.errors import ArtifactError
from rankwise.science.pave.config import SPACE_FIELDS, PaveConfig

__all__ = ["SPEC_KIND", "PaveSpec", "check_comparable"]

SPEC_KIND = "rankwise.pave_spec"
_VERSION = 1
_HEAD = ("head.weight", "head.bias")


@dataclass(eq=False)
class PaveSpec:
    """A PAVE specification: the flattened parameter change ``tau`` a dataset induces (spec §2).

    Attributes:
        tensors: ``{"<module>.lora_B": B (out, r), ..., "head.weight": (C, H), "head.bias": (C,)}`` in
            model order (the head last, when the config trains one).
        config: the :meth:`PaveConfig.to_dict` it was computed with.
        fingerprint: the base model's fingerprint (``"sha256:..."``), or None when unknown.
        info: what the fine-tune saw: ``n_examples``, ``steps``, ``final_loss`` (with the L1 term),
            ``final_ce`` (cross-entropy alone), ``losses`` (per step),
            ``seconds`` (wall), ``base_model`` (a name, when known).

    Construction checks the contents; a NaN or inf (a diverged fine-tune) raises ``ValueError``.
    """

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    fingerprint: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, dict) or not self.tensors:
            raise ValueError("PaveSpec.tensors must be a non-empty dict name -> tensor")
        if not isinstance(self.config, dict):
            raise ValueError(f"PaveSpec.config must be a dict, got {type(self.config).__name__}")
        try:
            PaveConfig.from_dict(self.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"PaveSpec.config is not a valid PaveConfig: {e}") from e
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise ValueError(f"PaveSpec.fingerprint must be a str or None, got {self.fingerprint!r}")
        r = int(self.config["rank"])
        for name, t in self.tensors.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"PaveSpec: {name!r} must be a floating-point tensor")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"PaveSpec: {name!r} holds NaN or inf (the fine-tune diverged; lower the "
                                 "learning rate)")
            if name.endswith(".lora_B") and (t.ndim != 2 or t.shape[1] != r):
                raise ValueError(f"PaveSpec: {name!r} has shape {tuple(t.shape)}, expected (out, rank={r})")
        if not self.modules():
            raise ValueError("PaveSpec: no '<module>.lora_B' tensor")

    # -- queries ------------------------------------------------------------------------------
    def modules(self) -> list[str]:
        """The adapted module names, in model order."""
        return [n[: -len(".lora_B")] for n in self.tensors if n.endswith(".lora_B")]

    @property
    def rank(self) -> int:
        return int(self.config["rank"])

    def num_parameters(self) -> int:
        """Numbers stored (the length of :meth:`vector`)."""
        return sum(t.numel() for t in self.tensors.values())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.tensors.items()}

    def vector(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``tau``: every tensor flattened and concatenated in order, shape ``(num_parameters,)``."""
        return torch.cat([t.detach().reshape(-1).to(dtype) for t in self.tensors.values()])

    def norm(self) -> float:
        """The Euclidean norm of :meth:`vector` (0 for a spec no training step changed)."""
        return float(torch.linalg.vector_norm(self.vector()))

    def scaled(self, c: float) -> "PaveSpec":
        """A copy with every tensor multiplied by ``c`` (the cosine is scale-invariant for ``c > 0``)."""
        return PaveSpec({n: t * c for n, t in self.tensors.items()}, dict(self.config), self.fingerprint,
                        dict(self.info))

    # -- files --------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write one safetensors file atomically (no partial file on failure); returns the path."""
        meta = {"kind": SPEC_KIND, "version": _VERSION, "config": self.config, "fingerprint": self.fingerprint,
                "modules": self.modules(), "info": _jsonable(self.info)}
        return io.save_tensors(path, {n: t.detach().contiguous() for n, t in self.tensors.items()}, meta)

    @classmethod
    def load(cls, path: str | Path) -> "PaveSpec":
        """Read a file written by :meth:`save` (checksums verified); other files raise ArtifactError."""
        meta = io.read_metadata(path)
        if meta.get("kind") != SPEC_KIND:
            what = meta.get("kind") or "no rankwise kind"
            raise ArtifactError(f"{path}: not a PAVE spec (its metadata says {what!r}); write specs with "
                                "`rankwise pave spec` or PaveSpec.save")
        if not isinstance(meta.get("version"), int) or meta["version"] > _VERSION:
            raise ArtifactError(f"{path}: PAVE spec version {meta.get('version')!r} is newer than this rankwise reads")
        tensors, meta = io.load_tensors(path)
        modules = meta.get("modules")
        names = [f"{m}.lora_B" for m in modules] if isinstance(modules, list) else None
        if names is None or not set(names) <= set(tensors):
            raise ArtifactError(f"{path}: tensors do not match the module list of its metadata")
        ordered = {n: tensors[n] for n in names}
        ordered.update({n: tensors[n] for n in _HEAD if n in tensors})
        extra = sorted(set(tensors) - set(ordered))
        if extra:
            raise ArtifactError(f"{path}: unexpected tensors {extra[:5]}")
        try:
            return cls(ordered, dict(meta.get("config") or {}), meta.get("fingerprint"), dict(meta.get("info") or {}))
        except ValueError as e:
            raise ArtifactError(f"{path}: {e}") from e


def _jsonable(info: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in info.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        elif isinstance(v, (list, tuple)):
            v = [None if isinstance(x, float) and not math.isfinite(x) else x for x in v]
        out[str(k)] = v
    return out


def check_comparable(a: PaveSpec, b: PaveSpec, names: tuple[str, str] = ("user spec", "learnware spec")) -> None:
    """Refuse to compare specs of different base models or spec spaces (``ValueError`` with both values).

    The base-model fingerprints (when both are known), the space fields of the config (rank, alpha,
    targets, layers, a_seed, classes, head) and the tensor names and shapes must agree.
    """
    na, nb = names
    if a.fingerprint is not None and b.fingerprint is not None and a.fingerprint != b.fingerprint:
        raise ValueError(f"{na} and {nb} were computed on different base models: fingerprints "
                         f"{a.fingerprint[:23]}... and {b.fingerprint[:23]}...; specs compare only on the same model")
    for k in SPACE_FIELDS:
        va, vb = a.config.get(k), b.config.get(k)
        if va != vb:
            raise ValueError(f"{na} and {nb} have different configs: {k} = {va!r} vs {vb!r}; recompute one "
                             "with the other's config")
    sa, sb = a.shapes(), b.shapes()
    if sa != sb:
        diff = sorted(set(sa) ^ set(sb)) or [n for n in sa if sa[n] != sb[n]]
        raise ValueError(f"{na} and {nb} hold different tensors or shapes (first differences: {diff[:3]}); "
                         "they were computed on different models")
