"""What every compression method shares: the per-layer method interface, ranks and the report.

A *layer method* turns one ``nn.Linear`` plus its calibration statistics into low-rank factors
``W ≈ A @ B`` (:class:`~rankwise.core.linalg.LowRankFactors`: ``B`` is ``r x n``, ``A`` is ``m x r``).
The pipeline (``compress/api.py`` and the modules it uses: ``targets``, ``calibration``,
``allocation``, ``blockwise``) owns everything around it: choosing targets, collecting the
statistics the method asks for (``needs``), the order in which layers are compressed, the ranks, the
module surgery and reporting. Methods register under a short name that the CLI and
``CompressConfig(method=...)`` accept (``"svd"``, ``"asvd"``, ``"fwsvd"``, ``"svd-llm"``, ``"swift-svd"``,
``"saes-svd"``, ``"gfwsvd"``); :func:`resolve_layer_method` also accepts ``_`` for ``-`` and a few
aliases (``"svdllm_w"``, ``"swift_svd"``). A method also names its own config class
(``config_class``, e.g. ``SwiftSVDConfig``): ``compress(model, SwiftSVDConfig(...), calib=...)`` finds
the method by the config's type (:func:`method_for_config`).

Statistics a method can receive:

* ``stats``: a :class:`~rankwise.core.stats.LayerStats` of the layer, collected with the kinds listed
  in ``needs`` (``input_cov``, ``output_cov``, ``input_abs_mean``, ``fisher_diag``, ``kfac``, ...) plus
  ``input_cov`` (the pipeline measures every layer's output error with it), on the model as it is
  when the layer's turn comes (see ``feed``). ``collect_options()`` passes extra arguments to the
  collector (``fisher="sample"``, ...);
* ``paired``: for methods that set ``paired = True`` (SAES-SVD), a :class:`PairedStats` with the
  input covariance ``H = X X^T`` of the layer's inputs in the partially compressed model and the
  differential covariance ``Delta = (X_f - X) X^T`` against the full-precision model's inputs to the
  same layer on the same tokens (columns are tokens; padding tokens excluded);
* anything else: a method that needs whole-model statistics of its own (GFWSVD's Kronecker factors)
  overrides :meth:`LayerMethod.prepare`, which the pipeline calls once, with the unmodified model and
  the calibration batches, before the first ``fit``; a caller who already has them passes them to
  ``compress(..., prepared=...)`` (:meth:`LayerMethod.load_prepared`) and the collection is skipped.

``feed`` says which model produces a layer's calibration inputs: ``"original"`` (every layer sees
full-precision inputs: plain SVD, ASVD, FWSVD, SVD-LLM(W), Swift-SVD, GFWSVD) or ``"compressed"``
(the inputs come from the already compressed upstream layers, SAES-SVD's closed loop; this needs the
block-sequential mode of the pipeline).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Literal

import torch
from torch import nn

from rankwise.core.errors import UnknownMethodError
from rankwise.core.linalg import LowRankFactors
from rankwise.core.stats import LayerStats
from rankwise.core.validate import check_unit

Tensor = torch.Tensor
Feed = Literal["original", "compressed"]

__all__ = [
    "Feed", "PairedStats", "LayerMethod", "register_layer_method", "layer_methods", "resolve_layer_method",
    "method_for_config", "uniform_rank", "check_ratio", "relative_output_error", "LayerReport", "CompressionReport",
]


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
    """Base class of a per-layer low-rank method. Subclasses set the class attributes and ``fit``.

    Class attributes:
        name: the registered name (``"swift-svd"``).
        aliases: other accepted spellings.
        needs: :mod:`rankwise.core.stats` kinds the method reads from ``stats``.
        feed: ``"original"`` or ``"compressed"`` (see the module docstring).
        paired: the method reads :class:`PairedStats` (implies ``feed="compressed"``).
        needs_grad: its statistics need a backward pass of a loss (``compress(..., loss_fn=...)``);
            gradient statistics are whole-model statistics, collected in one pass even in block mode.
        exact_at_full_rank: at ``rank = min(m, n)`` the factors reproduce the layer on its calibration
            inputs (true for every method whose objective is a weighted distance to ``W``; the
            shared test matrix checks it).
        config_class: the method's own config dataclass (``SwiftSVDConfig``); ``compress(model,
            config)`` picks the method registered for ``type(config)``.
        report_class: the :class:`CompressionReport` subclass ``compress`` returns (None: the base class).

    Instances are built with the method's options as keyword arguments (``compress`` passes
    ``CompressConfig.options``). The pipeline may set ``self.cache`` to a dict that lives as long as
    the :class:`~rankwise.compress.calibration.Calibration` it fits from; a method may keep there what
    depends only on the statistics (an eigendecomposition, a Cholesky factor), so that fitting the
    same calibration at several ranks does that work once.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[tuple[str, ...]] = ()
    feed: ClassVar[Feed] = "original"
    paired: ClassVar[bool] = False
    needs_grad: ClassVar[bool] = False
    exact_at_full_rank: ClassVar[bool] = True
    config_class: ClassVar[type | None] = None
    report_class: ClassVar[type | None] = None

    cache: dict[str, Any] | None = None

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        """Return factors ``(B, A)`` with ``A @ B ≈ layer.weight`` of rank ``rank`` (bias stays on the layer)."""
        raise NotImplementedError

    def needs_for(self, out_features: int, in_features: int) -> tuple[str, ...]:
        """The kinds of :attr:`needs` that a layer of this shape needs (default: all of them).

        The pipeline collects only these for that layer (Swift-SVD: ``Y^T Y`` for ``m <= n``, ``X^T X``
        for a layer wider at the output).
        """
        return self.needs

    def info(self) -> dict[str, Any]:
        """Per-layer diagnostics of the last ``fit`` (e.g. the chosen beta of SAES-SVD)."""
        return {}

    def collect_options(self) -> dict[str, Any]:
        """Extra keyword arguments for :class:`~rankwise.core.stats.StatsCollector` (``fisher=``, ...)."""
        return {}

    def prepare(self, model: nn.Module, calib: Iterable[Any], *, target: Any = None,
                loss_fn: Callable[[Any, Any], Tensor] | None = None,
                forward: Callable[[nn.Module, Any], Any] | None = None, mask: Any = "auto") -> None:
        """Whole-model statistics of the method's own, collected once before the first ``fit``.

        ``target`` is the list of qualified names of the layers that will be fitted. The default does
        nothing; methods that override it cannot run from a checkpoint block by block.
        """
        return None

    @classmethod
    def has_prepare(cls) -> bool:
        """Whether the method overrides :meth:`prepare` (needs the whole model once)."""
        return cls.prepare is not LayerMethod.prepare

    def load_prepared(self, state: Any) -> None:
        """Take statistics that :meth:`prepare` would collect, computed by the caller (``compress(..., prepared=)``)."""
        raise TypeError(f"method {self.name!r} collects no statistics of its own; it takes no prepared= argument")

    def is_prepared(self, names: Iterable[str]) -> bool:
        """Whether :meth:`prepare` has nothing left to collect for the layers ``names`` (then no data is needed)."""
        return not self.has_prepare()

    def rank_for(self, m: int, n: int) -> int | None:
        """The method's own rank rule for an ``m x n`` layer, used with ``allocation="method"``; None if it has none."""
        return None


_METHODS: dict[str, type[LayerMethod]] = {}
_BY_CONFIG: dict[type, type[LayerMethod]] = {}
_LOADED = False


def register_layer_method(cls: type[LayerMethod]) -> type[LayerMethod]:
    """Class decorator: make ``cls`` available under ``cls.name`` and for configs of type ``cls.config_class``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.paired and cls.feed != "compressed":
        raise ValueError(f"{cls.__name__}: paired statistics need feed='compressed', got feed={cls.feed!r}")
    _METHODS[cls.name] = cls
    own = cls.__dict__.get("config_class")  # declared by this class: a subclass does not take over its parent's config
    if own is not None:
        _BY_CONFIG[own] = cls
    return cls


def _load_all() -> None:
    """Import every module of this package so that each registers its layer methods (plugin discovery:
    the modules are found on disk, so that this module imports none of them)."""
    global _LOADED
    if _LOADED:
        return
    for info in pkgutil.iter_modules([str(Path(__file__).parent)], prefix=f"{__package__}."):
        importlib.import_module(info.name)
    _LOADED = True


def layer_methods() -> dict[str, type[LayerMethod]]:
    """Every registered layer method by name (imports the modules of ``rankwise.compress`` first)."""
    _load_all()
    return dict(_METHODS)


def method_for_config(config: Any) -> type[LayerMethod]:
    """The layer method registered for ``type(config)`` (or a base class of it); ``TypeError`` when none is."""
    _load_all()
    for t in type(config).__mro__:
        if t in _BY_CONFIG:
            return _BY_CONFIG[t]
    known = ", ".join(sorted(t.__name__ for t in _BY_CONFIG))
    raise TypeError(f"config must be a CompressConfig or a method config ({known}), got {type(config).__name__}")


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def resolve_layer_method(name: str) -> type[LayerMethod]:
    """The method class registered as ``name`` (``_``/``-`` and case ignored; aliases accepted).

    Raises :class:`~rankwise.core.errors.UnknownMethodError` listing the available names.
    """
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"method must be a non-empty string, got {name!r}")
    methods = layer_methods()
    key = _norm(name)
    for cls in methods.values():
        if key == _norm(cls.name) or key in {_norm(a) for a in cls.aliases}:
            return cls
    known = ", ".join(sorted(methods))
    raise UnknownMethodError(f"unknown compression method {name!r}; available: {known}")


def check_ratio(ratio: Any, field_name: str = "ratio") -> float:
    """Validate a kept-parameter fraction in ``(0, 1]``; returns it as float or raises ``ValueError``."""
    return check_unit(field_name, ratio, low_open=True)  # type: ignore[return-value]


def uniform_rank(m: int, n: int, keep: float) -> int:
    """Rank that keeps at most a fraction ``keep`` of an ``m x n`` layer's parameters:
    ``floor(keep * m * n / (m + n))``, at least 1 and at most ``min(m, n)``."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"kept-parameter fraction must be in (0, 1], got {keep!r}")
    return max(1, min(min(m, n), math.floor(keep * m * n / (m + n))))


def relative_output_error(W: Tensor, factors: LowRankFactors | tuple[Tensor, Tensor], H: Tensor) -> float:
    """``||X W^T - X (A B)^T||_F^2 / ||X W^T||_F^2`` from the input covariance ``H = X^T X`` (float64).

    ``W`` is ``m x n``, ``factors = (B, A)`` with ``B`` ``r x n`` and ``A`` ``m x r``, ``H`` ``n x n``.
    Computed as ``tr(E H E^T) / tr(W H W^T)`` with ``E = W - A B`` (the bias cancels, so it never
    enters). Returns 0.0 for a layer whose output is zero on the calibration data and whose error is
    zero, ``inf`` if only the output is zero.
    """
    B, A = factors
    W64 = W.detach().to(torch.float64)
    H64 = H.detach().to(W64.device, torch.float64)
    E = W64 - A.detach().to(W64.device, torch.float64) @ B.detach().to(W64.device, torch.float64)
    num = float(((E @ H64) * E).sum())
    den = float(((W64 @ H64) * W64).sum())
    num = max(num, 0.0)  # tr(E H E^T) >= 0 for PSD H; clamp rounding below zero
    if den <= 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


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
    """What ``compress`` did: per-layer ranks, parameters, errors and times, and totals.

    ``params_before`` / ``params_after`` count the whole model; the per-layer counts are in
    ``layers``. ``extra`` holds the mode, the block list, the feed, the allocation details and the
    tensor-memory ledger of the run.
    """

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

    @property
    def target_params_before(self) -> int:
        return sum(l.params_before for l in self.layers)

    @property
    def target_params_after(self) -> int:
        return sum(l.params_after for l in self.layers)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept_fraction"] = self.kept_fraction
        return _jsonable(d)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CompressionReport":
        layers = [LayerReport(name=l["name"], shape=tuple(l["shape"]), rank=int(l["rank"]),
                              params_before=int(l["params_before"]), params_after=int(l["params_after"]),
                              rel_error=l.get("rel_error"), seconds=float(l.get("seconds", 0.0)),
                              info=dict(l.get("info", {}))) for l in d.get("layers", [])]
        return cls(method=d["method"], config=dict(d.get("config", {})), layers=layers,
                   params_before=int(d.get("params_before", 0)), params_after=int(d.get("params_after", 0)),
                   seconds_calibration=float(d.get("seconds_calibration", 0.0)),
                   seconds_decomposition=float(d.get("seconds_decomposition", 0.0)),
                   extra=dict(d.get("extra", {})))

    def summary(self) -> str:
        """A few lines for logs: method, layers, parameters kept, mean error, times."""
        errs = [l.rel_error for l in self.layers if l.rel_error is not None]
        mean_err = f"{sum(errs) / len(errs):.4g}" if errs else "n/a"
        return (f"{self.method}: {len(self.layers)} layer(s); target parameters {self.target_params_before:,} -> "
                f"{self.target_params_after:,}; model {self.params_before:,} -> {self.params_after:,} "
                f"({self.kept_fraction:.3f} kept); mean relative output error {mean_err}; calibration "
                f"{self.seconds_calibration:.2f} s, decomposition {self.seconds_decomposition:.2f} s")


def _jsonable(x: Any) -> Any:
    """Tensors/dtypes/tuples/non-finite floats made JSON-friendly (NaN -> None, inf -> str)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, torch.Tensor):
        return _jsonable(x.detach().cpu().tolist()) if x.numel() <= 64 else f"<tensor {tuple(x.shape)}>"
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return repr(x)
