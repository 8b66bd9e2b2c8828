"""An image fine-tuning job: visual prompts (VAPT, VPT-deep, VPT-shallow) or LoRA on a ViT classifier ->
trained, evaluated, saved, verified. The image side of ``rankwise finetune`` (:mod:`rankwise.train.job` is
the text side; both share :class:`~rankwise.train.job.FinetuneJob` and the same checks)::

    from rankwise.train.image_job import ImageData, run_image_finetune, load_image_finetuned
    res = run_image_finetune(FinetuneJob(method="vapt", steps=200, out=Path("runs/vapt")), data, build_model)
    model, meta = load_image_finetuned("runs/vapt", build_model)

``build_model(source, num_labels, seed) -> model`` builds a ``ViTForImageClassification``-like model with
a head of ``num_labels`` classes (``source``: ``job.model`` or None for the caller's default). The method
is resolved through :mod:`rankwise.core.registry` (``vapt`` registers its prompt-only checkpoint functions;
``lora`` its :class:`~rankwise.core.adapters.AdapterMethod`), so this module imports no method package.

``--method vapt | vpt-deep | vpt-shallow`` apply ``VAPTConfig(method=...)`` (``job.options`` override its
fields); ``--method lora`` applies the reference LoRA (``query``/``value`` by default). The classification
head trains with the method (``head_lr``); AdamW, warm-up then linear decay, gradient clipping at 1.
Every ``eval_every`` steps (and at the end) the held-out images are evaluated and ``job.out`` rewritten
atomically::

    DIR/adapter/          VAPT: vapt.safetensors (prompts only, backbone fingerprint); LoRA: a PEFT directory
    DIR/head.safetensors  the trained classification head
    DIR/finetune.json     method, config, model source, labels, data, history, final metrics ("modality": "image")

At the end the directory is loaded back into a freshly built model and the held-out logits must be
identical to the trained model's (ArtifactError otherwise).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from rankwise.core import io, registry
from rankwise.core.errors import ArtifactError
from rankwise.train.job import (
    FORMAT,
    MAX_CLASSES,
    VERSION,
    FinetuneJob,
    FinetuneJobResult,
    _head,
    _head_tensors,
    _jsonable,
    _progress_bar,
    check_fields,
    method_config,
)

__all__ = ["IMAGE_METHODS", "ImageData", "ImageModelBuilder", "ImageEval", "evaluate_images",
           "load_image_finetuned", "run_image_finetune", "validate_image_job"]

IMAGE_METHODS = ("vapt", "vpt-deep", "vpt-shallow", "lora")
PROMPT_METHODS = ("vapt", "vpt-deep", "vpt-shallow")
EMBEDDED_VIT = "embedded:tiny-vit-digits"
VAPT_FILE = "vapt.safetensors"
WARMUP = 0.06
ImageModelBuilder = Callable[[Optional[str], int, int], nn.Module]


@dataclass
class ImageData:
    """Class names and float images ``(N, C, H, W)`` with class indices ``(N,)``; ``source`` says where from."""

    labels: list[str]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str = "given images"


@dataclass
class ImageEval:
    accuracy: float
    loss: float
    logits: torch.Tensor


def validate_image_job(job: FinetuneJob) -> None:
    """Every option (and ``job.out``'s writability) before any data or model is read."""
    if job.method not in IMAGE_METHODS:
        raise ValueError(f"--method {job.method!r} does not learn image tasks; choose one of "
                         f"{', '.join(IMAGE_METHODS)}")
    if job.optimizer != "adamw":
        raise ValueError(f"--optimizer {job.optimizer} is for text LoRA runs; image tasks train with adamw")
    if "method" in job.options:
        raise ValueError("set the prompt scheme with --method vapt|vpt-deep|vpt-shallow, not -o method=...")
    check_fields(job)


def _entry(method: str) -> registry.MethodEntry:
    return registry.get("vapt" if method in PROMPT_METHODS else method)


def _config(job: FinetuneJob) -> Any:
    entry = _entry(job.method)
    if job.method in PROMPT_METHODS:
        return method_config(dataclasses.replace(job, options={**job.options, "method": job.method}), entry.config)
    return method_config(job, entry.config)


def _check_data(data: ImageData, model: nn.Module) -> None:
    k = len(data.labels)
    if not 2 <= k <= MAX_CLASSES:
        raise ValueError(f"the data has {k} classes; classification needs 2 to {MAX_CLASSES}")
    cfg = model.config
    size = cfg.image_size if isinstance(cfg.image_size, (tuple, list)) else (cfg.image_size, cfg.image_size)
    want = (int(cfg.num_channels), int(size[0]), int(size[1]))
    for name, x, y in (("training", data.x_train, data.y_train), ("held-out", data.x_test, data.y_test)):
        if x.ndim != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"the {name} images have shape {tuple(x.shape[1:])} (C, H, W) but the model expects "
                             f"{want}; resize them or use a model of that image size")
        if len(x) != len(y) or not len(y):
            raise ValueError(f"{len(x)} {name} images but {len(y)} labels")
        if int(y.min()) < 0 or int(y.max()) >= k:
            raise ValueError(f"class indices must lie in [0, {k}), got {int(y.min())}..{int(y.max())}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"the {name} images hold NaN or inf")


@torch.no_grad()
def evaluate_images(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> ImageEval:
    """Accuracy, mean cross-entropy and logits on ``(x, y)`` in eval mode (the previous mode restored)."""
    was = model.training
    model.eval()
    try:
        logits = torch.cat([model(pixel_values=x[i:i + batch_size]).logits for i in range(0, len(x), batch_size)])
    finally:
        model.train(was)
    loss = float(nn.functional.cross_entropy(logits, y))
    return ImageEval(accuracy=float((logits.argmax(-1) == y).double().mean()), loss=loss, logits=logits)


def _adapt(job_method: str, model: nn.Module, config: Any) -> None:
    entry = _entry(job_method)
    entry.entry(model, config)
    for p in _head(model)[1].parameters():
        p.requires_grad_(True)


def _save(method: str, model: nn.Module, config: Any, meta: dict[str, Any], out: Path) -> None:
    entry = _entry(method)
    with io.atomic_dir(out, overwrite=True) as tmp:
        if method in PROMPT_METHODS:
            (tmp / "adapter").mkdir()
            entry.extras["save"](model, tmp / "adapter" / VAPT_FILE, include_head=False)
        else:
            entry.extras["adapter"].save_adapter(model, tmp / "adapter", "default")
        io.save_tensors(tmp / "head.safetensors", _head_tensors(model), {"kind": "rankwise-classification-head"})
        io.write_json(tmp / "finetune.json", dict(meta, method_config=_jsonable(dataclasses.asdict(config))))


def load_image_finetuned(directory: str | Path, build_model: ImageModelBuilder) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model an image job saved: ``(model, metadata)`` in eval mode. The base comes from
    ``build_model`` (the recorded directory, or None for the default), then the head, then the prompts
    (checked against the backbone fingerprint) or the LoRA adapter. ArtifactError for a bad artefact."""
    directory = Path(directory)
    if not (directory / "finetune.json").is_file():
        raise ArtifactError(f"{directory}: not a rankwise finetune directory (no finetune.json)")
    meta = io.read_json(directory / "finetune.json")
    if meta.get("format") != FORMAT or meta.get("modality") != "image":
        raise ArtifactError(f"{directory}/finetune.json: not an image fine-tuning run")
    method = meta.get("method")
    if method not in IMAGE_METHODS:
        raise ArtifactError(f"{directory}/finetune.json: unknown image method {method!r}")
    source = meta.get("model")
    model = build_model(None if source == EMBEDDED_VIT else source, len(meta["labels"]), int(meta.get("seed", 0)))
    name, head = _head(model)
    tensors, _ = io.load_tensors(directory / "head.safetensors")
    want = {f"{name}.{k}": v for k, v in head.state_dict().items()}
    if set(tensors) != set(want) or any(tensors[k].shape != v.shape for k, v in want.items()):
        raise ArtifactError(f"{directory}/head.safetensors does not fit the model's head {sorted(want)}")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(tensors[k])
    entry = _entry(method)
    if method in PROMPT_METHODS:
        entry.extras["load"](model, directory / "adapter" / VAPT_FILE)
    else:
        entry.extras["adapter"].load_adapter(model, directory / "adapter", "default")
    return model.eval(), meta


def _lr_factor(step: int, total: int) -> float:
    warm = max(1, int(round(WARMUP * total)))
    return (step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm))


def run_image_finetune(job: FinetuneJob, data: ImageData, build_model: ImageModelBuilder, progress: bool = False,
                       log: Callable[[str], None] | None = None) -> FinetuneJobResult:
    """Train, evaluate periodically, save (if ``job.out``), reload and compare. See the module docstring."""
    t0 = time.perf_counter()
    say = log or (lambda s: None)
    validate_image_job(job)
    config = _config(job)  # bad options / --rank fail here, before any work
    x, y, xt, yt = data.x_train, data.y_train, data.x_test, data.y_test
    if job.limit_train is not None:
        x, y = x[:job.limit_train], y[:job.limit_train]
    if job.limit_eval is not None:
        xt, yt = xt[:job.limit_eval], yt[:job.limit_eval]
    model = build_model(None if job.model is None else str(job.model), len(data.labels), job.seed)
    _check_data(ImageData(data.labels, x, y, xt, yt, data.source), model)
    total = sum(p.numel() for p in model.parameters())
    _adapt(job.method, model, config)
    head_ids = {id(p) for p in _head(model)[1].parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    n_adapter = sum(p.numel() for p in trainable if id(p) not in head_ids)
    entry = _entry(job.method)
    lr = job.lr if job.lr is not None else (entry.extras["default_lr"] if job.method in PROMPT_METHODS
                                             else entry.extras["adapter"].default_lr)
    steps = job.steps if job.steps is not None else max(1, math.ceil(len(y) / job.batch_size))
    eval_every = job.eval_every if job.eval_every is not None else max(1, steps // 4)
    groups = [{"params": [p for p in trainable if id(p) not in head_ids], "lr": lr},
              {"params": [p for p in trainable if id(p) in head_ids], "lr": job.head_lr}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _lr_factor(i, steps))
    say(f"{job.method}: {n_adapter:,} adapter + {n_trainable - n_adapter:,} head parameters trained of {total:,}; "
        f"{len(y)} training / {len(yt)} held-out images from {data.source}; {steps} steps, lr {lr:g}")
    meta: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "modality": "image", "method": job.method, "optimizer": "adamw",
        "model": EMBEDDED_VIT if job.model is None else str(Path(job.model).resolve()),
        "labels": list(data.labels), "data": data.source, "seed": job.seed, "lr": lr, "head_lr": job.head_lr,
        "steps": steps, "batch_size": job.batch_size, "trainable_parameters": n_trainable,
        "adapter_parameters": n_adapter,
    }
    history: list[tuple[int, float, float]] = []
    losses: list[float] = []
    gen = torch.Generator().manual_seed(job.seed)
    order = torch.randperm(len(y), generator=gen)
    pos, last = 0, None
    bar = _progress_bar(progress)
    with bar, torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)  # dropout masks
        task = bar.add_task(f"finetune {job.method}", total=steps) if progress else None
        for step in range(1, steps + 1):
            if pos >= len(order):
                order, pos = torch.randperm(len(y), generator=gen), 0
            idx = order[pos:pos + job.batch_size]
            pos += job.batch_size
            model.train()
            loss = nn.functional.cross_entropy(model(pixel_values=x[idx]).logits, y[idx])
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{job.method}: non-finite training loss at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if progress:
                bar.update(task, advance=1, description=f"finetune {job.method} loss {losses[-1]:.3f}")
            if step % eval_every == 0 or step == steps:
                last = evaluate_images(model, xt, yt)
                history.append((step, last.accuracy, last.loss))
                say(f"step {step}/{steps}: held-out accuracy {last.accuracy:.4f}, loss {last.loss:.4f}, "
                    f"train loss {losses[-1]:.4f}")
                if job.out is not None:
                    _save(job.method, model, config, dict(meta, history=history, steps_done=step), Path(job.out))
    model.eval()
    diff = None
    if job.out is not None:
        reloaded, _ = load_image_finetuned(job.out, build_model)
        diff = float((evaluate_images(reloaded, xt, yt).logits - last.logits).abs().max())
        if diff != 0.0:
            raise ArtifactError(f"{job.out}: the reloaded model's held-out logits differ from the trained "
                                f"model's by {diff:g} (expected identical)")
    return FinetuneJobResult(method=job.method, history=history, accuracy=last.accuracy, loss=last.loss,
                             train_losses=losses, trainable_parameters=n_trainable, adapter_parameters=n_adapter,
                             total_parameters=total, labels=list(data.labels), n_train=len(y), n_eval=len(yt),
                             reload_max_abs_diff=diff, out=None if job.out is None else Path(job.out),
                             seconds=time.perf_counter() - t0)
