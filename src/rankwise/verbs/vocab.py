"""``rankwise vocab``: AgentVocab vocabulary adaptation of a tokenizer (and model) from tool-calling traces.

    rankwise vocab --traces FILE.jsonl [--tokenizer DIR] [--model DIR] --structural N --content M --out DIR
                   [--steps S] [--min-freq F] [--grad-samples G] [--overwrite]

``FILE.jsonl`` holds one trajectory per line, ``{"tools": [...], "messages": [...]}`` (the format of
:mod:`rankwise.zoo.agent_traces`; calls as ``{"role": "assistant", "tool_calls": [{"name", "arguments"}]}``).
Invalid records are dropped and counted; a line that is not UTF-8 or not JSON is an error naming the line.
The tokenizer is ``--tokenizer``, else ``--model``'s; ``--model`` is a ``save_pretrained`` directory or
``zoo:<size>`` (a zoo tiny LM, built on first use); with neither option, ``zoo:small``. With a model (``--model``, or the zoo's when neither is given) content candidates are
ranked by its embedding gradients and the model gets mean-initialised rows; with ``--tokenizer`` alone, by
frequency. The compression report is printed before any training; ``--steps`` > 0 then fine-tunes the
expanded model on the traces. ``--out`` receives, atomically, the expanded tokenizer (loadable by
``AutoTokenizer.from_pretrained``), the model if there is one, and ``agentvocab.json`` (tokens, scores, report).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from rankwise.verbs import common

__all__ = ["DEFAULT_MODEL", "read_traces", "register"]

DEFAULT_MODEL = "zoo:small"


def read_traces(path: Path) -> list[Any]:
    """The JSON value of every non-blank line of ``path``; raises naming the first bad line."""
    from rankwise.core.textfiles import iter_jsonl

    out = [value for _, value in iter_jsonl(path)]
    if not out:
        raise ValueError(f"{path}: no trajectories (the file is empty)")
    return out


def _load(tokenizer: Optional[Path], model_arg: Optional[str]) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise.zoo.models import quiet_transformers

    if model_arg is None and tokenizer is None:
        model_arg = DEFAULT_MODEL
    embedded = common.zoo_model(model_arg, "tiny_lm") if model_arg is not None else None
    if embedded is not None:
        net, tok, what = embedded
        if tokenizer is None:
            return net, tok, what
        model = None
    else:
        net, model = None, (Path(model_arg) if model_arg is not None else None)
    for flag, d in (("--tokenizer", tokenizer), ("--model", model)):
        if d is not None and not d.is_dir():
            raise FileNotFoundError(f"{flag} {d}: no such directory (expected a save_pretrained layout)")
    with quiet_transformers():
        if model is not None:
            if not (model / "config.json").is_file():
                raise ValueError(f"--model {model}: no config.json (expected a save_pretrained layout)")
            try:
                net = AutoModelForCausalLM.from_pretrained(str(model), local_files_only=True).eval()
            except (OSError, ValueError) as e:
                raise ValueError(f"--model {model}: cannot load a causal LM ({common.one_line(e)})") from None
        src = tokenizer if tokenizer is not None else model
        assert src is not None
        try:
            tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{src}: cannot load a tokenizer ({common.one_line(e)})") from None
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{src}: AgentVocab needs a fast (tokenizers-backed) tokenizer")
    if net is not None and net.get_input_embeddings().weight.shape[0] < len(tok):
        raise ValueError(f"the tokenizer has {len(tok)} tokens but the model only "
                         f"{net.get_input_embeddings().weight.shape[0]} embedding rows")
    return net, tok, str(model or model_arg or tokenizer)


def vocab_cmd(
    ctx: typer.Context,
    traces: Path = typer.Option(..., "--traces", help="JSONL file, one {\"tools\", \"messages\"} trajectory per line."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (tokenizer, model, agentvocab.json)."),
    structural: int = typer.Option(..., "--structural", help="Structural tokens to add (>= 0)."),
    content: int = typer.Option(..., "--content", help="Content tokens to add (>= 0)."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Tokenizer directory (default: the model's)."),
    model: Optional[str] = typer.Option(None, "--model", help="Causal-LM directory or zoo:<size> (default "
                                        f"{DEFAULT_MODEL} unless --tokenizer is given alone)."),
    steps: int = typer.Option(0, "--steps", help="Fine-tuning steps after expansion (0: none)."),
    min_freq: int = typer.Option(10, "--min-freq", help="Minimum candidate frequency."),
    grad_samples: int = typer.Option(200, "--grad-samples", help="Sequences whose gradients rank content candidates."),
    lr: float = typer.Option(1e-3, "--lr", help="Fine-tuning learning rate."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output directory."),
) -> None:
    """Mine structural and content tokens from agent traces, report the compression, save the tokenizer."""
    from rankwise.core.io import atomic_dir
    from rankwise.infer.agentvocab import MARKERS, AgentVocab, AgentVocabConfig, add_markers, sft_train

    cfg = AgentVocabConfig(structural_budget=structural, content_budget=content, min_freq=min_freq,
                           grad_samples=grad_samples)
    if steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    records = read_traces(traces)
    net, tok, source = _load(tokenizer, model)
    if steps > 0 and net is None:
        raise ValueError("--steps needs a model (--model)")
    tok0, markers = add_markers(net, tok, MARKERS)
    av = AgentVocab(tok0, cfg)
    rendered = av.render(records)
    say = (lambda *_: None) if common.settings(ctx).quiet else common.console().print
    say(f"{len(rendered)} trajectories rendered, {len(av.rejected)} rejected; tokenizer {source}"
        + (f"; template markers added as tokens: {len(markers)}" if markers else ""))
    cands = av.mine(rendered, grad_model=net)
    tokens = av.select_reachable(cands, rendered)
    new_tok, net = av.expand(net, tokens)
    report = av.compression_report(rendered, new_tok)
    for line in report.lines():
        say(line, markup=False)
    losses: list[float] = []
    if steps > 0:
        losses = sft_train(net, new_tok, rendered, steps=steps, lr=lr)
        say(f"fine-tuned {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    info = {"source": source, "config": cfg.__dict__, "markers_added": markers, "rejected": len(av.rejected),
            "report": report.as_dict(), "steps": steps, "final_loss": losses[-1] if losses else None,
            "tokens": [{"id": len(tok0) + i, "text": c.text, "stream": c.stream, "score": c.score, "freq": c.freq}
                       for i, c in enumerate(tokens)]}
    from rankwise.zoo.models import quiet_transformers

    with atomic_dir(out, overwrite=overwrite) as tmp:
        with quiet_transformers():
            new_tok.save_pretrained(str(tmp))
            if net is not None:
                net.save_pretrained(str(tmp))
        (tmp / "agentvocab.json").write_text(json.dumps(info, indent=2))
    say(f"wrote {out}: {len(tokens)} new tokens ({sum(c.stream == 'structural' for c in tokens)} structural, "
        f"{sum(c.stream == 'content' for c in tokens)} content), ids {len(tok0)}..{len(new_tok) - 1}"
        + ("" if net is None else ", model with mean-initialised rows"))


def register(app: typer.Typer) -> None:
    app.command("vocab")(vocab_cmd)
