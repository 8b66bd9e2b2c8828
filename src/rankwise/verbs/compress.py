"""``rankwise compress``: SVD-compress a model's linear layers and report ranks, errors, fidelity, speed.

:func:`compress_command` resolves what the command line names (a model directory or the embedded
all-MiniLM-L6-v2, text files or the embedded docstring corpus, the task loss of gradient-based
methods) and runs the library job :func:`rankwise.compress.job.compress_texts`; :func:`compress_cmd`
prints its result.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Optional

import typer

from rankwise.verbs import common

__all__ = ["METHOD_CHOICES", "MODEL_METHODS", "compress_command", "compress_cmd", "register"]

#: The methods the CLI advertises.
METHOD_CHOICES = ("swift-svd", "saes-svd", "gfwsvd", "svd", "asvd", "fwsvd", "svd-llm")

#: Methods that transform a whole causal LM (experts, KV cache) rather than its linear layers one by one.
#: Each lives in its own module here, ``rankwise.verbs.compress_<name>``, defining
#: ``run(ctx, *, ratio, model, calib, out, overwrite, seed, n_calib) -> None`` (load, compress, print the
#: per-expert / per-head table, save atomically); ``rankwise compress --method <name>`` hands over to it.
MODEL_METHODS = {"heapr": "rankwise.verbs.compress_heapr", "star-kv": "rankwise.verbs.compress_star_kv"}


def _model_method(name: str) -> Any:
    """The module of a whole-model method named ``name`` (``None`` when it names a layer method)."""
    import importlib

    from rankwise.core.errors import UnknownMethodError

    norm = name.strip().lower().replace("_", "-")
    if norm not in MODEL_METHODS:
        return None
    try:
        return importlib.import_module(MODEL_METHODS[norm])
    except ModuleNotFoundError as e:
        raise UnknownMethodError(f"method {name!r} is not available in this installation ({e})") from None


def _resolve_method(name: str) -> str:
    from rankwise.compress.base import layer_methods, resolve_layer_method
    from rankwise.core.errors import UnknownMethodError

    try:
        return resolve_layer_method(name).name
    except UnknownMethodError:
        known = sorted(layer_methods())
        norm = name.strip().lower().replace("_", "-")
        if norm in METHOD_CHOICES:
            raise UnknownMethodError(f"method {name!r} is not available in this installation (its module "
                                     f"rankwise.compress.{norm.replace('-', '_')} is missing or did not register "
                                     f"it); available: {', '.join(known)}") from None
        raise UnknownMethodError(f"unknown method {name!r}; choose one of {', '.join(known)}") from None


def _load_model(d: Path) -> tuple[Any, Any]:
    """A model directory (dense or rankwise-compressed, checked) with its tokenizer (a padding token is set
    when it has none)."""
    from rankwise.compress.model_dir import load_model_dir
    from rankwise.core.errors import ArtifactError

    model, tok = load_model_dir(d)  # weights complete, config and tokenizer checked, or one-line refusal
    if getattr(tok, "pad_token", None) is None:
        tok.pad_token = getattr(tok, "eos_token", None) or getattr(tok, "unk_token", None)
        if tok.pad_token is None:
            raise ArtifactError(f"{d}: the tokenizer has no padding, end-of-sequence or unknown token")
    return model.eval(), tok


def compress_command(
    method: str,
    ratio: float = 0.4,
    *,
    model_dir: str | Path | None = None,
    calib_file: str | Path | None = None,
    eval_file: str | Path | None = None,
    out: str | Path | None = None,
    mode: str = "auto",
    allocation: str = "uniform",
    n_calib: int = 64,
    n_eval: int = 128,
    max_length: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = False,
    measure_speed: bool = True,
) -> Any:
    """Resolve the command line's model, texts and task loss, then run :func:`rankwise.compress.job.compress_texts`.

    Args:
        method: a registered method (``swift-svd``, ``saes-svd``, ``gfwsvd``, ``svd``, ``asvd``, ``fwsvd``,
            ``svd-llm``).
        ratio: kept-parameter fraction of the target layers, in ``(0, 1]``.
        model_dir: a ``save_pretrained`` directory with a tokenizer; default the embedded all-MiniLM-L6-v2.
        calib_file: calibration texts (``.txt``: one per line; ``.jsonl``: ``{"text": ...}`` per line);
            default: sentences of the embedded corpus's calibration split.
        eval_file: held-out texts for the fidelity; default: the corpus's evaluation split (or, with a
            ``calib_file`` and no ``eval_file``, the calibration texts after the first ``n_calib``).
        out: save the compressed model there (atomically); None = do not save.
        mode: ``auto`` / ``whole`` / ``blocks`` (see :func:`rankwise.compress.compress`).
        allocation: ``uniform`` or ``dynamic``.
        n_calib, n_eval: how many texts to use (sampled with ``seed`` from the defaults; the first ones
            of a file).
        max_length, batch_size: tokenisation and batching.

    Returns:
        :class:`~rankwise.compress.job.CompressJobResult` with ``model`` and ``calib_source`` set.
    """
    from rankwise.compress.config import CompressConfig
    from rankwise.compress.job import compress_texts
    from rankwise.core.textfiles import read_texts
    from rankwise.core.validate import check_int
    from rankwise.train.losses import task_loss_for
    from rankwise.zoo.text import docstring_sentences, sentence_pairs

    name = _resolve_method(method)
    check_int("n_calib", n_calib, 2)
    check_int("n_eval", n_eval, 1)
    cfg = CompressConfig(method=name, ratio=ratio, allocation=allocation)
    notes: list[str] = []
    if out is not None:  # an existing or unwritable --out fails now, not after the compression
        from rankwise.compress.serialization import check_output_dir

        check_output_dir(out, overwrite=overwrite)

    if model_dir is None:
        from rankwise import zoo

        model, tokenizer = zoo.minilm()
        model_name = "all-MiniLM-L6-v2 (embedded)"
    else:
        model, tokenizer = _load_model(Path(model_dir))
        model_name = str(model_dir)

    rng = random.Random(seed)
    if calib_file is not None:
        texts = read_texts(calib_file)
        calib_texts = texts[:n_calib]
        calib_source = str(calib_file)
        if eval_file is not None:
            eval_texts = read_texts(eval_file)[:n_eval]
        else:
            eval_texts = texts[n_calib:n_calib + n_eval]
            if not eval_texts:
                eval_texts = calib_texts[:n_eval]
                notes.append("no held-out text: the fidelity is measured on the calibration texts")
    else:
        pairs = sentence_pairs(docstring_sentences("calib"))
        take = rng.sample(pairs, min(len(pairs), max(1, n_calib // 2)))
        calib_texts = [a for a, _ in take] + [b for _, b in take]  # text i pairs with text i + n/2
        calib_source = "embedded docstring corpus (calib split)"
        if eval_file is not None:
            eval_texts = read_texts(eval_file)[:n_eval]
        else:
            pool = [s for ss in docstring_sentences("eval") for s in ss]
            eval_texts = rng.sample(pool, min(len(pool), n_eval))

    loss_fn, paired = None, False
    if cfg.method_class.needs_grad:
        loss_fn, paired = task_loss_for(model)
        if paired:
            notes.append("task loss for the Fisher: in-batch contrastive loss of consecutive sentence pairs "
                         "(temperature 0.05)" if calib_file is None else
                         "task loss for the Fisher: in-batch contrastive loss pairing text i with text i + n/2")
    res = compress_texts(model, tokenizer, cfg, calib_texts, eval_texts, loss_fn=loss_fn, pairs=paired, mode=mode,
                         max_length=max_length, batch_size=batch_size, out=out, overwrite=overwrite,
                         measure_speed=measure_speed, progress=progress)
    return dataclasses.replace(res, model=model_name, calib_source=calib_source, notes=notes + res.notes)


def compress_cmd(
    ctx: typer.Context,
    method: str = typer.Option(..., "--method", help="swift-svd, saes-svd, gfwsvd, svd, asvd, fwsvd, svd-llm; "
                                "heapr (MoE experts) or star-kv (KV cache)."),
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
    embedding fidelity on held-out text and the forward-time ratio. ``--method heapr`` prunes a
    mixture-of-experts LM's atomic experts and ``--method star-kv`` learns per-head ranks of the KV cache
    (default model: the zoo's tiny MoE / GQA LM); both print a per-expert / per-head table."""
    from rich.table import Table

    whole = _model_method(method)
    if whole is not None:
        whole.run(ctx, ratio=ratio, model=model, calib=calib, out=out, overwrite=overwrite, seed=seed,
                  n_calib=n_calib)
        return

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
