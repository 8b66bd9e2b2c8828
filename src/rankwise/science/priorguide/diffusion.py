"""Score models that PriorGuide can steer: our own conditional VE score network, and sbi's.

A *score model* (protocol :class:`ScoreModel`) is anything with ``theta_dim``, ``x_dim``,
``sigma_min``, ``sigma_max``, ``init_mean`` [D], ``init_std`` [D] (the distribution the reverse
process starts from) and ``score(theta_t [N, D], sigma [N], x [N, M]) -> [N, D]``, the learned
``grad log p_train,sigma(theta_t | x)`` of the variance-exploding (VE) forward process
``theta_t = theta_0 + sigma * eps`` (spec §2). Guidance and samplers only use this protocol.

* :class:`ScoreDiffusion`: an MLP (4 x 128, SiLU, sinusoidal embedding of ``log sigma``) trained by
  denoising score matching with ``log sigma ~ U[log sigma_min, log sigma_max]`` (spec's small-scale
  recipe); it predicts the noise, ``s = -eps_hat / sigma``; inputs are scaled by
  ``1 / sqrt(s_theta^2 + sigma^2)`` and ``x`` is z-scored. Saved/loaded as safetensors.
* :class:`SbiScoreAdapter`: sbi's ``VEScoreEstimator`` (what ``NPSE(sde_type="ve")`` trains) seen
  through the protocol (``sigma -> t`` inverts sbi's geometric ``std_fn``; checked at construction).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from rankwise.core import io
from rankwise.core.errors import ArtifactError
from rankwise.core.validate import check_int, check_number

__all__ = ["FitResult", "SbiScoreAdapter", "ScoreDiffusion", "ScoreModel", "ScoreNet", "VPScoreAdapter", "sigma_grid"]


@runtime_checkable
class ScoreModel(Protocol):
    theta_dim: int
    x_dim: int
    sigma_min: float
    sigma_max: float
    init_mean: Tensor
    init_std: Tensor

    def score(self, theta_t: Tensor, sigma: Tensor, x: Tensor) -> Tensor: ...


def sigma_grid(sigma_max: float, sigma_min: float, steps: int) -> Tensor:
    """``steps + 1`` noise levels, geometric from ``sigma_max`` down to ``sigma_min`` (float64)."""
    check_int("steps", steps, lo=1)
    check_number("sigma_min", sigma_min, lo=0.0, low_open=True)
    if not sigma_max > sigma_min:
        raise ValueError(f"sigma_max must be > sigma_min, got {sigma_max} and {sigma_min}")
    return torch.exp(torch.linspace(math.log(sigma_max), math.log(sigma_min), steps + 1, dtype=torch.float64))


class ScoreNet(nn.Module):
    """``eps_hat(theta_t_scaled, log sigma, x_scaled)``: an MLP with a sinusoidal noise embedding."""

    def __init__(self, theta_dim: int, x_dim: int, hidden: int = 128, layers: int = 4, emb: int = 16) -> None:
        super().__init__()
        self.emb = emb
        dims = [theta_dim + x_dim + emb] + [hidden] * layers
        mods: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            mods += [nn.Linear(a, b), nn.SiLU()]
        mods.append(nn.Linear(hidden, theta_dim))
        self.mlp = nn.Sequential(*mods)
        freqs = torch.exp(torch.linspace(0.0, math.log(100.0), emb // 2))
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, theta: Tensor, log_sigma: Tensor, x: Tensor) -> Tensor:
        a = log_sigma[:, None] * self.freqs[None] / 4.0
        return self.mlp(torch.cat([theta, x, torch.sin(a), torch.cos(a)], dim=-1))


@dataclass
class FitResult:
    """What :meth:`ScoreDiffusion.fit` did: ``losses`` (one mean per 100 steps), ``final_loss``, ``time_s``."""

    losses: list[float]
    final_loss: float
    steps: int
    time_s: float


def _check_pairs(theta: Tensor, x: Tensor, theta_dim: int, x_dim: int) -> tuple[Tensor, Tensor]:
    theta = torch.as_tensor(theta, dtype=torch.float32)
    x = torch.as_tensor(x, dtype=torch.float32)
    if theta.ndim != 2 or theta.shape[1] != theta_dim:
        raise ValueError(f"theta must be [N, {theta_dim}], got {tuple(theta.shape)}")
    if x.ndim != 2 or x.shape[1] != x_dim or x.shape[0] != theta.shape[0]:
        raise ValueError(f"x must be [N={theta.shape[0]}, {x_dim}], got {tuple(x.shape)}")
    if not torch.isfinite(theta).all() or not torch.isfinite(x).all():
        raise ValueError("theta and x must be finite (found NaN or inf)")
    return theta, x


class ScoreDiffusion:
    """A conditional VE score model ``s_phi(theta_t, sigma, x)`` trained by denoising score matching.

    ``theta_dim``/``x_dim``: sizes of a parameter and an observation; ``sigma_min``/``sigma_max``: the
    noise range (spec: 0.01 to 5). ``fit(theta [N, D], x [N, M], steps, seed)`` trains it (returns self,
    :attr:`fit_result` holds the losses); ``score`` evaluates it; ``save``/``load`` use safetensors.
    """

    def __init__(self, theta_dim: int, x_dim: int, *, sigma_min: float = 0.01, sigma_max: float = 5.0,
                 hidden: int = 128, layers: int = 4) -> None:
        self.theta_dim = check_int("ScoreDiffusion.theta_dim", theta_dim, lo=1)
        self.x_dim = check_int("ScoreDiffusion.x_dim", x_dim, lo=1)
        self.sigma_min = float(check_number("ScoreDiffusion.sigma_min", sigma_min, lo=0.0, low_open=True))
        self.sigma_max = float(check_number("ScoreDiffusion.sigma_max", sigma_max, lo=0.0, low_open=True))
        if self.sigma_max <= self.sigma_min:
            raise ValueError(f"ScoreDiffusion.sigma_max must be > sigma_min={sigma_min}, got {sigma_max}")
        self.hidden = check_int("ScoreDiffusion.hidden", hidden, lo=1)
        self.layers = check_int("ScoreDiffusion.layers", layers, lo=1)
        self.net = ScoreNet(self.theta_dim, self.x_dim, self.hidden, self.layers)
        self.theta_mean = torch.zeros(self.theta_dim)
        self.theta_std = torch.ones(self.theta_dim)
        self.x_mean = torch.zeros(self.x_dim)
        self.x_std = torch.ones(self.x_dim)
        self.fit_result: FitResult | None = None

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def init_mean(self) -> Tensor:
        return self.theta_mean.double()

    @property
    def init_std(self) -> Tensor:
        return torch.sqrt(self.theta_std.double() ** 2 + self.sigma_max**2)

    def _eps(self, theta_t: Tensor, sigma: Tensor, x: Tensor) -> Tensor:
        c_in = 1.0 / torch.sqrt(self.theta_std[None] ** 2 + sigma[:, None] ** 2)
        xs = (x - self.x_mean) / self.x_std
        return self.net((theta_t - self.theta_mean) * c_in, torch.log(sigma), xs)

    def score(self, theta_t: Tensor, sigma: Tensor, x: Tensor) -> Tensor:
        """``s_phi`` [N, D] at ``theta_t`` [N, D], noise levels ``sigma`` [N] (or scalar), ``x`` [N, M] or [M]."""
        dtype = theta_t.dtype
        th = theta_t.to(torch.float32)
        sig = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(th.shape[0])
        xx = torch.as_tensor(x, dtype=torch.float32)
        if xx.ndim == 1:
            xx = xx[None].expand(th.shape[0], -1)
        return (-self._eps(th, sig, xx) / sig[:, None]).to(dtype)

    # -- training -------------------------------------------------------------------------------
    def fit(self, theta: Tensor, x: Tensor, *, steps: int = 3000, batch_size: int = 256, lr: float = 1e-3,
            seed: int = 0) -> "ScoreDiffusion":
        """Denoising score matching: ``E || eps_hat(theta + sigma eps, sigma, x) - eps ||^2`` with Adam and a
        cosine decay; ``theta``/``x`` are simulated pairs ``[N, D]``/``[N, M]``. Deterministic given ``seed``."""
        theta, x = _check_pairs(theta, x, self.theta_dim, self.x_dim)
        check_int("ScoreDiffusion.fit.steps", steps, lo=1)
        check_int("ScoreDiffusion.fit.batch_size", batch_size, lo=1)
        check_number("ScoreDiffusion.fit.lr", lr, lo=0.0, low_open=True)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.net = ScoreNet(self.theta_dim, self.x_dim, self.hidden, self.layers)
        self.theta_mean, self.theta_std = theta.mean(0), theta.std(0).clamp_min(1e-6)
        self.x_mean, self.x_std = x.mean(0), x.std(0).clamp_min(1e-6)
        opt = torch.optim.Adam(self.net.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.05)
        lo, hi = math.log(self.sigma_min), math.log(self.sigma_max)
        t0, losses, acc = time.perf_counter(), [], 0.0
        n = theta.shape[0]
        self.net.train()
        for i in range(steps):
            idx = torch.randint(0, n, (batch_size,), generator=gen)
            sig = torch.exp(lo + (hi - lo) * torch.rand(batch_size, generator=gen))
            eps = torch.randn(batch_size, self.theta_dim, generator=gen)
            loss = (self._eps(theta[idx] + sig[:, None] * eps, sig, x[idx]) - eps).pow(2).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += float(loss.detach())
            if (i + 1) % 100 == 0 or i + 1 == steps:
                losses.append(acc / ((i % 100) + 1))
                acc = 0.0
        self.net.eval()
        for p in self.net.parameters():
            p.requires_grad_(False)
        if not math.isfinite(losses[-1]):
            raise FloatingPointError("ScoreDiffusion.fit diverged (non-finite loss); lower lr")
        self.fit_result = FitResult(losses, losses[-1], steps, time.perf_counter() - t0)
        return self

    # -- persistence ----------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {"theta_dim": self.theta_dim, "x_dim": self.x_dim, "sigma_min": self.sigma_min,
                "sigma_max": self.sigma_max, "hidden": self.hidden, "layers": self.layers}

    def save(self, path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Write weights and normalisation to one safetensors file (atomic)."""
        tensors = {f"net.{k}": v for k, v in self.net.state_dict().items()}
        tensors.update({"theta_mean": self.theta_mean, "theta_std": self.theta_std,
                        "x_mean": self.x_mean, "x_std": self.x_std})
        meta = {"config": self.config(), "kind": "rankwise.priorguide.ScoreDiffusion", **(metadata or {})}
        return io.save_tensors(path, tensors, metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "ScoreDiffusion":
        tensors, meta = io.load_tensors(path)
        if meta.get("kind") != "rankwise.priorguide.ScoreDiffusion" or "config" not in meta:
            raise ArtifactError(f"{path} is not a saved ScoreDiffusion (kind={meta.get('kind')!r})")
        m = cls(**meta["config"])
        state = {k[4:]: v for k, v in tensors.items() if k.startswith("net.")}
        try:
            m.net.load_state_dict(state)
        except RuntimeError as e:
            raise ArtifactError(f"{path}: weights do not match the saved config ({e})") from None
        m.theta_mean, m.theta_std = tensors["theta_mean"], tensors["theta_std"]
        m.x_mean, m.x_std = tensors["x_mean"], tensors["x_std"]
        m.net.eval()
        for p in m.net.parameters():
            p.requires_grad_(False)
        return m


class SbiScoreAdapter:
    """sbi's ``VEScoreEstimator`` (``NPSE(sde_type="ve")``) seen through :class:`ScoreModel`.

    sbi parameterises noise by time ``t`` in ``[t_min, t_max]`` with ``std_fn(t) = s_min (s_max/s_min)^t``;
    the adapter maps ``sigma -> t = log(sigma/s_min) / log(s_max/s_min)`` and checks the inversion
    against ``std_fn`` at construction (a ``ValueError`` for VP/sub-VP estimators, whose mean is not 1:
    use :meth:`VPScoreAdapter.from_sbi` for those).
    """

    def __init__(self, estimator: Any) -> None:
        for attr in ("std_fn", "mean_t_fn", "t_min", "t_max", "input_shape", "condition_shape"):
            if not hasattr(estimator, attr):
                raise TypeError(f"SbiScoreAdapter needs an sbi score estimator; {type(estimator).__name__} "
                                f"has no {attr!r}")
        self.estimator = estimator.eval()
        self.theta_dim = int(math.prod(estimator.input_shape))
        self.x_dim = int(math.prod(estimator.condition_shape))
        t = torch.tensor([estimator.t_min, 0.5, estimator.t_max])
        with torch.no_grad():
            std = estimator.std_fn(t).reshape(-1).double()
            mean = estimator.mean_t_fn(t).reshape(-1).double()
        if not torch.allclose(mean, torch.ones_like(mean)):
            raise ValueError(f"SbiScoreAdapter supports VE estimators only ({type(estimator).__name__} has "
                             f"mean_t != 1); use VPScoreAdapter.from_sbi")
        self._s0 = float(getattr(estimator, "sigma_min"))
        self._s1 = float(getattr(estimator, "sigma_max"))
        want = self._s0 * (self._s1 / self._s0) ** t.double()
        if not torch.allclose(std, want, rtol=1e-4):
            raise ValueError("SbiScoreAdapter: the estimator's std_fn is not geometric; cannot map sigma to t")
        self.sigma_min, self.sigma_max = float(std[0]), float(std[2])
        self.init_mean = torch.as_tensor(estimator.mean_base, dtype=torch.float64).reshape(-1).expand(self.theta_dim)
        self.init_std = torch.as_tensor(estimator.std_base, dtype=torch.float64).reshape(-1).expand(self.theta_dim)

    def time_of(self, sigma: Tensor) -> Tensor:
        return torch.log(sigma / self._s0) / math.log(self._s1 / self._s0)

    def score(self, theta_t: Tensor, sigma: Tensor, x: Tensor) -> Tensor:
        dtype = theta_t.dtype
        th = theta_t.to(torch.float32)
        sig = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1).expand(th.shape[0])
        xx = torch.as_tensor(x, dtype=torch.float32)
        if xx.ndim == 1:
            xx = xx[None].expand(th.shape[0], -1)
        t = self.time_of(sig).to(torch.float32)
        return self.estimator(input=th, condition=xx, time=t).to(dtype)


class VPScoreAdapter:
    """A variance-preserving (VP, or sub-VP) score model seen through the VE :class:`ScoreModel` protocol
    (spec §6, the VP variant).

    The VP forward process ``theta_t = m(t) theta_0 + s(t) eps`` (``m = sqrt(alpha_bar_t)``) is the VE process
    ``y = theta_t / m = theta_0 + sigma eps`` with ``sigma(t) = s(t) / m(t)``, and the scores are related by
    ``score_VE(y, sigma) = m score_VP(m y, t)``. Through this map the VE Tweedie mean is the spec's VP one,
    ``mu = y + sigma^2 score_VE = (theta_t + s^2 score_VP) / m``, and the guidance in ``theta_t`` coordinates
    is ``g_VE / m``: the extra ``1 / sqrt(alpha_bar_t)`` factor of the spec's chain rule. Guidance, the
    Jacobian variant and the sampler therefore run unchanged, in ``y``.

    ``score_fn(theta_t [N, D], t [N], x [N, M]) -> [N, D]`` is the VP score; ``mean_fn(t)``/``std_fn(t)`` are
    ``m`` and ``s`` (tensors of any shape broadcastable from ``t`` [N]); ``sigma = s / m`` must increase with
    ``t`` on ``[t_min, t_max]`` (checked); ``t(sigma)`` is found by bisection (float64, 60 halvings).
    ``data_mean``/``data_std``: moments of ``theta_0`` (the sampler starts from ``N(mean, std^2 + sigma_max^2)``).
    """

    def __init__(self, score_fn: Any, mean_fn: Any, std_fn: Any, *, t_min: float, t_max: float, theta_dim: int,
                 x_dim: int, data_mean: Any = 0.0, data_std: Any = 1.0) -> None:
        self.theta_dim = check_int("VPScoreAdapter.theta_dim", theta_dim, lo=1)
        self.x_dim = check_int("VPScoreAdapter.x_dim", x_dim, lo=1)
        check_number("VPScoreAdapter.t_min", t_min)
        check_number("VPScoreAdapter.t_max", t_max)
        if not t_max > t_min:
            raise ValueError(f"VPScoreAdapter.t_max must be > t_min={t_min}, got {t_max}")
        self.score_fn, self.mean_fn, self.std_fn = score_fn, mean_fn, std_fn
        self.t_min, self.t_max = float(t_min), float(t_max)
        tt = torch.linspace(self.t_min, self.t_max, 257, dtype=torch.float64)
        sig = self.sigma_of(tt)
        if not torch.isfinite(sig).all() or (sig <= 0).any() or not (sig[1:] > sig[:-1]).all():
            raise ValueError("VPScoreAdapter: std_fn(t) / mean_fn(t) must be positive and increasing on [t_min, t_max]")
        self.sigma_min, self.sigma_max = float(sig[0]), float(sig[-1])
        self.init_mean = torch.as_tensor(data_mean, dtype=torch.float64).reshape(-1).expand(self.theta_dim).clone()
        std0 = torch.as_tensor(data_std, dtype=torch.float64).reshape(-1).expand(self.theta_dim)
        self.init_std = torch.sqrt(std0**2 + self.sigma_max**2)

    @classmethod
    def from_sbi(cls, estimator: Any) -> "VPScoreAdapter":
        """sbi's ``VPScoreEstimator`` / ``SubVPScoreEstimator`` (``NPSE(sde_type="vp")``) as a score model."""
        for attr in ("std_fn", "mean_t_fn", "t_min", "t_max", "input_shape", "condition_shape", "mean_0", "std_0"):
            if not hasattr(estimator, attr):
                raise TypeError(f"VPScoreAdapter.from_sbi needs an sbi score estimator; {type(estimator).__name__} "
                                f"has no {attr!r}")
        est = estimator.eval()
        d = int(math.prod(est.input_shape))

        def score_fn(theta_t: Tensor, t: Tensor, x: Tensor) -> Tensor:
            return est(input=theta_t.to(torch.float32), condition=x.to(torch.float32),
                       time=t.to(torch.float32)).to(theta_t.dtype)

        def mean_fn(t: Tensor) -> Tensor:
            return est.mean_t_fn(t).reshape(-1).to(t.dtype)

        def std_fn(t: Tensor) -> Tensor:
            return est.std_fn(t).reshape(-1).to(t.dtype)

        out = cls(score_fn, mean_fn, std_fn, t_min=float(est.t_min), t_max=float(est.t_max), theta_dim=d,
                  x_dim=int(math.prod(est.condition_shape)), data_mean=est.mean_0.detach().double(),
                  data_std=est.std_0.detach().double())
        out.estimator = est
        return out

    def sigma_of(self, t: Tensor) -> Tensor:
        t = torch.as_tensor(t, dtype=torch.float64)
        with torch.no_grad():
            return (torch.as_tensor(self.std_fn(t), dtype=torch.float64).reshape(t.shape)
                    / torch.as_tensor(self.mean_fn(t), dtype=torch.float64).reshape(t.shape))

    def time_of(self, sigma: Tensor) -> Tensor:
        """``t`` with ``sigma(t) = sigma`` (bisection; ``sigma`` clamped to ``[sigma_min, sigma_max]``)."""
        sig = torch.as_tensor(sigma, dtype=torch.float64).clamp(self.sigma_min, self.sigma_max)
        lo = torch.full_like(sig, self.t_min)
        hi = torch.full_like(sig, self.t_max)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            below = self.sigma_of(mid) < sig
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        return 0.5 * (lo + hi)

    def score(self, theta_t: Tensor, sigma: Tensor, x: Tensor) -> Tensor:
        """The VE score at ``y = theta_t`` (VE coordinates) and noise ``sigma`` [N] or scalar."""
        n = theta_t.shape[0]
        sig = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1).expand(n)
        uniq = torch.unique(sig)
        t = self.time_of(uniq)[torch.searchsorted(uniq, sig.contiguous())] if uniq.numel() < n else self.time_of(sig)
        m = torch.as_tensor(self.mean_fn(t), dtype=torch.float64).reshape(n, 1).to(theta_t.dtype)
        xx = torch.as_tensor(x, dtype=theta_t.dtype)
        if xx.ndim == 1:
            xx = xx[None].expand(n, -1)
        return m * self.score_fn(m * theta_t, t, xx)
