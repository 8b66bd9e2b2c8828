"""E²LoRA: LoRA factors shared across adjacent layers, intervals and ranks set by gradient proxy entropy (ICLR 2026).

"E²LoRA: Efficient and Effective Low-Rank Adaptation with Entropy-Guided Adaptive Sharing" (Li, Ye, Ye, He,
Chen; OpenReview IQttyo0460). The paper's equation numbers were not available to us; the steps below are
numbered as in the spec (shared/methods/e2lora.md, "Method").

For each *module type* (the targeted Linear layers whose names differ only in the layer index, e.g.
``encoder.layer.*.attention.self.query``) with ``N`` layers and pretrained weights ``W_l (d_out, d_in)``:

1. one calibration pass of the frozen model gives ``G_l = dL/dW_l`` (averaged over ``n_calib_batches``);
2. proxy entropy (Gaussian differential entropy of the elements of ``G_l``, natural log)::

       H(G_l) = log sigma_l + 1/2 log(2 pi) + 1/2                     (sigma_l: element std of G_l)

3. joint entropy ``H(G_i, G_j)`` = the same formula on the concatenation ``[vec G_i ; vec G_j]``;
   ``I = H_i + H_j - H_ij`` and the relative mutual information ``RMI_ij = I / min(H_i, H_j)``;
4. adaptive thresholds ``tau_m = mean_{k != m} RMI_mk``;
5. Local-Similarity Sharing (LSS): greedy contiguous intervals; an interval started at ``s`` takes the
   next layer ``j`` while ``RMI_sj >= tau_s``;
6. Heterogeneous Rank Allocation (HRA): ``H_k = max_{l in I_k} H_l``, ``F_k = H_k / sum_i H_i``,
   ``r_k = round(F_k * K * r0)`` (``K`` intervals, ``r0 = base_rank``), clamped to ``>= 1``;
7. sharing: interval ``k`` holds ONE pair ``A_k (r_k, d_in)`` (Kaiming-uniform, a = sqrt 5),
   ``B_k (d_out, r_k)`` (zeros) used by every layer of the interval: ``ΔW_l = (alpha / r_k) B_k A_k``.
   The ``sharing="sharelora"`` variant (E²ShareLoRA) keeps one ``A`` per type at ``max_k r_k`` rows,
   each layer using ``A[:r_k(l)]`` with its own ``B_l (d_out, r_k(l))``.

The plan (entropies, RMI matrix, thresholds, intervals, ranks) is an :class:`E2LoRAPlan` computed once
before training by :func:`plan_e2lora`; :func:`apply_e2lora` installs it; :func:`adapt` does both.
Shared factors are the same ``nn.Parameter`` objects in every layer of an interval, so their gradient
is the sum of the per-layer gradients and an optimizer sees each once (``model.parameters()``
de-duplicates). Merging adds each layer's ``ΔW_l`` to its own base weight.

Usage::

    from rankwise.adapt.e2lora import E2LoRAConfig, adapt, get_plan, merge, save_adapter
    adapt(model, E2LoRAConfig(base_rank=8, alpha=16), calib=batches, loss_fn=lambda m, b: m(**b).loss)
    plan = get_plan(model)
    print(plan.intervals, plan.ranks, plan.num_parameters())
    ...train the parameters that require grad (and your task head)...
    merge(model)
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module

__all__ = [
    "E2LoRAConfig",
    "E2LoRALinear",
    "E2LoRAPlan",
    "TypePlan",
    "adapt",
    "adapter_names",
    "adaptive_thresholds",
    "allocate_ranks",
    "apply_e2lora",
    "collect_gradients",
    "delete_adapter",
    "disable_adapters",
    "e2lora_layers",
    "enable_adapters",
    "entropy_from_std",
    "get_plan",
    "group_layers",
    "load_adapter",
    "merge",
    "partition",
    "plan_e2lora",
    "proxy_entropy",
    "similarity_matrix",
    "save_adapter",
    "set_active",
    "trainable_parameters",
    "uniform_plan",
    "unload",
    "unmerge",
]

THRESHOLDS = ("adaptive",)
HRA_SCORES = ("paper", "shifted")
ROUNDINGS = ("round", "largest_remainder")
GRANULARITIES = ("type", "block")
SIMILARITIES = ("rmi", "cosine")
SHARINGS = ("lora", "sharelora")
#: The first purely numeric component of a module name is its layer index (depth).
DEFAULT_DEPTH_REGEX = r"(?:^|\.)(\d+)(?=\.|$)"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.e2lora"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
_HALF_LOG_2PI_E = 0.5 * math.log(2.0 * math.pi) + 0.5
#: Entropy is >= 0 once sigma >= 1/sqrt(2 pi e) ~= 0.242; RMI is then no similarity (see plan_e2lora).
SIGMA_SIGN_CHANGE = 1.0 / math.sqrt(2.0 * math.pi * math.e)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class E2LoRAConfig:
    """E²LoRA hyper-parameters (defaults: the paper's RoBERTa/GLUE setting, r0 = 8 on query/value).

    Attributes:
        base_rank: ``r0``, the vanilla LoRA rank; the rank budget of a module type is ``K * r0``.
        alpha: LoRA scale numerator; layer ``l`` uses ``alpha / r_k(l)``.
        target: module-name patterns (see :func:`rankwise.core.select.select`).
        threshold: ``"adaptive"`` (``tau_m`` = mean RMI of layer ``m`` with the others, step 4) or a fixed
            float in [0, 1] (the authors' flag suggests 0.85).
        hra_score: ``"paper"`` (``F_k = H_k / sum H``, literal) or ``"shifted"`` (scores
            ``H_k - min_i H_i + 1``: more rank to higher entropy).
        rounding: ``"round"`` (Python ``round`` as in the paper; the sum may miss ``K r0``) or
            ``"largest_remainder"`` (sum exactly ``K r0``).
        granularity: ``"type"`` (a partition per module type) or ``"block"`` (one partition for all types,
            from the concatenated gradients of each block's targeted modules).
        n_calib_batches: calibration batches averaged into ``G_l`` (the paper: 1).
        lss: share within entropy intervals (False: one interval per layer, the "HRA only" ablation).
        hra: entropy ranks (False: uniform ``r0``, the "LSS only" ablation).
        similarity: ``"rmi"`` (the paper) or ``"cosine"`` (cosine of ``vec G``; an ablation).
        sharing: ``"lora"`` (E²LoRA: A and B shared per interval) or ``"sharelora"`` (E²ShareLoRA).
        depth_regex: regex whose group 1 is the layer index inside a module name (default: the first purely
            numeric name component); modules equal up to that index form a type. ``None``: every module is
            its own type (no sharing; plain LoRA of rank ``r0``).
        dropout: dropout on the adapter input, in [0, 1).
        seed: seeds the Kaiming-uniform initialisation of ``A`` (``None``: the global torch RNG).
    """

    base_rank: int = 8
    alpha: float = 16.0
    target: tuple[str, ...] = ("query", "value")
    threshold: str | float = "adaptive"
    hra_score: str = "paper"
    rounding: str = "round"
    granularity: str = "type"
    n_calib_batches: int = 1
    lss: bool = True
    hra: bool = True
    similarity: str = "rmi"
    sharing: str = "lora"
    depth_regex: str | None = DEFAULT_DEPTH_REGEX
    dropout: float = 0.0
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not _pos_int(self.base_rank):
            raise ValueError(f"E2LoRAConfig.base_rank must be an int >= 1, got {self.base_rank!r}")
        if not _number(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"E2LoRAConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError("E2LoRAConfig.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        t = self.threshold
        if isinstance(t, str):
            if t not in THRESHOLDS:
                raise ValueError(f"E2LoRAConfig.threshold must be 'adaptive' or a float in [0, 1], got {t!r}")
        elif not _number(t) or not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"E2LoRAConfig.threshold must be 'adaptive' or a float in [0, 1], got {t!r}")
        else:
            object.__setattr__(self, "threshold", float(t))
        for fname, allowed in (("hra_score", HRA_SCORES), ("rounding", ROUNDINGS), ("granularity", GRANULARITIES),
                               ("similarity", SIMILARITIES), ("sharing", SHARINGS)):
            if getattr(self, fname) not in allowed:
                raise ValueError(f"E2LoRAConfig.{fname} must be one of {allowed}, got {getattr(self, fname)!r}")
        if not _pos_int(self.n_calib_batches):
            raise ValueError(f"E2LoRAConfig.n_calib_batches must be an int >= 1, got {self.n_calib_batches!r}")
        for fname in ("lss", "hra"):
            if not isinstance(getattr(self, fname), bool):
                raise ValueError(f"E2LoRAConfig.{fname} must be a bool, got {getattr(self, fname)!r}")
        if self.depth_regex is not None:
            if not isinstance(self.depth_regex, str):
                raise ValueError(f"E2LoRAConfig.depth_regex must be a regex string or None, got {self.depth_regex!r}")
            try:
                rx = re.compile(self.depth_regex)
            except re.error as e:
                raise ValueError(f"E2LoRAConfig.depth_regex {self.depth_regex!r} is not a valid regex: {e}") from None
            if rx.groups < 1:
                raise ValueError(f"E2LoRAConfig.depth_regex {self.depth_regex!r} needs a group capturing the "
                                 "layer index")
        if not _number(self.dropout) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"E2LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"E2LoRAConfig.seed must be an int or None, got {self.seed!r}")


# ------------------------------------------------------------------------------------------------
# the math (no model needed)
# ------------------------------------------------------------------------------------------------

def entropy_from_std(sigma: float) -> float:
    """``H = log sigma + 1/2 log(2 pi) + 1/2`` (step 2); ``sigma = 0`` gives ``-inf``."""
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}")
    return -math.inf if sigma == 0 else math.log(sigma) + _HALF_LOG_2PI_E


def _moments(G: torch.Tensor) -> tuple[int, float, float]:
    """``(n, mean, population variance)`` of the elements of ``G`` in float64."""
    g = G.detach().reshape(-1).to(torch.float64)
    if g.numel() == 0:
        raise ValueError("a gradient with no elements has no entropy")
    mean = g.mean()
    return g.numel(), float(mean), float((g - mean).square().mean())


def proxy_entropy(G: torch.Tensor) -> float:
    """Proxy entropy ``H(G) = log sigma + 1/2 log(2 pi) + 1/2`` of the elements of ``G`` (any shape; step 2)."""
    _, _, var = _moments(G)
    return entropy_from_std(math.sqrt(var))


def _joint_var(a: tuple[int, float, float], b: tuple[int, float, float]) -> float:
    """Population variance of the concatenation of two samples with moments ``a``, ``b`` (parallel formula)."""
    (na, ma, va), (nb, mb, vb) = a, b
    n = na + nb
    return (na * va + nb * vb) / n + na * nb * (ma - mb) ** 2 / (n * n)


def similarity_matrix(grads: Sequence[torch.Tensor], kind: str = "rmi") -> tuple[list[float], torch.Tensor]:
    """Entropies ``H_l`` and the ``N x N`` similarity matrix of the gradients ``grads`` (steps 2-3).

    ``kind="rmi"``: ``RMI_ij = (H_i + H_j - H(G_i, G_j)) / min(H_i, H_j)`` with the joint entropy of the
    concatenation ``[vec G_i ; vec G_j]`` (float64; symmetric; ``RMI_ii = 1`` up to rounding).
    ``kind="cosine"``: cosine similarity of ``vec G_i`` and ``vec G_j`` (same sizes required).
    Returns ``(H (N,), S (N, N) float64)``.
    """
    if kind not in SIMILARITIES:
        raise ValueError(f"similarity kind must be one of {SIMILARITIES}, got {kind!r}")
    if not grads:
        raise ValueError("similarity_matrix needs at least one gradient")
    mom = [_moments(g) for g in grads]
    H = [entropy_from_std(math.sqrt(v)) for _, _, v in mom]
    N = len(grads)
    S = torch.eye(N, dtype=torch.float64)
    if kind == "cosine":
        flat = [g.detach().reshape(-1).to(torch.float64) for g in grads]
        if len({f.numel() for f in flat}) != 1:
            raise ValueError("cosine similarity needs gradients of one size")
        X = torch.stack(flat)
        nrm = X.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        return H, (X @ X.T) / (nrm[:, None] * nrm[None, :])
    for i in range(N):
        for j in range(N):
            hij = entropy_from_std(math.sqrt(_joint_var(mom[i], mom[j])))
            S[i, j] = (H[i] + H[j] - hij) / min(H[i], H[j])
    return H, S


def adaptive_thresholds(S: torch.Tensor) -> list[float | None]:
    """``tau_m = 1/(N-1) sum_{k != m} S_mk`` (step 4); ``[None]`` for ``N = 1``."""
    N = S.shape[0]
    if S.ndim != 2 or S.shape[1] != N:
        raise ValueError(f"the similarity matrix must be square, got shape {tuple(S.shape)}")
    if N == 1:
        return [None]
    S = S.to(torch.float64)
    off = S.sum(1) - S.diagonal()
    return [float(v) / (N - 1) for v in off]


def partition(S: torch.Tensor, thresholds: Sequence[float | None]) -> list[list[int]]:
    """Greedy Local-Similarity Sharing (step 5): contiguous intervals covering ``0..N-1``.

    An interval starts at the first unassigned layer ``s`` and takes the next layer ``j`` while
    ``S[s, j] >= thresholds[s]`` (comparison with the interval's START layer and its threshold).
    """
    N = S.shape[0]
    if len(thresholds) != N:
        raise ValueError(f"need one threshold per layer ({N}), got {len(thresholds)}")
    out: list[list[int]] = []
    s = 0
    while s < N:
        cur = [s]
        j = s + 1
        while j < N and thresholds[s] is not None and float(S[s, j]) >= float(thresholds[s]):
            cur.append(j)
            j += 1
        out.append(cur)
        s = j
    return out


def allocate_ranks(H: Sequence[float], intervals: Sequence[Sequence[int]], base_rank: int, *,
                   score: str = "paper", rounding: str = "round", max_rank: int | None = None,
                   where: str = "") -> tuple[list[int], list[float], list[float]]:
    """Heterogeneous Rank Allocation (step 6): ``(ranks r_k, interval entropies H_k, factors F_k)``.

    ``H_k = max_{l in I_k} H_l``; ``score="paper"``: ``F_k = H_k / sum_i H_i``; ``"shifted"``: scores
    ``H_k - min_i H_i + 1`` normalised. Budget ``T = K * base_rank``; ``rounding="round"``:
    ``r_k = round(F_k T)``; ``"largest_remainder"``: floors plus one for the largest remainders (ties to the
    earlier interval), so ``sum r_k = T`` exactly. Ranks below 1 become 1 (a warning; with
    ``largest_remainder`` the unit is taken from the largest rank so the sum stays ``T``); ranks above
    ``max_rank`` are capped (a warning).
    """
    if score not in HRA_SCORES:
        raise ValueError(f"score must be one of {HRA_SCORES}, got {score!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if not _pos_int(base_rank):
        raise ValueError(f"base_rank must be an int >= 1, got {base_rank!r}")
    K = len(intervals)
    Hk = [max(float(H[i]) for i in iv) for iv in intervals]
    if not all(math.isfinite(h) for h in Hk):
        raise NumericalError(f"{where}non-finite interval entropy {Hk}; a gradient is zero or not finite")
    if score == "paper":
        scores = Hk
    else:
        lo = min(Hk)
        scores = [h - lo + 1.0 for h in Hk]
    total = sum(scores)
    if total == 0 or not math.isfinite(total):
        raise NumericalError(f"{where}the HRA scores {scores} sum to {total}; cannot form allocation factors")
    F = [s / total for s in scores]
    if any(f < 0 for f in F):
        raise NumericalError(f"{where}negative allocation factors {F} (entropies of mixed sign)")
    T = K * base_rank
    quota = [f * T for f in F]
    if rounding == "round":
        ranks = [int(round(q)) for q in quota]
    else:
        ranks = [int(math.floor(q)) for q in quota]
        rest = T - sum(ranks)
        order = sorted(range(K), key=lambda k: (-(quota[k] - ranks[k]), k))
        for k in order[:rest]:
            ranks[k] += 1
    low = [k for k, r in enumerate(ranks) if r < 1]
    if low:
        warnings.warn(f"{where}HRA gave rank 0 to interval(s) {low} (base_rank={base_rank}); clamped to 1",
                      stacklevel=2)
        for k in low:
            ranks[k] = 1
            if rounding == "largest_remainder":
                big = max(range(K), key=lambda i: (ranks[i], -i))
                ranks[big] -= 1
    if max_rank is not None and any(r > max_rank for r in ranks):
        warnings.warn(f"{where}HRA ranks {ranks} exceed min(d_in, d_out) = {max_rank}; capped", stacklevel=2)
        ranks = [min(r, max_rank) for r in ranks]
    return ranks, Hk, F


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------

@dataclass
class TypePlan:
    """The plan of one module type: its layers (by depth), the statistics and the partition.

    ``layers`` are module names ordered by depth; ``intervals`` hold positions into ``layers``;
    ``ranks[k]`` is the rank of interval ``k``; ``shape = (d_out, d_in)``. ``entropies``, ``similarity``,
    ``thresholds`` are None for a plan made without calibration (:func:`uniform_plan`).
    """

    key: str
    layers: list[str]
    shape: tuple[int, int]
    intervals: list[list[int]]
    ranks: list[int]
    entropies: list[float] | None = None
    similarity: list[list[float]] | None = None
    thresholds: list[float | None] | None = None
    interval_entropies: list[float] | None = None
    factors: list[float] | None = None

    def rank_of(self, pos: int) -> int:
        return self.ranks[self.interval_of(pos)]

    def interval_of(self, pos: int) -> int:
        for k, iv in enumerate(self.intervals):
            if pos in iv:
                return k
        raise KeyError(pos)

    def num_parameters(self, sharing: str = "lora") -> int:
        d_out, d_in = self.shape
        if sharing == "lora":
            return sum(r * (d_in + d_out) for r in self.ranks)
        return max(self.ranks) * d_in + sum(self.rank_of(p) * d_out for p in range(len(self.layers)))

    def validate(self) -> None:
        N = len(self.layers)
        flat = [i for iv in self.intervals for i in iv]
        if N == 0 or flat != list(range(N)) or any(not iv for iv in self.intervals):
            raise ValueError(f"type {self.key!r}: intervals {self.intervals} must be contiguous, disjoint and cover "
                             f"0..{N - 1}")
        if len(self.ranks) != len(self.intervals) or not all(_pos_int(r) for r in self.ranks):
            raise ValueError(f"type {self.key!r}: need one rank >= 1 per interval, got {self.ranks}")
        if len(self.shape) != 2 or not all(_pos_int(s) for s in self.shape):
            raise ValueError(f"type {self.key!r}: bad shape {self.shape}")


@dataclass
class E2LoRAPlan:
    """The one-shot E²LoRA plan of a model: one :class:`TypePlan` per module type (model order).

    ``sharing`` says how factors are shared (``"lora"``/``"sharelora"``); ``settings`` records the
    config fields that shaped the plan. :meth:`save` / :meth:`load` write / read it as JSON.
    """

    types: dict[str, TypePlan]
    sharing: str = "lora"
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def intervals(self) -> dict[str, list[list[int]]]:
        return {k: t.intervals for k, t in self.types.items()}

    @property
    def ranks(self) -> dict[str, list[int]]:
        return {k: t.ranks for k, t in self.types.items()}

    def num_parameters(self) -> int:
        """Trainable adapter parameters: ``sum_types sum_k r_k (d_in + d_out)`` for ``sharing="lora"``."""
        return sum(t.num_parameters(self.sharing) for t in self.types.values())

    def layer_names(self) -> list[str]:
        return [n for t in self.types.values() for n in t.layers]

    def validate(self) -> None:
        if self.sharing not in SHARINGS:
            raise ValueError(f"plan sharing must be one of {SHARINGS}, got {self.sharing!r}")
        if not self.types:
            raise ValueError("the plan holds no module type")
        seen: set[str] = set()
        for t in self.types.values():
            t.validate()
            dup = seen.intersection(t.layers)
            if dup:
                raise ValueError(f"layers {sorted(dup)[:3]} appear in more than one type")
            seen.update(t.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"sharing": self.sharing, "settings": dict(self.settings),
                "types": [{"key": t.key, "layers": list(t.layers), "shape": list(t.shape),
                           "intervals": [list(iv) for iv in t.intervals], "ranks": list(t.ranks),
                           "entropies": t.entropies, "similarity": t.similarity, "thresholds": t.thresholds,
                           "interval_entropies": t.interval_entropies, "factors": t.factors}
                          for t in self.types.values()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "E2LoRAPlan":
        try:
            types = {}
            for t in d["types"]:
                tp = TypePlan(key=str(t["key"]), layers=[str(n) for n in t["layers"]],
                              shape=(int(t["shape"][0]), int(t["shape"][1])),
                              intervals=[[int(i) for i in iv] for iv in t["intervals"]],
                              ranks=[int(r) for r in t["ranks"]], entropies=t.get("entropies"),
                              similarity=t.get("similarity"), thresholds=t.get("thresholds"),
                              interval_entropies=t.get("interval_entropies"), factors=t.get("factors"))
                types[tp.key] = tp
            plan = cls(types=types, sharing=str(d.get("sharing", "lora")), settings=dict(d.get("settings") or {}))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ArtifactError(f"malformed E²LoRA plan: {e!r}") from None
        try:
            plan.validate()
        except ValueError as e:
            raise ArtifactError(f"invalid E²LoRA plan: {e}") from None
        return plan

    def save(self, path: str | Path) -> Path:
        return io.write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "E2LoRAPlan":
        return cls.from_dict(io.read_json(Path(path)))


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Factor(nn.Module):
    """One factor matrix (``weight``), possibly held by several layers' adapters (shared)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class E2LoRALinear(AdapterLayer):
    """A Linear layer with named E²LoRA adapters: ``y = base(x) + sum_active s B A[:r] dropout(x)``.

    Per adapter ``name``: ``e2lora_A[name].weight (r_A, in)`` with ``r_A >= r`` (shared within an interval,
    or across the type for ``sharelora``), ``e2lora_B[name].weight (out, r)``, rank ``r`` and scale
    ``s = alpha / r``. Shapes: ``x (..., in_features) -> y (..., out_features)``.
    """

    adapter_store = "e2lora_B"
    adapter_fields = ("e2lora_A", "e2lora_B", "e2lora_dropout", "rank", "scaling", "adapter_config", "plans")
    adapter_label = "E²LoRA adapter"
    family = "E²LoRA"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"E2LoRALinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.e2lora_A = nn.ModuleDict()
        self.e2lora_B = nn.ModuleDict()
        self.e2lora_dropout = nn.ModuleDict()
        self.rank: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self.plans: dict[str, E2LoRAPlan] = {}
        self.train(base_layer.training)

    def add_adapter(self, name: str, A: _Factor, B: _Factor, rank: int, scaling: float, *, dropout: float = 0.0,
                    config: Mapping[str, Any] | None = None, plan: E2LoRAPlan | None = None) -> None:
        """Install adapter ``name`` from (possibly shared) factor modules ``A`` (``>= rank`` rows) and ``B``."""
        validate_adapter_name(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge before replacing it")
        a, b = A.weight, B.weight
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != self.in_features or b.shape[0] != self.out_features \
                or b.shape[1] != rank or a.shape[0] < rank:
            raise ValueError(f"{self._where()}: factors A {tuple(a.shape)}, B {tuple(b.shape)} do not fit rank {rank}, "
                             f"in_features={self.in_features}, out_features={self.out_features}")
        self.e2lora_A[name] = A
        self.e2lora_B[name] = B
        self.e2lora_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank[name] = int(rank)
        self.scaling[name] = float(scaling)
        cfg = dict(config or {})
        cfg.update({"r": int(rank), "scaling": float(scaling), "dropout": float(dropout)})
        self.adapter_config[name] = cfg
        if plan is not None:
            self.plans[name] = plan

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A[:r] (r, in), B (out, r))`` of adapter ``name``."""
        self._require(name)
        r = self.rank[name]
        return self.e2lora_A[name].weight[:r], self.e2lora_B[name].weight

    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s B A[:r]``, shape ``(out, in)``, in ``dtype`` (default: float32 or the factors' wider dtype)."""
        A, B = self.factors(name)
        dt = dtype or torch.promote_types(A.dtype, torch.float32)
        with torch.no_grad():
            return (B.to(dt) @ A.to(dt)) * self.scaling[name]

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(self.e2lora_A[name].weight, True), (self.e2lora_B[name].weight, True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            A, B = self.factors(name)
            h = self.e2lora_dropout[name](x.to(A.dtype)) @ A.T
            result = result + ((h @ B.T) * self.scaling[name]).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, ranks={self.rank}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")


# ------------------------------------------------------------------------------------------------
# model-level helpers
# ------------------------------------------------------------------------------------------------

def e2lora_layers(model: nn.Module) -> list[tuple[str, E2LoRALinear]]:
    """``(qualified name, E2LoRALinear)`` of every E²LoRA layer of ``model``, in model order."""
    return adapters.adapted_layers(model, E2LoRALinear)


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the E²LoRA adapters the model holds (first-seen order)."""
    return adapters.adapter_names(model, E2LoRALinear)


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    return adapters.all_or_nothing(model, E2LoRALinear)


def _sync_trainable(model: nn.Module, freeze_base: bool) -> None:
    """Active adapters' factors trainable (a shared factor if any of its layers' adapters is active), the others frozen;
    every other parameter frozen if ``freeze_base``."""
    adapters.sync_trainable(model, E2LoRALinear, freeze_base)


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, E2LoRALinear) else mod  # type: ignore[return-value]


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    conv_or_embedding = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
    return adapters.target_layers(model, target, E2LoRALinear,
                                  rejects=lambda m: isinstance(m, conv_or_embedding) or type(m).__name__ == "Conv1D")


def group_layers(names: Sequence[str], depth_regex: str | None = DEFAULT_DEPTH_REGEX
                 ) -> dict[str, list[tuple[int, str]]]:
    """Group module names into types: ``{type key: [(depth, name), ...] sorted by depth}``.

    The layer index is group 1 of the first match of ``depth_regex``; the type key is the name with that
    index replaced by ``*``. A name without a match (or ``depth_regex=None``) is a type of its own.
    """
    rx = re.compile(depth_regex) if depth_regex is not None else None
    groups: dict[str, list[tuple[int, str]]] = {}
    for n in names:
        m = rx.search(n) if rx is not None else None
        if m is None:
            groups.setdefault(n, []).append((0, n))
        else:
            key = n[:m.start(1)] + "*" + n[m.end(1):]
            groups.setdefault(key, []).append((int(m.group(1)), n))
    return {k: sorted(v) for k, v in groups.items()}


def _types_of(hits: Sequence[tuple[str, nn.Module]], config: E2LoRAConfig
              ) -> dict[str, tuple[list[str], tuple[int, int]]]:
    """``{type key: (layer names by depth, (d_out, d_in))}``; different shapes inside one type raise ValueError."""
    mods = dict(hits)
    out = {}
    for key, members in group_layers([n for n, _ in hits], config.depth_regex).items():
        names = [n for _, n in members]
        shapes = {n: (_base_of(mods[n]).out_features, _base_of(mods[n]).in_features) for n in names}
        if len(set(shapes.values())) != 1:
            shown = ", ".join(f"{n} {s[0]}x{s[1]}" for n, s in list(shapes.items())[:6])
            raise ValueError(f"E²LoRA cannot share factors across layers of different shapes: type {key!r} holds "
                             f"{shown}. Narrow the target, or set depth_regex=None (no sharing across modules)")
        d_out, d_in = next(iter(shapes.values()))
        if config.base_rank > min(d_in, d_out):
            raise ValueError(f"E²LoRA base_rank={config.base_rank} exceeds min(in_features={d_in}, "
                             f"out_features={d_out}) = {min(d_in, d_out)} of type {key!r}; choose base_rank in "
                             f"[1, {min(d_in, d_out)}]")
        out[key] = (names, (d_out, d_in))
    if config.granularity == "block":
        groups = group_layers([n for n, _ in hits], config.depth_regex)
        depth_sets = {k: tuple(d for d, _ in v) for k, v in groups.items()}
        if len(set(depth_sets.values())) != 1:
            raise ValueError(f"granularity='block' needs every module type at the same depths, got {depth_sets}")
    return out


# ------------------------------------------------------------------------------------------------
# calibration and planning
# ------------------------------------------------------------------------------------------------

def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch, ``model(*batch).loss`` for a tuple; otherwise pass ``loss_fn``."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError("the model's output has no .loss; pass loss_fn=lambda model, batch: <scalar loss>")
    return loss


def collect_gradients(model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Iterable[Any] | None,
                      loss_fn: LossFn | None = None, n_batches: int = 1) -> dict[str, torch.Tensor]:
    """Gradients ``G_l = dL/dW_l`` of the base weights of ``layers``, averaged over the first ``n_batches`` batches.

    Returns ``{name: G (d_out, d_in) float64}`` (step 1). Runs in eval mode (deterministic), with every
    E²LoRA adapter switched off (the plan belongs to the pretrained model) and only the targeted weights
    requiring gradients; modes, flags and ``.grad`` fields are restored afterwards. An empty loader
    (ValueError), a non-finite loss or gradient (NumericalError) and an all-zero gradient (ValueError,
    e.g. a frozen head or a detached graph) are reported naming the layer.
    """
    loss_fn = default_loss if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    if batches is None:
        raise ValueError("E²LoRA needs calibration batches (calib=...) to compute the gradient proxy entropies, "
                         "or a precomputed plan=")
    if not _pos_int(n_batches):
        raise ValueError(f"n_batches must be an int >= 1, got {n_batches!r}")
    weights = {n: _base_of(m).weight for n, m in layers}
    flags = {id(p): (p, p.requires_grad) for p in model.parameters()}
    grads_before = {n: w.grad for n, w in weights.items()}
    modes = {m: m.training for m in model.modules()}
    states = [(layer, layer.disabled) for _, layer in e2lora_layers(model)]
    acc = {n: torch.zeros(w.shape, dtype=torch.float64, device=w.device) for n, w in weights.items()}
    count = 0
    try:
        for p, _ in flags.values():
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
            w.grad = None
        for layer, _ in states:
            layer.disabled = True
        model.eval()
        for i, batch in enumerate(batches):
            if i >= n_batches:
                break
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}")
            if not bool(torch.isfinite(loss)):
                raise NumericalError(f"calibration loss is {float(loss.detach())} on batch {i}; the entropies are "
                                     "undefined")
            if not loss.requires_grad:
                raise ValueError("the calibration loss does not depend on the targeted weights (a detached graph or "
                                 "no_grad); E²LoRA needs dL/dW of every targeted layer")
            loss.backward()
            for n, w in weights.items():
                if w.grad is not None:
                    acc[n] += w.grad.to(torch.float64)
                    w.grad = None
            count += 1
    finally:
        for p, flag in flags.values():
            p.requires_grad_(flag)
        for n, w in weights.items():
            w.grad = grads_before[n]
        for layer, disabled in states:
            layer.disabled = disabled
        for m, mode in modes.items():
            m.training = mode
    if count == 0:
        raise ValueError("the calibration loader yielded no batch; E²LoRA needs at least one to compute G")
    out = {}
    for n, g in acc.items():
        g = g / count
        if not bool(torch.isfinite(g).all()):
            raise NumericalError(f"layer {n!r}: the calibration gradient holds NaN or inf")
        if float(g.abs().max()) == 0.0:
            raise ValueError(f"layer {n!r}: the calibration gradient is exactly zero (sigma = 0, H = -inf): the loss "
                             "does not depend on this layer (frozen or missing task head, detached graph?)")
        out[n] = g
    return out


def _type_plan(key: str, names: list[str], shape: tuple[int, int], grads: Sequence[torch.Tensor],
               config: E2LoRAConfig) -> TypePlan:
    """Steps 2-6 for one module type (or, for ``granularity="block"``, for the concatenated blocks)."""
    where = f"type {key!r}: "
    H, S = similarity_matrix(grads, config.similarity)
    N = len(names)
    if N >= 2 and not all(h < 0 for h in H):
        bad = [names[i] for i, h in enumerate(H) if h >= 0]
        raise NumericalError(
            f"{where}proxy entropies {[round(h, 3) for h in H]} are not all negative (element std >= "
            f"{SIGMA_SIGN_CHANGE:.3f} in {bad[:3]}): RMI is then no similarity and the HRA factors change sign. "
            "Scale the calibration loss down (e.g. by 1e-3); every entropy shifts by the same log factor")
    if not bool(torch.isfinite(S).all()):
        raise NumericalError(f"{where}the similarity matrix holds non-finite values")
    if config.threshold == "adaptive":
        tau = adaptive_thresholds(S)
    else:
        tau = [float(config.threshold)] * N if N > 1 else [None]
    intervals = partition(S, tau) if config.lss else [[i] for i in range(N)]
    if config.hra:
        ranks, Hk, F = allocate_ranks(H, intervals, config.base_rank, score=config.hra_score,
                                      rounding=config.rounding, max_rank=min(shape), where=where)
    else:
        ranks, Hk, F = [config.base_rank] * len(intervals), None, None
    return TypePlan(key=key, layers=list(names), shape=shape, intervals=intervals, ranks=ranks, entropies=list(H),
                    similarity=S.tolist(), thresholds=tau, interval_entropies=Hk, factors=F)


def _settings(config: E2LoRAConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("base_rank", "alpha", "threshold", "hra_score", "rounding", "granularity",
                                            "n_calib_batches", "lss", "hra", "similarity", "sharing")}


def plan_e2lora(model: nn.Module, calib: Iterable[Any] | None, loss_fn: LossFn | None = None,
                config: E2LoRAConfig | None = None, target: Selector = None, *,
                gradients: Mapping[str, torch.Tensor] | None = None) -> E2LoRAPlan:
    """The one-shot plan (steps 1-6): entropies, similarity matrix, thresholds, intervals and ranks per type.

    ``calib`` (an iterable of batches) and ``loss_fn(model, batch) -> scalar`` give the calibration
    gradients (or pass ``gradients={layer name: G (d_out, d_in)}``). The model is not modified.
    """
    config = E2LoRAConfig() if config is None else config
    if not isinstance(config, E2LoRAConfig):
        raise TypeError(f"config must be an E2LoRAConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    hits = _target_layers(model, config.target if target is None else target)
    types = _types_of(hits, config)
    if gradients is not None:
        grads = {}
        mods = dict(hits)
        for n, _ in hits:
            g = gradients.get(n)
            base = _base_of(mods[n])
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != (base.out_features, base.in_features):
                raise ValueError(f"gradients[{n!r}] must be a tensor of shape "
                                 f"({base.out_features}, {base.in_features})")
            g = g.detach().to(torch.float64)
            if not bool(torch.isfinite(g).all()):
                raise NumericalError(f"layer {n!r}: the gradient holds NaN or inf")
            if float(g.abs().max()) == 0.0:
                raise ValueError(f"layer {n!r}: the gradient is exactly zero (sigma = 0, H = -inf)")
            grads[n] = g
    else:
        grads = collect_gradients(model, hits, calib, loss_fn, config.n_calib_batches)
    out: dict[str, TypePlan] = {}
    if config.granularity == "type":
        for key, (names, shape) in types.items():
            out[key] = _type_plan(key, names, shape, [grads[n] for n in names], config)
    else:
        N = len(next(iter(types.values()))[0])
        blocks = [torch.cat([grads[names[d]].reshape(-1) for names, _ in types.values()]) for d in range(N)]
        smallest = min((shape for _, shape in types.values()), key=min)
        shared = _type_plan("block", [f"block{d}" for d in range(N)], smallest, blocks, config)
        for key, (names, shape) in types.items():
            ranks = [min(r, min(shape)) for r in shared.ranks]
            out[key] = TypePlan(key=key, layers=list(names), shape=shape, intervals=shared.intervals, ranks=ranks,
                                entropies=shared.entropies, similarity=shared.similarity,
                                thresholds=shared.thresholds, interval_entropies=shared.interval_entropies,
                                factors=shared.factors)
    return E2LoRAPlan(types=out, sharing=config.sharing, settings=_settings(config))


def uniform_plan(model: nn.Module, config: E2LoRAConfig | None = None, target: Selector = None, *,
                 intervals: str | int = "each", rank: int | None = None) -> E2LoRAPlan:
    """A plan without calibration: ``intervals="each"`` (one per layer), ``"all"`` (one per type) or an int
    block size (fixed-size blocks), every interval at ``rank`` (default ``config.base_rank``).

    With ``sharing="lora"`` and ``"each"`` this is plain LoRA; ``"all"`` is naive all-layer sharing; with
    ``sharing="sharelora"`` and ``"each"`` it is ShareLoRA (one ``A`` per type, per-layer ``B``).
    """
    config = E2LoRAConfig() if config is None else config
    rank = config.base_rank if rank is None else rank
    if not _pos_int(rank):
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    if not (intervals in ("each", "all") or _pos_int(intervals)):
        raise ValueError(f"intervals must be 'each', 'all' or a block size >= 1, got {intervals!r}")
    hits = _target_layers(model, config.target if target is None else target)
    out = {}
    for key, (names, shape) in _types_of(hits, config).items():
        if rank > min(shape):
            raise ValueError(f"rank {rank} exceeds min(d_in, d_out) = {min(shape)} of type {key!r}")
        N = len(names)
        size = 1 if intervals == "each" else N if intervals == "all" else int(intervals)
        ivs = [list(range(s, min(N, s + size))) for s in range(0, N, size)]
        out[key] = TypePlan(key=key, layers=list(names), shape=shape, intervals=ivs, ranks=[rank] * len(ivs))
    return E2LoRAPlan(types=out, sharing=config.sharing, settings=dict(_settings(config), uniform=str(intervals)))


# ------------------------------------------------------------------------------------------------
# installing a plan
# ------------------------------------------------------------------------------------------------

def _kaiming(rows: int, cols: int, gen: torch.Generator | None, dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
    A = torch.empty(rows, cols, dtype=torch.float32)
    nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=gen)
    return A.to(dtype=dtype, device=device)


def _build_factors(plan: E2LoRAPlan, mods: Mapping[str, nn.Module], gen: torch.Generator | None
                   ) -> list[tuple[str, _Factor, _Factor, int, dict[str, Any]]]:
    """``(layer name, A factor, B factor, rank, per-layer config)`` for every layer of the plan (shared objects)."""
    out = []
    for key, t in plan.types.items():
        w = _base_of(mods[t.layers[0]]).weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        d_out, d_in = t.shape
        if plan.sharing == "lora":
            for k, iv in enumerate(t.intervals):
                A = _Factor(_kaiming(t.ranks[k], d_in, gen, dtype, w.device))
                B = _Factor(torch.zeros(d_out, t.ranks[k], dtype=dtype, device=w.device))
                for pos in iv:
                    out.append((t.layers[pos], A, B, t.ranks[k], {"type": key, "position": pos, "interval": k}))
        else:
            A = _Factor(_kaiming(max(t.ranks), d_in, gen, dtype, w.device))
            for pos, lname in enumerate(t.layers):
                k = t.interval_of(pos)
                B = _Factor(torch.zeros(d_out, t.ranks[k], dtype=dtype, device=w.device))
                out.append((lname, A, B, t.ranks[k], {"type": key, "position": pos, "interval": k}))
    return out


def _check_plan_fits(model: nn.Module, plan: E2LoRAPlan, name: str) -> dict[str, nn.Module]:
    plan.validate()
    mods: dict[str, nn.Module] = {}
    for t in plan.types.values():
        for lname in t.layers:
            try:
                mod = model.get_submodule(lname)
            except AttributeError:
                raise ValueError(f"the plan's layer {lname!r} does not exist in the model") from None
            base = _base_of(mod)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"the plan's layer {lname!r} is a {type(mod).__name__}, not a Linear layer")
            if (base.out_features, base.in_features) != tuple(t.shape):
                raise ValueError(f"the plan's layer {lname!r} is {base.out_features}x{base.in_features}, the plan "
                                 f"says {t.shape[0]}x{t.shape[1]}")
            if max(t.ranks) > min(t.shape):
                raise ValueError(f"the plan's rank {max(t.ranks)} exceeds min(d_in, d_out) = {min(t.shape)} of "
                                 f"type {t.key!r}")
            if isinstance(mod, E2LoRALinear) and name in mod.adapters:
                raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name or "
                                 "delete it first")
            mods[lname] = mod
    return mods


def apply_e2lora(model: nn.Module, plan: E2LoRAPlan, config: E2LoRAConfig | None = None,
                 name: str = "default") -> nn.Module:
    """Install ``plan`` as adapter ``name`` (step 7): shared pairs per interval, ``A`` Kaiming-uniform, ``B = 0``.

    The new adapter becomes the active (and only trainable) one; every other parameter is frozen
    (unfreeze a task head yourself). On any error the model is unchanged.
    """
    config = E2LoRAConfig() if config is None else config
    if not isinstance(plan, E2LoRAPlan):
        raise TypeError(f"plan must be an E2LoRAPlan, got {type(plan).__name__}")
    if not isinstance(config, E2LoRAConfig):
        raise TypeError(f"config must be an E2LoRAConfig, got {type(config).__name__}")
    validate_adapter_name(name)
    merged = [n for n, layer in e2lora_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}; unmerge before adding an adapter")
    mods = _check_plan_fits(model, plan, name)
    gen = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    built = _build_factors(plan, mods, gen)
    _install(model, plan, built, mods, name, config.alpha, config.dropout)
    return model


def _install(model: nn.Module, plan: E2LoRAPlan, built: Sequence[tuple[str, _Factor, _Factor, int, dict[str, Any]]],
             mods: Mapping[str, nn.Module], name: str, alpha: float, dropout: float) -> None:
    with _all_or_nothing(model):
        for lname, A, B, r, cfg in built:
            mod = mods[lname]
            layer = mod if isinstance(mod, E2LoRALinear) else E2LoRALinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.add_adapter(name, A, B, r, alpha / r, dropout=dropout,
                              config=dict(cfg, method="e2lora", alpha=alpha), plan=plan)
            layer.set_active(name)
        for _, layer in e2lora_layers(model):
            if name not in layer.adapters:
                layer.active_adapters = []
        _sync_trainable(model, freeze_base=True)


def adapt(model: nn.Module, config: E2LoRAConfig | None = None, target: Selector = None, name: str = "default", *,
          calib: Iterable[Any] | None = None, loss_fn: LossFn | None = None, plan: E2LoRAPlan | None = None,
          gradients: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Add E²LoRA adapter ``name`` to the Linear layers ``target`` selects (default ``config.target``); in place.

    The plan comes from ``plan`` if given, else from calibration: ``calib`` (batches) with ``loss_fn(model,
    batch) -> scalar loss`` (default: the output's ``.loss``), or precomputed ``gradients``. Include a freshly
    initialised task head in the loss, as for normal fine-tuning. Everything is computed and checked before the
    model changes; on any error the model is unchanged. Returns the model.
    """
    config = E2LoRAConfig() if config is None else config
    if not isinstance(config, E2LoRAConfig):
        raise TypeError(f"adapt: config must be an E2LoRAConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
    validate_adapter_name(name)
    merged = [n for n, layer in e2lora_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}; unmerge before adding an adapter")
    if plan is None:
        hits = _target_layers(model, config.target if target is None else target)
        _types_of(hits, config)  # shapes and ranks checked before any gradient is computed
        for lname, mod in hits:
            if isinstance(mod, E2LoRALinear) and name in mod.adapters:
                raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                                 "or delete it first")
        plan = plan_e2lora(model, calib, loss_fn, config, target, gradients=gradients)
    return apply_e2lora(model, plan, config, name)


def get_plan(model: nn.Module, name: str = "default") -> E2LoRAPlan:
    """The plan adapter ``name`` was built from."""
    for _, layer in _require_adapter(model, name):
        if name in layer.plans:
            return layer.plans[name]
    raise KeyError(f"adapter {name!r} carries no plan")


def trainable_parameters(model: nn.Module, name: str = "default") -> int:
    """Distinct adapter parameters of adapter ``name`` (shared factors counted once)."""
    seen: dict[int, int] = {}
    for _, layer in _require_adapter(model, name):
        for p, _ in layer.adapter_parameters(name):
            seen[id(p)] = p.numel()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------------
# adapter management
# ------------------------------------------------------------------------------------------------

def _require_adapter(model: nn.Module, name: str) -> list[tuple[str, E2LoRALinear]]:
    return adapters.require_adapter(model, name, E2LoRALinear)


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active (trainable) adapter(s) of every E²LoRA layer; others inactive (frozen)."""
    adapters.set_active(model, names, E2LoRALinear)


def enable_adapters(model: nn.Module) -> None:
    adapters.enable_adapters(model, E2LoRALinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept). Refused while merged."""
    adapters.disable_adapters(model, E2LoRALinear)


def merge(model: nn.Module) -> nn.Module:
    """Merge the active adapters into the base weights (``W_l += s B_k A_k[:r]`` per layer); all-or-nothing."""
    adapters.merge_all(model, E2LoRALinear)
    return model


def unmerge(model: nn.Module) -> nn.Module:
    adapters.unmerge_all(model, E2LoRALinear)
    return model


def delete_adapter(model: nn.Module, name: str) -> None:
    adapters.delete_adapter(model, name, E2LoRALinear)


def unload(model: nn.Module, merge_first: bool = True) -> nn.Module:
    """Replace every E2LoRALinear by its base layer (merging the active adapters first if ``merge_first``)."""
    return adapters.unload(model, E2LoRALinear, merge_first)


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 overwrite: bool | None = None) -> Path:
    """Save adapter ``name`` to ``directory`` atomically (``adapter_model.safetensors`` + ``adapter_config.json``).

    Each distinct (possibly shared) factor is stored once as ``factor.<i>``; the header maps every layer
    to its ``A``/``B`` factor ids, rank and scale, and holds the plan, the base-model fingerprint and
    SHA-256 digests. ``adapter_config.json`` repeats the plan for people.
    """
    layers = _require_adapter(model, name)
    ids: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}

    def fid(f: _Factor) -> str:
        if id(f) not in ids:
            ids[id(f)] = str(len(ids))
            tensors[f"factor.{ids[id(f)]}"] = f.weight.detach()
        return ids[id(f)]

    plan = None
    for lname, layer in layers:
        cfg = dict(layer.adapter_config[name])
        cfg.update({"A": fid(layer.e2lora_A[name]), "B": fid(layer.e2lora_B[name])})
        modules[lname] = cfg
        plan = plan or layer.plans.get(name)
    meta = {"kind": _KIND, "name": name, "modules": modules, "fingerprint": io.model_fingerprint(model),
            "plan": plan.to_dict() if plan is not None else None}
    directory = Path(directory)
    if overwrite is None:
        overwrite = directory.is_dir() and all(p.is_file() and p.name in _OWN_FILES for p in directory.iterdir())
    with io.atomic_dir(directory, overwrite=bool(overwrite)) as tmp:
        io.write_json(tmp / CONFIG_FILE, {"method": "e2lora", "name": name, "modules": modules,
                                          "plan": meta["plan"]})
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return directory


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 check_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` as adapter ``name`` (active, trainable), sharing restored.

    ArtifactError (model unchanged) for a missing, corrupt or truncated file, another artefact kind,
    another base model (fingerprint; skip with ``check_base=False``), or modules that do not fit.
    An existing adapter ``name`` is replaced.
    """
    validate_adapter_name(name)
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    path = directory / WEIGHTS_FILE
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != _KIND:
        raise ArtifactError(f"{path}: not a rankwise E²LoRA adapter (kind={meta.get('kind')!r})")
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ArtifactError(f"{path}: metadata lacks the module table")
    plan = E2LoRAPlan.from_dict(meta["plan"]) if isinstance(meta.get("plan"), dict) else None
    used: set[str] = set()
    for m, cfg in modules.items():
        if not isinstance(cfg, dict) or not _pos_int(cfg.get("r")) or not _number(cfg.get("scaling")) \
                or not isinstance(cfg.get("A"), str) or not isinstance(cfg.get("B"), str) \
                or not _number(cfg.get("dropout", 0.0)) or not 0.0 <= float(cfg.get("dropout", 0.0)) < 1.0:
            raise ArtifactError(f"{path}: bad metadata for module {m!r}")
        used |= {f"factor.{cfg['A']}", f"factor.{cfg['B']}"}
    if used != set(tensors):
        raise ArtifactError(f"{path}: tensors do not match the module table "
                            f"(missing {sorted(used - set(tensors))[:4]}, "
                            f"unexpected {sorted(set(tensors) - used)[:4]})")
    if len({t.dtype for t in tensors.values()}) != 1 or not all(t.ndim == 2 for t in tensors.values()):
        raise ArtifactError(f"{path}: factors must be 2-D tensors of one dtype")
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
    if any(layer.merged_adapters for _, layer in e2lora_layers(model)):
        raise RankwiseError("unmerge the E²LoRA adapters before loading one")
    problems: list[str] = []
    found: dict[str, nn.Module] = {}
    for m, cfg in modules.items():
        try:
            mod = model.get_submodule(m)
        except AttributeError:
            problems.append(f"module {m!r} does not exist in the model")
            continue
        base = _base_of(mod)
        if not isinstance(base, nn.Linear):
            problems.append(f"module {m!r} is a {type(mod).__name__}, not a Linear layer")
            continue
        A, B, r = tensors[f"factor.{cfg['A']}"], tensors[f"factor.{cfg['B']}"], cfg["r"]
        if A.shape[1] != base.in_features or A.shape[0] < r or tuple(B.shape) != (base.out_features, r):
            problems.append(f"module {m!r}: factors A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                            f"({base.out_features}, {base.in_features}) with r={r}")
            continue
        found[m] = mod
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    with _all_or_nothing(model):
        for _, layer in e2lora_layers(model):
            if name in layer.adapters:
                layer.delete_adapter(name)
        dev = {m: _base_of(mod).weight.device for m, mod in found.items()}
        factors: dict[str, _Factor] = {}

        def factor(key: str, device: torch.device) -> _Factor:
            if key not in factors:
                factors[key] = _Factor(tensors[f"factor.{key}"].to(device).clone())
            return factors[key]

        for m, cfg in modules.items():
            mod = model.get_submodule(m)
            layer = mod if isinstance(mod, E2LoRALinear) else E2LoRALinear(mod, layer_name=m)
            if layer is not mod:
                replace_module(model, m, layer)
            extra = {k: v for k, v in cfg.items() if k not in ("A", "B", "r", "scaling", "dropout")}
            layer.add_adapter(name, factor(cfg["A"], dev[m]), factor(cfg["B"], dev[m]), cfg["r"],
                              float(cfg["scaling"]), dropout=float(cfg.get("dropout", 0.0)), config=extra, plan=plan)
            layer.set_active(name)
        for lname, layer in list(e2lora_layers(model)):
            if name not in layer.adapters:
                layer.active_adapters = []
            if not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        _sync_trainable(model, freeze_base=True)
    return model


register("e2lora", config=E2LoRAConfig, entry=adapt)
