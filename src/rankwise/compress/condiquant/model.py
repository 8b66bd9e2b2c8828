"""``condition_model``: CondiQuant on every selected Linear / Conv2d of a model, in place.

The calibration inputs of each layer are summarised once, in the original model, by ``H = X^T X`` from
:class:`rankwise.core.stats.StatsCollector` (float64; rows fed through :meth:`StatsCollector.update` after a
conv's input is laid out as patches, channels last). Every layer is then conditioned on its own ``H``
(:func:`~rankwise.compress.condiquant.condition.condition_weight`), and only when every layer has
succeeded are the new weights written back, so that a failure leaves the model unchanged. Shapes, dtypes,
biases and the parameter count never change: no module is added (zero inference overhead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.compress.condiquant.condition import LayerResult, condition_weight
from rankwise.compress.condiquant.config import CondiQuantConfig
from rankwise.core.errors import NumericalError, SelectionError
from rankwise.core.select import available_names, matcher, select
from rankwise.core.stats import StatsCollector, default_forward

log = logging.getLogger(__name__)
Tensor = torch.Tensor

__all__ = ["CondiQuantReport", "collect_xtx", "condition_model", "layer_matrix", "layer_rows", "target_layers"]


@dataclasses.dataclass
class CondiQuantReport:
    """What :func:`condition_model` did: one :class:`LayerResult` per matrix (a grouped conv has one per
    group when ``grouped="per_group"``), the config and the wall time."""

    layers: list[LayerResult]
    config: dict[str, Any]
    seconds: float

    @property
    def conditioned(self) -> list[LayerResult]:
        return [r for r in self.layers if r.status == "conditioned"]

    def kappas(self, after: bool = True) -> list[float]:
        """Per-matrix kappa after (or before) conditioning, skipped layers excluded."""
        return [r.kappa_after if after else r.kappa_before for r in self.layers if not r.status.startswith("skipped")]

    def median_kappa(self, after: bool = True) -> float:
        k = self.kappas(after)
        return statistics.median(k) if k else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"layers": [r.to_dict() for r in self.layers], "config": self.config, "seconds": self.seconds,
                "median_kappa_before": _finite(self.median_kappa(False)),
                "median_kappa_after": _finite(self.median_kappa(True))}

    def summary(self) -> str:
        """One line per matrix: name, shape, kappa before -> after, lambda, relative output error."""
        out = []
        for r in self.layers:
            out.append(f"{r.name:<28} {r.shape[0]:>4}x{r.shape[1]:<4} kappa {r.kappa_before:10.4g} -> "
                       f"{r.kappa_after:10.4g}  lam {r.lam:<6g} err {r.rel_err:.2e}  {r.status}")
        return "\n".join(out)


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _groups(m: nn.Module) -> int:
    return int(getattr(m, "groups", 1))


def target_layers(model: nn.Module, cfg: CondiQuantConfig) -> tuple[list[tuple[str, nn.Module]], list[LayerResult]]:
    """The layers to condition, and the skipped ones (grouped convs with ``grouped="skip"``, convs with a
    non-zero padding mode) as ``LayerResult`` rows. Raises :class:`SelectionError` listing the module names
    when no layer is left."""
    hits = select(model, cfg.target, cfg.layer_types, allow_empty=True)
    skip = matcher(list(cfg.skip)) if cfg.skip else None
    keep, skipped = [], []
    for name, m in hits:
        if skip is not None and skip(name, m):
            continue
        why = None
        if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros":
            why = f"skipped: padding_mode={m.padding_mode!r} is not a linear map of unfolded patches"
        elif _groups(m) > 1 and cfg.grouped == "skip":
            why = f"skipped: grouped conv (groups={_groups(m)}; grouped='skip')"
        if why:
            W = layer_matrix(m)
            skipped.append(LayerResult(name, (int(W.shape[0]), int(W.shape[1])), math.nan, math.nan, 0.0, 0.0, 0, why))
        else:
            keep.append((name, m))
    if not keep:
        names = available_names(model, cfg.layer_types)
        raise SelectionError(f"CondiQuant found no layer to condition (types {[t.__name__ for t in cfg.layer_types]}, "
                             f"target {cfg.target!r}, skip {list(cfg.skip)}); available: {names[:40]}")
    return keep, skipped


def layer_rows(m: nn.Module, x: Tensor) -> Tensor:
    """The layer's calibration input as rows of ``X`` (``tokens x n``): a Linear's last dim; a conv's
    unfolded patches ``(B L) x (c_in k_h k_w)`` (a 1x1 conv at stride 1: its pixels, channels last)."""
    if isinstance(m, nn.Conv2d):
        if x.ndim == 3:
            x = x.unsqueeze(0)
        if m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding in ((0, 0), "valid"):
            return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
        if isinstance(m.padding, str):
            raise ValueError(f"conv padding={m.padding!r} is not supported by CondiQuant; give explicit padding")
        u = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        return u.transpose(1, 2).reshape(-1, u.shape[1])
    return x.reshape(-1, x.shape[-1])


def layer_matrix(m: nn.Module) -> Tensor:
    """The spec's ``W`` (``n x m``, input x output): ``weight.T`` of a Linear, ``weight.reshape(c_out, -1).T``
    of a conv (a grouped conv: the ``(c_in/g k_h k_w) x c_out`` stack of its groups' matrices)."""
    w = m.weight.detach()
    return w.reshape(w.shape[0], -1).T


def _units(name: str, m: nn.Module, H: Tensor) -> list[tuple[str, Tensor, Tensor, slice]]:
    """``(unit name, W0, H block, output slice)`` per matrix of the layer (per group of a grouped conv)."""
    W = layer_matrix(m)
    g = _groups(m)
    if g == 1:
        return [(name, W, H, slice(None))]
    n_g, m_g = W.shape[0], W.shape[1] // g
    # unfold orders patches channel-major, so group j's inputs are the contiguous block j of H
    return [(f"{name}[{j}]", W[:, j * m_g:(j + 1) * m_g], H[j * n_g:(j + 1) * n_g, j * n_g:(j + 1) * n_g],
             slice(j * m_g, (j + 1) * m_g)) for j in range(g)]


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    flags = {mod: mod.training for mod in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for mod, f in flags.items():
            mod.training = f


def collect_xtx(model: nn.Module, layers: list[tuple[str, nn.Module]], calib: Iterable[Any],
                forward: Callable[[nn.Module, Any], Any] | None = None) -> dict[str, Tensor]:
    """``{layer: X^T X}`` (float64, unnormalised sums) of the layers' inputs over ``calib``.

    Raises ``ValueError`` for empty calibration data or non-finite activations (naming the layer)."""
    names = {n for n, _ in layers}
    col = StatsCollector(model, lambda n, _m: n in names, ("input_cov",), types=None)
    handles = []
    fwd = forward or default_forward

    def make_hook(lname: str) -> Callable:
        def hook(mod: nn.Module, args: tuple, _out: Any) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(f"layer {lname!r} was called without a tensor input")
            col.update(lname, layer_rows(mod, args[0].detach()))
        return hook

    n_batches = 0
    try:
        for n, mod in layers:
            handles.append(mod.register_forward_hook(make_hook(n)))
        with _eval(model), torch.no_grad():
            for batch in calib:
                fwd(model, batch)
                n_batches += 1
    except NumericalError as e:
        raise ValueError(f"CondiQuant calibration: {e}") from e
    finally:
        for h in handles:
            h.remove()
    if n_batches == 0:
        raise ValueError("CondiQuant calibration data is empty: the loader yielded no batch")
    return {n: st.input_cov(normalized=False) for n, st in col.results().items()}


def condition_model(model: nn.Module, calib: Iterable[Any], config: CondiQuantConfig | None = None, *,
                    forward: Callable[[nn.Module, Any], Any] | None = None) -> CondiQuantReport:
    """Condition every selected layer of ``model`` in place (spec Eq. 7; see the package docstring).

    ``calib``: an iterable of batches (``model(batch)``, ``model(*batch)`` or ``model(**batch)``, or a custom
    ``forward(model, batch)``). Returns a :class:`CondiQuantReport` (kappa before/after, lambda and output
    error per layer). Warns (``logging``) for a rank-deficient layer it could not lift. The model is changed
    only after every layer has been computed.
    """
    cfg = config or CondiQuantConfig()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    t0 = time.perf_counter()
    layers, results = target_layers(model, cfg)
    H = collect_xtx(model, layers, calib, forward)
    plan: list[tuple[nn.Module, Tensor]] = []
    for name, mod in layers:
        W_new = layer_matrix(mod).to(torch.float64).clone()
        for uname, W0, Hu, cols in _units(name, mod, H[name]):
            r = condition_weight(uname, W0, Hu, cfg)
            if r.status.startswith("skipped"):
                log.warning("CondiQuant: layer %s has kappa = inf and no lift within the output budget; skipped", uname)
            W_new[:, cols] = r.W
            r.W = None
            results.append(r)
        plan.append((mod, W_new))
    with torch.no_grad():
        for mod, W_new in plan:
            w = mod.weight
            w.copy_(W_new.T.reshape(w.shape).to(w.dtype))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    results.sort(key=lambda r: order.get(r.name.split("[")[0], len(order)))
    cfg_d = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
             for k, v in dataclasses.asdict(cfg).items()}
    return CondiQuantReport(results, cfg_d, time.perf_counter() - t0)
