"""`pocketlora setup`: what the phone runner needs besides Python, installed from the package registries.

- the npm packages of android_runner/web, exactly as its package-lock.json pins them (`npm ci`);
- Chromium, for the page's headless tests and for a person trying the page on this machine (Debian's
  `chromium`, installed with apt-get when this runs as root; otherwise the command to run is printed).

Node.js >= 20 must be on the machine already (it runs the Node runner and npm).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .web_server import WEB_DIR

NODE_MAJOR = 20
CHROMIUM = ("chromium", "chromium-browser")


class SetupError(RuntimeError):
    pass


def node_version() -> tuple[int, ...] | None:
    node = shutil.which("node")
    if node is None:
        return None
    out = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip().lstrip("v")
    return tuple(int(x) for x in out.split(".") if x.isdigit())


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM) if p), None)


def npm_packages_current(web_dir: Path = WEB_DIR) -> bool:
    """node_modules was installed from the package-lock.json that is there now."""
    installed = web_dir / "node_modules" / ".package-lock.json"
    return installed.is_file() and installed.stat().st_mtime >= (web_dir / "package-lock.json").stat().st_mtime


def install_npm_packages(web_dir: Path = WEB_DIR, log=print) -> None:
    version = node_version()
    if version is None or version[0] < NODE_MAJOR or shutil.which("npm") is None:
        raise SetupError(f"Node.js >= {NODE_MAJOR} with npm is needed (found {version or 'none'}); "
                         "install it (Debian: apt-get install nodejs npm) and run `pocketlora setup` again")
    if npm_packages_current(web_dir):
        log(f"npm packages of {web_dir} are installed")
        return
    log(f"npm ci in {web_dir}")
    res = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=web_dir, capture_output=True, text=True)
    if res.returncode != 0:
        tail = " | ".join(res.stderr.strip().splitlines()[-3:])
        raise SetupError(f"npm ci failed in {web_dir} (exit {res.returncode}): {tail}")


def install_chromium(log=print) -> None:
    if find_chromium():
        log(f"chromium: {find_chromium()}")
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SetupError("Chromium is needed for the page's tests; install it (Debian: apt-get install chromium) "
                         "and run `pocketlora setup` again")
    log("apt-get install chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            tail = " | ".join(res.stderr.strip().splitlines()[-3:])
            raise SetupError(f"{' '.join(cmd)} failed (exit {res.returncode}): {tail}")


def setup(log=print) -> None:
    install_npm_packages(log=log)
    install_chromium(log=log)
