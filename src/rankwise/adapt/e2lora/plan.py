"""The E²LoRA plan: per module type, the layer intervals that share a factor and their ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rankwise.adapt.e2lora.config import SHARINGS, _pos_int
from rankwise.core import io
from rankwise.core.errors import ArtifactError


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------

@dataclass
class TypePlan:
    """The plan of one module type: its layers (by depth), the statistics and the partition.

    ``layers`` are module names ordered by depth; ``intervals`` hold positions into ``layers``;
    ``ranks[k]`` is the rank of interval ``k``; ``shape = (d_out, d_in)``. ``entropies``, ``similarity``,
    ``thresholds`` are None for a plan made without calibration (:func:`uniform_plan`).
    """

    key: str
    layers: list[str]
    shape: tuple[int, int]
    intervals: list[list[int]]
    ranks: list[int]
    entropies: list[float] | None = None
    similarity: list[list[float]] | None = None
    thresholds: list[float | None] | None = None
    interval_entropies: list[float] | None = None
    factors: list[float] | None = None

    def rank_of(self, pos: int) -> int:
        return self.ranks[self.interval_of(pos)]

    def interval_of(self, pos: int) -> int:
        for k, iv in enumerate(self.intervals):
            if pos in iv:
                return k
        raise KeyError(pos)

    def num_parameters(self, sharing: str = "lora") -> int:
        d_out, d_in = self.shape
        if sharing == "lora":
            return sum(r * (d_in + d_out) for r in self.ranks)
        return max(self.ranks) * d_in + sum(self.rank_of(p) * d_out for p in range(len(self.layers)))

    def validate(self) -> None:
        N = len(self.layers)
        flat = [i for iv in self.intervals for i in iv]
        if N == 0 or flat != list(range(N)) or any(not iv for iv in self.intervals):
            raise ValueError(f"type {self.key!r}: intervals {self.intervals} must be contiguous, disjoint and cover "
                             f"0..{N - 1}")
        if len(self.ranks) != len(self.intervals) or not all(_pos_int(r) for r in self.ranks):
            raise ValueError(f"type {self.key!r}: need one rank >= 1 per interval, got {self.ranks}")
        if len(self.shape) != 2 or not all(_pos_int(s) for s in self.shape):
            raise ValueError(f"type {self.key!r}: bad shape {self.shape}")


@dataclass
class E2LoRAPlan:
    """The one-shot E²LoRA plan of a model: one :class:`TypePlan` per module type (model order).

    ``sharing`` says how factors are shared (``"lora"``/``"sharelora"``); ``settings`` records the
    config fields that shaped the plan. :meth:`save` / :meth:`load` write / read it as JSON.
    """

    types: dict[str, TypePlan]
    sharing: str = "lora"
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def intervals(self) -> dict[str, list[list[int]]]:
        return {k: t.intervals for k, t in self.types.items()}

    @property
    def ranks(self) -> dict[str, list[int]]:
        return {k: t.ranks for k, t in self.types.items()}

    def num_parameters(self) -> int:
        """Trainable adapter parameters: ``sum_types sum_k r_k (d_in + d_out)`` for ``sharing="lora"``."""
        return sum(t.num_parameters(self.sharing) for t in self.types.values())

    def layer_names(self) -> list[str]:
        return [n for t in self.types.values() for n in t.layers]

    def validate(self) -> None:
        if self.sharing not in SHARINGS:
            raise ValueError(f"plan sharing must be one of {SHARINGS}, got {self.sharing!r}")
        if not self.types:
            raise ValueError("the plan holds no module type")
        seen: set[str] = set()
        for t in self.types.values():
            t.validate()
            dup = seen.intersection(t.layers)
            if dup:
                raise ValueError(f"layers {sorted(dup)[:3]} appear in more than one type")
            seen.update(t.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"sharing": self.sharing, "settings": dict(self.settings),
                "types": [{"key": t.key, "layers": list(t.layers), "shape": list(t.shape),
                           "intervals": [list(iv) for iv in t.intervals], "ranks": list(t.ranks),
                           "entropies": t.entropies, "similarity": t.similarity, "thresholds": t.thresholds,
                           "interval_entropies": t.interval_entropies, "factors": t.factors}
                          for t in self.types.values()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "E2LoRAPlan":
        try:
            types = {}
            for t in d["types"]:
                tp = TypePlan(key=str(t["key"]), layers=[str(n) for n in t["layers"]],
                              shape=(int(t["shape"][0]), int(t["shape"][1])),
                              intervals=[[int(i) for i in iv] for iv in t["intervals"]],
                              ranks=[int(r) for r in t["ranks"]], entropies=t.get("entropies"),
                              similarity=t.get("similarity"), thresholds=t.get("thresholds"),
                              interval_entropies=t.get("interval_entropies"), factors=t.get("factors"))
                types[tp.key] = tp
            plan = cls(types=types, sharing=str(d.get("sharing", "lora")), settings=dict(d.get("settings") or {}))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ArtifactError(f"malformed E²LoRA plan: {e!r}") from None
        try:
            plan.validate()
        except ValueError as e:
            raise ArtifactError(f"invalid E²LoRA plan: {e}") from None
        return plan

    def save(self, path: str | Path) -> Path:
        return io.write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "E2LoRAPlan":
        return cls.from_dict(io.read_json(Path(path)))
