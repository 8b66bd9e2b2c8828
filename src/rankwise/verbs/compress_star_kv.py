"""``rankwise compress --method star-kv``: learn per-head K / per-layer V ranks of a low-rank KV cache.

::

    rankwise compress --method star-kv --ratio R [--model DIR | --model zoo:SIZE] [--calib FILE] [--out DIR]

``R`` is the kept fraction of the KV cache in the compressed layers (target compression ``C = 1 - R``; the
first and last layer stay uncompressed when the model has at least 3). ``--model`` is a ``save_pretrained``
causal LM with its tokenizer and Llama-style ``k_proj`` / ``v_proj`` (Llama, Mistral, Qwen2, ...), or
``zoo:<size>`` for a zoo tiny LM (default ``zoo:gqa``, the grouped-query tiny Llama). ``--calib`` holds the
distillation texts (``.txt`` one per line, or ``.jsonl``); default: the embedded corpus' calibration split.
The command distils for :data:`STEPS` + :data:`PHASE3_STEPS` steps of ``8 x 128`` tokens, prints the per-head
rank table and the cache accounting, and saves the folded model atomically (``load_star_kv`` reads it back).

``compress.py`` hands ``--method star-kv`` here; this module defines :func:`run`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from rankwise.verbs import common

__all__ = ["run", "star_kv_command", "DEFAULT_MODEL", "STEPS", "PHASE3_STEPS"]

DEFAULT_MODEL = "zoo:gqa"
STEPS = 120          # KD steps of phases 1 + 2 (the library default is the reproduction's 300)
PHASE3_STEPS = 10
SEQ_LEN = 128
BATCH = 8


def _load(model: str) -> tuple[Any, Any, str]:
    embedded = common.zoo_model(model, "tiny_lm")
    if embedded is not None:
        return embedded
    from rankwise.compress.model_dir import load_model_dir

    m, tok = load_model_dir(model)  # missing, incomplete or unreadable directories: one-line errors
    get_out = getattr(m, "get_output_embeddings", None)
    if get_out is None or get_out() is None:
        raise ValueError(f"--model {model}: not a causal LM (STAR-KV distils next-token distributions)")
    return m, tok, str(model)


def _batches(tok: Any, calib: Path | None, n_calib: int, seed: int) -> tuple[list[Any], str]:
    """Token windows (``BATCH x SEQ_LEN``) from ``calib`` (texts joined by EOS) or the embedded corpus."""
    import torch

    if calib is None:
        from rankwise import zoo

        nb = max(1, n_calib // BATCH)
        return zoo.token_batches(tok, "calib", seq_len=SEQ_LEN, batch_size=BATCH, n_batches=nb, seed=seed), \
            f"{nb * BATCH} windows of the embedded corpus"
    from rankwise.core.textfiles import read_texts

    texts = read_texts(calib)[:n_calib]
    sep = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    ids: list[int] = []
    for t in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(t + ([sep] if sep is not None else []))
    seq = min(SEQ_LEN, len(ids))
    if seq < 8:
        raise ValueError(f"--calib {calib}: {len(ids)} tokens, need at least 8")
    w = torch.tensor(ids[: (len(ids) // seq) * seq]).view(-1, seq)
    return list(w.split(BATCH)), f"{len(w)} windows of {seq} tokens from {calib}"


def star_kv_command(*, ratio: float, model: str | None = None, calib: Path | None = None, out: Path | None = None,
                    overwrite: bool = False, seed: int = 0, n_calib: int = 64, steps: int | None = None,
                    phase3_steps: int | None = None) -> dict[str, Any]:
    """Load, compress with :func:`rankwise.compress.star_kv.star_kv_compress`, save; returns the report dict
    with ``model``, ``calib`` and ``out``. ``steps`` / ``phase3_steps`` default to :data:`STEPS` / :data:`PHASE3_STEPS`."""
    from rankwise.compress.star_kv import StarKVConfig, attention_sites, save_star_kv, star_kv_compress
    from rankwise.core.validate import check_int, check_number

    check_number("--ratio", ratio, 0.0, 1.0, low_open=True)
    check_int("--n-calib", n_calib, 1)
    cfg = StarKVConfig(target_compression=1.0 - ratio if ratio < 1.0 else 0.0, steps=STEPS if steps is None else steps,
                       phase3_steps=PHASE3_STEPS if phase3_steps is None else phase3_steps)
    if out is not None:
        from rankwise.compress.serialization import check_output_dir

        check_output_dir(out, overwrite=overwrite)
    m, tok, name = _load(model or DEFAULT_MODEL)
    attention_sites(m)  # a model without k_proj / v_proj fails here, before any work
    data, source = _batches(tok, calib, n_calib, seed)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = star_kv_compress(m, cfg, data, seed=seed)
    res = rep.to_dict()
    res.update(model=name, calib=source, out=None,
               warnings=sorted({str(w.message) for w in caught if "STAR-KV" in str(w.message)}))
    if out is not None:
        res["out"] = str(save_star_kv(m, out, tokenizer=tok, overwrite=overwrite,
                                      extra={"ratio": ratio, "model": name, "calib": source}))
    return res


def run(ctx: typer.Context, *, ratio: float, model: Path | None, calib: Path | None, out: Path | None,
        overwrite: bool, seed: int, n_calib: int) -> None:
    """What ``rankwise compress --method star-kv`` runs: compress, print the per-head table, save."""
    from rich.table import Table

    res = star_kv_command(ratio=ratio, model=None if model is None else str(model), calib=calib, out=out,
                          overwrite=overwrite, seed=seed, n_calib=n_calib)
    console = common.console()
    acc, log = res["accounting"], res["log"]
    if not common.settings(ctx).quiet:
        t = Table(title=f"STAR-KV on {res['model']} (kept fraction {ratio} of the compressed layers' KV cache)",
                  title_justify="left", box=None, pad_edge=False)
        for c in ("layer", "K rank per head", "V rank", "cache per token"):
            t.add_column(c, justify="left" if c == "layer" else "right", no_wrap=True)
        for r in res["ranks"]:
            full = r["kv_heads"] * r["full_k"] + r["full_v"]
            mark = "" if r["compressed"] else " (skipped)"
            t.add_row(f"{r['layer']}{mark}", " ".join(f"{k}/{r['full_k']}" for k in r["k"]),
                      f"{r['v']}/{r['full_v']}", f"{sum(r['k']) + r['v']}/{full}")
        console.print(t)
        for w in res["warnings"]:
            console.print(f"warning: {w}", markup=False, soft_wrap=True)
    console.print(f"KV cache: {acc['cache_removed']:.3f} removed in the compressed layers (K {acc['cache_removed_k']:.3f},"
                  f" V {acc['cache_removed_v']:.3f}); {acc['cache_kept']:.3f} of the whole model's cache kept",
                  markup=False, soft_wrap=True)
    target = 1.0 - ratio
    if abs(acc["cache_removed"] - target) > 0.02:
        console.print(f"note: phase 1 stops on the official code's parameter targets (C + 0.09 for K, C - 0.11 for "
                      f"V, C = {target:.2f}), so the cache compression reached differs from 1 - ratio",
                      markup=False, soft_wrap=True)
    console.print(f"distillation: {log['phase1_steps']} + {log['phase2_steps']} + {log['phase3_steps']} steps "
                  f"(phases 1-3) on {res['calib']}; KD loss {log['kd'][0]:.4f} -> {log['kd'][-1]:.4f}"
                  if log["kd"] else "distillation: no steps", markup=False, soft_wrap=True)
    if res["out"] is not None:
        console.print(f"saved: {res['out']}", markup=False, soft_wrap=True)
