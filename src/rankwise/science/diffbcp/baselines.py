"""DiffBCP's CP-ALS baseline: fixed-rank CP completion of the patch tensor through tensorly's masked
``parafac`` (EM-style imputation of the missing entries at every ALS iteration).

Masked CP-ALS at 10-20 % observed easily stalls in a poor local optimum from a random start, so the
baseline starts from tensorly's SVD initialisation (the SVD of the mask-imputed unfoldings, repeated
``svd_mask_repeats`` times) and optionally adds random restarts; the run with the smallest error on the
observed entries wins. The number of ALS iterations of every run is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_int, check_number
from rankwise.science.diffbcp.bcp import check_observations
from rankwise.science.diffbcp.tensorize import PatchMap

__all__ = ["ALSResult", "cp_als_complete"]


@dataclass
class ALSResult:
    """``image``: the reconstruction (input's shape); ``iterations``: ALS iterations of the chosen run;
    ``all_iterations``: of every run (SVD start first); ``converged``: the chosen run stopped on ``tol``
    before ``n_iter_max``; ``observed_rmse``: its RMSE on the observed entries."""

    image: Tensor
    iterations: int
    converged: bool
    observed_rmse: float
    all_iterations: list[int] = field(default_factory=list)
    cpu_s: float = 0.0


def cp_als_complete(image: Tensor, mask: Tensor, rank: int = 4, patch: int = 4, stride: int = 2,
                    n_iter_max: int = 500, tol: float = 1e-7, restarts: int = 0, seed: int = 0) -> ALSResult:
    """Complete ``image`` ([C, H, W] or [H, W]) by rank-``rank`` CP-ALS (tensorly) on its patch tensor."""
    import tensorly as tl
    from tensorly.decomposition import parafac

    check_int("cp_als.rank", rank, 1)
    check_int("cp_als.n_iter_max", n_iter_max, 1)
    check_int("cp_als.restarts", restarts, 0)
    check_number("cp_als.tol", tol, 0.0)
    Y, M = check_observations(image, mask, "image")
    two_d = Y.dim() == 2
    Y3, M3 = (Y.unsqueeze(0), M.unsqueeze(0)) if two_d else (Y, M)
    pm = PatchMap(Y3.shape[0], Y3.shape[1], Y3.shape[2], patch, stride)
    yt, mt = pm.to_tensor(Y3).numpy(), pm.to_tensor(M3).numpy()
    c0 = time.process_time()
    best, runs = None, []
    prev = tl.get_backend()
    tl.set_backend("numpy")
    try:
        for k in range(restarts + 1):
            init = "svd" if k == 0 else "random"
            cp, errs = parafac(yt, rank, n_iter_max=n_iter_max, init=init, tol=tol, mask=mt,
                               random_state=np.random.RandomState(seed * 1000 + k), return_errors=True)
            rec = tl.cp_to_tensor(cp)
            rmse = float(np.sqrt(((rec - yt) ** 2 * mt).sum() / mt.sum()))
            runs.append(len(errs))
            if best is None or rmse < best[0]:
                best = (rmse, rec, len(errs))
    finally:
        tl.set_backend(prev)
    rmse, rec, iters = best
    out = pm.to_image(torch.from_numpy(np.asarray(rec, dtype=np.float64)))
    return ALSResult(out[0] if two_d else out, iters, iters < n_iter_max, rmse, runs, time.process_time() - c0)
