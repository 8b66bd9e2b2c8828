"""Save / load a folded STAR-KV model: config, tokenizer, one safetensors file and the per-layer ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from rankwise.compress.star_kv.layers import LatentProj
from rankwise.compress.star_kv.model import attention_sites, rank_table
from rankwise.core.errors import ArtifactError
from rankwise.core.io import load_tensors, read_json, save_tensors, write_dir, write_json
from rankwise.core.layers import LowRankLinear

__all__ = ["save_star_kv", "load_star_kv", "META_FILE", "WEIGHTS_FILE"]

META_FILE = "star_kv.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "rankwise.star_kv/1"


def save_star_kv(model: nn.Module, out: str | Path, *, tokenizer: Any = None, overwrite: bool = False,
                 extra: dict[str, Any] | None = None) -> Path:
    """Write ``out`` atomically: ``config.json`` (+ the tokenizer), ``model.safetensors`` (every tensor of the
    folded model) and ``star_kv.json`` (format, per-layer ranks, ``extra``). A failure leaves no directory."""
    rows = rank_table(model)
    if not any(r["compressed"] for r in rows):
        raise ValueError("the model has no folded STAR-KV layers to save (run star_kv_compress first)")
    for s in attention_sites(model):
        if s.attn.k_proj.__class__.__name__ == "ThresholdedProj":
            raise ValueError(f"{s.name} is still in training form; call star_kv_freeze before saving")
    state = {k: v for k, v in model.state_dict().items()}

    def fill(tmp: Path) -> None:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_tensors(tmp / WEIGHTS_FILE, state, metadata={"format": FORMAT})
        write_json(tmp / META_FILE, {"format": FORMAT, "ranks": rows, **(extra or {})})

    return write_dir(out, fill, overwrite=overwrite)


def load_star_kv(path: str | Path) -> tuple[nn.Module, Any]:
    """Load what :func:`save_star_kv` wrote: ``(model in eval mode, tokenizer or None)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / META_FILE).is_file():
        raise ArtifactError(f"{path} is not a STAR-KV model directory (no {META_FILE})")
    meta = read_json(path / META_FILE)
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path / META_FILE}: unknown format {meta.get('format')!r} (expected {FORMAT})")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config)
    sites = {s.layer: s for s in attention_sites(model)}
    for row in meta["ranks"]:
        if not row["compressed"]:
            continue
        s = sites.get(row["layer"])
        if s is None:
            raise ArtifactError(f"{path}: layer {row['layer']} is not in the model")
        for name, ranks, group in (("k_proj", row["k"], row["full_k"]), ("v_proj", [row["v"]], row["full_v"])):
            lin = getattr(s.attn, name)
            fac = LowRankLinear(lin.in_features, lin.out_features, sum(ranks), bias=lin.bias is not None)
            setattr(s.attn, name, LatentProj(fac, list(ranks), group))
    tensors, _ = load_tensors(path / WEIGHTS_FILE)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ArtifactError(f"{path / WEIGHTS_FILE}: missing {missing[:3]}, unexpected {unexpected[:3]} tensors")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    tok = None
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.requires_grad_(False)
    return model.eval(), tok
