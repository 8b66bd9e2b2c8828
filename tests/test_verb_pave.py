"""``rankwise pave spec/identify`` on user files: JSONL in, spec files out, a ranking back; bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rankwise import cli

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
FAST = ("--steps", "3", "--layers", "5", "--max-length", "16", "--rank", "4")


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pave")
    a = [{"text": t, "label": y} for t, y in [
        ("Return the JSON encoding of an object.", 1), ("Decode a JSON document from a string.", 1),
        ("Return the current working directory.", 0), ("Join two path components.", 0),
        ("Serialize obj to a JSON formatted str.", 1), ("Remove a file from the file system.", 0)]]
    b = [{"text": t, "label": y} for t, y in [
        ("Acquire a lock, blocking or non-blocking.", 1), ("Start the thread's activity.", 1),
        ("Return the sum of the numbers.", 0), ("Compute the square root of x.", 0)]]
    out = {"root": root, "a": _jsonl(root / "a.jsonl", a), "b": _jsonl(root / "b.jsonl", b)}
    for name in ("a", "b"):
        res = invoke("pave", "spec", "--data", str(out[name]), "--out", str(root / f"{name}.pave"), *FAST)
        assert res.exit_code == 0, res.output
        out[f"{name}_spec"] = root / f"{name}.pave"
    return out


def test_spec_files_and_ranking(files: dict[str, Path]) -> None:
    from rankwise.science.pave import PaveSpec

    spec = PaveSpec.load(files["a_spec"])
    assert spec.modules() == [f"encoder.layer.5.attention.self.{p}" for p in ("query", "key", "value")]
    assert spec.config["rank"] == 4 and spec.config["steps"] == 3 and spec.info["n_examples"] == 6
    assert spec.fingerprint.startswith("sha256:") and "MiniLM" in spec.info["base_model"]
    res = invoke("pave", "identify", str(files["a_spec"]), str(files["b_spec"]), str(files["a_spec"]), "--json")
    assert res.exit_code == 0, res.output
    ranking = json.loads(res.stdout)["ranking"]
    assert [m["name"] for m in ranking] == [str(files["a_spec"]), str(files["b_spec"])]  # learnware order: b, a
    assert ranking[0]["cosine"] == pytest.approx(1.0) and ranking[0]["score"] > ranking[1]["score"]
    table = invoke("pave", "identify", str(files["a_spec"]), str(files["b_spec"]))
    assert table.exit_code == 0 and "cosine" in table.stdout and "score" in table.stdout
    only = invoke("pave", "identify", str(files["a_spec"]), str(files["b_spec"]), "--json", "--min-score", "99.9")
    assert [m["name"] for m in json.loads(only.stdout)["ranking"]] == []  # b is not near-identical to a


def test_spec_refuses_to_overwrite_and_bad_labels(files: dict[str, Path]) -> None:
    root = files["root"]
    res = invoke("pave", "spec", "--data", str(files["a"]), "--out", str(files["a_spec"]), *FAST)
    assert res.exit_code == 2 and "exists" in res.output
    bad = _jsonl(root / "bad.jsonl", [{"text": "x y z", "label": "yes"}, {"text": "a b c", "label": 0}])
    res = invoke("pave", "spec", "--data", str(bad), "--out", str(root / "bad.pave"), *FAST)
    assert res.exit_code == 2 and "class indices" in res.output and not (root / "bad.pave").exists()
    far = _jsonl(root / "far.jsonl", [{"text": "x y z", "label": 3}, {"text": "a b c", "label": 0}])
    res = invoke("pave", "spec", "--data", str(far), "--out", str(root / "far.pave"), *FAST)
    assert res.exit_code == 2 and "outside 0..1" in res.output and not (root / "far.pave").exists()
    empty = root / "empty.jsonl"
    empty.write_text("\n")
    res = invoke("pave", "spec", "--data", str(empty), "--out", str(root / "e.pave"), *FAST)
    assert res.exit_code == 2 and "no examples" in res.output
    assert sorted(p.name for p in root.iterdir() if p.suffix == ".pave") == ["a.pave", "b.pave"]


def test_identify_refuses_other_configs_zero_norm_and_other_files(files: dict[str, Path]) -> None:
    from rankwise.core.io import save_tensors
    from rankwise.science.pave import PaveSpec

    root = files["root"]
    r8 = root / "r8.pave"
    res = invoke("pave", "spec", "--data", str(files["b"]), "--out", str(r8), "--steps", "2", "--layers", "5",
                 "--max-length", "16", "--rank", "8")
    assert res.exit_code == 0, res.output
    res = invoke("pave", "identify", str(files["a_spec"]), str(r8))
    assert res.exit_code == 2 and "different configs: rank = 4 vs 8" in res.output
    a = PaveSpec.load(files["a_spec"])
    zero = PaveSpec({n: torch.zeros_like(t) for n, t in a.tensors.items()}, dict(a.config), a.fingerprint)
    zero.save(root / "zero.pave")
    res = invoke("pave", "identify", str(files["a_spec"]), str(root / "zero.pave"))
    assert res.exit_code == 2 and "zero norm" in res.output
    save_tensors(root / "adapter.safetensors", {"x": torch.ones(2)}, {"kind": "rankwise.adapter_state"})
    res = invoke("pave", "identify", str(files["a_spec"]), str(root / "adapter.safetensors"))
    assert res.exit_code == 2 and "not a PAVE spec" in res.output
    res = invoke("pave", "identify", str(files["a_spec"]), str(root / "missing.pave"))
    assert res.exit_code == 2 and "no such file" in res.output


def test_other_base_models(files: dict[str, Path]) -> None:
    """A spec of another encoder directory is refused next to MiniLM's; a model without query/key/value too."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    from rankwise import zoo

    root = files["root"]
    _, tok = zoo.minilm()
    torch.manual_seed(0)
    small = BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64))
    small.save_pretrained(root / "small_bert")
    tok.save_pretrained(root / "small_bert")
    res = invoke("pave", "spec", "--data", str(files["b"]), "--out", str(root / "small.pave"), "--model",
                 str(root / "small_bert"), *FAST)
    assert res.exit_code == 0, res.output
    res = invoke("pave", "identify", str(files["a_spec"]), str(root / "small.pave"))
    assert res.exit_code == 2 and "different base models" in res.output
    llama = LlamaModel(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2))
    llama.save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    res = invoke("pave", "spec", "--data", str(files["b"]), "--out", str(root / "llama.pave"), "--model",
                 str(root / "llama"), *FAST)
    assert res.exit_code == 2 and "target_modules" in res.output and not (root / "llama.pave").exists()
    res = invoke("pave", "spec", "--data", str(files["b"]), "--out", str(root / "x.pave"), "--model", str(root / "nope"))
    assert res.exit_code == 2 and "no such directory" in res.output
