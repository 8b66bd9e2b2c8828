"""The configuration of a federated LoRA run, shared by FSLoRA and its baselines (HetLoRA, FlexLoRA, FedAvg-LoRA).

Defaults follow the FSLoRA paper's small-model setting as adapted in the rankwise spec (global rank
r = 16, alpha = 16, H = 8 local AdamW steps at lr 5e-4, batch 16, 5 clients per round, plain
averaging at the server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from rankwise.federated.common import finite_number

__all__ = ["FSLoRAConfig", "SERVER_OPTIMIZERS", "WEIGHTINGS"]

SERVER_OPTIMIZERS = ("avg", "sgd", "adam")
WEIGHTINGS = ("uniform", "examples")
ON_INVALID = ("skip", "raise")


def _pos_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"FSLoRAConfig.{name} must be an int >= 1, got {v!r}")


@dataclass(frozen=True)
class FSLoRAConfig:
    """Federated LoRA hyper-parameters.

    Attributes:
        rank: global LoRA rank r (server's B (out, r), A (r, in) per adapted layer).
        alpha: LoRA scaling numerator; the global update is (alpha / r) B A.
        target_modules: module-name patterns of the adapted Linear layers (None: the task's targets).
        client_ranks: ``{client id: k_i}`` with 1 <= k_i <= r (FSLoRA sketch size; HetLoRA/FlexLoRA rank).
        default_rank: k for clients missing from ``client_ranks`` (None: such a client is an error).
        clients_per_round: |C|, clients sampled per round (capped at the number of clients).
        local_steps: H, client optimizer steps per round.
        batch_size, client_lr, head_lr (None: client_lr), weight_decay: the clients' AdamW.
        server_optimizer: "avg" (B <- B + server_lr * mean delta; the paper's analysis, server_lr = 1),
            "sgd" (SGD with ``server_momentum`` on the pseudo-gradient -mean delta) or "adam"
            (AdamW on the pseudo-gradient, as the official code; use server_lr ~ 3e-4).
        weighting: "uniform" (divide by the number of aggregated clients, the paper) or "examples"
            (weights n_i / sum n, as Flower's FedAvg).
        on_invalid: "skip" (drop a malformed client update with a logged warning) or "raise".
        seed: seeds client sampling, sketches, adapter init and client batch order.
    """

    rank: int = 16
    alpha: float = 16.0
    target_modules: tuple[str, ...] | None = None
    client_ranks: Mapping[int, int] = field(default_factory=dict)
    default_rank: int | None = None
    clients_per_round: int = 5
    local_steps: int = 8
    batch_size: int = 16
    client_lr: float = 5e-4
    head_lr: float | None = None
    weight_decay: float = 0.0
    server_optimizer: str = "avg"
    server_lr: float = 1.0
    server_momentum: float = 0.0
    weighting: str = "uniform"
    on_invalid: str = "skip"
    seed: int = 0

    def __post_init__(self) -> None:
        _pos_int("rank", self.rank)
        if not finite_number(self.alpha) or float(self.alpha) <= 0:
            raise ValueError(f"FSLoRAConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if self.target_modules is not None:
            t = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
            if not isinstance(t, (tuple, list)) or not t or not all(isinstance(x, str) and x for x in t):
                raise ValueError(f"FSLoRAConfig.target_modules must be a non-empty tuple of module-name patterns, "
                                 f"got {self.target_modules!r}")
            object.__setattr__(self, "target_modules", tuple(t))
        if not isinstance(self.client_ranks, Mapping):
            raise ValueError(f"FSLoRAConfig.client_ranks must be a mapping {{client id: rank}}, "
                             f"got {type(self.client_ranks).__name__}")
        ranks: dict[int, int] = {}
        for cid, k in self.client_ranks.items():
            if not isinstance(cid, int) or isinstance(cid, bool) or cid < 0:
                raise ValueError(f"FSLoRAConfig.client_ranks: client id {cid!r} must be an int >= 0")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.rank:
                raise ValueError(f"FSLoRAConfig.client_ranks: client {cid} has rank {k!r}; it must be an int "
                                 f"in [1, rank={self.rank}]")
            ranks[cid] = k
        object.__setattr__(self, "client_ranks", ranks)
        if self.default_rank is not None and (not isinstance(self.default_rank, int)
                                              or isinstance(self.default_rank, bool)
                                              or not 1 <= self.default_rank <= self.rank):
            raise ValueError(f"FSLoRAConfig.default_rank must be None or an int in [1, rank={self.rank}], "
                             f"got {self.default_rank!r}")
        for name in ("clients_per_round", "local_steps", "batch_size"):
            _pos_int(name, getattr(self, name))
        for name in ("client_lr", "server_lr"):
            v = getattr(self, name)
            if not finite_number(v) or float(v) <= 0:
                raise ValueError(f"FSLoRAConfig.{name} must be a finite number > 0, got {v!r}")
        if self.head_lr is not None and (not finite_number(self.head_lr) or float(self.head_lr) < 0):
            raise ValueError(f"FSLoRAConfig.head_lr must be None or a finite number >= 0, got {self.head_lr!r}")
        if not finite_number(self.weight_decay) or float(self.weight_decay) < 0:
            raise ValueError(f"FSLoRAConfig.weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not finite_number(self.server_momentum) or not 0 <= float(self.server_momentum) < 1:
            raise ValueError(f"FSLoRAConfig.server_momentum must be in [0, 1), got {self.server_momentum!r}")
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"FSLoRAConfig.server_optimizer must be one of {SERVER_OPTIMIZERS}, "
                             f"got {self.server_optimizer!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"FSLoRAConfig.weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"FSLoRAConfig.on_invalid must be one of {ON_INVALID}, got {self.on_invalid!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"FSLoRAConfig.seed must be an int, got {self.seed!r}")

    def rank_of(self, client: int) -> int:
        """k_i of ``client``: ``client_ranks[client]``, else ``default_rank``, else ValueError."""
        if client in self.client_ranks:
            return self.client_ranks[client]
        if self.default_rank is not None:
            return self.default_rank
        raise ValueError(f"client {client} has no rank: it is not in FSLoRAConfig.client_ranks "
                         f"(ids {sorted(self.client_ranks)[:10]}) and default_rank is None")

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["client_ranks"] = {str(k): v for k, v in self.client_ranks.items()}
        d["target_modules"] = list(self.target_modules) if self.target_modules else None
        return d
