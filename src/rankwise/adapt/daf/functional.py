"""DAF's math, no model needed: unit costs, score smoothing, the greedy allocation and the change test."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from rankwise.adapt.daf.config import DAFConfig, FILL, RANK_BY, _number, _pos_int
from rankwise.core.errors import NumericalError


# ------------------------------------------------------------------------------------------------
# the math (no model needed)
# ------------------------------------------------------------------------------------------------

def unit_cost(d_in: int, d_out: int, rank: int) -> int:
    """Trainable parameters of a rank-``rank`` LoRA unit on a ``(d_out, d_in)`` matrix: ``r (d_in + d_out)``."""
    if not (_pos_int(d_in) and _pos_int(d_out) and _pos_int(rank)):
        raise ValueError(f"unit_cost needs positive ints, got d_in={d_in!r}, d_out={d_out!r}, rank={rank!r}")
    return rank * (d_in + d_out)


def smooth(previous: Mapping[str, float] | None, new: Mapping[str, float], ema: float = 0.7) -> dict[str, float]:
    """Step 2: ``S ← ema · S_prev + (1 - ema) · S_new`` per matrix; ``new`` unchanged when there is no history.

    A matrix without a previous score (e.g. added to the candidates later) takes its raw score.
    """
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema must be in [0, 1), got {ema!r}")
    if previous is None:
        return {k: float(v) for k, v in new.items()}
    out = {}
    for k, v in new.items():
        p = previous.get(k)
        out[k] = float(v) if p is None else ema * float(p) + (1.0 - ema) * float(v)
    return out


def allocate(scores: Mapping[str, float], costs: Mapping[str, int], budget: int, *,
             rank_by: str = "score_per_cost", fill: str = "skip") -> list[str]:
    """Step 3: the matrices that receive a unit, greedily by ``S_j / cost_j`` (or ``S_j``) under ``budget``.

    Ties keep the order of ``scores`` (model order). ``fill="skip"`` passes over a unit that does not
    fit, ``"stop"`` ends at the first one (the official rule). Returns the selected names in the order of ``scores``;
    their total cost is ``<= budget`` by construction.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    if fill not in FILL:
        raise ValueError(f"fill must be one of {FILL}, got {fill!r}")
    if set(scores) != set(costs):
        raise ValueError(f"scores and costs must name the same matrices; differ on "
                         f"{sorted(set(scores) ^ set(costs))[:5]}")
    names = list(scores)
    for n in names:
        s = scores[n]
        if not _number(s) or s < 0:
            raise NumericalError(f"sensitivity of {n!r} is {s!r}; scores must be finite and >= 0")
    key = (lambda n: scores[n] / costs[n]) if rank_by == "score_per_cost" else (lambda n: scores[n])
    order = sorted(range(len(names)), key=lambda i: -key(names[i]))  # stable: ties keep model order
    chosen: set[str] = set()
    used = 0
    for i in order:
        n = names[i]
        if used + costs[n] <= budget:
            chosen.add(n)
            used += costs[n]
        elif fill == "stop":
            break
    return [n for n in names if n in chosen]


def change_fraction(old: Iterable[str], new: Iterable[str], candidates: Sequence[str]) -> float:
    """Step 4: changed entries of the selection mask over the candidates, ``|old Δ new| / |candidates|``."""
    if not candidates:
        raise ValueError("change_fraction needs at least one candidate")
    return len(set(old) ^ set(new)) / len(candidates)


def resolve_budget(config: DAFConfig, costs: Mapping[str, int]) -> int:
    """The budget ``P``: ``config.budget_params`` or ``floor(budget_fraction · Σ_j cost_j)``.

    ValueError when ``P`` is smaller than the cheapest unit (nothing could ever be trained), naming its cost.
    """
    if not costs:
        raise ValueError("DAF needs at least one candidate matrix")
    P = config.budget_params if config.budget_params is not None else int(config.budget_fraction * sum(costs.values()))
    cheapest = min(costs, key=lambda n: costs[n])
    if P < costs[cheapest]:
        src = f"budget_params={config.budget_params}" if config.budget_params is not None else \
            f"budget_fraction={config.budget_fraction} of {sum(costs.values())} = {P}"
        raise ValueError(f"DAF budget ({src}) is smaller than one unit: the cheapest unit (rank "
                         f"{config.rank} on {cheapest!r}) costs {costs[cheapest]} parameters; raise the budget "
                         "or lower rank")
    return P
