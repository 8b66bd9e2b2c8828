"""The configuration of a federated run, shared by every method of the family (FSLoRA, HetLoRA, FlexLoRA,
FedAvg-LoRA, FLoRIST; UB-SMoE's config extends it).

Defaults follow the FSLoRA paper's small-model setting as adapted in the rankwise spec (global rank
r = 16, alpha = 16, H = 8 local AdamW steps at lr 5e-4, batch 16, 5 clients per round, plain
averaging at the server). The server-side defences (see :mod:`rankwise.federated.defences`) are on
by default: updates more than 10x the round's median size are rejected, example counts are capped
at what the client was assigned, and a round whose global model is not finite, whose test loss
more than doubles or whose test accuracy falls by more than 0.25 is refused.

``FSLoRAConfig`` is the former name of :class:`FederatedConfig` (deprecated alias, one release).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from rankwise.core.validate import check_choice, check_int, check_number, check_positive, check_unit

__all__ = ["AGGREGATORS", "FederatedConfig", "SERVER_OPTIMIZERS", "WEIGHTINGS"]

SERVER_OPTIMIZERS = ("avg", "sgd", "adam")
WEIGHTINGS = ("uniform", "examples")
ON_INVALID = ("skip", "raise")
#: how the server combines the accepted updates (see rankwise.federated.defences)
AGGREGATORS = ("mean", "median", "trimmed", "krum")


@dataclass(frozen=True)
class FederatedConfig:
    """Federated LoRA hyper-parameters and the server's defences.

    Attributes:
        rank: global LoRA rank r (server's B (out, r), A (r, in) per adapted layer).
        alpha: LoRA scaling numerator; the global update is (alpha / r) B A.
        target_modules: module-name patterns of the adapted Linear layers (None: the task's targets).
        client_ranks: ``{client id: k_i}`` with 1 <= k_i <= r (FSLoRA sketch size; HetLoRA/FlexLoRA rank).
        default_rank: k for clients missing from ``client_ranks`` (None: such a client is an error).
        clients_per_round: |C|, clients sampled per round (at most the number of clients).
        local_steps: H, client optimizer steps per round.
        batch_size, client_lr, head_lr (None: client_lr), weight_decay: the clients' AdamW.
        server_optimizer: "avg" (B <- B + server_lr * mean delta; the paper's analysis, server_lr = 1),
            "sgd" (SGD with ``server_momentum`` on the pseudo-gradient -mean delta) or "adam"
            (AdamW on the pseudo-gradient, as the official code; use server_lr ~ 3e-4).
        weighting: "uniform" (divide by the number of aggregated clients, the paper) or "examples"
            (weights n_i / sum n, as Flower's FedAvg).
        on_invalid: "skip" (drop a malformed client update with a logged warning) or "raise".
        seed: seeds client sampling, sketches, adapter init and client batch order.
        aggregator: "mean" (each method's own weighted average), "median" (coordinate-wise median, as
            Flower's FedMedian), "trimmed" (coordinate-wise trimmed mean, as FedTrimmedAvg, cutting
            ``trim_fraction`` of the values at each end) or "krum" (Multi-Krum: keep the
            ``n - krum_byzantine`` updates closest to their neighbours, then the method's mean).
        trim_fraction: in [0, 0.5), per end, for "trimmed".
        krum_byzantine: f >= 0, the number of malicious clients Krum tolerates per round.
        max_update_norm_ratio: a client whose update (root-mean-square change of what it was sent) is
            larger than this times the round's lower median is rejected; None: no bound.
        max_examples_ratio: with no assigned example count known for a client, its claimed
            ``num_examples`` is capped at this times the round's lower median claim; None: no cap.
            Where the server knows the assigned counts (the task is local) the cap is the assigned count.
        health_check: refuse a round whose global model has a non-finite tensor or test loss, or whose
            test loss exceeds ``max_loss_ratio`` times the last accepted loss, or whose test accuracy falls
            more than ``max_accuracy_drop`` below the last accepted one: the state is rolled back
            and no checkpoint is written from it.
        max_loss_ratio: the loss bound of the health check (> 1).
        max_accuracy_drop: the accuracy bound of the health check: refuse a round whose test accuracy
            falls more than this (absolute, in [0, 1]) below the last accepted round's; None: no bound.
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
    aggregator: str = "mean"
    trim_fraction: float = 0.2
    krum_byzantine: int = 1
    max_update_norm_ratio: float | None = 10.0
    max_examples_ratio: float | None = 10.0
    health_check: bool = True
    max_loss_ratio: float = 2.0
    max_accuracy_drop: float | None = 0.25

    def __post_init__(self) -> None:
        name = type(self).__name__
        q = lambda f: f"{name}.{f}"  # noqa: E731
        check_int(q("rank"), self.rank, 1)
        object.__setattr__(self, "alpha", check_positive(q("alpha"), self.alpha))
        if self.target_modules is not None:
            t = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
            if not isinstance(t, (tuple, list)) or not t or not all(isinstance(x, str) and x for x in t):
                raise ValueError(f"{name}.target_modules must be a non-empty tuple of module-name patterns, "
                                 f"got {self.target_modules!r}")
            object.__setattr__(self, "target_modules", tuple(t))
        if not isinstance(self.client_ranks, Mapping):
            raise ValueError(f"{name}.client_ranks must be a mapping {{client id: rank}}, "
                             f"got {type(self.client_ranks).__name__}")
        ranks: dict[int, int] = {}
        for cid, k in self.client_ranks.items():
            if not isinstance(cid, int) or isinstance(cid, bool) or cid < 0:
                raise ValueError(f"{name}.client_ranks: client id {cid!r} must be an int >= 0")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.rank:
                raise ValueError(f"{name}.client_ranks: client {cid} has rank {k!r}; it must be an int "
                                 f"in [1, rank={self.rank}]")
            ranks[cid] = k
        object.__setattr__(self, "client_ranks", ranks)
        check_int(q("default_rank"), self.default_rank, 1, self.rank, allow_none=True)
        for f in ("clients_per_round", "local_steps", "batch_size"):
            check_int(q(f), getattr(self, f), 1)
        for f in ("client_lr", "server_lr"):
            check_positive(q(f), getattr(self, f))
        check_number(q("head_lr"), self.head_lr, 0.0, allow_none=True)
        check_number(q("weight_decay"), self.weight_decay, 0.0)
        check_unit(q("server_momentum"), self.server_momentum, high_open=True)
        check_choice(q("server_optimizer"), self.server_optimizer, SERVER_OPTIMIZERS)
        check_choice(q("weighting"), self.weighting, WEIGHTINGS)
        check_choice(q("on_invalid"), self.on_invalid, ON_INVALID)
        check_int(q("seed"), self.seed)
        check_choice(q("aggregator"), self.aggregator, AGGREGATORS)
        check_number(q("trim_fraction"), self.trim_fraction, 0.0, 0.5, high_open=True)
        check_int(q("krum_byzantine"), self.krum_byzantine, 0)
        check_number(q("max_update_norm_ratio"), self.max_update_norm_ratio, 1.0, allow_none=True)
        check_number(q("max_examples_ratio"), self.max_examples_ratio, 1.0, allow_none=True)
        if not isinstance(self.health_check, bool):
            raise ValueError(f"{name}.health_check must be True or False, got {self.health_check!r}")
        check_number(q("max_loss_ratio"), self.max_loss_ratio, 1.0, low_open=True)
        check_unit(q("max_accuracy_drop"), self.max_accuracy_drop, allow_none=True)

    def rank_of(self, client: int) -> int:
        """k_i of ``client``: ``client_ranks[client]``, else ``default_rank``, else ValueError."""
        if client in self.client_ranks:
            return self.client_ranks[client]
        if self.default_rank is not None:
            return self.default_rank
        raise ValueError(f"client {client} has no rank: it is not in {type(self).__name__}.client_ranks "
                         f"(ids {sorted(self.client_ranks)[:10]}) and default_rank is None")

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["client_ranks"] = {str(k): v for k, v in self.client_ranks.items()}
        d["target_modules"] = list(self.target_modules) if self.target_modules else None
        return d


def __getattr__(name: str) -> Any:
    if name == "FSLoRAConfig":
        warnings.warn("FSLoRAConfig is renamed FederatedConfig (the config of every federated method); "
                      "the old name goes away in the next release", DeprecationWarning, stacklevel=2)
        return FederatedConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
