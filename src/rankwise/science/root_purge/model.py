"""Root Purge's torch side: the linear forecaster backbones (linear, frequency, DLinear), the Root Purge
loss and the training loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor, nn

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_int
from rankwise.science.root_purge.config import ArrayLike, RootPurgeConfig, TrainConfig
from rankwise.science.root_purge.data import _as_tensor, _check_finite


# --------------------------------------------------------------------------------------------
# forecaster modules
# --------------------------------------------------------------------------------------------


class _LinearBackbone(nn.Module):
    """What the linear backbones share: a bias-free map ``core`` on ``(B, L, C)`` -> ``(B, H, C)``, optional
    instance normalisation around it, 2-D inputs ``(B, L)`` read as one channel, and the map's
    equivalent ``(L, H)`` matrix (:meth:`linear_weight`, computed by applying ``core`` to the identity)."""

    L: int
    H: int
    instance_norm: bool

    def core(self, x: Tensor) -> Tensor:  # pragma: no cover - every backbone defines it
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        squeeze = x.ndim == 2
        if squeeze:
            x = x[..., None]
        if self.instance_norm:
            m = x.mean(1, keepdim=True)
            y = self.core(x - m) + m
        else:
            y = self.core(x)
        return y[..., 0] if squeeze else y

    def linear_weight(self) -> Tensor:
        """The ``(L, H)`` matrix of the core map, detached."""
        with torch.no_grad():
            eye = torch.eye(self.L, dtype=next(self.parameters()).dtype)[:, :, None]  # (L batch, L, 1)
            return self.core(eye)[..., 0].detach()


class LinearForecaster(_LinearBackbone):
    """Bias-free linear forecaster, ``x (B, L, C) -> (B, H, C)`` (spec §7, "Linear").

    ``individual=False`` shares one ``(L, H)`` weight across channels (channel independence, CI);
    ``individual=True`` holds one per channel (``weight`` of shape ``(C, L, H)``). The weight is
    initialised like ``nn.Linear(L, H)`` (uniform in ``+-1/sqrt(L)``). ``instance_norm`` subtracts
    the look-back mean and adds it back. ``core`` is the map without IN (what Root Purge applies
    to residuals). A 2-D input ``(B, L)`` is read as one channel.
    """

    def __init__(self, L: int, H: int, channels: int = 1, individual: bool = False, instance_norm: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.L, self.H = check_int("L", L, 1), check_int("H", H, 1)
        self.channels = check_int("channels", channels, 1)
        self.individual = bool(individual)
        self.instance_norm = bool(instance_norm)
        g = self.channels if self.individual else 1
        bound = 1.0 / math.sqrt(self.L)
        w = torch.rand(g, self.L, self.H, generator=generator) * 2 * bound - bound
        self.weight = nn.Parameter(w)

    @classmethod
    def from_weight(cls, W: ArrayLike, instance_norm: bool = True) -> "LinearForecaster":
        w = _as_tensor(W, "W", torch.float32)
        if w.ndim == 2:
            w = w[None]
        if w.ndim != 3:
            raise ValueError(f"W must be (L, H) or (C, L, H), got {tuple(w.shape)}")
        m = cls(w.shape[1], w.shape[2], channels=w.shape[0], individual=w.shape[0] > 1, instance_norm=instance_norm)
        with torch.no_grad():
            m.weight.copy_(w)
        return m

    def core(self, x: Tensor) -> Tensor:
        """The bias-free linear map on (already normalised) ``x (B, L, C)`` -> ``(B, H, C)``."""
        if self.individual:
            if x.shape[-1] != self.weight.shape[0]:
                raise ValueError(f"individual forecaster has {self.weight.shape[0]} channels, input has {x.shape[-1]}")
            return torch.einsum("blc,clh->bhc", x, self.weight)
        return torch.einsum("blc,lh->bhc", x, self.weight[0])

    def linear_weight(self) -> Tensor:
        """The ``(L, H)`` (or ``(C, L, H)``) matrix of the core map, detached."""
        w = self.weight.detach()
        return w[0] if not self.individual else w


class FrequencyLinearForecaster(_LinearBackbone):
    """Frequency-domain linear backbone (spec §7; FITS with ``cutoff``).

    rFFT of the look-back (``L//2+1`` bins, the lowest ``cutoff`` kept), complex linear map to
    ``(L+H)//2+1`` bins, irFFT to length ``L+H``, times ``(L+H)/L``, keep the last ``H`` steps.
    The map is linear in ``x``; :meth:`linear_weight` returns its equivalent ``(L, H)`` matrix.
    """

    def __init__(self, L: int, H: int, cutoff: int | None = None, instance_norm: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.L, self.H = check_int("L", L, 1), check_int("H", H, 1)
        self.instance_norm = bool(instance_norm)
        nin = self.L // 2 + 1
        self.cutoff = nin if cutoff is None else check_int("cutoff (<= L//2+1)", cutoff, 1, nin)
        self.n_out = (self.L + self.H) // 2 + 1
        k = 1.0 / math.sqrt(self.cutoff)
        re = torch.rand(self.cutoff, self.n_out, generator=generator) * 2 * k - k
        im = torch.rand(self.cutoff, self.n_out, generator=generator) * 2 * k - k
        self.weight_re = nn.Parameter(re)
        self.weight_im = nn.Parameter(im)
        self.individual = False

    def core(self, x: Tensor) -> Tensor:
        spec = torch.fft.rfft(x, dim=1)[:, : self.cutoff, :]  # (B, F, C)
        w = torch.complex(self.weight_re, self.weight_im)
        out = torch.einsum("bfc,fo->boc", spec, w)
        y = torch.fft.irfft(out, n=self.L + self.H, dim=1) * ((self.L + self.H) / self.L)
        return y[:, -self.H:, :]



class DLinearForecaster(_LinearBackbone):
    """DLinear baseline: moving-average trend (kernel 25, edge-replicated) + seasonal, two linear heads.

    Linear in ``x`` overall; :meth:`linear_weight` returns the equivalent ``(L, H)`` matrix.
    """

    def __init__(self, L: int, H: int, kernel: int = 25, instance_norm: bool = False,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.L, self.H = check_int("L", L, 1), check_int("H", H, 1)
        self.kernel = check_int("kernel", kernel, 1)
        self.instance_norm = bool(instance_norm)
        self.individual = False
        bound = 1.0 / math.sqrt(self.L)
        self.w_trend = nn.Parameter(torch.rand(self.L, self.H, generator=generator) * 2 * bound - bound)
        self.w_season = nn.Parameter(torch.rand(self.L, self.H, generator=generator) * 2 * bound - bound)

    def _trend(self, x: Tensor) -> Tensor:
        k = self.kernel
        front = x[:, :1, :].expand(-1, (k - 1) // 2, -1)
        back = x[:, -1:, :].expand(-1, k // 2, -1)
        xp = torch.cat([front, x, back], dim=1)  # (B, L + k - 1, C)
        return xp.unfold(1, k, 1).mean(-1)

    def core(self, x: Tensor) -> Tensor:
        trend = self._trend(x)
        season = x - trend
        return torch.einsum("blc,lh->bhc", trend, self.w_trend) + torch.einsum("blc,lh->bhc", season, self.w_season)



# --------------------------------------------------------------------------------------------
# Root Purge loss
# --------------------------------------------------------------------------------------------


def adapt_length(e: Tensor, L: int, generator: torch.Generator | None = None, offsets: Tensor | None = None) -> Tensor:
    """Bring a residual ``e (B, H, C)`` to the input length ``L`` (spec §5).

    ``L == H``: unchanged. ``L < H``: the first ``L`` steps. ``L > H``: zero-pad by ``L - H`` on both
    sides (length ``2L - H``) and take one random contiguous length-``L`` window per (sample,
    channel); the window starts are drawn uniformly from ``[0, L - H]`` with ``generator`` (or
    passed as ``offsets (B, C)``).
    """
    B, H, C = e.shape
    if L == H:
        return e
    if L < H:
        return e[:, :L, :]
    pad = L - H
    ep = torch.nn.functional.pad(e.permute(0, 2, 1), (pad, pad))  # (B, C, 2L-H)
    if offsets is None:
        offsets = torch.randint(0, pad + 1, (B, C), generator=generator)
    idx = offsets.to(e.device)[:, :, None] + torch.arange(L, device=e.device)  # (B, C, L)
    return torch.gather(ep, 2, idx).permute(0, 2, 1)


def _core_and_norm(model: nn.Module, instance_norm: bool | None) -> tuple[Callable[[Tensor], Tensor], bool]:
    core = getattr(model, "core", None)
    model_in = getattr(model, "instance_norm", None)
    if callable(core) and isinstance(model_in, bool):
        # rankwise forecasters: IN handled here, the purge applies the bias-free core (as the official wrapper)
        return core, model_in if instance_norm is None else bool(instance_norm)
    return model, bool(instance_norm)


class RootPurgeLoss(nn.Module):
    """Root Purge training loss, a drop-in wrapper around any forecaster module (spec §5).

    ``loss = MSE(f(x), y) + lam * c^k * MSE(f^k(e), target)`` with ``e = stopgrad(y - f(x))`` brought
    to length ``L`` before each application of ``f``, ``c = max(L/H, 1)``, ``k = order``.

    ``model`` maps ``(B, L, C) -> (B, H, C)``. For rankwise forecasters (they expose ``core`` and
    ``instance_norm``) the loss normalises the windows itself and applies ``core``, exactly as the
    official wrapper. Any other module is applied as is; pass ``instance_norm=True`` to have the
    loss normalise ``x``/``y`` for it (the module must then also be fed normalised inputs at
    inference). The wrapper changes only the training loss, never inference.

    Returns ``dict(loss=, fit=, purge=)`` (scalars; ``purge`` is the unweighted purge MSE).
    """

    def __init__(self, lam: float = 0.3, order: int = 1, target: Literal["zero", "model_zero"] = "zero",
                 instance_norm: bool | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = RootPurgeConfig(lam=lam, order=order, target=target)
        self.instance_norm = instance_norm
        self.generator = generator

    @classmethod
    def from_config(cls, config: RootPurgeConfig, **kw: Any) -> "RootPurgeLoss":
        return cls(lam=config.lam, order=config.order, target=config.target, **kw)

    def forward(self, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        squeeze = x.ndim == 2
        if squeeze:
            x, y = x[..., None], y[..., None]
        if x.ndim != 3 or y.ndim != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
            raise ValueError(f"x must be (B, L, C) and y (B, H, C) with the same B and C; got {tuple(x.shape)}, "
                             f"{tuple(y.shape)}")
        f, use_in = _core_and_norm(model, self.instance_norm)
        if use_in:
            m = x.mean(1, keepdim=True)
            x, y = x - m, y - m
        L, H = x.shape[1], y.shape[1]
        y_hat = f(x)
        fit = torch.nn.functional.mse_loss(y_hat, y)
        cfg = self.config
        if cfg.lam == 0:
            zero = fit.new_zeros(())
            return {"loss": fit, "fit": fit, "purge": zero}
        r = (y - y_hat).detach()
        for _ in range(cfg.order):
            r = f(adapt_length(r, L, self.generator))
        if cfg.target == "zero":
            tgt = torch.zeros_like(r)
        else:
            tgt = f(torch.zeros_like(x)).detach()
        purge = torch.nn.functional.mse_loss(r, tgt)
        c = max(L / H, 1.0)
        return {"loss": fit + cfg.lam * c ** cfg.order * purge, "fit": fit, "purge": purge}


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What :func:`train_forecaster` returns.

    ``history``: per logged step ``{"step", "loss", "fit", "purge"[, "val_mse"]}``; ``best_step``:
    step of the kept weights (the last step without validation data); ``best_val_mse``.
    """

    history: list[dict[str, float]] = field(default_factory=list)
    best_step: int = 0
    best_val_mse: float = float("nan")


def _window_batches(N: int, batch: int, steps: int, g: torch.Generator):
    """Indices of each step's batch: consecutive chunks of a fresh permutation per epoch (drop last)."""
    b = min(batch, N)
    perm = torch.randperm(N, generator=g)
    pos = 0
    for _ in range(steps):
        if pos + b > N:
            perm = torch.randperm(N, generator=g)
            pos = 0
        yield perm[pos: pos + b]
        pos += b


def _as_windows(X: ArrayLike, name: str) -> Tensor:
    x = _as_tensor(X, name, torch.float32)
    if x.ndim == 2:
        x = x[..., None]
    if x.ndim != 3 or x.shape[0] < 1:
        raise ValueError(f"{name} must be (N, T) or (N, T, C) with N >= 1, got {tuple(x.shape)}")
    _check_finite(x, name)
    return x


def train_forecaster(model: nn.Module, X: ArrayLike, Y: ArrayLike, train: TrainConfig = TrainConfig(),
                     purge: RootPurgeConfig | None = None, X_val: ArrayLike | None = None,
                     Y_val: ArrayLike | None = None) -> TrainResult:
    """Train any forecaster module in place with Adam on windows ``X (N, L, C)``, ``Y (N, H, C)``.

    ``purge=None`` trains with plain MSE ("Linear" baseline); a :class:`RootPurgeConfig` adds the
    Root Purge term. ``train.weight_decay`` switches to AdamW (decoupled L2), ``train.l1`` adds
    ``l1 * sum |theta|``. With validation windows, the weights with the lowest validation MSE
    (checked every ``train.val_every`` steps and at the end) are restored at the end.
    Raises :class:`NumericalError` if the loss becomes non-finite.
    """
    x, y = _as_windows(X, "X"), _as_windows(Y, "Y")
    if x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
        raise ValueError(f"X and Y must have the same N and C; got {tuple(x.shape)} and {tuple(y.shape)}")
    has_val = X_val is not None and Y_val is not None
    if has_val:
        xv, yv = _as_windows(X_val, "X_val"), _as_windows(Y_val, "Y_val")
    g = torch.Generator().manual_seed(train.seed)
    crit = RootPurgeLoss.from_config(purge or RootPurgeConfig(lam=0.0), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if train.weight_decay > 0:
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    else:
        opt = torch.optim.Adam(params, lr=train.lr)
    res = TrainResult()
    best_state: dict[str, Tensor] | None = None
    was_training = model.training
    model.train()

    def val_mse() -> float:
        model.eval()
        with torch.no_grad():
            v = float(((model(xv) - yv) ** 2).mean())
        model.train()
        return v

    for step, idx in enumerate(_window_batches(x.shape[0], train.batch_size, train.steps, g), start=1):
        out = crit(model, x[idx], y[idx])
        loss = out["loss"]
        if train.l1 > 0:
            loss = loss + train.l1 * sum(p.abs().sum() for p in params)
        if not torch.isfinite(loss):
            raise NumericalError(f"training loss became non-finite at step {step} (lr={train.lr}); lower the lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % train.val_every == 0 or step == train.steps:
            rec = {"step": float(step), "loss": float(loss.detach()), "fit": float(out["fit"].detach()),
                   "purge": float(out["purge"].detach())}
            if has_val:
                v = val_mse()
                rec["val_mse"] = v
                if not (v >= res.best_val_mse):  # also true while best is NaN
                    res.best_val_mse, res.best_step = v, step
                    best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
            res.history.append(rec)
    if best_state is not None:
        model.load_state_dict(best_state)
    elif not has_val:
        res.best_step = train.steps
    model.train(was_training)
    return res


def fit_linear_ensemble(X: Tensor, Y: Tensor, lams: Sequence[float] | Tensor, train: TrainConfig = TrainConfig(),
                        order: int = 1, X_val: Tensor | None = None, Y_val: Tensor | None = None,
                        instance_norm: bool = True,
                        weight_decays: Sequence[float] | None = None) -> tuple[Tensor, Tensor]:
    """Train ``S`` independent bias-free linear forecasters at once (vectorised sweeps).

    ``X (S, N, L)``, ``Y (S, N, H)``: member ``s`` trains on its own windows (one channel) with its
    own Root Purge weight ``lams[s]`` (0 = plain MSE), by Adam with the same hyper-parameters.
    Each member's gradient is exactly that of training it alone (losses are summed); the batch
    indices are shared across members. With ``S = 1`` the result equals
    :func:`train_forecaster` on a :class:`LinearForecaster` with the same seed (same draws).
    ``weight_decays`` (one per member, default ``train.weight_decay`` for all) applies AdamW's
    decoupled decay ``W <- W (1 - lr * wd)`` before each Adam update, member by member.
    Returns ``(W (S, L, H), best_val_mse (S,))`` (validation selection per member as in
    :func:`train_forecaster`).
    """
    x = _as_tensor(X, "X", torch.float32)
    y = _as_tensor(Y, "Y", torch.float32)
    if x.ndim != 3 or y.ndim != 3 or x.shape[:2] != y.shape[:2]:
        raise ValueError(f"X must be (S, N, L) and Y (S, N, H) with the same S, N; got {tuple(x.shape)}, {tuple(y.shape)}")
    _check_finite(x, "X")
    _check_finite(y, "Y")
    S, N, L = x.shape
    H = y.shape[2]
    lam = torch.as_tensor(lams, dtype=torch.float32).reshape(-1)
    if lam.numel() != S or bool((lam < 0).any()) or not bool(torch.isfinite(lam).all()):
        raise ValueError(f"lams must hold {S} finite values >= 0, got {lam.tolist()}")
    check_int("order", order, 1)
    g_init = torch.Generator().manual_seed(train.seed)
    bound = 1.0 / math.sqrt(L)
    # same initial draws as S LinearForecaster(L, H, generator=g_init) built one after another
    W = nn.Parameter(torch.stack([torch.rand(1, L, H, generator=g_init)[0] * 2 * bound - bound for _ in range(S)]))
    g = torch.Generator().manual_seed(train.seed)
    wd = torch.as_tensor([train.weight_decay] * S if weight_decays is None else list(weight_decays),
                         dtype=torch.float32).reshape(-1)
    if wd.numel() != S or bool((wd < 0).any()) or not bool(torch.isfinite(wd).all()):
        raise ValueError(f"weight_decays must hold {S} finite values >= 0, got {wd.tolist()}")
    decay = (1.0 - train.lr * wd)[:, None, None]
    opt = torch.optim.Adam([W], lr=train.lr)
    has_val = X_val is not None and Y_val is not None
    if has_val:
        xv = _as_tensor(X_val, "X_val", torch.float32)
        yv = _as_tensor(Y_val, "Y_val", torch.float32)
        if instance_norm:
            mv = xv.mean(2, keepdim=True)
            xv, yv = xv - mv, yv - mv
    best = torch.full((S,), float("inf"))
    best_W = W.detach().clone()
    c = max(L / H, 1.0)
    for step, idx in enumerate(_window_batches(N, train.batch_size, train.steps, g), start=1):
        xb, yb = x[:, idx], y[:, idx]  # (S, B, L)
        if instance_norm:
            m = xb.mean(2, keepdim=True)
            xb, yb = xb - m, yb - m
        yh = torch.bmm(xb, W)
        fit = ((yh - yb) ** 2).mean(dim=(1, 2))  # (S,)
        loss_s = fit
        if bool((lam > 0).any()):
            r = (yb - yh).detach()
            for _ in range(order):
                # adapt_length works on (B, H, C): members play the role of channels
                r = adapt_length(r.permute(1, 2, 0), L, g).permute(2, 0, 1)
                r = torch.bmm(r, W)
            loss_s = loss_s + lam * c ** order * (r ** 2).mean(dim=(1, 2))
        loss = loss_s.sum()
        if train.l1 > 0:
            loss = loss + train.l1 * W.abs().sum()
        if not torch.isfinite(loss):
            raise NumericalError(f"ensemble training loss became non-finite at step {step} (lr={train.lr})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if bool((wd > 0).any()):
            with torch.no_grad():
                W.mul_(decay)
        opt.step()
        if has_val and (step % train.val_every == 0 or step == train.steps):
            with torch.no_grad():
                v = ((torch.bmm(xv, W) - yv) ** 2).mean(dim=(1, 2))
            better = v < best
            best = torch.where(better, v, best)
            best_W[better] = W.detach()[better]
    if not has_val:
        return W.detach().clone(), torch.full((S,), float("nan"))
    return best_W, best
