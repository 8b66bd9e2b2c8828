"""Baselines of FSLoRA, as Flower strategies on the same client: FedAvg-LoRA, HetLoRA, FlexLoRA.

* **FedAvg-LoRA** (FedIT): every client trains the full global rank-r adapter; the server runs
  *Flower's own* ``FedAvg.aggregate_fit`` (example-weighted average of A and B separately). Run it at
  r = k_min for the homogeneous "bucket effect" baseline, or at r with all clients full as an upper
  bound. ``client_ranks`` is ignored.
* **HetLoRA** (Cho et al., 2024): client i receives the first k_i columns of B / rows of A (truncation)
  with the global scaling alpha / r; the server zero-pads each reply to rank r and averages element-wise
  (weights ``config.weighting``; ``norm_weighting=True`` additionally weights each layer's reply by
  ``||B_i A_i||_F``, the original paper's option). Rank self-pruning is not implemented.
* **FlexLoRA** (Bai et al., 2024): client i receives the rank-k_i truncated SVD of the global
  ``B A`` (``B_i = U_k sqrt(S_k)``, ``A_i = sqrt(S_k) V_k^T``); the server forms each ``B_i A_i``,
  averages them (weights ``config.weighting``; the paper weights by data size) and keeps the rank-r
  truncated SVD of the average as the new global factors. While the global product is zero (round 1,
  B = 0) the SVD carries no direction, so clients get the first k_i columns/rows as in HetLoRA.

HetLoRA and FlexLoRA replace factors rather than adding a change: they need ``server_optimizer="avg"``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rankwise.federated.common import HEAD_PREFIX, WIRE_DTYPE
from rankwise.federated.config import FederatedConfig
from rankwise.federated.registry import register_method
from rankwise.federated.strategy import ClientUpdate, LoRAStrategyLogic, flower_class

__all__ = ["FedAvgLoRALogic", "FlexLoRALogic", "HetLoRALogic", "product_contributions", "svd_factors",
           "truncated_factors"]


class FedAvgLoRALogic(LoRAStrategyLogic):
    """FedAvg-LoRA: full global rank for every client; aggregation by Flower's ``FedAvg.aggregate_fit``."""

    method = "fedavg"
    supports_server_optimizer = False

    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list, dict[str, float]]:
        names = list(self.tensors)
        return ([self.tensors[n].numpy().astype(WIRE_DTYPE, copy=True) for n in names],
                [(n, tuple(self.tensors[n].shape)) for n in names],
                {m: self.scaling for m in self.modules})

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        from flwr.common import parameters_to_ndarrays
        from flwr.server.strategy import FedAvg

        params, _ = FedAvg.aggregate_fit(self, rnd, [u.raw for u in updates], [])  # type: ignore[arg-type]
        if params is None:
            return
        for n, a in zip(list(self.tensors), parameters_to_ndarrays(params)):
            self.tensors[n].copy_(torch.from_numpy(np.asarray(a)).to(torch.float32))


def product_contributions(logic: LoRAStrategyLogic, updates: list[ClientUpdate]) -> list[dict[str, tuple[torch.Tensor, Any]]]:
    """Each update's full-size ``B_i A_i`` per module (key ``product:<module>``) and head changes: the
    aggregation space of the methods that average products (FlexLoRA, FLoRIST)."""
    return [{**{f"product:{m}": (u.tensors[f"{m}.lora_B"].double() @ u.tensors[f"{m}.lora_A"].double(), None)
                for m in logic.modules},
             **{n: (u.tensors[n].double() - logic.tensors[n].double(), None) for n in logic.head_names()}}
            for u in updates]


def truncated_factors(A: torch.Tensor, B: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First k rows of ``A (r, in)`` and first k columns of ``B (out, r)`` (HetLoRA's truncation)."""
    return A[:k].clone(), B[:, :k].clone()


def svd_factors(M: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-k factors of ``M (out, in)`` by SVD: ``B = U_k sqrt(S_k)`` (out, k), ``A = sqrt(S_k) V_k^T`` (k, in).

    ``B @ A`` is the best rank-k approximation of ``M`` (Eckart-Young); computed in float64.
    """
    U, S, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    k = min(k, S.shape[0])
    s = S[:k].clamp_min(0).sqrt()
    return (s[:, None] * Vh[:k]), (U[:, :k] * s[None, :])


def _product_svd_factors(A: torch.Tensor, B: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`svd_factors` of ``B @ A`` through thin QRs of B and A^T (no (out, in) product formed)."""
    qb, rb = torch.linalg.qr(B.double())
    qa, ra = torch.linalg.qr(A.double().T)
    a_small, b_small = svd_factors(rb @ ra.T, k)
    return a_small @ qa.T, qb @ b_small


class HetLoRALogic(LoRAStrategyLogic):
    """HetLoRA: truncation to the first k_i components, zero-padded element-wise averaging."""

    method = "hetlora"
    supports_server_optimizer = False

    def __init__(self, *args: Any, norm_weighting: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(norm_weighting, bool):
            raise ValueError(f"norm_weighting must be a bool, got {norm_weighting!r}")
        self.norm_weighting = norm_weighting

    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list, dict[str, float]]:
        k = self.config.rank_of(pid)
        return self.factor_payload(lambda m, A, B: truncated_factors(A, B, k))

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        w = self.weights(updates)
        for m in self.modules:
            A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
            wm = list(w)
            if self.norm_weighting:
                norms = [float(torch.linalg.matrix_norm(u.tensors[f"{m}.lora_B"].double()
                                                        @ u.tensors[f"{m}.lora_A"].double())) for u in updates]
                raw = [wi * n for wi, n in zip(w, norms)]
                wm = [x / sum(raw) for x in raw] if sum(raw) > 0 else list(w)
            newA = torch.zeros(A.shape, dtype=torch.float64)
            newB = torch.zeros(B.shape, dtype=torch.float64)
            for u, wi in zip(updates, wm):
                a, b = u.tensors[f"{m}.lora_A"].double(), u.tensors[f"{m}.lora_B"].double()
                newA[: a.shape[0]] += wi * a
                newB[:, : b.shape[1]] += wi * b
            A.copy_(newA.float())
            B.copy_(newB.float())
        for n, d in self._head_average(updates, w).items():
            self.tensors[n].add_(d)

    def contributions(self, rnd: int, updates: list[ClientUpdate]) -> list[dict[str, tuple[torch.Tensor, Any]]]:
        """Each client's factors zero-padded to rank r, masked on its first k_i components; head changes.
        (``norm_weighting`` applies to the mean only.)"""
        out = []
        for u in updates:
            c: dict[str, tuple[torch.Tensor, Any]] = {}
            for m in self.modules:
                A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
                a, b = u.tensors[f"{m}.lora_A"].double(), u.tensors[f"{m}.lora_B"].double()
                pa, pb = torch.zeros(A.shape, dtype=torch.float64), torch.zeros(B.shape, dtype=torch.float64)
                pa[: a.shape[0]], pb[:, : b.shape[1]] = a, b
                rows = torch.arange(A.shape[0])[:, None] < a.shape[0]
                c[f"{m}.lora_A"], c[f"{m}.lora_B"] = (pa, rows), (pb, rows.T)
            for n in self.head_names():
                c[n] = (u.tensors[n].double() - self.tensors[n].double(), None)
            out.append(c)
        return out

    def apply_combined(self, rnd: int, combined: dict[str, torch.Tensor], updates: list[ClientUpdate]) -> None:
        for n, t in combined.items():
            if n.startswith(HEAD_PREFIX):
                self.tensors[n].add_(t.float())
            else:
                self.tensors[n].copy_(t.float())


class FlexLoRALogic(LoRAStrategyLogic):
    """FlexLoRA: SVD redistribution of the averaged full-size update ``sum_i w_i B_i A_i``."""

    method = "flexlora"
    supports_server_optimizer = False

    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list, dict[str, float]]:
        k = self.config.rank_of(pid)

        def factors(m: str, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if bool((B == 0).all()) or bool((A == 0).all()):
                return truncated_factors(A, B, k)
            return _product_svd_factors(A, B, k)

        return self.factor_payload(factors)

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        w = self.weights(updates)
        products = {}
        for m in self.modules:
            A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
            M = torch.zeros(B.shape[0], A.shape[1], dtype=torch.float64)
            for u, wi in zip(updates, w):
                M += wi * (u.tensors[f"{m}.lora_B"].double() @ u.tensors[f"{m}.lora_A"].double())
            products[m] = M
        self.set_from_products(products)
        for n, d in self._head_average(updates, w).items():
            self.tensors[n].add_(d)

    def set_from_products(self, products: dict[str, torch.Tensor]) -> None:
        """The global factors of each module from the averaged full-size update: its rank-r truncated SVD."""
        r = self.config.rank
        for m, M in products.items():
            A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
            a, b = svd_factors(M, r)
            A.zero_()
            B.zero_()
            A[: a.shape[0]] = a.float()
            B[:, : b.shape[1]] = b.float()

    def contributions(self, rnd: int, updates: list[ClientUpdate]) -> list[dict[str, tuple[torch.Tensor, Any]]]:
        """Each client's full-size update ``B_i A_i`` per module (key ``product:<module>``); head changes."""
        return product_contributions(self, updates)

    def apply_combined(self, rnd: int, combined: dict[str, torch.Tensor], updates: list[ClientUpdate]) -> None:
        self.set_from_products({k[len("product:"):]: t for k, t in combined.items() if k.startswith("product:")})
        for n in self.head_names():
            self.tensors[n].add_(combined[n].float())


_NAMES = {"FedAvgLoRAStrategy": FedAvgLoRALogic, "HetLoRAStrategy": HetLoRALogic, "FlexLoRAStrategy": FlexLoRALogic}
for _name, _logic in _NAMES.items():
    register_method(_logic.method, _logic, _name, config=FederatedConfig)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return flower_class(_NAMES[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


