"""``rankwise continual``: a tiny BERT directory and two JSONL tasks, every learner, resume, bad options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rankwise import cli

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
WORDS = {0: ["apple", "pear", "plum", "grape"], 1: ["train", "bus", "car", "plane"]}


def invoke(*args: object):
    return CliRunner().invoke(cli.app, [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from rankwise import zoo

    d = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(d)
    AutoTokenizer.from_pretrained(str(zoo.minilm_path()), local_files_only=True).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("data")
    paths = []
    for t, flip in (("fruit", False), ("vehicle", True)):
        p = d / f"{t}.jsonl"
        lines = []
        for i in range(40):
            label = i % 2
            words = WORDS[label if not flip else 1 - label]
            lines.append(json.dumps({"text": f"the {words[i % 4]} number {i}", "label": ["a", "b"][label]}))
        p.write_text("\n".join(lines) + "\n")
        paths.append(p)
    return paths


@pytest.mark.parametrize("method", ["eblora", "lora", "olora", "inflora"])
def test_learns_a_sequence_and_resumes(method, tiny_dir, data_files, tmp_path):
    out = tmp_path / "run"
    common = ("--model", tiny_dir, "--rank", "2", "--batch-size", "8", "--max-length", "16",
              "--energy-threshold", "0.9", "--targets", "query,value,output.dense")
    res = invoke("continual", "--method", method, "--data", *data_files, *common, "--out", out, "--max-tasks", "1")
    assert res.exit_code == 0, res.output
    assert "task 1/2 fruit" in res.output and "1 of 2 tasks learned" in res.output
    saved = json.loads((out / "job.json").read_text())
    assert saved["tasks_done"] == 1 and len(saved["result"]["R"]) == 1
    res = invoke("continual", "--resume", out)
    assert res.exit_code == 0, res.output
    assert "task 2/2 vehicle" in res.output and "MFN" in res.output and "BWT" in res.output
    saved = json.loads((out / "job.json").read_text())
    R = saved["result"]["R"]
    assert saved["tasks_done"] == 2 and len(R) == 2 and R[1][0] is not None and R[1][1] is not None
    assert (out / "state.safetensors").is_file()
    if method == "eblora":
        assert (out / "peft" / "fruit" / "adapter_config.json").is_file()
        assert (out / "peft" / "vehicle" / "adapter_model.safetensors").is_file()
        ratios = [v for s in saved["result"]["spectra"] for v in s.values() if v is not None]
        assert ratios and max(ratios) < 1 + 1e-4
    res = invoke("continual", "--resume", out)
    assert res.exit_code == 2 and "learned already" in res.output


def test_resume_restores_the_state_bit_exactly(tiny_dir, data_files, tmp_path):
    from rankwise.core import io

    common = ("--model", tiny_dir, "--rank", "2", "--batch-size", "8", "--max-length", "16",
              "--energy-threshold", "0.9", "--targets", "query,value")
    full, part = tmp_path / "full", tmp_path / "part"
    assert invoke("continual", "--data", *data_files, *common, "--out", full).exit_code == 0
    assert invoke("continual", "--data", *data_files, *common, "--out", part, "--max-tasks", "1").exit_code == 0
    assert invoke("continual", "--resume", part).exit_code == 0
    a, _ = io.load_tensors(full / "state.safetensors")
    b, _ = io.load_tensors(part / "state.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), k


@pytest.mark.parametrize("args, message", [
    (("--method", "bogus"), "--method"),
    (("--energy-threshold", "1.5"), "--energy-threshold"),
    (("--energy-threshold", "0"), "--energy-threshold"),
    (("--rank", "0"), "--rank"),
    (("--tasks", "topic", "--data", "x.jsonl"), "not both"),
])
def test_bad_options_are_one_line_errors(args, message, tmp_path):
    res = invoke("continual", *args, "--out", tmp_path / "o")
    assert res.exit_code == 2
    assert message in res.output and "Traceback" not in res.output


def test_rank_above_free_directions_is_reported(tiny_dir, data_files, tmp_path):
    res = invoke("continual", "--data", *data_files, "--model", tiny_dir, "--rank", "2", "--energy-threshold", "1",
                 "--targets", "query", "--max-length", "16", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "exceeds the free input directions" in res.output


def test_resume_refuses_to_overwrite_another_directory(tmp_path):
    from rankwise.core import io
    from rankwise.verbs.continual import ContinualJob

    saved = tmp_path / "saved"
    saved.mkdir()
    io.write_json(saved / "job.json", {"kind": "rankwise.continual",
                                       "options": ContinualJob(tasks=("topic",), out=saved).saved()})
    (saved / "state.safetensors").write_bytes(b"")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    res = invoke("continual", "--resume", saved, "--out", other)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert (other / "keep.txt").read_text() == "mine"
