"""Stochastic token dynamics: deep Transformers with random value matrices as particles on the sphere.

Paper: "Clustering in Deep Stochastic Transformers" (Fedorov, Sander, Elie, Marion, Lauriere),
arXiv 2601.21942, ICML 2026. Spec: ``shared/methods/token_dynamics.md``.

``n`` tokens are unit vectors ``u_i`` in ``S^{d-1}`` (RMS normalisation with the scale ``sqrt(d)``
removed). One layer of the deep stochastic Transformer, with ``K`` layers over a horizon ``T`` and
step ``h = T / K``, is (spec "Method", steps 2a-2c)::

    A_i(u)  = sum_j P_ij u_j,     P_ij = softmax_j(beta <u_i, u_j>)              (attention)
    y_i     = u_i + h Vbar A_i + s sqrt(h) V_k A_i,   V_k entries iid N(0, 1/d)  (one V_k for ALL tokens)
    u_i^+   = y_i / ||y_i||                                                        (RMS norm)

with ``Vbar = drift * I`` (0 in the paper's model: centred random values) and the noise scale ``s``
(1 in the paper's model; ``s = 0, drift = 1`` is the deterministic attention flow baseline). Its
depth limit is the Ito SDE (spec "Continuous limit")::

    du_i = P_perp(u_i) (dW_t A_i + Vbar A_i dt) - s^2 (d-1)/(2d) ||A_i||^2 u_i dt,

``W_t`` a ``d x d`` matrix of independent Brownian motions of variance ``s^2 t / d``, common to
all tokens. For two tokens ``rho = <u_1, u_2>`` is a one-dimensional diffusion with absorbing
points ``+1`` (collapse) and ``-1`` (antipodal pair); :func:`two_token_drift_diffusion` gives its
coefficients and :func:`lyapunov_exponents` the stability of both ends.

Everything numerical is float64 numpy, vectorised over independent runs (and over ``beta`` for a
phase diagram). The torch part (:mod:`.transformer`) holds :class:`SphereTransformer`, a trainable deep
Transformer with the same layer, and :class:`StochasticValueInit`, which re-initialises the value
projections of any torch Transformer (GPT-2, BERT, Llama, ``nn.MultiheadAttention``).
"""

from __future__ import annotations

import csv
import io
import math
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from rankwise.core.errors import NumericalError
from rankwise.core.registry import register
from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive, check_unit
from rankwise.science.token_dynamics.transformer import SphereTransformer, StochasticValueInit, hidden_state_grams

__all__ = [
    "TokenDynamicsConfig",
    "TokenDynamicsResult",
    "PhaseDiagram",
    "simulate",
    "phase_diagram",
    "two_token_phase_diagram",
    "coupled_refinement",
    "attention_average",
    "two_token_drift_diffusion",
    "lyapunov_exponents",
    "antipodal_boundary_beta",
    "count_clusters",
    "has_antipodal_pair",
    "SphereTransformer",
    "StochasticValueInit",
    "hidden_state_grams",
]

Integrator = Literal["discrete", "sde"]

# A token whose update lands within this distance of the origin cannot be normalised; the step is
# redrawn for that run (probability zero for the noisy model) -- spec "Bad input and edge cases".
DEGENERATE_FLOOR = 1e-12
MAX_RESAMPLES = 100
# Memory guard for trajectories kept in RAM (float64 bytes).
MAX_TRAJ_BYTES = 2 * 1024**3


# --------------------------------------------------------------------------------------------------
# Config and result


@dataclass(frozen=True)
class TokenDynamicsConfig:
    """Settings of one Monte-Carlo experiment (defaults: the spec's choices T = 20, h = 0.01, R = 200).

    Attributes:
        n_tokens: ``n >= 1`` tokens per run.
        dim: ``d >= 2``, the ambient dimension (tokens live on ``S^{d-1}``).
        beta: interaction strength (the single knob; ``Q^T K = beta I``). Negative values are allowed
            with a warning (repulsive attention).
        horizon: ``T > 0``, the depth-time horizon.
        step: ``h`` in ``(0, 0.5]``; the number of layers is ``K = round(T / h)`` and the step used is
            ``T / K`` (equal to ``h`` when ``h`` divides ``T``).
        runs: ``R >= 1`` independent runs (independent inits and value matrices), vectorised.
        noise: ``True``: random value matrices (the paper's model). ``False``: the deterministic
            attention flow baseline (``s = 0``).
        noise_scale: ``s`` in ``[0, 1]``, multiplies the random part of the values (spec's
            noise-suppressed variant ``V_k = E[V] + s * noise``); ignored when ``noise=False``.
        drift: the mean value matrix is ``drift * I``; ``None`` means 0 with noise (centred random
            values, the paper's model) and 1 without (the classical ``V = I`` attention flow).
        integrator: ``"discrete"`` (the deep network itself, layers 2a-2c) or ``"sde"``
            (Euler-Maruyama of the limiting Ito SDE, coefficients evaluated at ``u/|u|``, the state
            not projected back to the sphere).
        keep_traj: keep the token positions at the recorded layers, shape ``(R, n_rec, n, d)``.
        record_every: record the Gram matrices (and positions if ``keep_traj``) every this many
            layers; layer 0 and layer ``K`` are always recorded.
        threshold: ``rho < -threshold`` is "antipodal", ``rho > threshold`` "collapsed" (0.99).
        seed: seed of the numpy generator (inits and value matrices).
    """

    n_tokens: int = 2
    dim: int = 8
    beta: float = 4.0
    horizon: float = 20.0
    step: float = 0.01
    runs: int = 200
    noise: bool = True
    noise_scale: float = 1.0
    drift: float | None = None
    integrator: str = "discrete"
    keep_traj: bool = False
    record_every: int = 10
    threshold: float = 0.99
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("TokenDynamicsConfig.n_tokens", self.n_tokens, 1)
        check_int("TokenDynamicsConfig.dim", self.dim, 2)  # tokens on the sphere S^(d-1)
        check_int("TokenDynamicsConfig.runs", self.runs, 1)
        check_int("TokenDynamicsConfig.record_every", self.record_every, 1)
        check_int("TokenDynamicsConfig.seed", self.seed, 0)
        beta = check_number("TokenDynamicsConfig.beta", self.beta)
        if beta < 0:
            warnings.warn(f"TokenDynamicsConfig.beta={beta} < 0: repulsive attention, outside the paper's setting",
                          stacklevel=3)
        T = check_positive("TokenDynamicsConfig.horizon", self.horizon)
        h = check_number("TokenDynamicsConfig.step", self.step, 0.0, 0.5, low_open=True)
        if h > T:
            raise ValueError(f"TokenDynamicsConfig.step={h} exceeds the horizon {T}")
        check_unit("TokenDynamicsConfig.noise_scale", self.noise_scale)
        check_number("TokenDynamicsConfig.drift", self.drift, allow_none=True)
        check_bool("TokenDynamicsConfig.noise", self.noise)
        check_bool("TokenDynamicsConfig.keep_traj", self.keep_traj)
        check_choice("TokenDynamicsConfig.integrator", self.integrator, ("discrete", "sde"))
        check_unit("TokenDynamicsConfig.threshold", self.threshold, low_open=True, high_open=True)
        if self.keep_traj:
            n_rec = self.n_layers // self.record_every + 2
            need = self.runs * n_rec * self.n_tokens * self.dim * 8
            if need > MAX_TRAJ_BYTES:
                raise ValueError(f"keep_traj=True would hold {need / 2**30:.1f} GiB of positions; raise record_every "
                                 f"(now {self.record_every}) or lower runs (now {self.runs})")

    @property
    def n_layers(self) -> int:
        """``K = round(T / h)`` (at least 1)."""
        return max(1, int(round(self.horizon / self.step)))

    @property
    def effective_step(self) -> float:
        """The step actually used, ``T / K``."""
        return self.horizon / self.n_layers

    @property
    def effective_noise(self) -> float:
        """``s``: ``noise_scale`` with noise on, 0 without."""
        return float(self.noise_scale) if self.noise else 0.0

    @property
    def effective_drift(self) -> float:
        """The coefficient of the mean value matrix ``Vbar = drift * I``."""
        if self.drift is not None:
            return float(self.drift)
        return 0.0 if self.noise else 1.0


@dataclass
class TokenDynamicsResult:
    """What :func:`simulate` returns.

    Attributes:
        config: the configuration that produced it.
        final: ``(R, n, d)`` final tokens, normalised to unit length (for ``integrator="sde"`` the
            unnormalised Euler-Maruyama state drifts off the sphere; see ``max_norm_error``).
        gram: ``(R, n, n)`` final Gram matrices ``u u^T`` of the normalised tokens.
        times: ``(n_rec,)`` depth-times ``k h`` of the recorded layers.
        gram_path: ``(R, n_rec, n, n)`` Gram matrices at the recorded layers.
        traj: ``(R, n_rec, n, d)`` positions at the recorded layers (``keep_traj=True``), else None.
        n_layers: ``K``. step: ``h = T / K``.
        resampled: how many (run, layer) updates were redrawn because a token hit the origin.
        max_norm_error: ``max |‖u_i‖ - 1|`` over all layers before normalisation of the reported state
            (discrete: rounding only, ~1e-15; sde: the Euler-Maruyama drift off the sphere).
        wall_time_s: seconds spent.
    """

    config: TokenDynamicsConfig
    final: np.ndarray
    gram: np.ndarray
    times: np.ndarray
    gram_path: np.ndarray
    traj: np.ndarray | None
    n_layers: int
    step: float
    resampled: int = 0
    max_norm_error: float = 0.0
    wall_time_s: float = 0.0

    def rho(self) -> np.ndarray:
        """``(R,)`` final ``<u_1, u_2>`` (two tokens or more: tokens 0 and 1)."""
        self._need_pair()
        return self.gram[:, 0, 1].copy()

    def rho_path(self) -> np.ndarray:
        """``(R, n_rec)`` ``<u_1, u_2>`` at the recorded layers."""
        self._need_pair()
        return self.gram_path[:, :, 0, 1].copy()

    def _need_pair(self) -> None:
        if self.config.n_tokens < 2:
            raise ValueError("rho needs at least two tokens (n_tokens >= 2)")

    def clusters(self) -> np.ndarray:
        """``(R,)`` number of clusters at time T: single linkage on ``|rho_ij| > threshold``, so a cluster and its
        antipode count once (clusters counted up to sign, as the spec asks)."""
        return count_clusters(self.gram, self.config.threshold)

    def summary(self) -> dict[str, float]:
        """Fractions of runs by final configuration.

        Two tokens: ``antipodal`` (rho < -thr), ``collapsed`` (rho > thr), ``other``. More tokens:
        ``antipodal`` = some pair has rho < -thr, ``collapsed`` = every pair has rho > thr, ``other`` = the
        rest; plus ``mean_clusters``. Always ``resampled`` (count) and ``runs``.
        """
        thr = self.config.threshold
        n = self.config.n_tokens
        R = self.gram.shape[0]
        if n == 1:
            return {"antipodal": 0.0, "collapsed": 1.0, "other": 0.0, "mean_clusters": 1.0,
                    "resampled": float(self.resampled), "runs": float(R)}
        if n == 2:
            rho = self.gram[:, 0, 1]
            anti = rho < -thr
            coll = rho > thr
        else:
            anti = has_antipodal_pair(self.gram, thr)
            iu = np.triu_indices(n, 1)
            coll = (self.gram[:, iu[0], iu[1]] > thr).all(axis=1)
        return {
            "antipodal": float(anti.mean()),
            "collapsed": float(coll.mean()),
            "other": float(1.0 - anti.mean() - coll.mean()),
            "mean_clusters": float(self.clusters().mean()),
            "resampled": float(self.resampled),
            "runs": float(R),
        }


# --------------------------------------------------------------------------------------------------
# The dynamics


def attention_average(u: np.ndarray, beta: float | np.ndarray) -> np.ndarray:
    """``A_i(u) = sum_j softmax_j(beta <u_i, u_j>) u_j`` for a batch ``u`` of shape ``(B, n, d)``.

    ``beta`` is a scalar or a ``(B,)`` array (one interaction strength per run). The row maximum is
    subtracted before the exponential, so ``beta = 1e3`` does not overflow. Returns ``(B, n, d)``.
    """
    u = np.asarray(u, dtype=np.float64)
    if u.ndim != 3:
        raise ValueError(f"u must have shape (batch, n_tokens, dim), got {u.shape}")
    b = np.asarray(beta, dtype=np.float64)
    if b.ndim == 1:
        b = b[:, None, None]
    S = b * (u @ u.transpose(0, 2, 1))
    S = S - S.max(axis=-1, keepdims=True)
    P = np.exp(S)
    P /= P.sum(axis=-1, keepdims=True)
    return P @ u


def _uniform_sphere(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape)
    nrm = np.linalg.norm(x, axis=-1, keepdims=True)
    # a Gaussian vector of norm < 1e-300 has probability zero; redraw to be exact
    while (nrm < 1e-300).any():  # pragma: no cover
        bad = (nrm < 1e-300)[..., 0]
        x[bad] = rng.standard_normal((int(bad.sum()), shape[-1]))
        nrm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / nrm


def _check_init(init: np.ndarray | torch.Tensor, runs: int, n: int, d: int) -> np.ndarray:
    if isinstance(init, torch.Tensor):
        init = init.detach().cpu().numpy()
    u0 = np.array(init, dtype=np.float64)
    if u0.ndim == 2:
        u0 = np.broadcast_to(u0, (runs, *u0.shape)).copy()
    if u0.shape != (runs, n, d):
        raise ValueError(f"init must have shape (n_tokens, dim)=({n}, {d}) or (runs, n_tokens, dim)=({runs}, {n}, {d}), "
                         f"got {tuple(np.shape(init))}")
    if not np.isfinite(u0).all():
        raise ValueError("init holds non-finite values (NaN or inf)")
    nrm = np.linalg.norm(u0, axis=-1, keepdims=True)
    if (nrm <= 1e-12).any():
        r, i = np.argwhere(nrm[..., 0] <= 1e-12)[0]
        raise ValueError(f"init token {i} of run {r} has zero norm; every token must be a nonzero vector "
                         "(it is projected to the unit sphere)")
    return u0 / nrm


DrawFn = Callable[[np.random.Generator, int, int], np.ndarray]


def _draw_standard(rng: np.random.Generator, batch: int, d: int) -> np.ndarray:
    """``(batch, d, d)`` standard normal entries (scaled by ``1/sqrt(d)`` by the caller)."""
    return rng.standard_normal((batch, d, d))


def _increment(u: np.ndarray, beta: np.ndarray, Z: np.ndarray | None, h: float, s: float, m: float,
               integrator: str) -> np.ndarray:
    """The state after one layer before normalisation (discrete) or after one EM step (sde)."""
    d = u.shape[-1]
    if integrator == "sde":
        # The SDE's coefficients are functions on the sphere; we evaluate them at u/|u| (spec formula for
        # |u| = 1). With this extension the Euler-Maruyama norm is mean-reverting to 1 instead of
        # carrying the cubic drift -c|A(u)|^2 u that makes plain EM blow up off the sphere.
        uh = u / np.linalg.norm(u, axis=-1, keepdims=True)
    else:
        uh = u
    A = attention_average(uh, beta)
    xi = np.zeros_like(u)
    if Z is not None and s > 0:
        # (V A_i) for every token with one V per run: A @ V^T; V = Z / sqrt(d)
        xi += (A @ Z.transpose(0, 2, 1)) * (s * math.sqrt(h / d))
    if m != 0.0:
        xi += (h * m) * A
    if integrator == "discrete":
        return u + xi
    # Euler-Maruyama of du = P_perp(u)(dW A + m A dt) - s^2 (d-1)/(2d) |A|^2 u dt, P_perp(u) = I - u u^T,
    # coefficients at uh = u/|u|
    radial = np.sum(uh * xi, axis=-1, keepdims=True)
    corr = (s * s * (d - 1) / (2 * d)) * np.sum(A * A, axis=-1, keepdims=True) * h
    return u + xi - radial * uh - corr * uh


def _simulate_core(u0: np.ndarray, beta: np.ndarray, h: float, K: int, s: float, m: float,
                   rng: np.random.Generator, integrator: str, record_every: int, keep_traj: bool,
                   draw: DrawFn | None = None) -> dict[str, Any]:
    """Run ``K`` layers on a batch ``u0 (B, n, d)`` with per-run ``beta (B,)``. See :func:`simulate`."""
    draw = draw or _draw_standard
    B, n, d = u0.shape
    rec_steps = sorted(set(range(0, K + 1, record_every)) | {K})
    rec_index = {k: i for i, k in enumerate(rec_steps)}
    gram_path = np.empty((B, len(rec_steps), n, n))
    traj = np.empty((B, len(rec_steps), n, d)) if keep_traj else None
    u = u0.copy()
    resampled = 0
    max_norm_err = 0.0

    def record(k: int, state: np.ndarray) -> None:
        i = rec_index[k]
        gram_path[:, i] = state @ state.transpose(0, 2, 1)
        if traj is not None:
            traj[:, i] = state

    record(0, u)
    noisy = s > 0
    for k in range(1, K + 1):
        Z = draw(rng, B, d) if noisy else None
        y = _increment(u, beta, Z, h, s, m, integrator)
        nrm = np.linalg.norm(y, axis=-1)
        bad = (nrm < DEGENERATE_FLOOR).any(axis=1)
        tries = 0
        while bad.any():
            if not noisy:
                r = int(np.argmax(bad))
                raise NumericalError(f"layer {k}: a token of run {r} was mapped to the origin by the deterministic "
                                     "update (drift too large for the step?); it cannot be normalised")
            tries += 1
            if tries > MAX_RESAMPLES:
                raise NumericalError(f"layer {k}: a token stayed at the origin after {MAX_RESAMPLES} redraws of V_k")
            idx = np.flatnonzero(bad)
            resampled += idx.size
            Zb = draw(rng, idx.size, d)
            y[idx] = _increment(u[idx], beta[idx], Zb, h, s, m, integrator)
            nrm[idx] = np.linalg.norm(y[idx], axis=-1)
            bad = np.zeros(B, dtype=bool)
            bad[idx] = (nrm[idx] < DEGENERATE_FLOOR).any(axis=1)
        if integrator == "discrete":
            u = y / nrm[..., None]
            err = float(np.abs(np.linalg.norm(u, axis=-1) - 1.0).max())
        else:
            u = y
            err = float(np.abs(nrm - 1.0).max())
        if not np.isfinite(u).all():
            raise NumericalError(f"layer {k}: the token state became non-finite (step {h}, integrator {integrator})")
        max_norm_err = max(max_norm_err, err)
        if k in rec_index:
            state = u if integrator == "discrete" else u / np.linalg.norm(u, axis=-1, keepdims=True)
            record(k, state)
    final = u / np.linalg.norm(u, axis=-1, keepdims=True)
    return {"final": final, "gram": final @ final.transpose(0, 2, 1), "gram_path": gram_path, "traj": traj,
            "times": np.array(rec_steps, dtype=np.float64) * h, "resampled": resampled,
            "max_norm_error": max_norm_err}


def simulate(config: TokenDynamicsConfig | None = None, *, init: np.ndarray | torch.Tensor | None = None,
             **overrides: Any) -> TokenDynamicsResult:
    """Monte-Carlo simulation of the deep stochastic Transformer (or its SDE limit).

    Args:
        config: a :class:`TokenDynamicsConfig`; keyword ``overrides`` replace its fields
            (``simulate(dim=4, beta=8.0)`` uses the defaults otherwise).
        init: optional initial tokens, ``(n, d)`` (the same for every run) or ``(R, n, d)``; each
            token is projected to the unit sphere. Default: i.i.d. uniform on ``S^{d-1}``.

    Returns a :class:`TokenDynamicsResult`. Cost ``O(R K (d^2 n + n^2 d))``. Runs are independent
    and reproducible from ``config.seed``; a degenerate update (a token mapped to the origin) is
    redrawn and counted in ``resampled``.
    """
    cfg = config if config is not None else TokenDynamicsConfig()
    if not isinstance(cfg, TokenDynamicsConfig):
        raise TypeError(f"config must be a TokenDynamicsConfig, got {type(cfg).__name__}")
    if overrides:
        cfg = TokenDynamicsConfig(**{**asdict(cfg), **overrides})
    t0 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    R, n, d = cfg.runs, cfg.n_tokens, cfg.dim
    u0 = _uniform_sphere(rng, (R, n, d)) if init is None else _check_init(init, R, n, d)
    out = _simulate_core(u0, np.full(R, float(cfg.beta)), cfg.effective_step, cfg.n_layers, cfg.effective_noise,
                         cfg.effective_drift, rng, cfg.integrator, cfg.record_every, cfg.keep_traj)
    return TokenDynamicsResult(config=cfg, final=out["final"], gram=out["gram"], times=out["times"],
                               gram_path=out["gram_path"], traj=out["traj"], n_layers=cfg.n_layers,
                               step=cfg.effective_step, resampled=out["resampled"],
                               max_norm_error=out["max_norm_error"], wall_time_s=time.perf_counter() - t0)


def coupled_refinement(config: TokenDynamicsConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Summaries of the discrete model at step ``h`` and at ``h / 2``, driven by the SAME Brownian path.

    The fine model draws two value matrices ``Z_1, Z_2`` per coarse layer; the coarse model uses
    ``(Z_1 + Z_2) / sqrt(2)``, so both discretise one realisation of ``W_t`` (strong coupling). The
    difference of the two summaries then measures the discretisation error, not Monte-Carlo noise
    (spec correctness check "halving h changes the antipodal fraction by <= 0.05").
    Returns ``(summary at h, summary at h/2)``.
    """
    cfg = config
    if cfg.integrator != "discrete":
        raise ValueError("coupled_refinement compares discrete networks; use integrator='discrete'")
    rng = np.random.default_rng(cfg.seed)
    R, n, d = cfg.runs, cfg.n_tokens, cfg.dim
    K, h = cfg.n_layers, cfg.effective_step
    s, m = cfg.effective_noise, cfg.effective_drift
    beta = np.full(R, float(cfg.beta))
    uc = _uniform_sphere(rng, (R, n, d))
    uf = uc.copy()
    for _ in range(K):
        Z1 = rng.standard_normal((R, d, d)) if s > 0 else None
        Z2 = rng.standard_normal((R, d, d)) if s > 0 else None
        Zc = (Z1 + Z2) / math.sqrt(2.0) if s > 0 else None
        for Z in (Z1, Z2):
            y = _increment(uf, beta, Z, h / 2, s, m, "discrete")
            uf = y / np.linalg.norm(y, axis=-1, keepdims=True)
        y = _increment(uc, beta, Zc, h, s, m, "discrete")
        uc = y / np.linalg.norm(y, axis=-1, keepdims=True)
    if not (np.isfinite(uc).all() and np.isfinite(uf).all()):
        raise NumericalError("coupled_refinement: non-finite token state")
    out = []
    for u in (uc, uf):
        res = TokenDynamicsResult(config=cfg, final=u, gram=u @ u.transpose(0, 2, 1), times=np.array([cfg.horizon]),
                                  gram_path=(u @ u.transpose(0, 2, 1))[:, None], traj=None, n_layers=K, step=h)
        out.append(res.summary())
    return out[0], out[1]


# --------------------------------------------------------------------------------------------------
# Phase diagram


@dataclass
class PhaseDiagram:
    """Fractions of final configurations over a ``(dim, beta)`` grid.

    Arrays have shape ``(len(dims), len(betas))``. ``lyapunov`` is the theoretical exponent of the
    antipodal point (:func:`lyapunov_exponents`; negative = attracting with positive probability),
    exact for two tokens.
    """

    dims: list[int]
    betas: list[float]
    antipodal: np.ndarray
    collapsed: np.ndarray
    other: np.ndarray
    mean_clusters: np.ndarray
    lyapunov: np.ndarray
    settings: dict[str, Any] = field(default_factory=dict)
    wall_time_s: float = 0.0

    def get(self, dim: int, beta: float, what: str = "antipodal") -> float:
        """One cell, e.g. ``grid.get(8, 2.0)``."""
        i = self.dims.index(dim)
        j = [k for k, b in enumerate(self.betas) if math.isclose(b, beta)]
        if not j:
            raise KeyError(f"beta={beta} not in the grid {self.betas}")
        return float(getattr(self, what)[i, j[0]])

    def to_dict(self) -> dict[str, list[float]]:
        """Column dict (DataFrame-ready): one row per cell."""
        cols: dict[str, list[float]] = {k: [] for k in ("dim", "beta", "antipodal", "collapsed", "other",
                                                         "mean_clusters", "lyapunov")}
        for i, d in enumerate(self.dims):
            for j, b in enumerate(self.betas):
                cols["dim"].append(d)
                cols["beta"].append(b)
                for k in ("antipodal", "collapsed", "other", "mean_clusters", "lyapunov"):
                    cols[k].append(float(getattr(self, k)[i, j]))
        return cols

    def to_csv(self, path: str | Path) -> Path:
        """Write the column dict as CSV, atomically (a failed write leaves no partial file)."""
        cols = self.to_dict()
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(list(cols))
        for row in zip(*cols.values()):
            w.writerow(row)
        return _atomic_write_bytes(Path(path), buf.getvalue().encode())

    def to_safetensors(self, path: str | Path) -> Path:
        """Write the grids as safetensors (float64 arrays) with the settings as JSON metadata, atomically."""
        import json

        from safetensors.numpy import save

        tensors = {k: np.ascontiguousarray(getattr(self, k), dtype=np.float64)
                   for k in ("antipodal", "collapsed", "other", "mean_clusters", "lyapunov")}
        tensors["dims"] = np.asarray(self.dims, dtype=np.float64)
        tensors["betas"] = np.asarray(self.betas, dtype=np.float64)
        meta = {"settings": json.dumps(self.settings)}
        return _atomic_write_bytes(Path(path), save(tensors, metadata=meta))


def _atomic_write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def phase_diagram(dims: Sequence[int], betas: Sequence[float], *, n_tokens: int = 2, runs: int = 200,
                  horizon: float = 20.0, step: float = 0.01, noise_scale: float = 1.0, drift: float | None = None,
                  noise: bool = True, integrator: str = "discrete", threshold: float = 0.99,
                  seed: int = 0) -> PhaseDiagram:
    """Final-configuration fractions over a ``(dim, beta)`` grid.

    For each ``d`` all betas run in one vectorised batch of ``len(betas) * runs`` runs with a
    generator seeded by ``(seed, d)``, so a cell's numbers do not depend on the other dimensions of
    the grid. Settings are validated through :class:`TokenDynamicsConfig`.
    """
    dims = [int(d) for d in dims]
    betas = [float(b) for b in betas]
    if not dims or not betas:
        raise ValueError("phase_diagram needs at least one dim and one beta")
    t0 = time.perf_counter()
    shape = (len(dims), len(betas))
    anti, coll, oth, ncl, lyap = (np.zeros(shape) for _ in range(5))
    for i, d in enumerate(dims):
        cfgs = [TokenDynamicsConfig(n_tokens=n_tokens, dim=d, beta=b, horizon=horizon, step=step, runs=runs,
                                    noise=noise, noise_scale=noise_scale, drift=drift, integrator=integrator,
                                    threshold=threshold, seed=seed, record_every=10**9) for b in betas]
        c0 = cfgs[0]
        rng = np.random.default_rng([seed, d])
        B = runs * len(betas)
        beta_vec = np.repeat(np.asarray(betas), runs)
        out = _simulate_core(_uniform_sphere(rng, (B, n_tokens, d)), beta_vec, c0.effective_step, c0.n_layers,
                             c0.effective_noise, c0.effective_drift, rng, integrator, 10**9, False)
        for j, cfg in enumerate(cfgs):
            sl = slice(j * runs, (j + 1) * runs)
            res = TokenDynamicsResult(config=cfg, final=out["final"][sl], gram=out["gram"][sl], times=out["times"],
                                      gram_path=out["gram_path"][sl], traj=None, n_layers=cfg.n_layers,
                                      step=cfg.effective_step)
            sm = res.summary()
            anti[i, j], coll[i, j], oth[i, j], ncl[i, j] = (sm["antipodal"], sm["collapsed"], sm["other"],
                                                            sm["mean_clusters"])
            lyap[i, j] = lyapunov_exponents(cfg.beta, d, noise_scale=cfg.effective_noise,
                                            drift=cfg.effective_drift)[0]
    settings = {"n_tokens": n_tokens, "runs": runs, "horizon": horizon, "step": step, "noise_scale": noise_scale,
                "drift": drift, "noise": noise, "integrator": integrator, "threshold": threshold, "seed": seed}
    return PhaseDiagram(dims=dims, betas=betas, antipodal=anti, collapsed=coll, other=oth, mean_clusters=ncl,
                        lyapunov=lyap, settings=settings, wall_time_s=time.perf_counter() - t0)


def two_token_phase_diagram(dims: Sequence[int], betas: Sequence[float], *, runs: int = 200, **kwargs: Any
                            ) -> PhaseDiagram:
    """:func:`phase_diagram` for two tokens: fractions of antipodal / collapsed pairs over ``(d, beta)``."""
    if "n_tokens" in kwargs:
        raise TypeError("two_token_phase_diagram fixes n_tokens=2; use phase_diagram for more tokens")
    return phase_diagram(dims, betas, n_tokens=2, runs=runs, **kwargs)


# --------------------------------------------------------------------------------------------------
# Two-token theory


def two_token_drift_diffusion(rho: float | np.ndarray, beta: float, d: int, *, noise_scale: float = 1.0,
                              drift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Drift ``b(rho)`` and quadratic-variation rate ``sigma^2(rho)`` of ``rho = <u_1, u_2>`` (Ito).

    From the limiting SDE (spec "Two-token reduction")::

        b(rho) = s^2 [ -c (|A_1|^2 + |A_2|^2) rho + (A_1.A_2)(d - 2 + rho^2)/d ] + 2 m (1-p)(1 - rho^2)
        sigma^2(rho) = s^2 (1 - rho^2)(|A_1|^2 + |A_2|^2 - 2 rho A_1.A_2) / d

    with ``c = (d-1)/(2d)``, ``A_1 = p u_1 + (1-p) u_2``, ``p = 1/(1 + exp(beta (rho - 1)))``,
    ``|A_i|^2 = p^2 + (1-p)^2 + 2p(1-p) rho``, ``A_1.A_2 = (p^2 + (1-p)^2) rho + 2 p (1-p)``; ``s``
    the noise scale and ``m`` the mean value coefficient (``Vbar = m I``, the deterministic part).
    The cross term ``(A_1.A_2)(d-2+rho^2)/d`` is the Ito covariation of the COMMON noise:
    ``tr(P_perp(u_1) P_perp(u_2)) = d - 2 + rho^2``.
    """
    check_int("d", d, 2)
    beta = check_number("beta", beta)
    r = np.asarray(rho, dtype=np.float64)
    if not np.isfinite(r).all() or (np.abs(r) > 1 + 1e-12).any():
        raise ValueError("rho must be finite and in [-1, 1]")
    p = 1.0 / (1.0 + np.exp(np.clip(beta * (r - 1.0), -700, 700)))
    q = 1.0 - p
    a_sq = p * p + q * q + 2 * p * q * r
    a12 = (p * p + q * q) * r + 2 * p * q
    c = (d - 1) / (2 * d)
    s2 = float(noise_scale) ** 2
    b = s2 * (-c * 2 * a_sq * r + a12 * (d - 2 + r * r) / d) + 2.0 * float(drift) * q * (1 - r * r)
    sig2 = s2 * (1 - r * r) * (2 * a_sq - 2 * r * a12) / d
    return b, np.maximum(sig2, 0.0)


def lyapunov_exponents(beta: float, d: int, *, noise_scale: float = 1.0, drift: float = 0.0,
                       method: Literal["numeric", "closed"] = "numeric") -> tuple[float, float]:
    """Lyapunov exponents ``(lambda_-, lambda_+)`` of the antipodal (rho = -1) and collapsed (rho = +1) ends.

    Linearising at ``rho = -1`` in ``x = 1 + rho``: ``dx ~ b'(-1) x dt + sigma'(-1) x dW`` so
    ``x -> 0`` with positive probability iff ``lambda_- = b'(-1) - sigma'(-1)^2 / 2 < 0`` (spec). Same at
    ``+1`` in ``1 - rho``. ``method="numeric"`` differentiates :func:`two_token_drift_diffusion` (one-sided
    differences with Richardson extrapolation, error ~1e-9); ``"closed"`` uses the formulas we derived
    from it (see ``docs/methods/token_dynamics.md``)::

        lambda_- = s^2 (4 P (d-1) - 2)/d + 4 m q,   P = p q = 1/(4 cosh^2 beta),  q = 1/(1 + e^{2 beta})
        lambda_+ = -s^2 (d-1)/d - 2 m

    so with centred values (m = 0) the antipodal pair is attracting iff ``cosh^2(beta) > (d-1)/2``.
    """
    beta = check_number("beta", beta)
    check_int("d", d, 2)
    s2 = float(noise_scale) ** 2
    m = float(drift)
    if method == "closed":
        P = 1.0 / (4.0 * math.cosh(min(abs(beta), 350.0)) ** 2)
        q = 1.0 / (1.0 + math.exp(min(2.0 * beta, 700.0)))
        return s2 * (4 * P * (d - 1) - 2) / d + 4 * m * q, -s2 * (d - 1) / d - 2 * m
    if method != "numeric":
        raise ValueError(f"method must be 'numeric' or 'closed', got {method!r}")

    def ends(sign: float) -> float:
        def f(x: float) -> tuple[float, float]:
            b, s = two_token_drift_diffusion(sign * (1.0 - x), beta, d, noise_scale=noise_scale, drift=drift)
            # in the variable x = 1 -/+ rho: dx = -/+ b dt; growth rate b'/x and sigma'^2 = sigma^2 / x^2
            return float(-sign * b) / x, float(s) / (x * x)

        x = 1e-4
        b1, s1 = f(x)
        b2, s2_ = f(x / 2)
        b3, s3 = f(x / 4)
        # second-order Richardson on the O(x) bias of the difference quotients
        bd = (8 * b3 - 6 * b2 + b1) / 3
        sd = (8 * s3 - 6 * s2_ + s1) / 3
        return bd - 0.5 * sd

    return ends(-1.0), ends(1.0)


def antipodal_boundary_beta(d: int) -> float:
    """The critical ``beta_c(d)`` above which the antipodal pair is attracting (centred values, any s > 0).

    ``beta_c = arccosh(sqrt((d-1)/2))`` for ``d > 3``; 0 for ``d <= 3`` (``d = 3`` is marginal at
    ``beta = 0``, ``d = 2`` attracting for every beta). From ``lambda_- < 0`` of :func:`lyapunov_exponents`.
    """
    check_int("d", d, 2)
    v = math.sqrt((d - 1) / 2)
    return math.acosh(v) if v > 1 else 0.0


# --------------------------------------------------------------------------------------------------
# Clusters


def count_clusters(gram: np.ndarray, threshold: float = 0.99) -> np.ndarray:
    """``(R,)`` clusters per run from Gram matrices ``(R, n, n)``: connected components of the graph
    ``|rho_ij| > threshold`` (single linkage), so antipodal groups count as one cluster (up to sign)."""
    g = np.asarray(gram, dtype=np.float64)
    if g.ndim == 2:
        g = g[None]
    if g.ndim != 3 or g.shape[1] != g.shape[2]:
        raise ValueError(f"gram must have shape (runs, n, n), got {np.shape(gram)}")
    n = g.shape[1]
    reach = (np.abs(g) > threshold) | np.eye(n, dtype=bool)[None]
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        reach = reach | ((reach.astype(np.int32) @ reach.astype(np.int32)) > 0)
    return (1.0 / reach.sum(axis=-1)).sum(axis=-1).round().astype(np.int64)


def has_antipodal_pair(gram: np.ndarray, threshold: float = 0.99) -> np.ndarray:
    """``(R,)`` bool: some pair of tokens has ``rho_ij < -threshold``."""
    g = np.asarray(gram, dtype=np.float64)
    if g.ndim == 2:
        g = g[None]
    n = g.shape[1]
    iu = np.triu_indices(n, 1)
    return (g[:, iu[0], iu[1]] < -threshold).any(axis=1)


register("token_dynamics", config=TokenDynamicsConfig, entry=simulate)
