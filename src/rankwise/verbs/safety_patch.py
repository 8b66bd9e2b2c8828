"""``rankwise safety-patch``: realign a harmfully fine-tuned causal LM with ONE safety example.

    rankwise safety-patch [--model DIR | --model zoo:RECIPE] --example FILE.json [--rank K] --out DIR
                          [--epochs E] [--lr LR] [--stop-nll X] [--overwrite]

``--model`` is a ``save_pretrained`` causal-LM directory with its tokenizer, or ``zoo:<recipe>`` for an
embedded warm-up model (default ``zoo:safety-attack-n100-s0``, the tiny Llama whose refusals a 100-example
fine-tuning attack removed). ``--example`` is a JSON object ``{"prompt": ..., "response": ...}`` (a harmful
request and the refusal to restore; ``"completion"`` is accepted for ``"response"``). ``--rank K`` runs the
projected patch (every update of a 2-D weight projected onto the top-K singular directions of the
example's gradient). The patch is :class:`rankwise.train.safety_one_shot.OneShotSafetyPatch` (AdamW, early
stop when the example's NLL is below ``--stop-nll``; a non-finite loss stops it and nothing is written).

``--out DIR`` receives, atomically (all or nothing): the patched model and tokenizer (``save_pretrained``
layout, so ``--model DIR`` reads it back), ``safety_delta.safetensors`` (``theta_patched - theta``, float64,
with the config, the example and the base model's fingerprint: the auditable patch;
``rankwise.train.safety_one_shot.apply_delta`` re-applies it) and ``safety_patch.json`` (options, losses, the
greedy response to the example's prompt before and after).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

__all__ = ["DEFAULT_MODEL", "DELTA_FILE", "REPORT_FILE", "read_example", "register", "safety_patch_command"]

DEFAULT_MODEL = "zoo:safety-attack-n100-s0"
DELTA_FILE = "safety_delta.safetensors"
REPORT_FILE = "safety_patch.json"


def read_example(path: Path) -> dict[str, str]:
    """The safety example of a JSON file (one object, or a list holding exactly one)."""
    from rankwise.train.safety_one_shot import example_pair

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--example {path}: no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--example {path}: not valid JSON ({e})") from None
    if isinstance(obj, list):
        if len(obj) != 1:
            raise ValueError(f"--example {path}: holds {len(obj)} examples; the one-shot patch takes exactly one "
                             "(the multi-example baseline is rankwise.train.safety_one_shot.MultiExampleSafetyPatch)")
        obj = obj[0]
    if not isinstance(obj, dict):
        raise ValueError(f"--example {path}: expected a JSON object with 'prompt' and 'response', "
                         f"got {type(obj).__name__}")
    try:
        prompt, response = example_pair(obj)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--example {path}: {e}") from None
    return {"prompt": prompt, "response": response}


def _load(model: str) -> tuple[Any, Any, str]:
    from rankwise.verbs import common

    embedded = common.zoo_model(model, "warm")
    if embedded is not None:
        return embedded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise.zoo.models import quiet_transformers

    d = Path(model)
    if not d.is_dir():
        raise FileNotFoundError(f"--model {d}: no such directory (expected a save_pretrained layout or zoo:<recipe>)")
    if not (d / "config.json").is_file():
        raise ValueError(f"--model {d}: no config.json (expected a save_pretrained layout)")
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {d}: cannot load its tokenizer ({' '.join(str(e).split())[:200]})") from None
    try:
        with quiet_transformers():
            m = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {d}: cannot load a causal LM ({' '.join(str(e).split())[:200]})") from None
    if tok.pad_token_id is None and tok.eos_token_id is None:
        raise ValueError(f"--model {d}: the tokenizer has neither a pad nor an EOS token")
    return m.eval(), tok, str(d)


def safety_patch_command(model: str | None, example: Path, out: Path, rank: int | None = None, epochs: int = 10,
                         lr: float = 1e-3, stop_nll: float | None = 0.05, overwrite: bool = False) -> dict[str, Any]:
    """Patch ``model`` with the example of ``example`` and write ``out`` (see the module docstring); returns
    the report that ``safety_patch.json`` holds."""
    import dataclasses

    from rankwise.core.io import write_dir
    from rankwise.train.safety_one_shot import OneShotSafetyPatch, SafetyPatchConfig
    from rankwise.train.sft import generate

    config = SafetyPatchConfig(epochs=epochs, lr=lr, stop_nll=stop_nll, projection_rank=rank)  # validates first
    ex = read_example(example)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out}: a file of that name exists")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {out}: the directory is not empty (pass --overwrite to replace it)")
    m, tok, source = _load(model or DEFAULT_MODEL)
    before = generate(m, tok, [ex["prompt"]], max_new_tokens=8)[0]
    patcher = OneShotSafetyPatch(m, tok, config)
    patched = patcher.patch(ex, inplace=True)
    after = generate(patched, tok, [ex["prompt"]], max_new_tokens=8)[0]
    res = patcher.result
    report = {"model": source, "example": ex, "config": dataclasses.asdict(config), "losses": res.losses,
              "steps": res.steps, "stopped_early": res.stopped_early, "response_before": before,
              "response_after": after, "n_delta_tensors": len(patcher.delta),
              "files": ["config.json", DELTA_FILE, REPORT_FILE]}

    def fill(tmp: Path) -> None:
        patched.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        patcher.save(tmp / DELTA_FILE)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")

    write_dir(out, fill, overwrite=overwrite)
    return report


def register(app: typer.Typer) -> None:
    @app.command("safety-patch")
    def safety_patch_cmd(
        ctx: typer.Context,
        example: Path = typer.Option(..., "--example", help="JSON file {\"prompt\": ..., \"response\": ...}: one "
                                     "harmful request and its refusal."),
        out: Path = typer.Option(..., "--out", help="Directory for the patched model, the delta and the report."),
        model: Optional[str] = typer.Option(None, "--model", help="A save_pretrained causal-LM directory or "
                                            f"zoo:<recipe> (default {DEFAULT_MODEL})."),
        rank: Optional[int] = typer.Option(None, "--rank", help="Project every update onto the top-K directions "
                                           "of the example's gradient (default: the plain patch)."),
        epochs: int = typer.Option(10, "--epochs", help="Optimizer steps on the example (at most)."),
        lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
        stop_nll: Optional[float] = typer.Option(0.05, "--stop-nll", help="Stop once the example's NLL is below."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
    ) -> None:
        """Realign a fine-tuned LM with one safety example; writes the patched model and the auditable delta."""
        from rankwise.verbs import common

        rep = safety_patch_command(model, example, out, rank=rank, epochs=epochs, lr=lr, stop_nll=stop_nll,
                                   overwrite=overwrite)
        console = common.console()
        if not common.settings(ctx).quiet:
            losses = rep["losses"]
            console.print(f"model: {rep['model']}", markup=False, soft_wrap=True)
            console.print(f"safety NLL {losses[0]:.4f} -> {losses[-1]:.4f} in {rep['steps']} step(s)"
                          f"{' (early stop)' if rep['stopped_early'] else ''}", markup=False)
            console.print(f"response before: {rep['response_before']!r}; after: {rep['response_after']!r}",
                          markup=False, soft_wrap=True)
        console.print(f"saved: {out} (patched model, {DELTA_FILE}, {REPORT_FILE})", markup=False, soft_wrap=True)
