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
    (["--method", "fedprox"], "method"),
    (["--client-ranks", "2,9"], "client 1 has rank 9"),
    (["--task", "nope"], "task"),
    (["--resume"], "--resume"),
    (["--server-optimizer", "lbfgs"], "server_optimizer"),
])
def test_federate_bad_options(args: list[str], needle: str) -> None:
    res = invoke("federate", "--rounds", "1", *SMALL, *args)
    assert res.exit_code == 2
    assert needle in res.output


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

    cfg = UBSMoEConfig(rank=4, client_ranks={0: 2, 1: 4})
    s = RunSettings(method="ub-smoe", task="rankwise.federated.ub_smoe:SyntheticMoETask", num_clients=2, config=cfg)
    back = RunSettings.from_run_config(s.to_run_config())
    assert type(back.config) is UBSMoEConfig and back.config == cfg
