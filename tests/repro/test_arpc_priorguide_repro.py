"""The issue-18 reproductions ARPC and PriorGuide end to end in smoke mode: the cached artefacts come from
``rankwise zoo build``'s builders (following ``--size``), and the figures the docs name reach the report."""

from __future__ import annotations

import json

import pytest


def test_arpc_builder_follows_size_and_the_report_shows_the_rate_distortion_figure(tmp_path, monkeypatch):
    pytest.importorskip("constriction")
    monkeypatch.setenv("RANKWISE_CACHE_DIR", str(tmp_path / "cache"))
    from rankwise.repro import arpc
    from rankwise.repro.kit import arpc_codec, artefacts
    from rankwise.repro.report import build_report

    assert artefacts.build_all(only=("arpc",), size="large-not-a-recipe") == {}  # no recipe of that size: skipped
    built = artefacts.build_all(only=("arpc",), size="smoke")["arpc"]
    assert set(built) == set(arpc_codec.RECIPES["smoke"].seeds) and all(v["built_now"] for v in built.values())
    again = artefacts.build_all(only=("arpc",), size="smoke")["arpc"]
    assert not any(v["built_now"] for v in again.values())  # cached: a second build only checks
    assert set(arpc_codec.RECIPES["small"].seeds) == set(arpc.SETTINGS["full"].seeds)  # full mode's seeds are built
    res = arpc.run("smoke", None, tmp_path / "out")
    assert "arpc_rate_distortion.png" in res.figures and (tmp_path / "out" / "arpc_rate_distortion.png").is_file()
    page = build_report({"arpc": res}, tmp_path / "report")
    html = page.read_text()
    assert "arpc/arpc_rate_distortion.png" in html and (tmp_path / "report" / "arpc" / "arpc_rate_distortion.png").is_file()
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    row = next(r for r in summary["papers"] if r["id"] == "arpc")
    assert "arpc/arpc_rate_distortion.png" in row["figures"] and not row["missing_figures"]


def test_priorguide_smoke_has_the_spec_blocks(tmp_path):
    from rankwise.repro import priorguide

    res = priorguide.run("smoke", None, tmp_path / "out")
    for name in ("priorguide_gaussian_linear_samples.png", "priorguide_gaussian_linear_mixture_samples.png",
                 "priorguide_c2st.png", "priorguide_scale_sweep.png"):
        assert name in res.figures and (tmp_path / "out" / name).is_file(), name
    rows = res.table.rows
    assert "mmd" in res.table.columns
    assert "PriorGuide [mixture q]" in rows and "PriorGuide [scale sweep]" in rows
    assert "retrained on q" in rows and "retrained on q [mixture q]" in rows  # the spec's gold standard
    statements = " | ".join(c.statement for c in res.checks)
    assert "prior-scale sweep" in statements and "2-component mixture q" in statements
    assert priorguide.SETTINGS["full"].tasks == ("gaussian_linear", "two_moons", "sir")


@pytest.mark.slow  # ~25 s of CPU: three tasks' tiny models and references
def test_priorguide_smoke_runs_the_full_mode_tasks(tmp_path):
    """Two moons and SIR (full mode's other tasks) run end to end on tiny in-memory models."""
    from rankwise.repro import priorguide

    res = priorguide.run("smoke", None, tmp_path / "out",
                         overrides={"tasks": ("gaussian_linear", "two_moons", "sir"), "sweep_scales": ()})
    rows = res.table.rows
    for tag in ("[two moons]", "[SIR]"):
        assert f"PriorGuide {tag}" in rows and f"PriorGuide [mixture q] {tag}" in rows, tag
    statements = " | ".join(c.statement for c in res.checks)
    assert "sir, off-centre Gaussian q" in statements and "two_moons, 2-component mixture q" in statements
    assert "priorguide_sir_samples.png" in res.figures


def test_priorguide_retrained_on_q_pairs_come_from_q_on_the_training_box():
    from rankwise.repro.kit import score_models as zm

    for task in zm.TASKS:
        q, box = zm.new_prior(task), zm.train_prior(task)
        theta, x = zm.q_task_data(task, "gaussian", 0, 2000)
        assert theta.shape == (2000, 2) and x.shape[0] == 2000 and box.contains(theta.double()).all()
        assert (theta.double().mean(0) - q.means[0]).abs().max() < 0.05  # q's mean, not the box's centre
    a, _ = zm.q_task_data("gaussian_linear", "mixture", 0, 2000)
    assert (a[:, 0] > 0).float().mean().item() == pytest.approx(0.5, abs=0.05)  # both components
    with pytest.raises(ValueError, match="kind"):
        zm.q_score_model("gaussian_linear", "uniform", 0, cache=False)
