"""The decomposed K / V projections: trainable thresholded factors, then folded low-rank latents.

A projection ``W`` (``out x in``, ``nn.Linear`` layout) is split into ``G`` row groups of ``d = out / G``
rows (K: one group per KV head; V: one group, the joint decomposition). Each group has its SVD
``W_g = U_g diag(s_g) V_g`` (``U_g``: ``d x q``, ``V_g``: ``q x in``, ``q = min(d, in)``) and a threshold
``alpha_g``; the output of group ``g`` is ``U_g (f(s_g; alpha_g) * (V_g x))`` (U is block-diagonal over
groups by construction: each group owns its ``U_g``).

:class:`ThresholdedProj` trains ``U, s, V, alpha``; :meth:`ThresholdedProj.fold` returns a
:class:`LatentProj`: a :class:`~rankwise.core.layers.LowRankLinear` whose down factor stacks the kept rows
of every group (the cached latent, ``sum_g r_g`` numbers per token) and whose up factor is block-diagonal
(kept so by a fixed mask while it is fine-tuned).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.compress.star_kv.threshold import soft_threshold, threshold_rank
from rankwise.core.layers import LowRankLinear
from rankwise.core.linalg import truncated_svd

Tensor = torch.Tensor

__all__ = ["ThresholdedProj", "LatentProj", "group_svd"]


def group_svd(W: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group SVD of ``W`` (``out x in``): ``U (G, d, q)``, ``S (G, q)``, ``Vh (G, q, in)`` in float64."""
    out, n = W.shape
    d = out // groups
    q = min(d, n)
    Us, Ss, Vs = [], [], []
    for g in range(groups):
        U, S, Vh = truncated_svd(W[g * d:(g + 1) * d], q)
        Us.append(U), Ss.append(S), Vs.append(Vh)
    return torch.stack(Us), torch.stack(Ss), torch.stack(Vs)


class ThresholdedProj(nn.Module):
    """A linear projection as per-group thresholded SVD factors (the training-time STAR-KV layer).

    Args:
        linear: the ``nn.Linear`` to decompose (``out`` divisible by ``groups``).
        groups: number of row groups (KV heads for K, 1 for V).
        sharpness, c: the soft threshold's ``s0`` and ``c``.

    With ``alpha = 0`` and ``sharpness -> inf`` the layer reproduces ``linear`` (``f(s) -> s``).
    """

    def __init__(self, linear: nn.Linear, groups: int, sharpness: float = 50.0, c: float = 0.0):
        super().__init__()
        out, n = linear.out_features, linear.in_features
        if out % groups:
            raise ValueError(f"{groups} groups do not divide {out} output features")
        W = linear.weight
        U, S, Vh = group_svd(W.detach(), groups)
        dt, dev = W.dtype, W.device
        self.in_features, self.out_features, self.groups = n, out, groups
        self.sharpness, self.c = float(sharpness), float(c)
        self.U = nn.Parameter(U.to(dev, dt))
        self.s = nn.Parameter(S.to(dev, dt))
        self.V = nn.Parameter(Vh.to(dev, dt))
        self.alpha = nn.Parameter(torch.zeros(groups, device=dev, dtype=dt))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.thresholding = True

    @property
    def group_size(self) -> int:
        return self.out_features // self.groups

    def scales(self) -> Tensor:
        """``f(s; alpha)`` (``G x q``), or ``s`` itself with thresholding off."""
        if not self.thresholding:
            return self.s
        return soft_threshold(self.s, self.alpha.unsqueeze(-1), self.sharpness, self.c)

    def forward(self, x: Tensor) -> Tensor:
        G, q, n = self.V.shape
        z = F.linear(x, self.V.reshape(G * q, n)).unflatten(-1, (G, q)) * self.scales()
        y = torch.einsum("...gq,gdq->...gd", z, self.U).flatten(-2)
        return y if self.bias is None else y + self.bias

    def ranks(self) -> list[int]:
        """``r_g = #{i : s_gi > alpha_g}`` per group."""
        return [int(r) for r in threshold_rank(self.s.detach(), self.alpha.detach())]

    def dense(self) -> Tensor:
        """The effective ``(out, in)`` weight at the current thresholds (float64)."""
        sc = self.scales().detach().double()
        return torch.einsum("gdq,gq,gqn->gdn", self.U.detach().double(), sc, self.V.detach().double()).reshape(
            self.out_features, self.in_features)

    def fold(self, mode: str = "shifted", min_rank: int | None = None, name: str = "",
             rank_multiple: int = 1) -> "LatentProj":
        """Fold the thresholded singular values into ``V`` and drop the dead ranks.

        ``mode="shifted"``: kept rows of ``V`` scaled by ``(s_i - alpha)_+`` (the official code);
        ``"exact"``: by ``f(s_i; alpha)``. ``min_rank`` keeps at least that many leading directions per
        group (those below the threshold scaled by ``s_i``); ``rank_multiple`` rounds every non-zero rank up
        to a multiple of it (kernel-friendly widths, capped at the group's full rank), the same way. A layer
        whose every group has rank 0 keeps its largest direction (with a warning): a zero-width latent
        cannot be cached.
        """
        s, a = self.s.detach(), self.alpha.detach()
        above = s > a.unsqueeze(-1)
        keep = [torch.nonzero(above[g]).flatten() for g in range(self.groups)]
        q = s.shape[1]
        for g in range(self.groups):  # top up with the largest directions below the threshold
            want = max(len(keep[g]), min(min_rank or 0, q))
            if want and rank_multiple > 1:
                want = min(q, -(-want // rank_multiple) * rank_multiple)
            need = want - len(keep[g])
            if need > 0:
                below = torch.nonzero(~above[g]).flatten()
                extra = below[s[g, below].argsort(descending=True)[:need]]
                keep[g] = torch.cat([keep[g], extra]).sort().values
        if sum(len(k) for k in keep) == 0:
            g = int(s.max(1).values.argmax())
            keep[g] = s[g].argmax().reshape(1)
            warnings.warn(f"STAR-KV: every group of {name or 'a projection'} reached rank 0; keeping its "
                          "largest direction", RuntimeWarning, stacklevel=2)
        full = self.scales().detach() if mode == "exact" else (s - a.unsqueeze(-1)).clamp_min(0)
        return self._latent(keep, torch.where(above, full, s))

    def truncate(self, ranks: list[int]) -> "LatentProj":
        """The plain truncated SVD at fixed per-group ``ranks`` (no threshold; baselines)."""
        if len(ranks) != self.groups or any(not 0 <= r <= self.s.shape[1] for r in ranks) or sum(ranks) == 0:
            raise ValueError(f"ranks {ranks} do not fit {self.groups} groups of at most {self.s.shape[1]}")
        s = self.s.detach()
        return self._latent([s[g].argsort(descending=True)[:r].sort().values for g, r in enumerate(ranks)], s)

    def _latent(self, keep: list[Tensor], scale: Tensor) -> "LatentProj":
        """Down rows ``scale_i V_i`` and block-diagonal up columns ``U_i`` for the kept indices of each group."""
        downs, ups = [], []
        d = self.group_size
        U, V = self.U.detach(), self.V.detach()
        for g, idx in enumerate(keep):
            if len(idx) == 0:
                continue
            downs.append(scale[g, idx, None] * V[g, idx])
            up = torch.zeros(self.out_features, len(idx), dtype=U.dtype, device=U.device)
            up[g * d:(g + 1) * d] = U[g][:, idx]
            ups.append(up)
        layer = LowRankLinear.from_factors(torch.cat(downs), torch.cat(ups, 1),
                                           None if self.bias is None else self.bias.detach())
        return LatentProj(layer, [len(k) for k in keep], d)


class LatentProj(nn.Module):
    """A folded STAR-KV projection: ``y = (A * mask) (B x) + b``; the cache stores ``B x``.

    ``factors``: a :class:`LowRankLinear` (``down`` = ``B``, ``sum(ranks) x in``; ``up`` = ``A``,
    ``out x sum(ranks)``, block-diagonal); ``ranks``: the latent width of each group (KV head for K;
    one entry for V); ``group_size``: output rows per group.
    """

    def __init__(self, factors: LowRankLinear, ranks: list[int], group_size: int):
        super().__init__()
        if sum(ranks) != factors.rank or len(ranks) * group_size != factors.out_features:
            raise ValueError(f"ranks {ranks} x group size {group_size} do not fit factors of rank {factors.rank}, "
                             f"out {factors.out_features}")
        self.factors = factors
        self.ranks = list(ranks)
        self.group_size = group_size
        mask = torch.zeros(factors.out_features, factors.rank, dtype=factors.up.weight.dtype,
                           device=factors.up.weight.device)
        col = 0
        for g, r in enumerate(ranks):
            mask[g * group_size:(g + 1) * group_size, col:col + r] = 1
            col += r
        self.register_buffer("mask", mask, persistent=False)
        self.in_features, self.out_features = factors.in_features, factors.out_features

    def latent(self, x: Tensor) -> Tensor:
        """The cached latent ``B x`` (``(..., sum(ranks))``)."""
        return self.factors.down(x)

    def up_weight(self) -> Tensor:
        """The block-diagonal up factor ``A * mask`` (``out x sum(ranks)``)."""
        return self.factors.up.weight * self.mask

    def reconstruct(self, z: Tensor) -> Tensor:
        """Full outputs from latents: ``(A * mask) z + b``."""
        return F.linear(z, self.up_weight(), self.factors.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.reconstruct(self.latent(x))

    def dense(self) -> Tensor:
        """The ``(out, in)`` weight (float64)."""
        return self.up_weight().detach().double() @ self.factors.down.weight.detach().double()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, ranks={self.ranks}"
