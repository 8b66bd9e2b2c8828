"""How sure a claim check is: a paired bootstrap interval and the sample size that would decide it.

A claim check that compares two rows on the same evaluation examples (accuracy of the method and of
the baseline on each test example; a per-example loss; a per-game gap) can carry its *paired
samples*: for every seed, the per-example differences ``method - baseline`` (or whatever per-example
quantity the check averages). The check's statistic is the mean over seeds of the per-seed mean of
those samples (what the reproduction's table reports), optionally its absolute value.

:func:`paired_bootstrap` resamples the examples of every seed with replacement and, when there are at
least :data:`MIN_SEEDS_FOR_SEED_BOOTSTRAP` seeds, the seeds too (two-level bootstrap), with a seeded
generator, and returns the percentile interval at level :data:`LEVEL` (95%). The interval *contains the
threshold* when ``lo <= threshold <= hi``: then the data cannot tell the claim from its negation and
the check is ``inconclusive``.

:func:`samples_to_decide` says roughly how many examples per seed (or seeds) would make the interval
exclude the threshold, if the estimate stayed where it is: the half-width shrinks like ``1/sqrt(n)``,
so ``n' = n * (half-width / |estimate - threshold|)^2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

LEVEL = 0.95  # two-sided percentile interval
RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # the interval is a deterministic function of the samples
MIN_SEEDS_FOR_SEED_BOOTSTRAP = 3
STATISTICS = ("mean", "abs_mean")


@dataclass(frozen=True)
class Interval:
    """A bootstrap interval of a check's statistic, with what was resampled."""

    estimate: float  # the statistic on the samples themselves
    lo: float
    hi: float
    level: float
    n_examples: int  # examples per seed (the smallest seed's count)
    n_seeds: int
    over_seeds: bool  # whether the seeds were resampled too

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2.0

    def contains(self, threshold: float) -> bool:
        return self.lo <= threshold <= self.hi


def _as_arrays(samples: Sequence[Sequence[float]]) -> list[np.ndarray]:
    if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
        raise TypeError(f"samples must be a sequence (one per seed) of sequences of numbers, got {samples!r}")
    out = []
    for i, s in enumerate(samples):
        a = np.asarray(s, dtype=np.float64).reshape(-1)
        if a.size == 0:
            raise ValueError(f"samples[{i}] is empty (every seed needs at least one example)")
        if not np.isfinite(a).all():
            raise ValueError(f"samples[{i}] holds NaN or infinite values")
        out.append(a)
    if not out:
        raise ValueError("samples must hold at least one seed")
    return out


def statistic(samples: Sequence[Sequence[float]], kind: str = "mean") -> float:
    """Mean over seeds of the per-seed mean of ``samples`` (``abs_mean``: its absolute value)."""
    if kind not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {kind!r}")
    value = float(np.mean([a.mean() for a in _as_arrays(samples)]))
    return abs(value) if kind == "abs_mean" else value


def paired_bootstrap(samples: Sequence[Sequence[float]], kind: str = "mean", *, level: float = LEVEL,
                     resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Interval:
    """Percentile bootstrap interval of :func:`statistic` over examples (and seeds when >= 3).

    Args:
        samples: one sequence per seed of the per-example (paired) values the check averages.
        kind: ``"mean"`` or ``"abs_mean"`` (for checks of the form ``|a - b| <= tol``).
        level: the two-sided coverage, in (0, 1).
        resamples: bootstrap draws.
        seed: seed of the generator (the interval is deterministic).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    arrays = _as_arrays(samples)
    est = statistic(arrays, kind)
    rng = np.random.default_rng(seed)
    # per seed: the mean of a resample of its examples, one per bootstrap draw -> (resamples, seeds)
    means = np.stack([a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1) for a in arrays], axis=1)
    n_seeds = len(arrays)
    over_seeds = n_seeds >= MIN_SEEDS_FOR_SEED_BOOTSTRAP
    if over_seeds:
        pick = rng.integers(0, n_seeds, size=(resamples, n_seeds))
        draws = np.take_along_axis(means, pick, axis=1).mean(axis=1)
    else:
        draws = means.mean(axis=1)
    if kind == "abs_mean":
        draws = np.abs(draws)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(draws, [tail, 1.0 - tail])
    return Interval(estimate=est, lo=float(lo), hi=float(hi), level=level,
                    n_examples=int(min(a.size for a in arrays)), n_seeds=n_seeds, over_seeds=over_seeds)


def samples_to_decide(interval: Interval, threshold: float) -> tuple[int | None, str]:
    """About how many examples per seed (or seeds, when the seeds were resampled) would make the
    interval exclude ``threshold``: ``(count, unit)``; count is ``None`` when the estimate sits on the
    threshold (no sample size decides it)."""
    unit = "seeds" if interval.over_seeds else "examples per seed"
    n = interval.n_seeds if interval.over_seeds else interval.n_examples
    gap = abs(interval.estimate - threshold)
    if gap == 0.0 or not math.isfinite(gap):
        return None, unit
    if interval.half_width <= 0.0:
        return n, unit
    return max(n + 1, math.ceil(n * (interval.half_width / gap) ** 2)), unit
