"""A tiny DevTools-protocol client for headless Chromium over ``--remote-debugging-pipe``.

No download and no websocket library: Chromium reads commands from fd 3 and writes replies and
events to fd 4, one JSON message per NUL-terminated frame. Enough to load a page, time it, collect
console errors, exceptions and network requests, run a script and take a screenshot.
"""
from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
         "--no-default-browser-check", "--disable-dev-shm-usage")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Chromium:
    def __init__(self, binary: str | None = None, *, width: int = 1280, height: int = 900, timeout: float = 60.0):
        self.binary = binary or find_chromium()
        if not self.binary:
            raise FileNotFoundError("chromium not found")
        self.timeout = timeout
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="report-chromium-")
        self.stderr_path = Path(self.profile) / "stderr.log"
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def child_fds():  # chromium talks on fds 3 (in) and 4 (out)
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [self.binary, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
                f"--window-size={width},{height}", "about:blank"]
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr,
                                     # close_fds=False: fds 3 and 4 are made in preexec_fn, after which
                                     # close_fds would close them; every other fd of ours is O_CLOEXEC
                                     preexec_fn=child_fds, close_fds=False)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._cv = threading.Condition()
        self.events: queue.Queue = queue.Queue()
        self.all_events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = None

    # -- transport
    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cv:
                    self._replies[-1] = {"closed": True}
                    self._cv.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                frame, buf = buf.split(b"\0", 1)
                msg = json.loads(frame)
                if "id" in msg:
                    with self._cv:
                        self._replies[msg["id"]] = msg
                        self._cv.notify_all()
                else:
                    self.all_events.append(msg)
                    self.events.put(msg)

    def send(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float | None = None):
        self._next += 1
        mid = self._next
        msg = {"id": mid, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._cv:
            while mid not in self._replies:
                if -1 in self._replies:
                    raise CDPError(f"chromium closed the pipe during {method}: {self.stderr_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CDPError(f"timeout waiting for {method}")
                self._cv.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"timeout waiting for event {method}")
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if ev.get("method") == method:
                return ev

    # -- page helpers
    def open_page(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.set_viewport(self.width, self.height)

    def set_viewport(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def navigate(self, url: str) -> float:
        """Load ``url``; returns wall seconds until the load event."""
        while not self.events.empty():
            self.events.get_nowait()
        t0 = time.monotonic()
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")
        return time.monotonic() - t0

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise CDPError(f"script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path, *, full_page: bool = True, max_height: int = 8000) -> Path:
        if full_page:
            h = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)") or self.height)
            self.set_viewport(self.width, min(max(h, self.height), max_height))
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        if full_page:
            self.set_viewport(self.width, self.height)
        return path

    def console_errors(self) -> list[str]:
        out = []
        for ev in self.all_events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                args = p.get("args", [])
                out.append("console.error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                e = p["entry"]
                out.append(f"log ({e.get('source')}): {e.get('text')} {e.get('url', '')}")
            elif m == "Network.loadingFailed":
                out.append(f"network: {p.get('errorText')} ({p.get('type')})")
        return out

    def requests(self) -> list[str]:
        return [ev["params"]["request"]["url"] for ev in self.all_events
                if ev.get("method") == "Network.requestWillBeSent"]

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.send("Browser.close", session=False, timeout=5)
                except CDPError:
                    pass
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            for fd in (self._to_chrome, self._from_chrome):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._stderr.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        self.open_page()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
