"""What the federated reproductions (fslora, ub_smoe) hold while they measure."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def flower_run() -> Iterator[None]:
    """One torch thread and Flower's logger quiet; both restored after.

    One thread, whatever the machine: a float sum split over another number of threads rounds differently,
    so with ``min(2, cores)`` threads (the earlier choice) the same seed gave other numbers on another
    machine or under another ``OMP_NUM_THREADS``. The tensors are small; a second thread bought little.
    """
    from rankwise.federated.common import quiet_flwr

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    restore_flwr_log = quiet_flwr()
    try:
        yield
    finally:
        restore_flwr_log()
        torch.set_num_threads(before)
