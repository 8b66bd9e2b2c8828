"""``rankwise finetune``: trains, evaluates, saves an adapter that reloads with identical outputs; bad input."""

from __future__ import annotations

import json
import os
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
           "daf": {"calib_batches": 1, "analysis_every": 1, "rank": 2},  # a DAF round after step 1
           "mtlora": {"rank": 2, "num_experts": 2},
           "lora_mixer": {"rank": 2, "num_experts": 2}}


@pytest.mark.parametrize("method,optimizer", [("lora", "adamw"), ("psoft", "adamw"), ("cdka", "adamw"),
                                              ("daf", "adamw"), ("e2lora", "adamw"), ("mtlora", "adamw"),
                                              ("lora_mixer", "adamw"), ("lora", "adams"), ("lora", "lracs")])
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


@pytest.mark.parametrize("method", ["mtlora", "lora_mixer"])
def test_the_methods_auxiliary_loss_is_added_to_the_cross_entropy(monkeypatch, method):
    """mtLoRA's regularisers / LoRA-Mixer's routing loss are trained with: the logged loss of step 1 is the
    cross-entropy of the same run without the term plus exactly the term (summed in float32)."""
    from rankwise.core import registry

    am = registry.get(method).extras["adapter"]
    original = type(am).auxiliary_loss
    terms: list[torch.Tensor] = []

    def recording(self, model, config):
        fn = original(self, model, config)
        assert fn is not None

        def wrapped(m, batch, outputs, step):
            t = fn(m, batch, outputs, step)
            terms.append(t.detach())
            return t
        return wrapped

    job = _small(method=method, options=OPTIONS[method], steps=1, eval_every=1, limit_eval=4)
    monkeypatch.setattr(type(am), "auxiliary_loss", recording)
    hooked = run_finetune(job)
    monkeypatch.setattr(type(am), "auxiliary_loss", lambda self, model, config: None)
    plain = run_finetune(job)
    assert len(terms) == 1 and float(terms[0]) > 0
    assert hooked.train_losses[0] == float(torch.tensor(plain.train_losses[0]) + terms[0].float())
    assert hooked.train_losses[0] != plain.train_losses[0]


def test_auxiliary_loss_declarations():
    from rankwise.adapt import lora_mixer, mtlora
    from rankwise.core import registry

    assert mtlora.MTLORA.auxiliary_loss(None, mtlora.MtLoRAConfig(balance_alpha=0.0, spectral_lambda=0.0)) is None
    assert lora_mixer.LORA_MIXER.auxiliary_loss(None, lora_mixer.LoRAMixerConfig()) is not None
    for other in ("lora", "cdka", "psoft", "e2lora", "daf"):
        assert registry.get(other).extras["adapter"].auxiliary_loss(None, None) is None


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
        (["finetune", "--method", "cdka", "--rank", "4"], "--rank does not apply to cdka"),
        (["finetune", "--method", "psoft", "-o", "rank=0"], "PSOFTConfig.rank must be an int >= 1"),
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


def test_the_job_lives_in_the_library_and_the_verb_reexports_it():
    from rankwise.train import job
    from rankwise.verbs import finetune as verb

    assert verb.FinetuneJob is job.FinetuneJob and verb.FinetuneJobResult is job.FinetuneJobResult
    # every registered adapter family is reachable, dispatched through the registry
    assert {"lora", "cdka", "psoft", "e2lora", "daf", "mtlora", "lora_mixer"} <= set(job.finetune_methods())
    src = Path(job.__file__).read_text()
    assert "rankwise.zoo" not in src and "rankwise.adapt" not in src
    for method in ("cdka", "daf", "e2lora", "psoft", "mtlora", "lora_mixer"):
        assert f'"{method}"' not in src, f"per-method branch for {method} in train/job.py"


def test_deprecated_option_names_still_work(tmp_path):
    from rankwise.adapt.daf import DAFConfig
    from rankwise.train.job import method_config

    with pytest.warns(DeprecationWarning, match="lora_rank"):
        cfg = method_config(FinetuneJob(method="daf", options={"lora_rank": 2, "analysis_batches": 1}), DAFConfig)
    assert cfg.rank == 2 and cfg.calib_batches == 1


def test_classes_come_from_the_labels_present(tmp_path):
    """Regression: one row labelled 10**12 made finetune allocate max(label) + 1 classes."""
    from rankwise.train.job import MAX_CLASSES, class_labels
    from rankwise.verbs.finetune import load_data

    labels, (rows,) = class_labels([("a", 0), ("b", 5), ("c", 5)])
    assert labels == ["0", "5"] and [y for _, y in rows] == [0, 1, 1]
    data = tmp_path / "huge.jsonl"
    data.write_text("".join(json.dumps({"text": f"text {i}", "label": lab}) + "\n"
                            for i, lab in enumerate([0, 1, 10**12] * 4)))
    d = load_data(FinetuneJob(data=data))
    assert d.labels == ["0", "1", str(10**12)]
    assert sorted({y for _, y in d.train + d.test}) == [0, 1, 2]
    too_many = tmp_path / "many.jsonl"
    too_many.write_text("".join(json.dumps({"text": f"t{i}", "label": f"c{i}"}) + "\n" for i in range(MAX_CLASSES + 1)))
    r = CliRunner().invoke(app, ["finetune", "--data", str(too_many), "--steps", "1"])
    assert r.exit_code == 2 and f"at most {MAX_CLASSES} classes" in r.output


def test_unwritable_out_fails_before_any_work(tmp_path, monkeypatch):
    """Regression: an unwritable --out was found only at the first checkpoint, after training."""
    from rankwise.train import job as job_mod

    def no_work(*a, **k):
        raise AssertionError("the model was built before --out was checked")

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises((NotADirectoryError, PermissionError), match="--out"):
        job_mod.run_finetune(_small(out=blocker / "run"), job_mod.FinetuneData(["a", "b"], [("x", 0)], [("y", 1)]),
                             no_work)
    r = CliRunner().invoke(app, ["finetune", "--steps", "1", "--out", str(blocker / "run")])
    assert r.exit_code == 2 and "--out" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "read-only"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(PermissionError, match="cannot write"):
                job_mod.validate_job(_small(out=ro / "run"))
        finally:
            ro.chmod(0o700)
