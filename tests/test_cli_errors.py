"""Every usage error of every verb is one line ``rankwise: error: <option>: <message>`` on stderr, exit 2
(issue "Nothing silently wrong", item 10): no usage box, the option named, what it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rankwise import cli

ENV = {"COLUMNS": "80", "NO_COLOR": "1"}

# (arguments, what the line must name, and what else it must say)
BAD = [
    (["compress", "--method", "svd", "--ratio", "abc"], "--ratio", "(0, 1]"),
    (["compress", "--method", "svd", "--n-calib", "1.5"], "--n-calib", "integer"),
    (["compress", "--method", "svd", "--bogus"], "--bogus", "no such option"),
    (["compress", "--ratio", "0.5"], "--method", "required"),
    (["reproduce", "lora", "--seeds", "1.5"], "--seeds", "non-negative integers"),
    (["reproduce", "lora", "--seeds", "a", "b"], "--seeds", "'a'"),
    (["reproduce", "lora", "--seeds", "1", "b"], "--seeds", "'b'"),
    (["reproduce", "lora", "--seeds"], "--seeds", "requires"),
    (["reproduce", "lora", "--smoke", "--quick"], "--smoke", "--quick"),
    (["reproduce"], "ID", "required"),
    (["report", "--seeds", "x"], "--seeds", "non-negative integers"),
    (["federate", "--clients", "abc"], "--clients", "integer"),
    (["federate", "--clients", "0"], "--clients", ">= 1"),
    (["finetune", "--steps", "x"], "--steps", "integer"),
    (["finetune", "--lr", "fast"], "--lr", "float"),
    (["merge", "--rank", "two", "a", "--out", "o"], "--rank", "integer"),
    (["merge", "--out", "o"], "ADAPTERS", "required"),
    (["list", "--family", "nope"], "--family", "compress"),
    (["zoo", "build", "--size"], "--size", "requires"),
    (["nonsense"], "nonsense", "finetune"),
    (["--bogus", "list"], "--bogus", "no such option"),
]


@pytest.mark.parametrize("args,option,says", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_a_bad_invocation_is_one_line_naming_the_option(args, option, says):
    r = CliRunner().invoke(cli.app, args, env=ENV)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("rankwise: error: ") and option in line and says in line, line
    assert "Usage:" not in r.output and "╭" not in r.output and "Traceback" not in r.output


def test_a_non_utf8_data_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_bytes(json.dumps({"text": "fine", "label": 0}).encode() + b"\n"
                    + b'{"text": "caf\xe9", "label": 1}\n')
    r = CliRunner().invoke(cli.app, ["finetune", "--data", str(bad)], env=ENV)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert f"{bad}:2: not UTF-8" in r.stderr


def test_a_non_utf8_calibration_file_names_the_file_and_line(tmp_path):
    from rankwise.core.textfiles import read_texts

    bad = tmp_path / "calib.txt"
    bad.write_bytes(b"one line\nanother line\n\xff\xfe third\n")
    with pytest.raises(ValueError, match=rf"{bad}:3: not UTF-8"):
        read_texts(bad)


def test_debug_keeps_the_usage_error_of_click(monkeypatch):
    """RANKWISE_DEBUG=1 shows click's own report (a traceback for a user error)."""
    r = CliRunner().invoke(cli.app, ["compress", "--method", "svd", "--ratio", "abc"],
                           env={**ENV, "RANKWISE_DEBUG": "1"})
    assert r.exit_code == 2 and "rankwise: error:" not in r.output


def test_help_still_works():
    r = CliRunner().invoke(cli.app, ["compress", "--help"], env=ENV)
    assert r.exit_code == 0 and "--ratio" in r.output
    r = CliRunner().invoke(cli.app, [], env=ENV)
    assert r.exit_code == 2 and "compress" in r.output  # no arguments: the help, as before


def test_readme_states_the_format():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "prints one line and exits with code 2" in readme
