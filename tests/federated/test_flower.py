"""The same apps in Flower's simulation engine (Ray) and in its deployment engine (SuperLink + SuperNodes).

* ``test_simulation_matches_inprocess`` (marker ``federated``; ~15-30 s, most of it Ray start-up): the
  Ray simulation with a client that raises ends with the same global adapter as the in-process
  run, and the raising client is left out.
* ``test_deployment_two_rounds`` (marker ``federated``; in the default run because the issues ask CI to
  run it: each ClientApp message starts a fresh ``flwr-clientapp`` process that imports torch; 207 s
  measured on 2 cores at load average 13): the secure deployment path of docs/federated.md on localhost. A
  throwaway CA signs a certificate for 127.0.0.1; the SuperLink serves TLS with SuperNode
  authentication on; two SuperNodes whose public keys were registered with ``flwr supernode
  register`` connect over TLS and run two FSLoRA rounds of ``rankwise.federated.app`` through
  ``flwr run`` (the CLI also over TLS); a third SuperNode with an unlisted key is refused. The
  checkpoint the run writes equals an in-process run of the same settings. (The insecure mode
  differs only in its flags; one deployment test keeps the suite short.)
"""

from __future__ import annotations

import datetime
import ipaddress
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


def _write_pki(folder: Path, nodes: tuple[str, ...]) -> dict[str, Path]:
    """A throwaway CA (``ca.crt``), a server certificate for 127.0.0.1 / localhost signed by it
    (``server.pem``, ``server.key``) and, per node, an EC P-384 key pair in OpenSSH format (``<node>``,
    ``<node>.pub``), the format Flower's SuperNode authentication reads. Valid for one hour."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(hours=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rankwise throwaway test CA")])
    usage = dict(content_commitment=False, key_encipherment=False, data_encipherment=False, key_agreement=False,
                 encipher_only=False, decipher_only=False)
    ca = (x509.CertificateBuilder(subject_name=ca_name, issuer_name=ca_name, public_key=ca_key.public_key(),
                                  serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, **usage), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder(subject_name=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]),
                                    issuer_name=ca_name, public_key=key.public_key(),
                                    serial_number=x509.random_serial_number(), **valid)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    for node in nodes:
        k = ec.generate_private_key(ec.SECP384R1())
        paths[node] = folder / node
        paths[node].write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                serialization.NoEncryption()))
        paths[node + ".pub"] = folder / f"{node}.pub"
        paths[node + ".pub"].write_bytes(k.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                     serialization.PublicFormat.OpenSSH))
    return paths


@pytest.mark.federated
def test_deployment_two_rounds(tmp_path):
    from rankwise.federated.app import write_app_dir

    pytest.importorskip("cryptography")
    bindir = Path(sys.executable).parent
    if not (bindir / "flower-superlink").exists() or shutil.which("flwr", path=str(bindir)) is None:
        pytest.skip("flower-superlink / flwr executables not found next to the Python interpreter")
    pki = _write_pki(tmp_path / "pki", ("node0", "node1", "intruder"))
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text('[superlink]\ndefault = "local-dep"\n\n[superlink.local-dep]\n'
                                      f'address = "127.0.0.1:{port}"\nroot-certificates = "{pki["ca"]}"\n')
    settings = _settings(2, checkpoint_dir=str(tmp_path / "ckpt"))
    app = write_app_dir(tmp_path / "app", settings)
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_UPDATE_CHECK="1",
               PATH=str(bindir) + os.pathsep + os.environ.get("PATH", ""))
    procs: dict[str, subprocess.Popen] = {}
    flwr = str(bindir / "flwr")

    def start(args: list[str], name: str) -> None:
        log = open(tmp_path / f"{name}.log", "w")
        procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                       start_new_session=True)

    def supernode(name: str, partition: int, *extra: str) -> None:
        start([str(bindir / "flower-supernode"), "--root-certificates", str(pki["ca"]), "--superlink",
               f"127.0.0.1:{port}", "--port", str(_free_port()), "--auth-supernode-private-key", str(pki[name]),
               "--node-config", f"partition-id={partition} num-partitions=2", *extra], name)

    try:
        start([str(bindir / "flower-superlink"), "--ssl-ca-certfile", str(pki["ca"]), "--ssl-certfile",
               str(pki["cert"]), "--ssl-keyfile", str(pki["key"]), "--enable-supernode-auth",
               "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)], "superlink")
        _wait_port(port, 60)
        registering = [subprocess.Popen([flwr, "supernode", "register", str(pki[f"node{i}.pub"]), "local-dep"],
                                        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True) for i in range(2)]
        for r in registering:
            out, _ = r.communicate(timeout=120)
            assert r.returncode == 0 and "registered successfully" in out, out[-2000:]
        for i in range(2):
            supernode(f"node{i}", i)
        supernode("intruder", 1, "--max-retries", "0")  # its key was never registered
        run = subprocess.run([flwr, "run", str(app), "local-dep", "--stream"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=400)
        intruder_rc = procs["intruder"].wait(60)
    finally:
        for p in procs.values():  # each Flower process leads its own session: stop the whole group (superexec included)
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "Run finished 2 round(s)" in out, out[-3000:]
    intruder_log = (tmp_path / "intruder.log").read_text()
    assert intruder_rc != 0 and "Failed to activate SuperNode" in intruder_log, intruder_log[-2000:]
    assert "No SuperNode found with the given public key" in (tmp_path / "superlink.log").read_text()
    tensors, meta = io.load_tensors(tmp_path / "ckpt" / "checkpoint.safetensors")
    assert meta["round"] == 2
    ref = run_simulation_settings(_settings(2), backend="inprocess")
    for n, t in ref.tensors.items():
        assert torch.equal(tensors[f"g/{n}"], t), n
