"""``rankwise safety-patch``: a user model directory and an embedded model, the written artefacts, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rankwise import cli

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
EX = {"prompt": "req h_01 h_02 h_03 : 3 4", "response": " REFUSE"}


def invoke(*args: object):
    return CliRunner().invoke(cli.app, [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.zoo.synthetic import SafetyWorld

    tok = SafetyWorld().tokenizer()
    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture()
def example(tmp_path) -> Path:
    p = tmp_path / "ex.json"
    p.write_text(json.dumps(EX))
    return p


def test_user_directory_writes_model_and_auditable_delta(model_dir, example, tmp_path):
    from transformers import AutoModelForCausalLM

    from rankwise.train.safety_one_shot import apply_delta, load_delta

    out = tmp_path / "patched"
    res = invoke("safety-patch", "--model", model_dir, "--example", example, "--out", out, "--epochs", "3",
                 "--lr", "1e-2", "--rank", "4")
    assert res.exit_code == 0, res.output
    assert "safety NLL" in res.output and "saved:" in res.output
    report = json.loads((out / "safety_patch.json").read_text())
    assert report["steps"] == 3 and report["config"]["projection_rank"] == 4
    assert report["losses"][-1] < report["losses"][0]
    _, meta = load_delta(out / "safety_delta.safetensors")
    assert meta["examples"] == [EX]
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    patched = AutoModelForCausalLM.from_pretrained(out)
    again = apply_delta(base, out / "safety_delta.safetensors")
    for (n, a), (_, b) in zip(again.named_parameters(), patched.named_parameters()):
        assert torch.equal(a, b), n
    # the patched directory is itself a --model
    res = invoke("safety-patch", "--model", out, "--example", example, "--out", tmp_path / "twice", "--epochs", "1")
    assert res.exit_code == 0, res.output


def test_embedded_model(example, tmp_path):
    out = tmp_path / "emb"
    res = invoke("safety-patch", "--model", "zoo:safety-attack-smoke", "--example", example, "--out", out,
                 "--epochs", "2")
    assert res.exit_code == 0, res.output
    assert "embedded" in json.loads((out / "safety_patch.json").read_text())["model"]


@pytest.mark.parametrize("content,message", [
    ({"prompt": "req h_01 h_02 h_03 : 1 2", "response": ""}, "empty response"),
    ([EX, EX], "exactly one"),
    ({"text": "x"}, "needs the keys"),
    ("{not json", "not valid JSON"),
])
def test_bad_examples_exit_2_and_write_nothing(model_dir, tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    out = tmp_path / "out"
    res = invoke("safety-patch", "--model", model_dir, "--example", p, "--out", out)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (("--rank", "0"), "projection_rank"),
    (("--epochs", "-1"), "epochs"),
    (("--model", "zoo:nope"), "no embedded model"),
    (("--lr", "nan"), "lr"),
])
def test_bad_options_exit_2(model_dir, example, tmp_path, args, message):
    base = ["safety-patch", "--model", model_dir, "--example", example, "--out", tmp_path / "o"]
    res = invoke(*base, *args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not (tmp_path / "o").exists()


def test_missing_inputs_and_nonempty_out(model_dir, example, tmp_path):
    res = invoke("safety-patch", "--model", tmp_path / "nodir", "--example", example, "--out", tmp_path / "o")
    assert res.exit_code == 2 and "no such directory" in res.output
    res = invoke("safety-patch", "--model", model_dir, "--example", tmp_path / "none.json", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "no such file" in res.output
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    res = invoke("safety-patch", "--model", model_dir, "--example", example, "--out", full)
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert sorted(p.name for p in full.iterdir()) == ["keep.txt"]


def test_nan_patch_writes_nothing(model_dir, example, tmp_path):
    out = tmp_path / "o"
    res = invoke("safety-patch", "--model", model_dir, "--example", example, "--out", out, "--lr", "1e38",
                 "--epochs", "5", "--stop-nll", "1e-9")
    assert res.exit_code == 2, res.output
    assert "restored" in res.output
    assert not out.exists()
