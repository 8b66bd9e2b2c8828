"""``rankwise compress --method heapr``: the embedded default, user model directories, the saved directory
reloading, and one-line errors without partial output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rankwise import cli, zoo

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """The zoo's moe-smoke Qwen2-MoE saved as a user's save_pretrained directory."""
    m, tok = zoo.tiny_lm("moe-smoke")
    d = tmp_path_factory.mktemp("user") / "moe"
    m.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


def test_user_directory_prunes_prints_and_saves_a_reloadable_model(moe_dir: Path, tmp_path: Path) -> None:
    from rankwise.compress.heapr import load_pruned, moe_layers

    out = tmp_path / "pruned"
    res = invoke("compress", "--method", "heapr", "--ratio", "0.75", "--model", str(moe_dir), "--n-calib", "8",
                 "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "HEAPr on" in res.stdout and "model.layers.0.mlp.experts" in res.stdout
    assert "atoms: 128 → 96" in res.stdout and f"saved: {out}" in res.stdout
    model, tok = load_pruned(out, tokenizer=True)
    widths = moe_layers(model)["model.layers.0.mlp.experts"].widths
    assert sum(widths) == 96
    x = tok("def f(x): return x", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x).logits).all()
    # the saved directory is a valid --model: pruned again
    res = invoke("compress", "--method", "heapr", "--ratio", "0.5", "--model", str(out), "--n-calib", "8",
                 "--out", str(tmp_path / "again"))
    assert res.exit_code == 0, res.output
    assert "atoms: 96 → 48" in res.stdout


def test_calibration_file_and_ratio_one_is_lossless(moe_dir: Path, tmp_path: Path) -> None:
    from rankwise.compress.heapr import load_pruned

    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(d.text for d in zoo.corpus().split("calib")[:20]), encoding="utf-8")
    out = tmp_path / "same"
    res = invoke("compress", "--method", "heapr", "--ratio", "1", "--model", str(moe_dir), "--calib", str(calib),
                 "--n-calib", "4", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert f"of {calib}" in res.stdout.replace("\n", "")
    ref, _ = zoo.tiny_lm("moe-smoke")
    x = torch.arange(20).view(1, 20)
    with torch.no_grad():
        # unfused per-expert Linears vs the fused experts: the same arithmetic, rounded by other kernels
        diff = (load_pruned(out)(input_ids=x).logits - ref(input_ids=x).logits).abs().max()
    assert float(diff) <= 1e-5


def test_default_model_is_the_zoo_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = zoo.tiny_lm

    def fake(size: str = "small", **kw):
        calls.append(size)
        return real("moe-smoke")
    monkeypatch.setattr(zoo, "tiny_lm", fake)
    res = invoke("compress", "--method", "heapr", "--ratio", "0.5", "--n-calib", "8")
    assert res.exit_code == 0, res.output
    assert calls == ["moe"] and "atoms: 128 → 64" in res.stdout


def test_model_without_moe_blocks_is_a_clear_error(tmp_path: Path) -> None:
    m, tok = zoo.tiny_lm("smoke")
    d = tmp_path / "llama"
    m.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    out = tmp_path / "out"
    res = invoke("compress", "--method", "heapr", "--ratio", "0.5", "--model", str(d), "--out", str(out))
    assert res.exit_code == 2
    assert "no mixture-of-experts block" in res.output and "Qwen2MoE" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("ratio", ["0", "1.5", "-0.2"])
def test_bad_ratio_exits_2(ratio: str, moe_dir: Path) -> None:
    res = invoke("compress", "--method", "heapr", "--ratio", ratio, "--model", str(moe_dir))
    assert res.exit_code == 2 and "ratio must be" in res.output


def test_existing_output_is_refused_before_any_work(moe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = invoke("compress", "--method", "heapr", "--ratio", "0.5", "--model", str(moe_dir), "--out", str(out))
    assert res.exit_code == 2 and "not empty" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_missing_model_directory(tmp_path: Path) -> None:
    res = invoke("compress", "--method", "heapr", "--ratio", "0.5", "--model", str(tmp_path / "nope"))
    assert res.exit_code == 2 and "no such model directory" in res.output
