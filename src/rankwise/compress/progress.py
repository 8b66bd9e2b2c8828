"""Progress bars and the tensor-memory ledger of a compression run (shared by every mode)."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from rankwise.core.stats import LayerStats

__all__ = ["Ledger", "tensor_bytes", "stats_bytes", "param_bytes", "Bar", "track"]


class Ledger:
    """Explicit tensor-memory accounting of a run (bytes held by parameters, statistics, activations)."""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.peak = 0
        self.peak_at: dict[str, int] = {}

    def set(self, key: str, nbytes: int) -> None:
        self.current[key] = int(nbytes)
        total = sum(self.current.values())
        if total > self.peak:
            self.peak = total
            self.peak_at = dict(self.current)

    def to_json(self) -> dict[str, Any]:
        return {"peak_tensor_bytes": self.peak, "at_peak": self.peak_at}


def tensor_bytes(ts: Iterable[Any]) -> int:
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            if not t.is_meta:
                total += t.numel() * t.element_size()
        elif isinstance(t, (list, tuple)):
            total += tensor_bytes(t)
        elif isinstance(t, dict):
            total += tensor_bytes(t.values())
    return total


def stats_bytes(stats: Mapping[str, LayerStats]) -> int:
    return sum(tensor_bytes(s.tensors().values()) for s in stats.values())


def param_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total



class Bar:
    """A rich progress bar on stderr (only when enabled and stderr is a terminal)."""

    def __init__(self, enabled: bool, description: str, total: int):
        self._p = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._p.start()
            self._task = self._p.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=text)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def track(items: Sequence[Any], description: str, enabled: bool) -> Iterator[Any]:
    bar = Bar(enabled, description, len(items))
    try:
        for x in items:
            yield x
            bar.advance()
    finally:
        bar.close()
