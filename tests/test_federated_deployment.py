"""Federated personalization on Flower's deployment engine: a SuperLink and 2 SuperNodes on loopback, each a
process of its own, the app (federated/flower_app: federated.deployment:server_app, federated.apps:client_app)
submitted with `flwr run`, as docs/FEDERATED.md describes for real devices.

2 devices, 2 rounds, 2 local steps. Checked: both devices trained in both rounds, DIR/global/ (PEFT) and
report.md are written, and the final global adapter is the weighted average, computed here with numpy, of the
tensors the devices returned in the last round. Every process the test starts (SuperLink, SuperNodes, `flwr run`)
and everything those start (each one's SuperExec, the flwr-serverapp and flwr-clientapp processes; the SuperLink's
SuperExec runs in a session of its own) is stopped at the end, pass or fail. Flower's home (connections, installed
app) is the test's tmp dir; telemetry and the update check are off; nothing is installed at run time.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from federated import state as fstate
from ort_trainer.adapter import to_peft
from ort_trainer.bundle import open_bundle
from tests.conftest import REPO

DEVICES, ROUNDS, LOCAL_STEPS = 2, 2, 2
APP = REPO / "federated" / "flower_app"
CONNECTION = "pocketlora-loopback"
BIN = Path(sys.executable).parent          # flower-superlink, flower-supernode, flwr: this Python's
RUN_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _Processes:
    """Starts processes in sessions of their own and remembers every descendant it sees (watch(), called while
    they run: a process whose parent died is no longer anyone's child); stop() ends them all, by process group
    and then one by one."""

    def __init__(self, cwd: Path, env: dict, logs: Path):
        self.cwd, self.env, self.logs = cwd, env, logs
        self.started: list[tuple[str, subprocess.Popen]] = []
        self.seen: dict[int, psutil.Process] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as f:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.started.append((name, proc))
        self.watch()
        return proc

    def watch(self) -> None:
        for _, proc in self.started:
            try:
                ps = psutil.Process(proc.pid)
                self.seen.setdefault(proc.pid, ps)
                for child in ps.children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass

    def alive(self) -> list[psutil.Process]:
        out = []
        for ps in self.seen.values():
            try:
                if ps.is_running() and ps.status() != psutil.STATUS_ZOMBIE:   # is_running: the same process
                    out.append(ps)
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self) -> None:
        self.watch()
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            running = self.alive()
            if not running:
                break
            groups = set()
            for ps in running:
                try:
                    groups.add(os.getpgid(ps.pid))
                except ProcessLookupError:
                    pass
            for g in groups:                 # every group here is led by a process started by this test's tree
                try:
                    os.killpg(g, sig)
                except ProcessLookupError:
                    pass
            for ps in running:
                try:
                    ps.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(running, timeout=wait_s)
        for _, proc in self.started:         # reap our direct children
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def log(self, name: str, chars: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return f"--- {name}.log (tail) ---\n" + (path.read_text(errors="replace")[-chars:] if path.exists() else "")

    def logs_tail(self) -> str:
        return "\n".join(self.log(name) for name, _ in self.started)


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k.replace("|", "/"): z[k] for k in z.files}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, federation):
    """One run on the deployment engine; (bundle, out, processes, seconds the `flwr run` took)."""
    for tool in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr", "flwr-serverapp",
                 "flwr-clientapp"):
        if not (BIN / tool).exists():
            pytest.fail(f"{BIN / tool} not found: pip install -e '.[federated]'")
    root = tmp_path_factory.mktemp("deployment")
    bundle, _ = federation
    out = root / "out"
    settings = root / "settings.json"
    settings.write_text(json.dumps({"bundle": str(bundle), "devices": DEVICES, "rounds": ROUNDS,
                                    "local_steps": LOCAL_STEPS, "micro_batch": 2, "lr": 5e-3,
                                    "keep_updates": True, "round_timeout_s": 300.0}))
    link_port = _free_port()
    node_ports = [_free_port() for _ in range(DEVICES)]
    home = root / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    logs = root / "logs"
    logs.mkdir()
    procs = _Processes(root, env, logs)
    try:
        link = procs.start("superlink", [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                         "--port", str(link_port), "--disable-runtime-dependency-installation"])
        for i, port in enumerate(node_ports):
            procs.start(f"supernode-{i}", [
                str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                "--host", "127.0.0.1", "--port", str(port),
                "--node-config", f"partition-id={i} num-partitions={DEVICES}"])
        deadline = time.time() + 60
        while not _listening(link_port):
            assert link.poll() is None and time.time() < deadline, "SuperLink did not come up\n" + procs.logs_tail()
            time.sleep(0.2)
        t0 = time.time()
        run = procs.start("flwr-run", [
            str(BIN / "flwr"), "run", str(APP), CONNECTION, "--stream",
            "--run-config", f"settings='{settings}' out='{out}'"])
        while run.poll() is None:            # --stream: returns when the run has ended
            procs.watch()
            assert time.time() - t0 < RUN_TIMEOUT_S, f"the run took over {RUN_TIMEOUT_S} s\n" + procs.logs_tail()
            time.sleep(0.5)
        seconds = time.time() - t0
        assert run.returncode == 0, procs.logs_tail()
        ls = subprocess.run([str(BIN / "flwr"), "ls", CONNECTION, "--format", "json"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=120, start_new_session=True)
        runs = json.loads(ls.stdout)["runs"]
        assert [r["status"] for r in runs] == ["finished:completed"], ls.stdout + "\n" + procs.logs_tail()
        yield bundle, out, procs, seconds
    finally:
        procs.stop()
    left = procs.alive()            # (reached when nothing failed above: a failure is reported as it is)
    assert not left, f"still running after stop: {[(p.pid, p.name()) for p in left]}"


def test_both_devices_trained_every_round_on_supernodes(deployed):
    _, out, procs, _ = deployed
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    for r in rounds:
        assert r["participants"] == list(range(DEVICES)), r
        assert (r["declined"], r["failed"], r["missing"]) == ({}, [], 0), r
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
    st = fstate.load(out)
    assert st.round == ROUNDS
    final = json.loads((out / fstate.FINAL).read_text())
    assert [int(d["device"]) for d in final["devices"]] == list(range(DEVICES)) and not final["failed"]
    assert (out / "global" / "adapter_model.safetensors").is_file()
    assert (out / "global" / "adapter_config.json").is_file()
    assert "federated + personalized" in (out / "report.md").read_text()
    # The devices ran as ClientApps on the SuperNodes: each received every round's train message and the evaluate.
    for i in range(DEVICES):
        log = (procs.logs / f"supernode-{i}.log").read_text(errors="replace")
        assert log.count("Receiving: train message") == ROUNDS and log.count("Receiving: evaluate message") == 1
        assert (out / "devices" / f"device-{i:03d}" / f"round-{ROUNDS:03d}").is_dir()


def test_final_global_is_numpy_weighted_average_of_last_round(deployed):
    bundle, out, _, _ = deployed
    man = open_bundle(bundle, verify="none").manifest
    last = out / "updates" / f"round-{ROUNDS:03d}"
    updates, weights = [], []
    for i in range(DEVICES):
        u = _npz(last / f"device-{i:03d}.npz")
        assert sorted(u) == sorted(man.trainable_names)          # FedAvg: A and B, only LoRA tensors
        updates.append(u)
        weights.append(float(json.loads((last / f"device-{i:03d}.json").read_text())["tokens"]))
    record = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()][-1]
    assert record["weights"] == weights and all(w > 0 for w in weights)
    w = np.asarray(weights, dtype=np.float64)
    expected = {n: (sum(wi * u[n].astype(np.float64) for wi, u in zip(w, updates)) / w.sum()).astype(np.float32)
                for n in updates[0]}
    assert any(not np.array_equal(updates[0][n], updates[1][n]) for n in expected)   # the devices differ
    st = fstate.load(out)
    assert sorted(st.lora) == sorted(expected)
    for n, v in expected.items():
        np.testing.assert_allclose(st.lora[n], v, rtol=1e-6, atol=1e-8, err_msg=n)
    saved = _npz(last / "global.npz")
    assert all(np.array_equal(saved[n], st.lora[n]) for n in st.lora)
    from safetensors.numpy import load_file

    peft = load_file(str(out / "global" / "adapter_model.safetensors"))
    want = to_peft(man, expected)           # layout only (ONNX -> PEFT names, transposes)
    assert sorted(peft) == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(peft[k], v, rtol=1e-6, atol=1e-8, err_msg=k)


def test_run_config_settings(tmp_path):
    """The ServerApp's run config: `settings` as a file or as JSON, `out`; relative paths are refused (the
    ServerApp runs in the SuperLink's working directory)."""
    from federated.config import FederateError
    from federated.deployment import settings_from_run_config

    text = json.dumps({"bundle": "/b", "devices": 3, "rounds": 2, "local_steps": 1})
    (tmp_path / "s.json").write_text(text)
    a, out_a = settings_from_run_config({"settings": text, "out": str(tmp_path / "o")})
    b, out_b = settings_from_run_config({"settings": str(tmp_path / "s.json"), "out": str(tmp_path / "o")})
    assert a == b and out_a == out_b == tmp_path / "o" and (a.devices, a.rounds, a.local_steps) == (3, 2, 1)
    for bad, match in (({"settings": "s.json", "out": "/o"}, "absolute"),
                       ({"settings": text, "out": "o"}, "absolute"),
                       ({"settings": text.replace('"/b"', '"b"'), "out": "/o"}, "bundle"),
                       ({"settings": '{"devices": 2}', "out": "/o"}, "not FederateConfig"),
                       ({"out": "/o"}, "needs `settings`")):
        with pytest.raises(FederateError, match=match):
            settings_from_run_config(bad)
