"""The calibration-gradient pass that adapter methods share: a few batches, ``dL/dW`` of chosen weights.

Methods that read gradients of the base weights before (or while) they adapt a model (CDKA's alignment
and gradient initialisation, E²LoRA's proxy entropies, DAF's Taylor sensitivity) all run the same
pass: switch adapters off (or not), freeze everything but the weights of interest, run the loss on a
few batches, backpropagate, accumulate a per-layer reduction of each gradient in float64, and put
every ``requires_grad`` flag, ``.grad`` field, train/eval mode and ``disabled`` flag back, also when
an error interrupts the pass. :func:`gradient_pass` is that pass; :func:`mean_gradients` the average
and checks that follow it when the gradients themselves are wanted; :func:`given_gradients` checks
gradients a user computed elsewhere and passes instead.

    sums, n = gradient_pass(model, {"fc": model.fc.weight}, batches, max_batches=4)
    grads = mean_gradients(sums, n, who="CDKA")        # {"fc": G (d_out, d_in) float64}
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from rankwise.core.errors import NumericalError

__all__ = ["LossFn", "NonFiniteLoss", "Reduce", "default_loss", "given_gradients", "gradient_pass",
           "gradient_scope", "mean_gradients"]

#: ``loss_fn(model, batch) -> scalar tensor``
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: ``reduce(grad, weight) -> tensor``: what is accumulated (in float64) per layer and batch
Reduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteLoss(NumericalError):
    """The calibration loss was NaN or inf on batch ``batch`` (its value: ``value``)."""

    def __init__(self, message: str, batch: int, value: float) -> None:
        super().__init__(message)
        self.batch = batch
        self.value = value


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch, ``model(*batch).loss`` for a tuple, ``model(batch).loss``
    otherwise: the calibration loss of methods that read gradients (pass ``loss_fn`` for anything else)."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError("the model's output has no .loss; pass loss_fn=lambda model, batch: <scalar loss>")
    return loss


def _full_gradient(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.to(torch.float64)


@contextlib.contextmanager
def gradient_scope(model: nn.Module, weights: Mapping[str, torch.Tensor], *, disable: Sequence[nn.Module] = (),
                   train: bool = False) -> Iterator[None]:
    """Inside: only ``weights`` require gradients (their ``.grad`` cleared), the ``disable`` layers are
    switched off (``layer.disabled = True``) and the model is in train (``train``) or eval mode. On exit,
    normal or not, every flag, ``.grad`` field, ``disabled`` flag and module mode is as before."""
    flags = {id(p): (p, p.requires_grad) for p in model.parameters()}
    for w in weights.values():  # a weight outside model.parameters() is restored too
        flags.setdefault(id(w), (w, w.requires_grad))
    grads_before = {n: w.grad for n, w in weights.items()}
    modes = {m: m.training for m in model.modules()}
    disabled = [(layer, layer.disabled) for layer in disable]
    try:
        for p, _ in flags.values():
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
            w.grad = None
        for layer, _ in disabled:
            layer.disabled = True
        model.train(train)
        yield
    finally:
        for p, flag in flags.values():
            p.requires_grad_(flag)
        for n, w in weights.items():
            w.grad = grads_before[n]
        for layer, d in disabled:
            layer.disabled = d
        for m, mode in modes.items():
            m.training = mode


def gradient_pass(model: nn.Module, weights: Mapping[str, torch.Tensor], batches: Iterable[Any],
                  loss_fn: LossFn | None = None, *, max_batches: int | None = None,
                  disable: Sequence[nn.Module] = (), train: bool = False, seed: int | None = None,
                  reduce: Reduce | None = None, needs: str = "", who: str = "the calibration"
                  ) -> tuple[dict[str, torch.Tensor], int]:
    """Sum ``reduce(dL/dW, W)`` over the first ``max_batches`` batches (all with None), per weight, in float64.

    ``weights``: ``{layer name: W}`` (parameters of ``model``); ``loss_fn(model, batch) -> scalar``
    (default :func:`default_loss`); ``reduce`` (default: the gradient itself, so the sums have W's
    shape); ``disable``: layers switched off during the pass (``.disabled``); ``train``: the module
    mode; ``seed``: when given, the pass runs on a forked RNG seeded with it (dropout masks in train
    mode), the caller's RNG untouched. Returns ``(sums, batches used)``; the model's flags, ``.grad``
    fields, modes and ``disabled`` flags are restored (see :func:`gradient_scope`).

    Raises TypeError for a non-callable ``loss_fn`` or a non-scalar loss, :class:`NonFiniteLoss`
    (``"calibration loss is <v> on batch <i>; <needs>"``) for a NaN/inf loss, and ValueError when the
    loss does not depend on the weights (``who`` names the method in the message).
    """
    loss_fn = default_loss if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    reduce = _full_gradient if reduce is None else reduce
    sums = {n: torch.zeros_like(reduce(torch.zeros_like(w), w), dtype=torch.float64) for n, w in weights.items()}
    count = 0
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with gradient_scope(model, weights, disable=disable, train=train), rng:
        if seed is not None:
            torch.manual_seed(seed)
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}")
            if not bool(torch.isfinite(loss.detach())):
                value = float(loss.detach())
                raise NonFiniteLoss(f"calibration loss is {value} on batch {i}" + (f"; {needs}" if needs else ""),
                                    i, value)
            if not loss.requires_grad:
                raise ValueError(f"the calibration loss does not depend on the targeted weights (a detached graph or "
                                 f"no_grad); {who} needs dL/dW of every targeted layer")
            (loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss).backward()
            for n, w in weights.items():
                if w.grad is not None:
                    sums[n] += reduce(w.grad.detach(), w.detach()).to(torch.float64)
                    w.grad = None
            count += 1
    return sums, count


def mean_gradients(sums: Mapping[str, torch.Tensor], count: int, *, who: str, zero_hint: str) -> dict[str, torch.Tensor]:
    """``sums / count`` per layer, checked: no batch (ValueError), NaN/inf (NumericalError) or an exactly
    zero gradient (ValueError ending with ``zero_hint``) are reported naming the layer."""
    if count == 0:
        raise ValueError(f"the calibration loader yielded no batch; {who} needs at least one to estimate G")
    out = {}
    for n, g in sums.items():
        g = g / count
        if not bool(torch.isfinite(g).all()):
            raise NumericalError(f"layer {n!r}: the calibration gradient holds NaN or inf")
        if float(g.abs().max()) == 0.0:
            raise ValueError(f"layer {n!r}: the calibration gradient is exactly zero {zero_hint}")
        out[n] = g
    return out


def given_gradients(gradients: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, int]], *,
                    check: bool = False, zero_hint: str = "") -> dict[str, torch.Tensor]:
    """Precomputed gradients ``{layer: G}`` for the layers of ``shapes`` (``{layer: (d_out, d_in)}``), detached,
    in float64. ValueError for a missing layer or a wrong shape; with ``check``, NumericalError for NaN/inf
    and ValueError (ending with ``zero_hint``) for an exactly zero gradient, naming the layer."""
    missing = [n for n in shapes if n not in gradients]
    if missing:
        raise ValueError(f"gradients lacks layers {missing[:5]}")
    out = {}
    for n, shape in shapes.items():
        g = gradients[n]
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(shape):
            raise ValueError(f"gradients[{n!r}] must be a tensor of shape {tuple(shape)}")
        g = g.detach().to(torch.float64)
        if check and not bool(torch.isfinite(g).all()):
            raise NumericalError(f"layer {n!r}: the gradient holds NaN or inf")
        if check and float(g.abs().max()) == 0.0:
            raise ValueError(f"layer {n!r}: the gradient is exactly zero {zero_hint}".rstrip())
        out[n] = g
    return out
