"""Distill-MIM: dataset distillation of two-layer-network training on multi-index models.

Paper: "Dataset Distillation Efficiently Encodes Low-Dimensional Representations from Gradient-Based
Learning of Non-Linear Tasks" (Kinoshita, Nishikawa, Toyoizumi; ICML 2026, arXiv 2603.14830; spec
``shared/methods/distill_multiindex.md``).

The setting, top to bottom in this module:

* :class:`MultiIndexTask`: ``x ~ N(0, I_d)``, ``y = g(U^T x)`` with ``U`` (``d x r``) orthonormal. The
  default link is the quadratic ``y = x^T Q x - tr Q``, ``Q = U S U^T``, ``||S||_F = 1`` (information
  exponent 2, so one large gradient step finds ``span(U)``); ``"he3"`` and ``"tanh"`` are the
  optional links; any callable ``g: (n, r) -> (n,)`` works too.
* :class:`TwoLayerAlg`: the reference training algorithm ``Alg(D)`` of a width-``L`` two-layer
  network ``f(x) = sum_j a_j sigma(w_j . x + b_j)``: stage 1 is one gradient step on ``W`` with a
  large step ``eta1 = sqrt(d) L`` followed by row renormalisation; stage 2 is the ridge readout.
* :class:`GradientMatchingDistiller`: learns the distilled set purely by gradient steps. Stage 1
  learns ``M1 = c r^2`` free points ``(x~, y~)`` by matching the stage-1 gradient of fresh random
  initialisations (redrawn every step) on the distilled set to that on the real data. Stage 2 keeps
  ``M2 = L`` inputs regenerated from a stored seed (zero storage) and learns their ``L`` labels by
  matching the readout gradient (at networks trained by stage 1 on the distilled set, at several
  readout iterates). Memory: ``M1 (d + 1) + L`` numbers, ``Theta(r^2 d + L)``.
* :class:`DistilledSet`: the result; ``alg.train(distilled, seed=...)`` retrains from a new init.

Baselines (equal memory): a random real subset and a k-center coreset of
``floor(memory / (d + 1))`` real points (:func:`random_subset`, :func:`k_center_subset`).
Shapes: inputs ``x (n, d)``, labels ``y (n,)``; batched network parameters carry a leading
``k`` (number of initialisations): ``W (k, L, d)``, ``b (k, L)``, ``a (k, L)``.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from rankwise.core.errors import ArtifactError, NumericalError
from rankwise.core.registry import register
from rankwise.core.validate import check_choice, check_int, check_positive, check_unit

LINKS = ("quadratic", "he3", "tanh")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# ||x~_m|| above CLIP_FACTOR * sqrt(d) is clipped back (spec: exploding distilled inputs).
CLIP_FACTOR = 1e3


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


@dataclass
class RegressionData:
    """A labelled set: inputs ``x (n, d)`` and labels ``y (n,)`` (validated: finite, matching n >= 1)."""

    x: Tensor
    y: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.x, Tensor) or not isinstance(self.y, Tensor):
            raise TypeError("RegressionData.x and .y must be torch tensors")
        if self.x.ndim != 2 or self.y.ndim != 1:
            raise ValueError(f"RegressionData needs x (n, d) and y (n,), got {tuple(self.x.shape)} and "
                             f"{tuple(self.y.shape)}")
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]} labels")
        if self.x.shape[0] < 1:
            raise ValueError("the dataset is empty (n = 0); need at least one labelled point")
        if not bool(torch.isfinite(self.x).all()):
            raise ValueError("RegressionData.x holds NaN/Inf values")
        if not bool(torch.isfinite(self.y).all()):
            raise ValueError("RegressionData.y holds NaN/Inf labels")

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def d(self) -> int:
        return int(self.x.shape[1])

    def split(self, n1: int) -> tuple["RegressionData", "RegressionData"]:
        """The first ``n1`` points and the rest (fresh samples for the two stages of ``Alg``)."""
        if not 1 <= n1 < self.n:
            raise ValueError(f"split point must be in [1, n-1] = [1, {self.n - 1}], got {n1}")
        return RegressionData(self.x[:n1], self.y[:n1]), RegressionData(self.x[n1:], self.y[n1:])

    def subset(self, idx: Tensor) -> "RegressionData":
        return RegressionData(self.x[idx], self.y[idx])


def _he3(t: Tensor) -> Tensor:
    return t ** 3 - 3 * t


@dataclass(frozen=True)
class MultiIndexTask:
    """Multi-index teacher ``y = g(U^T x)``, ``x ~ N(0, I_d)`` (spec "Data").

    ``d``: input dimension; ``r``: number of indices (``1 <= r <= d``); ``link``: ``"quadratic"``
    (``x^T Q x - tr Q``, ``Q = U S U^T``, ``S`` symmetric with ``||S||_F = 1``), ``"he3"``
    (``r^{-1/2} sum_k He_3(u_k . x)``, information exponent 3: the one-step algorithm may fail),
    ``"tanh"`` (``tanh(x^T Q x - tr Q)``) or a callable ``g(z: (n, r)) -> (n,)``; ``seed`` draws ``U``
    and ``S``.
    """

    d: int
    r: int
    link: str | Callable[[Tensor], Tensor] = "quadratic"
    seed: int = 0
    U: Tensor = field(init=False, repr=False, compare=False)
    S: Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("MultiIndexTask.d", self.d, 1)
        check_int("MultiIndexTask.r", self.r)
        check_int("MultiIndexTask.seed", self.seed)
        if not 1 <= self.r <= self.d:
            raise ValueError(f"MultiIndexTask.r must be in [1, d] = [1, {self.d}], got {self.r}")
        if isinstance(self.link, str):
            if self.link not in LINKS:
                raise ValueError(f"MultiIndexTask.link must be one of {LINKS} or a callable, got {self.link!r}")
        elif not callable(self.link):
            raise ValueError(f"MultiIndexTask.link must be one of {LINKS} or a callable, got {self.link!r}")
        if self.link == "he3":
            warnings.warn("link 'he3' has information exponent 3: the one-step feature-learning algorithm "
                          "(and hence the distillation claim, stated for exponent <= 2) may fail", UserWarning,
                          stacklevel=3)
        g = torch.Generator().manual_seed(int(self.seed))
        U, _ = torch.linalg.qr(torch.randn(self.d, self.r, generator=g, dtype=torch.float64))
        A = torch.randn(self.r, self.r, generator=g, dtype=torch.float64)
        S = (A + A.T) / 2
        S = S / torch.linalg.norm(S)
        object.__setattr__(self, "U", U)
        object.__setattr__(self, "S", S)

    @property
    def information_exponent(self) -> int | None:
        """2 for the quadratic and tanh links, 3 for He_3, None for a user callable."""
        return {"quadratic": 2, "tanh": 2, "he3": 3}.get(self.link) if isinstance(self.link, str) else None

    def f(self, x: Tensor) -> Tensor:
        """The target ``y = g(U^T x)`` for inputs ``x (n, d)`` -> ``(n,)``."""
        if x.ndim != 2 or x.shape[1] != self.d:
            raise ValueError(f"x must be (n, d={self.d}), got {tuple(x.shape)}")
        z = x.to(torch.float64) @ self.U
        if self.link in ("quadratic", "tanh"):
            q = ((z @ self.S) * z).sum(1) - torch.trace(self.S)
            y = q if self.link == "quadratic" else torch.tanh(q)
        elif self.link == "he3":
            y = _he3(z).sum(1) / math.sqrt(self.r)
        else:
            y = torch.as_tensor(self.link(z), dtype=torch.float64)  # type: ignore[operator]
            if y.shape != (x.shape[0],):
                raise ValueError(f"the link callable must return shape (n,) = ({x.shape[0]},), got {tuple(y.shape)}")
        return y.to(x.dtype)

    def sample(self, n: int, seed: int, dtype: torch.dtype = torch.float32) -> RegressionData:
        """``n`` fresh samples ``(x, y)`` drawn with ``seed`` (different seeds give independent sets)."""
        check_int("n", n, 1)
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
        x = torch.randn(int(n), self.d, generator=g, dtype=torch.float64)
        return RegressionData(x.to(dtype), self.f(x).to(dtype))

    @property
    def variance(self) -> float:
        """``Var(y)``: exact for the built-in links (2 ||S||_F^2 = 2, and 6 for He_3), Monte Carlo otherwise."""
        if self.link == "quadratic":
            return float(2 * (self.S ** 2).sum())
        if self.link == "he3":
            return 6.0
        data = self.sample(200_000, seed=987_654, dtype=torch.float64)
        return float(data.y.var())

    def energy_ratio(self, X: Tensor) -> float:
        """``||U^T X~||_F^2 / ||X~||_F^2`` for points ``X (m, d)``: the share of their energy in ``span(U)``."""
        X = torch.as_tensor(X, dtype=torch.float64)
        if X.ndim != 2 or X.shape[1] != self.d:
            raise ValueError(f"X must be (m, d={self.d}), got {tuple(X.shape)}")
        tot = float((X ** 2).sum())
        if tot == 0:
            raise ValueError("energy ratio of all-zero points is undefined")
        return float(((X @ self.U) ** 2).sum()) / tot


# --------------------------------------------------------------------------------------------
# the two-layer network and its training algorithm
# --------------------------------------------------------------------------------------------


@dataclass
class NetParams:
    """Batched parameters of ``k`` width-``L`` networks: ``W (k, L, d)``, ``b (k, L)``, ``a (k, L)``."""

    W: Tensor
    b: Tensor
    a: Tensor

    @property
    def k(self) -> int:
        return int(self.W.shape[0])

    def digest(self) -> str:
        """A short fingerprint of the initialisation (to check that inits are redrawn)."""
        h = hashlib.sha256()
        for t in (self.W, self.b, self.a):
            h.update(t.detach().to(torch.float64).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


@dataclass
class TrainedNetwork:
    """A network trained by :meth:`TwoLayerAlg.train`: ``W (L, d)``, ``b (L,)``, ``a (L,)``."""

    W: Tensor
    b: Tensor
    a: Tensor
    activation: str
    seed: int | None = None

    def predict(self, x: Tensor) -> Tensor:
        """``f(x) = sum_j a_j sigma(w_j . x + b_j)`` for ``x (n, d)`` -> ``(n,)``."""
        if x.ndim != 2 or x.shape[1] != self.W.shape[1]:
            raise ValueError(f"x must be (n, d={self.W.shape[1]}), got {tuple(x.shape)}")
        z = x.to(self.W.dtype) @ self.W.T + self.b
        return _act(z, self.activation) @ self.a

    def mse(self, data: RegressionData) -> float:
        return float(((self.predict(data.x).double() - data.y.double()) ** 2).mean())

    def test_mse(self, task: MultiIndexTask, n: int = 10_000, seed: int = 424_242) -> float:
        """Test MSE on ``n`` fresh samples, normalised by ``Var(y)`` (1.0 = predicting the mean)."""
        return self.mse(task.sample(n, seed=seed, dtype=self.W.dtype)) / task.variance


def _act(z: Tensor, activation: str) -> Tensor:
    return torch.relu(z) if activation == "relu" else torch.tanh(z)


def _act_grad(z: Tensor, activation: str) -> Tensor:
    if activation == "relu":
        return (z > 0).to(z.dtype)
    t = torch.tanh(z)
    return 1 - t * t


@dataclass(frozen=True)
class TwoLayerAlg:
    """The reference training algorithm ``Alg(D)`` of a width-``L`` two-layer network (spec "Reference").

    ``width``: L; ``activation``: ``"relu"`` or ``"tanh"``; ``eta1``: stage-1 step (``"auto"`` =
    ``sqrt(d) * L``); ``ridge``: lambda of the stage-2 readout, minimising
    ``(1/2n)||Phi a - y||^2 + (lambda/2)||a||^2`` (closed form in float64, Cholesky; lambda > 0 keeps
    it positive definite); ``renormalize``: rows of ``W`` back to unit norm after stage 1;
    ``dtype``: of the network (``"float32"`` or ``"float64"``).

    Initialisation: ``w_j ~ Unif(S^{d-1})``, ``a_j = +-1/L``, ``b_j ~ N(0, 1)``. ``init_scheme="symmetric"``
    (default) draws ``floor(L/2)`` neurons and mirrors them with the opposite ``a_j`` (same ``w_j``,
    ``b_j``), so that ``f = 0`` at initialisation, the standard device of one-step multi-index analyses:
    the stage-1 gradient is then ``-a_j E[y sigma'(w_j . x + b_j) x]`` alone, without the random term
    that the network's own initial output adds outside ``span(U)``. ``init_scheme="iid"`` draws every sign
    independently.
    """

    width: int = 128
    activation: Literal["relu", "tanh"] = "relu"
    eta1: float | str = "auto"
    ridge: float = 1e-3
    renormalize: bool = True
    dtype: Literal["float32", "float64"] = "float32"
    init_scheme: Literal["symmetric", "iid"] = "symmetric"

    def __post_init__(self) -> None:
        check_choice("TwoLayerAlg.init_scheme", self.init_scheme, ("symmetric", "iid"))
        check_int("TwoLayerAlg.width (L)", self.width, 1)
        check_choice("TwoLayerAlg.activation", self.activation, ("relu", "tanh"))
        if isinstance(self.eta1, str):
            if self.eta1 != "auto":
                raise ValueError(f"TwoLayerAlg.eta1 must be 'auto' or a number > 0, got {self.eta1!r}")
        elif not (isinstance(self.eta1, (int, float)) and math.isfinite(self.eta1) and self.eta1 > 0):
            raise ValueError(f"TwoLayerAlg.eta1 must be 'auto' or a finite number > 0, got {self.eta1!r}")
        check_positive("TwoLayerAlg.ridge", self.ridge)
        check_choice("TwoLayerAlg.dtype", self.dtype, tuple(_DTYPES))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def step_size(self, d: int) -> float:
        """``eta1`` (``sqrt(d) * L`` when ``"auto"``)."""
        return math.sqrt(d) * self.width if self.eta1 == "auto" else float(self.eta1)

    # -- pieces (batched over k initialisations) --------------------------------------------
    def init(self, d: int, k: int = 1, generator: torch.Generator | None = None, seed: int | None = None) -> NetParams:
        """``k`` random initialisations for inputs of dimension ``d``."""
        if generator is None:
            generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
        L, dt = self.width, self.torch_dtype
        m = (L + 1) // 2 if self.init_scheme == "symmetric" else L
        W = torch.randn(k, m, d, generator=generator, dtype=torch.float64)
        W = W / W.norm(dim=2, keepdim=True)
        b = torch.randn(k, m, generator=generator, dtype=torch.float64)
        sign = torch.randint(0, 2, (k, m), generator=generator).to(torch.float64) * 2 - 1
        if self.init_scheme == "symmetric":  # mirror: same (w, b), opposite a; an odd L keeps one unpaired neuron
            h = L // 2
            W = torch.cat([W, W[:, :h]], dim=1)
            b = torch.cat([b, b[:, :h]], dim=1)
            sign = torch.cat([sign, -sign[:, :h]], dim=1)
        return NetParams(W.to(dt), b.to(dt), (sign / L).to(dt))

    def forward(self, p: NetParams, x: Tensor) -> Tensor:
        """Outputs of the ``k`` networks on ``x (n, d)`` -> ``(k, n)``."""
        z = torch.einsum("kld,nd->knl", p.W, x) + p.b[:, None, :]
        return torch.einsum("knl,kl->kn", _act(z, self.activation), p.a)

    def stage1_gradient(self, p: NetParams, x: Tensor, y: Tensor) -> Tensor:
        """Closed-form ``grad_W (1/n) sum (f(x) - y)^2 / 2`` -> ``(k, L, d)``.

        For ReLU: ``g_j = (1/n) sum_i (f(x_i) - y_i) a_j 1[w_j . x_i + b_j > 0] x_i``. Differentiable
        with respect to ``x`` and ``y`` (what gradient matching needs).
        """
        k, L, d = p.W.shape
        n = x.shape[0]
        z = (x @ p.W.reshape(k * L, d).T).reshape(n, k, L) + p.b[None]  # one GEMM for all k networks
        f = (_act(z, self.activation) * p.a[None]).sum(-1)  # (n, k)
        coef = (f - y[:, None])[:, :, None] * _act_grad(z, self.activation) * p.a[None]  # (n, k, L)
        return (coef.reshape(n, k * L).T @ x).reshape(k, L, d) / n

    def stage1(self, p: NetParams, x: Tensor, y: Tensor) -> Tensor:
        """Stage 1: ``W <- W - eta1 grad_W``, then rows renormalised to unit norm -> ``W (k, L, d)``."""
        W = p.W - self.step_size(p.W.shape[2]) * self.stage1_gradient(p, x, y)
        if self.renormalize:
            nrm = W.norm(dim=2, keepdim=True)
            W = W / torch.clamp(nrm, min=torch.finfo(W.dtype).tiny)
        return W

    def features(self, W: Tensor, b: Tensor, x: Tensor) -> Tensor:
        """``sigma(W x + b)`` -> ``(k, n, L)``."""
        k, L, d = W.shape
        z = (x @ W.reshape(k * L, d).T).reshape(x.shape[0], k, L).transpose(0, 1)
        return _act(z + b[:, None, :], self.activation)

    def readout(self, Phi: Tensor, y: Tensor) -> Tensor:
        """Stage 2: ridge readout ``a = (Phi^T Phi / n + lambda I)^{-1} Phi^T y / n`` (float64) -> ``(k, L)``.

        ``Phi (k, n, L)``, ``y (n,)`` (or ``(k, n)``). Raises :class:`NumericalError` if the system is not
        positive definite (it is for ``lambda > 0`` unless the features are non-finite).
        """
        P = Phi.to(torch.float64)
        yy = y.to(torch.float64)
        n = P.shape[1]
        C = P.transpose(1, 2) @ P / n + self.ridge * torch.eye(P.shape[2], dtype=torch.float64)
        c = torch.einsum("knl,kn->kl", P, yy.expand(P.shape[0], n)) / n
        Lc, info = torch.linalg.cholesky_ex(C)
        if bool((info != 0).any()):
            raise NumericalError("ridge readout: the feature Gram matrix is not positive definite (non-finite "
                                 "features?)")
        return torch.cholesky_solve(c[..., None], Lc)[..., 0].to(Phi.dtype)

    # -- the whole algorithm --------------------------------------------------------------
    def train(self, data: "RegressionData | DistilledSet", seed: int = 0,
              stage2: RegressionData | None = None) -> TrainedNetwork:
        """``Alg(D)`` from the initialisation drawn with ``seed``.

        ``data``: a :class:`DistilledSet` (stage 1 on its ``S1``, stage 2 on ``S2``), or a
        :class:`RegressionData` used by stage 1 and, unless ``stage2`` is given, also by stage 2.
        """
        s1, s2 = _stages(data, stage2)
        dt = self.torch_dtype
        p = self.init(s1.d, 1, seed=seed)
        W = self.stage1(p, s1.x.to(dt), s1.y.to(dt))
        a = self.readout(self.features(W, p.b, s2.x.to(dt)), s2.y.to(dt))
        out = TrainedNetwork(W[0], p.b[0], a[0], self.activation, seed)
        if not all(bool(torch.isfinite(t).all()) for t in (out.W, out.a)):
            raise NumericalError(f"Alg produced non-finite weights (seed {seed}); lower eta1")
        return out


def _stages(data: Any, stage2: RegressionData | None) -> tuple[RegressionData, RegressionData]:
    if isinstance(data, DistilledSet):
        if stage2 is not None:
            raise ValueError("a DistilledSet carries its own stage-2 set; do not pass stage2")
        return data.stage1_data(), data.stage2_data()
    if not isinstance(data, RegressionData):
        raise TypeError(f"data must be a RegressionData or DistilledSet, got {type(data).__name__}")
    s2 = data if stage2 is None else stage2
    if not isinstance(s2, RegressionData):
        raise TypeError(f"stage2 must be a RegressionData, got {type(s2).__name__}")
    if s2.d != data.d:
        raise ValueError(f"stage-1 data have d={data.d}, stage-2 data d={s2.d}")
    return data, s2


# --------------------------------------------------------------------------------------------
# distillation objectives (pure functions)
# --------------------------------------------------------------------------------------------


def gradient_matching_loss(alg: TwoLayerAlg, p: NetParams, x_syn: Tensor, y_syn: Tensor, x_real: Tensor,
                           y_real: Tensor, g_real: Tensor | None = None) -> Tensor:
    """Stage-1 objective: mean over the ``k`` inits of ``||G(S1) - G(D)||_F^2 / ||G(D)||_F^2``.

    ``G`` is :meth:`TwoLayerAlg.stage1_gradient` (``(k, L, d)``); ``g_real`` may pass a precomputed
    real gradient. Differentiable in ``x_syn (M1, d)`` and ``y_syn (M1,)``.
    """
    if g_real is None:
        g_real = alg.stage1_gradient(p, x_real, y_real)
    g_syn = alg.stage1_gradient(p, x_syn, y_syn)
    den = (g_real ** 2).sum(dim=(1, 2)).clamp_min(torch.finfo(g_real.dtype).tiny)
    return (((g_syn - g_real) ** 2).sum(dim=(1, 2)) / den).mean()


@dataclass
class ReadoutMatchingProblem:
    """Stage-2 objective at ``k`` networks; linear in the labels ``y2`` (so a least-squares oracle exists).

    For network ``k`` (``W`` from stage 1 on the distilled ``S1``): ``Phi_S`` are the features of the
    ``M2`` stage-2 inputs, ``C_S = Phi_S^T Phi_S / M2``, ``b_S(y2) = Phi_S^T y2 / M2``; ``C_R``, ``c_R`` the
    same on the real stage-2 data; ``a*`` the real ridge readout. The readout gradients are
    ``g_S(a) = (C_S + lambda) a - b_S(y2)`` and ``g_R(a) = (C_R + lambda) a - c_R``. The loss averages
    ``||g_S(a) - g_R(a)||^2 / ||c_R||^2`` over the readout iterates

    * ``a_S(y2) = (C_S + lambda)^{-1} b_S(y2)``, the readout that stage 2 of ``Alg`` learns on
      ``(S2, y2)`` (there ``g_S = 0``: the term is ``||g_R(a_S)||^2``, the real-data gradient at the
      distilled readout);
    * ``a*`` and antithetic pairs ``a* +- delta`` around it (there ``g_R(a) = (C_R + lambda)(a - a*)``);

    and over the networks. In matrix form ``loss = mean_k sum_i ||A_ki y2 - t_ki||^2 / (I s_k)``.
    """

    A: Tensor  # (k, I, L, M2)
    t: Tensor  # (k, I, L)
    scale: Tensor  # (k,)
    Phi_S: Tensor  # (k, M2, L)
    W: Tensor | None = None  # (k, L, d) stage-1 weights of the k networks
    b: Tensor | None = None  # (k, L)

    def loss(self, y2: Tensor) -> Tensor:
        r = torch.einsum("kilm,m->kil", self.A, y2) - self.t
        return ((r ** 2).sum(-1).mean(-1) / self.scale).mean()

    def lstsq_labels(self) -> Tensor:
        """Closed-form minimiser of :meth:`loss` (a test oracle: the method itself uses gradient steps)."""
        k, I, L, M = self.A.shape
        w = (1.0 / (self.scale.to(torch.float64) * I * k)).sqrt()  # (k,)
        A = (self.A.to(torch.float64) * w[:, None, None, None]).reshape(k * I * L, M)
        rhs = (self.t.to(torch.float64) * w[:, None, None]).reshape(-1)
        return torch.linalg.lstsq(A, rhs[:, None], driver="gelsd").solution[:, 0]

    def readout(self, alg: TwoLayerAlg, y2: Tensor) -> Tensor:
        """The ridge readouts ``(k, L)`` that stage 2 of ``Alg`` learns on ``(S2 inputs, y2)``."""
        return alg.readout(self.Phi_S, y2)

    def networks(self, alg: TwoLayerAlg, y2: Tensor) -> list[TrainedNetwork]:
        """The ``k`` networks of this problem retrained on the distilled set (same inits as distillation)."""
        if self.W is None or self.b is None:
            raise ValueError("this problem does not hold the networks' weights")
        a = self.readout(alg, y2)
        return [TrainedNetwork(self.W[i], self.b[i], a[i], alg.activation) for i in range(a.shape[0])]


def readout_matching_problem(alg: TwoLayerAlg, p: NetParams, W: Tensor, z: Tensor, x_real: Tensor, y_real: Tensor,
                             n_pairs: int, spread: float, generator: torch.Generator,
                             endpoint: bool = True) -> ReadoutMatchingProblem:
    """Build the stage-2 matching problem at networks ``(W (k, L, d), p.b)`` (see :class:`ReadoutMatchingProblem`).

    Iterates: the distilled readout ``a_S(y2)`` (if ``endpoint``), ``a*`` and ``n_pairs`` antithetic pairs
    ``a* +- spread * ||a*|| / sqrt(L) * xi``. Computed in float64, returned in ``W``'s dtype.
    """
    dt = W.dtype
    f64 = torch.float64
    Phi_S = alg.features(W, p.b, z).to(f64)  # (k, M2, L)
    Phi_R = alg.features(W, p.b, x_real).to(f64)
    M2, n, L = Phi_S.shape[1], Phi_R.shape[1], Phi_S.shape[2]
    eye = torch.eye(L, dtype=f64)
    C_S = Phi_S.transpose(1, 2) @ Phi_S / M2 + alg.ridge * eye
    C_R = Phi_R.transpose(1, 2) @ Phi_R / n + alg.ridge * eye
    c_R = torch.einsum("knl,n->kl", Phi_R, y_real.to(f64)) / n
    a_star = torch.linalg.solve(C_R, c_R)  # (k, L)
    k = a_star.shape[0]
    B = Phi_S.transpose(1, 2) / M2  # (k, L, M2): b_S = B y2
    blocks_A, blocks_t = [], []
    if endpoint:  # g_S - g_R at a_S = -g_R(a_S) = c_R - C_R C_S^{-1} B y2
        blocks_A.append(-(C_R @ torch.linalg.solve(C_S, B))[:, None])
        blocks_t.append(-c_R[:, None])
    xi = torch.randn(k, n_pairs, L, generator=generator, dtype=f64)
    delta = spread * a_star.norm(dim=1)[:, None, None] / math.sqrt(L) * xi
    iters = torch.cat([a_star[:, None, :], a_star[:, None, :] + delta, a_star[:, None, :] - delta], dim=1)
    # g_S(a) - g_R(a) = (C_S - C_R) a + c_R - B y2  ->  A = B, t = (C_S - C_R) a + c_R   (sign flipped)
    blocks_A.append(B[:, None].expand(k, iters.shape[1], L, M2))
    blocks_t.append(torch.einsum("kij,kmj->kmi", C_S - C_R, iters) + c_R[:, None, :])
    A = torch.cat(blocks_A, dim=1)
    t = torch.cat(blocks_t, dim=1)
    scale = (c_R ** 2).sum(1).clamp_min(1e-30)
    return ReadoutMatchingProblem(A=A.to(dt), t=t.to(dt), scale=scale.to(dt), Phi_S=Phi_S.to(dt), W=W, b=p.b)


# --------------------------------------------------------------------------------------------
# the distilled set
# --------------------------------------------------------------------------------------------


@dataclass
class DistillHistory:
    """Per-step records of a distillation: stage-1 loss, the digest of the inits used at each step,
    the energy ratio of the distilled inputs in ``span(U)`` when a task is known, stage-2 loss."""

    stage1_loss: list[float] = field(default_factory=list)
    init_digests: list[str] = field(default_factory=list)
    stage2_loss: list[float] = field(default_factory=list)
    clipped: int = 0


@dataclass
class DistilledSet:
    """The distilled data: ``S1 = (x1 (M1, d), y1 (M1,))`` and ``S2 = (inputs from seed2, y2 (M2,))``.

    ``memory_numbers = M1 (d + 1) + M2`` (the stage-2 inputs are regenerated from the integer
    ``seed2``: zero storage); ``memory_bytes`` counts the stored float32 values plus 8 bytes for
    the seed.
    """

    x1: Tensor
    y1: Tensor
    y2: Tensor
    seed2: int
    history: DistillHistory = field(default_factory=DistillHistory)

    def __post_init__(self) -> None:
        if self.x1.ndim != 2 or self.y1.shape != (self.x1.shape[0],) or self.y2.ndim != 1:
            raise ValueError(f"DistilledSet needs x1 (M1, d), y1 (M1,), y2 (M2,); got {tuple(self.x1.shape)}, "
                             f"{tuple(self.y1.shape)}, {tuple(self.y2.shape)}")
        if self.x1.shape[0] < 1 or self.y2.shape[0] < 1:
            raise ValueError("DistilledSet needs M1 >= 1 and M2 >= 1")

    @property
    def d(self) -> int:
        return int(self.x1.shape[1])

    @property
    def m1(self) -> int:
        return int(self.x1.shape[0])

    @property
    def m2(self) -> int:
        return int(self.y2.shape[0])

    @property
    def memory_numbers(self) -> int:
        return self.m1 * (self.d + 1) + self.m2

    @property
    def memory_bytes(self) -> int:
        return 4 * self.memory_numbers + 8

    def stage2_inputs(self, dtype: torch.dtype | None = None) -> Tensor:
        """The ``M2`` stage-2 inputs ``z ~ N(0, I_d)`` regenerated from ``seed2`` -> ``(M2, d)``."""
        return stage2_inputs(self.seed2, self.m2, self.d, dtype or self.x1.dtype)

    def stage1_data(self) -> RegressionData:
        return RegressionData(self.x1, self.y1)

    def stage2_data(self) -> RegressionData:
        return RegressionData(self.stage2_inputs(), self.y2)

    def save(self, path: str | Path) -> Path:
        """One safetensors file (``x1``, ``y1``, ``y2``; seed and sizes in the JSON metadata), atomically."""
        from rankwise.core.io import save_tensors

        meta = {"rankwise": "distill_multiindex", "seed2": int(self.seed2), "m1": self.m1, "m2": self.m2,
                "d": self.d, "memory_numbers": self.memory_numbers}
        return save_tensors(path, {"x1": self.x1, "y1": self.y1, "y2": self.y2}, meta)

    @classmethod
    def load(cls, path: str | Path) -> "DistilledSet":
        from rankwise.core.io import load_tensors

        t, meta = load_tensors(path, {"x1": ((None, None), None), "y1": ((None,), None), "y2": ((None,), None)})
        if meta.get("rankwise") != "distill_multiindex" or not isinstance(meta.get("seed2"), int):
            raise ArtifactError(f"{path}: not a rankwise distilled set (metadata {meta})")
        try:
            return cls(t["x1"], t["y1"], t["y2"], int(meta["seed2"]))
        except ValueError as e:
            raise ArtifactError(f"{path}: {e}") from e


def stage2_inputs(seed: int, m: int, d: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Deterministic stage-2 inputs ``(m, d)`` ~ ``N(0, I_d)`` from an integer seed."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(int(m), int(d), generator=g, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# the distiller
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistillConfig:
    """Hyper-parameters of :class:`GradientMatchingDistiller` (spec "Distillation").

    Stage 1: ``m1`` distilled points (spec ``c r^2``, ``c = 2``), ``inits_per_step`` fresh inits per
    step, ``steps`` Adam steps at ``lr``, ``real_batch`` real points per step for the real gradient
    (a fresh random batch each step; ``None`` = all), ``init``: distilled inputs start at random real
    points (``"real"``) or ``N(0, I)`` (``"gaussian"``), their labels at the real labels (or 0).
    Stage 2: ``m2`` points (``None`` = the width L), labels learned by ``stage2_steps`` Adam steps
    at ``stage2_lr`` (cosine-decayed to 0 so the labels settle), ``stage2_inits`` networks per step
    (redrawn each step unless ``stage2_redraw=False``), ``stage2_pairs`` antithetic readout iterates
    around the real readout at relative spread ``stage2_spread`` (plus the distilled readout itself
    when ``stage2_endpoint``), a fresh batch of ``stage2_real_batch`` real stage-2 points per step
    (``None`` = all); the labels start at the mean prediction of networks trained on ``S1`` and the
    real stage-2 data (``stage2_init="expert"``) or at 0. ``stage1_fraction``: share of the
    real data used as stage-1 data (the rest is stage-2 data). ``seed``: all draws.
    """

    m1: int = 8
    inits_per_step: int = 16
    steps: int = 1000
    lr: float = 6e-2
    real_batch: int | None = 1024
    init: Literal["real", "gaussian"] = "gaussian"
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    stage2_steps: int = 300
    stage2_lr: float = 5e-2
    stage2_inits: int = 4
    stage2_redraw: bool = True
    stage2_pairs: int = 1
    stage2_spread: float = 0.5
    stage2_init: Literal["expert", "zero"] = "expert"
    stage2_endpoint: bool = True
    stage2_real_batch: int | None = 2048
    m2: int | None = None
    stage1_fraction: float = 2 / 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("m1", "inits_per_step", "steps", "stage2_steps", "stage2_inits", "stage2_pairs"):
            lo = 0 if name in ("steps", "stage2_steps", "stage2_pairs") else 1
            check_int(f"DistillConfig.{name}", getattr(self, name), lo)
        for name in ("m2", "real_batch", "stage2_real_batch"):
            check_int(f"DistillConfig.{name}", getattr(self, name), 1, allow_none=True)
        for name in ("lr", "stage2_lr", "stage2_spread"):
            check_positive(f"DistillConfig.{name}", getattr(self, name))
        check_unit("DistillConfig.stage1_fraction", self.stage1_fraction, low_open=True, high_open=True)
        check_choice("DistillConfig.lr_schedule", self.lr_schedule, ("cosine", "constant"))
        check_choice("DistillConfig.stage2_init", self.stage2_init, ("expert", "zero"))
        check_choice("DistillConfig.init", self.init, ("real", "gaussian"))


class GradientMatchingDistiller:
    """Learns a :class:`DistilledSet` for ``alg`` from real data, by gradient steps only.

    ``GradientMatchingDistiller(alg, m1=8, inits_per_step=16, steps=300, lr=1e-2)`` (any
    :class:`DistillConfig` field as a keyword, or ``config=``). ``fit(real)`` splits the real data
    into stage-1 and stage-2 parts (``stage1_fraction``), or takes them separately with
    ``fit(real1, stage2_real=real2)``. ``task`` (optional) only records the energy ratio per step.
    """

    def __init__(self, alg: TwoLayerAlg, config: DistillConfig | None = None, **overrides: Any) -> None:
        if not isinstance(alg, TwoLayerAlg):
            raise TypeError(f"alg must be a TwoLayerAlg, got {type(alg).__name__}")
        base = config or DistillConfig()
        if overrides:
            fields = dict(base.__dict__)
            unknown = set(overrides) - set(fields)
            if unknown:
                raise TypeError(f"unknown DistillConfig field(s) {sorted(unknown)}")
            fields.update(overrides)
            base = DistillConfig(**fields)
        self.alg = alg
        self.config = base

    def fit(self, real: RegressionData, stage2_real: RegressionData | None = None,
            task: MultiIndexTask | None = None) -> DistilledSet:
        """Distil ``real`` (stage 1 then stage 2); returns the :class:`DistilledSet`."""
        if not isinstance(real, RegressionData):
            raise TypeError(f"real must be a RegressionData, got {type(real).__name__}")
        if stage2_real is None:
            real1, real2 = real.split(self.split_point(real.n))
        else:
            real1, real2 = real, stage2_real
            if real2.d != real1.d:
                raise ValueError(f"stage-1 real data have d={real1.d}, stage-2 real data d={real2.d}")
        hist = DistillHistory()
        x1, y1 = self.distill_stage1(real1, hist, task)
        y2, seed2 = self.distill_stage2(x1, y1, real2, hist)
        return DistilledSet(x1, y1, y2, seed2, hist)

    def split_point(self, n: int) -> int:
        """Number of real points used as stage-1 data when ``fit`` splits one real set."""
        n1 = int(round(self.config.stage1_fraction * n))
        if n < 2:
            raise ValueError(f"need at least 2 real points to split into the two stages, got n={n}")
        return min(max(n1, 1), n - 1)

    # -- stage 1 ------------------------------------------------------------------------------
    def distill_stage1(self, real: RegressionData, hist: DistillHistory | None = None,
                       task: MultiIndexTask | None = None) -> tuple[Tensor, Tensor]:
        """Learn ``S1`` by gradient matching over fresh inits (redrawn every step). Returns ``(x1, y1)``."""
        cfg, alg = self.config, self.alg
        hist = hist if hist is not None else DistillHistory()
        dt = alg.torch_dtype
        g = torch.Generator().manual_seed(cfg.seed)
        xr, yr = real.x.to(dt), real.y.to(dt)
        d = real.d
        if cfg.init == "real":
            idx = torch.randint(0, real.n, (cfg.m1,), generator=g)
            x0, y0 = xr[idx].clone(), yr[idx].clone()
        else:
            x0 = torch.randn(cfg.m1, d, generator=g, dtype=torch.float64).to(dt)
            y0 = torch.zeros(cfg.m1, dtype=dt)
        xs = x0.requires_grad_(True)
        ys = y0.requires_grad_(True)
        opt = torch.optim.Adam([xs, ys], lr=cfg.lr)
        sched = _schedule(opt, cfg.lr_schedule, cfg.steps)
        clip = CLIP_FACTOR * math.sqrt(d)
        for _ in range(cfg.steps):
            p = alg.init(d, cfg.inits_per_step, generator=g)
            hist.init_digests.append(p.digest())
            if cfg.real_batch is not None and cfg.real_batch < real.n:
                bi = torch.randint(0, real.n, (cfg.real_batch,), generator=g)
                xb, yb = xr[bi], yr[bi]
            else:
                xb, yb = xr, yr
            with torch.no_grad():
                g_real = alg.stage1_gradient(p, xb, yb)
            loss = gradient_matching_loss(alg, p, xs, ys, xb, yb, g_real=g_real)
            if not torch.isfinite(loss):
                raise NumericalError("stage-1 gradient-matching loss became non-finite; lower the lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                nrm = xs.norm(dim=1)
                big = nrm > clip
                if bool(big.any()):
                    hist.clipped += int(big.sum())
                    warnings.warn(f"{int(big.sum())} distilled input(s) exceeded norm {clip:.3g} = 1e3 sqrt(d); "
                                  "clipped back (lower the lr)", RuntimeWarning, stacklevel=2)
                    xs[big] = xs[big] * (clip / nrm[big])[:, None]
            hist.stage1_loss.append(float(loss.detach()))
        return xs.detach(), ys.detach()

    # -- stage 2 ------------------------------------------------------------------------------
    def stage2_seed(self) -> int:
        """The integer seed of the stage-2 inputs (derived from the config seed)."""
        return int(self.config.seed) * 7919 + 2_027

    def distill_stage2(self, x1: Tensor, y1: Tensor, real: RegressionData,
                       hist: DistillHistory | None = None) -> tuple[Tensor, int]:
        """Learn the ``M2`` stage-2 labels by readout-gradient matching (Adam). Returns ``(y2, seed2)``."""
        cfg, alg = self.config, self.alg
        hist = hist if hist is not None else DistillHistory()
        dt = alg.torch_dtype
        d = x1.shape[1]
        m2 = cfg.m2 or alg.width
        seed2 = self.stage2_seed()
        z = stage2_inputs(seed2, m2, d, dt)
        g = torch.Generator().manual_seed(cfg.seed + 1)
        xr, yr = real.x.to(dt), real.y.to(dt)
        problem = None if cfg.stage2_redraw else self._stage2_problem(x1, y1, z, xr, yr, g)
        if cfg.stage2_init == "expert":
            # warm start: the mean prediction at z of networks trained by Alg on (S1, real stage-2 data)
            p = alg.init(d, cfg.stage2_inits, generator=g)
            W = alg.stage1(p, x1, y1)
            a = alg.readout(alg.features(W, p.b, xr), yr)
            y0 = torch.einsum("kml,kl->km", alg.features(W, p.b, z), a).mean(0)
        else:
            y0 = torch.zeros(m2, dtype=dt)
        y2 = y0.detach().clone().requires_grad_(True)
        opt = torch.optim.Adam([y2], lr=cfg.stage2_lr)
        sched = _schedule(opt, "cosine", cfg.stage2_steps)
        for _ in range(cfg.stage2_steps):
            if problem is not None:
                prob = problem
            elif cfg.stage2_real_batch is not None and cfg.stage2_real_batch < xr.shape[0]:
                bi = torch.randint(0, xr.shape[0], (cfg.stage2_real_batch,), generator=g)
                prob = self._stage2_problem(x1, y1, z, xr[bi], yr[bi], g)
            else:
                prob = self._stage2_problem(x1, y1, z, xr, yr, g)
            loss = prob.loss(y2)
            if not torch.isfinite(loss):
                raise NumericalError("stage-2 readout-matching loss became non-finite; lower stage2_lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            hist.stage2_loss.append(float(loss.detach()))
        return y2.detach(), seed2

    def _stage2_problem(self, x1: Tensor, y1: Tensor, z: Tensor, xr: Tensor, yr: Tensor,
                        g: torch.Generator) -> ReadoutMatchingProblem:
        cfg, alg = self.config, self.alg
        p = alg.init(x1.shape[1], cfg.stage2_inits, generator=g)
        W = alg.stage1(p, x1, y1)
        return readout_matching_problem(alg, p, W, z, xr, yr, cfg.stage2_pairs, cfg.stage2_spread, g,
                                        endpoint=cfg.stage2_endpoint)

    def stage2_problem(self, distilled: DistilledSet, real: RegressionData, seed: int = 0) -> ReadoutMatchingProblem:
        """A fixed stage-2 problem (for the oracle check): inits drawn from ``seed``."""
        dt = self.alg.torch_dtype
        g = torch.Generator().manual_seed(seed)
        return self._stage2_problem(distilled.x1.to(dt), distilled.y1.to(dt), distilled.stage2_inputs(dt),
                                    real.x.to(dt), real.y.to(dt), g)


def _schedule(opt: torch.optim.Optimizer, kind: str, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Constant, or cosine decay from the base lr to 0 over ``steps``."""
    if kind == "constant":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))


# --------------------------------------------------------------------------------------------
# equal-memory baselines
# --------------------------------------------------------------------------------------------


def points_for_memory(memory_numbers: int, d: int) -> int:
    """How many real labelled points fit in a memory budget: ``floor(memory / (d + 1))`` (at least 1)."""
    return max(1, int(memory_numbers) // (int(d) + 1))


def random_subset(real: RegressionData, m: int, seed: int = 0) -> RegressionData:
    """``m`` real points drawn uniformly without replacement."""
    if not 1 <= m <= real.n:
        raise ValueError(f"m must be in [1, n] = [1, {real.n}], got {m}")
    g = torch.Generator().manual_seed(seed)
    return real.subset(torch.randperm(real.n, generator=g)[:m])


def k_center_subset(real: RegressionData, m: int, seed: int = 0) -> RegressionData:
    """Greedy k-center coreset of ``m`` real points on the inputs (farthest-point traversal)."""
    if not 1 <= m <= real.n:
        raise ValueError(f"m must be in [1, n] = [1, {real.n}], got {m}")
    g = torch.Generator().manual_seed(seed)
    x = real.x.to(torch.float64)
    chosen = [int(torch.randint(0, real.n, (1,), generator=g))]
    dist = ((x - x[chosen[0]]) ** 2).sum(1)
    for _ in range(m - 1):
        i = int(torch.argmax(dist))
        chosen.append(i)
        dist = torch.minimum(dist, ((x - x[i]) ** 2).sum(1))
    return real.subset(torch.tensor(chosen))


def distill(real: RegressionData, alg: TwoLayerAlg | None = None, config: DistillConfig | None = None,
            **overrides: Any) -> DistilledSet:
    """Entry point: ``GradientMatchingDistiller(alg or TwoLayerAlg(), config, **overrides).fit(real)``."""
    return GradientMatchingDistiller(alg or TwoLayerAlg(), config, **overrides).fit(real)


register("distill_multiindex", config=DistillConfig, entry=distill,
         solvers={"task": MultiIndexTask, "alg": TwoLayerAlg, "distiller": GradientMatchingDistiller})

__all__ = [
    "LINKS", "RegressionData", "MultiIndexTask", "NetParams", "TrainedNetwork", "TwoLayerAlg",
    "gradient_matching_loss", "ReadoutMatchingProblem", "readout_matching_problem", "DistillHistory",
    "DistilledSet", "stage2_inputs", "DistillConfig", "GradientMatchingDistiller", "points_for_memory",
    "random_subset", "k_center_subset", "distill",
]
