"""The memory cap of benchmarks/large_checkpoint: a child over the cap fails, one under it completes."""

import os
import sys

import pytest

from benchmarks import large_checkpoint as lc

ALLOC = "b = bytearray({mib} * 2**20); b[::4096] = b'x' * len(b[::4096]); print(len(b))"


def _cgroup_v1_writable() -> bool:
    return (lc.CGROUP_V1 / "cgroup.procs").is_file() and os.access(lc.CGROUP_V1, os.W_OK) and not lc._cgroup_works()


@pytest.mark.skipif(not _cgroup_v1_writable(), reason="needs a writable cgroup v1 memory hierarchy (root)")
def test_cgroup_v1_cap_kills_a_child_over_it_and_spares_one_under_it():
    cap = 160 * 2**20
    under, kind, seen = lc.run_capped([sys.executable, "-c", ALLOC.format(mib=20)], cap, "cgroup")
    assert under.returncode == 0 and kind.startswith("cgroup v1") and seen["oom_kills"] == 0
    assert 20 * 2**20 <= seen["max_usage_in_bytes"] <= cap
    over, _, seen = lc.run_capped([sys.executable, "-c", ALLOC.format(mib=400)], cap, "cgroup")
    assert over.returncode != 0 and seen["oom_kills"] >= 1
    assert not any(p.name.startswith("rankwise-bench-") for p in lc.CGROUP_V1.iterdir())  # group removed


def test_no_cap_runs_plainly():
    proc, kind, seen = lc.run_capped([sys.executable, "-c", "print(1)"], None, "auto")
    assert proc.returncode == 0 and proc.stdout.strip() == "1" and kind == "none" and seen == {}
