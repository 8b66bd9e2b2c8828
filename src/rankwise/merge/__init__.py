"""Merging methods: several LoRA adapters in, one adapter out (``merge(adapters, config) -> AdapterState``).

* :mod:`rankwise.merge.ctm` — Compress-then-Merge (CtM, ICML 2026): shared rank-r subspaces first, then
  merge r x r coordinates;
* :mod:`rankwise.merge.mtc` — merge-then-compress baselines: task arithmetic, TIES, DARE, DARE-TIES,
  Iso-C in full, KnOTS or Core space, truncated to rank r by SVD (historical name:
  :mod:`rankwise.merge.baselines`);
* :mod:`rankwise.merge.rules` — the merge rules (TA, TIES, DARE, ...) on stacked task tensors;
* :mod:`rankwise.merge.common` — what every method shares (input checks, SVD helpers, output state);
* :mod:`rankwise.merge.base` — the registry: one :class:`MergeMethod` per name
  (:func:`resolve_merge_method`), with its config class;
* :mod:`rankwise.merge.dirs` — :func:`merge_dirs`: PEFT adapter directories in, a PEFT directory out.
"""

from rankwise.merge.base import MergeMethod, merge_methods, register_merge_method, resolve_merge_method
from rankwise.merge.ctm import CtMConfig, CtMReport, ctm_merge, merge_with_report, search, tucker2
from rankwise.merge.mtc import SPACES, MergeConfig, merged_deltas, mtc_merge
from rankwise.merge.common import truncate
from rankwise.merge.rules import RULES

__all__ = [
    "RULES",
    "SPACES",
    "CtMConfig",
    "CtMReport",
    "MergeConfig",
    "MergeMethod",
    "ctm_merge",
    "merge_methods",
    "merge_with_report",
    "merged_deltas",
    "mtc_merge",
    "register_merge_method",
    "resolve_merge_method",
    "search",
    "truncate",
    "tucker2",
]
