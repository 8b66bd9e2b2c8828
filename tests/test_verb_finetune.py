"""``rankwise finetune``: trains, evaluates, saves an adapter that reloads with identical outputs; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.core.errors import ArtifactError
from rankwise.verbs.finetune import FinetuneJob, load_finetuned, read_jsonl, run_finetune
from rankwise.train.finetune import evaluate

TEXTS = ["open a file and read its bytes", "parse a json document", "sort a list of numbers",
         "compute the square root", "start a thread pool", "send an http request", "format a date string",
         "join two paths", "round a float", "count items in a dict", "encode text as utf-8", "await a task"]


def _jsonl(path: Path, n: int = 24, labels=("io", "math", "net")) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": TEXTS[i % len(TEXTS)] + f" #{i}", "label": labels[i % len(labels)]}) + "\n")
    return path


def _small(**kw) -> FinetuneJob:
    base = dict(task="topic", steps=2, batch_size=8, max_length=16, limit_train=32, limit_eval=16, eval_every=1)
    base.update(kw)
    return FinetuneJob(**base)


OPTIONS = {"cdka": {"calib_batches": 1, "budget": "lora_r1"},
           "daf": {"analysis_batches": 1, "analysis_every": 1, "lora_rank": 2}}  # a DAF round after step 1


@pytest.mark.parametrize("method,optimizer", [("lora", "adamw"), ("psoft", "adamw"), ("cdka", "adamw"),
                                              ("daf", "adamw"), ("e2lora", "adamw"), ("lora", "adams"),
                                              ("lora", "lracs")])
def test_trains_saves_and_reloads_identically(tmp_path, method, optimizer):
    out = tmp_path / "run"
    kw = {"options": OPTIONS[method]} if method in OPTIONS else {}
    res = run_finetune(_small(method=method, optimizer=optimizer, out=out, **kw))
    assert res.reload_max_abs_diff == 0.0
    assert [h[0] for h in res.history] == [1, 2]
    assert res.adapter_parameters > 0 and res.trainable_parameters > res.adapter_parameters
    meta = json.loads((out / "finetune.json").read_text())
    assert meta["method"] == method and meta["steps_done"] == 2 and len(meta["history"]) == 2
    model, tok, _ = load_finetuned(out)
    ev = evaluate(model, tok, [("sort a list of numbers", 0), ("send an http request", 1)], max_length=16)
    model2, _, _ = load_finetuned(out)
    ev2 = evaluate(model2, tok, [("sort a list of numbers", 0), ("send an http request", 1)], max_length=16)
    assert torch.equal(ev.logits, ev2.logits)
    # the adapter changed the model: the base model with the trained head alone gives other logits
    from rankwise import zoo

    base, _ = zoo.minilm_classifier(len(meta["labels"]))
    base.classifier.load_state_dict({k.split(".", 1)[1]: v for k, v in
                                     __import__("safetensors.torch").torch.load_file(out / "head.safetensors").items()})
    ev0 = evaluate(base, tok, [("sort a list of numbers", 0), ("send an http request", 1)], max_length=16)
    assert not torch.equal(ev0.logits, ev.logits)


def test_cli_jsonl_data_and_user_model_dir(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from rankwise import zoo

    _, tok = zoo.minilm()
    model_dir = tmp_path / "tiny-bert"
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = _jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["--quiet", "finetune", "--method", "lora", "--model", str(model_dir), "--data",
                                 str(data), "--steps", "3", "--batch-size", "4", "--max-length", "16", "--rank", "2",
                                 "-o", "alpha=4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "held-out logits identical" in r.output
    meta = json.loads((out / "finetune.json").read_text())
    assert meta["labels"] == ["io", "math", "net"] and meta["model"] == str(model_dir.resolve())
    assert meta["method_config"]["rank"] == 2 and meta["method_config"]["alpha"] == 4
    model, _, _ = load_finetuned(out)
    assert model.config.hidden_size == 32


def test_bad_inputs_fail_before_any_work(tmp_path):
    runner = CliRunner()
    cases = [
        (["finetune", "--method", "nope"], "not one of lora"),
        (["finetune", "--method", "psoft", "--optimizer", "adams"], "use it with --method lora"),
        (["finetune", "--task", "topic", "--data", str(tmp_path / "x.jsonl")], "exactly one of --task"),
        (["finetune", "--method", "lora", "-o", "nonsense=1"], "has no field(s) nonsense"),
        (["finetune", "--method", "cdka", "--rank", "4"], "only used with config_mode='fixed'"),
        (["finetune", "--steps", "0"], "--steps must be an int >= 1"),
        (["finetune", "--task", "no-such-task"], "no-such-task"),
        (["finetune", "--model", str(tmp_path / "missing"), "--data", str(_jsonl(tmp_path / "d.jsonl"))],
         "no such directory"),
    ]
    for args, msg in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert msg in r.output, (args, r.output)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    r = runner.invoke(app, ["finetune", "--steps", "1", "--out", str(full)])
    assert r.exit_code == 2 and "--overwrite" in r.output
    assert [p.name for p in full.iterdir()] == ["keep.txt"]


def test_read_jsonl_names_the_bad_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a", "label": 0}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with 'text' and 'label'"):
        read_jsonl(p)
    p.write_text('{"text": "a", "label": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(p)
    p.write_text('{"text": "a", "label": 1.5}\n')
    with pytest.raises(ValueError, match="'label' must be an int or a string"):
        read_jsonl(p)


def test_corrupt_artefact_is_rejected(tmp_path):
    out = tmp_path / "run"
    run_finetune(_small(out=out, steps=1))
    head = out / "head.safetensors"
    data = bytearray(head.read_bytes())
    data[-5] ^= 0xFF
    head.write_bytes(bytes(data))
    with pytest.raises(ArtifactError):
        load_finetuned(out)
    with pytest.raises(ArtifactError, match="not a rankwise finetune directory"):
        load_finetuned(tmp_path)
