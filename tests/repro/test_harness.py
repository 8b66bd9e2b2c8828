"""The reproduction harness (caching, validation, errors) and the HTML report, on fake reproductions
(the ``load_fake`` fixture of conftest.py: a module written to a file, so its source can change)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rankwise.core import registry
from rankwise.core.errors import UnknownMethodError
from rankwise.repro import harness, report
from rankwise.repro.harness import ReproContractError, ReproductionUnavailable, reproduce
from rankwise.repro.result import DEFAULT_SEEDS, ClaimCheck, ReproResult, Table


@pytest.fixture
def fake(load_fake) -> ModuleType:
    return load_fake()


# --------------------------------------------------------------------------------------------------
# Running and caching


def test_first_run_writes_result_and_figures(repro_cache: Path, tmp_path: Path, fake: ModuleType) -> None:
    out = tmp_path / "a"
    r = reproduce("lora", "smoke", out_dir=out, module=fake)
    assert len(fake.CALLS) == 1
    assert fake.CALLS[0][:2] == ("smoke", list(DEFAULT_SEEDS["smoke"]))
    assert isinstance(r, ReproResult) and not r.cache_hit and r.source_dir == out
    assert (out / "result.json").is_file() and (out / "curve.png").is_file()
    assert r.verdict == "holds"
    saved = json.loads((out / "result.json").read_text())
    assert saved["id"] == "lora" and saved["mode"] == "smoke" and saved["verdict"] == "holds"


def test_second_run_hits_cache_and_copies_files(repro_cache: Path, tmp_path: Path, fake: ModuleType) -> None:
    r1 = reproduce("lora", "quick", seeds=[0, 1], out_dir=tmp_path / "a", module=fake)
    r2 = reproduce("lora", "quick", seeds=[0, 1], out_dir=tmp_path / "b", module=fake)
    assert len(fake.CALLS) == 1
    assert r2.cache_hit and not r1.cache_hit
    assert r2.to_json() == r1.to_json()
    assert (tmp_path / "b" / "curve.png").read_bytes() == (tmp_path / "a" / "curve.png").read_bytes()
    assert json.loads((tmp_path / "b" / "result.json").read_text()) == r1.to_json()
    # The entry lives under the cache root given by RANKWISE_CACHE_DIR.
    assert list((repro_cache / "repro" / "lora").glob("*/result.json"))


def test_cache_misses_when_mode_seeds_or_code_change(repro_cache: Path, tmp_path: Path, fake: ModuleType) -> None:
    out = tmp_path / "out"
    reproduce("lora", "smoke", seeds=[0], out_dir=out, module=fake)
    reproduce("lora", "quick", seeds=[0], out_dir=out, module=fake)  # mode changed
    reproduce("lora", "quick", seeds=[0, 1], out_dir=out, module=fake)  # seeds changed
    assert len(fake.CALLS) == 3
    reproduce("lora", "quick", seeds=[0, 1], out_dir=out, module=fake)  # nothing changed
    assert len(fake.CALLS) == 3
    path = Path(fake.__file__)
    path.write_text(path.read_text() + "\n# an edit\n")
    r = reproduce("lora", "quick", seeds=[0, 1], out_dir=out, module=fake)  # code changed
    assert len(fake.CALLS) == 4 and not r.cache_hit
    # Older code versions of the same (mode, seeds) are pruned: one entry per (mode, seeds).
    metas = [json.loads(p.read_text()) for p in (repro_cache / "repro" / "lora").glob("*/meta.json")]
    pairs = [(m["mode"], tuple(m["seeds"])) for m in metas]
    assert sorted(pairs) == sorted({("smoke", (0,)), ("quick", (0,)), ("quick", (0, 1))})


def test_no_cache_always_runs_and_leaves_cache_alone(repro_cache: Path, tmp_path: Path, fake: ModuleType) -> None:
    for _ in range(2):
        r = reproduce("lora", "smoke", out_dir=tmp_path / "o", use_cache=False, module=fake)
        assert not r.cache_hit
    assert len(fake.CALLS) == 2
    assert not (repro_cache / "repro").exists()


def test_damaged_cache_entry_is_a_miss(repro_cache: Path, tmp_path: Path, fake: ModuleType) -> None:
    reproduce("lora", "smoke", out_dir=tmp_path / "o", module=fake)
    (entry,) = (repro_cache / "repro" / "lora").glob("*/result.json")
    entry.write_text("{not json")
    r = reproduce("lora", "smoke", out_dir=tmp_path / "o", module=fake)
    assert len(fake.CALLS) == 2 and not r.cache_hit
    r = reproduce("lora", "smoke", out_dir=tmp_path / "o", module=fake)
    assert len(fake.CALLS) == 2 and r.cache_hit


def test_module_injected_in_sys_modules_is_found(repro_cache: Path, tmp_path: Path, fake: ModuleType,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rankwise.repro.lora", fake)
    assert registry.has_reproduction("lora")
    assert "lora" in harness.available()
    r = reproduce("LoRA", "smoke", out_dir=tmp_path / "o", use_cache=False)
    assert r.id == "lora" and len(fake.CALLS) == 1


# --------------------------------------------------------------------------------------------------
# Code version


def test_code_files_follow_rankwise_imports(fake: ModuleType) -> None:
    files = harness.code_files(fake)
    assert files is not None
    assert {"rankwise", "rankwise.repro", "rankwise.repro.result"} <= set(files)
    assert fake.__name__ in files
    own = harness.code_files(harness)
    assert own is not None
    # registry imports errors: found transitively, and the harness's own imports are there too.
    assert {"rankwise.core.registry", "rankwise.core.errors", "rankwise.repro.result"} <= set(own)
    assert not any(n.startswith(("torch", "numpy")) for n in own)


def test_code_version_changes_with_a_transitive_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "rankwise"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import VALUE\n")  # relative import
    (pkg / "sub" / "b.py").write_text("VALUE = 1\n")
    (pkg / "sub" / "unused.py").write_text("X = 1\n")
    monkeypatch.setattr(harness, "_package_root", lambda: pkg)
    mod = ModuleType("fake_user_repro")
    mod.__file__ = str(tmp_path / "fake_user_repro.py")
    Path(mod.__file__).write_text("def run(mode, seeds, out_dir):\n    from rankwise.sub import a\n")
    files = harness.code_files(mod)
    assert files is not None and {"rankwise.sub.a", "rankwise.sub.b"} <= set(files)
    assert "rankwise.sub.unused" not in files
    v1 = harness.code_version(mod)
    (pkg / "sub" / "unused.py").write_text("X = 2\n")
    assert harness.code_version(mod) == v1
    (pkg / "sub" / "b.py").write_text("VALUE = 2\n")
    assert harness.code_version(mod) != v1


def test_module_without_source_is_not_cached(repro_cache: Path, tmp_path: Path, fake: ModuleType) -> None:
    mod = ModuleType("no_source")
    mod.run = fake.run  # type: ignore[attr-defined]
    assert harness.code_version(mod) is None
    reproduce("lora", "smoke", out_dir=tmp_path / "o", module=mod)
    reproduce("lora", "smoke", out_dir=tmp_path / "o", module=mod)
    assert len(fake.CALLS) == 2


# --------------------------------------------------------------------------------------------------
# Inputs and errors


def test_mode_and_seed_validation(tmp_path: Path, fake: ModuleType) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        reproduce("lora", "medium", out_dir=tmp_path, module=fake)
    for bad, exc in (([], ValueError), ([-1], ValueError), ([0, 0], ValueError), (["a"], TypeError),
                     ([True], TypeError), ("012", TypeError), ([1.5], TypeError)):
        with pytest.raises(exc):
            harness.resolve_seeds("quick", bad)
    assert harness.resolve_seeds("full", None) == list(DEFAULT_SEEDS["full"])
    assert not fake.CALLS


def test_unknown_and_planned_ids(tmp_path: Path) -> None:
    with pytest.raises(UnknownMethodError, match="did you mean 'swift_svd'"):
        reproduce("swft-svd", out_dir=tmp_path)
    planned = [i for i in registry.all_ids() if not registry.has_reproduction(i)]
    if not planned:
        pytest.skip("every paper has a reproduction")
    with pytest.raises(ReproductionUnavailable, match=r"no reproduction yet \(status: (planned|implemented)\)"):
        reproduce(planned[0], out_dir=tmp_path)


def test_unwritable_out_dir_fails_before_running(tmp_path: Path, fake: ModuleType) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub"):
        with pytest.raises(PermissionError, match="cannot write to output folder"):
            reproduce("lora", "smoke", out_dir=out, module=fake)
    assert not fake.CALLS


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_out_dir_fails_before_running(tmp_path: Path, fake: ModuleType) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="cannot write"):
            reproduce("lora", "smoke", out_dir=ro, module=fake)
    finally:
        ro.chmod(0o700)
    assert not fake.CALLS


@pytest.mark.parametrize("behaviour, message", [
    ("wrong_id", "result.id is 'other'"),
    ("missing_figure", "figure 'missing.png' is listed but missing"),
    ("not_result", "must return a ReproResult"),
    ("no_checks", "checks is empty"),
])
def test_contract_violations_are_reported(tmp_path: Path, behaviour: str, message: str, load_fake) -> None:
    mod = load_fake(behaviour)
    with pytest.raises(ReproContractError, match=message):
        reproduce("lora", "smoke", out_dir=tmp_path / "o", use_cache=False, module=mod)


def test_module_without_run(tmp_path: Path, load_fake) -> None:
    mod = load_fake(source="X = 1\n")
    with pytest.raises(ReproContractError, match="defines no run"):
        reproduce("lora", "smoke", out_dir=tmp_path / "o", module=mod)


def test_wall_time_and_environment_filled_in(tmp_path: Path, load_fake) -> None:
    mod = load_fake("bare")
    r = reproduce("lora", "smoke", seeds=[3], out_dir=tmp_path / "o", use_cache=False, module=mod)
    assert r.wall_time_s > 0
    assert r.environment["seeds"] == [3] and "torch" in r.environment and "python" in r.environment
    saved = json.loads((tmp_path / "o" / "result.json").read_text())
    assert saved["wall_time_s"] == r.wall_time_s and saved["environment"]["seeds"] == [3]


def test_json_round_trip_with_nan(tmp_path: Path) -> None:
    t = Table(columns=["m"], notes={"m": "unit"})
    t.add("method", "m", 1.0)
    t.add("method", "m", float("nan"))
    r = ReproResult(id="lora", mode="smoke", seeds=[0, 1], claim="c", table=t,
                    checks=[ClaimCheck("a", float("nan"), ">", 0.0), ClaimCheck("b", 2.0, "<=", 3.0, unit="s"),
                            ClaimCheck("c", float("inf"), ">", 1.0)],
                    figures=[], notes="n", config={"k": [1, 2]}, wall_time_s=1.5, environment={"x": "y"},
                    extra={"curve": [1.0, 2.0]})
    r.save(tmp_path)
    back = ReproResult.load(tmp_path)
    assert back.to_json() == r.to_json()
    assert math.isnan(back.checks[0].measured) and not back.checks[0].holds
    assert back.checks[2].measured == float("inf") and back.checks[2].holds  # inf survives strict JSON
    assert back.verdict == "does not hold" and back.source_dir == tmp_path
    with pytest.raises(FileNotFoundError):
        ReproResult.load(tmp_path / "nowhere")


# --------------------------------------------------------------------------------------------------
# Report


def _results(tmp_path: Path, repro_cache: Path, load_fake) -> dict:
    ok = load_fake("ok", id="lora")
    r = reproduce("lora", "smoke", seeds=[0, 1], out_dir=tmp_path / "runs" / "lora", module=ok)
    return {"lora": r, "swift_svd": RuntimeError("boom <script>alert(1)</script>"), "ctm": None}


def test_build_report_has_every_paper_and_is_self_contained(repro_cache: Path, tmp_path: Path, load_fake) -> None:
    results = _results(tmp_path, repro_cache, load_fake)
    index = report.build_report(results, tmp_path / "report", mode="smoke")
    page = index.read_text()
    for id in list(registry.PAPERS) + list(registry.REFERENCES):
        assert f"<code>{id}</code>" in page, id
        assert registry.info(id).summary.replace("'", "&#x27;") in page or registry.info(id).summary in page
    assert page.count("<tr id='row-") == len(registry.PAPERS) + len(registry.REFERENCES)
    # the error row: escaped message, no live script
    assert "boom &lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "http://" not in page and "https://" not in page
    # the fake's notes are escaped too, and its figure is copied and inlined
    assert "a fake &lt;b&gt;reproduction&lt;/b&gt;" in page
    assert (tmp_path / "report" / "lora" / "curve.png").is_file()
    assert "src='lora/curve.png'" in page
    assert (tmp_path / "report" / "lora" / "result.json").is_file()
    assert "method has lower loss than baseline" in page and "1.05 ± 0.071" in page

    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    by_id = {p["id"]: p for p in summary["papers"]}
    assert len(by_id) == len(registry.PAPERS) + len(registry.REFERENCES)
    assert by_id["lora"]["outcome"] == "holds" and by_id["lora"]["figures"] == ["lora/curve.png"]
    assert "cpu_time_s" in by_id["lora"] and isinstance(by_id["lora"]["environment"], dict)  # the measured table
    assert by_id["swift_svd"]["outcome"] == "error" and "boom" in by_id["swift_svd"]["error"]
    assert summary["counts"]["holds"] == 1 and summary["counts"]["error"] == 1
    for id, p in by_id.items():
        if id not in results and not registry.has_reproduction(id):
            assert p["outcome"] == "no reproduction"
        assert p["status"] in ("planned", "implemented", "reproduced", "unknown")


def test_build_report_writes_strict_json_for_infinite_margins(repro_cache: Path, tmp_path: Path, load_fake) -> None:
    import dataclasses

    from rankwise.repro.result import ClaimCheck

    results = _results(tmp_path, repro_cache, load_fake)
    r = results["lora"]
    # a check whose measured value is -inf (e.g. a log of zero) makes the result's margin -inf
    r.checks = [dataclasses.replace(r.checks[0], measured=float("-inf"), op=">", threshold=0.0)] + r.checks[1:]
    assert isinstance(r.checks[0], ClaimCheck) and r.margin == float("-inf")
    report.build_report(results, tmp_path / "report", mode="smoke")
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert {p["id"]: p for p in summary["papers"]}["lora"]["margin"] == "-inf"


def test_build_report_rejects_unknown_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown ids"):
        report.build_report({"nope": None}, tmp_path)


def test_run_report_catches_errors_and_uses_cache(repro_cache: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, load_fake) -> None:
    ok = load_fake("ok", id="lora")
    bad = load_fake("raise", id="swift_svd")
    monkeypatch.setitem(sys.modules, "rankwise.repro.lora", ok)
    monkeypatch.setitem(sys.modules, "rankwise.repro.swift_svd", bad)
    out = tmp_path / "report"
    run = report.run_report(mode="smoke", only=["lora", "swift-svd"], out_dir=out)
    assert isinstance(run.results["lora"], ReproResult)
    assert isinstance(run.results["swift_svd"], RuntimeError) and set(run.errors) == {"swift_svd"}
    assert run.index == out / "index.html" and run.index.is_file()
    assert (out / "lora" / "result.json").is_file() and (out / "lora" / "curve.png").is_file()
    assert run.summary["counts"]["error"] == 1 and run.summary["mode"] == "smoke"
    again = report.run_report(mode="smoke", only=["lora"], out_dir=out)
    assert len(ok.CALLS) == 1 and again.results["lora"].cache_hit  # type: ignore[union-attr]
    assert len(bad.CALLS) == 1


def test_run_report_validates_before_running(repro_cache: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, load_fake) -> None:
    ok = load_fake("ok", id="lora")
    monkeypatch.setitem(sys.modules, "rankwise.repro.lora", ok)
    with pytest.raises(UnknownMethodError):
        report.run_report(mode="smoke", only=["lora", "nonsense"], out_dir=tmp_path / "r")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PermissionError):
        report.run_report(mode="smoke", only=["lora"], out_dir=blocker)
    with pytest.raises(ValueError, match="mode"):
        report.run_report(mode="fast", only=["lora"], out_dir=tmp_path / "r")
    planned = [i for i in registry.all_ids() if not registry.has_reproduction(i)]
    if planned:
        with pytest.raises(ReproductionUnavailable):
            report.run_report(mode="smoke", only=["lora", planned[0]], out_dir=tmp_path / "r")
    assert not ok.CALLS


def test_run_report_in_parallel_matches_one_at_a_time(repro_cache: Path, tmp_path: Path) -> None:
    # two real, dependency-free reproductions (simulators), each in its own spawned worker
    ids = ["mi_sprm", "root_purge"]
    done: list[str] = []
    par = report.run_report(mode="smoke", only=ids[::-1], out_dir=tmp_path / "par", use_cache=False, jobs=2,
                            on_done=lambda i, r, s: done.append(i))
    seq = report.run_report(mode="smoke", only=ids[::-1], out_dir=tmp_path / "seq", use_cache=False)
    assert sorted(done) == ids and list(par.results) == ids[::-1]  # the page keeps the asked order
    for id in ids:
        p, s = par.results[id], seq.results[id]
        assert isinstance(p, ReproResult) and isinstance(s, ReproResult), (p, s)
        assert p.verdict == s.verdict and [c.measured for c in p.checks] == [c.measured for c in s.checks]
        assert p.environment["threads"] == max(1, (os.cpu_count() or 1) // 2)
        assert (tmp_path / "par" / id / "result.json").is_file()
    by_id = {r["id"]: r for r in par.summary["papers"]}
    assert all(by_id[i]["verdict"] == seq.results[i].verdict for i in ids)


def test_run_report_rejects_bad_jobs(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="jobs"):
            report.run_report(mode="smoke", only=["root_purge"], out_dir=tmp_path / "r", jobs=bad)  # type: ignore[arg-type]
