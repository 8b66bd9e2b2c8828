"""``rankwise select``: embedded and user model directories, the outputs, and clear errors without partial output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rankwise import cli
from rankwise.zoo.synthetic import P2DWorld

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "pool.jsonl"
    rows = [{**e.as_trl(), "task": e.meta["task"]} for e in P2DWorld().pool(40, seed=2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _common(data: Path, out: Path, *extra: str) -> list[str]:
    return ["select", "--data", str(data), "--out", str(out), "--model", "zoo:p2d-smoke", "--proxy-steps", "2",
            "--head-fraction", "0.25", *extra]


def test_p2d_on_the_embedded_model_writes_subset_and_mask(tmp_path: Path, data: Path) -> None:
    from rankwise.train.p2d import load_heads

    out = tmp_path / "sel"
    res = invoke(*_common(data, out, "--method", "p2d", "--fraction", "0.25"))
    assert res.exit_code == 0, res.output
    assert "kept 10 of 40" in res.stdout
    lines = [json.loads(x) for x in (out / "subset.jsonl").read_text().splitlines()]
    pool = [json.loads(x) for x in data.read_text().splitlines()]
    rec = json.loads((out / "selection.json").read_text())
    assert len(lines) == 10 and lines == [pool[i] for i in rec["indices"]]  # lines as given, extra fields kept
    heads = load_heads(out / "heads.safetensors")
    assert tuple(heads.mask.shape) == (2, 4) and int(heads.mask.sum()) == 2
    assert rec["selected_heads"] == [[l, h] for l, h, _ in heads.heads]
    # the saved mask is reused on another run
    res = invoke(*_common(data, tmp_path / "again", "--heads", str(out / "heads.safetensors")))
    assert res.exit_code == 0, res.output
    assert load_heads(tmp_path / "again" / "heads.safetensors").heads == heads.heads


@pytest.mark.parametrize("method", ["random", "loss"])
def test_baseline_methods_on_a_user_model_directory(tmp_path: Path, data: Path, method: str) -> None:
    from rankwise.zoo.warm import warm_lm

    model, tok = warm_lm("p2d-smoke")
    d = tmp_path / "user-model"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    out = tmp_path / method
    res = invoke("select", "--method", method, "--data", str(data), "--fraction", "0.1", "--out", str(out),
                 "--model", str(d), "--heads", "random")
    assert res.exit_code == 0, res.output
    assert len((out / "subset.jsonl").read_text().splitlines()) == 4
    assert json.loads((out / "selection.json").read_text())["model"] == str(d)


@pytest.mark.parametrize("fraction", ["0", "-0.5", "1.5", "nan"])
def test_fraction_outside_unit_interval(tmp_path: Path, data: Path, fraction: str) -> None:
    res = invoke(*_common(data, tmp_path / "o", "--fraction", fraction))
    assert res.exit_code == 2 and "--fraction" in res.output
    assert not (tmp_path / "o").exists()


def test_bad_inputs_are_one_line_errors_without_partial_output(tmp_path: Path, data: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "task:copy 1 =>"}\n')
    cases = [(["--data", str(empty)], "empty"), (["--data", str(bad)], "bad.jsonl:1"),
             (["--data", str(tmp_path / "missing.jsonl")], "no such data file"),
             (["--method", "magic"], "--method"), (["--model", "zoo:nothing"], "no embedded model"),
             (["--model", str(tmp_path)], "no config.json"), (["--heads", "nowhere"], "--heads")]
    for extra, msg in cases:
        out = tmp_path / "out"
        args = _common(data, out)
        for k in range(0, len(extra), 2):  # replace the option if present, else append it
            if extra[k] in args:
                args[args.index(extra[k]) + 1] = extra[k + 1]
            else:
                args += extra[k:k + 2]
        res = invoke(*args)
        assert res.exit_code == 2, (extra, res.output)
        assert msg in res.output and len(res.output.strip().splitlines()) == 1, (extra, res.output)
        assert not out.exists()


def test_existing_output_needs_overwrite(tmp_path: Path, data: Path) -> None:
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = invoke(*_common(data, out, "--method", "random"))
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
