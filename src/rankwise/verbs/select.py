"""``rankwise select``: choose the training subset of a pool (and the attention heads to train) with P2D.

    rankwise select --method p2d|random|loss --data FILE.jsonl --fraction 0.1 --out DIR
                    [--model DIR | --model zoo:p2d] [--heads proxy|random|all|MASK.safetensors]
                    [--head-fraction 0.1] [--affinity grad_norm|activation|grad_cosine] [--proxy-steps 50] ...

``--data``: JSONL, one ``{"prompt": str, "completion": str}`` object per line (TRL's prompt-completion
format; other fields are kept). ``--model``: a causal-LM ``save_pretrained`` directory with its tokenizer,
or ``zoo:<recipe>`` for an embedded warm-up model (default ``zoo:p2d``, built once into the cache).
``--method``: ``p2d`` (affinity through the heads), ``random``, ``loss`` (highest response loss).
``--heads``: where the head mask comes from: P2D's probe fine-tune (default), random heads of the same
count, every head, or a mask saved by an earlier run (reuse across datasets).

Written atomically into ``--out`` (nothing is written when anything fails): ``subset.jsonl`` (the
selected lines as given, best first), ``heads.safetensors`` (the (L, H) mask and scores, loadable with
``rankwise.train.p2d.load_heads``) and ``selection.json`` (indices, affinities, exclusions, stage timings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

__all__ = ["read_pairs", "register", "run_select"]

FILES = ("subset.jsonl", "heads.safetensors", "selection.json")


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file of ``{"prompt": str, "completion": str, ...}`` (blank lines skipped)."""
    from rankwise.core.textfiles import iter_jsonl

    rows: list[dict[str, Any]] = []
    for no, obj in iter_jsonl(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) \
                or not isinstance(obj.get("completion"), str):
            raise ValueError(f"{path}:{no}: expected an object with string fields 'prompt' and 'completion'")
        rows.append(obj)
    if not rows:
        raise ValueError(f"{path}: no examples (the data file is empty)")
    return rows


def _model(source: str) -> tuple[Any, Any, str]:
    from rankwise.verbs import common

    embedded = common.zoo_model(source, "warm")
    if embedded is not None:
        return embedded
    d = Path(source)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json (expected a save_pretrained causal-LM directory "
                                "or zoo:<name>)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rankwise.zoo.models import quiet_transformers

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok, str(d)


def run_select(method: str, data: Path, fraction: float, out: Path, model: str = "zoo:p2d", heads: str = "proxy",
               head_fraction: float = 0.1, affinity: str = "grad_norm", head_score: str = "wasserstein",
               proxy_steps: int = 50, probe_samples: int = 256, batch_size: int = 32, max_length: int = 256,
               seed: int = 0, overwrite: bool = False) -> dict[str, Any]:
    """The whole command as a function; returns the ``selection.json`` record."""
    import dataclasses

    from rankwise.core import io
    from rankwise.core.validate import check_choice, check_number
    from rankwise.train.p2d import DATA_METHODS, P2DConfig, load_heads, save_heads, select

    check_choice("--method", method, DATA_METHODS)
    check_number("--fraction", fraction, 0.0, 1.0, low_open=True)
    check_number("--head-fraction", head_fraction, 0.0, 1.0, low_open=True)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    cfg = P2DConfig(head_fraction=head_fraction, data_fraction=fraction, affinity=affinity, head_score=head_score,
                    proxy_steps=proxy_steps, proxy_samples=probe_samples, batch_size=batch_size, max_length=max_length,
                    seed=seed)
    rows = read_pairs(data)
    net, tok, source = _model(model)
    head_src: Any = heads
    if heads not in ("proxy", "random", "all"):
        p = Path(heads)
        if not p.is_file():
            raise FileNotFoundError(f"--heads {heads}: not proxy, random, all, or a saved head mask file")
        head_src = load_heads(p)
    pool = [(r["prompt"], r["completion"]) for r in rows]
    sel, hs, timings = select(net, tok, pool, method, cfg, head_src)
    record = {"kind": "rankwise.select", "method": method, "data": str(data), "model": source, "fraction": fraction,
              "heads": heads if isinstance(head_src, str) else str(heads), "config": dataclasses.asdict(cfg),
              "indices": sel.indices, "affinities": [float(sel.affinities[i]) for i in sel.indices],
              "selected_heads": [[l, h] for l, h, _ in hs.heads], "report": sel.report(), "timings": timings}
    hs.meta.update({"model": source, "data": str(data)})

    def fill(tmp: Path) -> None:
        (tmp / "subset.jsonl").write_text("".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in sel.indices),
                                          encoding="utf-8")
        save_heads(tmp / "heads.safetensors", hs)
        io.write_json(tmp / "selection.json", record)

    io.write_dir(out, fill, overwrite=overwrite or None, own_files=FILES)
    return record


def register(app: typer.Typer) -> None:
    @app.command("select")
    def select_cmd(
        ctx: typer.Context,
        method: str = typer.Option("p2d", "--method", help="p2d (head affinity), random, or loss (highest loss)."),
        data: Path = typer.Option(..., "--data", help="Candidate pool, JSONL {\"prompt\", \"completion\"} per line."),
        fraction: float = typer.Option(0.1, "--fraction", help="Share of the pool to keep, in (0, 1]."),
        out: Path = typer.Option(..., "--out", help="Output directory (subset.jsonl, heads.safetensors, "
                                 "selection.json)."),
        model: str = typer.Option("zoo:p2d", "--model", help="A save_pretrained causal-LM directory, or zoo:<name> "
                                  "(embedded warm-up model; default zoo:p2d)."),
        heads: str = typer.Option("proxy", "--heads", help="proxy (P2D's probe fine-tune), random, all, or a saved "
                                  "heads.safetensors."),
        head_fraction: float = typer.Option(0.1, "--head-fraction", help="Share of all heads to select, in (0, 1]."),
        affinity: str = typer.Option("grad_norm", "--affinity", help="grad_norm, activation (forward only), "
                                     "grad_cosine."),
        head_score: str = typer.Option("wasserstein", "--head-score", help="wasserstein (ALPS), kl, js, cosine, "
                                       "update_norm."),
        proxy_steps: int = typer.Option(50, "--proxy-steps", help="Steps of the probe fine-tune."),
        probe_samples: int = typer.Option(256, "--probe-samples", help="At most this many probe samples (2 %)."),
        batch_size: int = typer.Option(32, "--batch-size", help="Samples per scoring batch."),
        max_length: int = typer.Option(256, "--max-length", help="Tokens per sample."),
        seed: int = typer.Option(0, "--seed"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out directory."),
    ) -> None:
        """Select the training subset (and the heads to train) of a pool of prompt-completion pairs."""
        from rankwise.verbs import common

        rec = run_select(method, data, fraction, out, model, heads, head_fraction, affinity, head_score, proxy_steps,
                         probe_samples, batch_size, max_length, seed, overwrite)
        if not common.settings(ctx).quiet:
            r = rec["report"]
            t = ", ".join(f"{k} {v:.2f} s" for k, v in rec["timings"].items())
            common.console().print(
                f"{method}: kept {r['selected']} of {r['pool']} samples ({r['excluded_no_response']} without a "
                f"response, {r['excluded_duplicates']} repeats, {r['excluded_nonfinite']} non-finite excluded); "
                f"{len(rec['selected_heads'])} heads ({rec['heads']}); {t}", markup=False, soft_wrap=True)
        common.console().print(f"wrote {out}/subset.jsonl, heads.safetensors, selection.json", markup=False,
                               soft_wrap=True)
