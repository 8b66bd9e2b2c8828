"""Small pieces shared by the federated server strategies and the client: seeds and the wire layout.

Wire format of one client's payload (both directions): a list of float32 ndarrays in the order of a
*layout*, ``[(name, shape), ...]``, sent as JSON in ``FitIns.config["layout"]``. Names are
``"<module>.lora_A"`` (``(k, in)``), ``"<module>.lora_B"`` (``(out, k)``) and ``"head:<param>"``
(parameters every client trains in full, e.g. a classifier). ``FitIns.config["scaling"]`` holds
``{module: s}``: the client's adapter computes ``s * B @ A``. A client returns arrays of exactly
the layout it received; the server rejects anything else (:func:`check_update`).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["HEAD_PREFIX", "WIRE_DTYPE", "check_update", "decode_layout", "derive_seed", "encode_layout", "nbytes"]

HEAD_PREFIX = "head:"
WIRE_DTYPE = np.float32
_TAGS = {"sample": 1, "sketch": 2, "batches": 3, "init": 4}


def derive_seed(seed: int, tag: str, *ints: int) -> int:
    """A 63-bit seed from ``(seed, tag, *ints)`` (numpy SeedSequence: independent streams per tuple)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, _TAGS[tag], *(int(i) & 0xFFFFFFFF for i in ints)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def encode_layout(layout: Sequence[tuple[str, Sequence[int]]]) -> str:
    return json.dumps([[n, [int(s) for s in shape]] for n, shape in layout])


def decode_layout(text: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Parse ``FitIns.config["layout"]``; a malformed layout raises ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"layout must be a JSON string, got {type(text).__name__}")
    try:
        raw = json.loads(text)
        out = [(str(n), tuple(int(s) for s in shape)) for n, shape in raw]
    except (ValueError, TypeError) as e:
        raise ValueError(f"malformed layout: {e}") from e
    return out


def nbytes(arrays: Sequence[np.ndarray]) -> int:
    return int(sum(int(a.nbytes) for a in arrays))


def check_update(arrays: Sequence[Any], layout: Sequence[tuple[str, tuple[int, ...]]]) -> str | None:
    """Why ``arrays`` is not a valid reply to ``layout`` (count, type, dtype, shape, finiteness), or None."""
    if len(arrays) != len(layout):
        return f"{len(arrays)} arrays for a layout of {len(layout)}"
    for a, (name, shape) in zip(arrays, layout):
        if not isinstance(a, np.ndarray):
            return f"{name}: not an ndarray ({type(a).__name__})"
        if a.dtype != WIRE_DTYPE:
            return f"{name}: dtype {a.dtype}, expected {np.dtype(WIRE_DTYPE)}"
        if tuple(a.shape) != tuple(shape):
            return f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}"
        if not bool(np.isfinite(a).all()):
            return f"{name}: holds NaN or inf"
    return None


def finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def quiet_flwr(level: int = logging.WARNING) -> Callable[[], None]:
    """Raise the ``flwr`` logger to ``level`` (its per-round INFO lines would flood a terminal) and return
    the function that restores the previous level. ``flwr.server`` is imported first because Flower sets
    its logger's level when it is imported; call the returned function in a ``finally``."""
    import flwr.server  # noqa: F401

    flwr_log = logging.getLogger("flwr")
    old = flwr_log.level
    flwr_log.setLevel(level)
    return lambda: flwr_log.setLevel(old)

