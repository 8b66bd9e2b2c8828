"""Merging methods: several LoRA adapters in, one adapter out (``merge(adapters, config) -> AdapterState``).

* :mod:`rankwise.merge.ctm` — Compress-then-Merge (CtM, ICML 2026): shared rank-r subspaces first, then
  merge r x r coordinates;
* :mod:`rankwise.merge.baselines` — merge-then-compress baselines: task arithmetic, TIES, DARE,
  DARE-TIES, Iso-C in full, KnOTS or Core space, truncated to rank r by SVD.
"""

from rankwise.merge.baselines import RULES, SPACES, MergeConfig, merged_deltas, mtc_merge, truncate
from rankwise.merge.ctm import CtMConfig, CtMReport, ctm_merge, merge_with_report, search, tucker2

__all__ = [
    "RULES",
    "SPACES",
    "CtMConfig",
    "CtMReport",
    "MergeConfig",
    "ctm_merge",
    "merge_with_report",
    "merged_deltas",
    "mtc_merge",
    "search",
    "truncate",
    "tucker2",
]
