"""Bayesian CP completion of any tensor with the CUSP rank prior (the non-image mode of DiffBCP, and
its "BCP-CUSP" baseline: DiffBCP without the diffusion coupling)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_int
from rankwise.science.diffbcp.cusp import CUSPConfig, active_rank, contribution_rank, cp_full, init_state, sweep

__all__ = ["BayesianCP", "CPResult", "check_observations", "collect_indices"]


def check_observations(data: Tensor, mask: Tensor, what: str = "data") -> tuple[Tensor, Tensor]:
    """Validate ``data`` and its 0/1 ``mask`` (1 = observed) and return them as float64 with unobserved
    entries of ``data`` set to 0. Raises ValueError on a shape mismatch, no observed entry, a mask that
    is not 0/1, or NaN/Inf at an observed entry (unobserved entries may hold anything, NaN included)."""
    if not isinstance(data, Tensor) or not isinstance(mask, Tensor):
        raise TypeError(f"DiffBCP: {what} and mask must be torch tensors, got {type(data).__name__} and "
                        f"{type(mask).__name__}")
    if tuple(mask.shape) != tuple(data.shape):
        raise ValueError(f"DiffBCP: mask shape {list(mask.shape)} does not match the {what} shape {list(data.shape)}")
    m = mask.double()
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("DiffBCP: mask must hold only 0/1 (or booleans); 1 = observed")
    if not bool(m.any()):
        raise ValueError(f"DiffBCP: the mask observes no entry of the {what}")
    d = data.double()
    if not bool(torch.isfinite(d[m.bool()]).all()):
        raise ValueError(f"DiffBCP: the observed entries of the {what} hold NaN or Inf")
    return torch.where(m.bool(), d, torch.zeros((), dtype=torch.float64)), m


def collect_indices(iters: int, burn_in: int, n_samples: int) -> list[int]:
    """``n_samples`` iteration indices equally spaced over ``burn_in .. iters - 1`` (distinct, sorted)."""
    if burn_in >= iters:
        raise ValueError(f"burn_in={burn_in} must be < iters={iters}")
    return sorted({int(round(v)) for v in np.linspace(burn_in, iters - 1, min(n_samples, iters - burn_in))})


@dataclass
class CPResult:
    """Posterior summary of a Bayesian CP run.

    ``mean``/``std``: per-entry posterior mean and std of the reconstruction over the collected sweeps;
    ``last``: the last sample; ``weights``/``factors``: the last state; traces per sweep: ``tau_trace``
    (noise precision), ``rank_trace`` (contribution rank), ``rank_z_trace`` (CUSP active count
    ``#{z_r > r}``), ``size_trace`` (the current truncation R)."""

    mean: Tensor
    std: Tensor
    last: Tensor
    weights: Tensor
    factors: list[Tensor]
    tau_trace: list[float] = field(default_factory=list)
    rank_trace: list[int] = field(default_factory=list)
    rank_z_trace: list[int] = field(default_factory=list)
    size_trace: list[int] = field(default_factory=list)
    cpu_s: float = 0.0

    def relative_error(self, truth: Tensor) -> float:
        """``||mean - truth|| / ||truth||``."""
        return float((self.mean - truth.double()).norm() / truth.double().norm())

    @property
    def rank(self) -> int:
        """The contribution rank of the last sweep."""
        return self.rank_trace[-1]


class BayesianCP:
    """CP completion of ``data`` (any order, any shape) observed where ``mask`` is 1, by Gibbs sampling
    the CUSP-prior Bayesian CP model (no diffusion coupling)."""

    def __init__(self, config: CUSPConfig | None = None) -> None:
        self.config = config or CUSPConfig()

    def fit(self, data: Tensor, mask: Tensor, sweeps: int = 300, burn_in: int | None = None,
            n_samples: int = 50, seed: int = 0) -> CPResult:
        check_int("BayesianCP.sweeps", sweeps, 1)
        burn = sweeps // 2 if burn_in is None else check_int("BayesianCP.burn_in", burn_in, 0, sweeps - 1)
        check_int("BayesianCP.n_samples", n_samples, 1)
        Y, M = check_observations(data, mask)
        if Y.dim() < 2:
            raise ValueError(f"BayesianCP: data must have at least 2 modes, got shape {list(Y.shape)}")
        rng = np.random.default_rng(seed)
        cfg = self.config
        c0 = time.process_time()
        st = init_state(tuple(Y.shape), cfg, rng)
        keep = set(collect_indices(sweeps, burn, n_samples))
        s1 = torch.zeros_like(Y)
        s2 = torch.zeros_like(Y)
        res = CPResult(Y, Y, Y, st.lam, st.factors)
        X = Y
        for k in range(sweeps):
            sweep(st, Y, M, cfg, rng)
            X = cp_full(st.factors, st.lam)
            res.tau_trace.append(st.tau)
            res.rank_trace.append(contribution_rank(st.factors, st.lam, cfg.contribution_tol))
            res.rank_z_trace.append(active_rank(st.z))
            res.size_trace.append(st.rank)
            if k in keep:
                s1 += X
                s2 += X * X
        n = len(keep)
        res.mean = s1 / n
        res.std = (s2 / n - res.mean**2).clamp_min(0.0).sqrt()
        res.last, res.weights, res.factors = X, st.lam, st.factors
        res.cpu_s = time.process_time() - c0
        return res
