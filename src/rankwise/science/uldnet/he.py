"""CKKS export of a polynomial network: depth counting, parameter choice under 128-bit security and
an encrypted evaluator on TenSEAL (imported lazily; ``pip install 'rankwise[he]'``).

The model must be a chain (``nn.Sequential``, nested allowed) of ``Linear``, :class:`PolyNorm`
(per-sample axis, switched on, ``Vbar`` estimated), :class:`PolyAct`, :class:`PolyFitAct`,
:class:`ChebNorm`, ``Dropout``/``Identity``/``Flatten``. One sample is one CKKS vector (TenSEAL
replicates it over the slots). Operators and their levels (one level = one rescale by a 30-bit prime):

* ``Linear``: vector-matrix product with plaintext weights (TenSEAL's diagonal method): 1 level. A
  pending plaintext affine map ``e * . + beta`` of the previous operator, the centring ``x - E[x]`` of a
  following norm and that norm's input scale ``t`` are folded into its matrix and bias (exact).
* PolyNorm: ``S = sum_slots(ct^2)`` (1, the slot sum is rotations only and lands in every slot since
  the vector is periodic), ``u = S - sqrt(a) b`` (free, ``t`` was chosen so that ``S = sqrt(a) mu v``),
  ``g = u^2 + c`` (1), ``ct * g`` (1): depth 3 in ciphertext products, as in the paper; ``K gamma / t``
  and ``beta`` stay pending (folded into the next operator).
* ChebNorm (post-hoc): ``w = S + beta0``, its Chebyshev series converted to powers of ``w`` (well
  conditioned on [-1, 1]) and evaluated like an activation (degree 8: 4 levels), then ``ct * r`` (1).
* PolyAct / PolyFitAct of degree n on the pending ``e * ct + beta``: expanded to per-slot coefficient
  vectors ``B_j`` of ``ct^j``; each term multiplies ``B_j`` into its lowest-level factor first, so
  degree 2 and 3 cost 2 levels, degree 7 costs 3; degree <= 1 is folded (0).

TenSEAL resets a ciphertext's scale to 2^30 after each rescale by a prime q != 2^30 (a drift of
2^30 / q per level, up to ~1e-3); the evaluator tracks that factor and folds its inverse into the
plaintext operands, so the result is exact up to CKKS noise.

Prime policy: 40-bit outer primes, 30-bit inner primes (scale 2^30), one inner prime per level; N is
the smallest ring degree whose 128-bit bound (SEAL's table) holds the chain.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from rankwise.core.errors import RankwiseError
from rankwise.core.validate import check_choice, check_int
from rankwise.science.uldnet.config import g_coefficients
from rankwise.science.uldnet.layers import ChebNorm, PolyAct, PolyFitAct, PolyNorm

__all__ = ["CKKSModel", "DepthCount", "DepthError", "MAX_MODULUS_BITS", "OpDepth", "UnsupportedOpError",
           "choose_parameters", "count_depth", "export_ckks"]

#: The largest total modulus (bits) per ring degree N at each security level (SEAL's
#: ``CoeffModulus::MaxBitCount``, HomomorphicEncryption.org standard, classical attacks).
MAX_MODULUS_BITS: dict[int, dict[int, int]] = {
    128: {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881},
    192: {1024: 19, 2048: 37, 4096: 75, 8192: 152, 16384: 305, 32768: 611},
    256: {1024: 14, 2048: 29, 4096: 58, 8192: 118, 16384: 237, 32768: 476},
}
RING_DEGREES = (8192, 16384, 32768)


class UnsupportedOpError(RankwiseError, TypeError):
    """A module that CKKS cannot evaluate (softmax, division, max-pool, exact normalisation, ...)."""


class DepthError(RankwiseError, ValueError):
    """The counted depth needs more modulus bits than the security level allows at the largest N."""


@dataclasses.dataclass(frozen=True)
class OpDepth:
    name: str
    kind: str
    depth: int


@dataclasses.dataclass(frozen=True)
class DepthCount:
    """Levels per operator (``ops``) and their sum ``total`` (the multiplicative depth of the chain)."""

    ops: tuple[OpDepth, ...]

    @property
    def total(self) -> int:
        return sum(o.depth for o in self.ops)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.ops:
            out[o.kind] = out.get(o.kind, 0) + o.depth
        return out


def _leaves(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Sequential):
        out = []
        for name, child in model.named_children():
            out += _leaves(child, f"{prefix}{name}.")
        return out
    return [(prefix.rstrip("."), model)]


# ----------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class _Step:
    name: str
    kind: str
    depth: int
    data: dict[str, Any]


def _term_depth(j: int) -> int:
    """Levels of ``B_j * ct^j`` with the coefficient multiplied into the lowest-level factor first."""
    levels = [k for k in range(j.bit_length()) if j >> k & 1]  # factor ct^(2^k) sits at level k
    levels.sort()
    levels[0] += 1
    while len(levels) > 1:
        a, b = levels.pop(0), levels.pop(0)
        levels.append(max(a, b) + 1)
        levels.sort()
    return levels[0]


def _expand(coef: np.ndarray, e: np.ndarray, beta: np.ndarray) -> list[np.ndarray]:
    """Per-slot coefficients ``B_j`` of ``sum_i a_i (e ct + beta)^i`` in powers of ct."""
    n = len(coef) - 1
    return [e**j * sum(coef[i] * math.comb(i, j) * beta ** (i - j) for i in range(j, n + 1)) for j in range(n + 1)]


def _plan(model: nn.Module, input_size: int | None = None) -> tuple[list[_Step], int, int]:
    """Compile ``model`` into steps; returns ``(steps, input width, output width)``."""
    if not isinstance(model, nn.Sequential):
        raise UnsupportedOpError(f"export_ckks needs an nn.Sequential chain of supported modules, got "
                                 f"{type(model).__name__}")
    leaves = []
    for name, m in _leaves(model):
        if isinstance(m, (nn.Dropout, nn.Identity, nn.Flatten)):
            continue
        if isinstance(m, PolyNorm):
            if m.axis != "per_sample":
                raise UnsupportedOpError(f"module '{name}' (PolyNorm, axis={m.axis}): only the per-sample axis is "
                                         "evaluated on one encrypted sample")
            if not m.estimated:
                raise UnsupportedOpError(f"module '{name}' (PolyNorm): V-bar not yet estimated (the model was never "
                                         "trained); train it before export")
            if float(m.mix) != 1.0:
                raise UnsupportedOpError(f"module '{name}' (PolyNorm): mix={float(m.mix):g}, still (partly) the exact "
                                         "normalisation 1/sqrt(Var); finish the warm-up switch before export")
        if isinstance(m, (PolyNorm, ChebNorm)) and len(m.normalized_shape) != 1:
            raise UnsupportedOpError(f"module '{name}' ({type(m).__name__}): only 1-D (MLP) normalisation is exported")
        if not isinstance(m, (nn.Linear, PolyNorm, ChebNorm, PolyAct, PolyFitAct)):
            raise UnsupportedOpError(f"module '{name}' ({type(m).__name__}) is not supported under CKKS (only "
                                     "Linear, PolyNorm, PolyAct, PolyFitAct, ChebNorm, Dropout, Identity, Flatten)")
        leaves.append((name, m))
    if not leaves:
        raise UnsupportedOpError("export_ckks: the model has no operator to evaluate")
    width = leaves[0][1].in_features if isinstance(leaves[0][1], nn.Linear) else input_size
    if width is None:
        raise ValueError("export_ckks: input_size is needed when the model does not start with a Linear")
    in_width = width
    steps: list[_Step] = []
    e = np.ones(width)
    beta = np.zeros(width)

    def dbl(t: torch.Tensor) -> np.ndarray:
        return t.detach().double().cpu().numpy()

    for idx, (name, m) in enumerate(leaves):
        nxt = leaves[idx + 1][1] if idx + 1 < len(leaves) else None
        if isinstance(m, (PolyNorm, ChebNorm)) and (not steps or steps[-1].kind != "linear" or steps[-1].data["t"] is None):
            raise UnsupportedOpError(f"module '{name}' ({type(m).__name__}) must follow a Linear (its centring "
                                     "is folded into that Linear)")
        if isinstance(m, nn.Linear):
            if m.in_features != width:
                raise UnsupportedOpError(f"module '{name}' (Linear): in_features {m.in_features} != width {width}")
            W = dbl(m.weight).T  # [in, out]
            b = dbl(m.bias) if m.bias is not None else np.zeros(m.out_features)
            M = e[:, None] * W
            c = beta @ W + b
            t = None
            if isinstance(nxt, (PolyNorm, ChebNorm)):
                n = m.out_features
                if n & (n - 1) or n < 2:
                    raise UnsupportedOpError(f"module '{leaves[idx + 1][0]}': normalised width {n} must be a power "
                                             "of two >= 2 (the CKKS slot sum)")
                C = np.eye(n) - 1.0 / n
                M, c = M @ C, c @ C
                if isinstance(nxt, PolyNorm):
                    a, _, _ = g_coefficients(nxt.config.k, nxt.config.mu)
                    t = math.sqrt(math.sqrt(a) * nxt.config.mu / (n * float(nxt.running_var)))
                else:
                    t = math.sqrt(nxt.alpha / n)
                M, c = M * t, c * t
            steps.append(_Step(name, "linear", 1, {"M": M, "c": c, "t": t, "final": False}))
            width = m.out_features
            e, beta = (np.full(width, 1.0 / t), np.zeros(width)) if t else (np.ones(width), np.zeros(width))
        elif isinstance(m, PolyNorm):
            a, b, cg = g_coefficients(m.config.k, m.config.mu)
            vbar = float(m.running_var)
            gamma = dbl(m.weight) if m.weight is not None else np.ones(width)
            steps.append(_Step(name, "polynorm", 3, {"shift": -math.sqrt(a) * b, "c": cg, "n": width}))
            e = math.sqrt(m.config.mu / vbar) * gamma * e  # e was 1 / t
            beta = dbl(m.bias) if m.bias is not None else np.zeros(width)
        elif isinstance(m, ChebNorm):
            coef = dbl(m.coef)
            deg = len(coef) - 1
            power = np.polynomial.chebyshev.cheb2poly(coef)
            steps.append(_Step(name, "chebnorm", 1 + max(_term_depth(j) for j in range(1, deg + 1)) + 1,
                               {"beta0": m.beta0, "power": power, "n": width}))
            e = dbl(m.weight) * e
            beta = dbl(m.bias)
        else:  # PolyAct / PolyFitAct
            coef = dbl(m.coefficients())
            B = _expand(coef, e, beta)
            deg = len(coef) - 1
            if deg <= 1:
                e, beta = (B[1] if deg == 1 else np.zeros(width)), B[0]
                continue
            depth = max(_term_depth(j) for j in range(1, deg + 1) if np.any(B[j] != 0))
            steps.append(_Step(name, "act", depth, {"B": B}))
            e, beta = np.ones(width), np.zeros(width)
    for i, st in enumerate(steps):
        if st.kind == "linear":
            st.data["final"] = all(x.kind == "affine" for x in steps[i + 1:])
            w_in = st.data["M"].shape[0]
            if w_in & (w_in - 1):
                raise UnsupportedOpError(f"module '{st.name}' (Linear): input width {w_in} must be a power of two "
                                         "(the sample is tiled over the CKKS slots)")
            if not st.data["final"] and st.data["M"].shape[1] & (st.data["M"].shape[1] - 1):
                raise UnsupportedOpError(f"module '{st.name}' (Linear): width {st.data['M'].shape[1]} must be a power "
                                         "of two unless it is the output")
    if not steps or steps[0].kind != "linear":
        if in_width & (in_width - 1):
            raise UnsupportedOpError(f"input width {in_width} must be a power of two (tiled over the CKKS slots)")
    if np.any(e != 1.0) or np.any(beta != 0.0):
        steps.append(_Step("output", "affine", 1 if np.any(e != 1.0) else 0, {"e": e, "beta": beta}))
    return steps, in_width, width


def count_depth(model: nn.Module, input_size: int | None = None) -> DepthCount:
    """The multiplicative depth (CKKS levels) of ``model`` per operator, as :func:`export_ckks` evaluates it.

    Raises :class:`UnsupportedOpError` naming the first module CKKS cannot evaluate."""
    steps, _, _ = _plan(model, input_size)
    return DepthCount(tuple(OpDepth(s.name, s.kind, s.depth) for s in steps))


def choose_parameters(depth: int, security: int = 128, slots: int = 1, inner_bits: int = 30,
                      outer_bits: int = 40) -> tuple[int, list[int]]:
    """``(N, coeff_mod_bit_sizes)``: ``[outer] + [inner] * depth + [outer]`` on the smallest N of
    8192/16384/32768 whose ``security``-bit bound holds the chain and whose N/2 slots hold ``slots``.

    Raises :class:`DepthError` (depth, bits, the largest N and its maximal depth) when none does."""
    depth = check_int("choose_parameters.depth", depth, 0)
    security = check_choice("export_ckks.security", security, tuple(MAX_MODULUS_BITS))
    inner_bits = check_int("export_ckks.inner_bits", inner_bits, 20, 60)
    outer_bits = check_int("export_ckks.outer_bits", outer_bits, inner_bits + 1, 60)
    bits = [outer_bits] + [inner_bits] * depth + [outer_bits]
    table = MAX_MODULUS_BITS[security]
    for n in RING_DEGREES:
        if sum(bits) <= table[n] and n // 2 >= slots:
            return n, bits
    top = RING_DEGREES[-1]
    max_depth = (table[top] - 2 * outer_bits) // inner_bits
    raise DepthError(f"counted multiplicative depth {depth} needs {sum(bits)} modulus bits "
                     f"({outer_bits} + {depth} x {inner_bits} + {outer_bits}); {security}-bit security allows at most "
                     f"{table[top]} bits at the largest supported N = {top} (depth <= {max_depth}); reduce the "
                     "depth (fewer layers, lower degrees) or add bootstrapping")


def _tenseal() -> Any:
    try:
        import tenseal
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("export_ckks needs TenSEAL: pip install 'rankwise[he]' (tenseal==0.3.18)") from e
    return tenseal


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        byte, v = v & 0x7F, v >> 7
        out.append(byte | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _relabel(ts: Any, ctx: Any, vec: Any, n: int) -> Any:
    """``vec`` with TenSEAL's recorded size set to ``n`` (<= the slot count), ciphertext unchanged.

    Every ciphertext here is kept periodic over all slots (the sample tiled, as TenSEAL encrypts it);
    labelled with the full slot count, plaintext operands are tiled too and the period survives; labelled
    ``n``, TenSEAL's vector-matrix product reads one period and its slot sum (rotations by 1..n/2) leaves
    the whole sum in every slot. TenSEAL has no setter for the size: this edits field 1 (``sizes``,
    packed uint32) of the serialised ``CKKSVectorProto``, nothing else."""
    blob = vec.serialize()
    if len(blob) < 3 or blob[0] != 0x0A or blob[1] >= 0x80:
        raise RuntimeError("unexpected TenSEAL CKKSVector serialisation; cannot relabel its size")
    field = blob[2:2 + blob[1]]
    if len(field) != blob[1] or field[-1] & 0x80:
        raise RuntimeError("CKKSVector has several chunks; cannot relabel its size")
    new = _varint(n)
    return ts.ckks_vector_from(ctx, bytes([0x0A, len(new)]) + new + blob[2 + blob[1]:])


class CKKSModel:
    """An exported network: ``depth`` (counted levels), ``poly_modulus_degree``, ``coeff_mod_bit_sizes``;
    :meth:`infer_encrypted` encrypts each sample, runs the chain on the ciphertext and decrypts once,
    at the output. The TenSEAL context (keys: seconds to tens of seconds) is made on first use and
    reused; ``levels_used`` is measured on the last ciphertext (consumed moduli)."""

    def __init__(self, steps: list[_Step], in_width: int, out_width: int, n: int, bits: list[int],
                 security: int, n_threads: int = 1) -> None:
        self.steps, self.in_width, self.out_width = steps, in_width, out_width
        self.poly_modulus_degree, self.coeff_mod_bit_sizes, self.security = n, bits, security
        self.n_threads = n_threads
        self.count = DepthCount(tuple(OpDepth(s.name, s.kind, s.depth) for s in steps))
        self._ctx: Any = None
        self.keygen_s: float | None = None
        self.decryptions = 0
        self.levels_used: int | None = None

    @property
    def depth(self) -> int:
        return self.count.total

    @property
    def context(self) -> Any:
        if self._ctx is None:
            ts = _tenseal()
            t0 = time.perf_counter()
            ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=self.poly_modulus_degree,
                             coeff_mod_bit_sizes=self.coeff_mod_bit_sizes, n_threads=self.n_threads)
            ctx.global_scale = 2.0 ** self.coeff_mod_bit_sizes[1] if len(self.coeff_mod_bit_sizes) > 2 else 2.0**20
            ctx.generate_galois_keys()
            self.keygen_s = time.perf_counter() - t0
            self._ctx = ctx
        return self._ctx

    def encrypt(self, x: Sequence[float]) -> Any:
        v = [float(a) for a in x]
        if len(v) != self.in_width:
            raise ValueError(f"CKKSModel.encrypt: expected {self.in_width} features, got {len(v)}")
        ts = _tenseal()
        return _relabel(ts, self.context, ts.ckks_vector(self.context, v), self.poly_modulus_degree // 2)

    def decrypt(self, ct: Any) -> np.ndarray:
        self.decryptions += 1
        if ct.size() != self.out_width:
            ct = _relabel(_tenseal(), self.context, ct, self.out_width)
        return np.asarray(ct.decrypt(), dtype=np.float64) / getattr(self, "_r", 1.0)

    def run(self, ct: Any) -> Any:
        """The chain on one ciphertext (no decryption)."""
        ev = _Ev(_tenseal(), self.context, self.poly_modulus_degree, self.coeff_mod_bit_sizes)
        top = ct.ciphertext()[0].coeff_modulus_size()
        x = (ct, 0, 1.0)
        for s in self.steps:
            x = getattr(ev, s.kind)(x, s.data)
        ct, _, r = x
        self.levels_used = top - ct.ciphertext()[0].coeff_modulus_size()
        self._r = r
        return ct

    def infer_encrypted(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Logits ``[B, out]`` of the samples ``x`` ``[B, in]`` (or ``[in]``), each encrypted, evaluated and
        decrypted once."""
        arr = np.asarray(x.detach().cpu().double() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
        single = arr.ndim == 1
        arr = arr.reshape(1, -1) if single else arr.reshape(arr.shape[0], -1)
        out = np.stack([self.decrypt(self.run(self.encrypt(row))) for row in arr])
        t = torch.from_numpy(out)
        return t[0] if single else t


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):  # deterministic below 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def seal_primes(n: int, bits: Sequence[int]) -> list[int]:
    """The primes SEAL's ``CoeffModulus::Create(n, bits)`` picks: per bit size, the largest primes
    ``= 1 mod 2n`` below ``2^size``, handed out smallest first (checked against decrypted rescales)."""
    pools: dict[int, list[int]] = {}
    for b in sorted(set(bits)):
        need, found = list(bits).count(b), []
        v = ((1 << b) - 1) // (2 * n) * (2 * n) + 1
        while len(found) < need and v > 1 << (b - 1):
            if _is_prime(v):
                found.append(v)
            v -= 2 * n
        pools[b] = found
    return [pools[b].pop() for b in bits]  # SEAL hands each pool out from its smallest prime


class _Ev:
    """Runs the steps on TenSEAL ciphertexts, tracking each one's level and its scale error ``r``
    (decoded = true x r): TenSEAL resets the scale to 2^30 after each rescale by a prime q != 2^30, so
    the value drifts by 2^30 / q per level. Every plaintext factor and constant is pre-compensated so
    that products with plaintexts come out exact and sums add equal ``r``."""

    def __init__(self, ts: Any, ctx: Any, n: int, bits: list[int]) -> None:
        self.ts, self.ctx, self.slots = ts, ctx, n // 2
        self.scale = 2.0 ** bits[1]
        self.data_primes = seal_primes(n, bits)[:-1]

    def drop(self, level: int) -> float:
        """``2^30 / q`` of the prime dropped by the rescale from ``level``."""
        return self.scale / self.data_primes[len(self.data_primes) - 1 - level]

    def tile(self, v: np.ndarray) -> list[float]:
        return np.tile(v, self.slots // len(v)).tolist()

    def mul_plain(self, x: tuple, v: np.ndarray, post: float = 1.0) -> tuple:
        """``x * v`` with the result's ``r`` equal to ``1 / post``."""
        ct, lv, r = x
        return ct * self.tile(v / (r * self.drop(lv) * post)), lv + 1, 1.0 / post

    def mul(self, a: tuple, b: tuple) -> tuple:
        lv = max(a[1], b[1])
        return a[0] * b[0], lv + 1, a[2] * b[2] * self.drop(lv)

    def add_plain(self, x: tuple, c: float | np.ndarray) -> tuple:
        ct, lv, r = x
        return (ct + float(c) * r if np.isscalar(c) else ct + self.tile(np.asarray(c) * r)), lv, r

    def add(self, a: tuple, b: tuple) -> tuple:
        if abs(a[2] / b[2] - 1.0) > 1e-12:
            raise RuntimeError("internal: adding ciphertexts with different scale errors")
        return a[0] + b[0], max(a[1], b[1]), a[2]

    def slot_sum(self, x: tuple, n: int) -> tuple:
        ct, lv, r = x
        return _relabel(self.ts, self.ctx, _relabel(self.ts, self.ctx, ct, n).sum(), self.slots), lv, r

    def poly(self, x: tuple, B: Sequence[np.ndarray]) -> tuple:
        """``sum_j B_j x^j`` (per-slot coefficient vectors); each term multiplies ``B_j`` into its
        lowest-level factor first, pre-compensated for the rest of its product tree; result ``r = 1``."""
        pows: dict[int, tuple] = {0: x}

        def power(k: int) -> tuple:
            if k not in pows:
                p = power(k - 1)
                pows[k] = self.mul(p, p)
            return pows[k]

        out = None
        for j in range(1, len(B)):
            if not np.any(B[j] != 0):
                continue
            facs = [power(k) for k in range(j.bit_length()) if j >> k & 1]
            # dry run of the product tree: the r it multiplies onto the first factor's
            lv = [facs[0][1] + 1] + [f[1] for f in facs[1:]]
            rs = [1.0] + [f[2] for f in facs[1:]]
            order = sorted(range(len(facs)), key=lambda i: lv[i])
            items = [(lv[i], rs[i]) for i in order]
            while len(items) > 1:
                (la, ra), (lb, rb) = items.pop(0), items.pop(0)
                items.append((max(la, lb) + 1, ra * rb * self.drop(max(la, lb))))
                items.sort(key=lambda it: it[0])
            rest = items[0][1]
            first = self.mul_plain(facs[0], np.asarray(B[j], dtype=np.float64), post=rest)
            tree = sorted([first] + facs[1:], key=lambda f: f[1])
            while len(tree) > 1:
                a, b = tree.pop(0), tree.pop(0)
                tree.append(self.mul(a, b))
                tree.sort(key=lambda f: f[1])
            out = tree[0] if out is None else self.add(out, tree[0])
        return self.add_plain(out, np.asarray(B[0], dtype=np.float64))

    def linear(self, x: tuple, d: dict[str, Any]) -> tuple:
        ct, lv, r = x
        M = d["M"] / (r * self.drop(lv))
        out = _relabel(self.ts, self.ctx, ct, M.shape[0]).mm(M.tolist())
        if d["final"]:
            return out + d["c"].tolist(), lv + 1, 1.0
        return self.add_plain((_relabel(self.ts, self.ctx, out, self.slots), lv + 1, 1.0), d["c"])

    def polynorm(self, x: tuple, d: dict[str, Any]) -> tuple:
        u = self.add_plain(self.slot_sum(self.mul(x, x), d["n"]), d["shift"])
        g = self.add_plain(self.mul(u, u), d["c"])
        return self.mul(x, g)

    def chebnorm(self, x: tuple, d: dict[str, Any]) -> tuple:
        w = self.add_plain(self.slot_sum(self.mul(x, x), d["n"]), d["beta0"])
        return self.mul(x, self.poly(w, [np.full(d["n"], c) for c in d["power"]]))

    def act(self, x: tuple, d: dict[str, Any]) -> tuple:
        return self.poly(x, d["B"])

    def affine(self, x: tuple, d: dict[str, Any]) -> tuple:
        ct, lv, r = x
        n = len(d["e"])
        if ct.size() != n:
            ct = _relabel(self.ts, self.ctx, ct, n)
        if np.any(d["e"] != 1.0):
            ct, lv, r = ct * (d["e"] / (r * self.drop(lv))).tolist(), lv + 1, 1.0
        return ct + (d["beta"] * r).tolist(), lv, r


def export_ckks(model: nn.Module, security: int = 128, *, input_size: int | None = None, inner_bits: int = 30,
                outer_bits: int = 40, n_threads: int = 1) -> CKKSModel:
    """Compile ``model`` (eval mode, a chain of polynomial operators) for CKKS: count its depth, choose
    the ring degree and modulus chain under ``security`` bits, and return the :class:`CKKSModel`.

    Raises :class:`UnsupportedOpError` (naming the module) for an operator CKKS cannot evaluate or a
    PolyNorm whose V-bar was never estimated, :class:`DepthError` when the depth needs more modulus
    than the largest N allows, ``ImportError`` (with the install hint) on first use without TenSEAL."""
    steps, w_in, w_out = _plan(model, input_size)
    depth = sum(s.depth for s in steps)
    n, bits = choose_parameters(depth, security, slots=max(w_in, w_out, 1), inner_bits=inner_bits,
                                outer_bits=outer_bits)
    return CKKSModel(steps, w_in, w_out, n, bits, security, n_threads=n_threads)
