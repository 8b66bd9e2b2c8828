"""``rankwise compress --method heapr``: prune a mixture-of-experts LM's atomic experts with HEAPr.

:mod:`rankwise.verbs.compress` hands ``--method heapr`` to :func:`run`. ``--ratio R`` is the KEPT fraction
of the routed-expert atoms (as for the SVD methods), so HEAPr's pruning ratio is ``p = 1 - R``. The model
is the zoo's tiny Qwen2-MoE (``zoo.tiny_lm("moe")``, built on first use) or a directory: a
``save_pretrained`` causal LM with fused MoE experts (Qwen2-MoE, Mixtral, ...) or a directory this
command wrote (pruned again). Calibration: ``--n-calib`` windows of 128 tokens of ``--calib`` (texts
joined with the end-of-sequence token) or of the embedded corpus' calib split (drawn with ``--seed``).
Prints one row per expert (calibration tokens, width before -> after) and saves atomically.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import typer

from rankwise.verbs import common

__all__ = ["run", "prune_command", "SEQ_LEN", "BATCH"]

SEQ_LEN = 128   #: tokens per calibration window
BATCH = 8       #: windows per calibration batch


def _load(model: Optional[Path]) -> tuple[Any, Any, str]:
    from rankwise.compress.heapr import is_pruned_dir, load_pruned

    if model is None:
        from rankwise import zoo

        m, tok = zoo.tiny_lm("moe")
        return m, tok, "zoo tiny Qwen2-MoE (tiny_lm('moe'))"
    d = Path(model)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such model directory")
    if is_pruned_dir(d):
        m, tok = load_pruned(d, tokenizer=True)
        return m, tok, str(d)
    from rankwise.compress.model_dir import load_model_dir

    m, tok = load_model_dir(d)
    return m.eval(), tok, str(d)


def _calibration(tok: Any, calib: Optional[Path], n_calib: int, seed: int) -> tuple[list[Any], str]:
    import torch

    from rankwise.core.errors import RankwiseError

    if calib is None:
        from rankwise import zoo

        n_batches = math.ceil(n_calib / BATCH)
        batches = zoo.token_batches(tok, "calib", seq_len=SEQ_LEN, batch_size=min(BATCH, n_calib),
                                    n_batches=n_batches, seed=seed)
        return batches, f"{n_batches * min(BATCH, n_calib)} windows of {SEQ_LEN} tokens of the embedded corpus"
    from rankwise.core.textfiles import read_texts

    texts = read_texts(calib)
    sep = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    ids: list[int] = []
    for t in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(t)
        if sep is not None:
            ids.append(sep)
    n = min(n_calib, len(ids) // SEQ_LEN)
    if n == 0:
        raise RankwiseError(f"{calib}: {len(ids)} tokens, fewer than one calibration window of {SEQ_LEN}")
    windows = torch.tensor(ids[: n * SEQ_LEN], dtype=torch.long).view(n, SEQ_LEN)
    return list(windows.split(BATCH)), f"{n} windows of {SEQ_LEN} tokens of {calib}"


def prune_command(*, ratio: float, model: Optional[Path] = None, calib: Optional[Path] = None,
                  out: Optional[Path] = None, overwrite: bool = False, seed: int = 0, n_calib: int = 64,
                  progress: bool = False) -> dict[str, Any]:
    """Load, prune (HEAPr, global ranking) in place and save; returns ``{"report", "model", "source", "out"}``."""
    from rankwise.compress.heapr import HEAPrConfig, find_fused_experts, heapr_compress, moe_layers, save_pruned
    from rankwise.core.validate import check_int, check_number

    r = check_number("ratio", ratio, 0.0, 1.0, low_open=True)
    check_int("n_calib", n_calib, 1)
    check_int("seed", seed, 0)
    cfg = HEAPrConfig(prune_ratio=1.0 - r)
    if out is not None:
        from rankwise.compress.serialization import check_output_dir

        check_output_dir(out, overwrite=overwrite)
    m, tok, name = _load(model)
    if not find_fused_experts(m) and not moe_layers(m):
        from rankwise.compress.heapr import SUPPORTED

        raise TypeError(f"{name}: {type(m).__name__} has no mixture-of-experts block to prune; supported: "
                        + "; ".join(SUPPORTED))
    batches, source = _calibration(tok, calib, n_calib, seed)
    report = heapr_compress(m, cfg, calib=batches, progress=progress)
    saved = None
    if out is not None:
        saved = save_pruned(m, out, tokenizer=tok, report=report, overwrite=overwrite)
    return {"report": report, "model": name, "source": source, "out": saved, "module": m}


def run(ctx: typer.Context, *, ratio: float, model: Optional[Path], calib: Optional[Path], out: Optional[Path],
        overwrite: bool, seed: int, n_calib: int) -> None:
    """The ``--method heapr`` branch of ``rankwise compress``: prune, print the per-expert table, save."""
    from rich.table import Table

    res = prune_command(ratio=ratio, model=model, calib=calib, out=out, overwrite=overwrite, seed=seed,
                        n_calib=n_calib, progress=common.progress(ctx))
    rep = res["report"]
    console = common.console()
    if not common.settings(ctx).quiet:
        t = Table(title=f"HEAPr on {res['model']} (kept fraction {ratio:g} of the routed-expert atoms, global "
                        "ranking)", title_justify="left", box=None, pad_edge=False)
        for c, j in (("layer", "left"), ("expert", "right"), ("tokens", "right"), ("width", "right")):
            t.add_column(c, justify=j, no_wrap=True)
        for row in rep.rows():
            t.add_row(row["layer"], str(row["expert"]), "–" if row["tokens"] is None else str(row["tokens"]),
                      f"{row['before']}→{row['after']}")
        console.print(t)
        console.print(f"calibration: {res['source']}", markup=False, soft_wrap=True)
    console.print(f"atoms: {rep.atoms_before:,} → {rep.atoms_after:,}; parameters: {rep.params_before:,} → "
                  f"{rep.params_after:,} ({rep.params_after / max(1, rep.params_before):.3f} of the model; "
                  f"{rep.expert_params_after / max(1, rep.expert_params_before):.3f} of the routed experts); "
                  f"{rep.seconds:.1f} s", markup=False, soft_wrap=True)
    if res["out"] is not None:
        console.print(f"saved: {res['out']}", markup=False, soft_wrap=True)
