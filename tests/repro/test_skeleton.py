"""The reproduction skeleton: settings and overrides, evidence (kinds, intervals, preconditions), verdicts,
old result files, and the harness's handling of overrides (validation, recording, cache key)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rankwise.repro import evidence
from rankwise.repro.harness import cache_key, reproduce
from rankwise.repro.result import ClaimCheck, Precondition, ReproResult, Table
from rankwise.repro.skeleton import Reproduction, Settings, parse_overrides, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToySettings(Settings):
    n: int = setting(10, "examples", lo=1)
    lr: float = setting(0.1, "learning rate", lo=0.0)
    targets: tuple[str, ...] = setting(("q", "v"), "modules")
    cap: int | None = setting(None, "optional cap", lo=1)
    flag: bool = setting(False, "a switch")
    kind: str = setting("a", "a choice", choices=("a", "b"))


def test_overrides_parse_strings_to_the_field_types() -> None:
    s = ToySettings().with_overrides({"n": "20", "lr": "1e-3", "targets": "q,k,v", "cap": "5", "flag": "true",
                                      "kind": "b", "seeds": "0,1,2"})
    assert (s.n, s.lr, s.targets, s.cap, s.flag, s.kind, s.seeds) == (20, 1e-3, ("q", "k", "v"), 5, True, "b",
                                                                        (0, 1, 2))
    assert ToySettings(cap=3).with_overrides({"cap": "none"}).cap is None
    assert ToySettings().with_overrides({"n": 7, "lr": 1}).lr == 1.0  # Python values, an int for a float
    assert ToySettings().with_overrides({}) == ToySettings()
    assert ToySettings().to_json()["targets"] == ["q", "v"]


@pytest.mark.parametrize("overrides, message", [
    ({"n": "0"}, "ToySettings.n must be an int >= 1, got 0"),
    ({"n": "ten"}, "cannot read 'ten' as int for setting 'n'"),
    ({"lr": "-1"}, "ToySettings.lr must be a finite number >= 0"),
    ({"flag": "maybe"}, "cannot read 'maybe' as bool"),
    ({"kind": "c"}, "ToySettings.kind must be one of 'a', 'b', got 'c'"),
    ({"seeds": "1,1"}, "ToySettings.seeds must be distinct"),
    ({"n": 2.5}, "ToySettings.n must be an int"),
])
def test_bad_overrides_name_the_field_and_value(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ToySettings().with_overrides(overrides)


def test_unknown_setting_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown setting 'm' for ToySettings; the settings are: seeds, n, lr"):
        ToySettings().with_overrides({"m": "1"})


def test_parse_overrides() -> None:
    assert parse_overrides(["a=1", "b=x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["a"])
    with pytest.raises(ValueError, match="given twice"):
        parse_overrides(["a=1", "a=2"])


def test_settings_fields_are_immutable() -> None:
    with pytest.raises(TypeError, match="immutable"):
        setting([1, 2], "a list")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToySettings().n = 3  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# Evidence and verdicts


def _result(checks: list[ClaimCheck], pre: list[Precondition] | None = None, mode: str = "quick") -> ReproResult:
    t = Table(columns=["acc"])
    t.add("m", "acc", 1.0)
    return ReproResult(id="lora", mode=mode, seeds=[0], claim="c", table=t, checks=checks,
                       preconditions=pre or [])


def test_interval_containing_the_threshold_is_inconclusive() -> None:
    diffs = [[1.0, -1.0] * 10 + [1.0]]  # mean 1/21, wide interval around 0
    c = ClaimCheck("method beats baseline", 1 / 21, ">", 0.0, samples=diffs)
    assert c.holds and c.status == "inconclusive" and c.ci[0] < 0 < c.ci[1]
    n, unit = c.to_decide
    assert unit == "examples per seed" and n > 21
    r = _result([c])
    assert r.verdict == "inconclusive" and "contains the threshold" in r.reason and "CI" in r.reason


def test_decisive_interval_gives_holds_or_does_not_hold() -> None:
    good = [[0.5, 0.4, 0.6, 0.5] * 10]
    c = ClaimCheck("beats", 0.5, ">=", 0.1, samples=good)
    assert c.status == "holds" and c.ci[0] > 0.1 and c.to_decide is None
    bad = ClaimCheck("beats by a lot", 0.5, ">=", 0.9, samples=good)
    assert bad.status == "does not hold"
    assert _result([c]).verdict == "holds" and _result([c]).reason == ""
    assert _result([c, bad]).verdict == "does not hold"
    # a decisive failure outweighs an inconclusive check
    unsure = ClaimCheck("unsure", 1 / 21, ">", 0.0, samples=[[1.0, -1.0] * 10 + [1.0]])
    assert _result([unsure, bad]).verdict == "does not hold"


def test_abs_mean_statistic_and_seed_bootstrap() -> None:
    samples = [[0.1, 0.2], [0.0, 0.1], [-0.1, 0.3]]
    iv = evidence.paired_bootstrap(samples)
    assert iv.over_seeds and iv.n_seeds == 3 and iv.lo <= iv.estimate <= iv.hi
    assert evidence.paired_bootstrap(samples) == iv  # seeded: deterministic
    assert not evidence.paired_bootstrap(samples[:2]).over_seeds
    c = ClaimCheck("same accuracy", abs(-0.05), "<=", 0.2, samples=[[-0.1, 0.0]], statistic="abs_mean")
    assert c.ci[0] >= 0.0
    with pytest.raises(ValueError, match="is not the mean of its samples"):
        ClaimCheck("wrong measured", 0.3, ">", 0.0, samples=[[0.1, 0.2]])
    with pytest.raises(ValueError, match="empty"):
        evidence.paired_bootstrap([[]])


def test_failed_precondition_makes_the_verdict_inconclusive() -> None:
    c = ClaimCheck("beats", 0.5, ">=", 0.1)
    pre = Precondition("the baseline learned: accuracy - chance", 0.01, ">", 0.1)
    r = _result([c], [pre])
    assert r.verdict == "inconclusive"
    assert r.reason.startswith("precondition failed: the baseline learned") and "failed" in r.reason
    assert _result([c], [Precondition("ok", 0.5, ">", 0.1)]).verdict == "holds"


def test_wiring_only_and_wiring_failures() -> None:
    w = ClaimCheck("same logits as PEFT", 0.0, "<=", 1e-5, kind="wiring")
    r = _result([w])
    assert r.verdict == "wiring only" and r.verdict_text == "quick checks wiring only"
    broken = ClaimCheck("same logits as PEFT", 1.0, "<=", 1e-5, kind="wiring")
    r = _result([broken, ClaimCheck("beats", 0.5, ">=", 0.1)])
    assert r.verdict == "does not hold" and "wiring check failed" in r.reason
    with pytest.raises(ValueError, match="ClaimCheck.kind must be one of"):
        ClaimCheck("x", 0.0, "<=", 1.0, kind="other")


def test_json_round_trip_keeps_intervals_kinds_and_preconditions(tmp_path: Path) -> None:
    c = ClaimCheck("beats", 1 / 21, ">", 0.0, samples=[[1.0, -1.0] * 10 + [1.0]])
    r = _result([c, ClaimCheck("same", 0.0, "<=", 1e-5, kind="wiring")], [Precondition("p", 1.0, ">", 0.5)])
    r.overrides = {"n": "20"}
    r.save(tmp_path)
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["verdict"] == "inconclusive" and data["reason"]
    assert data["checks"][0]["ci"] == list(c.ci) and data["checks"][0]["to_decide"]["count"] > 21
    assert data["checks"][1]["kind"] == "wiring" and data["preconditions"][0]["holds"] is True
    back = ReproResult.load(tmp_path)
    assert back.to_json() == data and back.checks[0].status == "inconclusive"


def test_old_result_json_without_the_new_fields_loads(tmp_path: Path) -> None:
    r = _result([ClaimCheck("beats", 0.5, ">=", 0.1), ClaimCheck("fails", 0.0, ">=", 0.1)])
    data = r.to_json()
    for k in ("reason", "preconditions", "overrides", "cpu_time_s"):
        del data[k]
    for c in data["checks"]:
        for k in ("kind", "status"):
            del c[k]
    (tmp_path / "result.json").write_text(json.dumps(data))
    old = ReproResult.load(tmp_path)
    assert [c.kind for c in old.checks] == ["claim", "claim"] and old.preconditions == [] and old.overrides == {}
    assert old.verdict == "does not hold"


# --------------------------------------------------------------------------------------------------
# The harness with a skeleton reproduction

TOY_SOURCE = '''
import dataclasses
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Reproduction, Settings, pyplot, save_figure, setting

CALLS = []


@dataclasses.dataclass(frozen=True, kw_only=True)
class S(Settings):
    n: int = setting(8, "examples per seed", lo=1)
    shift: float = setting(0.5, "how much better the method is")
    floor: float = setting(0.0, "the precondition's floor")


class Toy(Reproduction):
    id = "lora"
    claim = "The method beats the baseline."
    settings = {"smoke": S(n=4), "quick": S(seeds=(3,)), "full": S(n=32)}

    def measure(self, s, seed):
        CALLS.append((s.n, seed))
        return {"diffs": [s.shift + (0.1 if (i + seed) % 2 else -0.1) for i in range(s.n)]}

    def table(self, s, records):
        t = Table(columns=["gain"])
        for r in records:
            t.add("method", "gain", sum(r["diffs"]) / len(r["diffs"]))
        self.t = t
        return t

    def preconditions(self, s, records):
        return [Precondition("the gain is above the floor", self.t.mean("method", "gain"), ">", s.floor)]

    def checks(self, s, records):
        return [ClaimCheck("gain", self.t.mean("method", "gain"), ">", 0.0, samples=[r["diffs"] for r in records]),
                ClaimCheck("examples", float(s.n), ">=", 1, kind="wiring")]

    def figures(self, s, records, out_dir):
        plt = pyplot()
        fig, ax = plt.subplots()
        ax.plot([0, 1])
        return [save_figure(fig, out_dir / "toy.png")]


REPRODUCTION = Toy
run = Toy.run
'''


@pytest.fixture
def toy(tmp_path: Path) -> ModuleType:
    path = tmp_path / "toy_src" / "rankwise_toy_skeleton.py"
    path.parent.mkdir()
    path.write_text(TOY_SOURCE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("rankwise_toy_skeleton", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_skeleton_run_records_settings_overrides_and_times(repro_cache: Path, tmp_path: Path, toy: ModuleType) -> None:
    r = reproduce("lora", mode="smoke", out_dir=tmp_path / "a", module=toy, overrides={"n": "6"})
    assert toy.CALLS == [(6, 0)] and r.overrides == {"n": 6} and r.config["settings"]["n"] == 6
    assert r.verdict == "holds" and r.checks[0].ci is not None and r.wall_time_s > 0 and r.cpu_time_s > 0
    assert (tmp_path / "a" / "toy.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temporary files left
    data = json.loads((tmp_path / "a" / "result.json").read_text())
    assert data["overrides"] == {"n": 6} and data["preconditions"][0]["holds"]
    # the mode's own seeds (quick: one seed, 3) unless the caller gives some
    assert reproduce("lora", mode="quick", out_dir=tmp_path / "q", module=toy, use_cache=False).seeds == [3]
    assert reproduce("lora", mode="quick", seeds=[1], out_dir=tmp_path / "q", module=toy, use_cache=False).seeds == [1]


def test_precondition_failure_through_the_harness(repro_cache: Path, tmp_path: Path, toy: ModuleType) -> None:
    r = reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"floor": "5"}, use_cache=False)
    assert r.verdict == "inconclusive" and "the gain is above the floor" in r.reason


def test_cache_key_includes_overrides(repro_cache: Path, tmp_path: Path, toy: ModuleType) -> None:
    assert cache_key("lora", "smoke", [0], "c") != cache_key("lora", "smoke", [0], "c", {"n": "6"})
    assert cache_key("lora", "smoke", [0], "c", {"n": "6"}) != cache_key("lora", "smoke", [0], "c", {"n": "7"})
    reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"n": "6"})
    hit = reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"n": "6"})
    assert hit.cache_hit and len(toy.CALLS) == 1
    other = reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"n": "7"})
    assert not other.cache_hit and len(toy.CALLS) == 2
    assert reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"n": "6"}).cache_hit
    assert reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"n": 6}).cache_hit  # same run


def test_bad_overrides_fail_before_running(tmp_path: Path, toy: ModuleType, load_fake) -> None:
    with pytest.raises(ValueError, match="unknown setting 'm'"):
        reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"m": "1"})
    with pytest.raises(ValueError, match="S.n must be an int >= 1"):
        reproduce("lora", mode="smoke", out_dir=tmp_path, module=toy, overrides={"n": "0"})
    assert toy.CALLS == []
    legacy = load_fake(tmp_path)
    with pytest.raises(ValueError, match="no settings to override"):
        reproduce("lora", mode="smoke", out_dir=tmp_path, module=legacy, overrides={"n": "1"})


def test_every_converted_reproduction_declares_valid_settings() -> None:
    from rankwise.core import registry
    from rankwise.repro.harness import load_module, reproduction_class

    converted = 0
    for id in (i for i in registry.all_ids() if registry.has_reproduction(i)):
        cls = reproduction_class(load_module(id))
        if cls is None:
            continue
        converted += 1
        assert cls.id == id and cls.claim.strip()
        assert set(cls.settings) == {"smoke", "quick", "full"}, id
        for mode, s in cls.settings.items():
            assert isinstance(s, Settings) and s.with_overrides({}) == s, (id, mode)
            assert all(s.docs().values()), f"{id}: every setting is documented"
    assert converted >= 3


# --------------------------------------------------------------------------------------------------
# The command line and the report


def test_cli_show_settings_and_set(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rankwise import cli

    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    r = CliRunner().invoke(cli.app, ["reproduce", "lora", "--smoke", "--show-settings", "--set", "rank=4",
                                     "targets=query,key"], env=env)
    assert r.exit_code == 0, r.output
    assert "rank" in r.output and " 4 " in r.output and "['query', 'key']" in r.output
    r = CliRunner().invoke(cli.app, ["reproduce", "lora", "--smoke", "--set", "rnk=4", "--out", str(tmp_path)], env=env)
    assert r.exit_code != 0 and "unknown setting 'rnk'" in r.output and "the settings are" in r.output
    r = CliRunner().invoke(cli.app, ["reproduce", "lora", "--smoke", "--set", "rank"], env=env)
    assert r.exit_code != 0 and "key=value" in r.output


def test_report_shows_intervals_reasons_and_preconditions(repro_cache: Path, tmp_path: Path, toy: ModuleType) -> None:
    from rankwise.repro.report import build_report

    r = reproduce("lora", mode="smoke", out_dir=tmp_path / "run", module=toy, overrides={"floor": "5"})
    index = build_report({"lora": r}, tmp_path / "report", mode="smoke")
    page = index.read_text()
    assert "inconclusive" in page and "95% interval" in page and "Precondition" in page
    assert "the gain is above the floor" in page and "Settings changed" in page
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    rec = next(p for p in summary["papers"] if p["id"] == "lora")
    assert rec["verdict"] == "inconclusive" and rec["reason"].startswith("precondition failed")
    assert rec["checks"][0]["kind"] == "claim" and len(rec["checks"][0]["ci"]) == 2
    assert rec["overrides"] == {"floor": 5.0} and summary["counts"]["inconclusive"] == 1


def test_per_seed_fragments_join_like_one_table() -> None:
    from rankwise.repro.skeleton import merge_in_order

    whole, parts = Table(columns=["a", "b"]), []
    for seed in (0, 1):
        part = Table(columns=["a", "b"])
        for t in (whole, part):
            t.add("x", "a", seed)
            if seed == 1:
                t.add("y", "b", 2.0)
            t.add("x", "b", 10 + seed)
        parts.append(part)
    joined = Table(columns=["a", "b"])
    for p in parts:
        joined.extend(p)
    assert joined.to_json() == whole.to_json()
    merged = merge_in_order([{"r": [1], "d": {"k": [1]}}, {"d": {"k": [2], "j": [3]}, "r": [4], "s": 5}])
    assert merged == {"r": [1, 4], "d": {"k": [1, 2], "j": [3]}, "s": 5} and list(merged) == ["r", "d", "s"]


# --------------------------------------------------------------------------------------------------
# Global generators: seeded per seed, restored after the run


class _Draws(Reproduction):
    """Draws from every global generator in measure and measure_joint, and seeds torch's itself (a leaker)."""

    id = "lora"
    claim = "Draws depend on the seed only."
    settings = {"smoke": Settings(), "quick": Settings(), "full": Settings()}

    def measure(self, s: Settings, seed: int) -> dict:
        import random

        import numpy as np
        import torch

        out = {"py": random.random(), "np": float(np.random.rand()), "torch": torch.rand(3).tolist()}
        torch.manual_seed(12345)  # what transformers' set_seed or a library's own seeding does
        return out

    def measure_joint(self, s: Settings, records: Any) -> float:
        import torch

        return float(torch.rand(()))

    def table(self, s: Settings, records: Any) -> Table:
        self.draws = list(records)
        return Table(columns=["x"])

    def checks(self, s: Settings, records: Any) -> list[ClaimCheck]:
        return [ClaimCheck("ran", 1.0, ">=", 1.0, kind="wiring")]


def _global_states() -> tuple:
    import random

    import numpy as np
    import torch

    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def test_measure_sees_seeded_global_generators_and_the_caller_gets_its_own_back(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    def run(prior: int, seeds: list[int], out: str) -> list:
        random.seed(prior), np.random.seed(prior), torch.manual_seed(prior)
        before = _global_states()
        repro = _Draws()
        from rankwise.repro.skeleton import execute

        execute(repro, "smoke", seeds, tmp_path / out)
        assert _global_states() == before  # restored, although measure seeded torch's generator itself
        return repro.draws

    a = run(1, [0, 1], "a")
    b = run(2, [0, 1], "b")  # another state before the run: the same draws
    assert a == b
    assert a[0] != a[1]  # two seeds, two streams
    c = run(1, [1], "c")  # seed 1 alone draws what seed 1 drew after seed 0 (no carry-over between seeds)
    assert c[0] == a[1]
