"""The RKME baseline through learnware's own ``RKMETableSpecification`` (learnware 0.4.0.post1).

A reduced kernel mean embedding describes a data set by ``K`` weighted points ``(z_j, beta_j)`` whose kernel
mean embedding ``sum_j beta_j k(z_j, .)`` is close (in the RKHS of the Gaussian kernel
``k(x, z) = exp(-gamma ||x - z||^2)``, gamma = 0.1) to the data's ``(1/n) sum_i k(x_i, .)``: k-means
initialisation, then ``steps`` rounds of (closed-form non-negative beta, one gradient step on Z). Two specs
compare by ``MMD^2`` between their weighted sets (smaller = more similar). For text the inputs are sentence
embeddings: here the caller's (mean-pooled MiniLM in the reproduction), L2-normalised by :func:`rkme_spec`.

learnware is imported inside the functions (extra ``learnware``; it also needs ``fast-pytorch-kmeans``);
its k-means draws from torch's and numpy's global RNGs, which are seeded here inside a fork and restored.
learnware's text and LLM specifications download encoders from a hub, so they cannot run offline; its
table specification on our embeddings is the offline equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["RKMESpec", "rkme_data_mmd", "rkme_identify", "rkme_mmd", "rkme_spec"]


@dataclass(eq=False)
class RKMESpec:
    """A reduced set: ``z`` (K, d) float64 points, ``beta`` (K,) weights, the kernel's ``gamma``, ``n`` data points.

    ``learnware`` holds learnware's own ``RKMETableSpecification`` object (None when rebuilt from arrays).
    """

    z: torch.Tensor
    beta: torch.Tensor
    gamma: float
    n: int
    learnware: Any = None

    def __post_init__(self) -> None:
        if self.z.ndim != 2 or self.beta.ndim != 1 or self.z.shape[0] != self.beta.shape[0]:
            raise ValueError(f"RKMESpec: z {tuple(self.z.shape)} and beta {tuple(self.beta.shape)} do not fit")
        if not (bool(torch.isfinite(self.z).all()) and bool(torch.isfinite(self.beta).all())):
            raise ValueError("RKMESpec holds NaN or inf")


def _kernel(x: torch.Tensor, z: torch.Tensor, gamma: float) -> torch.Tensor:
    return torch.exp(-gamma * torch.cdist(x.double(), z.double()).pow(2))


def rkme_mmd(a: RKMESpec, b: RKMESpec) -> float:
    """``MMD^2`` between two reduced sets (``b^T K b`` terms in float64); 0 for a spec with itself."""
    if a.gamma != b.gamma:
        raise ValueError(f"RKME specs with different kernels (gamma {a.gamma} vs {b.gamma}) do not compare")
    if a.z.shape[1] != b.z.shape[1]:
        raise ValueError(f"RKME specs of different dimensions ({a.z.shape[1]} vs {b.z.shape[1]})")
    ba, bb = a.beta.double(), b.beta.double()
    aa = ba @ _kernel(a.z, a.z, a.gamma) @ ba
    ab = ba @ _kernel(a.z, b.z, a.gamma) @ bb
    bbv = bb @ _kernel(b.z, b.z, a.gamma) @ bb
    return float(aa - 2 * ab + bbv)


def rkme_data_mmd(spec: RKMESpec, x: torch.Tensor, normalise: bool = True) -> float:
    """``MMD^2`` between a reduced set and the empirical embedding of data ``x`` (N, d) (the quantity RKME fits)."""
    x = torch.as_tensor(x).double()
    if normalise:
        x = torch.nn.functional.normalize(x, dim=-1)
    beta = spec.beta.double()
    n = x.shape[0]
    zz = beta @ _kernel(spec.z, spec.z, spec.gamma) @ beta
    zx = beta @ _kernel(spec.z, x, spec.gamma).sum(1) / n
    xx = _kernel(x, x, spec.gamma).sum() / n**2
    return float(zz - 2 * zx + xx)


def rkme_spec(embeddings: torch.Tensor | np.ndarray, *, k: int = 100, gamma: float = 0.1, steps: int = 3,
              step_size: float = 0.1, seed: int = 0, normalise: bool = True) -> RKMESpec:
    """learnware's RKME of ``embeddings`` (N, d): L2-normalised rows (``normalise``), ``K = k`` points
    (learnware uses ``max(1, 2N/3)`` when ``N <= k``), ``steps`` alternating rounds. Deterministic in ``seed``."""
    from learnware.specification import RKMETableSpecification

    x = torch.as_tensor(embeddings).detach().float()
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"embeddings must be (N >= 1, d), got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("embeddings hold NaN or inf")
    if normalise:
        x = torch.nn.functional.normalize(x, dim=-1)
    state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            np.random.seed(seed)
            s = RKMETableSpecification(gamma=gamma, cuda_idx=-1)
            s.generate_stat_spec_from_data(x.numpy().copy(), K=k, step_size=step_size, steps=steps)
    finally:
        np.random.set_state(state)
    z = torch.as_tensor(s.get_z()).double().reshape(s.get_z().shape[0], -1)
    beta = torch.as_tensor(s.get_beta()).double().reshape(-1)
    return RKMESpec(z, beta, float(gamma), int(x.shape[0]), s)


def rkme_identify(user: RKMESpec, learnwares: Mapping[str, RKMESpec]) -> list[tuple[str, float]]:
    """``[(name, MMD^2)]`` smallest first (the most similar learnware first)."""
    if not learnwares:
        raise ValueError("no learnware spec to compare with")
    out = [(name, rkme_mmd(user, s)) for name, s in learnwares.items()]
    return sorted(out, key=lambda t: t[1])
