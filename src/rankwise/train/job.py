"""A fine-tuning job: any registered adapter method, a sequence classifier, text data -> trained, saved, verified.

This is the library behind ``rankwise finetune``::

    from rankwise.train.job import FinetuneJob, FinetuneData, run_finetune, load_finetuned
    data = FinetuneData(labels=["neg", "pos"], train=[("good", 1), ...], test=[...], source="my data")
    res = run_finetune(FinetuneJob(method="lora", steps=200, out=Path("runs/lora")), data, build_model)
    model, tokenizer, meta = load_finetuned("runs/lora", build_model)

``build_model(source, num_labels, seed) -> (model, tokenizer)`` builds the classifier: ``source`` is
``job.model`` (a ``save_pretrained`` directory) or None for the caller's default; ``rankwise finetune``
passes one that knows the embedded MiniLM. The job never imports ``zoo`` or ``adapt``: the method is
resolved through :mod:`rankwise.core.registry` (its config class, its ``adapt`` entry point and its
:class:`~rankwise.core.adapters.AdapterMethod`, which declares what a run needs: calibration batches
for ``adapt(..., calib=...)``, a per-step training hook such as DAF's re-allocation, an auxiliary loss
added to the cross-entropy such as mtLoRA's regularisers or LoRA-Mixer's routing loss, the default learning
rate, whether LoRA factor-pair optimizers apply). There are no per-method branches here.

The adapter is added with the method's paper defaults, overridden by ``job.rank`` (the config's
``rank`` field) and ``job.options``; the classification head trains with it (``head_lr``). Training
uses :class:`rankwise.train.finetune.Trainer` (AdamW, warm-up then linear decay, clipping) or the LoRA-S
optimizers AdamS / LRACS (:mod:`rankwise.train.riemannian_lora`; factor-pair methods only, starting
from LoRA-S's offset initialisation, which moves the base weights by ``-s B0 A0``; ``finetune.json``
records its seed and :func:`load_finetuned` rebuilds that base exactly).

Every ``eval_every`` steps (and at the end) the model is evaluated and ``job.out`` is rewritten
atomically::

    DIR/adapter/          the method's adapter artefact (its save_adapter; for LoRA a PEFT directory)
    DIR/head.safetensors  the trained classification head
    DIR/finetune.json     method, its config, model source, labels, data, history, final metrics

At the end the directory is loaded back into a freshly built model and the held-out logits are
compared with the trained model's (they must be identical; the job fails otherwise). ``job.out`` is
checked for writability before any work starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from rankwise.core import io, registry
from rankwise.core.adapters import AdapterMethod
from rankwise.core.errors import ArtifactError, UnknownMethodError

__all__ = ["FinetuneData", "FinetuneJob", "FinetuneJobResult", "MAX_CLASSES", "ModelBuilder", "OPTIMIZERS",
           "adapter_method", "check_fields", "check_writable", "class_labels", "finetune_methods", "load_finetuned",
           "method_config", "run_finetune", "validate_job"]

OPTIMIZERS = ("adamw", "adams", "lracs")
HEAD_NAMES = ("classifier", "score")
EMBEDDED = "embedded:all-MiniLM-L6-v2"
FORMAT = "rankwise-finetune"
VERSION = 1
OFFSET_STD = 0.02  # offset init of the LoRA-S optimizers (train.riemannian_lora.offset_init_)
#: most classes a job accepts (a classification head over more is almost surely a label column mistake)
MAX_CLASSES = 1000

#: ``build_model(source, num_labels, seed) -> (model, tokenizer)``; ``source`` None: the caller's default model
ModelBuilder = Callable[[Optional[str], int, int], tuple[nn.Module, Any]]


@dataclass
class FinetuneJob:
    """What ``rankwise finetune`` does; the CLI options map one to one onto these fields.

    ``options`` overrides fields of the method's config (``{"alpha": 32.0}``); ``rank`` sets its ``rank``
    field. ``steps`` defaults to one epoch of the training data. ``eval_every`` defaults to a quarter of
    the steps. ``limit_train`` / ``limit_eval`` cap the examples used. ``task`` / ``data`` /
    ``eval_data`` say where the data come from (resolved by the caller into :class:`FinetuneData`);
    ``model`` is the model directory (None: the caller's default).
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
class FinetuneData:
    """Class names and ``(text, class index)`` examples; ``source`` describes where they came from."""

    labels: list[str]
    train: list[tuple[str, int]]
    test: list[tuple[str, int]]
    source: str = "given data"


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
# labels


def class_labels(*sets: Sequence[tuple[str, Any]]) -> tuple[list[str], list[list[tuple[str, int]]]]:
    """Class names from the labels present and each set's examples with class indices.

    Labels are ints or strings (not mixed); classes are the distinct labels in sorted order (so int labels
    ``0..K-1`` keep their meaning, and a label ``10**12`` is one class, not ``10**12 + 1``). More than
    :data:`MAX_CLASSES` distinct labels raise ``ValueError``.
    """
    raw = {lab for s in sets for _, lab in s}
    kinds = {type(lab) for lab in raw}
    if len(kinds) > 1:
        raise ValueError("labels mix ints and strings; use one kind")
    if kinds == {int} and min(raw) < 0:
        raise ValueError(f"int labels must be >= 0, got {min(raw)}")
    if len(raw) > MAX_CLASSES:
        raise ValueError(f"the data has {len(raw)} distinct labels; at most {MAX_CLASSES} classes are supported "
                         "(is the label field right?)")
    ordered = sorted(raw)
    index = {lab: i for i, lab in enumerate(ordered)}
    return [str(lab) for lab in ordered], [[(t, index[lab]) for t, lab in s] for s in sets]


# --------------------------------------------------------------------------------------------------
# the method, through the registry


def finetune_methods() -> list[str]:
    """Ids of the registered adapter methods a job can train (those that register an AdapterMethod)."""
    registry.discover()
    ids = [i for i in registry.all_ids()
           if registry.info(i).family == "adapt" and registry.status(i) != "planned"
           and isinstance(registry.get(i).extras.get("adapter"), AdapterMethod)]
    return [i for i in ids if registry.get(i).kind == "reference"] + [i for i in ids if registry.get(i).kind != "reference"]


def adapter_method(method: str) -> tuple[registry.MethodEntry, AdapterMethod]:
    """The registry entry of ``method`` and its AdapterMethod; ValueError naming the choices otherwise."""
    choices = finetune_methods()
    if method not in choices:
        raise ValueError(f"--method {method!r} is not one of {', '.join(choices)}")
    try:
        entry = registry.get(method)
    except UnknownMethodError as e:  # pragma: no cover - finetune_methods() lists registered ones only
        raise ValueError(str(e)) from None
    return entry, entry.extras["adapter"]


def method_config(job: FinetuneJob, config_cls: type) -> Any:
    """The method's config: its defaults, ``job.options`` and ``job.rank`` applied (unknown fields refused)."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    old = dict(getattr(config_cls, "deprecated_fields", {}))
    kwargs = dict(job.options)
    unknown = sorted(set(kwargs) - fields - set(old))
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field(s) {', '.join(unknown)}; "
                         f"its fields: {', '.join(sorted(fields))}")
    if job.rank is not None:
        if "rank" not in fields:
            raise ValueError(f"--rank does not apply to {job.method} ({config_cls.__name__} has no rank field); "
                             f"set its size with -o FIELD=VALUE (fields: {', '.join(sorted(fields))})")
        kwargs["rank"] = job.rank
    for k, v in list(kwargs.items()):  # JSON lists -> tuples, as the frozen configs expect
        if isinstance(v, list):
            kwargs[k] = tuple(v)
    return config_cls(**kwargs)


# --------------------------------------------------------------------------------------------------
# checks before any work


def check_writable(out: Path) -> None:
    """Raise (one line, naming ``--out``) unless ``out`` can be created and written; nothing is left behind."""
    out = Path(out)
    probe = out if out.exists() else out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"--out {out}: {probe} is not a directory")
    try:
        with tempfile.TemporaryDirectory(prefix=".rankwise-write-check.", dir=probe):
            pass
    except OSError as e:
        raise PermissionError(f"--out {out}: cannot write in {probe} ({e.strerror or e})") from None


def validate_job(job: FinetuneJob) -> AdapterMethod:
    """Check every field (and that ``job.out`` is writable) before any work; returns the method's AdapterMethod."""
    _, am = adapter_method(job.method)
    if job.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {job.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if job.optimizer != "adamw" and not am.factor_pairs:
        pairs = [m for m in finetune_methods() if registry.get(m).extras["adapter"].factor_pairs]
        raise ValueError(f"--optimizer {job.optimizer} acts on LoRA factor pairs; use it with --method "
                         f"{' / '.join(pairs)} (got --method {job.method})")
    check_fields(job)
    return am


def check_fields(job: FinetuneJob) -> None:
    """The checks every job shares (text or image): data options, sizes, rates, ``--out``'s writability."""
    if job.task is not None and job.data is not None:
        raise ValueError("give exactly one of --task NAME or --data FILE")
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
        check_writable(out)


# --------------------------------------------------------------------------------------------------
# model pieces


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


# --------------------------------------------------------------------------------------------------
# save / load


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _save(am: AdapterMethod, model: nn.Module, config: Any, meta: dict[str, Any], out: Path) -> None:
    with io.atomic_dir(out, overwrite=True) as tmp:
        am.save_adapter(model, tmp / "adapter", "default")
        io.save_tensors(tmp / "head.safetensors", _head_tensors(model), {"kind": "rankwise-classification-head"})
        io.write_json(tmp / "finetune.json", dict(meta, method_config=_jsonable(dataclasses.asdict(config))))


def load_finetuned(directory: str | Path, build_model: ModelBuilder) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Rebuild the model a fine-tuning job saved: ``(model, tokenizer, metadata)``, in eval mode.

    Builds the base model with ``build_model`` (the recorded model directory, or None for the default),
    loads the trained head, then the adapter through the method's ``load_adapter`` (which checks the
    base-model fingerprint). Raises ArtifactError for a missing/corrupt artefact.
    """
    directory = Path(directory)
    if not (directory / "finetune.json").is_file():
        raise ArtifactError(f"{directory}: not a rankwise finetune directory (no finetune.json)")
    meta = io.read_json(directory / "finetune.json")
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{directory}/finetune.json: format {meta.get('format')!r} is not {FORMAT!r}")
    method = meta.get("method")
    try:
        entry, am = adapter_method(method)
    except ValueError:
        raise ArtifactError(f"{directory}/finetune.json: unknown method {method!r}") from None
    source = meta.get("model")
    model, tokenizer = build_model(None if source == EMBEDDED else source, len(meta["labels"]),
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
    offset = meta.get("offset_init")
    if offset is not None:
        # AdamS/LRACS runs start from the offset init, which moved the base weights by -s B0 A0; rebuild
        # that base exactly (same adapter layout, same seed) before loading the trained factors over it
        from rankwise.train.riemannian_lora import offset_init_

        fields = {f.name for f in dataclasses.fields(entry.config)}
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["method_config"].items() if k in fields}
        entry.entry(model, entry.config(**cfg))
        offset_init_(model, seed=int(offset["seed"]), std=float(offset["std"]))
    am.load_adapter(model, directory / "adapter", "default")
    model.eval()
    return model, tokenizer, meta


# --------------------------------------------------------------------------------------------------
# the job


def run_finetune(job: FinetuneJob, data: FinetuneData, build_model: ModelBuilder, progress: bool = False,
                 log: Callable[[str], None] | None = None) -> FinetuneJobResult:
    """Train, evaluate periodically, save (if ``job.out``), reload and compare. See the module docstring."""
    from rankwise.train.finetune import FinetuneConfig, Trainer, evaluate, make_batches

    t0 = time.perf_counter()
    say = log or (lambda s: None)
    am = validate_job(job)
    entry, _ = adapter_method(job.method)
    config = method_config(job, entry.config)  # bad options / --rank fail here, before any work
    labels, train, test, source = data.labels, list(data.train), list(data.test), data.source
    if not 2 <= len(labels) <= MAX_CLASSES:
        raise ValueError(f"the data has {len(labels)} classes; classification needs 2 to {MAX_CLASSES}")
    bad = [y for _, y in train + test if isinstance(y, bool) or not isinstance(y, int) or not 0 <= y < len(labels)]
    if bad:
        raise ValueError(f"class indices must lie in [0, {len(labels)}), got {bad[0]!r}")
    if job.limit_train is not None:
        train = train[:job.limit_train]
    if job.limit_eval is not None:
        test = test[:job.limit_eval]
    model, tokenizer = build_model(None if job.model is None else str(job.model), len(labels), job.seed)
    total = sum(p.numel() for p in model.parameters())
    steps = job.steps if job.steps is not None else max(1, math.ceil(len(train) / job.batch_size))
    n_calib = am.calibration_batches(config)
    calib = _calibration(job, tokenizer, train, n_calib) if n_calib else None
    entry.entry(model, config, **({"calib": calib} if calib is not None else {}))
    for p in _head(model)[1].parameters():
        p.requires_grad_(True)
    step_hook = am.training_hook(model, config, calib, steps)
    extra_loss = am.auxiliary_loss(model, config)
    head_ids = {id(p) for p in _head(model)[1].parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_adapter = sum(p.numel() for p in trainable if id(p) not in head_ids)
    lr = job.lr if job.lr is not None else am.default_lr
    eval_every = job.eval_every if job.eval_every is not None else max(1, steps // 4)
    cfg = FinetuneConfig(lr=lr, steps=steps, batch_size=job.batch_size, max_length=job.max_length, seed=job.seed)
    if job.optimizer != "adamw":
        from rankwise.train.riemannian_lora import offset_init_

        offset_init_(model, seed=job.seed, std=OFFSET_STD)  # the lift needs full-rank factors (B = 0 at init)
    trainer = Trainer(model, cfg, steps, _optimizer_factory(job, model, lr), extra_loss=extra_loss)
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
            _save(am, model, config, dict(meta, history=history, steps_done=step), Path(job.out))
        return ev

    batches = make_batches(tokenizer, train, cfg, steps=steps)
    last = None
    bar = _progress_bar(progress)
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
        reloaded, _, _ = load_finetuned(job.out, build_model)
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


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        class _Null(contextlib.nullcontext):
            def add_task(self, *a: Any, **k: Any) -> None:
                return None
        return _Null()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    transient=True)
