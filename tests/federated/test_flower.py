"""The same apps in Flower's simulation engine (Ray) and in its deployment engine (SuperLink + SuperNodes).

* ``test_simulation_matches_inprocess`` (marker ``federated``; ~15-30 s, most of it Ray start-up): the
  Ray simulation with a client that raises ends with the same global adapter as the in-process
  run, and the raising client is left out.
* ``test_deployment_two_rounds`` (marker ``federated``; in the default run because the issue asks CI to
  run it: each ClientApp message starts a fresh ``flwr-clientapp`` process that imports torch, about
  60-70 s in all on 2 busy cores): a real
  SuperLink and two SuperNodes on localhost run two FSLoRA rounds of ``rankwise.federated.app``
  through ``flwr run``; the checkpoint it writes equals an in-process run of the same settings.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")

from rankwise.core import io  # noqa: E402
from rankwise.federated import FederatedConfig, RunSettings  # noqa: E402
from rankwise.federated.runner import run_simulation_settings  # noqa: E402

logging.getLogger("flwr").setLevel(logging.WARNING)


def _settings(num_clients: int, **kw) -> RunSettings:
    cfg = FederatedConfig(rank=4, alpha=4.0, client_ranks={i: [1, 2, 4][i % 3] for i in range(num_clients)},
                       clients_per_round=min(3, num_clients), local_steps=2, batch_size=8, client_lr=1e-2)
    return RunSettings(method="fslora", task="synthetic", task_kwargs={"per_client": 24, "n_test": 64, "d_in": 8,
                                                                       "hidden": 8},
                       num_clients=num_clients, rounds=2, config=cfg, **kw)


@pytest.mark.federated
def test_simulation_matches_inprocess(tmp_path):
    torch.set_num_threads(1)
    s = _settings(4)
    probe = run_simulation_settings(_settings(4), backend="inprocess")
    bad = probe.history[1]["client_ranks"] and sorted(int(k) for k in probe.history[1]["client_ranks"])[0]
    faulty = _settings(4, faults={bad: "raise"}, checkpoint_dir=str(tmp_path))
    sim = run_simulation_settings(faulty, backend="flower")
    ref = run_simulation_settings(_settings(4, faults={bad: "raise"}), backend="inprocess")
    assert sim.completed_rounds == 2 and (tmp_path / "checkpoint.safetensors").is_file()
    assert sim.history[1]["clients_failed"] == 1 and sim.history[1]["clients_ok"] == s.config.clients_per_round - 1
    assert sim.global_adapter.allclose(ref.global_adapter)
    assert not sim.global_adapter.allclose(probe.global_adapter)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


@pytest.mark.federated
def test_deployment_two_rounds(tmp_path):
    from rankwise.federated.app import write_app_dir

    bindir = Path(sys.executable).parent
    if not (bindir / "flower-superlink").exists() or shutil.which("flwr", path=str(bindir)) is None:
        pytest.skip("flower-superlink / flwr executables not found next to the Python interpreter")
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text('[superlink]\ndefault = "local-dep"\n\n[superlink.local-dep]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    settings = _settings(2, checkpoint_dir=str(tmp_path / "ckpt"))
    app = write_app_dir(tmp_path / "app", settings)
    env = dict(os.environ, FLWR_HOME=str(home), PATH=str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    procs: list[subprocess.Popen] = []

    def start(args: list[str], name: str) -> None:
        log = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                      start_new_session=True))

    try:
        start([str(bindir / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
               "--host", "127.0.0.1", "--port", str(port)], "superlink")
        _wait_port(port, 60)
        for i in range(2):
            start([str(bindir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                   "--port", str(_free_port()), "--node-config", f"partition-id={i} num-partitions=2"], f"supernode{i}")
        run = subprocess.run([str(bindir / "flwr"), "run", str(app), "local-dep", "--stream"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=400)
    finally:
        for p in procs:  # each Flower process leads its own session: stop the whole group (superexec included)
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "Run finished 2 round(s)" in out, out[-3000:]
    tensors, meta = io.load_tensors(tmp_path / "ckpt" / "checkpoint.safetensors")
    assert meta["round"] == 2
    ref = run_simulation_settings(_settings(2), backend="inprocess")
    for n, t in ref.tensors.items():
        assert torch.equal(tensors[f"g/{n}"], t), n
