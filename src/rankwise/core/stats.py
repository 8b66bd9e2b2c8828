"""Streaming calibration statistics of selected layers, collected with hooks.

What can be collected (the ``kinds``), per target layer with input ``x`` (last dim ``n``) and
output ``y`` (last dim ``m``); every input is flattened to tokens, ``X = x.reshape(-1, n)``:

``"input_cov"``
    ``sum_t x_t x_t^T`` (``n x n``): ``X^T X`` of SVD-LLM / Swift-SVD's ``H``.
``"input_mean"``
    ``sum_t x_t`` (``n``), for means and centred covariances.
``"input_abs_mean"``
    ``sum_t |x_t|`` (``n``), ASVD's activation scale ``mean_t |x_tj|``.
``"output_cov"``
    ``sum_t y_t y_t^T`` (``m x m``), Swift-SVD's ``C = Y^T Y``. By default ``y`` is the output
    **without the bias** (``Y = X W^T``, what Swift-SVD needs: the bias is kept outside the
    low-rank factor): ``bias`` is subtracted from the module's actual output in the accumulation
    dtype. ``output_bias=True`` keeps the bias in.
``"output_mean"``
    ``sum_t y_t`` (``m``), same bias convention.
``"kfac"``
    K-FAC factors over the tokens that received an output gradient ``g_t = dL/dy_t``:
    ``sum_t x_t x_t^T`` (``n x n``) and ``sum_t g_t g_t^T`` (``m x m``). Normalised (the default
    of :meth:`LayerStats.kfac_factors`) they are ``A = E_t[x x^T]`` and ``G = E_t[g g^T]``, both
    divided by the number of gradient tokens. The scale of ``g`` is whatever the loss gives: with
    a mean-reduced loss each ``g`` carries a ``1/batch`` factor, so ``G`` then depends on the
    batch size; use ``reduction="sum"`` in the loss for batch-size-independent factors.
``"fisher_diag"``
    Diagonal empirical Fisher of the weight in the ``(out, in)`` layout: a sum of squared weight
    gradients ``(dL/dW)^2`` (``m x n``) with ``dL/dW = sum_t g_t x_t^T``. ``fisher="batch"``
    (default, FWSVD's recipe ``f_ij = sum_batches (dL_b/dW_ij)^2``) squares the gradient of each
    backward pass; ``fisher="sample"`` squares the gradient of each sample (leading dim of the
    input) and is therefore independent of how samples are grouped into batches. The per-batch
    gradient of a module called several times in one forward is the sum over its calls; it is
    squared once all calls' gradients have arrived.

Which method uses what: Swift-SVD's ``C = Y^T Y`` is ``output_cov(normalized=False)`` (step 1 of
its algorithm); SVD-LLM(W)'s and SAES-SVD's ``H`` is ``input_cov()`` (SAES-SVD's Alg. 1 keeps
``(2/N) X X^T``, i.e. ``2 * input_cov()``; the factor only rescales the relative ridge, so it does
not change the result); ASVD uses ``input_abs_mean()``; FWSVD uses ``fisher_rows()``
(``fisher="batch"`` for its original recipe, ``fisher="sample"`` for GFWSVD's comparison on the
same per-sample gradients); GFWSVD's K-FAC ablation uses ``kfac_factors()``.

Everything accumulates in float64 (``dtype``) on the input's device, with token counts, in
tensors whose size does not depend on the number of batches; the sums do not depend on the batch
split or order (up to float64 rounding), except ``fisher="batch"`` which by definition depends on
the split. Padding tokens are excluded with a token mask (``attention_mask`` of dict batches by
default). Non-finite inputs, outputs or gradients raise :class:`~rankwise.core.errors.NumericalError`
naming the layer. Gradient kinds never touch the parameters' ``requires_grad`` or ``.grad``: the
hooks add a zero scalar leaf to each target output so that output gradients exist even in a frozen
model, and :meth:`StatsCollector.run` differentiates with respect to that leaf only.

Activation checkpointing re-runs forwards during backward and would count tokens twice:
disable it while calibrating.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

import torch
from torch import nn

from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError
from rankwise.core.select import Selector, select

log = logging.getLogger(__name__)

Tensor = torch.Tensor

KINDS: tuple[str, ...] = (
    "input_cov", "input_mean", "input_abs_mean", "output_cov", "output_mean", "kfac", "fisher_diag",
)
GRAD_KINDS = frozenset({"kfac", "fisher_diag"})
_OUTPUT_KINDS = frozenset({"output_cov", "output_mean"})

# tensor fields of LayerStats -> the kind that fills them
_FIELDS: dict[str, str] = {
    "xtx": "input_cov", "x_sum": "input_mean", "x_abs_sum": "input_abs_mean",
    "yty": "output_cov", "y_sum": "output_mean",
    "kfac_xtx": "kfac", "gtg": "kfac", "fisher": "fisher_diag",
}
_COUNTS = ("n_tokens", "n_grad_tokens", "n_fisher", "in_features", "out_features")
_FLAGS = ("fisher_per_sample", "output_bias")

__all__ = ["KINDS", "GRAD_KINDS", "CalibrationError", "LayerStats", "StatsCollector", "collect",
           "default_forward", "resolve_mask", "task_loss"]


class CalibrationError(RankwiseError, ValueError):
    """The calibration data gave no statistics for a layer (empty data, layer never called, no gradient)."""


# ----------------------------------------------------------------------------------------------
# per-layer statistics


@dataclass(eq=False)
class LayerStats:
    """Accumulated statistics of one layer (sums in float64, plus the counts that normalise them).

    Shapes: ``n = in_features``, ``m = out_features``. Tensor fields are ``None`` when their kind
    was not collected. The accessor methods return normalised (divided by the count) values by
    default and raise :class:`CalibrationError` when the needed kind or tokens are missing.
    """

    name: str
    in_features: int = 0
    out_features: int = 0
    n_tokens: int = 0          #: rows of X accumulated by the forward kinds
    n_grad_tokens: int = 0     #: tokens whose output gradient was accumulated (kfac)
    n_fisher: int = 0          #: squared gradients summed into ``fisher`` (batches or samples)
    fisher_per_sample: bool = False
    output_bias: bool = False  #: True when ``y`` included the bias
    xtx: Tensor | None = None         #: (n, n) sum_t x x^T
    x_sum: Tensor | None = None       #: (n,) sum_t x
    x_abs_sum: Tensor | None = None   #: (n,) sum_t |x|
    yty: Tensor | None = None         #: (m, m) sum_t y y^T
    y_sum: Tensor | None = None       #: (m,) sum_t y
    kfac_xtx: Tensor | None = None    #: (n, n) sum over gradient tokens of x x^T
    gtg: Tensor | None = None         #: (m, m) sum_t g g^T
    fisher: Tensor | None = None      #: (m, n) sum of squared weight gradients

    # -- accessors ---------------------------------------------------------------------------

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds present in this object."""
        have = {k for f, k in _FIELDS.items() if getattr(self, f) is not None}
        return tuple(k for k in KINDS if k in have)

    def _need(self, field: str, count: int, what: str) -> Tensor:
        t = getattr(self, field)
        if t is None:
            raise CalibrationError(f"layer {self.name!r}: {what} was not collected "
                                   f"(add {_FIELDS[field]!r} to kinds); collected: {list(self.kinds)}")
        if count == 0:
            raise CalibrationError(f"layer {self.name!r}: {what} has zero tokens/samples; the layer "
                                   "saw no calibration data")
        return t

    def input_cov(self, normalized: bool = True, centered: bool = False) -> Tensor:
        """``X^T X`` (``n x n``); ``/ n_tokens`` if ``normalized``; minus ``N mu mu^T`` if ``centered``."""
        xtx = self._need("xtx", self.n_tokens, "input covariance")
        return _cov(xtx, self.x_sum, self.n_tokens, normalized, self, "input_mean", centered)

    def input_mean(self) -> Tensor:
        """``mean_t x_t`` (``n``)."""
        return self._need("x_sum", self.n_tokens, "input mean") / self.n_tokens

    def input_abs_mean(self) -> Tensor:
        """``mean_t |x_t|`` (``n``), ASVD's per-channel activation scale."""
        return self._need("x_abs_sum", self.n_tokens, "input mean |x|") / self.n_tokens

    def output_cov(self, normalized: bool = True, centered: bool = False) -> Tensor:
        """``Y^T Y`` (``m x m``; ``Y`` without bias unless ``output_bias``); ``/ n_tokens`` if ``normalized``."""
        yty = self._need("yty", self.n_tokens, "output covariance")
        return _cov(yty, self.y_sum, self.n_tokens, normalized, self, "output_mean", centered)

    def output_mean(self) -> Tensor:
        """``mean_t y_t`` (``m``)."""
        return self._need("y_sum", self.n_tokens, "output mean") / self.n_tokens

    def kfac_factors(self, normalized: bool = True) -> tuple[Tensor, Tensor]:
        """K-FAC ``(A, G)``: ``A = E_t[x x^T]`` (``n x n``), ``G = E_t[g g^T]`` (``m x m``), over gradient tokens.

        ``normalized=False`` returns the raw sums. The Fisher block of ``vec(W)`` (column stacking)
        is approximated by ``A kron G``.
        """
        a = self._need("kfac_xtx", self.n_grad_tokens, "K-FAC input factor")
        g = self._need("gtg", self.n_grad_tokens, "K-FAC gradient factor")
        if normalized:
            return a / self.n_grad_tokens, g / self.n_grad_tokens
        return a, g

    def grad_cov(self, normalized: bool = True) -> Tensor:
        """The K-FAC output-gradient factor ``G`` alone (``m x m``)."""
        return self.kfac_factors(normalized)[1]

    def fisher_diag(self, normalized: bool = True) -> Tensor:
        """Diagonal empirical Fisher (``m x n``): sum of squared gradients, ``/ n_fisher`` if ``normalized``.

        ``n_fisher`` counts batches (``fisher="batch"``) or samples (``fisher="sample"``), see
        ``fisher_per_sample``. FWSVD's row weights are :meth:`fisher_rows`.
        """
        f = self._need("fisher", self.n_fisher, "diagonal Fisher")
        return f / self.n_fisher if normalized else f

    def fisher_rows(self, normalized: bool = True) -> Tensor:
        """FWSVD row importance ``f_i = sum_j F_ij`` (``m``), one weight per output neuron."""
        return self.fisher_diag(normalized).sum(dim=1)

    # -- bookkeeping -------------------------------------------------------------------------

    def tensors(self) -> dict[str, Tensor]:
        """The non-``None`` accumulator tensors, by field name."""
        return {f: getattr(self, f) for f in _FIELDS if getattr(self, f) is not None}

    def state_numel(self) -> int:
        """Number of scalars held (constant in the number of batches)."""
        return sum(t.numel() for t in self.tensors().values())

    def check_finite(self) -> None:
        """Raise :class:`NumericalError` naming the layer and field if any sum is NaN/Inf."""
        for f, t in self.tensors().items():
            if not bool(torch.isfinite(t).all()):
                raise NumericalError(f"layer {self.name!r}: accumulated statistic {f!r} is not finite "
                                     "(overflow or NaN in the calibration data)")

    def merge(self, other: "LayerStats") -> "LayerStats":
        """A new object holding the sums of both (e.g. statistics of two data shards)."""
        if not isinstance(other, LayerStats):
            raise TypeError(f"can only merge LayerStats, got {type(other).__name__}")
        for attr in ("in_features", "out_features", "fisher_per_sample", "output_bias"):
            a, b = getattr(self, attr), getattr(other, attr)
            if a != b and not (attr.endswith("features") and 0 in (a, b)):
                raise ValueError(f"cannot merge statistics of {self.name!r} and {other.name!r}: {attr} differs ({a} vs {b})")
        if set(self.tensors()) != set(other.tensors()):
            raise ValueError(f"cannot merge statistics with different kinds: {self.kinds} vs {other.kinds}")
        out = dataclasses.replace(
            self,
            in_features=self.in_features or other.in_features,
            out_features=self.out_features or other.out_features,
            n_tokens=self.n_tokens + other.n_tokens,
            n_grad_tokens=self.n_grad_tokens + other.n_grad_tokens,
            n_fisher=self.n_fisher + other.n_fisher,
        )
        for f, t in self.tensors().items():
            setattr(out, f, t + other.tensors()[f].to(t.device, t.dtype))
        return out

    def to_tensors(self) -> dict[str, Tensor]:
        """A flat ``dict[str, Tensor]`` (safetensors-ready; counts and flags as int64 scalars).

        The layer name is not included (store it as the key / in metadata); see :meth:`from_tensors`.
        """
        out = {f: t.detach().contiguous() for f, t in self.tensors().items()}
        for c in _COUNTS:
            out[c] = torch.tensor(int(getattr(self, c)), dtype=torch.int64)
        for c in _FLAGS:
            out[c] = torch.tensor(int(bool(getattr(self, c))), dtype=torch.int64)
        return out

    @classmethod
    def from_tensors(cls, name: str, tensors: Mapping[str, Tensor]) -> "LayerStats":
        """Rebuild from :meth:`to_tensors`; raises :class:`ArtifactError` on missing/unknown keys or bad shapes."""
        unknown = set(tensors) - set(_FIELDS) - set(_COUNTS) - set(_FLAGS)
        if unknown:
            raise ArtifactError(f"statistics of {name!r}: unknown entries {sorted(unknown)}")
        missing = [k for k in (*_COUNTS, *_FLAGS) if k not in tensors]
        if missing:
            raise ArtifactError(f"statistics of {name!r}: missing entries {missing}")
        kw: dict[str, Any] = {}
        for k in (*_COUNTS, *_FLAGS):
            t = tensors[k]
            if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.is_floating_point():
                raise ArtifactError(f"statistics of {name!r}: {k!r} must be an integer scalar tensor")
            v = int(t.item())
            if v < 0:
                raise ArtifactError(f"statistics of {name!r}: {k!r} = {v} < 0")
            kw[k] = bool(v) if k in _FLAGS else v
        n, m = kw["in_features"], kw["out_features"]
        shapes = {"xtx": (n, n), "x_sum": (n,), "x_abs_sum": (n,), "yty": (m, m), "y_sum": (m,),
                  "kfac_xtx": (n, n), "gtg": (m, m), "fisher": (m, n)}
        for f in _FIELDS:
            if f in tensors:
                t = tensors[f]
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[f] or not t.is_floating_point():
                    raise ArtifactError(f"statistics of {name!r}: {f!r} must be a float tensor of shape "
                                        f"{shapes[f]}, got {getattr(t, 'shape', type(t))}")
                kw[f] = t
        return cls(name=name, **kw)


def _cov(s: Tensor, mean_sum: Tensor | None, n: int, normalized: bool, st: LayerStats, kind: str,
         centered: bool) -> Tensor:
    """``S`` or, centred, ``S - sum sum^T / n`` (the scatter about the mean); ``/ n`` if normalised."""
    if centered:
        if mean_sum is None:
            raise CalibrationError(f"layer {st.name!r}: a centred covariance needs the {kind!r} kind as well")
        s = s - torch.outer(mean_sum, mean_sum) / n
    return s / n if normalized else s


# ----------------------------------------------------------------------------------------------
# the collector


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Call the model on a batch: a dict/Mapping as ``**kwargs``, a tuple/list as ``*args``, else one argument."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for k in ("input", "hidden_states", "x"):
        if isinstance(kwargs.get(k), torch.Tensor):
            return kwargs[k]
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


def _output_tensor(out: Any) -> Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class _Layer:
    """Per-layer collector state: the LayerStats plus pending per-batch gradients."""

    def __init__(self, name: str, module: nn.Module, kinds: tuple[str, ...]):
        self.name = name
        self.module = module
        self.kinds = kinds
        self.needs_grad = bool(GRAD_KINDS & set(kinds))
        self.stats = LayerStats(name=name)
        self.outstanding = 0                    # forward calls whose output gradient is still due
        self.pending: Tensor | None = None      # summed per-batch (m, n) or per-sample (B, m, n) gradient


class StatsCollector:
    """Hooks that stream statistics of the selected layers into :class:`LayerStats`.

    Use as a context manager (hooks are attached on enter and always removed on exit, also after
    an error), then either call :meth:`run` per batch, or run the model (and ``backward``) yourself;
    or feed tensors without hooks through :meth:`update`. :meth:`results` returns the statistics.

    Args:
        model: any ``nn.Module``.
        target: selector for :func:`rankwise.core.select.select` (``None`` = every module of ``types``).
        kinds: subset of :data:`KINDS`.
        types: module types allowed (default ``(nn.Linear,)``; ``None`` accepts any module whose
            first input and output are tensors with features in the last dim).
        fisher: ``"batch"`` or ``"sample"`` (see the module docstring).
        output_bias: keep the bias in ``y`` for the output kinds (default: subtract it).
        dtype: accumulation dtype (float64 by default; float32 allowed for speed on accelerators).
        layer_kinds: ``f(name, module) -> kinds``, the subset of ``kinds`` collected for one layer
            (default: all of them). Lets a method skip an accumulator a layer does not need (Swift-SVD
            reads ``X^T X``, not the larger ``Y^T Y``, for a layer wider at the output).

    Example::

        with StatsCollector(model, "re:.*(query|value)", kinds=("input_cov",)) as col:
            for batch in loader:
                col.run(batch)
        stats = col.results()          # {name: LayerStats}
    """

    def __init__(
        self,
        model: nn.Module,
        target: Selector = None,
        kinds: Sequence[str] = ("input_cov",),
        *,
        types: tuple[type, ...] | None = (nn.Linear,),
        fisher: Literal["batch", "sample"] = "batch",
        output_bias: bool = False,
        dtype: torch.dtype = torch.float64,
        layer_kinds: Callable[[str, nn.Module], Sequence[str]] | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(kinds, str):
            kinds = (kinds,)
        kinds = tuple(dict.fromkeys(kinds))
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"kinds {list(bad) or list(kinds)} not supported; choose from {list(KINDS)}")
        if fisher not in ("batch", "sample"):
            raise ValueError(f"fisher must be 'batch' or 'sample', got {fisher!r}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.model = model
        self.kinds = kinds
        self.fisher = fisher
        self.output_bias = bool(output_bias)
        self.dtype = dtype
        self.needs_grad = bool(GRAD_KINDS & set(kinds))
        hits = select(model, target, types)
        self.layers: dict[str, _Layer] = {n: _Layer(n, m, self._layer_kinds(layer_kinds, n, m)) for n, m in hits}
        for lay in self.layers.values():
            lay.stats.fisher_per_sample = fisher == "sample"
            lay.stats.output_bias = self.output_bias
        self._handles: list[Any] = []
        self._mask: Tensor | None = None
        self._leaf: Tensor | None = None
        self._batch_index = 0

    def _layer_kinds(self, fn: Callable[[str, nn.Module], Sequence[str]] | None, name: str,
                     module: nn.Module) -> tuple[str, ...]:
        if fn is None:
            return self.kinds
        got = fn(name, module)
        own = (got,) if isinstance(got, str) else tuple(got)
        extra = [k for k in own if k not in self.kinds]
        if extra or not own:
            raise ValueError(f"layer_kinds({name!r}) must give a non-empty subset of the collector's kinds "
                             f"{list(self.kinds)}, got {list(own)}")
        return tuple(k for k in self.kinds if k in own)

    # -- hooks -------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Qualified names of the target layers, in model order."""
        return list(self.layers)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> "StatsCollector":
        """Register the forward hooks (idempotent)."""
        if self._handles:
            return self
        try:
            for lay in self.layers.values():
                self._handles.append(lay.module.register_forward_hook(self._make_hook(lay), with_kwargs=True))
        except BaseException:
            self.detach()
            raise
        if self.needs_grad and self._leaf is None:
            self._leaf = torch.zeros((), requires_grad=True)
        return self

    def detach(self) -> None:
        """Remove every hook this collector registered."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> "StatsCollector":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()
        self._mask = None

    @contextlib.contextmanager
    def token_mask(self, mask: Tensor | None) -> Iterator[None]:
        """Within the block, hooks drop the tokens where ``mask == 0`` (shape: the inputs' leading dims)."""
        prev, self._mask = self._mask, (None if mask is None else mask.detach())
        try:
            yield
        finally:
            self._mask = prev

    def _make_hook(self, lay: _Layer) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            x = _first_tensor(args, kwargs)
            y = _output_tensor(output)
            if x is None or (y is None and (set(lay.kinds) & (_OUTPUT_KINDS | GRAD_KINDS))):
                raise TypeError(f"layer {lay.name!r} ({type(module).__name__}) was called without a tensor "
                                "input/output; statistics need tensors with features in the last dim")
            mask = self._mask
            self._accumulate_forward(lay, x.detach(), None if y is None else y.detach(), mask)
            if lay.needs_grad and torch.is_grad_enabled():
                if not isinstance(output, torch.Tensor):
                    raise TypeError(f"layer {lay.name!r} ({type(module).__name__}) returns a "
                                    f"{type(output).__name__}, not a tensor; gradient statistics need a tensor output")
                new_out = output + self._leaf  # exact (+0); makes dL/dy exist even in a frozen model
                lay.outstanding += 1
                new_out.register_hook(self._make_grad_hook(lay, x.detach(), mask))
                return new_out
            return None
        return hook

    def _make_grad_hook(self, lay: _Layer, x: Tensor, mask: Tensor | None) -> Callable:
        def grad_hook(g: Tensor) -> None:
            self._accumulate_grad(lay, x, g.detach(), mask, complete=False)
        return grad_hook

    # -- accumulation ------------------------------------------------------------------------

    def _rows(self, lay: _Layer, t: Tensor, mask: Tensor | None, what: str) -> Tensor:
        """Flatten to (tokens, features) in the accumulation dtype, dropping masked tokens."""
        feats = t.shape[-1] if t.ndim else 0
        if t.ndim == 0 or feats == 0:
            raise ValueError(f"layer {lay.name!r}: {what} has shape {tuple(t.shape)}; need features in the last dim")
        rows = t.reshape(-1, feats)
        keep = self._mask_rows(lay, t, mask)
        if keep is not None:
            rows = rows[keep.to(rows.device)]
        rows = rows.to(self.dtype)
        if not bool(torch.isfinite(rows).all()):
            raise NumericalError(f"layer {lay.name!r}: non-finite values (NaN/Inf) in its {what} "
                                 f"(calibration batch {self._batch_index})")
        return rows

    def _mask_rows(self, lay: _Layer, t: Tensor, mask: Tensor | None) -> Tensor | None:
        if mask is None:
            return None
        lead = tuple(t.shape[:-1])
        if tuple(mask.shape) == lead or mask.numel() == max(1, t.numel() // max(1, t.shape[-1])):
            return mask.reshape(-1) != 0
        log.debug("token mask of shape %s does not fit layer %s input %s; not masking it",
                  tuple(mask.shape), lay.name, tuple(t.shape))
        return None

    def _check_features(self, lay: _Layer, n: int, m: int | None) -> None:
        st = lay.stats
        for side, dim in (("in", n), ("out", m)):  # the input's last dim, then the output's (if any)
            if dim is None:
                continue
            expected = getattr(lay.module, f"{side}_features", None)
            if isinstance(expected, int) and dim != expected:
                raise ValueError(f"layer {lay.name!r}: {side}put last dim {dim} != {side}_features {expected}")
            seen = getattr(st, f"{side}_features")
            if seen and seen != dim:
                raise ValueError(f"layer {lay.name!r}: {side}put last dim {dim} differs from earlier batches ({seen})")
            setattr(st, f"{side}_features", dim)

    def _bias(self, lay: _Layer, m: int) -> Tensor | None:
        if self.output_bias:
            return None
        b = getattr(lay.module, "bias", None)
        return b if isinstance(b, torch.Tensor) and tuple(b.shape) == (m,) else None

    @staticmethod
    def _add(st: LayerStats, field: str, value: Tensor) -> None:
        cur = getattr(st, field)
        if cur is None:
            setattr(st, field, value.clone())
        else:
            cur.add_(value.to(cur.device))

    def _accumulate_forward(self, lay: _Layer, x: Tensor, y: Tensor | None, mask: Tensor | None) -> None:
        kinds = set(lay.kinds)
        st = lay.stats
        self._check_features(lay, x.shape[-1], None if y is None else y.shape[-1])
        fwd = kinds - GRAD_KINDS
        if not fwd:
            return
        X = self._rows(lay, x, mask, "input")
        if "input_cov" in kinds:
            self._add(st, "xtx", X.mT @ X)
        if "input_mean" in kinds:
            self._add(st, "x_sum", X.sum(0))
        if "input_abs_mean" in kinds:
            self._add(st, "x_abs_sum", X.abs().sum(0))
        if kinds & _OUTPUT_KINDS:
            assert y is not None
            Y = self._rows(lay, y, mask, "output")
            b = self._bias(lay, Y.shape[1])
            if b is not None:
                Y = Y - b.detach().to(Y.device, Y.dtype)
            if Y.shape[0] != X.shape[0]:
                raise ValueError(f"layer {lay.name!r}: {X.shape[0]} input tokens but {Y.shape[0]} output tokens")
            if "output_cov" in kinds:
                self._add(st, "yty", Y.mT @ Y)
            if "output_mean" in kinds:
                self._add(st, "y_sum", Y.sum(0))
        st.n_tokens += X.shape[0]

    def _accumulate_grad(self, lay: _Layer, x: Tensor, g: Tensor, mask: Tensor | None, *, complete: bool) -> None:
        st = lay.stats
        kinds = set(lay.kinds)
        if tuple(g.shape[:-1]) != tuple(x.shape[:-1]):
            raise ValueError(f"layer {lay.name!r}: gradient shape {tuple(g.shape)} does not match input "
                             f"shape {tuple(x.shape)} in the leading (token) dims")
        self._check_features(lay, x.shape[-1], g.shape[-1])
        if "kfac" in kinds:
            X = self._rows(lay, x, mask, "input")
            G = self._rows(lay, g, mask, "output gradient")
            self._add(st, "kfac_xtx", X.mT @ X)
            self._add(st, "gtg", G.mT @ G)
            st.n_grad_tokens += X.shape[0]
        if "fisher_diag" in kinds:
            self._fisher(lay, x, g, mask, last=complete or lay.outstanding <= 1)
        if not complete:
            lay.outstanding = max(0, lay.outstanding - 1)
        if complete or lay.outstanding == 0:
            self._flush_layer(lay)

    def _fisher(self, lay: _Layer, x: Tensor, g: Tensor, mask: Tensor | None, *, last: bool) -> None:
        """Add this call's weight gradient ``sum_t g_t x_t^T`` (per batch or per sample) to ``pending``.

        ``last``: no other call of this batch is still waiting for its gradient, so a per-sample
        gradient can be squared right away without materialising the ``(B, m, n)`` tensor.
        """
        n, m = x.shape[-1], g.shape[-1]
        keep = self._mask_rows(lay, x, mask)
        if self.fisher == "sample":
            B = x.shape[0] if x.ndim >= 2 else 1
            X = x.reshape(B, -1, n).to(self.dtype)
            G = g.reshape(B, -1, m).to(self.dtype)
            if keep is not None:
                w = keep.reshape(B, -1, 1).to(X.device, self.dtype)
                X, G = X * w, G * w
            for t, what in ((X, "input"), (G, "output gradient")):
                if not bool(torch.isfinite(t).all()):
                    raise NumericalError(f"layer {lay.name!r}: non-finite values (NaN/Inf) in its {what} "
                                         f"(calibration batch {self._batch_index})")
            if lay.pending is None and last:
                # the common case (one call per forward): square per sample in chunks, no (B, m, n) buffer
                chunk = max(1, int(2 ** 24 // max(1, m * n)))
                acc = torch.zeros(m, n, dtype=self.dtype, device=X.device)
                for i in range(0, B, chunk):
                    acc += torch.einsum("btm,btn->bmn", G[i:i + chunk], X[i:i + chunk]).square().sum(0)
                self._add(lay.stats, "fisher", acc)
                lay.stats.n_fisher += B
                return
            grad = torch.einsum("btm,btn->bmn", G, X)
        else:
            X = self._rows(lay, x, None, "input")
            G = self._rows(lay, g, None, "output gradient")
            if keep is not None:
                w = keep.to(X.device, self.dtype)[:, None]
                X, G = X * w, G * w
            grad = G.mT @ X
        if lay.pending is None:
            lay.pending = grad
        else:
            if lay.pending.shape != grad.shape:
                raise ValueError(f"layer {lay.name!r}: per-sample gradients of calls in one batch have "
                                 f"different batch sizes ({tuple(lay.pending.shape)} vs {tuple(grad.shape)})")
            lay.pending = lay.pending + grad

    def _flush_layer(self, lay: _Layer) -> None:
        p, lay.pending = lay.pending, None
        if p is None:
            return
        if p.ndim == 3:  # per sample
            self._add(lay.stats, "fisher", p.square().sum(0))
            lay.stats.n_fisher += p.shape[0]
        else:
            self._add(lay.stats, "fisher", p.square())
            lay.stats.n_fisher += 1

    def flush(self) -> None:
        """Square and add pending per-batch gradients now.

        Needed only if a forward pass under grad mode was never followed by its backward (the
        collector then waits for it); :meth:`run` and :meth:`results` call it.
        """
        for lay in self.layers.values():
            lay.outstanding = 0
            self._flush_layer(lay)

    def update(
        self,
        name: str,
        inputs: Tensor,
        outputs: Tensor | None = None,
        grad_outputs: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> None:
        """Feed one call's tensors to layer ``name`` without hooks.

        ``inputs`` ``(..., n)``; ``outputs`` ``(..., m)``: the module's outputs, bias included (for
        an ``nn.Linear`` they are computed from its weight and bias in the accumulation dtype when
        omitted; the ``output_bias`` convention then applies as for hooks); ``grad_outputs`` ``(..., m)`` = ``dL/d outputs`` for the gradient kinds (each such
        call counts as one complete batch); ``mask`` over the leading dims.
        """
        if name not in self.layers:
            raise KeyError(f"{name!r} is not a target of this collector; targets: {self.names}")
        lay = self.layers[name]
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"inputs must be a tensor, got {type(inputs).__name__}")
        fwd = set(lay.kinds) - GRAD_KINDS
        if fwd:
            if outputs is None and (fwd & _OUTPUT_KINDS):
                W = getattr(lay.module, "weight", None)
                if not isinstance(lay.module, nn.Linear) or W is None:
                    raise ValueError(f"layer {name!r}: pass outputs= for the output kinds")
                if inputs.shape[-1] != W.shape[1]:
                    raise ValueError(f"layer {name!r}: input last dim {inputs.shape[-1]} != in_features {W.shape[1]}")
                b = lay.module.bias
                outputs = nn.functional.linear(inputs.detach().to(self.dtype), W.detach().to(inputs.device, self.dtype),
                                               None if b is None else b.detach().to(inputs.device, self.dtype))
            self._accumulate_forward(lay, inputs.detach(), None if outputs is None else outputs.detach(), mask)
        if lay.needs_grad:
            if grad_outputs is None:
                raise ValueError(f"layer {name!r}: kinds {sorted(GRAD_KINDS & set(lay.kinds))} need grad_outputs=")
            self._accumulate_grad(lay, inputs.detach(), grad_outputs.detach(), mask, complete=True)

    # -- running batches ---------------------------------------------------------------------

    def run(
        self,
        batch: Any,
        *,
        forward: Callable[[nn.Module, Any], Any] | None = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        mask: Any = "auto",
    ) -> Any:
        """Run one batch through the model (and, for gradient kinds, differentiate the loss).

        ``forward(model, batch)`` defaults to :func:`default_forward`. ``loss_fn(output, batch)``
        must return a scalar; when omitted, ``output.loss`` (Hugging Face models given labels) or a
        scalar output is used. ``mask``: ``"auto"`` (the batch's ``attention_mask``), ``None``, a
        tensor, or ``callable(batch)``. Returns the model output.
        """
        if not self._handles:
            raise RuntimeError("attach the collector first: `with StatsCollector(...) as col: col.run(batch)`")
        fwd = forward or default_forward
        m = resolve_mask(batch, mask)
        with self.token_mask(m):
            if not self.needs_grad:
                with torch.no_grad():
                    out = fwd(self.model, batch)
            else:
                with torch.enable_grad():
                    out = fwd(self.model, batch)
                    loss = _loss(out, batch, loss_fn)
                    if not bool(torch.isfinite(loss.detach()).all()):
                        raise NumericalError(f"calibration loss is not finite ({float(loss.detach()):.3g}) at batch {self._batch_index}")
                    if loss.requires_grad:
                        torch.autograd.grad(loss, [self._leaf], allow_unused=True)
                self.flush()
        self._batch_index += 1
        return out

    def results(self, *, check: bool = True) -> dict[str, LayerStats]:
        """The statistics by layer name (the live objects).

        With ``check`` (default): raises :class:`CalibrationError` naming every layer that saw no
        tokens (or no gradient, for gradient kinds) and :class:`NumericalError` for non-finite sums.
        """
        self.flush()
        if check:
            silent = [n for n, lay in self.layers.items() if set(lay.kinds) - GRAD_KINDS and lay.stats.n_tokens == 0]
            if silent:
                raise CalibrationError(f"no calibration token reached {len(silent)} target layer(s): {silent[:10]}"
                                       " (the hook never fired or every token was masked; empty calibration data?)")
            nograd = [n for n, lay in self.layers.items()
                      if ("kfac" in lay.kinds and lay.stats.n_grad_tokens == 0)
                      or ("kfac" not in lay.kinds and "fisher_diag" in lay.kinds and lay.stats.n_fisher == 0)]
            if nograd:
                raise CalibrationError(f"no gradient reached {len(nograd)} target layer(s): {nograd[:10]} "
                                       "(the loss does not depend on them, or no backward pass was run)")
            for lay in self.layers.values():
                lay.stats.check_finite()
                for f in (lay.stats.fisher, lay.stats.gtg):
                    if f is not None and float(f.abs().max()) == 0.0:
                        raise CalibrationError(f"layer {lay.name!r}: every output gradient is zero, so its Fisher "
                                               "is zero; use a task loss whose gradient does not vanish (e.g. not "
                                               "a self-distillation loss at its optimum)")
        return {n: lay.stats for n, lay in self.layers.items()}

    def state_numel(self) -> int:
        """Scalars held by all accumulators (constant in the number of batches)."""
        return sum(lay.stats.state_numel() for lay in self.layers.values())


def task_loss(out: Any, batch: Any, loss_fn: Callable | None, missing: str) -> Tensor:
    """The scalar loss of one batch: ``loss_fn(out, batch)``, else ``out.loss``, else a scalar ``out``;
    ``missing`` is the message when there is none."""
    if loss_fn is not None:
        loss = loss_fn(out, batch)
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    elif isinstance(out, torch.Tensor) and out.ndim == 0:
        loss = out
    else:
        raise ValueError(missing)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss.reshape(())


def _loss(out: Any, batch: Any, loss_fn: Callable | None) -> Tensor:
    return task_loss(out, batch, loss_fn, "gradient statistics (kinds 'kfac'/'fisher_diag') need a loss: pass "
                     "loss_fn(output, batch) -> scalar, or a model that returns .loss")


def resolve_mask(batch: Any, mask: Any) -> Tensor | None:
    """The token mask of ``batch``: ``"auto"`` takes a mapping batch's ``attention_mask`` (else None); a
    tensor is used as is; a callable is called with the batch; None means no mask."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "auto":
            raise ValueError(f"mask must be 'auto', None, a tensor or a callable, got {mask!r}")
        if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
            return batch["attention_mask"]
        return None
    if isinstance(mask, torch.Tensor):
        return mask
    if callable(mask):
        return mask(batch)
    raise TypeError(f"mask must be 'auto', None, a tensor or a callable, got {type(mask).__name__}")


@contextlib.contextmanager
def _eval_mode(model: nn.Module, enabled: bool) -> Iterator[None]:
    flags = {m: m.training for m in model.modules()}
    if enabled:
        model.eval()
    try:
        yield
    finally:
        for m, f in flags.items():
            m.training = f


def collect(
    model: nn.Module,
    batches: Iterable[Any],
    target: Selector = None,
    kinds: Sequence[str] = ("input_cov",),
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    types: tuple[type, ...] | None = (nn.Linear,),
    mask: Any = "auto",
    fisher: Literal["batch", "sample"] = "batch",
    output_bias: bool = False,
    dtype: torch.dtype = torch.float64,
    eval_mode: bool = True,
    progress: bool = False,
) -> dict[str, LayerStats]:
    """Stream ``batches`` through ``model`` and return ``{layer name: LayerStats}`` for the targets.

    Batches may be dicts (``model(**batch)``), tuples/lists (``model(*batch)``) or tensors, or
    anything a custom ``forward(model, batch)`` accepts. The model is put in eval mode for the
    duration (``eval_mode``; training flags restored after); hooks are removed even on error.
    See :class:`StatsCollector` for the other arguments and the module docstring for the kinds.

    Raises:
        CalibrationError: ``batches`` is empty, or a target saw no token / no gradient.
        NumericalError: non-finite data or statistics (naming the layer).
    """
    col = StatsCollector(model, target, kinds, types=types, fisher=fisher, output_bias=output_bias, dtype=dtype)
    n_batches = 0
    with _eval_mode(model, eval_mode), col:
        for batch in _progress(batches, progress):
            col.run(batch, forward=forward, loss_fn=loss_fn, mask=mask)
            n_batches += 1
    if n_batches == 0:
        raise CalibrationError("the calibration data is empty: `batches` yielded no batch")
    return col.results()


def _progress(batches: Iterable[Any], enabled: bool) -> Iterable[Any]:
    if not enabled:
        return batches
    import sys

    from rich.progress import track

    total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    return track(batches, description="calibrating", total=total, disable=not sys.stderr.isatty())
