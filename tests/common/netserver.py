"""Loopback servers on 127.0.0.1 for remote tests: :class:`LoopbackServer` serves one folder (GET, HEAD, one Range)
with per-test faults (through the ``http_server`` fixture of conftest.py); :class:`HandlerServer` answers each
request with a handler the test sets; :class:`RawServer` writes scripted bytes on raw sockets; :func:`closed_port`
is a port nothing listens on.

Knobs of :class:`LoopbackServer` (attributes of :class:`Faults`, changed by a test while the server runs):

- ``bandwidth``: bytes per second for every response body (0: unlimited), for a throttled source;
- ``missing``: paths (``/train-000000.tar``) answered 404;
- ``reset``: path -> ``(after_bytes, times)``: the first ``times`` GETs of the path close the socket after
  ``after_bytes`` of the body (``times`` < 0: every GET);
- ``first_byte_delay``: seconds to sleep before the headers of every GET.

``requests`` records ``(method, path, range header)`` of each request; ``max_in_flight`` is the most GETs the
server was answering at once (each on its own connection).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Faults:
    bandwidth: int = 0
    missing: set[str] = field(default_factory=set)
    reset: dict[str, tuple[int, int]] = field(default_factory=dict)
    first_byte_delay: float = 0.0


class LoopbackServer:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.faults = Faults()
        self.requests: list[tuple[str, str, str | None]] = []
        self._gets: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def __init__(self, *a, **kw):
                super().__init__(*a, directory=str(server.root), **kw)

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                with server._lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    self._serve(body=True)
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _serve(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                rng = self.headers.get("Range")
                with server._lock:
                    server.requests.append((self.command, path, rng))
                    n = server._gets[path] = server._gets.get(path, 0) + (1 if body else 0)
                faults = server.faults
                if body and faults.first_byte_delay:
                    time.sleep(faults.first_byte_delay)
                local = Path(self.translate_path(path))
                if path in faults.missing or not local.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = local.stat().st_size
                start, end = 0, size
                status = 200
                if rng:
                    m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                    if not m or int(m.group(1)) >= max(size, 1):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start = int(m.group(1))
                    end = min(int(m.group(2)) + 1, size) if m.group(2) else size
                    status = 206
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                cut = None
                after_times = faults.reset.get(path)
                if after_times is not None and (after_times[1] < 0 or n <= after_times[1]):
                    cut = after_times[0]
                with open(local, "rb") as f:
                    f.seek(start)
                    left, sent = end - start, 0
                    while left > 0:
                        piece = f.read(min(left, 64 << 10 if not faults.bandwidth else max(faults.bandwidth // 20, 1)))
                        if not piece:
                            break
                        if cut is not None and sent + len(piece) > cut:
                            self.wfile.write(piece[: max(cut - sent, 0)])
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            self.close_connection = True
                            return
                        self.wfile.write(piece)
                        sent += len(piece)
                        left -= len(piece)
                        if faults.bandwidth:
                            time.sleep(len(piece) / faults.bandwidth)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def gets(self, path: str) -> int:
        """GET requests seen for ``path``."""
        with self._lock:
            return sum(1 for m, p, _ in self.requests if m == "GET" and p == path)

    def start(self) -> "LoopbackServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


class HandlerServer:
    """A loopback HTTP server whose every GET/HEAD is answered by ``self.handler(request) -> None`` (set by the
    test); ``sent`` counts body bytes written, ``gets`` GET requests seen."""

    def __init__(self) -> None:
        self.handler = None
        self.sent = 0
        self.gets = 0
        self.headers: list[dict] = []
        server = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                server.gets += 1
                server.headers.append(dict(self.headers))
                try:
                    server.handler(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_HEAD = do_GET

            def write(self, data: bytes) -> None:
                self.wfile.write(data)
                server.sent += len(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class RawServer:
    """A loopback HTTP server that answers each request on each of at most ``max_conns`` connections with
    ``respond(request) -> [(bytes, seconds to wait after sending them), ...]`` (bounded loops: a connection ends
    when the client closes it or the server is closed)."""

    def __init__(self, respond, max_conns: int = 16) -> None:
        self.respond, self.max_conns = respond, max_conns
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        for _ in range(self.max_conns):
            while not self.stopped.is_set():
                try:
                    conn, _ = self.sock.accept()
                    break
                except socket.timeout:
                    continue
                except OSError:
                    return
            else:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        conn.settimeout(5)
        try:
            for _ in range(16):  # requests on one connection
                req = b""
                while b"\r\n\r\n" not in req and len(req) < 65536:
                    data = conn.recv(4096)
                    if not data:
                        return
                    req += data
                self.requests.append(req.split(b"\r\n", 1)[0])
                for data, pause in self.respond(req):
                    if self.stopped.is_set():
                        return
                    conn.sendall(data)
                    time.sleep(pause)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()
        self.thread.join(timeout=5)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
