"""``rankwise federate``: the verb runs, checkpoints, resumes, and rejects bad options (in-process backend)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("flwr")

from rankwise import cli  # noqa: E402
from rankwise.core.lora import AdapterState  # noqa: E402

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
SMALL = ["--task", "synthetic", "--clients", "4", "--rank", "4", "--clients-per-round", "2", "--local-steps", "2",
         "--backend", "inprocess"]


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=ENV)


def test_federate_runs_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = invoke("federate", "--method", "fslora", "--rounds", "1", "--out", str(out), *SMALL)
    assert res.exit_code == 0, res.output
    assert "round 1: accuracy" in res.output and "KB/client" in res.output
    assert json.loads((out / "history.json").read_text())[-1]["round"] == 1
    res = invoke("federate", "--method", "fslora", "--rounds", "2", "--out", str(out), "--resume", *SMALL)
    assert res.exit_code == 0, res.output
    assert "round 2: accuracy" in res.output and "round 1:" not in res.output
    resumed = AdapterState.load(out / "global_adapter.safetensors")
    res = invoke("federate", "--method", "fslora", "--rounds", "2", "--out", str(tmp_path / "straight"), *SMALL)
    assert res.exit_code == 0, res.output
    assert resumed.allclose(AdapterState.load(tmp_path / "straight" / "global_adapter.safetensors"))


@pytest.mark.parametrize("args,needle", [
    (["--method", "fedprox"], "--method must be one of fslora, fedavg, hetlora, flexlora, ub-smoe"),
    (["--client-ranks", "2,9"], "--client-ranks: client 1 has rank 9"),
    (["--client-ranks", "a,b"], "--client-ranks must be integers separated by commas"),
    (["--task", "nope"], "--task must be minilm, synthetic, synthetic-moe or pkg.module:factory, got 'nope'"),
    (["--resume"], "--resume needs --out"),
    (["--server-optimizer", "lbfgs"], "--server-optimizer must be one of 'avg', 'sgd', 'adam', got 'lbfgs'"),
    (["--clients", "0"], "--clients must be an int >= 1, got 0"),
    (["--clients-per-round", "100"], "--clients-per-round must be an int in [1, --clients=4], got 100"),
    (["--clients-per-round", "0"], "--clients-per-round must be an int in [1, --clients=4], got 0"),
    (["--rounds", "0"], "--rounds must be an int >= 1, got 0"),
    (["--rank", "0"], "--rank must be an int >= 1, got 0"),
    (["--local-steps", "0"], "--local-steps must be an int >= 1, got 0"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--backend", "ray"], "--backend must be flower or inprocess, got 'ray'"),
    (["--round-timeout", "-1"], "--round-timeout must be a number of seconds > 0, got -1.0"),
    (["--aggregation", "mode"], "--aggregation must be one of 'mean', 'median', 'trimmed', 'krum', got 'mode'"),
    (["--trim-fraction", "0.5"], "--trim-fraction must be a finite number >= 0 and < 0.5, got 0.5"),
    (["--max-update-norm-ratio", "abc"], "--max-update-norm-ratio must be a number >= 1 or off, got 'abc'"),
    (["--max-update-norm-ratio", "0.5"], "--max-update-norm-ratio must be a finite number >= 1 or None, got 0.5"),
    (["--max-loss-ratio", "1"], "--max-loss-ratio must be a finite number > 1, got 1.0"),
])
def test_federate_bad_options(args: list[str], needle: str) -> None:
    """A bad value is one line naming the option and the allowed values, exit status 2, before any work."""
    res = invoke("federate", "--rounds", "1", *SMALL, *args)
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert needle in res.output, res.output


def test_federate_defence_options_reach_the_config(tmp_path: Path) -> None:
    out = tmp_path / "robust"
    res = invoke("federate", "--method", "fslora", "--rounds", "1", "--out", str(out), *SMALL, "--aggregation",
                 "median", "--max-update-norm-ratio", "off", "--max-examples-ratio", "5", "--no-health-check")
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "settings.json").read_text())["config"]
    assert (cfg["aggregator"], cfg["max_update_norm_ratio"], cfg["max_examples_ratio"], cfg["health_check"]) == \
        ("median", None, 5.0, False)


def test_federate_ub_smoe_defaults_to_the_moe_task(tmp_path: Path) -> None:
    out = tmp_path / "ub"
    res = invoke("federate", "--method", "ub-smoe", "--clients", "4", "--rounds", "1", "--clients-per-round", "2",
                 "--local-steps", "1", "--backend", "inprocess", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "task synthetic-moe" in res.output and "round 1: accuracy" in res.output
    assert (out / "global_adapter.safetensors").is_file()


def test_run_settings_round_trip_keeps_the_ub_smoe_config() -> None:
    from rankwise.federated.runner import RunSettings
    from rankwise.federated.ub_smoe import UBSMoEConfig

    cfg = UBSMoEConfig(rank=4, client_ranks={0: 2, 1: 4}, clients_per_round=2)
    s = RunSettings(method="ub-smoe", task="rankwise.federated.ub_smoe:SyntheticMoETask", num_clients=2, config=cfg)
    back = RunSettings.from_run_config(s.to_run_config())
    assert type(back.config) is UBSMoEConfig and back.config == cfg


def test_clients_per_round_above_the_clients_is_an_error() -> None:
    from rankwise.federated.config import FederatedConfig
    from rankwise.federated.runner import RunSettings

    with pytest.raises(ValueError, match="clients_per_round must be at most num_clients=4, got 5"):
        RunSettings(num_clients=4, config=FederatedConfig(clients_per_round=5))
