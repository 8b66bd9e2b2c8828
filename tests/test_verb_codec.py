"""``rankwise codec encode/decode`` on user files: real PNG in, real bitstream out, PNG back; bad inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rankwise import cli

pytest.importorskip("constriction")
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    from rankwise.science.arpc import ARPCCodec, ARPCConfig

    root = tmp_path_factory.mktemp("codec")
    g = torch.Generator().manual_seed(0)
    train = torch.rand(24, 1, 16, 16, generator=g) * 2 - 1
    codec = ARPCCodec(ARPCConfig(ar_width=16, ar_heads=2, ar_layers=1))
    codec.fit(train, steps=3, batch_size=8)
    model = codec.save(root / "codec.safetensors")
    rgb = (np.random.default_rng(0).random((20, 35, 3)) * 255).astype(np.uint8)  # RGB, not a tile multiple
    Image.fromarray(rgb, mode="RGB").save(root / "img.png")
    return {"root": root, "model": model, "img": root / "img.png"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


def test_encode_decode_files(files: dict[str, Path]) -> None:
    from PIL import Image

    from rankwise.science.arpc import ARPCCodec, load_image

    root, model = files["root"], str(files["model"])
    out = root / "x.arpc"
    res = invoke("codec", "encode", str(files["img"]), "--scales", "3", "-o", str(out), "--model", model)
    assert res.exit_code == 0, res.output
    assert out.is_file() and "bpp" in res.stdout
    data = out.read_bytes()
    codec = ARPCCodec.load(files["model"])
    assert codec.read_header(data).num_scales == 3 and (codec.read_header(data).width, codec.read_header(data).height) == (35, 20)
    for complete in ("argmax", "sample", "zeros"):
        png = root / f"out_{complete}.png"
        res = invoke("codec", "decode", str(out), "-o", str(png), "--complete", complete, "--model", model)
        assert res.exit_code == 0, res.output
        with Image.open(png) as im:
            assert im.size == (35, 20) and im.mode == "L"
    # zero-fill decoding is the quantizer's reconstruction of the sent tokens (grey conversion of the input)
    r = codec.encode(load_image(files["img"], 1), 3)
    assert r.data == data
    # all scales: the decoded PNG is close to the input (pixel-level residual quantization)
    res = invoke("codec", "encode", str(files["img"]), "-o", str(root / "all.arpc"), "--model", model)
    assert res.exit_code == 0, res.output
    res = invoke("codec", "decode", str(root / "all.arpc"), "-o", str(root / "all.png"), "--model", model)
    assert res.exit_code == 0, res.output
    back = load_image(root / "all.png", 1)
    assert float(((back - load_image(files["img"], 1)) ** 2).mean()) < 0.05


def test_bad_inputs_are_one_line_errors(files: dict[str, Path]) -> None:
    root, model = files["root"], str(files["model"])
    out = root / "y.arpc"
    res = invoke("codec", "encode", str(files["img"]), "--scales", "2", "-o", str(out), "--model", model)
    assert res.exit_code == 0, res.output
    truncated = root / "t.arpc"
    truncated.write_bytes(out.read_bytes()[:-1])
    flipped = bytearray(out.read_bytes())
    flipped[-1] ^= 0x10  # one bit of the payload
    corrupted = root / "c.arpc"
    corrupted.write_bytes(bytes(flipped))
    header_hit = bytearray(out.read_bytes())
    header_hit[4] ^= 0x01  # one bit of the model hash
    other = root / "h.arpc"
    other.write_bytes(bytes(header_hit))
    cases = [
        (("codec", "decode", str(truncated), "-o", str(root / "t.png"), "--model", model), "truncated or corrupted"),
        (("codec", "decode", str(corrupted), "-o", str(root / "c.png"), "--model", model), "truncated or corrupted"),
        (("codec", "decode", str(other), "-o", str(root / "h.png"), "--model", model), "truncated or corrupted"),
        (("codec", "decode", str(out), "-o", str(root / "z.png"), "--complete", "mean", "--model", model), "complete"),
        (("codec", "encode", str(files["img"]), "--scales", "9", "-o", str(root / "n.arpc"), "--model", model),
         "num_scales"),
        (("codec", "encode", str(root / "missing.png"), "-o", str(root / "m.arpc"), "--model", model), "no such"),
        (("codec", "encode", str(files["img"]), "-o", str(out), "--model", model), "exists"),
        (("codec", "decode", str(files["img"]), "-o", str(root / "p.png"), "--model", model), "not an ARPC"),
        (("codec", "decode", str(out), "-o", str(root / "q.png"), "--model", str(files["img"])), "safetensors"),
    ]
    for args, message in cases:
        res = invoke(*args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.stderr and "Traceback" not in res.output, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1
    for name in ("t.png", "c.png", "h.png", "n.arpc"):
        assert not (root / name).exists(), name
