"""``rankwise finetune``: train an adapter for sequence classification, evaluate it, save it.

    rankwise finetune --method lora|cdka|psoft|e2lora|daf [--optimizer adamw|adams|lracs]
                      [--task NAME | --model DIR --data FILE.jsonl [--eval FILE.jsonl]] [--out DIR]

The same job from Python::

    from rankwise.verbs.finetune import FinetuneJob, run_finetune, load_finetuned
    res = run_finetune(FinetuneJob(method="psoft", task="topic", steps=200, out=Path("runs/psoft")))
    model, tokenizer, meta = load_finetuned("runs/psoft")

Model: the embedded all-MiniLM-L6-v2 with a fresh classification head (default), or a local
``save_pretrained`` directory loaded with ``AutoModelForSequenceClassification`` (its head is kept when
it has as many labels as the data, else replaced by a new seeded one). Data: one of the zoo's text tasks (``rankwise zoo`` docs), or JSONL
files with one ``{"text": ..., "label": ...}`` object per line (labels: ints, or strings mapped to
ids in sorted order); without ``--eval`` a seeded 20 % of ``--data`` is held out.

The adapter is added by the method's own ``adapt`` (``rankwise.adapt.<method>``) with its paper
defaults, overridden by ``--rank`` and ``-o FIELD=VALUE``; the classification head is trained with it
(``--head-lr``). Training uses the shared loop of :mod:`rankwise.train.finetune` (AdamW, warm-up then
linear decay, gradient clipping) or the LoRA-S optimizers AdamS / LRACS of
:mod:`rankwise.train.riemannian_lora` (``--method lora`` only: they act on LoRA factor pairs).

Every ``--eval-every`` steps (and at the end) the model is evaluated on the held-out set and the
output directory is rewritten atomically (a crash never leaves a half-written checkpoint)::

    DIR/adapter/          the method's adapter artefact (its save_adapter; for LoRA a PEFT directory)
    DIR/head.safetensors  the trained classification head
    DIR/finetune.json     method, its config, model source, labels, data, history, final metrics

At the end the saved directory is loaded back into a freshly built model and the held-out logits
are compared with the trained model's (they must be identical; the job fails otherwise).

AdamS / LRACS start from LoRA-S's offset initialisation, which moves the base weights by ``-s B0 A0``
(:func:`rankwise.train.riemannian_lora.offset_init_`); ``finetune.json`` records its seed and
:func:`load_finetuned` rebuilds that base exactly. Such an adapter directory is therefore not a plain
PEFT adapter of the original model (rankwise's fingerprint check refuses it there).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import typer
from torch import nn

from rankwise.core.errors import ArtifactError, RankwiseError

__all__ = ["FinetuneJob", "FinetuneJobResult", "METHODS", "OPTIMIZERS", "load_finetuned", "read_jsonl",
           "run_finetune", "register"]

#: method -> (module, config class). The adapter is added by ``module.adapt(model, config)``.
METHODS: dict[str, tuple[str, str]] = {
    "lora": ("rankwise.adapt.lora", "LoraConfig"),
    "cdka": ("rankwise.adapt.cdka", "CDKAConfig"),
    "psoft": ("rankwise.adapt.psoft", "PSOFTConfig"),
    "e2lora": ("rankwise.adapt.e2lora", "E2LoRAConfig"),
    "daf": ("rankwise.adapt.daf", "DAFConfig"),
}
OPTIMIZERS = ("adamw", "adams", "lracs")
#: adapter learning rate when --lr is not given: the rate each method's reproduction selected on a
#: development split (docs/methods/<method>.md); 1e-3 for a method without one.
DEFAULT_LR = {"lora": 1e-3, "cdka": 3e-3, "psoft": 1e-2, "e2lora": 1e-3, "daf": 3e-4}
HEAD_NAMES = ("classifier", "score")
EMBEDDED = "embedded:all-MiniLM-L6-v2"
FORMAT = "rankwise-finetune"
VERSION = 1
OFFSET_STD = 0.02  # offset init of the LoRA-S optimizers (train.riemannian_lora.offset_init_)


@dataclass
class FinetuneJob:
    """What ``rankwise finetune`` does; the CLI options map one to one onto these fields.

    ``options`` overrides fields of the method's config (``{"alpha": 32.0}``); ``rank`` sets its rank
    field (``rank`` or ``r``). ``steps`` defaults to one epoch of the training data. ``eval_every``
    defaults to a quarter of the steps. ``limit_train`` / ``limit_eval`` cap the examples used.
    """

    method: str = "lora"
    optimizer: str = "adamw"
    task: Optional[str] = None
    model: Optional[Path] = None
    data: Optional[Path] = None
    eval_data: Optional[Path] = None
    out: Optional[Path] = None
    overwrite: bool = False
    rank: Optional[int] = None
    options: dict[str, Any] = field(default_factory=dict)
    lr: Optional[float] = None
    head_lr: float = 1e-3
    steps: Optional[int] = None
    batch_size: int = 16
    max_length: int = 64
    eval_every: Optional[int] = None
    limit_train: Optional[int] = None
    limit_eval: Optional[int] = None
    seed: int = 0


@dataclass
class FinetuneJobResult:
    """What :func:`run_finetune` returns: held-out accuracy/loss history ``[(step, acc, loss)]``, the
    final metrics, parameter counts, the reload check and where the artefact went."""

    method: str
    history: list[tuple[int, float, float]]
    accuracy: float
    loss: float
    train_losses: list[float]
    trainable_parameters: int
    adapter_parameters: int
    total_parameters: int
    labels: list[str]
    n_train: int
    n_eval: int
    reload_max_abs_diff: Optional[float]
    out: Optional[Path]
    seconds: float


# --------------------------------------------------------------------------------------------------
# data


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """``(text, label)`` pairs from a JSONL file of ``{"text": str, "label": int | str}`` objects.

    Raises ``ValueError`` naming the line for malformed JSON, a missing field or a wrong type;
    ``FileNotFoundError`` for a missing file; ``ValueError`` for an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    out: list[tuple[str, Any]] = []
    with path.open("rb") as fh:
        for no, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: not valid JSON ({e.msg})") from None
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


def _label_ids(*sets: Sequence[tuple[str, Any]]) -> tuple[list[str], list[list[tuple[str, int]]]]:
    raw = {lab for s in sets for _, lab in s}
    kinds = {type(lab) for lab in raw}
    if len(kinds) > 1:
        raise ValueError("labels mix ints and strings; use one kind")
    if kinds == {int}:
        if min(raw) < 0:
            raise ValueError(f"int labels must be >= 0, got {min(raw)}")
        names = [str(i) for i in range(max(raw) + 1)]
        return names, [[(t, int(lab)) for t, lab in s] for s in sets]
    names = sorted(raw)
    index = {n: i for i, n in enumerate(names)}
    return names, [[(t, index[lab]) for t, lab in s] for s in sets]


def _load_data(job: FinetuneJob) -> tuple[list[str], list[tuple[str, int]], list[tuple[str, int]], str]:
    if job.task is not None:
        from rankwise import zoo

        task = zoo.text_task(job.task, seed=job.seed)
        train, test, labels, source = task.train, task.test, list(task.labels), f"zoo task {job.task!r}"
    else:
        rows = read_jsonl(job.data)
        if job.eval_data is not None:
            ev = read_jsonl(job.eval_data)
            labels, (train, test) = _label_ids(rows, ev)
            source = f"{job.data} (eval: {job.eval_data})"
        else:
            labels, (rows_i,) = _label_ids(rows)
            if len(rows_i) < 5:
                raise ValueError(f"{job.data}: {len(rows_i)} examples are too few to hold out an eval split; "
                                 "give --eval FILE")
            order = list(range(len(rows_i)))
            random.Random(job.seed).shuffle(order)
            n_eval = max(1, len(order) // 5)
            test = [rows_i[i] for i in order[:n_eval]]
            train = [rows_i[i] for i in order[n_eval:]]
            source = f"{job.data} (20 % held out, seed {job.seed})"
    if len(labels) < 2:
        raise ValueError(f"the data has {len(labels)} label(s); classification needs at least 2")
    if job.limit_train is not None:
        train = train[:job.limit_train]
    if job.limit_eval is not None:
        test = test[:job.limit_eval]
    return labels, train, test, source


# --------------------------------------------------------------------------------------------------
# model and method


def _method_module(method: str) -> Any:
    if method not in METHODS:
        raise ValueError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    mod_name, _ = METHODS[method]
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name == mod_name:
            raise RankwiseError(f"method {method!r} is not implemented in this version of rankwise") from None
        raise


def _method_config(job: FinetuneJob) -> Any:
    mod = _method_module(job.method)
    cls = getattr(mod, METHODS[job.method][1])
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = dict(job.options)
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}; its fields: {', '.join(sorted(fields))}")
    if job.rank is not None:
        rank_field = next((f for f in ("rank", "r", "lora_rank", "base_rank") if f in fields), None)
        if rank_field is None:
            raise ValueError(f"--rank does not apply to {job.method} ({cls.__name__} has no rank field); "
                             f"set its size with -o FIELD=VALUE (fields: {', '.join(sorted(fields))})")
        kwargs[rank_field] = job.rank
    for k, v in list(kwargs.items()):  # JSON lists -> tuples, as the frozen configs expect
        if isinstance(v, list):
            kwargs[k] = tuple(v)
    return cls(**kwargs)


def _build_model(model_dir: Optional[Path], num_labels: int, seed: int) -> tuple[nn.Module, Any]:
    if model_dir is None:
        from rankwise import zoo

        return zoo.minilm_classifier(num_labels, seed=seed)
    model_dir = Path(model_dir)
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


def _head(model: nn.Module) -> tuple[str, nn.Module]:
    for name in HEAD_NAMES:
        mod = getattr(model, name, None)
        if isinstance(mod, nn.Module):
            return name, mod
    raise ValueError(f"{type(model).__name__} has no classification head named {' or '.join(HEAD_NAMES)}")


def _head_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    name, head = _head(model)
    return {f"{name}.{k}": v.detach().clone() for k, v in head.state_dict().items()}


def _calibration(job: FinetuneJob, tokenizer: Any, train: list[tuple[str, int]], n: int) -> list[dict[str, Any]]:
    """``n`` training batches as ``model(**batch)`` keyword dicts with labels (so ``.loss`` is the CE)."""
    from rankwise.train.finetune import FinetuneConfig, make_batches

    cfg = FinetuneConfig(batch_size=job.batch_size, max_length=job.max_length, seed=job.seed + 1)
    return [dict(b.inputs, labels=b.labels) for b in make_batches(tokenizer, train, cfg, steps=n)]


def _apply_method(job: FinetuneJob, config: Any, model: nn.Module, tokenizer: Any,
                  train: list[tuple[str, int]], total_steps: int) -> Any:
    """Add the adapter; returns a per-step hook ``f(trainer, step_done)`` for methods that need one (DAF)."""
    mod = _method_module(job.method)
    kwargs: dict[str, Any] = {}
    if job.method == "cdka" and (config.config_mode == "aligned" or config.init == "gradient"):
        kwargs["calib"] = _calibration(job, tokenizer, train, config.calib_batches)
    if job.method == "e2lora":  # the gradient-entropy plan comes from a calibration pass of the frozen model
        kwargs["calib"] = _calibration(job, tokenizer, train, config.n_calib_batches)
    if job.method == "daf":  # round 0 of the sensitivity analysis, then periodic rounds during training
        kwargs["batches"] = _calibration(job, tokenizer, train, config.analysis_batches)
    mod.adapt(model, config, **kwargs)
    for p in _head(model)[1].parameters():
        p.requires_grad_(True)
    if job.method == "daf":
        controller = mod.DAFController(model, kwargs["batches"], total_steps=total_steps)
        hooks: dict[int, Any] = {}

        def daf_hook(trainer: Any, step_done: int) -> None:
            if id(trainer) not in hooks:
                hooks[id(trainer)] = controller.callback(trainer)
            hooks[id(trainer)](step_done - 1)
        return daf_hook
    return None


def _optimizer_factory(job: FinetuneJob, model: nn.Module, lr: float) -> Callable[[list[nn.Parameter]], Any]:
    head_ids = {id(p) for p in _head(model)[1].parameters()}
    if job.optimizer == "adamw":
        def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            groups = [{"params": [p for p in params if id(p) not in head_ids], "lr": lr},
                      {"params": [p for p in params if id(p) in head_ids], "lr": job.head_lr}]
            return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=0.0)
        return make
    from rankwise.train import riemannian_lora as rl

    cls = rl.AdamS if job.optimizer == "adams" else rl.LRACS

    def make_lifted(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        pairs = rl.lora_factor_pairs(model)
        ids = {id(t) for p in pairs for t in (p.lora_A, p.lora_B)}
        others = [p for p in params if id(p) not in ids]
        return cls(pairs, lr=lr, other_params=others, other_lr=job.head_lr)
    return make_lifted


def _validate(job: FinetuneJob) -> None:
    if job.method not in METHODS:
        raise ValueError(f"--method {job.method!r} is not one of {', '.join(METHODS)}")
    if job.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {job.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if job.optimizer != "adamw" and job.method != "lora":
        raise ValueError(f"--optimizer {job.optimizer} acts on LoRA factor pairs; use it with --method lora "
                         f"(got --method {job.method})")
    if (job.task is None) == (job.data is None):
        raise ValueError("give exactly one of --task NAME or --data FILE.jsonl")
    if job.eval_data is not None and job.data is None:
        raise ValueError("--eval needs --data")
    for name in ("steps", "batch_size", "eval_every", "limit_train", "limit_eval", "rank"):
        v = getattr(job, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {v!r}")
    if isinstance(job.max_length, bool) or not isinstance(job.max_length, int) or job.max_length < 2:
        raise ValueError(f"--max-length must be an int >= 2, got {job.max_length!r}")
    for name in ("lr", "head_lr"):
        v = getattr(job, name)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v!r}")
    if job.out is not None:
        out = Path(job.out)
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"--out {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not job.overwrite:
            raise FileExistsError(f"--out {out} exists and is not empty; pass --overwrite to replace it")


# --------------------------------------------------------------------------------------------------
# save / load


def _save(job: FinetuneJob, model: nn.Module, config: Any, meta: dict[str, Any], out: Path) -> None:
    from rankwise.core import io

    mod = _method_module(job.method)
    with io.atomic_dir(out, overwrite=True) as tmp:
        mod.save_adapter(model, tmp / "adapter", "default")
        io.save_tensors(tmp / "head.safetensors", _head_tensors(model), {"kind": "rankwise-classification-head"})
        io.write_json(tmp / "finetune.json", dict(meta, method_config=_jsonable(dataclasses.asdict(config))))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def load_finetuned(directory: str | Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Rebuild the model a ``rankwise finetune`` run saved: ``(model, tokenizer, metadata)``.

    Builds the base model (the embedded MiniLM or the recorded ``--model`` directory) with a head of
    the recorded size, loads the trained head, then the adapter through the method's ``load_adapter``
    (which checks the base-model fingerprint). Raises ArtifactError for a missing/corrupt artefact.
    The model is returned in eval mode.
    """
    from rankwise.core import io

    directory = Path(directory)
    if not (directory / "finetune.json").is_file():
        raise ArtifactError(f"{directory}: not a rankwise finetune directory (no finetune.json)")
    meta = io.read_json(directory / "finetune.json")
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{directory}/finetune.json: format {meta.get('format')!r} is not {FORMAT!r}")
    method = meta.get("method")
    if method not in METHODS:
        raise ArtifactError(f"{directory}/finetune.json: unknown method {method!r}")
    source = meta.get("model")
    model, tokenizer = _build_model(None if source == EMBEDDED else Path(source), len(meta["labels"]),
                                    int(meta.get("seed", 0)))
    name, head = _head(model)
    tensors, _ = io.load_tensors(directory / "head.safetensors")
    want = {f"{name}.{k}" for k in head.state_dict()}
    if set(tensors) != want:
        raise ArtifactError(f"{directory}/head.safetensors: tensors {sorted(tensors)} do not match the head {sorted(want)}")
    with torch.no_grad():
        for k, v in head.state_dict().items():
            t = tensors[f"{name}.{k}"]
            if t.shape != v.shape:
                raise ArtifactError(f"{directory}/head.safetensors: {name}.{k} has shape {tuple(t.shape)}, "
                                    f"the head needs {tuple(v.shape)}")
            v.copy_(t)
    mod = _method_module(method)
    offset = meta.get("offset_init")
    if offset is not None:
        # AdamS/LRACS runs start from the offset init, which moved the base weights by -s B0 A0; rebuild
        # that base exactly (same adapter layout, same seed) before loading the trained factors over it
        from rankwise.train.riemannian_lora import offset_init_

        cls = getattr(mod, METHODS[method][1])
        fields = {f.name for f in dataclasses.fields(cls)}
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["method_config"].items() if k in fields}
        mod.adapt(model, cls(**cfg))
        offset_init_(model, seed=int(offset["seed"]), std=float(offset["std"]))
    mod.load_adapter(model, directory / "adapter", "default")
    model.eval()
    return model, tokenizer, meta


# --------------------------------------------------------------------------------------------------
# the job


def run_finetune(job: FinetuneJob, progress: bool = False,
                 log: Callable[[str], None] | None = None) -> FinetuneJobResult:
    """Train, evaluate periodically, save (if ``job.out``), reload and compare. See the module docstring."""
    from rankwise.train.finetune import FinetuneConfig, Trainer, evaluate, make_batches

    t0 = time.perf_counter()
    say = log or (lambda s: None)
    _validate(job)
    config = _method_config(job)  # bad -o / --rank fail here, before any work
    labels, train, test, source = _load_data(job)
    model, tokenizer = _build_model(job.model, len(labels), job.seed)
    total = sum(p.numel() for p in model.parameters())
    steps = job.steps if job.steps is not None else max(1, math.ceil(len(train) / job.batch_size))
    step_hook = _apply_method(job, config, model, tokenizer, train, steps)
    head_ids = {id(p) for p in _head(model)[1].parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_adapter = sum(p.numel() for p in trainable if id(p) not in head_ids)
    lr = job.lr if job.lr is not None else DEFAULT_LR.get(job.method, 1e-3)
    eval_every = job.eval_every if job.eval_every is not None else max(1, steps // 4)
    cfg = FinetuneConfig(lr=lr, steps=steps, batch_size=job.batch_size, max_length=job.max_length, seed=job.seed)
    if job.optimizer != "adamw":
        from rankwise.train.riemannian_lora import offset_init_

        offset_init_(model, seed=job.seed, std=OFFSET_STD)  # the lift needs full-rank factors (B = 0 at init)
    trainer = Trainer(model, cfg, steps, _optimizer_factory(job, model, lr))
    say(f"{job.method}: {n_adapter:,} adapter + {n_trainable - n_adapter:,} head parameters trained of "
        f"{total:,}; {len(train)} training / {len(test)} held-out examples from {source}; {steps} steps, lr {lr:g}")
    meta: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "method": job.method, "optimizer": job.optimizer,
        "model": EMBEDDED if job.model is None else str(Path(job.model).resolve()),
        "labels": labels, "data": source, "seed": job.seed, "lr": lr, "head_lr": job.head_lr,
        "steps": steps, "batch_size": job.batch_size, "max_length": job.max_length,
        "trainable_parameters": n_trainable, "adapter_parameters": n_adapter,
    }
    if job.optimizer != "adamw":
        meta["offset_init"] = {"seed": job.seed, "std": OFFSET_STD}
    history: list[tuple[int, float, float]] = []

    def checkpoint(step: int) -> Any:
        ev = evaluate(model, tokenizer, test, max_length=job.max_length)
        history.append((step, ev.accuracy, ev.loss))
        say(f"step {step}/{steps}: held-out accuracy {ev.accuracy:.4f}, loss {ev.loss:.4f}, "
            f"train loss {trainer.losses[-1]:.4f}")
        if job.out is not None:
            _save(job, model, config, dict(meta, history=history, steps_done=step), Path(job.out))
        return ev

    batches = make_batches(tokenizer, train, cfg, steps=steps)
    last = None
    bar = _progress_bar(progress, steps)
    with bar:
        task = bar.add_task(f"finetune {job.method}", total=steps) if progress else None
        for i, batch in enumerate(batches, 1):
            trainer.step(batch)
            if step_hook is not None:
                step_hook(trainer, i)
            if progress:
                bar.update(task, advance=1, description=f"finetune {job.method} loss {trainer.losses[-1]:.3f}")
            if i % eval_every == 0 or i == steps:
                last = checkpoint(i)
    diff = None
    if job.out is not None:
        reloaded, _, _ = load_finetuned(job.out)
        ev2 = evaluate(reloaded, tokenizer, test, max_length=job.max_length)
        diff = float((ev2.logits - last.logits).abs().max())
        if diff != 0.0:
            raise ArtifactError(f"{job.out}: the reloaded model's held-out logits differ from the trained "
                                f"model's by {diff:g} (expected identical)")
    return FinetuneJobResult(method=job.method, history=history, accuracy=last.accuracy, loss=last.loss,
                             train_losses=list(trainer.losses), trainable_parameters=n_trainable,
                             adapter_parameters=n_adapter, total_parameters=total, labels=labels,
                             n_train=len(train), n_eval=len(test), reload_max_abs_diff=diff,
                             out=None if job.out is None else Path(job.out), seconds=time.perf_counter() - t0)


def _progress_bar(enabled: bool, total: int) -> Any:
    import contextlib

    if not enabled:
        class _Null(contextlib.nullcontext):
            def add_task(self, *a: Any, **k: Any) -> None:
                return None
        return _Null()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    transient=True)


# --------------------------------------------------------------------------------------------------
# the command


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
        method: str = typer.Option("lora", "--method", help=f"Adapter: {', '.join(METHODS)}."),
        optimizer: str = typer.Option("adamw", "--optimizer", help="adamw, or adams / lracs (LoRA-S; --method lora)."),
        task: Optional[str] = typer.Option(None, "--task", help="A zoo text task (default 'topic' when no --data)."),
        model: Optional[Path] = typer.Option(None, "--model", help="A save_pretrained model directory "
                                             "(default: the embedded all-MiniLM-L6-v2)."),
        data: Optional[Path] = typer.Option(None, "--data", help="Training data, JSONL {\"text\", \"label\"}."),
        eval_data: Optional[Path] = typer.Option(None, "--eval", help="Held-out JSONL (default: 20 % of --data)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Save adapter, head and metadata here."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
        rank: Optional[int] = typer.Option(None, "--rank", help="The method's rank field (rank / r)."),
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
        """Fine-tune an adapter for text classification; evaluate periodically; save and verify the reload."""
        from rankwise.verbs import common

        if task is None and data is None:
            task = "topic"
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
