"""The E²LoRA peer rows and the federated round benchmark are well-formed (nothing is run or timed)."""

import importlib

import pytest

from benchmarks.harness import Case, _smoke_cases


def _check_cases(cases):
    assert cases
    for case in cases:
        assert isinstance(case, Case) and case.anchor in case.impls
        for g in case.goals:
            assert g.impl in case.impls  # a goal names an implementation the case runs


def test_e2lora_has_vera_and_vblora_peers_beside_the_unchanged_anchor():
    pytest.importorskip("peft")
    mod = importlib.import_module("benchmarks.bench_e2lora")
    _check_cases(mod.CASES)
    step = next(c for c in mod.CASES if c.name == "e2lora_step")
    assert step.anchor == "peft-lora-r8"
    assert {"rankwise-e2lora", "peft-vera-r2560", "peft-vblora-r4"} <= set(step.impls)
    # The counts are measured on the built models, into the dict the case's params carry.
    assert step.params["trainable_params"] is mod.TRAINABLE


def test_federated_round_benchmark_compares_fslora_with_fedavg_at_equal_rounds():
    pytest.importorskip("flwr")
    from rankwise.federated.runner import methods

    mod = importlib.import_module("benchmarks.bench_federated")
    _check_cases(mod.CASES)
    _check_cases(mod.SMOKE_CASES)
    for case in mod.CASES + mod.SMOKE_CASES:
        assert case.anchor == "fedavg" and set(case.impls) == {"fedavg", "fslora"} <= set(methods())
        assert case.params["clients"] == 16
        (goal,) = case.goals
        assert (goal.impl, goal.max_ratio, goal.metric) == ("fslora", 1.2, "ratio")
    assert {c.params["backend"] for c in mod.CASES} == {"flower", "inprocess"}
    assert _smoke_cases(mod) == mod.SMOKE_CASES and mod.SMOKE_CASES[0].params["backend"] == "flower"
    # Equal rounds: both methods' runs are built from the same settings apart from the method.
    a, b = (mod._settings(m, 2, 4, 2) for m in ("fedavg", "fslora"))
    assert (a.rounds, a.num_clients, a.config.rank, a.config.local_steps) == \
        (b.rounds, b.num_clients, b.config.rank, b.config.local_steps)
