"""``rankwise pave``: PAVE specifications of the user's labelled data, and identification by spec.

    rankwise pave spec --data FILE.jsonl --out SPEC.safetensors [--model DIR] [--steps N] [--layers 4,5] ...
    rankwise pave identify USER_SPEC LEARNWARE_SPEC... [--json] [--min-score S]

``spec`` reads ``{"text": str, "label": int}`` lines (labels are class indices ``0..num_labels-1``, so that
the specs of different data sets share the head's classes), fine-tunes the shared adapter's B on them
(the embedded all-MiniLM-L6-v2 by default, or a ``save_pretrained`` directory) and writes the spec
atomically (no partial file; an existing file is kept unless ``--overwrite``). ``identify`` ranks the
learnware specs by cosine similarity to the user spec and prints ``cosine`` and ``score = 100 *
sigmoid(cos / 0.1)``; specs of different base models or configs, and zero-norm specs, are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from rankwise.verbs import common

__all__ = ["register"]


def _labels(rows: list[tuple[str, Any]], data: Path, num_labels: int) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    for i, (text, label) in enumerate(rows, 1):
        if not isinstance(label, int):
            raise ValueError(f"{data}: example {i} has label {label!r}; PAVE specs need class indices "
                             f"0..{num_labels - 1} (the same classes for every data set that is compared)")
        if not 0 <= label < num_labels:
            raise ValueError(f"{data}: example {i} has label {label}, outside 0..{num_labels - 1} "
                             f"(pass --num-labels to widen the head)")
        texts.append(text)
        labels.append(label)
    return texts, labels


def _encoder(model: Optional[Path]) -> tuple[Any, Any, str]:
    if model is None:
        from rankwise import zoo

        bert, tok = zoo.minilm()
        return bert, tok, "all-MiniLM-L6-v2 (rankwise zoo)"
    if not model.is_dir():
        raise FileNotFoundError(f"--model {model}: no such directory (expected a save_pretrained layout)")
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json (expected a save_pretrained layout)")
    from rankwise.compress.model_dir import load_model_dir

    net, tok = load_model_dir(model, task="auto")
    enc = getattr(net, "base_model", net)  # a model with a head: its encoder
    return enc.eval(), tok, str(model)


def _layers(value: Optional[str]) -> Optional[tuple[int, ...]]:
    if value is None or value.strip().lower() in ("", "all"):
        return None
    try:
        return tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    except ValueError:
        raise typer.BadParameter(f"expected layer indices like 4,5 or 'all', got {value!r}", param_hint="--layers")


def spec_cmd(
    ctx: typer.Context,
    data: Path = typer.Option(..., "--data", help="JSONL file of {\"text\": str, \"label\": int} lines."),
    out: Path = typer.Option(..., "--out", "-o", help="Output spec file (.safetensors)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Encoder directory (default: the embedded MiniLM)."),
    steps: int = typer.Option(100, "--steps", help="Fine-tuning steps (the same for every spec you compare)."),
    rank: int = typer.Option(16, "--rank", help="Rank of the shared adapter."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Adapted layers, e.g. 4,5 (default: all)."),
    num_labels: int = typer.Option(2, "--num-labels", help="Classes of the head (labels are 0..N-1)."),
    max_length: int = typer.Option(64, "--max-length", help="Tokens per text."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    seed: int = typer.Option(0, "--seed", help="Data order and dropout seed (keep it equal across specs)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
) -> None:
    """Compute the PAVE spec of a labelled JSONL file and save it (safetensors + fingerprint + config)."""
    from rankwise.science.pave import PaveConfig, pave_spec
    from rankwise.verbs.finetune import read_jsonl

    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass --overwrite to replace it)")
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a directory")
    cfg = PaveConfig(rank=rank, steps=steps, layers=_layers(layers), num_labels=num_labels,
                     max_length=max_length, lr=lr, seed=seed)
    texts, labels = _labels(read_jsonl(data), data, num_labels)
    enc, tok, name = _encoder(model)
    spec = pave_spec(enc, tok, texts, labels, cfg, base_model=name)
    spec.save(out)
    if not common.settings(ctx).quiet:
        common.console().print(
            f"wrote {out}: {spec.num_parameters():,} numbers over {len(spec.modules())} modules, rank {rank}, "
            f"{len(texts)} examples, {steps} steps, final loss {spec.info['final_loss']:.4f}, base {name}")


def identify_cmd(
    ctx: typer.Context,
    user_spec: Path = typer.Argument(..., help="The user's spec (from `rankwise pave spec`)."),
    learnware_specs: List[Path] = typer.Argument(..., help="Learnware specs to rank."),
    as_json: bool = typer.Option(False, "--json", help="Print the ranking as JSON."),
    min_score: Optional[float] = typer.Option(None, "--min-score", help="Show only matches scoring at least this."),
) -> None:
    """Rank learnware specs by cosine similarity to the user's spec (best first), with scores."""
    from rankwise.science.pave import PaveSpec, identify

    user = PaveSpec.load(user_spec)
    names = [str(p) for p in learnware_specs]
    if len(set(names)) != len(names):
        raise ValueError("a learnware spec is given twice")
    lws = {n: PaveSpec.load(p) for n, p in zip(names, learnware_specs)}
    result = identify(user, lws)
    matches = result.matches if min_score is None else result.above(min_score)
    if as_json:
        typer.echo(json.dumps({"user": str(user_spec), "temperature": result.temperature, "dropped": result.dropped,
                               "ranking": [m.__dict__ for m in matches]}, indent=2))
        return
    if common.settings(ctx).quiet:
        for m in matches:
            typer.echo(f"{m.name}\t{m.cosine:.6f}\t{m.score:.2f}")
        return
    from rich.table import Table

    table = Table(title=f"learnwares ranked for {user_spec}")
    for col in ("rank", "learnware", "cosine", "score", "distance"):
        table.add_column(col, justify="left" if col == "learnware" else "right")
    for i, m in enumerate(matches, 1):
        table.add_row(str(i), m.name, f"{m.cosine:.4f}", f"{m.score:.2f}", f"{m.distance:.4f}")
    common.console().print(table)
    if not matches:
        common.console().print(f"no learnware scores at least {min_score}")


def register(app: typer.Typer) -> None:
    pave_app = typer.Typer(help="PAVE specifications: describe labelled data by a parameter change; rank learnwares.",
                           no_args_is_help=True)
    pave_app.command("spec")(spec_cmd)
    pave_app.command("identify")(identify_cmd)
    app.add_typer(pave_app, name="pave")
