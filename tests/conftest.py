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
def gemma3_vocab():
    """The real Gemma3-270M GGUF's SentencePiece vocabulary (gguf_tokenizer.read_spm_vocab), read once: gguf-py's
    reader takes ~11 s to parse its 262k tokens."""
    from artifacts_gen.gguf_tokenizer import read_spm_vocab
    from artifacts_gen.source import EMBEDDED_DEFAULT, resolve_embedded

    directory, name = resolve_embedded(EMBEDDED_DEFAULT)
    return read_spm_vocab(directory / name)


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


LOW_BATTERY = "t_s,percent,charging,temp_c\n0,10,0,30\n100000,10,0,30\n"     # 10% all along: the gate pauses


@pytest.fixture(scope="session")
def federation(tmp_path_factory, shared_data) -> tuple[Path, Path]:
    """The federated tests' tiny GPT-2 bundle (runs never write into a bundle) and a low-battery replay trace."""
    from tests.bundle_helpers import build_tiny_bundle

    root = tmp_path_factory.mktemp("federation")
    _, bundle = build_tiny_bundle("gpt2", root)
    low = root / "low.csv"
    low.write_text(LOW_BATTERY)
    return bundle, low
