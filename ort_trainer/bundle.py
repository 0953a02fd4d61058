"""Open a bundle and verify it against its manifest before anything runs."""
from __future__ import annotations

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


def open_bundle(path: str | Path, verify: str = "hashes") -> Bundle:
    """Load the manifest and check every listed file: `hashes` (sha256), `sizes`, or `none`."""
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
        if verify == "hashes" and sha256_file(f) != entry.sha256:
            raise BundleError(f"{f}: sha256 does not match the manifest. The file is damaged; copy the bundle again.")
    return Bundle(path, manifest)
