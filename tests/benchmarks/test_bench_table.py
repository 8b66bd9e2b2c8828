"""The harness's goals, spreads and growth fits, the smoke mode, the table of docs/benchmarks.md, and the
larger-than-memory benchmark's checkpoint writer and memory formula."""

import json
import math

import pytest

from benchmarks.harness import Case, Goal, fit_exponent, run_module, time_case
from benchmarks.table import render


def _sleepy(seconds):
    import time

    def factory():
        return lambda: time.sleep(seconds)
    return factory


def test_time_case_reports_raw_times_and_the_spread_of_the_ratio():
    case = Case("c", impls={"a": _sleepy(0.002), "b": _sleepy(0.006)}, anchor="a", repeats=5, warmup=0)
    out = time_case(case)
    assert len(out["b"]["times_s"]) == 5
    assert out["b"]["ratio_q1"] <= out["b"]["ratio_vs_anchor"] * 1.5
    assert out["b"]["ratio_q1"] <= out["b"]["ratio_q3"]
    assert out["a"]["ratio_q1"] == pytest.approx(1.0) and out["a"]["ratio_q3"] == pytest.approx(1.0)


def test_fit_exponent_recovers_a_cubic():
    sizes = {"d=1": 1.0, "d=2": 2.0, "d=4": 4.0}
    times = {k: {"median_s": 1e-3 * d ** 3, "times_s": [1e-3 * d ** 3 * f for f in (0.9, 1.0, 1.1)]}
             for k, d in sizes.items()}
    g = fit_exponent(sizes, times)
    assert g["exponent"] == pytest.approx(3.0)
    assert g["exponent_q1"] == pytest.approx(3.0) and g["exponent_q3"] == pytest.approx(3.0)
    times["d=4"]["median_s"] /= 4  # a quadratic tail
    assert fit_exponent(sizes, times)["exponent"] < 2.5


def test_goals_are_checked_from_the_numbers():
    g = Goal("b at least 2x faster", impl="b", max_ratio=0.5)
    assert g.check({"time": {"b": {"ratio_vs_anchor": 0.4}}}) is True
    assert g.check({"time": {"b": {"ratio_vs_anchor": 0.6}}}) is False
    assert g.check({"time": {}}) is None
    e = Goal("cubic", metric="exponent", tol=0.5)
    assert e.check({"growth": {"exponent": 2.7, "expected_exponent": 3.0}}) is True
    assert e.check({"growth": {"exponent": 2.2, "expected_exponent": 3.0}}) is False
    with pytest.raises(ValueError, match="impl"):
        Goal("x")
    with pytest.raises(ValueError, match="unknown implementation"):
        Case("c", impls={"a": _sleepy(0)}, anchor="a", goals=(g,))
    with pytest.raises(ValueError, match="expected_exponent"):
        Case("c", impls={"a": _sleepy(0), "b": _sleepy(0)}, anchor="a", sizes={"a": 1, "b": 2})


def test_smoke_run_goes_to_its_own_folder_with_one_repeat(tmp_path):
    path = run_module("selftest", tmp_path, memory=False, smoke=True)
    assert path.parent.name == "smoke"
    data = json.loads(path.read_text())
    assert data["smoke"] is True
    (case,) = data["cases"]
    assert case["repeats"] == 1 and case["warmup"] == 0 and case["threads"] >= 1


def _sample_results(tmp_path):
    res = tmp_path / "results"
    (res / "smoke").mkdir(parents=True)

    def t(med, ratio, q1, q3):
        return {"median_s": med, "q1_s": med, "q3_s": med, "n": 5, "times_s": [med] * 5,
                "ratio_vs_anchor": ratio, "ratio_q1": q1, "ratio_q3": q3}

    compress = {"benchmark": "compress", "environment": {"torch": "2.13.0", "threads": 1, "loadavg": [0.1, 0.1, 0.1]},
                "cases": [
                    {"case": "decompose_4096x4096_f32", "anchor": "svd-llm(w)", "params": {}, "repeats": 5,
                     "warmup": 1, "threads": 1,
                     "goals": [Goal("Swift-SVD >= 2x faster", impl="swift-svd", max_ratio=0.5).to_json()],
                     "goals_met": [True],
                     "time": {"swift-svd": t(30.0, 0.38, 0.36, 0.4), "svd-llm(w)": t(80.0, 1.0, 1.0, 1.0),
                              "plain-svd": t(0.05, 0.8, 0.7, 0.9)}},
                    {"case": "decompose_minilm_1536x384_f64", "anchor": "svd-llm(w)", "params": {}, "repeats": 3,
                     "warmup": 1, "threads": 1,
                     "goals": [Goal("Swift-SVD faster", impl="swift-svd", max_ratio=1.0).to_json()],
                     "goals_met": [False],
                     "time": {"swift-svd": t(0.2, 1.25, 1.2, 1.3), "svd-llm(w)": t(0.16, 1.0, 1.0, 1.0)}},
                ]}
    growth = {"benchmark": "growth", "environment": {"threads": 1}, "cases": [
        {"case": "swift_svd_dxd", "anchor": "d=1024", "params": {}, "repeats": 5, "warmup": 1, "threads": 1,
         "goals": [Goal("fitted exponent near 3", metric="exponent").to_json()], "goals_met": [True],
         "time": {"d=1024": t(0.5, 1, 1, 1), "d=2048": t(4.0, 8, 7.9, 8.1), "d=4096": t(31.0, 62, 61, 63)},
         "growth": {"sizes": [1024, 2048, 4096], "exponent": 2.98, "exponent_q1": 2.95, "exponent_q3": 3.01,
                    "expected_exponent": 3.0}}]}
    large = {"benchmark": "large_checkpoint", "environment": {}, "metrics": [
        {"name": "peak RSS above the import baseline / checkpoint size", "value": 0.21, "goal": "<= 0.3", "met": True}]}
    smoke = {"benchmark": "merge", "smoke": True, "cases": []}
    for name, d in (("compress", compress), ("growth", growth), ("large_checkpoint", large)):
        (res / f"{name}.json").write_text(json.dumps(d))
    (res / "smoke" / "merge.json").write_text(json.dumps(smoke))
    (res / "merge.json").write_text(json.dumps(smoke))  # a smoke result in the wrong place is still ignored
    return res


def test_table_renders_every_ratio_spread_goal_and_pending(tmp_path):
    md = render(_sample_results(tmp_path), modules=["compress", "growth", "merge"])
    assert "| decompose_4096x4096_f32 | swift-svd | 30 s | 0.38 | 0.36 - 0.4 | 5 / 1 / 1 |" in md
    assert "| decompose_4096x4096_f32 | plain-svd | 50 ms | 0.8 | 0.7 - 0.9 |" in md
    assert "Swift-SVD >= 2x faster (ratio <= 0.5): **met**" in md
    assert "Swift-SVD faster (ratio <= 1): **not met**" in md
    assert "3 / 1 / 1 (fewer than 5 repeats)" in md
    assert "| swift_svd_dxd | 1024, 2048, 4096 |" in md and "| 2.98 | 2.95 - 3.01 | 3 |" in md
    assert "| peak RSS above the import baseline / checkpoint size | 0.21" in md
    assert "**merge** (`python -m benchmarks.run merge`): pending" in md  # smoke results never tabulated
    assert "Goals: 3 met, 1 not met, " in md
    assert "loadavg [0.1, 0.1, 0.1] (at the end of the run: its own load included)" in md


def test_table_without_results_is_all_pending(tmp_path):
    md = render(tmp_path, modules=["compress"])
    assert "Goals: 0 met, 0 not met" in md
    assert "**large_checkpoint**" in md and "pending" in md
    assert "|" not in md  # no table row: nothing is written that was not measured
    assert "goal: decompose_4096x4096_f32: Swift-SVD >= 2x faster than SVD-LLM(W) at 4096x4096" in md


def test_large_checkpoint_writer_and_memory_formula(tmp_path):
    from benchmarks.large_checkpoint import llama_shape, memory_estimate, write_checkpoint
    from rankwise.compress.serialization import CheckpointReader

    shape = llama_shape(0.004, hidden=32, intermediate=86, heads=4, kv_heads=2, vocab=64)
    size = write_checkpoint(tmp_path / "ck", shape, blocks_per_shard=2)
    assert size >= 0.004e9
    reader = CheckpointReader(tmp_path / "ck")
    assert len(set(reader.key_file.values())) >= 3  # sharded
    assert reader.get("model.layers.0.mlp.up_proj.weight").shape == (86, 32)
    est = memory_estimate(dict(shape, torch_dtype="float32"), tokens=100)
    # the formula's block weights and checkpoint size agree with what was written (norms aside)
    assert est["checkpoint"] == pytest.approx(size, rel=0.05)  # file headers and norms aside
    d, f = 32, 86
    # Swift-SVD: Y^T Y of q, k, v, o, down; X^T X of gate and up (wider at the output) and of every
    # target for the error measurement
    assert est["statistics_S"] == 8 * (9 * d * d + 2 * 16 * 16 + f * f)
    assert memory_estimate(dict(shape, torch_dtype="float32"), tokens=100, measure_error=False)["statistics_S"] \
        == 8 * (5 * d * d + 2 * 16 * 16)
    # ... which is what the pipeline collects for one block
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.compress import CompressConfig, calibrate

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(shape, num_hidden_layers=1), max_position_embeddings=32)).eval()
    for measure in (True, False):
        cal = calibrate(model, [torch.randint(0, 64, (2, 8))],
                        CompressConfig(method="swift-svd", allocation="uniform", measure_error=measure))
        held = sum(t.numel() * t.element_size() for st in cal.stats.values() for t in st.tensors().values())
        assert held == memory_estimate(dict(shape, torch_dtype="float32"), tokens=100,
                                       measure_error=measure)["statistics_S"]
    assert math.isclose(est["activations_A"], 2 * 100 * d * 4)
    assert est["peak"] >= est["block_weights_P"] + est["statistics_S"]


def test_docs_table_is_the_one_rendered_from_the_kept_results():
    """docs/benchmarks.md is what ``python -m benchmarks.table`` renders from benchmarks/results/*.json.

    The measured JSON is kept in the repository (smoke results are not), so a fresh clone regenerates the
    same table; after a benchmark run, ``python -m benchmarks.table`` rewrites the doc.
    """
    from benchmarks.table import DOC, RESULTS

    assert DOC.read_text() == render(RESULTS)
