"""DiffBCP's cost per 16 x 16 image, and BCP-CUSP's rank recovery against tensorly's CP-ALS.

* ``diffbcp_per_image``: one held-out digit at 10 % observed (noise 0.05), ``K`` outer iterations of every
  sampled row on the reproduction's sizes (4 x 4 x 49 patch tensor, R0 = 32, 50-step reverse grid) with a
  seeded *untrained* UNet of the cached prior's architecture (timing needs no training; the number of
  reverse steps depends on rho, i.e. on the CP block's noise estimate, not on the weights). Anchor:
  tensorly's masked ``parafac`` (rank 4, SVD start, 100 iterations), the peer a user already runs.
  Rows: BCP-CUSP (CP block only), PnP-DM (diffusion block only), DiffBCP (both).
* ``diffbcp_rank_recovery``: the synthetic rank-3 tensor 20 x 20 x 20, 50 % observed: BCP-CUSP (R0 = 16,
  300 sweeps, rank chosen by CUSP) against tensorly's masked ``parafac`` at the true rank 3 (anchor; SVD
  start, up to 300 iterations).

``SMOKE_CASES``: K = 2 on one digit. Run ``python -m benchmarks.run diffbcp``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.harness import Case

K = 20


def _digit() -> tuple[Any, torch.Tensor, torch.Tensor]:
    from rankwise.science import diffbcp as db
    from rankwise.zoo.images import digits_images

    img = digits_images(16, n_test=297, seed=0)[1][0, 0].double() * 2 - 1
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(16, 16, generator=g) < 0.1).double()
    return db, (img + 0.05 * torch.randn(16, 16, generator=g, dtype=torch.float64)) * mask, mask


def _per_image(kind: str, k: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        db, y, mask = _digit()
        cfg = db.DiffBCPConfig(iters=k, burn_in=k // 2, n_samples=max(1, k // 4))
        if kind == "tensorly CP-ALS r4":
            return lambda: db.cp_als_complete(y, mask, rank=4, n_iter_max=100, tol=0.0)
        if kind == "BCP-CUSP":
            import dataclasses

            return lambda: db.DiffBCP(dataclasses.replace(cfg, schedule="none")).fit(y, mask, seed=0)
        prior = db.TinyVPDiffusion.build(16, 1, (16, 32, 32), grid_steps=50, seed=0)
        if kind == "PnP-DM":
            return lambda: db.pnp_dm([y], [mask], prior, 0.05, cfg, seed=0)
        return lambda: db.DiffBCP(cfg).fit(y, mask, prior=prior, seed=0)
    return factory


def _synthetic(kind: str) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.science import diffbcp as db

        g = torch.Generator().manual_seed(0)
        U = [torch.randn(20, 3, generator=g, dtype=torch.float64) for _ in range(3)]
        X = torch.einsum("ir,jr,kr->ijk", *U)
        M = (torch.rand(X.shape, generator=g) < 0.5).double()
        Y = (X + 0.01 * torch.randn(X.shape, generator=g, dtype=torch.float64)) * M
        if kind == "BCP-CUSP":
            return lambda: db.BayesianCP(db.CUSPConfig(init_rank=16)).fit(Y, M, sweeps=300, seed=0)

        def als() -> Any:
            import tensorly as tl
            from tensorly.decomposition import parafac

            tl.set_backend("numpy")
            return parafac(Y.numpy(), 3, n_iter_max=300, init="svd", mask=M.numpy(), tol=1e-9)
        return als
    return factory


_ROWS = ("tensorly CP-ALS r4", "BCP-CUSP", "PnP-DM", "DiffBCP")


def _cases(k: int, repeats: int, synthetic: bool = True) -> list[Case]:
    cases = [Case("diffbcp_per_image", {r: _per_image(r, k) for r in _ROWS}, anchor="tensorly CP-ALS r4",
                  params={"outer_iterations": k, "image": "16x16 digit, 10% observed", "init_rank": 32,
                          "grid_steps": 50, "unet_channels": "16/32/32"}, repeats=repeats, warmup=1)]
    if synthetic:
        cases.append(Case("diffbcp_rank_recovery", {"tensorly CP-ALS r3": _synthetic("als"),
                                                    "BCP-CUSP": _synthetic("BCP-CUSP")},
                          anchor="tensorly CP-ALS r3", params={"tensor": "20x20x20 rank 3, 50% observed",
                                                               "sweeps": 300}, repeats=repeats, warmup=1))
    return cases


CASES = _cases(K, 5)
SMOKE_CASES = _cases(2, 1, synthetic=False)
