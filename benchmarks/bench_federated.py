"""Federated rounds: FSLoRA against Flower's FedAvg-LoRA at equal rounds, 16 clients.

Both methods run through rankwise's federated runner (:func:`rankwise.federated.runner.run_simulation_settings`,
what ``rankwise federate`` calls) on the same task, clients, rank and client optimisation, so the only
difference is the method: FSLoRA sends each client a sketch of the global rank-r adapter (client sketch
ranks cycling 2, 4, 8, 16 as in ``rankwise federate``'s default) and averages the sketched updates;
FedAvg-LoRA sends every client the full rank-r adapter and aggregates with Flower's own
``FedAvg.aggregate_fit``. Each timed call is a *whole* run of ``ROUNDS`` rounds with a fresh strategy
(server-side evaluation after every round included, for both), so ``median_s / ROUNDS`` is the round
wall time and the ratio of medians is the ratio of round wall times.

Cases (``ratio_vs_anchor`` < 1: faster than the anchor, FedAvg-LoRA):

* ``federated_round_sim``: Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend,
  one CPU per client actor). A call includes the engine's start-up and shutdown (about 10 s here),
  the same for both methods, which pulls the ratio towards 1: the in-process case isolates the rounds;
* ``federated_round_inprocess``: the same runs in Flower's ``Server`` loop with in-process clients (no
  Ray), where the time is the methods' own (client training, payloads, aggregation, evaluation).

Memory (``VmHWM`` of the timing process) does not see the simulation engine's worker processes.

Goal: FSLoRA's round wall time <= 1.2x FedAvg-LoRA's. ``SMOKE_CASES``: the simulation-engine case with
4 of the 16 clients per round, 2 local steps and one round. Run ``python -m benchmarks.run federated``.
"""

from __future__ import annotations

from typing import Any, Callable

from benchmarks.harness import Case, Goal

CLIENTS = 16
ROUNDS = 3
RANK = 16
GOAL = Goal("FSLoRA round wall time <= 1.2x FedAvg-LoRA's", impl="fslora", max_ratio=1.2)


def _settings(method: str, rounds: int, per_round: int, local_steps: int) -> Any:
    from rankwise.federated import FederatedConfig
    from rankwise.federated.runner import RunSettings

    cycle = [k for k in (2, 4, 8, 16) if k <= RANK]
    ranks = {i: cycle[i % len(cycle)] for i in range(CLIENTS)} if method == "fslora" else {}
    config = FederatedConfig(rank=RANK, alpha=float(RANK), client_ranks=ranks, clients_per_round=per_round,
                             local_steps=local_steps, batch_size=16, seed=0)
    return RunSettings(method=method, task="synthetic", task_kwargs={"seed": 0}, num_clients=CLIENTS,
                       rounds=rounds, config=config)


def _run(method: str, backend: str, rounds: int, per_round: int,
         local_steps: int) -> Callable[[], Callable[[], Any]]:
    def factory() -> Callable[[], Any]:
        from rankwise.federated.common import quiet_flwr
        from rankwise.federated.runner import run_simulation_settings

        settings = _settings(method, rounds, per_round, local_steps)
        settings.task_object()  # build (and cache) the task once, outside the timed calls

        def run() -> int:
            restore = quiet_flwr()
            try:
                strategy = run_simulation_settings(settings, backend=backend)
            finally:
                restore()
            if strategy.completed_rounds != rounds:  # a run that stopped early would time less work
                raise RuntimeError(f"{method}: {strategy.completed_rounds} of {rounds} rounds completed")
            return strategy.completed_rounds
        return run
    return factory


def _case(name: str, backend: str, rounds: int, per_round: int, local_steps: int, repeats: int,
          warmup: int) -> Case:
    return Case(name, {m: _run(m, backend, rounds, per_round, local_steps) for m in ("fedavg", "fslora")},
                anchor="fedavg", goals=(GOAL,), repeats=repeats, warmup=warmup,
                params={"backend": backend, "task": "synthetic", "clients": CLIENTS, "clients_per_round": per_round,
                        "rounds_per_call": rounds, "rank": RANK, "fslora_client_ranks": "2,4,8,16 cycled",
                        "local_steps": local_steps, "batch_size": 16, "server_evaluation": "every round"})


CASES = [
    _case("federated_round_sim", "flower", ROUNDS, CLIENTS, 8, repeats=5, warmup=1),
    _case("federated_round_inprocess", "inprocess", ROUNDS, CLIENTS, 8, repeats=10, warmup=1),
]

SMOKE_CASES = [_case("federated_round_sim_smoke", "flower", 1, 4, 2, repeats=1, warmup=0)]
