"""Save and reload a HEAPr-pruned model (experts of unequal widths).

A directory holds ``config.json`` (the model's ``transformers`` config), ``heapr.json`` (format, the
per-expert widths of every MoE layer, the report), ``heapr_model.safetensors`` (the whole state dict,
with per-tensor digests, written by :func:`rankwise.core.io.save_tensors`) and, when given, the
tokenizer files. The weights file is deliberately not ``model.safetensors``: ``from_pretrained``
cannot build experts of unequal widths and would silently re-initialise them; :func:`load_pruned`
builds the architecture from the config, unfuses it, resizes every expert to its saved width and
loads the weights strictly (shapes, digests and completeness checked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from rankwise.compress.heapr.experts import ExpertMLP, moe_layers, unfuse_experts
from rankwise.core import io
from rankwise.core.errors import ArtifactError

__all__ = ["FORMAT", "META_FILE", "WEIGHTS_FILE", "save_pruned", "load_pruned", "is_pruned_dir"]

FORMAT = "rankwise-heapr"
FORMAT_VERSION = 1
META_FILE = "heapr.json"
WEIGHTS_FILE = "heapr_model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
_OWN = (META_FILE, WEIGHTS_FILE, "config.json", "generation_config.json", *_TOKENIZER_FILES)


def is_pruned_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_pruned`."""
    return (Path(path) / META_FILE).is_file()


def save_pruned(model: nn.Module, path: str | Path, *, tokenizer: Any = None, report: Any = None,
                overwrite: bool | None = None) -> Path:
    """Write ``model`` (unfused, possibly pruned) atomically to the directory ``path``.

    ``overwrite``: ``None`` replaces only a directory a previous save left; ``True`` any; ``False`` none.
    """
    layers = moe_layers(model)
    if not layers:
        raise TypeError("save_pruned needs a model whose experts were unfused (unfuse_experts / heapr_compress)")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError("save_pruned needs a transformers model (with .config)")
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
        "widths": {ln: m.widths for ln, m in layers.items()},
        "gated": {ln: [ex.gated for ex in m.experts] for ln, m in layers.items()},
        "report": report.to_dict() if hasattr(report, "to_dict") else report,
    }
    state = {k: v for k, v in model.state_dict().items()}

    def fill(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        io.save_tensors(tmp / WEIGHTS_FILE, state, metadata={"format": FORMAT, "version": FORMAT_VERSION})
        io.write_json(tmp / META_FILE, meta)

    return io.write_dir(path, fill, overwrite=overwrite, own_files=_OWN)


def load_pruned(path: str | Path, *, tokenizer: bool = False) -> Any:
    """The model saved by :func:`save_pruned` (eval mode); with ``tokenizer=True``, ``(model, tokenizer)``.

    Raises :class:`~rankwise.core.errors.ArtifactError` naming the directory when a file is missing,
    malformed, or does not fit the architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such directory")
    if not is_pruned_dir(d):
        raise ArtifactError(f"{d}: not a HEAPr-pruned model directory (no {META_FILE})")
    meta = io.read_json(d / META_FILE)
    if meta.get("format") != FORMAT or not isinstance(meta.get("widths"), dict):
        raise ArtifactError(f"{d / META_FILE}: not a {FORMAT} file (format {meta.get('format')!r})")
    if int(meta.get("version", 0)) > FORMAT_VERSION:
        raise ArtifactError(f"{d}: format version {meta.get('version')} is newer than this rankwise reads "
                            f"({FORMAT_VERSION}); upgrade rankwise")
    try:
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
        model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{d}: cannot build the model from config.json ({' '.join(str(e).split())[:300]})") from e
    unfuse_experts(model)
    layers = moe_layers(model)
    if set(layers) != set(meta["widths"]):
        raise ArtifactError(f"{d}: {META_FILE} names MoE layers {sorted(meta['widths'])[:4]}, the architecture "
                            f"has {sorted(layers)[:4]}")
    gated = meta.get("gated") or {}
    for ln, m in layers.items():
        widths = meta["widths"][ln]
        if not isinstance(widths, list) or len(widths) != m.num_experts or \
                not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in widths):
            raise ArtifactError(f"{d}: widths of {ln} must be {m.num_experts} ints >= 0, got {widths!r}")
        g = gated.get(ln) or [True] * m.num_experts
        for e, ex in enumerate(m.experts):
            W = ex.down_proj.weight
            m.experts[e] = ExpertMLP.empty(W.shape[0], widths[e], ex.act_fn, bool(g[e]), dtype=W.dtype,
                                           device=W.device)
    expect = {k: v for k, v in model.state_dict().items()}
    tensors, _ = io.load_tensors(d / WEIGHTS_FILE, expect=expect)
    model.load_state_dict(tensors, strict=True)
    model.eval()
    if not tokenizer:
        return model
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{d}: no tokenizer could be loaded ({' '.join(str(e).split())[:200]})") from e
    return model, tok
