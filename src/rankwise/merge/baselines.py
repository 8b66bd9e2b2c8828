"""The merge-then-compress baselines under their historical module name (kept importable).

The code now lives in the merge family's modules: :mod:`rankwise.merge.mtc` (``MergeConfig``,
:func:`merge`, :func:`merged_deltas`: task arithmetic, TIES, DARE, DARE-TIES, Iso-C in full, KnOTS or
Core space, truncated to rank r), :mod:`rankwise.merge.rules` (the rules, :func:`merge_tensors`) and
:mod:`rankwise.merge.common` (input checks, SVD helpers, the output state). Every name this module
had is re-exported here; the three field validators (``check_rank``, ``check_scale``,
``_check_unit``) are deprecated in favour of :mod:`rankwise.core.validate`.
"""

from __future__ import annotations

import warnings
from typing import Any

from rankwise.core.validate import check_int, check_number, check_unit

# Everything below is re-exported (the public names in __all__, the private ones for old callers).
from rankwise.merge.common import (
    FP as _FP,
    MergeInputs,
    adapter_seed,
    check_adapters,
    core_bases,
    core_matrices,
    flatten_isotropic,
    logger,
    scaled_factors,
    sign_fix,
    top_left_singular,
    truncate,
)
from rankwise.merge.common import lowrank_factors as _factors
from rankwise.merge.common import module_factors as _module_factors
from rankwise.merge.common import out_state as _out_state
from rankwise.merge.mtc import SPACES, MergeConfig, describe, merge, merged_deltas, mtc_merge
from rankwise.merge.mtc import merged_delta_module as _merged_delta_module
from rankwise.merge.rules import RULES, canonical_rule, merge_tensors
from rankwise.merge.rules import RULE_ALIASES as _RULE_ALIASES
from rankwise.merge.rules import _dare_drop, _elect_and_mean, _topk_mask

__all__ = [
    "RULES",
    "SPACES",
    "MergeConfig",
    "MergeInputs",
    "adapter_seed",
    "core_bases",
    "core_matrices",
    "check_adapters",
    "flatten_isotropic",
    "merge",
    "merge_tensors",
    "merged_deltas",
    "mtc_merge",
    "sign_fix",
    "truncate",
]

_TINY = 1e-300



def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"rankwise.merge.baselines.{old} is deprecated; use rankwise.core.validate.{new}",
                  DeprecationWarning, stacklevel=3)


def check_rank(name: str, value: Any, allow_none: bool = False) -> None:
    """Deprecated: ``rankwise.core.validate.check_int(name, value, 1, allow_none=...)``."""
    _deprecated("check_rank", "check_int")
    check_int(name, value, 1, allow_none=allow_none)


def check_scale(name: str, value: Any) -> float:
    """Deprecated: ``rankwise.core.validate.check_number(name, value)``."""
    _deprecated("check_scale", "check_number")
    return check_number(name, value)  # type: ignore[return-value]


def _check_unit(name: str, value: Any, low_open: bool, high_open: bool) -> float:
    """Deprecated: ``rankwise.core.validate.check_unit(name, value, low_open=..., high_open=...)``."""
    _deprecated("_check_unit", "check_unit")
    return check_unit(name, value, low_open=low_open, high_open=high_open)  # type: ignore[return-value]
