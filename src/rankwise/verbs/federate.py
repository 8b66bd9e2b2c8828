"""``rankwise federate``: federated LoRA fine-tuning (FSLoRA and baselines) in Flower's simulation engine.

    rankwise federate --method fslora|fedavg|hetlora|flexlora|florist|ub-smoe|smoe-naive|smoe-llb|a3smoe
                      --clients 16 --rounds N [--out DIR]
                      [--task minilm|synthetic|synthetic-moe|pkg.module:factory] [--rank 16] [--client-ranks 2,4,8,16]
                      [--clients-per-round 5] [--local-steps 8] [--lr 5e-4] [--seed 0] [--resume]
                      [--backend flower|inprocess] [--round-timeout S]

Prints one line per round (test accuracy and loss of the global adapter, mean client loss, bytes sent
per client); with ``--out`` the server state is checkpointed there every round (``--resume``
continues from it), and the final global adapter, the per-round history and the settings are saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

TASKS = {"minilm": "rankwise.repro.fslora:minilm_task", "synthetic": "synthetic",
         "synthetic-moe": "rankwise.federated.ub_smoe:SyntheticMoETask"}
#: methods that train LoRA experts of a mixture-of-experts model: their default task has MoE layers
MOE_METHODS = ("ub-smoe", "smoe-naive", "smoe-llb", "a3smoe")


def _ranks(text: Optional[str], rank: int, clients: int) -> dict[int, int]:
    if text is None:
        cycle = [k for k in (2, 4, 8, 16) if k <= rank] or [rank]
    else:
        try:
            cycle = [int(t) for t in text.replace(" ", "").split(",") if t]
        except ValueError:
            raise typer.BadParameter(f"--client-ranks takes integers separated by commas, got {text!r}") from None
        if not cycle:
            raise typer.BadParameter("--client-ranks is empty")
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
    ) -> None:
        """Federated LoRA fine-tuning with heterogeneous client ranks in Flower's simulation engine."""
        from rankwise.verbs import common
        from rankwise.core import io
        from rankwise.federated import FSLoRAConfig
        from rankwise.federated.runner import RunSettings, methods, run_simulation_settings

        if method not in methods():
            raise typer.BadParameter(f"unknown method {method!r}; choose one of {', '.join(methods())}",
                                     param_hint="--method")
        if backend not in ("flower", "inprocess"):
            raise typer.BadParameter(f"unknown backend {backend!r}; choose flower or inprocess", param_hint="--backend")
        if clients < 1:
            raise typer.BadParameter(f"--clients must be >= 1, got {clients}")
        if rounds < 1:
            raise typer.BadParameter(f"--rounds must be >= 1, got {rounds}")
        if resume and out is None:
            raise typer.BadParameter("--resume needs --out (the folder holding checkpoint.safetensors)")
        if task is None:
            task = "synthetic-moe" if method in MOE_METHODS else "minilm"
        spec = TASKS.get(task, task)
        if spec not in TASKS.values() and ":" not in spec:
            raise typer.BadParameter(f"unknown task {task!r}; choose minilm, synthetic, synthetic-moe or "
                                     "pkg.module:factory",
                                     param_hint="--task")
        ranks = _ranks(client_ranks, rank, clients) if method != "fedavg" else {}
        config = FSLoRAConfig(rank=rank, alpha=alpha, client_ranks=ranks, clients_per_round=per_round,
                              local_steps=local_steps, batch_size=batch_size, client_lr=lr, head_lr=head_lr,
                              server_optimizer=server_optimizer, server_lr=server_lr, weighting=weighting, seed=seed)
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
