"""The page (`pocketlora web`, android_runner/web/index.html), end to end in headless Chromium.

`pocketlora web` serves a tiny bundle on a free loopback port (one server per test origin: a new port is a new
origin, so its Origin Private File System starts empty); Chromium is driven over the DevTools protocol on a
pipe (--remote-debugging-pipe: NUL-separated JSON on fds 3 and 4, no port, no extra package) and the page's
`#status` JSON is read with Runtime.evaluate.

- the page trains gpt2, qwen2 and gemma3 for 20 steps (micro-batch 2 x accum 2, warmup, clipping) with per-step
  losses within 1e-5 relative of `pocketlora train`'s, cross-origin isolated on more than one WASM thread;
- a reload mid-run continues from the last checkpoint, a pause checkpoints and resumes, and the run still ends
  with exactly the losses of an uninterrupted one;
- the training file picked through <input type=file> never leaves the browser: in Chromium's NetLog (capture
  mode Everything: every byte sent on every socket) no request carries a marker planted in the data, and the
  page sends nothing but GETs to its own origin;
- "Download adapter (PEFT)" saves adapter_config.json + adapter_model.safetensors byte-identical to
  `export_peft` of the same tensors, and `peft` loads them onto the tiny base.

Chromium missing fails the tests (`pocketlora setup` installs it); it never skips them.
"""
from __future__ import annotations

import base64
import collections
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

from tests.bundle_helpers import build_tiny_bundle
from tests.conftest import REPO
from tests.test_web_parity import instruction_records

FAMILIES = ["gpt2", "qwen2", "gemma3"]
STEPS = 20
SETTINGS = {"micro_batch": 2, "accum": 2, "lr": 5e-3, "warmup": 5, "schedule": "cosine", "clip": 0.6,
            "weight_decay": 0.01, "seed": 3}
MARKER = "zq7-PRIVATE-MARKER-5k2"        # only in the file picked in the privacy test: never served, never sent


# -- Chromium over the DevTools protocol ---------------------------------------------------------------------
class CDPError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium with --remote-debugging-pipe: commands go to its fd 3, replies and events come from
    its fd 4, one JSON message per NUL-terminated chunk."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
             "--disable-dev-shm-usage")
    # Puts the pipe ends at fds 3 and 4, then execs Chromium (no preexec_fn: this process has threads).
    EXEC = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 100); os.dup2(w, 101); "
            "os.dup2(100, 3); os.dup2(101, 4); [os.close(f) for f in {r, w, 100, 101} - {3, 4}]; "
            "os.execv(sys.argv[3], sys.argv[3:])")

    def __init__(self, exe: str, extra: tuple[str, ...] = ()):
        self.profile = tempfile.TemporaryDirectory(prefix="pocketlora-chromium-")
        cmd_r, cmd_w = os.pipe()
        ev_r, ev_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.EXEC, str(cmd_r), str(ev_w), exe, *self.FLAGS,
             f"--user-data-dir={self.profile.name}", "--remote-debugging-pipe", *extra, "about:blank"],
            pass_fds=(cmd_r, ev_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(ev_w)
        self._w = os.fdopen(cmd_w, "wb", buffering=0)
        self._r = os.fdopen(ev_r, "rb", buffering=0)
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._cv = threading.Condition()
        self.events: list[dict] = []
        self._alive = True
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while chunk := self._r.read(1 << 16):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._cv:
                for m in messages:
                    msg = json.loads(m)
                    (self._replies.__setitem__(msg["id"], msg) if "id" in msg else self.events.append(msg))
                self._cv.notify_all()
        with self._cv:
            self._alive = False
            self._cv.notify_all()

    def send(self, method: str, session: str | None = None, timeout: float = 60, **params) -> dict:
        with self._cv:
            self._next += 1
            i = self._next
        msg = {"id": i, "method": method, "params": params, **({"sessionId": session} if session else {})}
        self._w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cv:
            while i not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self._alive:
                    raise CDPError(f"{method}: no reply ({'timeout' if self._alive else 'Chromium exited'})")
                self._cv.wait(left)
            reply = self._replies.pop(i)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error'].get('message')}")
        return reply["result"]

    def tab(self) -> Tab:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        return Tab(self, target, self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
            self.proc.wait(30)           # the NetLog is complete only once Chromium has exited
        except (CDPError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.profile.cleanup()


class Tab:
    def __init__(self, browser: Chromium, target: str, session: str):
        self.browser, self.target, self.session = browser, target, session

    def close(self) -> None:
        self.browser.send("Target.closeTarget", targetId=self.target)

    def send(self, method: str, **params) -> dict:
        return self.browser.send(method, session=self.session, **params)

    def evaluate(self, expression: str, gesture: bool = False):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, userGesture=gesture,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise CDPError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def status(self) -> dict | None:
        try:
            text = self.evaluate("document.getElementById('status')?.textContent ?? null")
        except CDPError:                 # between documents
            return None
        return json.loads(text) if text else None

    def page_log(self) -> str:
        try:
            return self.evaluate("document.getElementById('log')?.textContent ?? ''")
        except CDPError:
            return ""

    def wait(self, until, timeout: float = 180, what: str = "the page") -> dict:
        """Poll #status until `until(status)`; a page error or the timeout fails with the page's log."""
        deadline, st = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            st = self.status()
            if st and until(st):
                return st
            if st and st.get("state") == "error":
                pytest.fail(f"{what}: the page failed: {st.get('error')}\n{self.page_log()}")
            time.sleep(0.05)
        pytest.fail(f"{what}: not reached in {timeout} s; last status {st}\n{self.page_log()}")

    def click(self, selector: str) -> None:
        assert self.evaluate(f"(() => {{ const b = document.querySelector({json.dumps(selector)}); "
                             "if (!b || b.disabled) return false; b.click(); return true; })()", gesture=True), \
            f"{selector} is missing or disabled"

    def pick_file(self, selector: str, path: Path) -> None:
        root = self.send("DOM.getDocument")["root"]["nodeId"]
        node = self.send("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.send("DOM.setFileInputFiles", nodeId=node, files=[str(path)])


# -- `pocketlora web` ----------------------------------------------------------------------------------------
class Server:
    """`pocketlora web --bundle B --port 0 --data-dir D` in a subprocess; .url, .requests (method, path)."""

    def __init__(self, bundle: Path, data_dir: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "pocketlora_cli", "web", "--bundle", str(bundle), "--port", "0",
             "--data-dir", str(data_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = self.proc.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+)/", first)
        if not m:
            self.proc.kill()
            pytest.fail(f"pocketlora web did not start: {first}{self.proc.stdout.read()}")
        self.url = m.group(1)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()

    @property
    def requests(self) -> list[tuple[str, str]]:
        return [(m.group(1), m.group(2)) for line in list(self.lines) if (m := re.search(r'"(\S+) (\S+) HTTP/', line))]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def query(data: str | None = "/data/train.jsonl", steps: int = STEPS, **extra) -> str:
    params = {**({"data": data} if data else {}), "max_steps": steps, **SETTINGS, "battery": "none", "autostart": 1,
              **extra}
    return "/?" + urllib.parse.urlencode({k: repr(v) if isinstance(v, float) else v for k, v in params.items()})


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium_exe(node_web) -> str:
    from android_runner.web_setup import find_chromium

    exe = find_chromium()
    if exe is None:
        pytest.fail("Chromium is not installed: run `pocketlora setup` (Debian: apt-get install chromium)")
    return exe


class Env:
    """One tiny bundle per family, the training data, the reference runs and the page runs, each made once."""

    def __init__(self, root: Path):
        self.root = root
        self.data_dir = root / "data"
        self.data_dir.mkdir()
        self.data = self.data_dir / "train.jsonl"
        self.data.write_text("".join(json.dumps(r) + "\n" for r in instruction_records(48, seed=1)))
        self.bundles: dict[str, Path] = {}
        self.ckpts: dict[str, Path] = {}
        self.servers: list[Server] = []
        self.page_runs: dict[str, tuple[Server, dict]] = {}
        self._python: dict[str, subprocess.Popen] = {}

    def bundle(self, family: str) -> Path:
        if family not in self.bundles:
            self.ckpts[family], self.bundles[family] = build_tiny_bundle(family, self.root)
            self._start_python(family)
        return self.bundles[family]

    def server(self, family: str) -> Server:
        s = Server(self.bundle(family), self.data_dir)
        self.servers.append(s)
        return s

    def _start_python(self, family: str) -> None:
        """`pocketlora train` on the same data and settings (in the background while the page runs)."""
        out = self.root / f"{family}-python"
        args = [sys.executable, "-m", "pocketlora_cli", "train", "--bundle", str(self.bundles[family]),
                "--data", str(self.data), "--out", str(out), "--max-steps", str(STEPS), "--battery", "none",
                "--threads", "1", "--save-every", "50"]
        for k, v in SETTINGS.items():
            args += [f"--{k.replace('_', '-')}", repr(v) if isinstance(v, float) else str(v)]
        with open(self.root / f"{family}-python.log", "w") as log:
            self._python[family] = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def python_run(self, family: str) -> Path:
        self.bundle(family)
        proc = self._python[family]
        proc.wait(timeout=600)
        out = (self.root / f"{family}-python.log").read_text()
        assert proc.returncode == 0, f"pocketlora train ({family}) failed:\n{out}"
        return self.root / f"{family}-python"

    def python_losses(self, family: str) -> list[float]:
        lines = (self.python_run(family) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if line.strip()]


@pytest.fixture(scope="module")
def env(tmp_path_factory, chromium_exe):
    e = Env(tmp_path_factory.mktemp("web_page"))
    yield e
    for s in e.servers:
        s.stop()
    for p in e._python.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def browser(chromium_exe):
    b = Chromium(chromium_exe)
    yield b
    b.close()


def page_run(env: Env, browser: Chromium, family: str) -> tuple[Server, dict]:
    """The page trains `family` from ?data=/data/train.jsonl to the end, uninterrupted (once per module)."""
    if family not in env.page_runs:
        server = env.server(family)
        tab = browser.tab()
        tab.open(server.url + query())
        st = tab.wait(lambda s: s["state"] == "done", what=f"{family} run")
        st["hardwareConcurrency"] = tab.evaluate("navigator.hardwareConcurrency")
        tab.close()
        env.page_runs[family] = (server, st)
    return env.page_runs[family]


def rel_diff(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


# -- tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_page_trains_like_pocketlora_train(family, env, browser):
    _, st = page_run(env, browser, family)
    py = env.python_losses(family)
    assert st["step"] == st["total_steps"] == STEPS and len(st["losses"]) == STEPS == len(py)
    rel = rel_diff(st["losses"], py)
    print(f"{family}: page vs pocketlora train: max rel loss diff {max(rel):.2e} (step {int(np.argmax(rel)) + 1}); "
          f"loss {py[0]:.4f} -> {py[-1]:.4f}; threads {st['threads']}, isolated {st['crossOriginIsolated']}")
    assert max(rel) < 1e-5, rel
    grad_norms = [json.loads(line)["grad_norm"] for line in
                  (env.python_run(family) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any(g > SETTINGS["clip"] for g in grad_norms), "clipping never engaged: the test would not cover it"
    # cross-origin isolated (COOP/COEP from `pocketlora web`), so the WASM runs on all cores
    assert st["crossOriginIsolated"] is True
    assert st["threads"] == st["hardwareConcurrency"] and st["threads"] > 1, st
    assert st["resumed_from"] is None and st["error"] is None


def test_reload_and_pause_continue_from_checkpoints(env, browser):
    """Reload mid-run: the page continues from the last checkpoint. Pause: it checkpoints where it is and
    resumes there. The run ends with the uninterrupted run's losses, exactly."""
    _, straight = page_run(env, browser, "gpt2")
    server = env.server("gpt2")               # a new origin: its own, empty storage
    tab = browser.tab()
    tab.open(server.url + query(save_every=4, threads=2))
    before = tab.wait(lambda s: s["state"] == "training" and s["step"] >= 5, what="step 5")
    assert before["threads"] == 2 and before["crossOriginIsolated"]
    tab.send("Page.reload")
    time.sleep(0.3)
    st = tab.wait(lambda s: s["state"] in ("training", "done") and s["resumed_from"] is not None, what="resume")
    assert 4 <= st["resumed_from"] < STEPS and st["resumed_from"] % 4 == 0, (before["step"], st)
    assert st["step"] >= st["resumed_from"], st
    resumed_from = st["resumed_from"]

    at = tab.wait(lambda s: s["step"] > resumed_from, what="a step after the reload")
    assert at["state"] == "training", at
    tab.click("#pause")
    paused = tab.wait(lambda s: s["state"] == "paused", what="pause")
    assert paused["step"] < STEPS, "the run ended before the pause: nothing was tested"
    time.sleep(1.0)
    assert tab.status()["step"] == paused["step"], "the page kept stepping while paused"
    tab.click("#start")
    resumed = tab.wait(lambda s: s["resumed_from"] == paused["step"] or s["state"] == "done", what="resume")
    assert resumed["resumed_from"] == paused["step"], resumed   # from the pause's own checkpoint
    done = tab.wait(lambda s: s["state"] == "done", what="the end")
    print(f"reload at step {before['step']} -> resumed from {resumed_from}; paused at {paused['step']}; "
          f"losses equal to the uninterrupted run: {done['losses'] == straight['losses']}")
    assert done["step"] == STEPS and done["losses"] == straight["losses"]
    # a reload after the end: the run is found done in storage, nothing trains again
    tab.send("Page.reload")
    time.sleep(0.3)
    again = tab.wait(lambda s: s["state"] in ("done", "training"), what="reload after the end")
    assert again["state"] == "done" and again["losses"] == straight["losses"]
    # what the run left in the origin's storage: the newest two checkpoints, each a weights file + its record
    files = tab.evaluate("(async () => { const root = await navigator.storage.getDirectory(); "
                         "const runs = await (await root.getDirectoryHandle('pocketlora')).getDirectoryHandle('runs'); "
                         f"const dir = await runs.getDirectoryHandle({json.dumps(again['run'])}); const names = []; "
                         "for await (const name of dir.keys()) names.push(name); return names.sort(); })()")
    assert files == ["data.jsonl", "metrics.json", "run.json", "step-00000016.json", "step-00000016.safetensors",
                     "step-00000020.json", "step-00000020.safetensors", "summary.json"], files
    tab.close()


def test_battery_gate_pauses_the_page(env, browser):
    """A replayed battery trace (`battery=replay:URL@SPEED`): at 10% on battery the gate pauses training
    (state gate-paused, no steps), on the charger it resumes; the losses are the ungated run's."""
    _, straight = page_run(env, browser, "gpt2")
    (env.data_dir / "drain.csv").write_text("t_s,percent,charging,temp_c\n0,80,0,30\n1,10,0,30\n40,50,1,30\n")
    server = env.server("gpt2")
    tab = browser.tab()
    tab.open(server.url + query(battery="replay:/data/drain.csv@10", poll_s=0.5))
    st = tab.wait(lambda s: s["state"] == "gate-paused", what="the gate's pause")
    assert st["gate"]["state"] == "paused" and st["gate"]["percent"] == 10 and st["gate"]["charging"] is False, st
    assert st["gate"]["probe"] == "replay" and st["step"] < STEPS
    time.sleep(1.0)
    held = tab.status()
    assert held["state"] == "gate-paused" and held["step"] == st["step"], "the page trained while the gate said pause"
    done = tab.wait(lambda s: s["state"] == "done", what="the end after charging")
    assert done["gate"]["state"] == "full" and done["gate"]["charging"] is True
    assert done["losses"] == straight["losses"]
    tab.close()


def _netlog(path: Path) -> tuple[list[dict], bytes]:
    """URL requests (method, url, initiator) and every byte Chromium sent on any socket, from a NetLog."""
    log = json.loads(path.read_text())
    types = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    requests, sent = [], collections.defaultdict(bytearray)
    for e in log["events"]:
        kind, params = types[e["type"]], e.get("params", {})
        if kind == "URL_REQUEST_START_JOB" and "url" in params:
            requests.append({"method": params["method"], "url": params["url"], "initiator": params.get("initiator")})
        elif kind in ("SOCKET_BYTES_SENT", "UDP_BYTES_SENT") and "bytes" in params:
            sent[e["source"]["id"]] += base64.b64decode(params["bytes"])
    return requests, b"\n".join(bytes(b) for b in sent.values())


def test_training_data_never_leaves_the_page(env, chromium_exe, tmp_path):
    """A person's run: the file is picked in <input type=file>; Chromium's NetLog of the whole session shows no
    request that carries it."""
    secret = tmp_path / "private.jsonl"
    secret.write_text("".join(json.dumps({"instruction": f"{r['instruction']} {MARKER}", "output": f"{MARKER} {r['output']}"})
                              + "\n" for r in instruction_records(16, seed=7)))
    netlog = tmp_path / "netlog.json"
    server = env.server("gpt2")
    b = Chromium(chromium_exe, extra=(f"--log-net-log={netlog}", "--net-log-capture-mode=Everything"))
    try:
        tab = b.tab()
        tab.open(server.url + query(data=None, steps=3))
        tab.wait(lambda s: s["state"] == "idle", what="the page")
        tab.pick_file("#file", secret)
        st = tab.wait(lambda s: s["state"] == "done", what="training on the picked file")
        assert st["data"]["name"] == "private.jsonl" and st["data"]["examples"] == 16 and len(st["losses"]) == 3
        tab.send("Page.reload")          # no file picked now: the page finds its last run, and the file's copy
        time.sleep(0.3)
        again = tab.wait(lambda s: s["state"] == "done", what="the last run after a reload")
        assert again["data"] == st["data"] and again["losses"] == st["losses"]
    finally:
        b.close()
    requests, sent = _netlog(netlog)
    origin = server.url
    page = [r for r in requests if r["initiator"] == origin or r["url"].startswith(origin + "/")]
    others = [r for r in requests if r not in page]
    print(f"NetLog: {len(page)} requests of the page, {len(others)} of Chromium itself "
          f"({sorted({r['url'].split('/')[2] for r in others})}), {len(sent)} bytes sent")
    # the NetLog holds what was sent: the page's requests are there, byte for byte
    assert b"GET /bundle/manifest.json HTTP/1.1" in sent and any("/bundle/" in r["url"] for r in page)
    assert MARKER.encode() not in sent and MARKER not in netlog.read_text()
    assert all(MARKER not in urllib.parse.unquote(r["url"]) for r in requests)
    assert {r["method"] for r in page} == {"GET"}, [r for r in page if r["method"] != "GET"]
    assert all(r["url"].startswith(origin + "/") for r in page), "the page talked to another host"
    assert all(r["initiator"] in (None, "not an origin") for r in others), others   # Chromium's own, not the page's
    assert {m for m, _ in server.requests} == {"GET"} and all("private" not in p for _, p in server.requests)


@pytest.mark.parametrize("family", FAMILIES)
def test_download_adapter_loads_in_peft(family, env, browser, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from ort_trainer import checkpoint
    from ort_trainer.adapter import export_peft, load_lora
    from ort_trainer.manifest import Manifest
    from tests.bundle_helpers import peft_lora_params, to_onnx_layout, to_peft_layout

    server, _ = page_run(env, browser, family)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.send("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads), eventsEnabled=True)
    tab = browser.tab()
    tab.open(server.url + query())           # the finished run, found in the origin's storage
    st = tab.wait(lambda s: s["state"] == "done", what="the finished run")
    tab.click("#download")
    st = tab.wait(lambda s: s.get("adapter") is not None, what="the adapter")
    assert "error" not in st["adapter"], st["adapter"]
    names = ["adapter_config.json", "adapter_model.safetensors"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sorted(p.name for p in downloads.iterdir()) != names:
        time.sleep(0.1)
    assert sorted(p.name for p in downloads.iterdir()) == names
    for n in names:
        assert hashlib.sha256((downloads / n).read_bytes()).hexdigest() == st["adapter"]["files"][n]["sha256"]

    man = Manifest.load(env.bundle(family))
    # byte for byte what `pocketlora export --peft` writes for these tensors
    page_lora = to_onnx_layout(man, load_file(str(downloads / "adapter_model.safetensors")))
    export_peft(man, page_lora, tmp_path / "python-export")
    for n in names:
        assert (downloads / n).read_bytes() == (tmp_path / "python-export" / n).read_bytes(), n

    # PEFT loads it onto the tiny base; its LoRA is the page's, and close to `pocketlora train`'s
    base = AutoModelForCausalLM.from_pretrained(env.ckpts[family], dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(downloads)).eval()
    loaded = {k: p.detach().numpy() for k, p in peft_lora_params(model).items()}
    want = load_file(str(downloads / "adapter_model.safetensors"))
    assert set(loaded) == set(want) == {t.peft_key for t in man.trainable}
    assert all(np.array_equal(loaded[k], want[k]) for k in want)
    path, state = checkpoint.latest(env.python_run(family))
    py = to_peft_layout(man, load_lora(checkpoint.weights_file(path, state), man))
    worst = max(float(np.abs(want[k] - py[k]).max() / (np.abs(py[k]).max() + 1e-12)) for k in py)
    print(f"{family}: PEFT adapter from the page (step {st['adapter']['step']}) vs pocketlora train: max rel diff {worst:.1e}")
    assert st["adapter"]["step"] == STEPS and worst < 1e-4
    ids = torch.tensor([[5, 17, 42, 9, 3, 11]])
    with torch.no_grad():
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        tuned = model(input_ids=ids).logits
    assert not torch.allclose(plain, tuned), "the adapter changes nothing"
    tab.close()


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_the_chat_panel_answers_like_pocketlora_generate_with_the_same_adapter(family, env, browser, tmp_path):
    """The page's chat (the bundle's decoder in WASM, the run's latest adapter) gives the same greedy tokens as
    `pocketlora generate --peft` on the adapter the page's Download button writes."""
    import contextlib
    import io

    from pocketlora_cli import main

    server, _ = page_run(env, browser, family)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.send("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads), eventsEnabled=True)
    tab = browser.tab()
    tab.open(server.url + query())
    tab.wait(lambda s: s["state"] == "done", what="the finished run")
    tab.click("#download")
    tab.wait(lambda s: s.get("adapter") is not None, what="the adapter")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(downloads.iterdir())) < 2:
        time.sleep(0.1)
    question = "say red"
    tab.evaluate(f"pocketloraChat({json.dumps(question)})")
    st = tab.wait(lambda s: len(s["chat"]["history"]) == 2 or s["chat"]["error"], what="the chat reply")
    assert st["chat"]["error"] is None and st["chat"]["adapter_step"] == STEPS, st["chat"]
    page_ids = st["chat"]["history"][1]["token_ids"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", "--bundle", str(env.bundle(family)), "--peft", str(downloads), "--prompt", question,
                     "--greedy", "--max-new-tokens", "64", "--json"]) == 0
    python = json.loads(buf.getvalue())
    assert page_ids == python["token_ids"] and len(page_ids) > 0
    assert st["chat"]["history"][1]["content"] == python["text"].strip()
