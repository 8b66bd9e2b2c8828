"""ULD-Net's training recipe: warm-up with exact normalisation, a switch (hard or blended) to
PolyNorm, and the variance-aware penalties ``L1 = lam1 mean_i v_i``, ``L2 = lam2 mean_i (v_i - 1)^2``
over every PolyNorm input's relative variance (samples x layers)."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import Tensor, nn

from rankwise.core.validate import check_int, check_number
from rankwise.science.uldnet.config import ULDConfig
from rankwise.science.uldnet.model import polynorms

__all__ = ["TrainResult", "mix_schedule", "train", "variance_penalty"]


@dataclasses.dataclass
class TrainResult:
    """``loss``/``penalty``: mean cross-entropy and mean penalty per epoch; ``mix``: PolyNorm's blend
    per epoch (0 = exact normalisation, 1 = PolyNorm); ``switch_epoch``: first epoch with ``mix > 0``."""

    loss: list[float]
    penalty: list[float]
    mix: list[float]
    switch_epoch: int | None


def mix_schedule(epochs: int, warmup_frac: float, blend_frac: float) -> list[float]:
    """PolyNorm's blend per epoch: 0 for ``round(warmup_frac * epochs)`` epochs, then a linear ramp over
    ``round(blend_frac * epochs)`` epochs (none: a hard switch), then 1."""
    w, b = round(warmup_frac * epochs), round(blend_frac * epochs)
    return [0.0 if e < w else (min(1.0, (e - w + 1) / (b + 1)) if e < w + b else 1.0) for e in range(epochs)]


def variance_penalty(model: nn.Module, lam1: float, lam2: float) -> Tensor:
    """``lam1 mean(v) + lam2 mean((v - 1)^2)`` over the ``v`` the PolyNorms of ``model`` saw in the
    last training forward (zero when none did)."""
    vs = [m.last_v for m in polynorms(model) if m.last_v is not None]
    if not vs:
        return torch.zeros(())
    v = torch.cat(vs)
    return lam1 * v.mean() + lam2 * (v - 1.0).pow(2).mean()


def train(model: nn.Module, loader: Iterable[tuple[Tensor, Tensor]], epochs: int = 40,
          config: ULDConfig | None = None, lr: float = 3e-3, weight_decay: float = 1e-2) -> TrainResult:
    """Train ``model`` (cross-entropy + the variance penalties) with AdamW, switching every PolyNorm
    from exact normalisation to PolyNorm on the schedule of ``config`` (default: the PolyNorms' own).

    ``loader``: re-iterable batches ``(x, y)`` (a DataLoader, a list). Leaves every PolyNorm at
    ``mix = 1`` when the schedule ends there, and the model in eval mode."""
    epochs = check_int("train.epochs", epochs, 1)
    check_number("train.lr", lr, 0.0, low_open=True)
    norms = polynorms(model)
    cfg = config or (norms[0].config if norms else ULDConfig())
    sched = mix_schedule(epochs, cfg.warmup_frac, cfg.blend_frac) if cfg.norm == "polynorm" else [0.0] * epochs
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    res = TrainResult([], [], [], None)
    model.train()
    for epoch, mix in enumerate(sched):
        for m in norms:
            m.mix.fill_(mix)
        if mix > 0 and res.switch_epoch is None:
            res.switch_epoch = epoch
        tot = pen_tot = 0.0
        n = 0
        for xb, yb in loader:
            for m in norms:
                m.last_v = None
            loss = nn.functional.cross_entropy(model(xb), yb)
            pen = variance_penalty(model, cfg.lam1, cfg.lam2) if mix > 0 else torch.zeros(())
            if not torch.isfinite(loss + pen):
                raise FloatingPointError(f"ULD-Net training diverged at epoch {epoch} (loss {float(loss)})")
            opt.zero_grad(set_to_none=True)
            (loss + pen).backward()
            opt.step()
            tot += float(loss.detach()) * len(yb)
            pen_tot += float(pen.detach()) * len(yb)
            n += len(yb)
        res.loss.append(tot / max(n, 1))
        res.penalty.append(pen_tot / max(n, 1))
        res.mix.append(mix)
    for m in norms:
        m.last_v = None
    model.eval()
    return res
