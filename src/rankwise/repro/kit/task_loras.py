"""One LoRA (and its classification head) per zoo text task on all-MiniLM-L6-v2, trained once and cached.

The merging reproductions (``rankwise.repro.ctm``) need T task adapters on one frozen base. This
module trains them by a fixed, deterministic recipe and caches each under
``cache_dir()/task_loras/<task>-s<seed>-<hash>/`` (``adapter.safetensors``: the
:class:`~rankwise.core.lora.AdapterState`; ``head.safetensors``: the linear head; ``info.json``:
the recipe and the measured accuracies). The hash covers the recipe, the task, the seed, the corpus
SHA-256 and the major.minor versions of torch and transformers, so a change of any of them trains
anew. A build writes into a temporary folder and renames it into place.

Recipe (:data:`RECIPE`): the pretrained all-MiniLM-L6-v2 (:func:`rankwise.zoo.minilm`), frozen;
LoRA rank 8, alpha 8 (scale 1, as the CtM paper's alpha = r) on ``query``, ``key``, ``value`` and
``attention.output.dense`` of the top ``top_layers`` encoder layers (the lower layers' outputs are
computed once and cached, :class:`rankwise.repro.kit.cached_encoder.FrozenPrefix`); mean pooling and a per-task
linear head trained with the LoRA (never merged). Texts cut at ``max_length`` WordPiece tokens.
Data: :func:`rankwise.zoo.text_task` (``seed`` picks the training examples and their order); the
last ``n_val`` training examples are held out as the validation split that the merge reproduction
tunes on; the test split is the task's fixed test set (capped at ``max_test``). Adam (LoRA lr 3e-3,
head lr 1e-2), batch 32, ``epochs`` passes, LoRA A from a seeded kaiming init, head from N(0, 0.02²).

Cost (measured, one thread, recipe version 4: top_layers = 1, 3 epochs): about 3.5-5 s of CPU per LoRA of
the small tasks (``c_signature``, ``dunder``, ``files_vs_formats``), about 9 s for the 504-example ones;
the six tasks of :data:`TASKS` for one seed take about 40 s. Inside :func:`shared_encodings` the
validation and test encodings computed for training are reused by the caller's evaluation. Modules in
the AdapterState are named as in :class:`~rankwise.repro.kit.cached_encoder.TopModel`
(``layers.<i>.attention.self.query``, ...).

    from rankwise.repro.kit.task_loras import task_lora, TASKS
    tl = task_lora("topic", seed=0)    # TaskLoRA(task, labels, state, head, metrics, path)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from rankwise.core import io
from rankwise.core.errors import ArtifactError
from rankwise.core.lora import AdapterState, add_lora, get_state
from rankwise.zoo.tasks import text_task
from rankwise.zoo.models import BUILD_THREADS, build_threads
from rankwise.zoo.tinylm import cache_dir

__all__ = ["RECIPE", "TASKS", "TaskData", "TaskLoRA", "encode_task", "shared_encodings", "task_lora",
           "task_lora_path", "top_model"]

logger = logging.getLogger(__name__)

#: The six zoo text tasks used for merging (different label semantics: topic, object kind, naming,
#: signatures, sub-domains).
TASKS: tuple[str, ...] = ("topic", "kind", "private", "dunder", "c_signature", "files_vs_formats")
TARGETS: tuple[str, ...] = ("query", "key", "value", "attention.output.dense")

RECIPE: dict[str, Any] = {
    "version": 4,
    "model": "all-MiniLM-L6-v2",
    "top_layers": 1,
    "targets": list(TARGETS),
    "rank": 8,
    "alpha": 8.0,
    "lr": 3e-3,
    "head_lr": 1e-2,
    "epochs": 3,
    "batch_size": 32,
    "max_length": 32,
    "max_train": 600,
    "n_val": 96,
    "max_test": 200,
    "head_std": 0.02,
}


@dataclass
class TaskLoRA:
    """A trained task LoRA: its AdapterState, its head ``{"weight" (C, 384), "bias" (C,)}`` and metrics."""

    task: str
    seed: int
    labels: list[str]
    state: AdapterState
    head: dict[str, torch.Tensor]
    metrics: dict[str, float]
    path: Path


@dataclass
class TaskData:
    """A task's splits as ``(text, label)`` lists: train (minus validation), val, test."""

    task: str
    labels: list[str]
    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    test: list[tuple[str, int]]


def task_data(task: str, seed: int = 0, recipe: dict[str, Any] | None = None) -> TaskData:
    """The recipe's splits of ``task`` for ``seed`` (validation = the last ``n_val`` training examples)."""
    R = recipe or RECIPE
    t = text_task(task, seed=seed, max_train=R["max_train"], max_test=R["max_test"])
    n_val = R["n_val"]
    if len(t.train) <= n_val + len(t.labels):
        raise ValueError(f"task {task!r} has only {len(t.train)} training examples; n_val={n_val} leaves too few")
    return TaskData(task, list(t.labels), list(t.train[:-n_val]), list(t.train[-n_val:]), list(t.test))


def _key(task: str, seed: int, recipe: dict[str, Any]) -> str:
    import transformers

    from rankwise.zoo.docstrings import corpus

    blob = json.dumps({"recipe": recipe, "task": task, "seed": seed, "corpus": corpus().info["sha256"],
                       "torch": ".".join(torch.__version__.split(".")[:2]),
                       "transformers": ".".join(transformers.__version__.split(".")[:2]),
                       "build_threads": BUILD_THREADS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def task_lora_path(task: str, seed: int = 0, recipe: dict[str, Any] | None = None) -> Path:
    R = recipe or RECIPE
    return cache_dir() / "task_loras" / f"{task}-s{seed}-{_key(task, seed, R)}"


def top_model(bert: nn.Module, num_labels: int, seed: int, recipe: dict[str, Any] | None = None) -> nn.Module:
    """A :class:`rankwise.repro.kit.cached_encoder.TopModel` (copies of the top layers + a head) for ``recipe``."""
    from rankwise.repro.kit.cached_encoder import TopModel

    R = recipe or RECIPE
    return TopModel(bert, R["top_layers"], num_labels, seed)


_MEMO: dict[tuple[Any, ...], tuple[Any, torch.Tensor, torch.Tensor]] | None = None


@contextlib.contextmanager
def shared_encodings() -> Iterator[None]:
    """Within the block, :func:`encode_task` keeps what it computed and returns it for the same texts again.

    The merge reproduction trains its task LoRAs and then evaluates merged adapters on the same
    validation and test texts (and the test set of a task is the same for every seed), so each text
    list is run through the frozen prefix once per process instead of once per use. Entries are keyed
    by the identity of the prefix's model, its depth and ``max_length`` and the exact list of texts, and
    are dropped when the block ends (so an in-place change of the model outside the block cannot be
    served from a stale entry). Re-entrant: an inner block shares the outer block's entries.
    """
    global _MEMO
    outer = _MEMO
    if outer is None:
        _MEMO = {}
    try:
        yield
    finally:
        if outer is None:
            _MEMO = None


def encode_task(prefix: Any, data: Sequence[tuple[str, int]], chunk: int = 64, keep: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cached prefix outputs ``hidden (N, L, H)``, ``mask (N, L)`` and ``labels (N,)`` of ``data``.

    The texts are run through the prefix in chunks of ``chunk`` texts of similar token length (so a
    chunk carries little padding) and returned in the order of ``data``. Inside
    :func:`shared_encodings`, an identical text list is encoded only once (``keep=False``: looked up but
    not kept, for lists that will not be asked for again, such as a seed's training set).
    """
    texts = [t for t, _ in data]
    labels = torch.tensor([y for _, y in data])
    key = None
    if _MEMO is not None:
        digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()
        key = (id(prefix.bert), prefix.n_frozen, prefix.max_length, len(texts), digest)
        hit = _MEMO.get(key)
        if hit is not None and hit[0]() is prefix.bert:
            return hit[1], hit[2], labels
    lengths = [len(ids) for ids in prefix.tokenizer(texts, truncation=True, max_length=prefix.max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    h, m = prefix.encode([texts[i] for i in order], chunk=chunk)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    h, m = h[inverse], m[inverse]
    if keep and key is not None and _MEMO is not None:
        _MEMO[key] = (weakref.ref(prefix.bert), h, m)
    return h, m, labels


def _train(task: str, seed: int, R: dict[str, Any], bert: nn.Module, tok: Any) -> tuple[AdapterState, dict, dict]:
    from rankwise.repro.kit.cached_encoder import FrozenPrefix, batch_indices, cached_batches, evaluate_cached

    data = task_data(task, seed, R)
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - R["top_layers"], R["max_length"])
    htr, mtr, ytr = encode_task(prefix, data.train, keep=False)
    hva, mva, yva = encode_task(prefix, data.val)
    hte, mte, yte = encode_task(prefix, data.test)
    model = top_model(bert, len(data.labels), seed, R)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=g) * R["head_std"])
    head_only = {"val_acc_head_init": evaluate_cached(model, hva, mva, yva)[0]}
    add_lora(model, tuple(R["targets"]), "default", rank=R["rank"], alpha=R["alpha"],
             generator=torch.Generator().manual_seed(seed))
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    head_ids = {id(p) for p in model.classifier.parameters()}
    opt = torch.optim.Adam([
        {"params": [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids], "lr": R["lr"]},
        {"params": list(model.classifier.parameters()), "lr": R["head_lr"]}])
    steps_per_epoch = len(data.train) // R["batch_size"]
    batches = cached_batches(htr, mtr, ytr, batch_indices(len(data.train), R["epochs"] * steps_per_epoch,
                                                          R["batch_size"], seed))
    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for b in batches:
            loss = nn.functional.cross_entropy(model(**b.inputs), b.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    model.eval()
    metrics = {"val_acc": evaluate_cached(model, hva, mva, yva)[0], "test_acc": evaluate_cached(model, hte, mte, yte)[0],
               "final_loss": sum(losses[-5:]) / len(losses[-5:]), "steps": len(batches),
               "n_train": len(data.train), "n_val": len(data.val), "n_test": len(data.test), **head_only}
    state = get_state(model, "default")
    # the base-model identity must not include the task's own head (every task has its own)
    state.fingerprint = io.model_fingerprint(model, exclude="classifier")
    state.config.update({"task": task, "seed": seed, "recipe": R})
    head = {"weight": model.classifier.weight.detach().clone(), "bias": model.classifier.bias.detach().clone()}
    return state, head, metrics


def task_lora(task: str, seed: int = 0, *, recipe: dict[str, Any] | None = None, rebuild: bool = False,
              bert: nn.Module | None = None, tokenizer: Any = None, cache: bool = True) -> TaskLoRA:
    """The cached LoRA + head of ``task`` for ``seed`` (trained on first use; ``rebuild`` retrains).

    ``bert``/``tokenizer``: an already loaded :func:`rankwise.zoo.minilm` (saves loading it again).
    ``cache=False`` trains in memory and neither reads nor writes the cache (smoke runs, tests).
    A damaged cache folder raises ArtifactError (rebuild with ``rebuild=True``).
    """
    R = dict(recipe or RECIPE)
    path = task_lora_path(task, seed, R)
    if cache and path.is_dir() and not rebuild:
        try:
            info = io.read_json(path / "info.json")
            state = AdapterState.load(path / "adapter.safetensors")
            head, _ = io.load_tensors(path / "head.safetensors")
        except (OSError, ValueError, KeyError) as e:
            raise ArtifactError(f"{path}: damaged task-LoRA cache ({e}); rebuild with task_lora(..., rebuild=True)") from e
        return TaskLoRA(task, seed, info["labels"], state, head, info["metrics"], path)
    if bert is None or tokenizer is None:
        from rankwise.zoo.models import minilm

        bert, tokenizer = minilm()
    t0 = time.perf_counter()
    c0 = time.process_time()
    with build_threads():
        state, head, metrics = _train(task, seed, R, bert, tokenizer)
    metrics["train_wall_s"] = time.perf_counter() - t0
    metrics["train_cpu_s"] = time.process_time() - c0
    labels = list(text_task(task, seed=seed, max_train=R["max_train"], max_test=R["max_test"]).labels)
    if not cache:
        return TaskLoRA(task, seed, labels, state, head, metrics, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        state.save(tmp / "adapter.safetensors")
        io.save_tensors(tmp / "head.safetensors", head, {"task": task})
        io.write_json(tmp / "info.json", {"task": task, "seed": seed, "labels": labels, "recipe": R,
                                          "metrics": metrics})
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("trained task LoRA %s (seed %d): test acc %.3f in %.1f s", task, seed, metrics["test_acc"],
                metrics["train_wall_s"])
    return TaskLoRA(task, seed, labels, state, head, metrics, path)
