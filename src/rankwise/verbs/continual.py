"""``rankwise continual``: learn a sequence of text classification tasks, one adapter per task, and measure forgetting.

    rankwise continual --method eblora|lora|olora|inflora --tasks topic,kind,private [--rank R] --out DIR
                       [--model DIR] [--data A.jsonl B.jsonl ...] [--epochs E] [--max-tasks N] [--resume DIR]

The model is the embedded all-MiniLM-L6-v2 (or a local ``save_pretrained`` encoder directory, ``--model``),
mean-pooled, with one linear head per task (fitted as a linear probe, trained with its task, then frozen).
Tasks are zoo text tasks (``--tasks``) or JSONL files (``--data``, one file per task, ``{"text", "label"}`` per
line; a seeded 20 % of each held out; the task is named after the file). The loop, metrics and learners are
:mod:`rankwise.adapt.stiefel_cl.runner` / ``.baselines``: ``eblora`` (rankwise), ``lora`` (sequential PEFT LoRA,
``merge_and_unload`` after each task), ``olora`` (O-LoRA penalty), ``inflora`` (InfLoRA-like projection).

Printed: progress per task, the accuracy matrix, MFN / MAA / BWT / FWT and the worst σ_1/σ_r of each task's
update. Saved in ``--out`` after every task (atomically): ``job.json`` (options, labels, accuracy matrix,
metrics), ``state.safetensors`` (the encoder's linear weights, the heads and the learner's state: EBLoRA's
protected bases and per-task factors, O-LoRA's earlier A, InfLoRA's bases) and, for EBLoRA, every task's
update as a PEFT LoRA directory ``peft/<task>/``. ``--resume DIR`` reloads that state and continues with the
next task (``--tasks`` may append new tasks to the saved list), saving into ``DIR`` (or a new ``--out``, where the
PEFT directories of the earlier tasks are not copied).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import click
import typer
from typer.core import TyperCommand

__all__ = ["ContinualJob", "register", "run_continual_job"]

JOB_FILE = "job.json"
STATE_FILE = "state.safetensors"
_KIND = "rankwise.continual"


@dataclasses.dataclass
class ContinualJob:
    """The options of ``rankwise continual`` (see the module docstring)."""

    method: str = "eblora"
    tasks: tuple[str, ...] = ()
    data: tuple[Path, ...] = ()
    model: Path | None = None
    out: Path | None = None
    resume: Path | None = None
    rank: int = 4
    alpha: float | None = None
    epochs: int = 1
    lr: float = 1e-3
    head_lr: float = 1e-3
    batch_size: int = 16
    max_length: int = 64
    limit_train: int | None = 384
    limit_eval: int | None = 200
    energy_threshold: float = 0.99
    olora_lambda: float = 0.1
    targets: tuple[str, ...] = ()
    max_tasks: int | None = None
    seed: int = 0
    overwrite: bool = False

    def saved(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("data", "tasks", "targets"):
            d[k] = [str(x) for x in d[k]]
        for k in ("model", "out", "resume"):
            d[k] = None if d[k] is None else str(d[k])
        return d


def _validate(job: ContinualJob) -> None:
    from rankwise.adapt.stiefel_cl.baselines import LEARNERS
    from rankwise.core.validate import check_choice, check_int, check_number, check_positive, check_unit

    check_choice("--method", job.method, LEARNERS)
    check_int("--rank", job.rank, 1)
    check_positive("--alpha", job.alpha, allow_none=True)
    check_int("--epochs", job.epochs, 1)
    check_number("--lr", job.lr, 0.0, low_open=True)
    check_number("--head-lr", job.head_lr, 0.0, low_open=True)
    check_int("--batch-size", job.batch_size, 1)
    check_int("--max-length", job.max_length, 4)
    check_int("--limit-train", job.limit_train, 2, allow_none=True)
    check_int("--limit-eval", job.limit_eval, 2, allow_none=True)
    check_unit("--energy-threshold", job.energy_threshold, low_open=True)
    check_number("--olora-lambda", job.olora_lambda, 0.0)
    check_int("--max-tasks", job.max_tasks, 1, allow_none=True)
    if job.tasks and job.data:
        raise ValueError("give zoo tasks (--tasks) or data files (--data), not both")
    if job.out is None and job.resume is None:
        raise ValueError("--out DIR is required (where the state is saved)")


# -- data and model ----------------------------------------------------------------------------------

def _task_data(job: ContinualJob) -> list[tuple[str, list[str], list[tuple[str, int]], list[tuple[str, int]]]]:
    """``(name, labels, train, test)`` per task."""
    out = []
    if job.data:
        from rankwise.train.job import class_labels
        from rankwise.verbs.finetune import read_jsonl

        for path in job.data:
            labels, (rows,) = class_labels(read_jsonl(Path(path)))
            if len(rows) < 5:
                raise ValueError(f"{path}: {len(rows)} examples are too few to hold out a test split")
            order = list(range(len(rows)))
            random.Random(job.seed).shuffle(order)
            n_test = max(1, len(order) // 5)
            test = [rows[i] for i in order[:n_test]][: job.limit_eval]
            train = [rows[i] for i in order[n_test:]][: job.limit_train]
            out.append((Path(path).stem, labels, train, test))
        names = [o[0] for o in out]
        if len(set(names)) != len(names):
            raise ValueError(f"--data files must have distinct names (tasks are named after them), got {names}")
        return out
    from rankwise import zoo

    for name in job.tasks or ("topic", "kind", "private"):
        t = zoo.text_task(name, seed=job.seed, max_train=job.limit_train, max_test=job.limit_eval)
        out.append((name, list(t.labels), list(t.train), list(t.test)))
    return out


def _encoder(job: ContinualJob) -> tuple[Any, Any]:
    """``(BERT-style encoder, tokenizer)``: the embedded MiniLM or ``--model DIR``."""
    if job.model is None:
        from rankwise import zoo

        return zoo.minilm()
    d = Path(job.model)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json (expected a save_pretrained encoder directory)")
    from transformers import AutoModel, AutoTokenizer

    from rankwise.zoo.models import quiet_transformers

    with quiet_transformers():
        model = AutoModel.from_pretrained(str(d), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    return model.eval(), tok


def _pooled_encoder(bert: Any) -> Any:
    import torch
    from torch import nn

    class MeanPooled(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            w = attention_mask[..., None].to(h.dtype)
            return (h * w).sum(1) / w.sum(1).clamp_min(1.0)

    return MeanPooled(bert)


def _batches(tok: Any, rows: Sequence[tuple[str, int]], size: int, max_length: int, seed: int | None) -> list:
    import torch

    order = list(range(len(rows)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    out = []
    for i in range(0, len(order), size):
        chunk = [rows[k] for k in order[i:i + size]]
        enc = tok([t for t, _ in chunk], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        out.append(({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                    torch.tensor([y for _, y in chunk])))
    return out


def _loss(model: Any, batch: Any) -> Any:
    from torch import nn

    x, y = batch
    return nn.functional.cross_entropy(model(**x), y)


# -- the job -------------------------------------------------------------------------------------------

def _resume_job(job: ContinualJob) -> tuple[ContinualJob, dict[str, Any]]:
    from rankwise.core import io

    d = Path(job.resume)
    if not (d / JOB_FILE).is_file() or not (d / STATE_FILE).is_file():
        raise FileNotFoundError(f"--resume {d}: no {JOB_FILE} and {STATE_FILE} (not a rankwise continual output)")
    saved = io.read_json(d / JOB_FILE)
    if saved.get("kind") != _KIND:
        raise ValueError(f"--resume {d}: {JOB_FILE} is not a rankwise continual job")
    opts = dict(saved["options"])
    old_tasks = tuple(opts["tasks"])
    if job.tasks:
        if tuple(job.tasks[: len(old_tasks)]) != old_tasks:
            raise ValueError(f"--tasks must start with the saved tasks {list(old_tasks)} to resume, got {list(job.tasks)}")
        opts["tasks"] = list(job.tasks)
    new = ContinualJob(**{**opts, "tasks": tuple(opts["tasks"]), "data": tuple(Path(p) for p in opts["data"]),
                          "targets": tuple(opts["targets"]),
                          "model": None if opts["model"] is None else Path(opts["model"]),
                          "out": Path(job.out) if job.out is not None else d, "resume": d,
                          "max_tasks": job.max_tasks, "overwrite": job.overwrite})
    return new, saved


def run_continual_job(job: ContinualJob, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run (or resume) ``job``; returns the saved ``job.json`` content."""
    import torch

    from rankwise.adapt.stiefel_cl import BERT_TARGETS
    from rankwise.adapt.stiefel_cl.baselines import make_learner
    from rankwise.adapt.stiefel_cl.runner import ContinualResult, ContinualTask, MultiHeadModel, run_continual
    from rankwise.core import io

    _validate(job)
    saved: dict[str, Any] | None = None
    if job.resume is not None:
        job, saved = _resume_job(job)
    if job.resume is None or Path(job.out).resolve() != Path(job.resume).resolve():
        io.write_dir(job.out, lambda tmp: None, overwrite=job.overwrite or None)  # writable, and empty or --overwrite
    data = _task_data(job)
    if not job.tasks and not job.data:
        job.tasks = tuple(d[0] for d in data)
    bert, tok = _encoder(job)
    hidden = int(bert.config.hidden_size)
    model = MultiHeadModel(_pooled_encoder(bert), hidden)
    targets = job.targets or BERT_TARGETS
    alpha = job.alpha if job.alpha is not None else 2.0 * job.rank
    learner = make_learner(job.method, model, targets, job.rank, alpha, _loss, energy_threshold=job.energy_threshold,
                           olora_lambda=job.olora_lambda, seed=job.seed)
    tasks = [ContinualTask(name, len(labels), _batches(tok, train, job.batch_size, job.max_length, job.seed + k),
                           _batches(tok, test, 64, job.max_length, None),
                           _batches(tok, train, job.batch_size, job.max_length, job.seed + k)[:8])
             for k, (name, labels, train, test) in enumerate(data)]
    start, result = 0, None
    if saved is not None:
        start = len(saved["result"]["R"])
        tensors, meta = io.load_tensors(Path(job.resume) / STATE_FILE)
        with torch.no_grad():
            for n, m in model.encoder.named_modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(tensors[f"encoder/{n}.weight"])
                    if m.bias is not None:
                        m.bias.copy_(tensors[f"encoder/{n}.bias"])
            for k in range(start):
                name = tasks[k].name
                head = model.add_head(name, tasks[k].num_labels, 0)
                head.weight.copy_(tensors[f"head/{name}/weight"])
                head.bias.copy_(tensors[f"head/{name}/bias"])
                head.requires_grad_(False)
        learner.restore({k[len("learner/"):]: v for k, v in tensors.items() if k.startswith("learner/")},
                        meta.get("learner", {}), start)
        r = saved["result"]
        result = ContinualResult(job.method, [t.name for t in tasks],
                                 [row + [None] * (len(tasks) - len(row)) for row in r["R"]],
                                 [[None] * len(tasks) for _ in r["R"]], list(r["before"]), list(r["zero_shot"]),
                                 [{k: (float("nan") if v is None else v) for k, v in s.items()} for s in r["spectra"]])
        # tasks appended on resume have no pretrained-encoder probe (the pretrained weights are gone): FWT n/a
        result.zero_shot += [float("nan")] * (len(tasks) - len(result.zero_shot))
    if job.method == "eblora":
        learner.peft_export = Path(job.out) / "peft"  # type: ignore[attr-defined]
    stop = len(tasks) if job.max_tasks is None else min(len(tasks), start + job.max_tasks)
    if start >= len(tasks):
        raise ValueError(f"every task of {[t.name for t in tasks]} is learned already; add tasks with --tasks")

    def save(i: int, res: ContinualResult) -> None:
        _save(job, model, learner, res, data, i + 1)

    res = run_continual(learner, model, tasks, epochs=job.epochs, lr=job.lr, head_lr=job.head_lr, seed=job.seed,
                        start=start, stop=stop, log=log, after_task=save, result=result)
    return _summary(job, res, data, stop)


def _summary(job: ContinualJob, res: Any, data: Sequence[Any], done: int) -> dict[str, Any]:
    def fin(x: Any) -> Any:
        return None if isinstance(x, float) and x != x else x
    j = res.to_json()
    j["R"] = [[fin(v) for v in row] for row in j["R"]]
    j["zero_shot"] = [fin(v) for v in j["zero_shot"]]
    return {"kind": _KIND, "options": job.saved(), "labels": {d[0]: d[1] for d in data}, "tasks_done": done,
            "n_tasks": len(data), "result": j}


def _save(job: ContinualJob, model: Any, learner: Any, res: Any, data: Sequence[Any], done: int) -> None:
    import torch

    from rankwise.core import io

    tensors: dict[str, torch.Tensor] = {}
    enc = model.encoder
    for n, m in enc.named_modules():
        if isinstance(m, torch.nn.Linear) and not n.endswith(".base_layer"):
            tensors[f"encoder/{n}.weight"] = m.weight.detach()
            if m.bias is not None:
                tensors[f"encoder/{n}.bias"] = m.bias.detach()
        elif hasattr(m, "base_layer") and isinstance(m.base_layer, torch.nn.Linear):
            tensors[f"encoder/{n}.weight"] = m.base_layer.weight.detach()
            if m.base_layer.bias is not None:
                tensors[f"encoder/{n}.bias"] = m.base_layer.bias.detach()
    for name, head in model.heads.items():
        tensors[f"head/{name}/weight"] = head.weight.detach()
        tensors[f"head/{name}/bias"] = head.bias.detach()
    lt, lmeta = learner.state()
    tensors.update({f"learner/{k}": v for k, v in lt.items()})
    summary = _summary(job, res, data, done)
    out = Path(job.out)

    def files(tmp: Path) -> None:
        io.save_tensors(tmp / STATE_FILE, tensors, {"kind": _KIND, "learner": lmeta})
        io.write_json(tmp / JOB_FILE, summary)
        peft = out / "peft"
        if peft.is_dir():
            import shutil

            shutil.copytree(peft, tmp / "peft")
    io.write_dir(out, files, overwrite=True)


def format_matrix(summary: dict[str, Any]) -> list[str]:
    """The accuracy matrix (rows: after task i; columns: task j) and the metrics as text lines."""
    r = summary["result"]
    names = r["tasks"][: len(r["R"])]
    width = max(8, *(len(n) for n in names))
    lines = ["after \\ on".ljust(width + 7) + " ".join(n.rjust(width) for n in names)]
    for i, row in enumerate(r["R"]):
        cells = " ".join(("" if v is None else f"{v:.3f}").rjust(width) for v in row[: len(names)])
        lines.append(f"{i + 1}. {names[i]}".ljust(width + 7) + cells)
    m = r["metrics"]
    show = lambda v: "n/a" if v is None else f"{v:+.4f}" if v < 0 else f"{v:.4f}"  # noqa: E731
    lines.append("MFN " + show(m["MFN"]) + "   MAA " + show(m["MAA"]) + "   BWT " + show(m["BWT"]) + "   FWT "
                 + show(m["FWT"]))
    ratios = [max((v for v in s.values() if v is not None), default=None) for s in r["spectra"]]
    lines.append("max σ1/σr per task update: " + ", ".join("n/a" if v is None else f"{v:.4g}" for v in ratios))
    return lines


class _DataCommand(TyperCommand):
    """``--data A.jsonl B.jsonl`` (several files after one flag) is read as ``--data A.jsonl --data B.jsonl``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(args):
            tok = args[i]
            i += 1
            if tok == "--":
                out += args[i - 1:]
                break
            if tok != "--data":
                out.append(tok)
                continue
            vals = []
            while i < len(args) and not args[i].startswith("-"):
                vals.append(args[i])
                i += 1
            out += [x for v in vals for x in ("--data", v)] if vals else [tok]
        return super().parse_args(ctx, out)


def register(app: typer.Typer) -> None:
    @app.command("continual", cls=_DataCommand)
    def continual_cmd(
        ctx: typer.Context,
        method: str = typer.Option("eblora", "--method", help="eblora, lora (sequential PEFT LoRA), olora, inflora."),
        tasks: Optional[str] = typer.Option(None, "--tasks", help="Zoo text tasks in order, comma-separated "
                                            "(default topic,kind,private)."),
        data: Optional[List[Path]] = typer.Option(None, "--data", help="JSONL files, one per task (in order)."),
        model: Optional[Path] = typer.Option(None, "--model", help="A save_pretrained encoder directory "
                                             "(default: the embedded all-MiniLM-L6-v2)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Save the state and results here (after every task)."),
        resume: Optional[Path] = typer.Option(None, "--resume", help="Continue a saved run with its next task."),
        rank: int = typer.Option(4, "--rank", help="Adapter rank of every task."),
        alpha: Optional[float] = typer.Option(None, "--alpha", help="lora_alpha (default 2 * rank)."),
        epochs: int = typer.Option(1, "--epochs", help="Epochs per task."),
        lr: float = typer.Option(1e-3, "--lr", help="Adapter learning rate."),
        head_lr: float = typer.Option(1e-3, "--head-lr", help="Head learning rate."),
        batch_size: int = typer.Option(16, "--batch-size"),
        max_length: int = typer.Option(64, "--max-length", help="Tokens per text."),
        limit_train: Optional[int] = typer.Option(384, "--limit-train", help="Training examples per task (at most)."),
        limit_eval: Optional[int] = typer.Option(200, "--limit-eval", help="Test examples per task (at most)."),
        energy_threshold: float = typer.Option(0.99, "--energy-threshold", help="ε of the protected subspaces."),
        olora_lambda: float = typer.Option(0.1, "--olora-lambda", help="O-LoRA's penalty λ."),
        targets: Optional[str] = typer.Option(None, "--targets", help="Adapted module names, comma-separated "
                                              "(default: query,key,value,attention.output.dense,intermediate.dense,"
                                              "output.dense)."),
        max_tasks: Optional[int] = typer.Option(None, "--max-tasks", help="Learn at most N tasks in this run."),
        seed: int = typer.Option(0, "--seed"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
    ) -> None:
        """Continual learning of a task sequence (EBLoRA or a baseline); accuracy matrix, MFN/MAA/BWT/FWT."""
        from rankwise.verbs import common

        split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip()) if s else ()  # noqa: E731
        job = ContinualJob(method=method, tasks=split(tasks), data=tuple(data or ()), model=model, out=out,
                           resume=resume, rank=rank, alpha=alpha, epochs=epochs, lr=lr, head_lr=head_lr,
                           batch_size=batch_size, max_length=max_length, limit_train=limit_train,
                           limit_eval=limit_eval, energy_threshold=energy_threshold, olora_lambda=olora_lambda,
                           targets=split(targets), max_tasks=max_tasks, seed=seed, overwrite=overwrite)
        console = common.console()
        quiet = common.settings(ctx).quiet
        summary = run_continual_job(job, log=None if quiet else
                                    (lambda s: console.print(s, markup=False, soft_wrap=True)))
        for line in format_matrix(summary):
            console.print(line, markup=False, soft_wrap=True)
        console.print(f"saved: {summary['options']['out']} ({summary['tasks_done']} of "
                      f"{summary['n_tasks']} tasks learned)", markup=False, soft_wrap=True)
