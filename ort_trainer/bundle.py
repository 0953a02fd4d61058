"""Open a bundle and verify it against its manifest before anything runs."""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path

from . import manifest as mf


class BundleError(ValueError):
    """A bundle that cannot be used; the message names the file, the problem and the fix."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Bundle:
    path: Path
    manifest: mf.Manifest

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / mf.TOKENIZER_DIR


@contextlib.contextmanager
def blame_damage(bundle: Bundle):
    """Around a library reading the bundle's files (ORT, tokenizers): if it fails, every file is checked against
    the manifest's sha256, and a damaged one is reported as the BundleError naming it. (A resumed run and eval
    check sizes only, so a flipped byte shows up first as the library's own error.) With every file intact,
    the library's error stands as it is: it is not the bundle's."""
    try:
        yield
    except Exception:
        open_bundle(bundle.path, verify="hashes")
        raise


def open_bundle(path: str | Path, verify: str = "hashes") -> Bundle:
    """Load the manifest and check every listed file: `hashes` (sha256), `sizes`, or `none`. `sizes` (a resume,
    eval) still hashes the small files (graphs, tokenizer, initial checkpoint: a flipped byte there could
    pass ORT silently) and checks only the size of the weight shards, which are most of the bytes."""
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle directory. Build one with `pocketlora gen`.")
    try:
        manifest = mf.Manifest.load(path)
    except mf.ManifestError as exc:
        raise BundleError(str(exc)) from exc
    for role in ("training_model", "eval_model", "optimizer_model", "checkpoint"):
        if not manifest.files_with_role(role):
            raise BundleError(f"{path / mf.MANIFEST_NAME}: lists no {role} file; rebuild the bundle.")
    if verify == "none":
        return Bundle(path, manifest)
    for entry in manifest.files:
        f = path / entry.path
        if not f.is_file():
            raise BundleError(f"{f}: missing from the bundle (listed in the manifest). Copy the whole bundle again.")
        size = f.stat().st_size
        if size != entry.bytes:
            raise BundleError(
                f"{f}: {size} bytes, the manifest says {entry.bytes}. The copy is incomplete or damaged; copy it again."
            )
        if (verify == "hashes" or entry.role != "shard") and sha256_file(f) != entry.sha256:
            raise BundleError(f"{f}: sha256 does not match the manifest. The file is damaged; copy the bundle again.")
    return Bundle(path, manifest)
