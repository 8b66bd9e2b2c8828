"""Identification with PAVE specs: cosine similarity, the score shown to users, the ranking (spec §3-§4).

* ``sim(u, k) = cos(tau_u, tau_k)`` of the flattened specs;
* ``score = 100 * softmax([cos / T, 0])[0] = 100 * sigmoid(cos / T)`` (T = 0.1), so ``score(0) = 50``;
* ``dist = (1 - cos) / 2`` in ``[0, 1]``.

Why the B-vectors suffice (spec §3): with the shared frozen A, ``Delta W = s B A`` and
``<B_u A, B_k A>_F = trace(B_u (A A^T) B_k^T)`` (:func:`trace_inner`); for a random A with ``d_in >> r``,
``A A^T`` is close to ``c I``, so ``cos(B_u, B_k)`` approximates ``cos(Delta W_u, Delta W_k)``
(:func:`delta_cosine`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import torch

from rankwise.science.pave.spec import PaveSpec, check_comparable

__all__ = ["Identification", "Match", "cosine", "delta_cosine", "delta_inner", "distance", "identify", "score",
           "trace_inner"]

log = logging.getLogger(__name__)
SpecLike = Union[PaveSpec, torch.Tensor]


def _vec(x: SpecLike, what: str) -> torch.Tensor:
    v = x.vector() if isinstance(x, PaveSpec) else torch.as_tensor(x).detach().reshape(-1).to(torch.float64)
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{what} holds NaN or inf")
    if float(torch.linalg.vector_norm(v)) == 0.0:
        raise ValueError(f"{what} has zero norm (no training step changed it), so its cosine is undefined; "
                         "recompute it with steps >= 1 and a learning rate > 0")
    return v


def cosine(u: SpecLike, v: SpecLike, *, names: tuple[str, str] = ("first spec", "second spec")) -> float:
    """``cos(tau_u, tau_v)`` in float64; specs are checked comparable; a zero-norm spec raises ``ValueError``."""
    if isinstance(u, PaveSpec) and isinstance(v, PaveSpec):
        check_comparable(u, v, names)
    a, b = _vec(u, names[0]), _vec(v, names[1])
    if a.shape != b.shape:
        raise ValueError(f"{names[0]} has {a.numel()} numbers, {names[1]} {b.numel()}: not comparable")
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=0.0).clamp(-1.0, 1.0))


def score(cos: float, temperature: float = 0.1) -> float:
    """``100 * sigmoid(cos / T)``: 50 at cos = 0, increasing in cos."""
    if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    z = float(cos) / temperature
    return 100.0 / (1.0 + math.exp(-z)) if z >= 0 else 100.0 * math.exp(z) / (1.0 + math.exp(z))


def distance(cos: float) -> float:
    """``(1 - cos) / 2``, in ``[0, 1]`` for ``cos`` in ``[-1, 1]``."""
    return (1.0 - float(cos)) / 2.0


def trace_inner(b_u: torch.Tensor, b_k: torch.Tensor, a: torch.Tensor) -> float:
    """``trace(B_u (A A^T) B_k^T)`` (B: (out, r), A: (r, in)), in float64, without forming ``Delta W``."""
    bu, bk, a64 = b_u.double(), b_k.double(), a.double()
    return float(torch.trace(bu @ (a64 @ a64.T) @ bk.T))


def delta_inner(b_u: torch.Tensor, b_k: torch.Tensor, a: torch.Tensor) -> float:
    """``<B_u A, B_k A>_F`` from the explicitly formed ``Delta W`` (float64); equals :func:`trace_inner`."""
    return float(((b_u.double() @ a.double()) * (b_k.double() @ a.double())).sum())


def delta_cosine(b_u: Sequence[torch.Tensor], b_k: Sequence[torch.Tensor], a: Sequence[torch.Tensor]) -> float:
    """Cosine of the full-size updates ``concat_l vec(B_l A_l)`` of two specs (per-module lists)."""
    uk = sum(trace_inner(x, y, m) for x, y, m in zip(b_u, b_k, a))
    uu = sum(trace_inner(x, x, m) for x, m in zip(b_u, a))
    kk = sum(trace_inner(y, y, m) for y, m in zip(b_k, a))
    if uu <= 0 or kk <= 0:
        raise ValueError("a zero update has no cosine")
    return uk / math.sqrt(uu * kk)


@dataclass(frozen=True)
class Match:
    """One learnware of a ranking: its name, ``cosine`` to the user's spec, ``score`` and ``distance``."""

    name: str
    cosine: float
    score: float
    distance: float


@dataclass(frozen=True)
class Identification:
    """The result of :func:`identify`.

    Attributes:
        matches: every comparable learnware, highest cosine first (ties keep the input order).
        dropped: names whose similarity was not finite (logged as a warning).
        temperature: the T of the scores.
    """

    matches: list[Match]
    dropped: list[str] = field(default_factory=list)
    temperature: float = 0.1

    @property
    def best(self) -> Match:
        if not self.matches:
            raise ValueError("no learnware could be ranked")
        return self.matches[0]

    def names(self) -> list[str]:
        return [m.name for m in self.matches]

    def above(self, min_score: float) -> list[Match]:
        """The matches scoring at least ``min_score`` (a "no helpful model" threshold)."""
        return [m for m in self.matches if m.score >= min_score]


def identify(user: PaveSpec, learnwares: Mapping[str, PaveSpec] | Sequence[PaveSpec],
             temperature: float | None = None) -> Identification:
    """Rank ``learnwares`` by cosine similarity to the ``user`` spec, highest first (spec §4).

    ``learnwares``: ``{name: spec}`` or a sequence (named ``"0"``, ``"1"``, ...). Every learnware must be
    comparable with the user spec (same base model and spec space: ``ValueError`` naming both values),
    and no spec may have zero norm (``ValueError``). ``temperature`` defaults to the user spec's config.
    """
    if not isinstance(user, PaveSpec):
        raise TypeError(f"user must be a PaveSpec, got {type(user).__name__}")
    items = list(learnwares.items()) if isinstance(learnwares, Mapping) else [(str(i), s) for i, s in enumerate(learnwares)]
    if not items:
        raise ValueError("no learnware spec to compare with")
    t = float(user.config.get("temperature", 0.1)) if temperature is None else temperature
    _vec(user, "the user spec")
    out: list[Match] = []
    dropped: list[str] = []
    for name, spec in items:
        if not isinstance(spec, PaveSpec):
            raise TypeError(f"learnware {name!r} must be a PaveSpec, got {type(spec).__name__}")
        c = cosine(user, spec, names=("the user spec", f"learnware {name!r}"))
        if not math.isfinite(c):
            log.warning("dropping learnware %r: its similarity is not finite", name)
            dropped.append(name)
            continue
        out.append(Match(name, c, score(c, t), distance(c)))
    out.sort(key=lambda m: -m.cosine)
    return Identification(out, dropped, t)
