"""The pipeline's config (:class:`CompressConfig`) and the base of every method's own config.

``compress(model, config, calib=...)`` takes either

* a method's own config (``SwiftSVDConfig``, ``SAESSVDConfig``, ``GFWSVDConfig``, ``PlainSVDConfig``,
  ``ASVDConfig``, ``FWSVDConfig``, ``SVDLLMConfig``): a :class:`MethodConfig` with the paper's field
  names and defaults; the method is found by the config's type in the layer-method registry
  (:func:`~rankwise.compress.base.method_for_config`), and the config translates itself into the
  pipeline's settings (:meth:`MethodConfig.to_compress_config`); or
* a :class:`CompressConfig`: any registered method by name plus every pipeline setting (explicit
  rank maps, the feed, the statistics dtype), the form the reproductions use to run several
  methods on one :class:`~rankwise.compress.calibration.Calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from rankwise.compress.base import LayerMethod, _jsonable, check_ratio, method_for_config, resolve_layer_method
from rankwise.core.select import Selector
from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_unit

__all__ = ["CompressConfig", "MethodConfig", "as_compress_config", "check_dtype", "check_patterns", "ALLOCATIONS"]

#: Rank allocations of the pipeline (or a ``{layer name: rank}`` mapping).
ALLOCATIONS = ("uniform", "dynamic", "method")


def check_dtype(field_name: str, value: Any) -> torch.dtype:
    """A floating ``torch.dtype``; ``ValueError("<field> must be a floating torch.dtype, got ...")`` otherwise."""
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{field_name} must be a floating torch.dtype, got {value!r}")
    return value


def check_patterns(field_name: str, value: Any) -> tuple[str, ...] | None:
    """None, or a non-empty tuple of module-name patterns (a single string becomes a 1-tuple)."""
    if value is None:
        return None
    t = (value,) if isinstance(value, str) else tuple(value)
    if not t or not all(isinstance(x, str) for x in t):
        raise ValueError(f"{field_name} must be None or a non-empty sequence of name patterns, got {value!r}")
    return t


@dataclass(frozen=True)
class CompressConfig:
    """What to compress with: the method, the kept-parameter fraction, the rank allocation, options.

    Attributes:
        method: a registered layer method (``"swift-svd"``, ``"svd-llm"``, ``"svd"``, ``"asvd"``,
            ``"fwsvd"``, ``"saes-svd"``, ``"gfwsvd"``; ``_`` and ``-`` are interchangeable).
        ratio: kept-parameter fraction ``rho`` of the target layers (``param_ratio``), in ``(0, 1]``.
        allocation: ``"uniform"``, ``"dynamic"``, ``"method"`` or ``{layer name: rank}`` (layers not
            listed get the uniform rank).
        alpha: exponent of the dynamic allocation score (2.5, Swift-SVD).
        base_fraction: base rank of the dynamic allocation as a fraction of the uniform rank (0.5).
        options: keyword arguments of the method's constructor (e.g. ``{"damping": 1e-5}``).
        feed: override the method's ``feed`` (``"original"`` / ``"compressed"``); None = the method's.
        dtype: accumulation dtype of the statistics (float64).
        measure_error: collect ``X^T X`` of every target to report its relative output error.
    """

    method: str = "swift-svd"
    ratio: float = 0.4
    allocation: str | Mapping[str, int] = "uniform"
    alpha: float = 2.5
    base_fraction: float = 0.5
    options: Mapping[str, Any] = field(default_factory=dict)
    feed: str | None = None
    dtype: torch.dtype = torch.float64
    measure_error: bool = True

    def __post_init__(self) -> None:
        cls = resolve_layer_method(self.method)
        object.__setattr__(self, "method", cls.name)
        check_ratio(self.ratio, "CompressConfig.ratio")
        alloc = self.allocation
        if isinstance(alloc, str):
            check_choice("CompressConfig.allocation", alloc, ALLOCATIONS)
        elif isinstance(alloc, Mapping):
            clean: dict[str, int] = {}
            for k, v in alloc.items():
                if not isinstance(k, str):
                    raise ValueError(f"CompressConfig.allocation keys must be layer names (str), got {k!r}")
                clean[k] = check_int(f"CompressConfig.allocation[{k!r}] (the rank of layer {k!r})", v, 1)  # type: ignore[assignment]
            object.__setattr__(self, "allocation", clean)
        else:
            raise ValueError(f"CompressConfig.allocation must be one of {list(ALLOCATIONS)} or a {{layer name: rank}} "
                             f"mapping, got {alloc!r}")
        check_number("CompressConfig.alpha", self.alpha)
        check_unit("CompressConfig.base_fraction", self.base_fraction)
        if not isinstance(self.options, Mapping):
            raise ValueError(f"CompressConfig.options must be a mapping of keyword arguments, got {self.options!r}")
        object.__setattr__(self, "options", dict(self.options))
        check_choice("CompressConfig.feed", self.feed, ("original", "compressed"), allow_none=True)
        if cls.paired and self.feed == "original":
            raise ValueError(f"method {cls.name!r} reads paired statistics and needs feed='compressed'")
        check_dtype("CompressConfig.dtype", self.dtype)
        check_bool("CompressConfig.measure_error", self.measure_error)

    @property
    def method_class(self) -> type[LayerMethod]:
        return resolve_layer_method(self.method)

    def build_method(self) -> LayerMethod:
        """An instance of the method with ``options``; bad options raise ``TypeError``/``ValueError``."""
        cls = self.method_class
        try:
            return cls(**self.options)
        except TypeError as e:
            raise TypeError(f"bad options {sorted(self.options)} for method {cls.name!r}: {e}") from None

    def to_json(self) -> dict[str, Any]:
        return _jsonable({"method": self.method, "ratio": self.ratio, "allocation": self.allocation,
                          "alpha": self.alpha, "base_fraction": self.base_fraction, "options": dict(self.options),
                          "feed": self.feed, "dtype": self.dtype, "measure_error": self.measure_error})


class MethodConfig:
    """Base of a method's own config dataclass (``SwiftSVDConfig``, ``PlainSVDConfig``, ...).

    A subclass is a frozen dataclass with the paper's field names and defaults, names its layer
    method through that method's ``config_class``, and says how its fields map onto the pipeline:
    :meth:`pipeline_settings` (``ratio``, ``allocation``, ... of :class:`CompressConfig`) and
    :meth:`method_options` (the method constructor's keyword arguments). A ``targets`` field, when the
    config has one, is the default ``target=`` of ``compress``.
    """

    def pipeline_settings(self) -> dict[str, Any]:
        """:class:`CompressConfig` fields other than ``method`` and ``options`` (at least ``ratio``)."""
        raise NotImplementedError

    def method_options(self) -> dict[str, Any]:
        """Keyword arguments of the layer method's constructor."""
        return {}

    @property
    def method_class(self) -> type[LayerMethod]:
        """The layer method registered for this config's type."""
        return method_for_config(self)

    @property
    def default_target(self) -> Selector:
        """The layers ``compress`` selects when it is given no ``target=`` (the config's ``targets``)."""
        return getattr(self, "targets", None)

    def to_compress_config(self) -> CompressConfig:
        """The equivalent :class:`CompressConfig` (the method found by this config's type)."""
        return CompressConfig(method=self.method_class.name, options=self.method_options(), **self.pipeline_settings())

    @classmethod
    def with_options(cls, config: Any, options: Mapping[str, Any], label: str) -> Any:
        """``config`` (default ``cls()``) with some fields replaced: how a method built from
        ``CompressConfig.options`` gets its config. Unknown fields raise ``TypeError`` naming the valid ones."""
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be a {cls.__name__}, got {type(config).__name__}")
        cfg = config if config is not None else cls()
        if not options:
            return cfg
        fields = getattr(cls, "__dataclass_fields__", {})
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise TypeError(f"unknown {label} option(s) {unknown}; valid: {sorted(fields)}")
        return replace(cfg, **options)


def as_compress_config(config: Any) -> CompressConfig:
    """``config`` as a :class:`CompressConfig`: itself, or a method config translated (``TypeError`` otherwise)."""
    if isinstance(config, CompressConfig):
        return config
    if isinstance(config, MethodConfig):
        method_for_config(config)  # a config type no method registered fails here, naming the known ones
        return config.to_compress_config()
    conv = getattr(config, "to_compress_config", None)
    if callable(conv):
        out = conv()
        if isinstance(out, CompressConfig):
            return out
    raise TypeError(f"config must be a CompressConfig or a method config (SwiftSVDConfig, PlainSVDConfig, ...), "
                    f"got {type(config).__name__}")
