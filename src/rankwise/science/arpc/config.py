"""ARPC's configuration: the scale schedule, the quantizer, the group masks and the AR model's size."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from rankwise.core.validate import check_choice, check_int, check_number

__all__ = ["ARPCConfig", "QUANTIZERS", "default_groups"]

QUANTIZERS = ("vq", "bitplane")
_MAX_SCALES = 15  # the header stores the number of sent scales in four bits


def default_groups(bits: int, num_scales: int) -> tuple[int, ...]:
    """Bit planes kept per scale when the spec is silent: ``G`` at the coarsest scale falling linearly
    to ``ceil(G / 4)`` at the finest (spec §2, "g_k decreasing linearly from G to G/4"), rounded."""
    lo = max(1, math.ceil(bits / 4))
    if num_scales == 1:
        return (bits,)
    return tuple(int(round(bits + (lo - bits) * k / (num_scales - 1))) for k in range(num_scales))


@dataclass(frozen=True)
class ARPCConfig:
    """What an ARPC codec is (every field enters the model hash that each bitstream header carries).

    ``scales``: side lengths of the K square token maps, strictly increasing; the last one is the
    tile side ``T`` (the codec works on pixels, ``f = x``, so scale K is the full tile). An image is
    coded as ``T x T`` tiles. ``channels``: 1 (grey) or 3 (RGB), coded as separate token channels of
    one position. ``quantizer``: ``"vq"`` (a scalar codebook of ``codebook_size`` entries per scale,
    learned by 1-D k-means on the training residuals) or ``"bitplane"`` (a uniform ``bits``-bit
    quantizer of the residual per scale; scale k keeps only its ``groups[k]`` most significant bit
    planes, the group mask of spec §2, so its alphabet has ``2 ** groups[k]`` symbols).
    ``groups``: None gives :func:`default_groups`. ``ar_*``: the next-scale transformer (layers,
    width, heads, MLP expansion). ``prob_floor``: every symbol of a scale's alphabet gets at least
    this probability before coding (mixed with the uniform distribution), so an occurring symbol
    never has probability 0.
    """

    scales: tuple[int, ...] = (1, 2, 4, 8, 16)
    channels: int = 1
    quantizer: str = "vq"
    codebook_size: int = 16
    bits: int = 4
    groups: tuple[int, ...] | None = None
    ar_layers: int = 2
    ar_width: int = 64
    ar_heads: int = 4
    ar_mlp: int = 4
    prob_floor: float = 2.0 ** -16
    kmeans_iters: int = 50

    def __post_init__(self) -> None:
        scales = self.scales
        if not isinstance(scales, (tuple, list)) or not scales:
            raise ValueError(f"ARPCConfig.scales must be a non-empty tuple of ints, got {scales!r}")
        for s in scales:
            check_int("ARPCConfig.scales[k]", s, 1, 256)
        if any(b <= a for a, b in zip(scales, scales[1:])):
            raise ValueError(f"ARPCConfig.scales must be strictly increasing, got {tuple(scales)}")
        if len(scales) > _MAX_SCALES:
            raise ValueError(f"ARPCConfig.scales must hold at most {_MAX_SCALES} scales, got {len(scales)}")
        object.__setattr__(self, "scales", tuple(int(s) for s in scales))
        check_choice("ARPCConfig.channels", self.channels, (1, 3))
        check_choice("ARPCConfig.quantizer", self.quantizer, QUANTIZERS)
        check_int("ARPCConfig.codebook_size", self.codebook_size, 2, 256)
        check_int("ARPCConfig.bits", self.bits, 1, 8)
        if self.groups is not None:
            g = self.groups
            if not isinstance(g, (tuple, list)) or len(g) != len(scales):
                n = len(g) if isinstance(g, (tuple, list)) else type(g).__name__
                raise ValueError(f"ARPCConfig.groups must hold one entry per scale ({len(scales)}), got {n}: {g!r}")
            for v in g:
                check_int("ARPCConfig.groups[k]", v, 1, self.bits)
            object.__setattr__(self, "groups", tuple(int(v) for v in g))
        check_int("ARPCConfig.ar_layers", self.ar_layers, 1, 16)
        check_int("ARPCConfig.ar_width", self.ar_width, 8, 1024)
        check_int("ARPCConfig.ar_heads", self.ar_heads, 1, 64)
        if self.ar_width % self.ar_heads:
            raise ValueError(f"ARPCConfig.ar_width must be divisible by ar_heads={self.ar_heads}, "
                             f"got {self.ar_width}")
        check_int("ARPCConfig.ar_mlp", self.ar_mlp, 1, 16)
        check_number("ARPCConfig.prob_floor", self.prob_floor, 2.0 ** -20, 1e-2)
        check_int("ARPCConfig.kmeans_iters", self.kmeans_iters, 1, 10_000)
        if self.prob_floor * self.max_vocab >= 0.5:
            raise ValueError(f"ARPCConfig.prob_floor must be < 0.5 / alphabet size ({self.max_vocab}), "
                             f"got {self.prob_floor}")

    # ---- derived quantities ---------------------------------------------------------------------
    @property
    def num_scales(self) -> int:
        return len(self.scales)

    @property
    def tile(self) -> int:
        """The tile side ``T`` (the finest scale)."""
        return self.scales[-1]

    @property
    def group_schedule(self) -> tuple[int, ...]:
        """Bit planes kept per scale (bitplane quantizer)."""
        return self.groups if self.groups is not None else default_groups(self.bits, self.num_scales)

    def vocab(self, k: int) -> int:
        """The alphabet size of scale ``k`` (0-based)."""
        if self.quantizer == "vq":
            return self.codebook_size
        return 2 ** self.group_schedule[k]

    @property
    def max_vocab(self) -> int:
        return self.codebook_size if self.quantizer == "vq" else 2 ** max(self.group_schedule)

    @property
    def positions(self) -> int:
        """Positions of one tile's token sequence, ``sum_k s_k^2`` (341 for 1, 2, 4, 8, 16)."""
        return sum(s * s for s in self.scales)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["scales"] = list(self.scales)
        d["groups"] = list(self.groups) if self.groups is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ARPCConfig":
        if not isinstance(d, dict):
            raise ValueError(f"ARPCConfig.from_dict needs a dict, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ARPCConfig has no fields {unknown}")
        d = dict(d)
        for key in ("scales", "groups"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of the config."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()
