"""FSLoRA: federated sketching LoRA (arXiv 2501.19389, ICML 2026).

The server keeps ONE global rank-r LoRA pair per adapted layer, ``B (out, r)``, ``A (r, in)``, global
update ``(alpha / r) B A``. Every round, each sampled client i gets a fresh random sketch per layer

    S_i = (r / k_i) sum_{j in J_i} e_j e_j^T,   J_i a uniform k_i-subset of {1..r},   E[S_i] = I_r,

and trains ``W0 + (alpha / r) B S_i A = W0 + (alpha / k_i) B[:, J_i] A[J_i, :]``: it receives, trains
and returns only ``B[:, J_i]`` (out, k_i) and ``A[J_i, :]`` (k_i, in), so its compute, memory and
traffic scale with k_i / r. The server scatters each client's change into full-size zero matrices
(columns / rows J_i) and averages over the aggregated clients (dividing by their number, not by how
many touched a column; that keeps the aggregate unbiased), then ``B <- B + eta_s mean dB``,
``A <- A + eta_s mean dA`` (``server_optimizer="avg"``, eta_s = 1, the setting of the analysis) or
feeds ``-mean d`` to a server SGD/AdamW (the official code uses AdamW).

Choices (spec "choice" items): J_i is drawn independently per layer and shared by that layer's B and
A; J_i is sorted (so k_i = r gives S = I exactly and FSLoRA equals FedAvg-LoRA); sketch seeds are
``(seed, round, client, layer)`` so the server can re-derive J_i instead of storing it.

API::

    from rankwise.federated import FederatedConfig, FSLoRAStrategy, run_federated
    strategy = FSLoRAStrategy(cfg, init_adapter, head=head, evaluate_fn=fn, num_clients=16)
    history = run_federated(strategy, client_fn, num_clients=16, rounds=30)     # in-process, or backend="flower"
    strategy.global_adapter.save("fslora.safetensors")
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rankwise.core.registry import register
from rankwise.federated.common import derive_seed
from rankwise.federated.config import FederatedConfig
from rankwise.federated.registry import register_method
from rankwise.federated.strategy import ClientUpdate, LoRAStrategyLogic, flower_class

__all__ = ["FederatedConfig", "FSLoRALogic", "FSLoRAStrategy", "draw_indices", "scatter_delta", "sketch_matrix"]


def draw_indices(r: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """J: a uniformly random k-subset of ``range(r)`` (without replacement), sorted ascending."""
    if not isinstance(r, (int, np.integer)) or r < 1:
        raise ValueError(f"global rank r must be an int >= 1, got {r!r}")
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= r:
        raise ValueError(f"sketch size k must be an int in [1, r={r}], got {k!r}")
    return np.sort(rng.choice(r, size=int(k), replace=False)).astype(np.int64)


def sketch_matrix(r: int, indices: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``S = (r / k) sum_{j in J} e_j e_j^T`` as a dense ``(r, r)`` diagonal matrix (paper, Sec. 3)."""
    idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
    d = torch.zeros(r, dtype=dtype)
    d[idx] = r / len(idx)
    return torch.diag(d)


def scatter_delta(r: int, parts: list[tuple[np.ndarray, torch.Tensor, float]], axis: int,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """``sum_i w_i scatter(delta_i)``: each ``delta_i`` fills rows (axis 0, A) or columns (axis 1, B) ``J_i``.

    ``parts``: ``(J_i, delta_i, w_i)``; accumulated in float64.
    """
    out = torch.zeros(shape, dtype=torch.float64)
    for idx, delta, w in parts:
        j = torch.as_tensor(idx, dtype=torch.long)
        if axis == 0:
            out.index_add_(0, j, delta.double() * w)
        else:
            out.index_add_(1, j, delta.double() * w)
    return out


class FSLoRALogic(LoRAStrategyLogic):
    """FSLoRA's server: fresh random sketches per client per round, scatter-average of the sub-block changes."""

    method = "fslora"

    def sketch(self, rnd: int, pid: int) -> dict[str, np.ndarray]:
        """J_i per module for client ``pid`` in round ``rnd`` (re-derivable from the seed)."""
        k = self.config.rank_of(pid)
        return {m: draw_indices(self.config.rank, k,
                                np.random.default_rng(derive_seed(self.config.seed, "sketch", rnd, pid, i)))
                for i, m in enumerate(self.modules)}

    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list, dict[str, float]]:
        J = self.sketch(rnd, pid)
        # (alpha / r) * (r / k): the sketch's scale
        return self.factor_payload(lambda m, A, B: (A[torch.as_tensor(J[m])], B[:, torch.as_tensor(J[m])]),
                                   {m: self.config.alpha / len(J[m]) for m in self.modules})

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        w = self.weights(updates)
        sketches = [self.sketch(rnd, u.pid) for u in updates]
        deltas: dict[str, torch.Tensor] = {}
        for m in self.modules:
            A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
            pa, pb = [], []
            for u, J, wi in zip(updates, sketches, w):
                j = torch.as_tensor(J[m])
                pa.append((J[m], u.tensors[f"{m}.lora_A"].double() - A[j].double(), wi))
                pb.append((J[m], u.tensors[f"{m}.lora_B"].double() - B[:, j].double(), wi))
            deltas[f"{m}.lora_A"] = scatter_delta(self.config.rank, pa, 0, tuple(A.shape)).float()
            deltas[f"{m}.lora_B"] = scatter_delta(self.config.rank, pb, 1, tuple(B.shape)).float()
        deltas.update(self._head_average(updates, w))
        self.apply_delta(deltas)

    def contributions(self, rnd: int, updates: list[ClientUpdate]) -> list[dict[str, tuple[torch.Tensor, Any]]]:
        """Each client's change scattered into rows (A) / columns (B) ``J_i``, masked there; head changes."""
        out = []
        for u in updates:
            J = self.sketch(rnd, u.pid)
            c: dict[str, tuple[torch.Tensor, Any]] = {}
            for m in self.modules:
                A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
                j = torch.as_tensor(J[m])
                dA = torch.zeros(A.shape, dtype=torch.float64)
                dB = torch.zeros(B.shape, dtype=torch.float64)
                dA[j] = u.tensors[f"{m}.lora_A"].double() - A[j].double()
                dB[:, j] = u.tensors[f"{m}.lora_B"].double() - B[:, j].double()
                rows = torch.zeros(A.shape[0], 1, dtype=torch.bool)
                rows[j] = True
                c[f"{m}.lora_A"], c[f"{m}.lora_B"] = (dA, rows), (dB, rows.T)
            for n in self.head_names():
                c[n] = (u.tensors[n].double() - self.tensors[n].double(), None)
            out.append(c)
        return out


def __getattr__(name: str) -> Any:
    if name == "FSLoRAStrategy":
        return flower_class(FSLoRALogic, "FSLoRAStrategy")
    if name == "FSLoRAConfig":  # deprecated alias of FederatedConfig (warns)
        import rankwise.federated.config as config

        return config.FSLoRAConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fslora_strategy(config: FederatedConfig, init_adapter: Any, **kwargs: Any) -> Any:
    """``FSLoRAStrategy(config, init_adapter, **kwargs)``: the registry's entry point (a Flower Strategy)."""
    return flower_class(FSLoRALogic, "FSLoRAStrategy")(config, init_adapter, **kwargs)


register_method("fslora", FSLoRALogic, "FSLoRAStrategy", config=FederatedConfig)
register("fslora", config=FederatedConfig, entry=fslora_strategy)
