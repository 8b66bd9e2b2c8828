"""Reusable structured linear layers: :class:`LowRankLinear` and :class:`KroneckerLinear`.

Both keep the ``nn.Linear`` interface (``in_features``, ``out_features``, input ``(..., in)`` ->
output ``(..., out)``) so that module surgery can swap them in for a linear layer, and both can
return their dense weight with ``to_dense()`` (``(out, in)``, the ``nn.Linear.weight`` layout).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from rankwise.core import linalg
from rankwise.core.linalg import Balance, LowRankFactors

Tensor = torch.Tensor

__all__ = ["LowRankLinear", "KroneckerLinear", "validate_rank"]


def validate_rank(rank: int, in_features: int, out_features: int, name: str | None = None) -> int:
    """Check ``0 < rank <= min(in_features, out_features)``; returns ``rank`` or raises ``ValueError``/``TypeError``."""
    where = f" for layer {name!r}" if name else ""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank{where} must be an int, got {type(rank).__name__} ({rank!r})")
    if not 0 < rank <= min(in_features, out_features):
        raise ValueError(f"rank={rank}{where} is out of range: need 0 < rank <= min(in_features={in_features}, "
                         f"out_features={out_features}) = {min(in_features, out_features)}")
    return rank


class LowRankLinear(nn.Module):
    """``y = up(down(x))``: a rank-``r`` linear map ``W = A @ B`` stored as two thin ``nn.Linear``.

    ``down``: ``Linear(in_features -> rank, bias=False)`` with weight ``B`` (``r x n``);
    ``up``: ``Linear(rank -> out_features, bias=bias)`` with weight ``A`` (``m x r``) and the bias.
    Parameters: ``rank * (in + out)`` (+ ``out`` for the bias). State-dict keys:
    ``down.weight``, ``up.weight``, ``up.bias``.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        for nm, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{nm} must be a positive int, got {v!r}")
        validate_rank(rank, in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_factors(cls, B: Tensor, A: Tensor, bias: Tensor | None = None, *,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "LowRankLinear":
        """Layer with down weight ``B`` (``r x n``), up weight ``A`` (``m x r``) and optional ``bias`` (``m``).

        ``dtype``/``device`` default to those of ``bias`` if given, else of ``B``.
        """
        if not all(isinstance(t, torch.Tensor) for t in (A, B)):
            raise TypeError("A and B must be tensors")
        if B.ndim != 2 or A.ndim != 2 or B.shape[0] != A.shape[1]:
            raise ValueError(f"need B of shape (rank, in) and A of shape (out, rank); got B {tuple(B.shape)}, "
                             f"A {tuple(A.shape)} (is the order (B, A) = (down, up)?)")
        r, n = B.shape
        m = A.shape[0]
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (m,)):
            raise ValueError(f"bias must be a tensor of shape ({m},), got {getattr(bias, 'shape', type(bias))}")
        ref = bias if bias is not None else B
        dtype = dtype or (ref.dtype if ref.is_floating_point() else torch.get_default_dtype())
        device = device or ref.device
        for nm, t in (("B", B), ("A", A)) + ((("bias", bias),) if bias is not None else ()):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"factor {nm} has non-finite values")
        layer = cls(n, m, r, bias=bias is not None, device=device, dtype=dtype)
        with torch.no_grad():
            layer.down.weight.copy_(B.detach())
            layer.up.weight.copy_(A.detach())
            if bias is not None:
                layer.up.bias.copy_(bias.detach())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int | None = None, *,
                    factors: LowRankFactors | tuple[Tensor, Tensor] | None = None,
                    balance: Balance = "sqrt") -> "LowRankLinear":
        """Replace ``linear`` by its best rank-``rank`` approximation (truncated SVD in float64), or by
        given ``factors = (B, A)``. Bias, dtype, device and ``requires_grad`` come from ``linear``.

        At ``rank = min(in, out)`` the layer reproduces ``linear`` up to rounding; below it, the
        weight error ``||W - A B||_F^2`` equals the sum of the discarded squared singular values.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        W = linear.weight
        if factors is None:
            if rank is None:
                raise ValueError("give rank or factors")
            validate_rank(rank, linear.in_features, linear.out_features)
            B, A = linalg.lowrank_factors(W.detach(), rank, balance=balance)
        else:
            B, A = factors
            if B.shape[1] != linear.in_features or A.shape[0] != linear.out_features:
                raise ValueError(f"factors B {tuple(B.shape)}, A {tuple(A.shape)} do not fit a linear layer "
                                 f"{linear.in_features} -> {linear.out_features}")
            if rank is not None and rank != B.shape[0]:
                raise ValueError(f"rank={rank} disagrees with the factors' rank {B.shape[0]}")
        layer = cls.from_factors(B.to(W.device, W.dtype), A.to(W.device, W.dtype),
                                 None if linear.bias is None else linear.bias.detach(),
                                 dtype=W.dtype, device=W.device)
        layer.requires_grad_(W.requires_grad)
        return layer

    # -- use ---------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))

    @property
    def bias(self) -> Tensor | None:
        return self.up.bias

    def to_dense(self) -> Tensor:
        """The ``(out, in)`` weight ``A @ B`` (computed in float64, returned in the layer dtype)."""
        w = self.up.weight.detach().double() @ self.down.weight.detach().double()
        return w.to(self.up.weight.dtype)

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the dense weight and the bias (e.g. to undo a compression)."""
        W = self.up.weight
        lin = nn.Linear(self.in_features, self.out_features, bias=self.up.bias is not None,
                        device=W.device, dtype=W.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.to_dense())
            if self.up.bias is not None:
                lin.bias.copy_(self.up.bias)
        return lin

    @staticmethod
    def parameter_count(in_features: int, out_features: int, rank: int, bias: bool = True) -> int:
        """``rank * (in + out) + (out if bias)``."""
        return rank * (in_features + out_features) + (out_features if bias else 0)

    @property
    def num_parameters(self) -> int:
        return self.parameter_count(self.in_features, self.out_features, self.rank, self.up.bias is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"bias={self.up.bias is not None}")


def _balanced_split(n: int) -> tuple[int, int]:
    """``(a, b)`` with ``a * b = n`` and ``a <= b`` as close as possible."""
    a = int(math.isqrt(n))
    while n % a:
        a -= 1
    return a, n // a


class KroneckerLinear(nn.Module):
    """Linear layer whose weight is ``W = sum_k kron(A_k, B_k)``, applied without forming ``W``.

    ``A_k`` is ``(m1, n1)``, ``B_k`` is ``(m2, n2)``; ``out_features = m1 * m2``,
    ``in_features = n1 * n2``. With ``X = x.reshape(..., n1, n2)`` (row-major), the output is
    ``sum_k A_k X B_k^T`` flattened (cost ``O(K (n1 n2 m2 + m1 n1 m2))`` per token instead of
    ``O(m n)``). Parameters ``A`` (``K, m1, n1``), ``B`` (``K, m2, n2``), ``bias`` (``out``).

    ``in_factors=(n1, n2)`` and ``out_factors=(m1, m2)`` default to the most balanced
    factorisations of the feature sizes.
    """

    def __init__(self, in_features: int, out_features: int, *, in_factors: Sequence[int] | None = None,
                 out_factors: Sequence[int] | None = None, terms: int = 1, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        for nm, v in (("in_features", in_features), ("out_features", out_features), ("terms", terms)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{nm} must be a positive int, got {v!r}")
        n1, n2 = self._factors(in_features, in_factors, "in")
        m1, m2 = self._factors(out_features, out_factors, "out")
        if terms > min(m1 * n1, m2 * n2):
            raise ValueError(f"terms={terms} exceeds the maximal Kronecker rank {min(m1 * n1, m2 * n2)}")
        self.in_features, self.out_features, self.terms = in_features, out_features, terms
        self.in_factors, self.out_factors = (n1, n2), (m1, m2)
        kw = dict(device=device, dtype=dtype)
        self.A = nn.Parameter(torch.empty(terms, m1, n1, **kw))
        self.B = nn.Parameter(torch.empty(terms, m2, n2, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters(generator)

    @staticmethod
    def _factors(size: int, given: Sequence[int] | None, side: str) -> tuple[int, int]:
        if given is None:
            return _balanced_split(size)
        f = tuple(int(v) for v in given)
        if len(f) != 2 or min(f) <= 0 or f[0] * f[1] != size:
            raise ValueError(f"{side}_factors must be two positive ints with product {side}_features={size}, got {given!r}")
        return f  # type: ignore[return-value]

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Kaiming-uniform-like scale: each entry of ``W`` has variance ``~ 1 / (3 in_features)``."""
        (_, m1, n1), (_, m2, n2) = self.A.shape, self.B.shape
        # Var(W_ij) = K Var(a) Var(b); choose Var(a) = Var(b) = (1/(3 n K))^(1/2)
        std = (1.0 / (3.0 * self.in_features * self.terms)) ** 0.25
        with torch.no_grad():
            for p in (self.A, self.B):
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) * std)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(self.in_features)
                self.bias.copy_((torch.rand(self.bias.shape, generator=generator, dtype=self.bias.dtype) * 2 - 1)
                                .to(self.bias.device) * bound)

    @classmethod
    def from_dense(cls, weight: Tensor | nn.Linear, *, in_factors: Sequence[int] | None = None,
                   out_factors: Sequence[int] | None = None, terms: int = 1,
                   bias: Tensor | None = None) -> "KroneckerLinear":
        """Nearest ``terms``-term Kronecker approximation of a dense weight (Van Loan-Pitsianis).

        ``weight`` may be an ``nn.Linear`` (its bias is then kept unless ``bias`` is given).
        Exact when the weight is a sum of ``terms`` Kronecker products of these shapes.
        """
        if isinstance(weight, nn.Linear):
            bias = weight.bias.detach() if (bias is None and weight.bias is not None) else bias
            weight = weight.weight.detach()
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError("weight must be an (out, in) tensor or an nn.Linear")
        m, n = weight.shape
        layer = cls(n, m, in_factors=in_factors, out_factors=out_factors, terms=terms, bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
        (n1, n2), (m1, m2) = layer.in_factors, layer.out_factors
        A, B = linalg.nearest_kronecker(weight, (m1, n1), (m2, n2), terms=terms)
        with torch.no_grad():
            layer.A.copy_(A)
            layer.B.copy_(B)
            if bias is not None:
                if tuple(bias.shape) != (m,):
                    raise ValueError(f"bias must have shape ({m},), got {tuple(bias.shape)}")
                layer.bias.copy_(bias)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        y = linalg.kron_rowmajor_apply(self.A, self.B, x)
        return y if self.bias is None else y + self.bias

    def to_dense(self) -> Tensor:
        """The ``(out, in)`` weight ``sum_k kron(A_k, B_k)``."""
        A, B = self.A.detach(), self.B.detach()
        return sum(torch.kron(A[k], B[k]) for k in range(self.terms))  # type: ignore[return-value]

    @staticmethod
    def parameter_count(in_factors: Sequence[int], out_factors: Sequence[int], terms: int = 1,
                        bias: bool = True) -> int:
        """``terms * (m1 n1 + m2 n2) + (m1 m2 if bias)``."""
        (n1, n2), (m1, m2) = in_factors, out_factors
        return terms * (m1 * n1 + m2 * n2) + (m1 * m2 if bias else 0)

    @property
    def num_parameters(self) -> int:
        return self.parameter_count(self.in_factors, self.out_factors, self.terms, self.bias is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} {self.in_factors}, out_features={self.out_features} "
                f"{self.out_factors}, terms={self.terms}, bias={self.bias is not None}")
