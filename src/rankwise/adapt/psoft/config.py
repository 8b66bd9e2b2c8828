"""PSOFT configuration: :class:`PSOFTConfig` and the parameter count per adapted matrix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from rankwise.core.adapters import CONFIG_FILE, WEIGHTS_FILE  # noqa: F401  (re-exported)
from rankwise.core.adapters import deprecated_fields
from rankwise.core.validate import check_bool, check_choice, check_int, check_unit


CAYLEY = ("neumann", "exact")
SIDES = ("output", "input")
_UNSUPPORTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.EmbeddingBag)
#: Above this spectral norm of Q the Neumann series converges slowly (it diverges at 1): a warning suggests "exact".
NEUMANN_WARN_NORM = 0.9
#: Singular values below ``RANK_RTOL * sigma_1`` inside the top r count as zero (rank-deficient W0: warning).
RANK_RTOL = 1e-6


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _target_tuple(owner: str, target: Any) -> tuple[str, ...]:
    target = (target,) if isinstance(target, str) else target
    if not isinstance(target, (tuple, list)) or not target or not all(isinstance(t, str) and t for t in target):
        raise ValueError(f"{owner}.target must be a non-empty tuple of module-name patterns, got "
                         f"{target!r} (pass types or callables to adapt(target=...))")
    return tuple(target)


@deprecated_fields(r="rank")
@dataclass(frozen=True)
class PSOFTConfig:
    """PSOFT hyper-parameters (defaults: the official GLUE script's, r = 46, t = 5, orth + alpha + beta).

    Attributes:
        rank: principal-subspace rank r, ``1 <= r <= min(d_in, d_out)`` of every adapted layer
            (``r``: deprecated name).
        target: module-name patterns (the four attention projections of a BERT-style model).
        cayley: ``"neumann"`` (truncated series, ``neumann_terms`` terms) or ``"exact"`` (linear solve).
        neumann_terms: ``t >= 0`` of the truncated Neumann series of ``(I + Q)^{-1}``.
        neumann_eps: optional bound in (0, 1) on ``||Q||_F`` for the Neumann series: a larger ``Q`` is
            rescaled to it before the series (PEFT's ``cayley_neumann_eps``, from OFTv2), which keeps the
            series convergent at the price of capping the rotation angle. None (default): no rescaling.
        orth: Cayley-parametrised orthogonal core; ``False``: a free ``r x r`` matrix (init I, LoRA-XS).
        train_alpha, train_beta: learn the input-side / output-side relaxation vectors (init 1).
        singular_values_on: ``"output"`` (B = U S, A = V^T, default) or ``"input"`` (B = U, A = S V^T).
        dropout: dropout on the adapter's input, in [0, 1).
    """

    rank: int = 46
    target: tuple[str, ...] = ("query", "key", "value", "attention.output.dense")
    cayley: str = "neumann"
    neumann_terms: int = 5
    neumann_eps: float | None = None
    orth: bool = True
    train_alpha: bool = True
    train_beta: bool = True
    singular_values_on: str = "output"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        c = "PSOFTConfig"
        check_int(f"{c}.rank", self.rank, 1)
        object.__setattr__(self, "target", _target_tuple(c, self.target))
        check_choice(f"{c}.cayley", self.cayley, CAYLEY)
        check_int(f"{c}.neumann_terms", self.neumann_terms, 0)
        check_unit(f"{c}.neumann_eps", self.neumann_eps, low_open=True, high_open=True, allow_none=True)
        for fname in ("orth", "train_alpha", "train_beta"):
            check_bool(f"{c}.{fname}", getattr(self, fname))
        check_choice(f"{c}.singular_values_on", self.singular_values_on, SIDES)
        object.__setattr__(self, "dropout", check_unit(f"{c}.dropout", self.dropout, high_open=True))

    @property
    def trainable_per_matrix(self) -> int:
        return num_parameters(self.rank, orth=self.orth, train_alpha=self.train_alpha, train_beta=self.train_beta)


def num_parameters(r: int, *, orth: bool = True, train_alpha: bool = True, train_beta: bool = True) -> int:
    """Trainable parameters per adapted matrix: ``r(r-1)/2`` (or ``r^2`` without ``orth``) ``+ r`` per vector."""
    if not _pos_int(r):
        raise ValueError(f"r must be an int >= 1, got {r!r}")
    return (r * (r - 1) // 2 if orth else r * r) + r * (int(train_alpha) + int(train_beta))


def rank_for_budget(budget: int, *, orth: bool = True, train_alpha: bool = True, train_beta: bool = True,
                    mode: str = "closest") -> int:
    """The ``r`` whose :func:`num_parameters` is closest to ``budget`` (``mode="floor"``: largest not above it).

    Ties between two closest counts go to the smaller ``r``. ``budget`` below the count of ``r = 1`` is a ValueError.
    """
    if not _pos_int(budget):
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if mode not in ("closest", "floor"):
        raise ValueError(f"mode must be 'closest' or 'floor', got {mode!r}")
    kw = dict(orth=orth, train_alpha=train_alpha, train_beta=train_beta)
    if num_parameters(1, **kw) > budget and mode == "floor":
        raise ValueError(f"budget {budget} is below the smallest PSOFT count ({num_parameters(1, **kw)} at r=1)")
    r = 1
    while num_parameters(r + 1, **kw) <= budget:
        r += 1
    if mode == "floor":
        return r
    below, above = num_parameters(r, **kw), num_parameters(r + 1, **kw)
    if below > budget:  # even r = 1 is above the budget
        return 1
    return r if budget - below <= above - budget else r + 1
