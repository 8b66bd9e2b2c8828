"""Per-window validation losses of a causal LM: the paired samples of the language-model reproductions.

:func:`rankwise.train.pretrain.eval_loss` returns one number (the mean over every predicted token);
a claim that compares two models on the same validation windows needs the loss of each window, so
that the harness can bootstrap the paired difference over the windows (and the seeds).
"""

from __future__ import annotations

import torch
from torch import nn

from rankwise.core.errors import NumericalError


@torch.no_grad()
def window_losses(model: nn.Module, windows: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """Mean next-token cross-entropy (nats, float64) of every window of ``windows`` (n, T): shape (n,).

    All windows have the same length, so the mean of the result is the mean over every predicted token
    (what ``eval_loss`` returns, up to float rounding). ``model(input_ids=...)`` must return ``.logits``;
    it runs in eval mode, its train/eval mode restored after. A non-finite loss raises
    :class:`~rankwise.core.errors.NumericalError`.
    """
    was = model.training
    model.eval()
    out = []
    try:
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch).logits[:, :-1].double()
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)
            if not torch.isfinite(nll).all():
                raise NumericalError("window_losses: the model produced a non-finite loss")
            out.append(nll)
    finally:
        model.train(was)
    return torch.cat(out)
