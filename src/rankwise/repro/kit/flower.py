"""What the federated reproductions (fslora, ub_smoe) hold while they measure."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def flower_run() -> Iterator[None]:
    """At most two torch threads (the runs' own choice) and Flower's logger quiet; both restored after."""
    from rankwise.federated.common import quiet_flwr

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, before)))
    restore_flwr_log = quiet_flwr()
    try:
        yield
    finally:
        restore_flwr_log()
        torch.set_num_threads(before)
