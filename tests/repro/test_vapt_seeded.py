"""VAPT's reproduction: a row's numbers depend on the seed alone, not on the global RNG state before it
(the dropouts of VPT, VAPT and PEFT LoRA draw from torch's global generator)."""

from __future__ import annotations

import torch

from rankwise.repro import vapt


def test_rows_do_not_depend_on_the_global_rng_state() -> None:
    S = vapt.SETTINGS["smoke"]
    torch.manual_seed(123)
    a = vapt._run_task(S.tasks[0], S, 0)
    torch.rand(1000)  # anything else drawing from the global generator in between
    b = vapt._run_task(S.tasks[0], S, 0)
    assert a["correct"] == b["correct"]
    assert a["losses"] == b["losses"]
