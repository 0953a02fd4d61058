"""Shared test fixtures. Real data lives in ../shared/data beside the repository (read-only)."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


WEB = REPO / "android_runner" / "web"


@pytest.fixture(scope="session")
def node_web() -> Path:
    """android_runner/web with its pinned npm packages, installed as `pocketlora setup` does (npm ci) when
    they are absent or older than package-lock.json. No Node or a failing npm fails the test; it never skips."""
    from android_runner.web_setup import SetupError, install_npm_packages

    try:
        install_npm_packages(WEB, log=lambda *_: None)
    except SetupError as e:
        pytest.fail(str(e))
    return WEB
