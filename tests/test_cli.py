"""The ``rankwise`` command: in-process through typer's CliRunner, and as a real subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

import rankwise.zoo
from rankwise import cli
from rankwise.core import registry
from rankwise.readme import papers_table_markdown

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, *args: str, **env: str):
    return runner.invoke(cli.app, list(args), env={**ENV, **env})


def _planned_id() -> str:
    ids = [i for i in registry.PAPERS if not registry.has_reproduction(i)]
    if not ids:
        pytest.skip("every paper has a reproduction")
    return ids[0]


@pytest.fixture
def fake_lora(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repro_cache: Path, load_fake) -> ModuleType:
    """A fake ``rankwise.repro.lora`` (whatever the real one does), with a private cache."""
    mod = load_fake("ok", id="lora")
    monkeypatch.setitem(sys.modules, "rankwise.repro.lora", mod)
    return mod


# --------------------------------------------------------------------------------------------------
# list


def test_list_shows_every_paper_and_reference(runner: CliRunner) -> None:
    res = invoke(runner, "list")
    assert res.exit_code == 0, res.output
    for id in list(registry.PAPERS) + list(registry.REFERENCES):
        assert id in res.stdout, id
    assert "Papers (38)" in res.stdout
    for status in ("planned", "implemented", "reproduced"):
        n = sum(r["status"] == status for r in registry.table(include_references=True))
        assert (status in res.stdout) == (n > 0)


def test_list_markdown_is_the_readme_table(runner: CliRunner) -> None:
    res = invoke(runner, "list", "--markdown")
    assert res.exit_code == 0
    assert res.stdout == papers_table_markdown()


def test_list_family_filter(runner: CliRunner) -> None:
    res = invoke(runner, "list", "--family", "compress")
    assert res.exit_code == 0
    shown = {id for id in registry.all_ids() if f" {id} " in res.stdout}
    assert shown == {id for id, p in {**registry.PAPERS, **registry.REFERENCES}.items() if p.family == "compress"}
    res = invoke(runner, "list", "--family", "nonsense")
    assert res.exit_code == 2 and "adapt" in res.output


# --------------------------------------------------------------------------------------------------
# reproduce


def test_reproduce_unknown_id_exits_2_with_suggestion(runner: CliRunner) -> None:
    res = invoke(runner, "reproduce", "swft-svd")
    assert res.exit_code == 2
    assert "did you mean 'swift_svd'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_reproduce_planned_id_exits_2(runner: CliRunner) -> None:
    id = _planned_id()
    res = invoke(runner, "reproduce", id)
    assert res.exit_code == 2
    assert "no reproduction yet" in res.stderr and "Traceback" not in res.output


def test_debug_env_reraises(runner: CliRunner) -> None:
    res = invoke(runner, "reproduce", "swft-svd", RANKWISE_DEBUG="1")
    assert res.exit_code != 2
    assert isinstance(res.exception, KeyError)  # UnknownMethodError, with its traceback


def test_reproduce_prints_table_checks_verdict_and_paths(runner: CliRunner, fake_lora: ModuleType,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = invoke(runner, "reproduce", "lora", "--smoke", "--seeds", "0", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert fake_lora.CALLS[0][:2] == ("smoke", [0, 1])
    for text in ("method", "baseline", "loss", "Claim:", "method has lower loss than baseline",
                 "Verdict: holds", str(out / "result.json"), str(out / "curve.png")):
        assert text in res.stdout, text
    assert json.loads((out / "result.json").read_text())["seeds"] == [0, 1]
    # The second time comes from the cache.
    res = invoke(runner, "reproduce", "lora", "--smoke", "--seeds", "0,1", "--out", str(out))
    assert res.exit_code == 0 and "from the cache" in res.stdout and len(fake_lora.CALLS) == 1
    # --no-cache recomputes.
    res = invoke(runner, "reproduce", "lora", "--smoke", "--seeds=0,1", "--out", str(out), "--no-cache")
    assert res.exit_code == 0 and len(fake_lora.CALLS) == 2


@pytest.mark.parametrize("args, seeds", [
    (["--seeds", "3", "4", "5"], [3, 4, 5]),
    (["--seeds", "3,4"], [3, 4]),
    (["--seeds", "3", "--seeds", "4"], [3, 4]),
    ([], [0, 1]),  # quick mode's default
])
def test_seed_forms(runner: CliRunner, fake_lora: ModuleType, tmp_path: Path, args: list[str], seeds: list[int]) -> None:
    res = invoke(runner, "reproduce", *args, "lora", "--out", str(tmp_path / "o"), "--no-cache")
    assert res.exit_code == 0, res.output
    assert fake_lora.CALLS[-1][:2] == ("quick", seeds)


@pytest.mark.parametrize("args, message", [
    (["--seeds", "x"], "seeds"),
    (["--seeds", "1", "1"], "distinct"),
    (["--smoke", "--full"], "choose one of"),
])
def test_bad_options_exit_2(runner: CliRunner, fake_lora: ModuleType, tmp_path: Path, args: list[str], message: str) -> None:
    res = invoke(runner, "reproduce", "lora", *args, "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert message in res.output and "Traceback" not in res.output
    assert not fake_lora.CALLS


def test_unwritable_out_exits_2_before_running(runner: CliRunner, fake_lora: ModuleType, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    res = invoke(runner, "reproduce", "lora", "--smoke", "--out", str(blocker / "sub"))
    assert res.exit_code == 2
    assert "cannot write to output folder" in res.stderr and "Traceback" not in res.output
    assert not fake_lora.CALLS
    res = invoke(runner, "report", "--smoke", "--only", "lora", "--out", str(blocker))
    assert res.exit_code == 2 and "cannot write" in res.stderr and not fake_lora.CALLS


def test_quiet_prints_only_paths(runner: CliRunner, fake_lora: ModuleType, tmp_path: Path) -> None:
    res = invoke(runner, "--quiet", "reproduce", "lora", "--smoke", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0
    lines = res.stdout.strip().splitlines()
    assert lines == [f"result: {tmp_path / 'o' / 'result.json'}", f"figure: {tmp_path / 'o' / 'curve.png'}"]


# --------------------------------------------------------------------------------------------------
# report


def test_report_with_an_error_row(runner: CliRunner, fake_lora: ModuleType, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch, load_fake) -> None:
    bad = load_fake("raise", id="swift_svd")
    monkeypatch.setitem(sys.modules, "rankwise.repro.swift_svd", bad)
    out = tmp_path / "report"
    res = invoke(runner, "report", "--smoke", "--only", "lora", "swift_svd", "--out", str(out))
    assert res.exit_code == 1, res.output  # the report is written; the failure is signalled
    assert f"report: {(out / 'index.html').resolve()}" in res.stdout
    assert "1 holds" in res.stdout and "1 error" in res.stdout and "boom" in res.stdout
    # not a terminal: one line per finished reproduction (id, verdict, seconds), in the order run
    done = [ln for ln in res.stdout.splitlines() if re.fullmatch(r"\S+ +.+ +\(\d+\.\d s\)", ln)]
    assert [ln.split()[0] for ln in done] == ["lora", "swift_svd"], res.stdout
    assert "holds" in done[0] and "error: boom" in done[1]
    page = (out / "index.html").read_text()
    assert all(f"<code>{id}</code>" in page for id in registry.all_ids())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["error"] == 1 and summary["counts"]["holds"] == 1
    res = invoke(runner, "report", "--smoke", "--only", "lora", "--out", str(out))
    assert res.exit_code == 0 and len(fake_lora.CALLS) == 1  # cached
    res = invoke(runner, "--quiet", "report", "--smoke", "--only", "lora", "--out", str(out))
    assert res.exit_code == 0 and res.stdout.strip().splitlines() == [f"report: {(out / 'index.html').resolve()}"]


def test_report_only_unknown_or_planned(runner: CliRunner, tmp_path: Path) -> None:
    res = invoke(runner, "report", "--only", "nosuchpaper", "--out", str(tmp_path / "r"))
    assert res.exit_code == 2 and "unknown method id" in res.stderr
    res = invoke(runner, "report", "--only", _planned_id(), "--out", str(tmp_path / "r"))
    assert res.exit_code == 2 and "no reproduction yet" in res.stderr
    res = invoke(runner, "report", "--jobs", "0", "--out", str(tmp_path / "r"))
    assert res.exit_code == 2 and "--jobs" in res.stderr and not (tmp_path / "r").exists()


# --------------------------------------------------------------------------------------------------
# zoo


def test_zoo_build_calls_the_zoo(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def build(force: bool = False, size: str = "small") -> str:
        calls.append((force, size))
        return "built"

    monkeypatch.setattr(rankwise.zoo, "build", build, raising=False)
    from rankwise.repro.kit import artefacts

    monkeypatch.setattr(artefacts, "build_all",
                        lambda force=False, size="small": calls.append(("artefacts", force, size)) or {})
    res = invoke(runner, "zoo", "build", "--force")
    assert res.exit_code == 0, res.output
    assert calls == [(True, "small"), ("artefacts", True, "small")] and "built" in res.stdout
    calls.clear()
    res = invoke(runner, "zoo", "build", "--size", "smoke")
    assert res.exit_code == 0 and calls == [(False, "smoke"), ("artefacts", False, "smoke")], res.output
    # a size only the reproductions' builders know (full modes' own models) skips the zoo's part
    monkeypatch.setattr(artefacts, "sizes", lambda: ("full", "small", "smoke"))
    calls.clear()
    res = invoke(runner, "zoo", "build", "--size", "full")
    assert res.exit_code == 0 and calls == [("artefacts", False, "full")], res.output
    calls.clear()
    res = invoke(runner, "zoo", "build", "--size", "huge")
    assert res.exit_code != 0 and calls == [] and "huge" in res.output


def test_artefact_builders_follow_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A builder with sizes builds the asked size if it has that recipe; one without sizes builds for
    the default size only."""
    import types

    from rankwise.repro.kit import artefacts

    calls = []
    sized = types.SimpleNamespace(RECIPES={"smoke": 1, "small": 2},
                                  build=lambda force=False, size="small": calls.append(("sized", size)) or size)
    plain = types.SimpleNamespace(build=lambda force=False: calls.append(("plain",)) or "ok")
    monkeypatch.setitem(sys.modules, "fake_sized", sized)
    monkeypatch.setitem(sys.modules, "fake_plain", plain)
    monkeypatch.setattr(artefacts, "BUILDERS", {"a": "fake_sized:build", "b": "fake_plain:build"})
    assert artefacts.build_all(size="smoke") == {"a": "smoke"} and calls == [("sized", "smoke")]
    calls.clear()
    assert artefacts.build_all() == {"a": "small", "b": "ok"} and calls == [("sized", "small"), ("plain",)]
    assert artefacts.build_all(size="large") == {}
    # SIZES, when a builder has it, lists what it builds (e.g. a size that reuses another's first stage)
    sized.SIZES = ("small", "full")
    calls.clear()
    assert artefacts.build_all(size="full") == {"a": "full"} and artefacts.sizes() == ("full", "small")
    with pytest.raises(ValueError, match="unknown artefact builders"):
        artefacts.build_all(only=("nope",))


def test_zoo_build_missing_is_a_clear_error(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(rankwise.zoo, "build", raising=False)
    monkeypatch.setattr(rankwise.zoo, "__getattr__", lambda name: (_ for _ in ()).throw(AttributeError(name)),
                        raising=False)
    res = invoke(runner, "zoo", "build")
    assert res.exit_code == 2 and "zoo" in res.stderr and "Traceback" not in res.output


# --------------------------------------------------------------------------------------------------
# argument rewriting and the console entry point


def test_expand_multi() -> None:
    from rankwise.verbs.common import expand_multi as ex
    assert ex(["--seeds", "0", "1", "lora"]) == ["--seeds", "0", "--seeds", "1", "lora"]
    assert ex(["--only", "a", "b", "--quick"]) == ["--only", "a", "--only", "b", "--quick"]
    assert ex(["--seeds", "x", "1"]) == ["--seeds", "x", "--seeds", "1"]
    assert ex(["--seeds"]) == ["--seeds"]
    assert ex(["x", "--", "--seeds", "1", "2"]) == ["x", "--", "--seeds", "1", "2"]


def _rankwise_exe() -> Path:
    exe = Path(sys.executable).parent / "rankwise"
    if not exe.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    return exe


def test_console_script_list() -> None:
    env = {**os.environ, **ENV}
    p = subprocess.run([str(_rankwise_exe()), "list"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    for id in registry.PAPERS:
        assert id in p.stdout


def test_console_script_user_error_is_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANKWISE_DEBUG"}
    p = subprocess.run([str(_rankwise_exe()), "reproduce", "swft-svd"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "rankwise: error: unknown method id 'swft_svd'; did you mean 'swift_svd'? (`rankwise list` shows all ids)"]
    assert p.stdout == ""
