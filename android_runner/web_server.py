"""`pocketlora web`: serve the phone runner's page and one bundle to a browser.

The page (android_runner/web/index.html) trains in the browser with onnxruntime-web's WASM build; this
server only hands out files and never receives any: it answers GET and HEAD, and refuses every other
method, so the person's training data, which the page reads from a local file, has nowhere to go.

Paths:
  /             the page
  /app/...      android_runner/web/ (the page's modules and node_modules/onnxruntime-web/dist)
  /bundle/...   the bundle directory (manifest.json, graphs, weight shards, tokenizer)
  /data/...     with --data-dir only: that directory, for automated runs and tests (the page's ?data=/data/F).
                A person's data never goes through here: the page reads it from a file they pick.

Every response carries Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy:
require-corp. Without them the page is not cross-origin isolated, SharedArrayBuffer is missing and the
WASM runs on one thread, at about half the speed, without a word. Loopback by default. Isolation, the
page's storage (OPFS) and WebCrypto need a secure context, which plain http is only on localhost: a phone
reaches the page through `adb reverse tcp:PORT tcp:PORT` at http://localhost:PORT (or over https); at
http://192.168.x.y:PORT the page stops with a message saying so.

The page's own files (/app/, /) carry an ETag and may be cached, revalidated on each load, so the browser also
keeps the compiled WASM; the bundle and data are sent with no-store.
"""
from __future__ import annotations

import http.server
import mimetypes
import posixpath
import urllib.parse
from functools import partial
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent / "web"
PAGE = "index.html"
ISOLATION_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
}
TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
         ".json": "application/json", ".onnx": "application/octet-stream", ".html": "text/html; charset=utf-8"}


class WebServerError(ValueError):
    pass


def resolve(path: str, web_dir: Path, bundle_dir: Path, data_dir: Path | None = None) -> Path | None:
    """The file a URL path names, or None: only files below the roots, never outside them."""
    parts = [p for p in posixpath.normpath(urllib.parse.unquote(urllib.parse.urlsplit(path).path)).split("/") if p]
    if not parts:
        root, rest = web_dir, [PAGE]
    elif parts[0] == "app":
        root, rest = web_dir, parts[1:]
    elif parts[0] == "bundle":
        root, rest = bundle_dir, parts[1:]
    elif parts[0] == "data" and data_dir is not None:
        root, rest = data_dir, parts[1:]
    else:
        return None
    if any(p in ("..", ".") for p in rest):
        return None
    target = root.joinpath(*rest).resolve()
    if not target.is_file() or not target.is_relative_to(root.resolve()):
        return None
    return target


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "pocketlora-web"

    def __init__(self, *args, web_dir: Path, bundle_dir: Path, data_dir: Path | None = None, log=None, **kw):
        self.web_dir, self.bundle_dir, self.data_dir, self._log = web_dir, bundle_dir, data_dir, log
        super().__init__(*args, **kw)

    def _send(self, code: int, body: bytes = b"", ctype: str = "text/plain; charset=utf-8", head=False) -> None:
        self.send_response(code)
        for k, v in ISOLATION_HEADERS.items():
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _file(self, head: bool) -> None:
        target = resolve(self.path, self.web_dir, self.bundle_dir, self.data_dir)
        if target is None:
            self._send(404, b"not found\n", head=head)
            return
        ctype = TYPES.get(target.suffix) or mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        st = target.stat()
        size = st.st_size
        # The page's own files (11 MB of WASM among them) may be cached, revalidated on every load: the browser
        # then also keeps the compiled WASM. The bundle and data are not kept in the browser's cache.
        app = target.is_relative_to(self.web_dir.resolve())
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        if app and self.headers.get("If-None-Match") == etag:
            self.send_response(304)
            for k, v in ISOLATION_HEADERS.items():
                self.send_header(k, v)
            self.send_header("ETag", etag)
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            return
        self.send_response(200)
        for k, v in ISOLATION_HEADERS.items():
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(size))
        if app:
            self.send_header("ETag", etag)
            self.send_header("Cache-Control", "no-cache")
        else:
            self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if head:
            return
        with open(target, "rb") as f:
            while chunk := f.read(1 << 20):
                self.wfile.write(chunk)

    def do_GET(self):   # noqa: N802 - http.server's naming
        self._file(head=False)

    def do_HEAD(self):  # noqa: N802
        self._file(head=True)

    def _refuse(self):
        self._send(405, b"this server only serves files; it accepts nothing\n")

    do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

    def log_message(self, fmt, *args):
        if self._log:
            self._log(f"{self.address_string()} {fmt % args}")


def make_server(bundle: str | Path, host: str = "127.0.0.1", port: int = 8000, web_dir: Path = WEB_DIR,
                data_dir: str | Path | None = None, log=None) -> http.server.ThreadingHTTPServer:
    """port 0: any free port (server.server_address has the one chosen)."""
    bundle_dir = Path(bundle)
    if not (bundle_dir / "manifest.json").is_file():
        raise WebServerError(f"{bundle_dir}: not a bundle (no manifest.json); pass the --out of `pocketlora gen`")
    if data_dir is not None:
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise WebServerError(f"--data-dir {data_dir}: not a directory")
    if not (web_dir / PAGE).is_file():
        raise WebServerError(f"{web_dir / PAGE}: the page is missing from this installation")
    if not (web_dir / "node_modules" / "onnxruntime-web").is_dir():
        raise WebServerError(f"{web_dir}: the npm packages are not installed; run `pocketlora setup`")
    handler = partial(Handler, web_dir=web_dir, bundle_dir=bundle_dir, data_dir=data_dir, log=log)
    try:
        return http.server.ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise WebServerError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
