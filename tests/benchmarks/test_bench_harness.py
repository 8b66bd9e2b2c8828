import json

import pytest

from benchmarks.harness import Case, run_module, time_case


def _recorder(calls):
    """A factory maker whose implementations append their tag to ``calls`` when run."""
    def mk(tag):
        def factory():
            return lambda: calls.append(tag)
        return factory
    return mk


def test_alternating_timing_reports_ratio_against_anchor():
    calls = []
    mk = _recorder(calls)
    case = Case("c", impls={"a": mk("a"), "b": mk("b")}, anchor="a", repeats=4, warmup=0)
    out = time_case(case)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # alternating, order flipped each round
    assert out["a"]["ratio_vs_anchor"] == pytest.approx(1.0)
    assert set(out) == {"a", "b"} and out["b"]["n"] == 4


def test_cold_implementations_skip_only_the_warmup():
    calls = []
    mk = _recorder(calls)
    case = Case("c", impls={"a": mk("a"), "slow": mk("slow")}, anchor="a", repeats=2, warmup=2, cold=("slow",))
    out = time_case(case)
    assert calls == ["a", "a", "a", "slow", "slow", "a"]  # two warm-up calls of "a" only, then alternating
    assert out["slow"]["n"] == 2


def test_case_rejects_unknown_cold_implementation_and_zero_memory_calls():
    with pytest.raises(ValueError, match="cold"):
        Case("c", impls={"a": lambda: (lambda: None)}, anchor="a", cold=("b",))
    with pytest.raises(ValueError, match="memory_calls"):
        Case("c", impls={"a": lambda: (lambda: None)}, anchor="a", memory_calls=0)


def test_case_rejects_unknown_anchor():
    with pytest.raises(ValueError, match="anchor"):
        Case("c", impls={"a": lambda: (lambda: None)}, anchor="z")


def test_run_module_writes_json_with_time_and_memory(tmp_path):
    path = run_module("selftest", tmp_path, memory=True)
    data = json.loads(path.read_text())
    (case,) = data["cases"]
    assert case["anchor"] == "one"
    # Four matmuls per call must take longer than one: the measurement can tell them apart.
    assert case["time"]["four"]["ratio_vs_anchor"] > 1.5
    for impl in ("one", "four"):
        assert case["memory"][impl]["peak_rss_mib"] > 0
    assert "torch" in data["environment"] and data["environment"]["loadavg_at"] == "start"
