"""``rankwise codec``: ARPC image coding to real files.

    rankwise codec encode IMG.png --scales K -o X.arpc [--model CODEC.safetensors] [--entropy ar|histogram]
    rankwise codec decode X.arpc -o OUT.png [--complete argmax|sample|zeros] [--seed S] [--model ...]

The codec is ``--model`` (a file written by ``ARPCCodec.save``) or, by default, the zoo's digits codec
(:mod:`rankwise.repro.kit.arpc_codec`, recipe ``small``, seed 0; built on first use, or by ``rankwise zoo
build``). Images are read with Pillow and converted to the codec's channels (grey ``L`` for the zoo
codec); any size works (tiles of the codec's side, edge-padded; the decoder crops back). Outputs are
written atomically and an existing output is kept unless ``--overwrite``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

import typer

from rankwise.verbs import common

__all__ = ["register"]


def _codec(model: Optional[Path]) -> Any:
    if model is not None:
        from rankwise.science.arpc import ARPCCodec

        return ARPCCodec.load(model)
    from rankwise.repro.kit.arpc_codec import codec_path, zoo_codec

    if not (codec_path("small", 0) / "codec.safetensors").is_file():
        common.console().print("building the zoo's ARPC codec once (a few minutes; `rankwise zoo build` does it too)")
    return zoo_codec("small", 0)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass --overwrite to replace it)")
    if out.is_dir():
        raise IsADirectoryError(f"{out} is a directory")


def encode_cmd(
    ctx: typer.Context,
    image: Path = typer.Argument(..., help="Image file (PNG, JPEG, ... anything Pillow reads)."),
    scales: Optional[int] = typer.Option(None, "--scales", "-k", help="Scales to send (1..K; default all K)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output bitstream (.arpc)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Codec file (default: the zoo's digits codec)."),
    entropy: str = typer.Option("ar", "--entropy", help="Entropy model: ar (the paper) or histogram (baseline)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
) -> None:
    """Encode an image into an ARPC bitstream that sends the first --scales scales."""
    from rankwise.core.io import atomic_write_bytes
    from rankwise.science.arpc import load_image

    _check_out(out, overwrite)
    codec = _codec(model)
    img = load_image(image, codec.config.channels)
    r = codec.encode(img, scales, entropy_model=entropy)
    atomic_write_bytes(out, r.data)
    if not common.settings(ctx).quiet:
        h = r.header
        common.console().print(
            f"wrote {out}: {r.num_bytes} bytes ({r.header_bytes} header), {r.bpp:.4f} bpp for {h.width}x{h.height}, "
            f"scales {h.num_scales}/{codec.config.num_scales}, ideal {r.ideal_bits:.0f} bits, entropy model {entropy}")


def decode_cmd(
    ctx: typer.Context,
    bitstream: Path = typer.Argument(..., help="ARPC bitstream written by `rankwise codec encode`."),
    out: Path = typer.Option(..., "--out", "-o", help="Output image (PNG)."),
    complete: str = typer.Option("argmax", "--complete",
                                 help="Fill unsent scales: argmax (AR model), sample (AR model), zeros."),
    seed: int = typer.Option(0, "--seed", help="Seed of --complete sample."),
    model: Optional[Path] = typer.Option(None, "--model", help="Codec file (default: the zoo's digits codec)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
) -> None:
    """Decode an ARPC bitstream into a PNG, completing the unsent scales."""
    from rankwise.core.io import atomic_write_bytes
    from rankwise.science.arpc import to_pil

    _check_out(out, overwrite)
    if not bitstream.is_file():
        raise FileNotFoundError(f"{bitstream}: no such bitstream file")
    data = bitstream.read_bytes()
    codec = _codec(model)
    d = codec.decode(data, complete, seed=seed)
    buf = io.BytesIO()
    to_pil(d.image).save(buf, format="PNG")
    atomic_write_bytes(out, buf.getvalue())
    if not common.settings(ctx).quiet:
        h = d.header
        common.console().print(f"wrote {out}: {h.width}x{h.height}, scales {h.num_scales}/{codec.config.num_scales} "
                               f"decoded, the rest {complete}")


def register(app: typer.Typer) -> None:
    codec_app = typer.Typer(help="ARPC progressive image coding to real files.", no_args_is_help=True)
    codec_app.command("encode")(encode_cmd)
    codec_app.command("decode")(decode_cmd)
    app.add_typer(codec_app, name="codec")
