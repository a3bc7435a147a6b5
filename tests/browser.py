"""A headless Chromium driven over the DevTools protocol through ``--remote-debugging-pipe`` (fds 3 and 4,
NUL-terminated JSON messages): no websocket client, no extra dependency. Used by the report's browser test and by
``scripts/report_screenshot.py``.

``open_page`` loads one file:// URL with the network, console and log domains on and returns what a reviewer
needs: every request the page made (other than the page itself), console errors and uncaught exceptions, the size
of every <img> and <svg>, and a full-page PNG."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
         "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def install_chromium(timeout_s: float = 900) -> tuple[str | None, str]:
    """Chromium from Debian's packages when it is missing (apt-get, as root): its path, or None and why not."""
    found = find_chromium()
    if found:
        return found, ""
    if shutil.which("apt-get") is None:
        return None, "chromium is not installed and this system has no apt-get"
    if os.geteuid() != 0:
        return None, "chromium is not installed and installing it with apt-get needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                return None, f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"installing chromium failed: {exc}"
    found = find_chromium()
    return found, "" if found else "apt-get installed no chromium binary"


@dataclass
class PageResult:
    requests: list[str] = field(default_factory=list)
    """URLs the page requested besides itself."""
    errors: list[str] = field(default_factory=list)
    """Console errors, uncaught exceptions and error log entries."""
    boxes: list[dict[str, Any]] = field(default_factory=list)
    """Each <img> and <svg>: tag, width, height (CSS px)."""
    screenshot: bytes = b""
    title: str = ""


class _Pipe:
    def __init__(self, binary: str, profile: str) -> None:
        to_r, to_w = os.pipe()      # we write, chromium reads on fd 3
        from_r, from_w = os.pipe()  # chromium writes on fd 4, we read

        def child_fds() -> None:  # move both ends above 4 first, so that neither dup2 closes the other
            import fcntl

            high_r, high_w = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     preexec_fn=child_fds,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False)
        os.close(to_r)
        os.close(from_w)
        self.w, self.r = to_w, from_r
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout_s: float = 30) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        want = self.next_id
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("id") == want:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            e = self._read(deadline)
            self.events.append(e)
            if e.get("method") == method:
                return e

    def _read(self, deadline: float) -> dict[str, Any]:
        import select

        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self.buf += chunk
        msg, _, self.buf = self.buf.partition(b"\0")
        return json.loads(msg)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=5)
        except Exception:  # noqa: BLE001 - it is going away either way
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.w)
        os.close(self.r)


def open_page(binary: str, path: Path, width: int = 1100, height: int = 900) -> PageResult:
    """Load ``path`` in a fresh headless Chromium profile and report what it did (see the module docstring)."""
    url = path.resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="gpufeed-chromium-") as profile:
        pipe = _Pipe(binary, profile)
        try:
            target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False},
                      session=session)
            pipe.events.clear()
            pipe.send("Page.navigate", {"url": url}, session=session)
            pipe.wait_event("Page.loadEventFired")
            time.sleep(0.3)  # late console messages
            probe = ("JSON.stringify({title: document.title, boxes: [...document.querySelectorAll('img,svg')]"
                     ".map(e => {const r = e.getBoundingClientRect(); return {tag: e.tagName, width: r.width, "
                     "height: r.height};})})")
            value = json.loads(pipe.send("Runtime.evaluate", {"expression": probe, "returnByValue": True},
                                         session=session)["result"]["value"])
            shot = pipe.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                             session=session, timeout_s=60)
            result = PageResult(boxes=value["boxes"], title=value["title"],
                                screenshot=base64.b64decode(shot["data"]))
            for e in pipe.events:
                method, params = e.get("method"), e.get("params", {})
                if method == "Network.requestWillBeSent":
                    req = params.get("request", {}).get("url", "")
                    if req != url:
                        result.requests.append(req)
                elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                    result.errors.append(f"console: {params.get('args')}")
                elif method == "Runtime.exceptionThrown":
                    result.errors.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
                elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                    result.errors.append(f"log: {params['entry'].get('text')}")
            return result
        finally:
            pipe.close()
