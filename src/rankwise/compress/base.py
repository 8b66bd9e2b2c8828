"""What every compression method shares: the per-layer method interface, ranks and the report.

A *layer method* turns one ``nn.Linear`` plus its calibration statistics into low-rank factors
``W ≈ A @ B`` (:class:`~rankwise.core.linalg.LowRankFactors`: ``B`` is ``r x n``, ``A`` is ``m x r``).
The pipeline (``compress/pipeline.py``) owns everything around it: choosing targets, collecting the
statistics the method asks for (``needs``), the order in which layers are compressed, the module
surgery, saving and reporting. Methods register under a short name that the ``compress`` verb and the
CLI accept (``"svd"``, ``"asvd"``, ``"fwsvd"``, ``"svd-llm"``, ``"swift-svd"``, ``"saes-svd"``,
``"gfwsvd"``).

Two kinds of statistics input exist:

* ``stats``: a :class:`~rankwise.core.stats.LayerStats` of the layer, collected with the kinds listed
  in ``needs`` (``input_cov``, ``output_cov``, ``input_abs_mean``, ``fisher_diag``, ``kfac``, ...) on the
  model as it is when the layer's turn comes (see ``feed``);
* ``paired``: for methods that set ``paired = True`` (SAES-SVD), a :class:`PairedStats` with the
  input covariance ``H = X X^T`` of the layer's inputs in the partially compressed model and the
  differential covariance ``Delta = (X_f - X) X^T`` against the full-precision model's inputs to the
  same layer on the same tokens (columns are tokens).

``feed`` says which model produces a block's calibration inputs in block-sequential mode:
``"original"`` (every layer sees full-precision inputs: plain SVD, ASVD, FWSVD, SVD-LLM(W),
Swift-SVD, GFWSVD) or ``"compressed"`` (the inputs come from the already compressed upstream layers,
SAES-SVD's closed loop).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from rankwise.core.linalg import LowRankFactors
from rankwise.core.stats import LayerStats

Tensor = torch.Tensor
Feed = Literal["original", "compressed"]


@dataclass
class PairedStats:
    """Second-order statistics of one layer's inputs in two models on the same tokens (float64).

    ``H``: ``n x n`` = sum over tokens of x x^T (compressed-upstream inputs X);
    ``Delta``: ``n x n`` = sum over tokens of (x_f - x) x^T (not symmetric); ``tokens``: count.
    """

    H: Tensor
    Delta: Tensor
    tokens: int


class LayerMethod:
    """Base class of a per-layer low-rank method. Subclasses set the class attributes and ``fit``."""

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()
    feed: ClassVar[Feed] = "original"
    paired: ClassVar[bool] = False
    needs_grad: ClassVar[bool] = False  # statistics need a backward pass (a loss)

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        """Return factors ``(B, A)`` with ``A @ B ≈ layer.weight`` of rank ``rank`` (bias stays on the layer)."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """Per-layer diagnostics of the last ``fit`` (e.g. the chosen beta of SAES-SVD)."""
        return {}


_METHODS: dict[str, type[LayerMethod]] = {}


def register_layer_method(cls: type[LayerMethod]) -> type[LayerMethod]:
    """Class decorator: make ``cls`` available to ``compress(..., method=cls.name)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _METHODS[cls.name] = cls
    return cls


def layer_methods() -> dict[str, type[LayerMethod]]:
    return dict(_METHODS)


def uniform_rank(m: int, n: int, keep: float) -> int:
    """Rank that keeps at most a fraction ``keep`` of an ``m x n`` layer's parameters:
    ``floor(keep * m * n / (m + n))``, at least 1 and at most ``min(m, n)``."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"kept-parameter fraction must be in (0, 1], got {keep!r}")
    return max(1, min(min(m, n), math.floor(keep * m * n / (m + n))))


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]  # (out, in)
    rank: int
    params_before: int
    params_after: int
    rel_error: float | None = None  # ||Y - X W_k^T||_F^2 / ||Y||_F^2 on calibration data, when measured
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompressionReport:
    """What ``compress`` did: per-layer ranks, parameters, errors and times, and totals."""

    method: str
    config: dict[str, Any]
    layers: list[LayerReport] = field(default_factory=list)
    params_before: int = 0  # whole model
    params_after: int = 0
    seconds_calibration: float = 0.0
    seconds_decomposition: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> dict[str, int]:
        return {l.name: l.rank for l in self.layers}

    @property
    def layer_errors(self) -> dict[str, float | None]:
        return {l.name: l.rel_error for l in self.layers}

    @property
    def kept_fraction(self) -> float:
        return self.params_after / self.params_before if self.params_before else float("nan")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept_fraction"] = self.kept_fraction
        return d
