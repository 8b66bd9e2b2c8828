"""``load_model_dir``: every ``--model`` directory is loaded with its weights complete, its tokenizer
present and fitting, or refused with one line (issue "Nothing silently wrong", items 1, 2, 5)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from rankwise.compress.model_dir import load_model_dir
from rankwise.compress.serialization import load_compressed, save_compressed
from rankwise.core.errors import ArtifactError
from rankwise.core.layers import LowRankLinear
from tests.compress import model_dirs as md


def _old_style_compressed_dir(path):
    """A compressed directory as `rankwise compress --out` writes it (tokenizer beside the model)."""
    model, rep, tok = md.compressed()
    save_compressed(model, path, rep)
    tok.save_pretrained(str(path))
    return path, model, tok


# ----------------------------------------------------------------------------------------------
# item 1: a compressed directory is loaded as what it is, wherever a --model is loaded


def test_compressed_dir_loads_as_compressed_for_every_task(tmp_path):
    d, model, tok = _old_style_compressed_dir(tmp_path / "c")
    got, got_tok = load_model_dir(d)
    assert torch.equal(md.outputs(got, got_tok), md.outputs(model, tok))
    cls, _ = load_model_dir(d, task="sequence-classification", num_labels=3, seed=1)
    assert type(cls).__name__ == "BertForSequenceClassification" and cls.classifier.out_features == 3
    assert sum(isinstance(m, LowRankLinear) for m in cls.modules()) == 12
    want = load_compressed(d).state_dict()
    for k, v in cls.bert.state_dict().items():
        assert torch.equal(v, want[k]), k
    again, _ = load_model_dir(d, task="sequence-classification", num_labels=3, seed=1)
    assert torch.equal(again.classifier.weight, cls.classifier.weight)  # the new head is seeded
    assert torch.isfinite(cls.classifier.weight).all() and cls.classifier.weight.std() > 0


def test_finetune_and_compress_call_sites_load_compressed_dirs(tmp_path):
    from rankwise.verbs.compress import _load_model
    from rankwise.verbs.finetune import build_model

    d, model, tok = _old_style_compressed_dir(tmp_path / "c")
    ft, _ = build_model(str(d), 2, 0)
    assert sum(isinstance(m, LowRankLinear) for m in ft.modules()) == 12
    enc = tok(md.TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(ft.bert(**enc).last_hidden_state, model(**enc).last_hidden_state)
    cm, _ = _load_model(d)
    assert sum(isinstance(m, LowRankLinear) for m in cm.modules()) == 12


def test_compress_then_finetune_from_the_command_line(tmp_path):
    """The issue's reproduction: `rankwise compress ... --out C`, then `rankwise finetune --model C`."""
    from typer.testing import CliRunner

    from rankwise.cli import app

    d = md.dense_dir(tmp_path / "m")
    (tmp_path / "calib.txt").write_text("\n".join(md.TEXTS * 3) + "\n")
    rows = [{"text": f"the {w} is a value", "label": i % 2} for i, w in enumerate(md.WORDS[:20])]
    (tmp_path / "train.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    runner = CliRunner()
    r = runner.invoke(app, ["-q", "compress", "--method", "svd", "--model", str(d), "--calib", str(tmp_path / "calib.txt"),
                            "--n-calib", "16", "--n-eval", "8", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c" / "vocab.txt").is_file() or (tmp_path / "c" / "tokenizer.json").is_file()
    r = runner.invoke(app, ["-q", "finetune", "--model", str(tmp_path / "c"), "--data", str(tmp_path / "train.jsonl"),
                            "--steps", "2", "--rank", "2", "-o", 'target=["query.up", "value.up"]',
                            "--out", str(tmp_path / "ft")])
    assert r.exit_code == 0, r.output
    assert "reloaded: held-out logits identical" in r.output


def _rewrite_weights(d, edit):
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("task", ["auto", "sequence-classification"])
def test_missing_unexpected_or_resized_weights_are_refused_with_names(tmp_path, task):
    kw = {"num_labels": 2} if task != "auto" else {}
    d = md.dense_dir(tmp_path / "missing")
    _rewrite_weights(d, lambda t: t.pop("encoder.layer.1.output.dense.weight"))
    with pytest.raises(ArtifactError, match=r"missing.*encoder\.layer\.1\.output\.dense\.weight"):
        load_model_dir(d, task=task, **kw)
    d = md.dense_dir(tmp_path / "extra")
    _rewrite_weights(d, lambda t: t.update({"encoder.layer.7.attention.self.query.weight": torch.zeros(16, 16)}))
    with pytest.raises(ArtifactError, match=r"not in the model.*encoder\.layer\.7"):
        load_model_dir(d, task=task, **kw)
    d = md.dense_dir(tmp_path / "resized")
    _rewrite_weights(d, lambda t: t.update({"pooler.dense.weight": torch.zeros(16, 8)}))
    with pytest.raises(ArtifactError, match=r"pooler\.dense\.weight"):
        load_model_dir(d, task=task, **kw)


def test_finetune_refuses_a_checkpoint_with_missing_backbone_weights(tmp_path):
    from rankwise.verbs.finetune import build_model

    d = md.dense_dir(tmp_path / "m")
    _rewrite_weights(d, lambda t: t.pop("encoder.layer.0.attention.self.query.weight"))
    with pytest.raises(ArtifactError, match="query.weight"):
        build_model(str(d), 2, 0)


def _transformers_log(fn):
    """Run ``fn`` and return what transformers logged (its logger does not propagate to pytest's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf = logging.getLogger("transformers")
    hf.addHandler(handler)
    try:
        fn()
    finally:
        hf.removeHandler(handler)
    return "\n".join(r.getMessage() for r in records)


def test_a_new_or_resized_head_is_allowed_and_reported_not_silenced(tmp_path):
    from rankwise.verbs.finetune import build_model

    d = md.dense_dir(tmp_path / "base")
    model, _ = load_model_dir(d, task="sequence-classification", num_labels=2, seed=3)
    assert model.classifier.out_features == 2
    # transformers' loading report on the new head reaches the user (finetune no longer silences it)
    assert "classifier.weight" in _transformers_log(lambda: build_model(str(d), 2, 0))
    head3 = md.dense_dir(tmp_path / "head3", model=md.bert(cls="BertForSequenceClassification", num_labels=3))
    model, _ = load_model_dir(head3, task="sequence-classification", num_labels=2)
    assert model.classifier.out_features == 2
    kept, _ = load_model_dir(head3, task="sequence-classification", num_labels=3)
    ref = md.bert(cls="BertForSequenceClassification", num_labels=3)
    assert torch.equal(kept.classifier.weight, ref.classifier.weight)


# ----------------------------------------------------------------------------------------------
# item 2: the tokenizer must be there and be this model's


def test_a_directory_without_tokenizer_is_refused(tmp_path):
    from rankwise.verbs.compress import compress_command

    d = md.dense_dir(tmp_path / "m", with_tokenizer=False)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    with pytest.raises(ArtifactError, match="no tokenizer"):
        load_model_dir(d)
    (tmp_path / "calib.txt").write_text("\n".join(md.TEXTS * 2) + "\n")
    with pytest.raises(ArtifactError, match="no tokenizer"):
        compress_command("svd", 0.5, model_dir=d, calib_file=tmp_path / "calib.txt", n_calib=8, n_eval=4,
                         measure_speed=False)


def test_a_tokenizer_that_does_not_fit_the_embedding_is_refused(tmp_path):
    d = md.dense_dir(tmp_path / "small", model=md.bert(vocab=16))  # 41 tokens > 16 rows
    with pytest.raises(ArtifactError, match="41 tokens.*16 rows"):
        load_model_dir(d)
    d = md.dense_dir(tmp_path / "specials", with_tokenizer=False)
    md.tokenizer(d, words=[])  # only the special tokens: every word would be [UNK]
    with pytest.raises(ArtifactError, match="only 5 tokens.*64 embedding rows"):
        load_model_dir(d)
    model, tok = load_model_dir(md.dense_dir(tmp_path / "ok"))  # 41 tokens, 64 rows: padded table, fine
    assert len(tok) == 41


# ----------------------------------------------------------------------------------------------
# item 5: damaged directories are user errors (one line, exit 2), not tracebacks


@pytest.mark.parametrize("damage", ["empty config", "garbled config", "unknown model_type", "truncated weights",
                                    "garbage weights", "no directory"])
def test_damaged_model_directories_are_one_line_errors(tmp_path, damage):
    from typer.testing import CliRunner

    from rankwise.cli import app

    d = md.dense_dir(tmp_path / "m")
    w = d / "model.safetensors"
    if damage == "empty config":
        (d / "config.json").write_text("")
    elif damage == "garbled config":
        (d / "config.json").write_text('{"model_type": "bert", "hidden_size": ')
    elif damage == "unknown model_type":
        (d / "config.json").write_text('{"model_type": "no-such-model"}')
    elif damage == "truncated weights":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "garbage weights":
        w.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\x00" * 64)
    else:
        d = tmp_path / "nowhere"
    with pytest.raises((ArtifactError, FileNotFoundError)):
        load_model_dir(d)
    (tmp_path / "calib.txt").write_text("\n".join(md.TEXTS) + "\n")
    r = CliRunner().invoke(app, ["compress", "--method", "svd", "--model", str(d), "--calib", str(tmp_path / "calib.txt")])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rankwise: error: ") and str(d) in lines[0], r.stderr
