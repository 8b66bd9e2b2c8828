"""``rankwise finetune``: train an adapter for sequence classification, evaluate it, save it.

    rankwise finetune --method lora|cdka|psoft|e2lora|daf|mtlora|lora_mixer [--optimizer adamw|adams|lracs]
                      [--task NAME | --model DIR --data FILE.jsonl [--eval FILE.jsonl]] [--out DIR]
    rankwise finetune --method vapt|vpt-deep|vpt-shallow|lora [--task rot90 | --model VIT_DIR --data FILE.npz
                      [--eval FILE.npz]] [--out DIR]

Image tasks (a prompt method, a zoo digits task, or ``.npz`` data) go to :mod:`rankwise.verbs.finetune_image`
and :mod:`rankwise.train.image_job`: the same evaluation, saving and reload check on a ViT.

The job itself is :mod:`rankwise.train.job` (it resolves the method through the registry; see there for
what is trained, saved and verified). This verb resolves what the job does not know about: the data
(one of the zoo's text tasks, or JSONL files with one ``{"text": ..., "label": ...}`` object per line;
labels are ints or strings, classes are the distinct labels in sorted order; without ``--eval`` a seeded
20 % of ``--data`` is held out) and the model (the embedded all-MiniLM-L6-v2 with a fresh classification
head by default, or a local ``save_pretrained`` directory loaded with ``AutoModelForSequenceClassification``;
its head is kept when it has as many labels as the data, else replaced by a new seeded one).

From Python, with the zoo defaults::

    from rankwise.verbs.finetune import FinetuneJob, run_finetune, load_finetuned
    res = run_finetune(FinetuneJob(method="psoft", task="topic", steps=200, out=Path("runs/psoft")))
    model, tokenizer, meta = load_finetuned("runs/psoft")
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import typer

from rankwise.core.textfiles import iter_jsonl

if TYPE_CHECKING:
    from torch import nn

    from rankwise.train.job import FinetuneData, FinetuneJob, FinetuneJobResult

# torch and the job are imported on first use, so that `rankwise --help` imports neither
_LAZY = {"FinetuneData", "FinetuneJob", "FinetuneJobResult"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rankwise.train import job

        return getattr(job, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FinetuneData", "FinetuneJob", "FinetuneJobResult", "build_model", "load_data", "load_finetuned",
           "read_jsonl", "run_finetune", "register"]


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """``(text, label)`` pairs from a JSONL file of ``{"text": str, "label": int | str}`` objects.

    Raises ``ValueError`` naming the line for malformed JSON, a missing field or a wrong type;
    ``FileNotFoundError`` for a missing file; ``ValueError`` for an empty file.
    """
    out: list[tuple[str, Any]] = []
    for no, obj in iter_jsonl(path):
        if not isinstance(obj, dict) or "text" not in obj or "label" not in obj:
            raise ValueError(f"{path}:{no}: expected an object with 'text' and 'label'")
        text, label = obj["text"], obj["label"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{no}: 'text' must be a non-empty string")
        if isinstance(label, bool) or not isinstance(label, (int, str)):
            raise ValueError(f"{path}:{no}: 'label' must be an int or a string, got {label!r}")
        out.append((text, label))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def load_data(job: FinetuneJob) -> FinetuneData:
    """The job's data: a zoo text task (``job.task``) or JSONL files (``job.data``, ``job.eval_data``)."""
    from rankwise.train.job import FinetuneData, class_labels

    if (job.task is None) == (job.data is None):
        raise ValueError("give exactly one of --task NAME or --data FILE.jsonl")
    if job.task is not None:
        from rankwise import zoo

        task = zoo.text_task(job.task, seed=job.seed)
        return FinetuneData(list(task.labels), list(task.train), list(task.test), f"zoo task {job.task!r}")
    rows = read_jsonl(job.data)
    if job.eval_data is not None:
        labels, (train, test) = class_labels(rows, read_jsonl(job.eval_data))
        return FinetuneData(labels, train, test, f"{job.data} (eval: {job.eval_data})")
    labels, (rows_i,) = class_labels(rows)
    if len(rows_i) < 5:
        raise ValueError(f"{job.data}: {len(rows_i)} examples are too few to hold out an eval split; give --eval FILE")
    order = list(range(len(rows_i)))
    random.Random(job.seed).shuffle(order)
    n_eval = max(1, len(order) // 5)
    return FinetuneData(labels, [rows_i[i] for i in order[n_eval:]], [rows_i[i] for i in order[:n_eval]],
                        f"{job.data} (20 % held out, seed {job.seed})")


def build_model(source: Optional[str], num_labels: int, seed: int) -> tuple[nn.Module, Any]:
    """The embedded MiniLM classifier (``source`` None) or a ``save_pretrained`` directory with a seeded head."""
    if source is None:
        from rankwise import zoo

        return zoo.minilm_classifier(num_labels, seed=seed)
    model_dir = Path(source)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such directory (expected a save_pretrained layout)")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: no config.json (expected a save_pretrained layout)")
    from rankwise.compress.model_dir import load_model_dir

    # dense or compressed; a head of another size than the data's labels is replaced by a new one (seeded);
    # any other missing or unexpected weight, or a missing tokenizer, is refused
    model, tokenizer = load_model_dir(model_dir, task="sequence-classification", num_labels=num_labels, seed=seed)
    if getattr(tokenizer, "pad_token", None) is None:
        if getattr(tokenizer, "eos_token", None) is None:
            raise ValueError(f"--model {model_dir}: the tokenizer has no pad and no eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer


def run_finetune(job: FinetuneJob, progress: bool = False,
                 log: Callable[[str], None] | None = None) -> FinetuneJobResult:
    """:func:`rankwise.train.job.run_finetune` with the data and model resolved as ``rankwise finetune`` does."""
    from rankwise.train import job as _job
    from rankwise.verbs import finetune_image

    if finetune_image.is_image_job(job):
        return finetune_image.run_image(job, progress=progress, log=log)
    _job.validate_job(job)  # every option (and --out's writability) before the data or the model is read
    if job.model is not None and not Path(job.model).is_dir():
        raise FileNotFoundError(f"--model {job.model}: no such directory (expected a save_pretrained layout)")
    return _job.run_finetune(job, load_data(job), build_model, progress=progress, log=log)


def load_finetuned(directory: str | Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """:func:`rankwise.train.job.load_finetuned` with this verb's model builder (embedded MiniLM or a directory);
    an image run gives ``(model, None, metadata)``."""
    from rankwise.train import job as _job

    meta_path = Path(directory) / "finetune.json"
    if meta_path.is_file():
        from rankwise.core import io

        if io.read_json(meta_path).get("modality") == "image":
            from rankwise.verbs.finetune_image import load_finetuned_image

            model, meta = load_finetuned_image(directory)
            return model, None, meta
    return _job.load_finetuned(directory, build_model)


def _parse_options(values: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values:
        if "=" not in item:
            raise ValueError(f"-o {item!r}: expected FIELD=VALUE")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"-o {item!r}: empty field name")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw  # a bare string, e.g. -o cayley=exact
    return out


def register(app: typer.Typer) -> None:
    @app.command("finetune")
    def finetune_cmd(
        ctx: typer.Context,
        method: str = typer.Option("lora", "--method", help="Adapter method id: lora, cdka, psoft, e2lora, daf, "
                                   "mtlora, lora_mixer (any registered adapter; `rankwise list`); for images: "
                                   "vapt, vpt-deep, vpt-shallow, lora."),
        optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, or adams / lracs (LoRA-S; --method lora)."),
        task: Optional[str] = typer.Option(None, "--task", help="A zoo text task (default 'topic' when no --data), "
                                           "or a zoo digits task (rot90, digits5to9, inverted, ...; default 'rot90' "
                                           "for vapt / vpt-*)."),
        model: Optional[Path] = typer.Option(None, "--model", help="A save_pretrained model directory "
                                             "(default: the embedded all-MiniLM-L6-v2)."),
        data: Optional[Path] = typer.Option(None, "--data", help="Training data, JSONL {\"text\", \"label\"}, or "
                                            "an .npz of 'images' and 'labels'."),
        eval_data: Optional[Path] = typer.Option(None, "--eval", help="Held-out JSONL / .npz (default: 20 % of --data)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Save adapter, head and metadata here."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
        rank: Optional[int] = typer.Option(None, "--rank", help="The method config's rank field."),
        option: Optional[list[str]] = typer.Option(None, "--option", "-o", help="FIELD=VALUE of the method's "
                                                   "config (JSON values), repeatable."),
        lr: Optional[float] = typer.Option(None, "--lr", help="Adapter learning rate (default: per method)."),
        head_lr: float = typer.Option(1e-3, "--head-lr", help="Classification head learning rate."),
        steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default: one epoch)."),
        batch_size: int = typer.Option(16, "--batch-size"),
        max_length: int = typer.Option(64, "--max-length", help="Tokens per text."),
        eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Evaluate and save every N steps "
                                                 "(default: 4 times per run)."),
        limit_train: Optional[int] = typer.Option(None, "--limit-train", help="Use at most N training examples."),
        limit_eval: Optional[int] = typer.Option(None, "--limit-eval", help="Use at most N held-out examples."),
        seed: int = typer.Option(0, "--seed"),
    ) -> None:
        """Fine-tune an adapter for text or image classification; evaluate periodically; save and verify the reload."""
        from rankwise.train.job import FinetuneJob
        from rankwise.verbs import common

        if task is None and data is None:
            from rankwise.verbs.finetune_image import PROMPT_METHODS

            task = "rot90" if method in PROMPT_METHODS else "topic"
        job = FinetuneJob(method=method, optimizer=optimizer, task=task, model=model, data=data,
                          eval_data=eval_data, out=out, overwrite=overwrite, rank=rank,
                          options=_parse_options(option or []), lr=lr, head_lr=head_lr, steps=steps,
                          batch_size=batch_size, max_length=max_length, eval_every=eval_every,
                          limit_train=limit_train, limit_eval=limit_eval, seed=seed)
        console = common.console()
        quiet = common.settings(ctx).quiet
        res = run_finetune(job, progress=common.progress(ctx), log=None if quiet else
                           (lambda s: console.print(s, markup=False, soft_wrap=True)))
        console.print(f"{res.method}: held-out accuracy {res.accuracy:.4f} (loss {res.loss:.4f}) on {res.n_eval} "
                      f"examples after {len(res.train_losses)} steps; {res.adapter_parameters:,} adapter parameters; "
                      f"{res.seconds:.1f} s", markup=False, soft_wrap=True)
        if res.out is not None:
            console.print(f"saved: {res.out} (reloaded: held-out logits identical)", markup=False, soft_wrap=True)
