"""``rankwise vocab``: the embedded model and a user model directory, a loadable tokenizer, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rankwise import cli
from rankwise.zoo.agent_traces import agent_traces

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    rows = agent_traces(80, 0) + [{"tools": [], "messages": []}]  # one invalid record: dropped and counted
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_embedded_model_prints_report_and_saves_a_loadable_tokenizer(tmp_path: Path, traces: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    res = invoke("vocab", "--traces", str(traces), "--model", "zoo:smoke", "--structural", "8", "--content", "4",
                 "--min-freq", "5", "--grad-samples", "4", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "80 trajectories rendered, 1 rejected" in res.stdout and "fewer" in res.stdout
    assert res.stdout.index("fewer") < res.stdout.index("wrote")  # the report comes before anything is written
    info = json.loads((out / "agentvocab.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(info["tokens"]) == 12 and len(tok) == info["tokens"][-1]["id"] + 1
    assert [tok.convert_tokens_to_ids(t["text"]) for t in info["tokens"]] == [t["id"] for t in info["tokens"]]
    s = "".join(json.dumps(r) for r in agent_traces(3, 9))
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"], clean_up_tokenization_spaces=False) == s
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)


def test_user_model_directory_and_training(tmp_path: Path, traces: Path) -> None:
    from rankwise import zoo

    model, tok = zoo.tiny_lm("smoke")
    d = tmp_path / "user-model"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    out = tmp_path / "out"
    res = invoke("vocab", "--traces", str(traces), "--model", str(d), "--structural", "6", "--content", "0",
                 "--min-freq", "5", "--grad-samples", "0", "--steps", "2", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "fine-tuned 2 steps" in res.stdout and "template markers added as tokens: 8" in res.stdout
    info = json.loads((out / "agentvocab.json").read_text())
    assert {t["stream"] for t in info["tokens"]} == {"structural"} and info["markers_added"]
    # tokenizer only: no model written
    res = invoke("vocab", "--traces", str(traces), "--tokenizer", str(d), "--structural", "4", "--content", "2",
                 "--min-freq", "5", "--out", str(tmp_path / "tok-only"))
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "tok-only" / "model.safetensors").exists()
    assert (tmp_path / "tok-only" / "tokenizer.json").is_file()


def test_bad_inputs_are_one_line_errors_without_output(tmp_path: Path, traces: Path) -> None:
    bad_utf8 = tmp_path / "bad.jsonl"
    bad_utf8.write_bytes(traces.read_bytes().split(b"\n")[0] + b"\n{\"tools\": \"\xff\"}\n")
    not_json = tmp_path / "nj.jsonl"
    not_json.write_text("{\"tools\": [\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    no_calls = tmp_path / "nocalls.jsonl"
    no_calls.write_text(json.dumps({"tools": [], "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    common = ["--model", "zoo:smoke", "--min-freq", "5", "--grad-samples", "0"]
    cases = [
        (["--traces", str(tmp_path / "missing.jsonl"), "--structural", "4", "--content", "0"], "no such data file"),
        (["--traces", str(bad_utf8), "--structural", "4", "--content", "0"], ":2: not UTF-8"),
        (["--traces", str(not_json), "--structural", "4", "--content", "0"], ":1: not valid JSON"),
        (["--traces", str(empty), "--structural", "4", "--content", "0"], "empty"),
        (["--traces", str(no_calls), "--structural", "4", "--content", "0"], "1 of 1 records rejected"),
        (["--traces", str(traces), "--structural", "-1", "--content", "0"], "structural_budget must be an int >= 0"),
        (["--traces", str(traces), "--structural", "4", "--content", "0", "--model", "zoo:nope"], "no embedded tiny LM"),
        (["--traces", str(traces), "--structural", "4", "--content", "0", "--model", str(tmp_path / "nodir")],
         "no such directory"),
    ]
    for i, (args, msg) in enumerate(cases):
        out = tmp_path / f"o{i}"
        res = invoke("vocab", *common, *args, "--out", str(out))
        assert res.exit_code == 2, (args, res.output)
        assert msg in res.output and len(res.output.strip().splitlines()) == 1, res.output
        assert not out.exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep")
    res = invoke("vocab", *common, "--traces", str(traces), "--structural", "4", "--content", "0", "--out", str(full))
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert (full / "x").read_text() == "keep"
