"""One loader for the model directories users hand to rankwise (``--model DIR`` of every command).

:func:`load_model_dir` returns ``(model, tokenizer)`` from either kind of directory:

* a ``save_pretrained`` directory (dense): loaded with ``transformers``' ``from_pretrained``, whose
  loading report (missing / unexpected / mismatched weights) is checked, never silenced: a load that
  leaves a weight of the model randomly initialised, or a weight of the checkpoint unused, is refused
  with the names. With ``task="sequence-classification"`` the one exception is the classification
  head (what lies outside the backbone): a head that is absent or of another number of labels is
  replaced by a fresh one initialised from ``seed``, and weights of another task's head in the
  checkpoint (``lm_head``, ``cls.predictions``) are left unused;
* a rankwise compressed directory (``rankwise_compression.json``, written by
  :func:`~rankwise.compress.serialization.save_compressed`): loaded with
  :func:`~rankwise.compress.serialization.load_compressed` (digests and shapes checked), so that
  "compress, then fine-tune" works; for a task whose class differs from the saved one, the compressed
  backbone is grafted into that class and only its head is initialised (from ``seed``).

The tokenizer must be there and fit: a directory without tokenizer files, a tokenizer that does not
load, or one whose vocabulary does not fit the model's input embedding (ids beyond its rows, or fewer
than half of its rows: another model's tokenizer) is refused. transformers 5 would otherwise build a
tokenizer of the special tokens only, which maps every word to ``[UNK]``.

Every refusal is an :class:`~rankwise.core.errors.ArtifactError` (or ``FileNotFoundError`` for a
missing directory) with one line naming the directory and what is wrong: an empty or garbled
``config.json``, truncated weights, missing weights, a missing tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from rankwise.compress import serialization as ser
from rankwise.core import io
from rankwise.core.errors import ArtifactError

__all__ = ["load_model_dir", "load_tokenizer", "TASKS", "TOKENIZER_FILES"]

TASKS = ("auto", "sequence-classification")
#: files that hold a vocabulary (one of them must be present; tokenizer_config.json alone is not a tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "source.spm")
_SHOWN = 10


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:400] or type(e).__name__


def _names(keys: Any) -> str:
    keys = sorted(str(k) for k in keys)
    more = f" ... ({len(keys)} in all)" if len(keys) > _SHOWN else ""
    return "[" + ", ".join(keys[:_SHOWN]) + "]" + more


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """Hide transformers' loading progress bar; its log messages (the loading report) stay as they are."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _model_class(config: Any, task: str, d: Path) -> type:
    import transformers

    if task == "sequence-classification":
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

        try:
            return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
        except KeyError:
            raise ArtifactError(f"{d}: transformers has no sequence-classification model for "
                                f"{type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})") from None
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) else None
    return cls if isinstance(cls, type) else transformers.AutoModel


def _check_weight_files(d: Path) -> None:
    """Truncated or garbled safetensors files and shard indexes raise one clear line before transformers reads them."""
    index = d / ser.INDEX_FILE
    files = sorted(d.glob("*.safetensors"))
    if index.is_file():
        wm = io.read_json(index).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ArtifactError(f"{index}: no weight_map")
        for name in sorted(set(wm.values())):
            if not (d / name).is_file():
                raise ArtifactError(f"{index}: names shard {name!r}, which is missing")
    for f in files:
        io.read_metadata(f)  # container checks: truncation, header length, header JSON


def _backbone_roots(model: nn.Module) -> set[str]:
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    roots = {prefix} if prefix else set()
    if isinstance(base, nn.Module):
        roots |= {k.split(".")[0] for k in base.state_dict()}
    return roots


def _check_loading(d: Path, model: nn.Module, info: dict[str, Any], task: str) -> None:
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = {k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys") or ()}
    if task == "sequence-classification":
        # the head (everything outside the backbone) may be new; another task's head may go unused
        prefix = getattr(model, "base_model_prefix", "") or ""
        in_backbone = (lambda k: k.startswith(prefix + ".")) if prefix else (lambda k: True)
        missing = {k for k in missing if in_backbone(k)}
        mismatched = {k for k in mismatched if in_backbone(k)}
        roots = _backbone_roots(model)
        unexpected = {k for k in unexpected if k.split(".")[0] in roots}
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint (they would be randomly initialised): {_names(missing)}")
    if mismatched:
        problems.append(f"of another shape in the checkpoint: {_names(mismatched)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_names(unexpected)}")
    if info.get("error_msgs"):
        problems.append(f"errors: {_one_line(RuntimeError('; '.join(map(str, info['error_msgs']))))}")
    if problems:
        raise ArtifactError(f"{d}: the weights do not fit {type(model).__name__}; weights "
                            + "; weights ".join(problems))


def _load_dense(d: Path, task: str, num_labels: int | None, seed: int) -> nn.Module:
    config = ser.read_config(d)
    cls = _model_class(config, task, d)
    _check_weight_files(d)
    # mismatched sizes are reported (not raised) so that the refusal below can name them; a head of
    # another size is the one mismatch allowed (replaced by a new one)
    kw: dict[str, Any] = {"ignore_mismatched_sizes": True}
    if task == "sequence-classification":
        kw["num_labels"] = num_labels
    try:
        with _no_progress_bar(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, info = cls.from_pretrained(str(d), local_files_only=True, output_loading_info=True, **kw)
    except Exception as e:  # transformers/safetensors raise OSError, ValueError, RuntimeError, SafetensorError...
        raise ArtifactError(f"{d}: transformers cannot load this model directory ({type(e).__name__}: "
                            f"{_one_line(e)})") from e
    _check_loading(d, model, info, task)
    return model


def _fresh_head(target: nn.Module, seed: int) -> None:
    """Give the parameters still on the meta device (the head) real storage and transformers' initialisation."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for mod in target.modules():
            if any(p.is_meta for p in mod.parameters(recurse=False)):
                mod.to_empty(device="cpu", recurse=False)
                init = getattr(target, "_init_weights", None)
                if callable(init):
                    with torch.no_grad():
                        init(mod)
                elif hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()


def _load_compressed(d: Path, task: str, num_labels: int | None, seed: int) -> nn.Module:
    base = ser.load_compressed(d)
    if task == "auto":
        return base
    config = copy.deepcopy(base.config)
    cls = _model_class(config, task, d)
    if type(base) is cls and getattr(base.config, "num_labels", None) == num_labels:
        return base
    config.num_labels = num_labels
    config.architectures = [cls.__name__]
    target = ser.build_skeleton(config, cls)
    prefix = getattr(target, "base_model_prefix", "") or ""
    backbone = getattr(base, prefix, base) if prefix else None
    slot = getattr(target, prefix, None) if prefix else None
    if backbone is None or not isinstance(slot, nn.Module) or type(slot) is not type(backbone):
        raise ArtifactError(f"{d}: the compressed {type(base).__name__} has no backbone that fits "
                            f"{cls.__name__}; it cannot be used for {task}")
    setattr(target, prefix, backbone)
    _fresh_head(target, seed)
    left = [n for n, p in target.named_parameters() if p.is_meta]
    if left:
        raise ArtifactError(f"{d}: parameters {_names(left)} of {cls.__name__} could not be initialised")
    return target


def load_tokenizer(directory: str | Path, model: nn.Module | None = None) -> Any:
    """The tokenizer of a model directory, refused unless it has vocabulary files, loads, and fits
    ``model``'s input embedding (no id beyond its rows; at least half of them covered)."""
    from transformers import AutoTokenizer

    d = Path(directory)
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise ArtifactError(f"{d}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the model's tokenizer "
                            "there too (tokenizer.save_pretrained(DIR))")
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:
        raise ArtifactError(f"{d}: the tokenizer cannot be loaded ({type(e).__name__}: {_one_line(e)})") from e
    rows = None
    if model is not None:
        with contextlib.suppress(Exception):
            emb = model.get_input_embeddings()
            rows = int(emb.weight.shape[0])
    if rows is not None:
        try:
            size = len(tok)
            top = max(tok.get_vocab().values(), default=-1)
        except Exception as e:
            raise ArtifactError(f"{d}: the tokenizer's vocabulary cannot be read ({_one_line(e)})") from e
        if top >= rows or size > rows:
            raise ArtifactError(f"{d}: the tokenizer has {size} tokens (ids up to {top}) but the model's input "
                                f"embedding has {rows} rows; it is not this model's tokenizer")
        if 2 * size < rows:
            raise ArtifactError(f"{d}: the tokenizer has only {size} tokens for the model's {rows} embedding rows; "
                                "it is not this model's tokenizer (or its vocabulary files are incomplete)")
    return tok


def load_model_dir(path: str | Path, *, task: str = "auto", num_labels: int | None = None,
                   seed: int = 0) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of a dense or rankwise-compressed model directory, checked (see the module docstring).

    ``task``: ``"auto"`` (the class ``config.json`` names, else ``AutoModel``; a compressed directory as
    saved) or ``"sequence-classification"`` (``AutoModelForSequenceClassification`` with ``num_labels``;
    a new head is initialised from ``seed``). The model is returned in eval mode.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "sequence-classification" and (isinstance(num_labels, bool) or not isinstance(num_labels, int)
                                               or num_labels < 1):
        raise ValueError(f"num_labels must be an int >= 1 for sequence classification, got {num_labels!r}")
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such model directory (expected a save_pretrained layout)")
    if ser.is_compressed_dir(d):
        model = _load_compressed(d, task, num_labels, seed)
    else:
        model = _load_dense(d, task, num_labels, seed)
    tokenizer = load_tokenizer(d, model)
    return model.eval(), tokenizer
