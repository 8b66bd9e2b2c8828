"""The federated reproductions give the same table twice on the same seed.

fslora's quick numbers used to differ run to run: the frozen MiniLM layers kept BERT's dropout, and a
client trains in ``train()`` mode, so every local step drew masks from torch's global generator, whose
state depends on whatever ran before in the process. The second run below starts from a different
global generator state on purpose.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("flwr")


def _table(result) -> dict:
    return {row: {c: v for c, v in cols.items() if "wall" not in c} for row, cols in result.table.rows.items()}


@pytest.mark.parametrize("mod", ["fslora", "ub_smoe"])
def test_two_smoke_runs_with_the_same_seed_give_identical_tables(mod, tmp_path):
    m = importlib.import_module(f"rankwise.repro.{mod}")
    torch.manual_seed(1)
    first = m.run("smoke", [0], tmp_path / "a")
    torch.manual_seed(2)
    torch.rand(1000)  # a different global generator state: nothing the run draws may depend on it
    second = m.run("smoke", [0], tmp_path / "b")
    assert _table(first) == _table(second)
