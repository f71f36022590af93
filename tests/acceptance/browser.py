"""A headless Chromium for the browser tests, driven over the W3C WebDriver protocol.

Debian's `chromium` and `chromium-driver` (`make setup` installs them with apt-get where it can);
chromedriver is a local HTTP server and these few calls are all the tests need, so httpx (a dev
dependency already) drives it and Selenium is not needed. `browser_or_skip()` says why when
there is no browser to start.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
STARTED = re.compile(r"started successfully on port (\d+)")


def browser_or_skip() -> tuple[str, str]:
    """The paths of a Chromium and its chromedriver, or skip the test saying what is missing."""
    binary = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        missing = " and ".join(n for n, p in (("chromium", binary), ("chromium-driver", driver)) if p is None)
        pytest.skip(
            f"no headless browser: {missing} not installed (`make setup` installs Debian's chromium and "
            f"chromium-driver with apt-get)"
        )
    return binary, driver


class Browser:
    """One WebDriver session: a headless Chromium window."""

    def __init__(self, http: httpx.Client, session: str) -> None:
        self.http = http
        self.session = session

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self.http.request(method, f"/session/{self.session}{path}", json=body)
        value = r.json().get("value")
        if r.status_code != 200:
            raise AssertionError(f"WebDriver {method} {path}: {r.status_code} {value}")
        return value

    def get(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def find(self, css: str) -> str:
        return str(self._call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def click(self, css: str) -> None:
        self._call("POST", f"/element/{self.find(css)}/click", {})

    def type(self, css: str, text: str) -> None:
        """Types into a field (after clearing it), as a person would."""
        element = self.find(css)
        self._call("POST", f"/element/{element}/clear", {})
        self._call("POST", f"/element/{element}/value", {"text": text})

    def run(self, script: str, *args: Any) -> Any:
        """The value of a function body run in the page (`arguments` holds args)."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def run_async(self, script: str, *args: Any) -> Any:
        """Like `run`, the result being what the script passes to its last argument, a callback."""
        return self._call("POST", "/execute/async", {"script": script, "args": list(args)})

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Polls a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.run(f"return {expression};")
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {expression}")
            time.sleep(0.05)

    def text(self, css: str) -> str:
        return str(self.run("const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", css))

    def logs(self) -> list[str]:
        """The console's errors since the last call (CSP violations, failed loads, exceptions)."""
        entries = self.http.post(f"/session/{self.session}/se/log", json={"type": "browser"}).json()["value"]
        return [e["message"] for e in entries if e.get("level") == "SEVERE"]

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", "/screenshot")))


@contextmanager
def headless_browser(width: int = 1280, height: int = 800, timeout: float = 30.0) -> Iterator[Browser]:
    """Starts chromedriver on a free port and one headless Chromium session; ends both."""
    binary, driver = browser_or_skip()
    proc = subprocess.Popen(
        [driver, "--port=0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    port: list[int] = []
    ready = threading.Event()

    def read() -> None:  # the port it chose, then drain its output
        assert proc.stdout is not None
        for line in proc.stdout:
            m = STARTED.search(line)
            if m and not port:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout) or not port:
            raise RuntimeError("chromedriver did not start")
        with httpx.Client(base_url=f"http://127.0.0.1:{port[0]}", timeout=timeout) as http:
            options = {
                "binary": binary,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--no-first-run", "--disable-extensions", f"--window-size={width},{height}",
                ],
            }
            caps = {"browserName": "chrome", "goog:chromeOptions": options, "goog:loggingPrefs": {"browser": "ALL"}}
            r = http.post("/session", json={"capabilities": {"alwaysMatch": caps}})
            if r.status_code != 200:
                raise RuntimeError(f"chromium did not start: {r.text}")
            session = r.json()["value"]["sessionId"]
            try:
                yield Browser(http, session)
            finally:
                http.delete(f"/session/{session}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
