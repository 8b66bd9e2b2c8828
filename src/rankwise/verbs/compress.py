"""``rankwise compress``: SVD-compress a model's linear layers and report ranks, errors, fidelity, speed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rankwise.verbs import common


def compress_cmd(
    ctx: typer.Context,
    method: str = typer.Option(..., "--method", help="swift-svd, saes-svd, gfwsvd, svd, asvd, fwsvd or svd-llm."),
    ratio: float = typer.Option(0.4, "--ratio", help="Kept-parameter fraction of the compressed layers, in (0, 1]."),
    model: Optional[Path] = typer.Option(None, "--model", help="A save_pretrained model directory (default: the "
                                         "embedded all-MiniLM-L6-v2)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration texts: .txt (one per line) or .jsonl "
                                         "({\"text\": ...} per line). Default: the embedded corpus."),
    eval_file: Optional[Path] = typer.Option(None, "--eval", help="Held-out texts for the fidelity (same formats)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Save the compressed model to this directory."),
    mode: str = typer.Option("auto", "--mode", help="auto, whole or blocks (block-sequential calibration)."),
    allocation: str = typer.Option("uniform", "--allocation", help="uniform or dynamic (Swift-SVD's ranks)."),
    n_calib: int = typer.Option(64, "--n-calib", help="Number of calibration texts."),
    n_eval: int = typer.Option(128, "--n-eval", help="Number of held-out texts."),
    seed: int = typer.Option(0, "--seed", help="Which texts are sampled from the embedded corpus."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
) -> None:
    """Compress a model's linear layers with an SVD method; print per-layer ranks and errors, the
    embedding fidelity on held-out text and the forward-time ratio."""
    from rich.table import Table

    from rankwise.compress.command import compress_command

    res = compress_command(method, ratio, model_dir=model, calib_file=calib, eval_file=eval_file, out=out,
                           mode=mode, allocation=allocation, n_calib=n_calib, n_eval=n_eval, seed=seed,
                           overwrite=overwrite, progress=common.progress(ctx))
    console = common.console()
    rep = res.report
    if not common.settings(ctx).quiet:
        prefix = f"{rep.extra['blocks']}." if rep.extra.get("blocks") else ""
        t = Table(title=f"{res.method} on {res.model} (ratio {ratio}, {rep.extra.get('mode')} mode)",
                  title_justify="left", box=None, pad_edge=False)
        for c, j in ((f"layer ({prefix}…)" if prefix else "layer", "left"), ("shape", "right"), ("rank", "right"),
                     ("params", "right"), ("error", "right"), ("s", "right")):
            t.add_column(c, justify=j, no_wrap=True)
        for r in res.rows():
            err = "–" if r["rel_error"] is None else f"{r['rel_error']:.4f}"
            name = r["layer"][len(prefix):] if prefix and r["layer"].startswith(prefix) else r["layer"]
            t.add_row(name, r["shape"], str(r["rank"]), f"{r['params_before']:,}→{r['params_after']:,}", err,
                      f"{r['seconds']:.2f}")
        console.print(t)
        for note in res.notes:
            console.print(f"note: {note}", markup=False, soft_wrap=True)
    console.print(f"parameters: {rep.params_before:,} → {rep.params_after:,} ({rep.kept_fraction:.3f} of the model; "
                  f"{rep.target_params_after / max(1, rep.target_params_before):.3f} of the compressed layers)",
                  markup=False)
    console.print(f"embedding fidelity: mean cosine {res.fidelity:.4f} to the original on {res.n_eval} held-out "
                  f"texts (calibration: {res.n_calib} texts from {res.calib_source})", markup=False, soft_wrap=True)
    if res.speed:
        console.print(f"forward time: {res.speed['compressed_s'] * 1e3:.1f} ms vs {res.speed['original_s'] * 1e3:.1f} "
                      f"ms uncompressed (ratio {res.speed['ratio']:.2f})", markup=False)
    console.print(f"time: calibration {rep.seconds_calibration:.1f} s, decomposition {rep.seconds_decomposition:.1f} s, "
                  f"total {res.seconds:.1f} s", markup=False)
    if res.out_dir is not None:
        console.print(f"saved: {res.out_dir}", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("compress")(compress_cmd)
