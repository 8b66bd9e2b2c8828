"""CDKA: component-designed Kronecker adapters (ICML 2026, "Diving into Kronecker Adapters: Component Design Matters").

A frozen linear layer ``W0 (d_out, d_in)`` gets a sum of ``r`` Kronecker components::

    ΔW = s * sum_{k<r} B_k ⊗ A_k,    B_k: (d_out/r1, r2),   A_k: (r1, d_in/r2),   s = alpha / sqrt(r)

(``s = alpha / r`` with ``use_rslora=False``). Block ``(p, q)`` of ``B_k ⊗ A_k`` is ``B_k[p, q] * A_k``,
so ``rank(ΔW) <= r * r1 * r2`` while the adapter holds only ``P = r * ((d_out/r1) * r2 + r1 * (d_in/r2))``
parameters. With ``r1 = r2 = 1`` a component is an outer product and CDKA *is* rank-``r`` LoRA; with
``r = 1`` it is a single Kronecker adapter (LoKr-like).

The component design comes from the Van Loan rearrangement ``R`` (:func:`rearrange`): with
``m1 = d_out/r1, n1 = r2, m2 = r1, n2 = d_in/r2``, ``R(B ⊗ A) = vec(B) vec(A)^T`` (row-major vec), so the
best ``sum_{k<r} B_k ⊗ A_k`` approximation of a matrix is the rank-``r`` truncated SVD of its
rearrangement. For the full fine-tuning gradient ``G = dL/dW0`` (averaged over calibration batches)
the *alignment score* of a configuration is::

    align(r1, r2, r) = sum_{k<=r} sigma_k(R(G))^2 / ||G||_F^2      in [0, 1]

the fraction of the first full-fine-tuning step that the adapter family can express. Per adapted
layer (``config_mode="aligned"``) CDKA enumerates every ``(r1, r2, r)`` with ``r1 | d_out``,
``r2 | d_in`` and ``P`` within ``budget_tolerance`` of the per-matrix budget, and keeps the one with
the largest alignment (ties: more components ``r``, then ``P`` closest to the budget, then the
smallest ``(r1, r2)``). ``config_mode="fixed"`` takes ``(r1, r2, r)`` from the config.

Initialisation (``init="gradient"``, the official recipe): the top-``r`` singular triplets
``(u_k, sigma_k, v_k)`` of ``R(-G)`` give ``vec(B_k) = c sqrt(sigma_k/sigma_1) u_k`` and
``vec(A_k) = c sqrt(sigma_k/sigma_1) v_k`` (``c = init_scale = 1/sqrt(1024)``); the initial update is
removed so that the model's output at step 0 is the pretrained one. The paper stores the residual
``W0 - s sum B_k(0) ⊗ A_k(0)`` as the frozen weight; rankwise keeps ``W0`` untouched and stores the
initial factors as frozen buffers ``B0, A0`` instead, computing ``W0 x + s (sum B_k ⊗ A_k - sum B0_k ⊗ A0_k) x``.
Both define the same function and the same merged weight; this form keeps disable / several named
adapters / the base-model fingerprint exact (see docs/methods/cdka.md). ``init="zero"``: ``A_k``
Kaiming-uniform, ``B_k = 0`` (no offset).

The forward pass never forms ``ΔW``: with ``X = x.reshape(r2, d_in/r2)`` (row-major),
``(B ⊗ A) vec(X) = vec(B X A^T)``; cost ``O(r (r1 d_in + d_out r2))`` per token (:func:`kron_apply`).

Usage::

    from rankwise.adapt.cdka import CDKAConfig, adapt, merge, report, save_adapter
    adapt(model, CDKAConfig(budget="lora_r8"), calib=batches, loss_fn=lambda m, b: m(**b).loss)
    print(report(model))        # per layer: (r1, r2, r), parameters, alignment
    ...train the parameters with requires_grad...
    merge(model)                # exact: W = W0 + s sum (B_k ⊗ A_k - B0_k ⊗ A0_k)

Storage: factors are held as stacks ``A (r, r1, d_in/r2)`` and ``B (r, d_out/r1, r2)``;
:func:`to_official_layout` / :func:`from_official_layout` convert to the official code's stacked
matrices (``(r*r1, d_in/r2)`` with component ``i`` in rows ``i::r``, ``(d_out/r1, r*r2)`` with
component ``i`` in columns ``i::r``).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError
from rankwise.core.linalg import kron_rearrange
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module

__all__ = [
    "CDKAChoice",
    "CDKAConfig",
    "CDKALinear",
    "adapt",
    "adapter_names",
    "alignment",
    "alignment_curve",
    "apply_cdka",
    "candidates",
    "cdka_layers",
    "choose_configuration",
    "collect_gradients",
    "delete_adapter",
    "disable_adapters",
    "divisors",
    "enable_adapters",
    "from_official_layout",
    "gradient_init",
    "kron_apply",
    "kron_delta",
    "load_adapter",
    "merge",
    "num_parameters",
    "parse_budget",
    "rearrange",
    "report",
    "squared_singular_values",
    "save_adapter",
    "set_active",
    "to_official_layout",
    "unload",
    "unmerge",
]

CONFIG_MODES = ("aligned", "fixed")
INITS = ("gradient", "zero")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.cdka"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
_BUDGET_RE = re.compile(r"^lora_r([1-9][0-9]*)$")
#: Relative tolerance under which two alignment scores count as tied.
TIE_RTOL = 1e-9
_UNSUPPORTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.EmbeddingBag)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CDKAConfig:
    """CDKA hyper-parameters (defaults: the paper's / official code's).

    Attributes:
        target: module-name patterns (see :func:`rankwise.core.select.select`); default the four
            attention projections of a BERT-style model (the official configs adapt q, k, v, o).
        budget: per-matrix trainable-parameter budget for ``config_mode="aligned"``: an int, or
            ``"lora_r<k>"`` meaning the count of rank-``k`` LoRA on that layer, ``k (d_in + d_out)``.
        budget_tolerance: candidates must have ``|P - budget| <= budget_tolerance * budget``, in [0, 1).
        config_mode: ``"aligned"`` (choose ``(r1, r2, r)`` per layer by the alignment score) or
            ``"fixed"`` (use ``r1``, ``r2``, ``r`` below for every layer).
        r1, r2, r: component shapes and count for ``"fixed"`` (r1 divides d_out, r2 divides d_in).
        init: ``"gradient"`` (gradient-aligned factors, initial update removed) or ``"zero"``
            (A Kaiming-uniform, B = 0).
        alpha: scaling numerator; ``s = alpha / sqrt(r)`` (``use_rslora``) or ``alpha / r``.
        use_rslora: rank-stabilised scaling (the official config: ``use_rslora: True``, alpha 64).
        init_scale: ``c`` of the gradient initialisation, applied to each factor (official ``1/sqrt(1024)``).
        dropout: dropout on the adapter's input, in [0, 1).
        calib_batches: calibration batches used to estimate ``G`` (at most this many are read).
        seed: seeds the zero initialisation (``None``: global RNG); the gradient one is deterministic.
    """

    target: tuple[str, ...] = ("query", "key", "value", "attention.output.dense")
    budget: int | str = "lora_r8"
    budget_tolerance: float = 0.10
    config_mode: str = "aligned"
    r1: int | None = None
    r2: int | None = None
    r: int | None = None
    init: str = "gradient"
    alpha: float = 64.0
    use_rslora: bool = True
    init_scale: float = 1.0 / 32.0
    dropout: float = 0.0
    calib_batches: int = 8
    seed: int | None = 0

    def __post_init__(self) -> None:
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError("CDKAConfig.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        parse_budget(self.budget, 1, 1)  # validates the form
        tol = self.budget_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0.0 <= float(tol) < 1.0:
            raise ValueError(f"CDKAConfig.budget_tolerance must be in [0, 1), got {tol!r}")
        object.__setattr__(self, "budget_tolerance", float(tol))
        if self.config_mode not in CONFIG_MODES:
            raise ValueError(f"CDKAConfig.config_mode must be one of {CONFIG_MODES}, got {self.config_mode!r}")
        shape = {"r1": self.r1, "r2": self.r2, "r": self.r}
        if self.config_mode == "fixed":
            bad = {k: v for k, v in shape.items() if not _pos_int(v)}
            if bad:
                raise ValueError(f"CDKAConfig: config_mode='fixed' needs positive ints r1, r2, r; got {bad}")
        else:
            given = {k: v for k, v in shape.items() if v is not None}
            if given:
                raise ValueError(f"CDKAConfig: {sorted(given)} are only used with config_mode='fixed' "
                                 f"(config_mode='aligned' chooses them per layer); got {given}")
        if self.init not in INITS:
            raise ValueError(f"CDKAConfig.init must be one of {INITS}, got {self.init!r}")
        for fname in ("alpha", "init_scale"):
            v = getattr(self, fname)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) or v <= 0:
                raise ValueError(f"CDKAConfig.{fname} must be a finite number > 0, got {v!r}")
            object.__setattr__(self, fname, float(v))
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"CDKAConfig.use_rslora must be a bool, got {self.use_rslora!r}")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"CDKAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if not _pos_int(self.calib_batches):
            raise ValueError(f"CDKAConfig.calib_batches must be an int >= 1, got {self.calib_batches!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"CDKAConfig.seed must be an int or None, got {self.seed!r}")

    @property
    def needs_gradient(self) -> bool:
        """Whether :func:`adapt` needs calibration data (aligned shapes or gradient init)."""
        return self.config_mode == "aligned" or self.init == "gradient"

    def scaling(self, r: int) -> float:
        """``alpha / sqrt(r)`` (rsLoRA) or ``alpha / r``."""
        return self.alpha / math.sqrt(r) if self.use_rslora else self.alpha / r


def parse_budget(budget: int | str, d_out: int, d_in: int) -> int:
    """The per-matrix budget in parameters: an int as is, ``"lora_r<k>"`` as ``k (d_in + d_out)``."""
    if _pos_int(budget):
        return int(budget)
    if isinstance(budget, str):
        m = _BUDGET_RE.match(budget)
        if m:
            return int(m.group(1)) * (d_in + d_out)
    raise ValueError(f"CDKA budget must be an int >= 1 or 'lora_r<k>' (k >= 1, e.g. 'lora_r8'), got {budget!r}")


# ------------------------------------------------------------------------------------------------
# the math (no model needed)
# ------------------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    if not _pos_int(n):
        raise ValueError(f"divisors: n must be an int >= 1, got {n!r}")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_shape(d_out: int, d_in: int, r1: int, r2: int, r: int, name: str | None = None) -> None:
    """Raise ValueError unless ``r1 | d_out``, ``r2 | d_in`` and ``1 <= r <= min(m1 n1, m2 n2)``."""
    where = f" for layer {name!r}" if name else ""
    for field, v in (("r1", r1), ("r2", r2), ("r", r)):
        if not _pos_int(v):
            raise ValueError(f"CDKA {field} must be an int >= 1{where}, got {v!r}")
    if d_out % r1:
        raise ValueError(f"CDKA r1={r1} does not divide d_out={d_out}{where}; valid r1: {divisors(d_out)}")
    if d_in % r2:
        raise ValueError(f"CDKA r2={r2} does not divide d_in={d_in}{where}; valid r2: {divisors(d_in)}")
    limit = min((d_out // r1) * r2, r1 * (d_in // r2))
    if r > limit:
        raise ValueError(f"CDKA r={r} components{where} exceed the Kronecker rank of shape (r1={r1}, r2={r2}), "
                         f"min((d_out/r1)*r2, r1*(d_in/r2)) = {limit}; choose r in [1, {limit}]")


def num_parameters(d_out: int, d_in: int, r1: int, r2: int, r: int) -> int:
    """``P = r ((d_out/r1) r2 + r1 (d_in/r2))``, the trainable parameters of one adapted matrix."""
    return r * ((d_out // r1) * r2 + r1 * (d_in // r2))


def rearrange(M: torch.Tensor, r1: int, r2: int) -> torch.Tensor:
    """Van Loan rearrangement ``R(M)``, shape ``((d_out/r1) r2, r1 (d_in/r2))``: ``R(B ⊗ A) = vec(B) vec(A)^T``.

    Row ``p * r2 + q`` of ``R(M)`` is block ``(p, q)`` of ``M`` (size ``r1 x d_in/r2``) flattened row-major.
    """
    if M.ndim != 2:
        raise ValueError(f"rearrange takes a matrix (d_out, d_in), got shape {tuple(M.shape)}")
    d_out, d_in = M.shape
    check_shape(d_out, d_in, r1, r2, 1)
    return kron_rearrange(M, (d_out // r1, r2), (r1, d_in // r2))


def _energy(G: torch.Tensor, what: str) -> torch.Tensor:
    G = G.detach().to(torch.float64)
    if not bool(torch.isfinite(G).all()):
        raise NumericalError(f"{what}: the gradient holds NaN or inf; alignment is undefined")
    total = G.square().sum()
    if float(total) == 0.0:
        raise ValueError(f"{what}: the gradient is exactly zero, so the alignment score is undefined; "
                         "check that the calibration loss depends on this layer")
    return total


def alignment_curve(G: torch.Tensor, r1: int, r2: int, max_r: int | None = None, *,
                    name: str | None = None) -> torch.Tensor:
    """``align(r1, r2, r)`` for ``r = 1..max_r`` (float64 vector, non-decreasing, in [0, 1]).

    ``sum_{k<=r} sigma_k(R(G))^2 / ||G||_F^2`` in float64 (:func:`squared_singular_values`).
    ``max_r`` defaults to the rank bound ``min(m1 n1, m2 n2)``.
    """
    what = f"layer {name!r}" if name else "CDKA alignment"
    total = _energy(G, what)
    R = rearrange(G.detach().to(torch.float64), r1, r2)
    limit = min(R.shape)
    max_r = limit if max_r is None else max_r
    if not _pos_int(max_r) or max_r > limit:
        raise ValueError(f"{what}: max_r must be in [1, {limit}] for r1={r1}, r2={r2}, got {max_r!r}")
    return (torch.cumsum(squared_singular_values(R)[:max_r], 0) / total).clamp(0.0, 1.0)


def squared_singular_values(R: torch.Tensor) -> torch.Tensor:
    """``sigma_k(R)^2`` in decreasing order, float64, from the eigenvalues of the smaller Gram matrix.

    ``R R^T`` (or ``R^T R``) costs ``p^2 q`` instead of an SVD; the leading eigenvalues, which the
    alignment scores use, are accurate to ``~eps * sigma_1^2`` (negative rounding is clipped to 0).
    """
    R = R.to(torch.float64)
    C = R @ R.T if R.shape[0] <= R.shape[1] else R.T @ R
    return torch.linalg.eigvalsh(C).flip(0).clamp_min(0.0)


def alignment(G: torch.Tensor, r1: int, r2: int, r: int, *, name: str | None = None) -> float:
    """The alignment score ``align(r1, r2, r)`` of gradient ``G`` (see the module docstring)."""
    return float(alignment_curve(G, r1, r2, r, name=name)[r - 1])


def candidates(d_out: int, d_in: int, budget: int, tolerance: float = 0.10, *,
               name: str | None = None) -> list[tuple[int, int, int, int]]:
    """Every ``(r1, r2, r, P)`` with ``r1 | d_out``, ``r2 | d_in``, ``r <= min(m1 n1, m2 n2)`` and
    ``|P - budget| <= tolerance * budget``; ValueError (with the feasible counts nearby) when none.
    """
    where = f" for layer {name!r} ({d_out}x{d_in})" if name else f" for a {d_out}x{d_in} layer"
    lo, hi = budget * (1.0 - tolerance), budget * (1.0 + tolerance)
    out: list[tuple[int, int, int, int]] = []
    cheapest: tuple[int, int, int] | None = None
    near_below, near_above = 0, None
    for r1 in divisors(d_out):
        for r2 in divisors(d_in):
            per = num_parameters(d_out, d_in, r1, r2, 1)
            limit = min((d_out // r1) * r2, r1 * (d_in // r2))
            if cheapest is None or per < cheapest[2]:
                cheapest = (r1, r2, per)
            for r in range(max(1, math.ceil(lo / per)), min(limit, math.floor(hi / per)) + 1):
                out.append((r1, r2, r, r * per))
            for r in range(1, limit + 1):  # nearest feasible counts, for the error message
                p = r * per
                if p < lo:
                    near_below = max(near_below, p)
                elif p > hi:
                    near_above = p if near_above is None else min(near_above, p)
                    break
    if not out:
        assert cheapest is not None
        if hi < cheapest[2]:
            raise ValueError(f"CDKA budget {budget}{where} is smaller than the cheapest configuration "
                             f"(r1={cheapest[0]}, r2={cheapest[1]}, r=1: {cheapest[2]} parameters); the minimum "
                             f"feasible budget is {cheapest[2]}")
        raise ValueError(f"no CDKA configuration has a parameter count within {tolerance:.0%} of the budget "
                         f"{budget}{where}; the nearest feasible counts are {near_below or None} and "
                         f"{near_above}; change the budget or budget_tolerance")
    return out


@dataclass(frozen=True)
class CDKAChoice:
    """The configuration of one adapted layer: shapes, parameter count and alignment (None if unknown)."""

    r1: int
    r2: int
    r: int
    params: int
    align: float | None


def choose_configuration(G: torch.Tensor, budget: int, tolerance: float = 0.10, *,
                         name: str | None = None) -> CDKAChoice:
    """The ``(r1, r2, r)`` of largest alignment among :func:`candidates` (budget-aware design, step 2).

    Ties (within :data:`TIE_RTOL`): more components ``r``, then ``P`` closest to the budget, then
    the smallest ``(r1, r2)``. One SVD of ``R(G)`` per ``(r1, r2)`` pair with a feasible ``r``.
    """
    if G.ndim != 2:
        raise ValueError(f"choose_configuration: G must be (d_out, d_in), got shape {tuple(G.shape)}")
    d_out, d_in = G.shape
    cands = candidates(d_out, d_in, budget, tolerance, name=name)
    by_pair: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r1, r2, r, p in cands:
        by_pair.setdefault((r1, r2), []).append((r, p))
    scored: list[tuple[float, int, int, int, int]] = []
    for (r1, r2), rs in by_pair.items():
        curve = alignment_curve(G, r1, r2, max(r for r, _ in rs), name=name)
        scored.extend((float(curve[r - 1]), r, p, r1, r2) for r, p in rs)
    best = max(s[0] for s in scored)
    tied = [s for s in scored if s[0] >= best - TIE_RTOL * max(abs(best), 1e-300)]
    a, r, p, r1, r2 = min(tied, key=lambda s: (-s[1], abs(s[2] - budget), s[3], s[4]))
    return CDKAChoice(r1=r1, r2=r2, r=r, params=p, align=a)


def gradient_init(G: torch.Tensor, r1: int, r2: int, r: int, scale: float = 1.0 / 32.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient-aligned factors (stabilised initialisation, step 3), float64.

    Top-``r`` singular triplets of ``R(-G)``: ``B_k = c sqrt(sigma_k/sigma_1) unvec(u_k)`` of shape
    ``(d_out/r1, r2)`` and ``A_k = c sqrt(sigma_k/sigma_1) unvec(v_k)`` of shape ``(r1, d_in/r2)``.
    Returns ``B (r, d_out/r1, r2)``, ``A (r, r1, d_in/r2)``.
    """
    d_out, d_in = G.shape
    check_shape(d_out, d_in, r1, r2, r)
    _energy(G, "gradient_init")
    R = rearrange(-G.detach().to(torch.float64), r1, r2)
    U, S, Vh = torch.linalg.svd(R, full_matrices=False)
    w = scale * torch.sqrt(S[:r] / S[0])
    B = (U[:, :r] * w).T.reshape(r, d_out // r1, r2)
    A = (Vh[:r] * w[:, None]).reshape(r, r1, d_in // r2)
    return B, A


def kron_delta(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Dense ``sum_k B_k ⊗ A_k`` of shape ``(d_out, d_in)`` from stacks ``B (r, m1, n1)``, ``A (r, m2, n2)``."""
    r, m1, n1 = B.shape
    r_, m2, n2 = A.shape
    if r != r_:
        raise ValueError(f"B and A must hold equally many components, got {r} and {r_}")
    return torch.einsum("kpq,kmn->pmqn", B, A).reshape(m1 * m2, n1 * n2)


def kron_apply(B: torch.Tensor, A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ (sum_k B_k ⊗ A_k)^T`` without forming the product.

    ``y_k = vec(B_k X A_k^T)`` with ``X = x.reshape(r2, d_in/r2)`` (row-major).

    ``B (r, d_out/r1, r2)``, ``A (r, r1, d_in/r2)``, ``x (..., d_in)`` -> ``(..., d_out)``. Two batched
    matmuls: ``T = X A^T`` over all components, then ``B`` contracted over (component, r2).
    """
    r, m1, r2 = B.shape
    _, r1, n2 = A.shape
    lead = x.shape[:-1]
    X = x.reshape(-1, r2, n2)                                          # (N, r2, n2)
    T = X @ A.reshape(r * r1, n2).T                                    # (N, r2, r*r1)  [q, (k, m)]
    T = T.reshape(-1, r2, r, r1).transpose(1, 2).reshape(-1, r * r2, r1)  # (N, (k, q), m)
    Y = B.transpose(0, 1).reshape(m1, r * r2) @ T                      # (N, m1, r1)
    return Y.reshape(*lead, m1 * r1)


def to_official_layout(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks -> the official code's matrices: ``B (d_out/r1, r*r2)`` with component ``i`` in columns
    ``i::r`` and ``A (r*r1, d_in/r2)`` with component ``i`` in rows ``i::r``."""
    r, m1, r2 = B.shape
    _, r1, n2 = A.shape
    return B.permute(1, 2, 0).reshape(m1, r2 * r), A.permute(1, 0, 2).reshape(r1 * r, n2)


def from_official_layout(B: torch.Tensor, A: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_official_layout` for ``r`` components."""
    if B.ndim != 2 or A.ndim != 2 or B.shape[1] % r or A.shape[0] % r:
        raise ValueError(f"official-layout B {tuple(B.shape)} / A {tuple(A.shape)} do not hold {r} components")
    m1, r2 = B.shape[0], B.shape[1] // r
    r1, n2 = A.shape[0] // r, A.shape[1]
    return B.reshape(m1, r2, r).permute(2, 0, 1).contiguous(), A.reshape(r1, r, n2).permute(1, 0, 2).contiguous()


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Components(nn.Module):
    """One named adapter of a layer: trainable ``A``, ``B``; optional frozen offset ``A0``, ``B0``."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, A0: torch.Tensor | None, B0: torch.Tensor | None) -> None:
        super().__init__()
        self.A = nn.Parameter(A)
        self.B = nn.Parameter(B)
        self.register_buffer("A0", A0)
        self.register_buffer("B0", B0)

    @property
    def has_offset(self) -> bool:
        return self.A0 is not None


def _owned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached, contiguous copy on ``device`` (row-major, so results do not depend on the source's strides)."""
    return t.detach().to(device).clone(memory_format=torch.contiguous_format)


class CDKALinear(AdapterLayer):
    """An ``nn.Linear`` with named CDKA adapters: ``y = base(x) + sum_active s_k K_k(dropout(x))``.

    ``K(x) = x (sum B_k ⊗ A_k)^T - x (sum B0_k ⊗ A0_k)^T`` (the second term only with a gradient
    initialisation). Shapes: ``x (..., in_features) -> y (..., out_features)``; per adapter
    ``cdka[name].A (r, r1, in/r2)``, ``cdka[name].B (r, out/r1, r2)`` (parameters) and ``A0``, ``B0``
    (buffers, same shapes, or None). State-dict keys ``<layer>.cdka.<name>.{A,B,A0,B0}``.
    """

    adapter_store = "cdka"
    adapter_fields = ("cdka", "cdka_dropout", "scaling", "adapter_config")
    adapter_label = "CDKA adapter"
    family = "CDKA"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"CDKALinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.cdka = nn.ModuleDict()
        self.cdka_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.train(base_layer.training)

    def shape_of(self, name: str) -> tuple[int, int, int]:
        """``(r1, r2, r)`` of adapter ``name``."""
        self._require(name)
        c = self.cdka[name]
        return int(c.A.shape[1]), int(c.B.shape[2]), int(c.A.shape[0])

    def set_components(self, name: str, B: torch.Tensor, A: torch.Tensor, scaling: float, *,
                       B0: torch.Tensor | None = None, A0: torch.Tensor | None = None, dropout: float = 0.0,
                       config: Mapping[str, Any] | None = None) -> None:
        """Create (or replace) adapter ``name`` from stacks ``B (r, out/r1, r2)``, ``A (r, r1, in/r2)`` (copied)."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        if B.ndim != 3 or A.ndim != 3 or B.shape[0] != A.shape[0]:
            raise ValueError(f"{self._where()}: need stacks B (r, out/r1, r2) and A (r, r1, in/r2), got "
                             f"B {tuple(B.shape)}, A {tuple(A.shape)}")
        r, m1, r2 = B.shape
        _, r1, n2 = A.shape
        if m1 * r1 != self.out_features or r2 * n2 != self.in_features:
            raise ValueError(f"{self._where()}: B {tuple(B.shape)} ⊗ A {tuple(A.shape)} gives "
                             f"({m1 * r1}, {r2 * n2}), the layer is ({self.out_features}, {self.in_features})")
        if (B0 is None) != (A0 is None):
            raise ValueError(f"{self._where()}: give both offset factors B0 and A0 or neither")
        if B0 is not None and (B0.shape != B.shape or A0.shape != A.shape):
            raise ValueError(f"{self._where()}: offset shapes B0 {tuple(B0.shape)}, A0 {tuple(A0.shape)} must "
                             f"equal B {tuple(B.shape)}, A {tuple(A.shape)}")
        if not A.is_floating_point() or A.dtype != B.dtype or (B0 is not None and
                                                               (B0.dtype != B.dtype or A0.dtype != B.dtype)):
            raise ValueError(f"{self._where()}: factors must share one floating dtype")
        dev = self.base_layer.weight.device
        comp = _Components(_owned(A, dev), _owned(B, dev), None if A0 is None else _owned(A0, dev),
                           None if B0 is None else _owned(B0, dev))
        self.cdka[name] = comp
        self.cdka_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling[name] = float(scaling)
        self.adapter_config[name] = dict(config or {})
        self.adapter_config[name]["dropout"] = float(dropout)
        if name not in self.active_adapters and not self.active_adapters:
            self.active_adapters = [name]

    # -- math ---------------------------------------------------------------------------------
    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s (sum B_k ⊗ A_k - sum B0_k ⊗ A0_k)``, shape ``(out, in)``, in ``dtype`` (default float32/64)."""
        self._require(name)
        c = self.cdka[name]
        dt = dtype or torch.promote_types(c.A.dtype, torch.float32)
        d = kron_delta(c.B.detach().to(dt), c.A.detach().to(dt))
        if c.has_offset:
            d = d - kron_delta(c.B0.to(dt), c.A0.to(dt))
        return d * self.scaling[name]

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        c = self.cdka[name]
        return [(c.A, True), (c.B, True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            c = self.cdka[name]
            xd = self.cdka_dropout[name](x.to(c.A.dtype))
            update = kron_apply(c.B, c.A, xd)
            if c.has_offset:
                update = update - kron_apply(c.B0, c.A0, xd)
            result = result + (update * self.scaling[name]).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        shapes = {n: self.shape_of(n) for n in self.adapters}
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters(r1,r2,r)={shapes}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")


# ------------------------------------------------------------------------------------------------
# model-level helpers
# ------------------------------------------------------------------------------------------------

def cdka_layers(model: nn.Module) -> list[tuple[str, CDKALinear]]:
    """``(qualified name, CDKALinear)`` of every CDKA layer of ``model``, in model order."""
    return adapters.adapted_layers(model, CDKALinear)


def adapter_names(model: nn.Module) -> list[str]:
    return adapters.adapter_names(model, CDKALinear)


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    return adapters.all_or_nothing(model, CDKALinear)


def _sync_trainable(model: nn.Module, freeze_base: bool) -> None:
    """Active adapters' factors trainable, inactive ones frozen; every other parameter frozen if ``freeze_base``."""
    adapters.sync_trainable(model, CDKALinear, freeze_base)


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    """Linear layers (or CDKALinear wrappers) that ``target`` selects; Conv/Embedding -> NotImplementedError."""
    return adapters.target_layers(model, target, CDKALinear,
                                  rejects=lambda m: isinstance(m, _UNSUPPORTED) or type(m).__name__ == "Conv1D")


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, CDKALinear) else mod  # type: ignore[return-value]


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch, ``model(*batch).loss`` for a tuple; otherwise pass ``loss_fn``."""
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


def collect_gradients(model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Iterable[Any],
                      loss_fn: LossFn | None = None, max_batches: int = 8) -> dict[str, torch.Tensor]:
    """Full-fine-tuning gradients ``G = dL/dW0`` of ``layers``, averaged over up to ``max_batches`` batches.

    Returns ``{name: G (d_out, d_in) float64}``. Runs in eval mode (no dropout, so ``G`` is
    deterministic), with every CDKA adapter of the model switched off (``G`` belongs to the base
    model) and only the targeted base weights requiring gradients; the model's modes, flags and
    ``.grad`` fields are restored afterwards. An empty loader, a non-finite loss or gradient
    (NumericalError) and an all-zero gradient (ValueError) are reported naming the layer.
    """
    loss_fn = default_loss if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    if batches is None:
        raise ValueError("CDKA needs calibration batches (calib=...) to estimate the fine-tuning gradient")
    weights = {n: _base_of(m).weight for n, m in layers}
    flags = {id(p): p.requires_grad for p in model.parameters()}
    grads_before = {n: w.grad for n, w in weights.items()}
    modes = {m: m.training for m in model.modules()}
    states = [(layer, layer.disabled, list(layer.merged_adapters)) for _, layer in cdka_layers(model)]
    if any(merged for _, _, merged in states):
        raise RankwiseError("unmerge the CDKA adapters before adding another one")
    acc = {n: torch.zeros(w.shape, dtype=torch.float64, device=w.device) for n, w in weights.items()}
    count = 0
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
            w.grad = None
        for layer, _, _ in states:
            layer.disabled = True
        model.eval()
        for i, batch in enumerate(batches):
            if i >= max_batches:
                break
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}")
            if not bool(torch.isfinite(loss)):
                raise NumericalError(f"calibration loss is {float(loss)} on batch {i}; alignment is undefined")
            loss.backward()
            for n, w in weights.items():
                if w.grad is not None:
                    acc[n] += w.grad.to(torch.float64)
                    w.grad = None
            count += 1
    finally:
        for p in model.parameters():
            p.requires_grad_(flags.get(id(p), p.requires_grad))
        for n, w in weights.items():
            w.grad = grads_before[n]
        for layer, disabled, _ in states:
            layer.disabled = disabled
        for m, mode in modes.items():
            m.training = mode
    if count == 0:
        raise ValueError("the calibration loader yielded no batch; CDKA needs at least one to estimate G")
    out = {}
    for n, g in acc.items():
        g = g / count
        if not bool(torch.isfinite(g).all()):
            raise NumericalError(f"layer {n!r}: the calibration gradient holds NaN or inf")
        if float(g.abs().max()) == 0.0:
            raise ValueError(f"layer {n!r}: the calibration gradient is exactly zero (the loss does not depend "
                             "on this layer, or the batches carry no signal); the alignment score is undefined")
        out[n] = g
    return out


def adapt(model: nn.Module, config: CDKAConfig | None = None, target: Selector = None, name: str = "default", *,
          calib: Iterable[Any] | None = None, loss_fn: LossFn | None = None,
          gradients: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Add CDKA adapter ``name`` to the Linear layers ``target`` selects (default ``config.target``); in place.

    ``calib`` (an iterable of batches) and ``loss_fn(model, batch) -> scalar`` (default: the output's
    ``.loss``) estimate the fine-tuning gradient ``G`` needed by ``config_mode="aligned"`` and
    ``init="gradient"``; alternatively pass precomputed ``gradients`` ``{layer name: G (d_out, d_in)}``.
    The new adapter becomes the active (and only trainable) one; every other parameter is frozen
    (unfreeze a task head yourself). Everything is computed and checked before the model changes;
    on any error the model is unchanged. Returns the model.
    """
    config = CDKAConfig() if config is None else config
    if not isinstance(config, CDKAConfig):
        raise TypeError(f"adapt: config must be a CDKAConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
    validate_adapter_name(name)
    merged = [n for n, layer in cdka_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}; unmerge before adding an adapter")
    hits = _target_layers(model, config.target if target is None else target)
    for lname, mod in hits:
        if isinstance(mod, CDKALinear) and name in mod.cdka:
            raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                             "or delete it first")
        base = _base_of(mod)
        if config.config_mode == "fixed":
            check_shape(base.out_features, base.in_features, config.r1, config.r2, config.r, lname)
        else:  # budget feasibility before any gradient is computed
            candidates(base.out_features, base.in_features,
                       parse_budget(config.budget, base.out_features, base.in_features),
                       config.budget_tolerance, name=lname)

    grads: dict[str, torch.Tensor] = {}
    if gradients is not None:
        missing = [n for n, _ in hits if n not in gradients]
        if missing:
            raise ValueError(f"gradients lacks layers {missing[:5]}")
        for n, mod in hits:
            g = gradients[n]
            base = _base_of(mod)
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != (base.out_features, base.in_features):
                raise ValueError(f"gradient for layer {n!r} must be a tensor of shape "
                                 f"({base.out_features}, {base.in_features})")
            grads[n] = g.detach().to(torch.float64)
    elif config.needs_gradient:
        grads = collect_gradients(model, hits, calib, loss_fn, config.calib_batches)

    gen = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    plan = []
    for lname, mod in hits:
        base = _base_of(mod)
        d_out, d_in = base.out_features, base.in_features
        G = grads.get(lname)
        if config.config_mode == "aligned":
            budget = parse_budget(config.budget, d_out, d_in)
            choice = choose_configuration(G, budget, config.budget_tolerance, name=lname)
        else:
            r1, r2, r = config.r1, config.r2, config.r
            choice = CDKAChoice(r1, r2, r, num_parameters(d_out, d_in, r1, r2, r),
                                None if G is None else alignment(G, r1, r2, r, name=lname))
        w = base.weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        r1, r2, r = choice.r1, choice.r2, choice.r
        if config.init == "gradient":
            B, A = gradient_init(G, r1, r2, r, config.init_scale)
            B, A = B.to(dtype), A.to(dtype)
            B0, A0 = B, A
        else:
            A = torch.empty(r, r1, d_in // r2, dtype=torch.float32)
            for k in range(r):
                nn.init.kaiming_uniform_(A[k], a=math.sqrt(5), generator=gen)
            A = A.to(dtype)
            B = torch.zeros(r, d_out // r1, r2, dtype=dtype)
            B0 = A0 = None
        cfg = {"method": "cdka", "r1": r1, "r2": r2, "r": r, "params": choice.params, "align": choice.align,
               "budget": None if config.config_mode == "fixed" else parse_budget(config.budget, d_out, d_in),
               "config_mode": config.config_mode, "init": config.init, "alpha": config.alpha,
               "use_rslora": config.use_rslora}
        plan.append((lname, mod, B, A, B0, A0, config.scaling(r), cfg))

    with _all_or_nothing(model):
        for lname, mod, B, A, B0, A0, s, cfg in plan:
            layer = mod if isinstance(mod, CDKALinear) else CDKALinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.set_components(name, B, A, s, B0=B0, A0=A0, dropout=config.dropout, config=cfg)
            layer.set_active(name)
        for _, layer in cdka_layers(model):
            if name not in layer.cdka:
                layer.active_adapters = []
        _sync_trainable(model, freeze_base=True)
    return model


apply_cdka = adapt


def report(model: nn.Module, name: str | None = None) -> list[dict[str, Any]]:
    """Per adapted layer and adapter: ``layer, adapter, d_out, d_in, r1, r2, r, params, budget, align``."""
    rows = []
    for lname, layer in cdka_layers(model):
        for n in layer.adapters:
            if name is not None and n != name:
                continue
            r1, r2, r = layer.shape_of(n)
            cfg = layer.adapter_config.get(n, {})
            rows.append({"layer": lname, "adapter": n, "d_out": layer.out_features, "d_in": layer.in_features,
                         "r1": r1, "r2": r2, "r": r,
                         "params": num_parameters(layer.out_features, layer.in_features, r1, r2, r),
                         "budget": cfg.get("budget"), "align": cfg.get("align")})
    if name is not None and not rows:
        raise KeyError(f"the model has no CDKA adapter named {name!r}; it has {adapter_names(model) or 'none'}")
    return rows


def _require_adapter(model: nn.Module, name: str) -> list[tuple[str, CDKALinear]]:
    return adapters.require_adapter(model, name, CDKALinear)


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active (trainable) adapter(s) of every CDKA layer; others inactive (frozen)."""
    adapters.set_active(model, names, CDKALinear)


def enable_adapters(model: nn.Module) -> None:
    """Turn the active adapters back on (after :func:`disable_adapters`)."""
    adapters.enable_adapters(model, CDKALinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept). Refused while merged."""
    adapters.disable_adapters(model, CDKALinear)


def merge(model: nn.Module) -> nn.Module:
    """Merge the active adapters into the base weights (``W0 += s sum(B⊗A - B0⊗A0)``); all-or-nothing."""
    adapters.merge_all(model, CDKALinear)
    return model


def unmerge(model: nn.Module) -> nn.Module:
    """Subtract merged adapters from the base weights (exact up to float rounding)."""
    adapters.unmerge_all(model, CDKALinear)
    return model


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name`` everywhere (a layer left without adapters gets its plain Linear back)."""
    adapters.delete_adapter(model, name, CDKALinear)


def unload(model: nn.Module, merge_first: bool = True) -> nn.Module:
    """Replace every CDKALinear by its base Linear (merging the active adapters first if ``merge_first``)."""
    return adapters.unload(model, CDKALinear, merge_first)


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 overwrite: bool | None = None) -> Path:
    """Save adapter ``name`` to ``directory`` atomically: ``adapter_model.safetensors`` + ``adapter_config.json``.

    Tensors ``<module>.cdka_A`` ``(r, r1, in/r2)``, ``<module>.cdka_B`` ``(r, out/r1, r2)`` and, after a
    gradient initialisation, ``<module>.cdka_A0`` / ``<module>.cdka_B0``; the safetensors header holds
    the per-module scaling, dropout and configuration, the base-model fingerprint and SHA-256 digests
    (:mod:`rankwise.core.io`). ``adapter_config.json`` repeats the configuration for humans.
    ``overwrite`` as in :func:`rankwise.adapt.lora.write_adapter_dir`.
    """
    layers = _require_adapter(model, name)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}
    for lname, layer in layers:
        c = layer.cdka[name]
        tensors[f"{lname}.cdka_A"] = c.A.detach()
        tensors[f"{lname}.cdka_B"] = c.B.detach()
        if c.has_offset:
            tensors[f"{lname}.cdka_A0"] = c.A0
            tensors[f"{lname}.cdka_B0"] = c.B0
        cfg = dict(layer.adapter_config.get(name, {}))
        modules[lname] = {"scaling": layer.scaling[name], "offset": c.has_offset, "config": cfg}
    meta = {"kind": _KIND, "name": name, "modules": modules, "fingerprint": io.model_fingerprint(model)}
    directory = Path(directory)
    if overwrite is None:
        overwrite = directory.is_dir() and all(p.is_file() and p.name in _OWN_FILES for p in directory.iterdir())
    with io.atomic_dir(directory, overwrite=bool(overwrite)) as tmp:
        io.write_json(tmp / CONFIG_FILE, {"method": "cdka", "name": name, "modules": modules})
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return directory


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 check_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model`` as adapter ``name`` (active, trainable).

    Rejects with ArtifactError, leaving the model unchanged: a missing, corrupt or truncated file; an
    artefact of another kind; one saved for another base model (fingerprint; skip with
    ``check_base=False``); modules missing from the model or of other shapes. Factors load bit-exactly.
    """
    validate_adapter_name(name)
    directory = Path(directory)
    path = directory / WEIGHTS_FILE
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != _KIND:
        raise ArtifactError(f"{path}: not a rankwise CDKA adapter (kind={meta.get('kind')!r})")
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ArtifactError(f"{path}: metadata lacks the module table")
    expected = set()
    for m, info in modules.items():
        if not isinstance(info, dict) or not isinstance(info.get("scaling"), (int, float)) \
                or not math.isfinite(float(info["scaling"])):
            raise ArtifactError(f"{path}: bad metadata for module {m!r}")
        expected |= {f"{m}.cdka_A", f"{m}.cdka_B"} | ({f"{m}.cdka_A0", f"{m}.cdka_B0"} if info.get("offset") else set())
    if set(tensors) != expected:
        raise ArtifactError(f"{path}: tensors do not match the module table (missing "
                            f"{sorted(expected - set(tensors))[:4]}, unexpected {sorted(set(tensors) - expected)[:4]})")
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
    if any(layer.merged_adapters for _, layer in cdka_layers(model)):
        raise RankwiseError("unmerge the CDKA adapters before loading one")
    found: dict[str, nn.Module] = {}
    problems: list[str] = []
    for m, info in modules.items():
        try:
            mod = model.get_submodule(m)
        except AttributeError:
            problems.append(f"module {m!r} does not exist in the model")
            continue
        base = _base_of(mod)
        if not isinstance(base, nn.Linear):
            problems.append(f"module {m!r} is a {type(mod).__name__}, not nn.Linear")
            continue
        B, A = tensors[f"{m}.cdka_B"], tensors[f"{m}.cdka_A"]
        if B.ndim != 3 or A.ndim != 3 or B.shape[0] != A.shape[0] \
                or B.shape[1] * A.shape[1] != base.out_features or B.shape[2] * A.shape[2] != base.in_features:
            problems.append(f"module {m!r}: factors B {tuple(B.shape)}, A {tuple(A.shape)} do not fit "
                            f"({base.out_features}, {base.in_features})")
            continue
        found[m] = mod
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    with _all_or_nothing(model):
        for lname, layer in cdka_layers(model):
            if name in layer.cdka and lname not in found:
                layer.delete_adapter(name)
        for m, mod in found.items():
            info = modules[m]
            layer = mod if isinstance(mod, CDKALinear) else CDKALinear(mod, layer_name=m)
            if layer is not mod:
                replace_module(model, m, layer)
            cfg = info.get("config") if isinstance(info.get("config"), dict) else {}
            dropout = float(cfg.get("dropout", 0.0) or 0.0)
            if not 0.0 <= dropout < 1.0:
                raise ArtifactError(f"{path}: dropout {dropout!r} of module {m!r} is outside [0, 1)")
            try:
                layer.set_components(name, tensors[f"{m}.cdka_B"], tensors[f"{m}.cdka_A"], float(info["scaling"]),
                                     B0=tensors.get(f"{m}.cdka_B0"), A0=tensors.get(f"{m}.cdka_A0"),
                                     dropout=dropout, config=cfg)
            except ValueError as e:
                raise ArtifactError(f"{path}: {e}") from e
            layer.set_active(name)
        for lname, layer in list(cdka_layers(model)):
            if name not in layer.cdka:
                layer.active_adapters = []
            if not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        _sync_trainable(model, freeze_base=True)
    return model


register("cdka", config=CDKAConfig, entry=adapt)
