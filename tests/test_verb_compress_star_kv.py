"""``rankwise compress --method star-kv``: embedded and user model directories, the table, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rankwise import cli
from rankwise.verbs import compress_star_kv

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


@pytest.fixture(autouse=True)
def few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compress_star_kv, "STEPS", 3)
    monkeypatch.setattr(compress_star_kv, "PHASE3_STEPS", 1)
    monkeypatch.setattr(compress_star_kv, "SEQ_LEN", 32)
    monkeypatch.setattr(compress_star_kv, "BATCH", 2)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    from rankwise.zoo import tiny_lm

    m, tok = tiny_lm("gqa-smoke")
    d = tmp_path_factory.mktemp("user") / "llama"
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_embedded_model_prints_per_head_table_and_saves(tmp_path: Path) -> None:
    from rankwise.compress.star_kv import load_star_kv, rank_table

    out = tmp_path / "kv"
    res = invoke("compress", "--method", "star-kv", "--ratio", "0.5", "--model", "zoo:gqa-smoke", "--n-calib", "4",
                 "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "K rank per head" in res.stdout and "KV cache:" in res.stdout and "saved:" in res.stdout
    model, tok = load_star_kv(out)
    assert tok is not None and rank_table(model)[0]["compressed"]


def test_user_model_directory_and_calib_file(tmp_path: Path, user_dir: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(30)))
    res = invoke("compress", "--method", "star_kv", "--ratio", "0.4", "--model", str(user_dir), "--calib", str(calib),
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    assert "windows of" in res.stdout and str(calib) in res.stdout.replace("\n", "")
    # an existing --out is refused before any work, and --overwrite replaces it
    again = invoke("compress", "--method", "star-kv", "--ratio", "0.4", "--model", str(user_dir), "--calib",
                   str(calib), "--out", str(tmp_path / "o"))
    assert again.exit_code != 0 and "not empty" in again.output


def test_fused_c_attn_model_is_a_one_line_error(tmp_path: Path, user_dir: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=384, n_positions=64)).save_pretrained(d)
    PreTrainedTokenizerFast.from_pretrained(user_dir).save_pretrained(d)
    res = invoke("compress", "--method", "star-kv", "--ratio", "0.5", "--model", str(d), "--out", str(tmp_path / "x"))
    assert res.exit_code != 0
    assert "c_attn" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,needle", [(["--ratio", "0"], "--ratio"), (["--ratio", "1.5"], "--ratio"),
                                         (["--model", "zoo:nothing"], "no embedded tiny LM"),
                                         (["--model", "/no/such/dir"], "no such model directory")])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    res = invoke("compress", "--method", "star-kv", "--out", str(tmp_path / "o"), *(["--ratio", "0.5"] + args))
    assert res.exit_code != 0 and needle in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()
