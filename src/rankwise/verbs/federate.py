"""``rankwise federate``: federated LoRA fine-tuning (FSLoRA and baselines) in Flower's simulation engine.

    rankwise federate --method fslora|fedavg|hetlora|flexlora|florist|ub-smoe|smoe-naive|smoe-llb|a3smoe
                      --clients 16 --rounds N [--out DIR]
                      [--task minilm|synthetic|synthetic-moe|pkg.module:factory] [--rank 16] [--client-ranks 2,4,8,16]
                      [--clients-per-round 5] [--local-steps 8] [--lr 5e-4] [--seed 0] [--resume]
                      [--backend flower|inprocess] [--round-timeout S]
                      [--aggregation mean|median|trimmed|krum] [--max-update-norm-ratio 10|off]
                      [--max-examples-ratio 10|off] [--no-health-check] [--max-loss-ratio 2]
                      [--max-accuracy-drop 0.25|off]

Prints one line per round (test accuracy and loss of the global adapter, mean client loss, bytes sent
per client); with ``--out`` the server state is checkpointed there every round (``--resume``
continues from it), and the final global adapter, the per-round history and the settings are saved.
The server's defences (rankwise.federated.defences) are on by default. A bad option value is one line
naming the option and its allowed values (exit status 2).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

#: ``--task`` names; a method's default task (its registry entry's ``default_task``) is one of them
TASKS = {"minilm": "rankwise.repro.fslora:minilm_task", "synthetic": "synthetic", "synthetic-moe": "synthetic-moe"}


#: config fields and the options that set them (a config error names the option)
OPTIONS = {"rank": "--rank", "alpha": "--alpha", "client_ranks": "--client-ranks", "clients_per_round":
           "--clients-per-round", "local_steps": "--local-steps", "batch_size": "--batch-size", "client_lr": "--lr",
           "head_lr": "--head-lr", "server_optimizer": "--server-optimizer", "server_lr": "--server-lr",
           "weighting": "--weighting", "seed": "--seed", "aggregator": "--aggregation",
           "trim_fraction": "--trim-fraction", "krum_byzantine": "--krum-byzantine",
           "max_update_norm_ratio": "--max-update-norm-ratio", "max_examples_ratio": "--max-examples-ratio",
           "max_loss_ratio": "--max-loss-ratio", "max_accuracy_drop": "--max-accuracy-drop"}


def _bad(option: str, allowed: str, got: Any) -> None:
    """A one-line user error (exit 2, through the app's error handler) naming the option and its allowed values."""
    raise ValueError(f"{option} must be {allowed}, got {got!r}")


@contextlib.contextmanager
def _as_options() -> Iterator[None]:
    """Re-word a config's ``FederatedConfig.<field> must be ...`` error with the option that set the field."""
    try:
        yield
    except ValueError as e:
        msg = str(e)
        for fieldname, option in OPTIONS.items():
            for prefix in (f"FederatedConfig.{fieldname}:", f"FederatedConfig.{fieldname} "):
                if msg.startswith(prefix):
                    raise ValueError(option + msg[len(prefix) - 1:]) from None
        raise


def _ratio(option: str, text: str, allowed: str = "a number >= 1 or off") -> float | None:
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        _bad(option, allowed, text)
        raise  # unreachable


def _ranks(text: Optional[str], rank: int, clients: int) -> dict[int, int]:
    if text is None:
        cycle = [k for k in (2, 4, 8, 16) if k <= rank] or [rank]
    else:
        try:
            cycle = [int(t) for t in text.replace(" ", "").split(",") if t]
        except ValueError:
            cycle = []
        if not cycle:
            _bad("--client-ranks", "integers separated by commas, e.g. 2,4,8,16", text)
    return {i: cycle[i % len(cycle)] for i in range(clients)}


def register(app: typer.Typer) -> None:
    @app.command("federate")
    def federate_cmd(
        ctx: typer.Context,
        method: str = typer.Option("fslora", "--method", help="fslora, fedavg (Flower's FedAvg), hetlora, flexlora, "
                                   "florist; ub-smoe and its SMoE baselines smoe-naive, smoe-llb, a3smoe."),
        clients: int = typer.Option(16, "--clients", help="Number of simulated clients (SuperNodes)."),
        rounds: int = typer.Option(5, "--rounds", help="Total number of rounds (a resumed run continues to it)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Folder for the per-round checkpoint, the final "
                                           "adapter (global_adapter.safetensors) and history.json."),
        task: Optional[str] = typer.Option(None, "--task", help="minilm (MiniLM top layers on the zoo's topic task, "
                                           "cached lower layers; the default), synthetic, synthetic-moe (the "
                                           "default of the SMoE methods), or pkg.module:factory."),
        rank: int = typer.Option(16, "--rank", help="Global LoRA rank r."),
        alpha: float = typer.Option(16.0, "--alpha", help="LoRA alpha (update scale alpha / r)."),
        client_ranks: Optional[str] = typer.Option(None, "--client-ranks", help="Client ranks / sketch sizes "
                                                   "cycled over client ids, e.g. 2,4,8,16 (default: powers of 2 "
                                                   "up to r)."),
        per_round: int = typer.Option(5, "--clients-per-round", help="Clients sampled per round."),
        local_steps: int = typer.Option(8, "--local-steps", help="Client AdamW steps per round."),
        lr: float = typer.Option(5e-4, "--lr", help="Client learning rate of the LoRA factors."),
        head_lr: Optional[float] = typer.Option(5e-3, "--head-lr", help="Client learning rate of the head."),
        batch_size: int = typer.Option(16, "--batch-size", help="Client batch size."),
        server_optimizer: str = typer.Option("avg", "--server-optimizer", help="avg, sgd or adam (FSLoRA only)."),
        server_lr: float = typer.Option(1.0, "--server-lr", help="Server step size (1.0 for avg)."),
        weighting: str = typer.Option("examples", "--weighting", help="uniform or examples."),
        dirichlet: float = typer.Option(0.3, "--dirichlet", help="Non-IID level: Dirichlet concentration of "
                                        "the label split."),
        seed: int = typer.Option(0, "--seed", help="Seed of data split, sampling, sketches and init."),
        resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
        backend: str = typer.Option("flower", "--backend", help="flower (simulation engine, Ray) or inprocess."),
        round_timeout: Optional[float] = typer.Option(None, "--round-timeout", help="Seconds after which a "
                                                      "client's round counts as failed."),
        aggregation: str = typer.Option("mean", "--aggregation", help="Server aggregation: mean (each method's "
                                        "own average), median, trimmed (trimmed mean) or krum (Multi-Krum)."),
        trim_fraction: float = typer.Option(0.2, "--trim-fraction", help="Fraction cut at each end by "
                                            "--aggregation trimmed, in [0, 0.5)."),
        krum_byzantine: int = typer.Option(1, "--krum-byzantine", help="Malicious clients per round that "
                                           "--aggregation krum tolerates."),
        max_update_norm_ratio: str = typer.Option("10", "--max-update-norm-ratio", help="Reject a client update "
                                                  "larger than this times the round's median update (off: no "
                                                  "bound)."),
        max_examples_ratio: str = typer.Option("10", "--max-examples-ratio", help="Cap a claimed example count "
                                               "at this times the round's median claim when the server does not "
                                               "know the client's assigned count (off: no cap)."),
        health_check: bool = typer.Option(True, "--health-check/--no-health-check", help="Refuse (roll back, do "
                                          "not checkpoint) a round whose global model is not finite or whose "
                                          "test loss exceeds --max-loss-ratio times the last accepted one or "
                                          "whose accuracy drops by more than --max-accuracy-drop."),
        max_loss_ratio: float = typer.Option(2.0, "--max-loss-ratio", help="Loss bound of the health check."),
        max_accuracy_drop: str = typer.Option("0.25", "--max-accuracy-drop", help="Accuracy bound of the health "
                                              "check: refuse a round whose test accuracy falls more than this "
                                              "below the last accepted round's (off: no bound)."),
    ) -> None:
        """Federated LoRA fine-tuning with heterogeneous client ranks in Flower's simulation engine."""
        from rankwise.verbs import common
        from rankwise.core import io
        from rankwise.federated import FederatedConfig, registry
        from rankwise.federated.runner import RunSettings, methods, run_simulation_settings

        names = methods()
        if method not in names:
            _bad("--method", f"one of {', '.join(names)}", method)
        if backend not in ("flower", "inprocess"):
            _bad("--backend", "flower or inprocess", backend)
        if clients < 1:
            _bad("--clients", "an int >= 1", clients)
        if rounds < 1:
            _bad("--rounds", "an int >= 1", rounds)
        if not 1 <= per_round <= clients:
            _bad("--clients-per-round", f"an int in [1, --clients={clients}]", per_round)
        if round_timeout is not None and not round_timeout > 0:
            _bad("--round-timeout", "a number of seconds > 0", round_timeout)
        if resume and out is None:
            raise ValueError("--resume needs --out (the folder holding checkpoint.safetensors)")
        if task is None:
            task = registry.get(method).default_task
        spec = TASKS.get(task, task)
        if spec not in TASKS.values() and ":" not in spec:
            _bad("--task", "minilm, synthetic, synthetic-moe or pkg.module:factory", task)
        ranks = _ranks(client_ranks, rank, clients) if method != "fedavg" else {}
        with _as_options():
            config = FederatedConfig(
                rank=rank, alpha=alpha, client_ranks=ranks, clients_per_round=per_round, local_steps=local_steps,
                batch_size=batch_size, client_lr=lr, head_lr=head_lr, server_optimizer=server_optimizer,
                server_lr=server_lr, weighting=weighting, seed=seed, aggregator=aggregation,
                trim_fraction=trim_fraction, krum_byzantine=krum_byzantine,
                max_update_norm_ratio=_ratio("--max-update-norm-ratio", max_update_norm_ratio),
                max_examples_ratio=_ratio("--max-examples-ratio", max_examples_ratio), health_check=health_check,
                max_loss_ratio=max_loss_ratio, max_accuracy_drop=_ratio("--max-accuracy-drop", max_accuracy_drop,
                                                                        "a number in [0, 1] or off"))
        task_kwargs: dict[str, Any] = {"seed": seed, "dirichlet_alpha": dirichlet}
        ckpt = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            ckpt = str(out)
            if resume and not (out / "checkpoint.safetensors").is_file():
                raise FileNotFoundError(f"--resume: no checkpoint.safetensors in {out}")
        settings = RunSettings(method=method, task=spec, task_kwargs=task_kwargs, num_clients=clients, rounds=rounds,
                               config=config, checkpoint_dir=ckpt, resume=str(out) if resume else None,
                               round_timeout=round_timeout)
        quiet = common.settings(ctx).quiet
        console = common.console()
        if not quiet:
            console.print(f"{method}: {clients} clients, {per_round} per round, {rounds} rounds, rank {rank}, "
                          f"task {task}, backend {backend}", markup=False)
        settings.task_object()  # build (and cache on disk) the task once, before any client starts

        def on_round(row: dict[str, Any]) -> None:
            if quiet:
                return
            if row["round"] == 0:
                console.print(f"round 0: accuracy {row.get('accuracy', float('nan')):.4f}  "
                              f"loss {row.get('loss', float('nan')):.4f}", markup=False)
                return
            if "refused" in row:
                console.print(f"round {row['round']}: refused by the health check ({row['refused']}); the global "
                              "model stays at the previous round's", markup=False, soft_wrap=True)
                return
            console.print(f"round {row['round']}: accuracy {row.get('accuracy', float('nan')):.4f}  "
                          f"loss {row.get('loss', float('nan')):.4f}  client loss {row['train_loss']:.4f}  "
                          f"clients ok/failed/rejected {row['clients_ok']}/{row['clients_failed']}/"
                          f"{row['clients_rejected']}  upload {row['upload_bytes_per_client'] / 1024:.1f} KB/client  "
                          f"download {row['download_bytes_per_client'] / 1024:.1f} KB/client", markup=False, soft_wrap=True)

        from rankwise.federated.common import quiet_flwr

        restore_flwr_log = quiet_flwr()  # Flower's per-round INFO lines, with or without --quiet
        try:
            strategy = run_simulation_settings(settings, backend=backend, on_round=on_round)
        finally:
            restore_flwr_log()
        if out is not None:
            strategy.global_adapter.save(out / "global_adapter.safetensors")
            io.write_json(out / "history.json", json.loads(json.dumps(strategy.history, default=str)
                                                           .replace("NaN", "null")))
            io.write_json(out / "settings.json", json.loads(settings.to_run_config()["rankwise-settings"]))
            console.print(f"saved: {out / 'global_adapter.safetensors'}", soft_wrap=True, markup=False)
        last = strategy.history[-1] if strategy.history else {}
        console.print(f"final (round {last.get('round')}): accuracy {last.get('accuracy', float('nan')):.4f}", markup=False)
