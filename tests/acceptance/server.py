"""Start the real `triollm serve` in a subprocess, as a user would, and wait until it is ready."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

READY = re.compile(r"serving .* on (https?(?:://|\+unix:)\S+) \(ready\)")


class Server:
    def __init__(self, proc: subprocess.Popen[str], url: str, log: list[str]) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    @property
    def engine_children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


@contextmanager
def run_server(model: Path, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Iterator[Server]:
    cmd = [
        sys.executable, "-m", "triollm.api.cli", "serve", str(model),
        "--port", "0", "--max-model-len", "256", "--num-threads", "1", *args,
    ]
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout) or not found:
            raise RuntimeError("server did not start:\n" + "".join(log))
        yield Server(proc, found[0], log)
    finally:
        children = []
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for child in children:
            if child.is_running():
                child.kill()
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()


def health_after_death(url: str, timeout: float = 5.0) -> int | str:
    """Poll /health until it answers 503 or the server has closed its socket ("gone": it is
    exiting); the last status otherwise (a server that kept answering 200)."""
    deadline = time.monotonic() + timeout
    status: int | str | None = None
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{url}/health", timeout=1).status_code
        except httpx.HTTPError:
            return "gone"
        if status == 503:
            return status
        time.sleep(0.01)
    return status if status is not None else "no answer"


def assert_dies_with_its_engine(srv: Server, engine: list[psutil.Process], timeout: float = 20.0) -> None:
    """After an engine process was killed: /health answers 503 until the server has closed its
    socket (one that kept answering 200 for 5 s fails), the server exits non-zero within
    `timeout`, and no engine process is left."""
    status = health_after_death(srv.url)
    assert status in (503, "gone"), status
    try:
        code = srv.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("server did not exit after the engine died") from None
    assert code != 0
    assert not [p for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and the KV cache is empty."""
    deadline = time.monotonic() + timeout
    values: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]  # summed over the engines (data parallel ranks)
                values[key] = values.get(key, 0.0) + float(value)
        if (
            values.get("vllm:num_requests_running") == 0
            and values.get("vllm:num_requests_waiting") == 0
            and values.get("vllm:kv_cache_usage_perc") == 0
        ):
            return values
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {values}")


def staggered_completion(url: str, i: int, tokens: int, delay: float) -> int:
    """After `delay` seconds, a greedy completion of `tokens` tokens for prompt i (served model
    name "m"); returns the completion tokens the server counted."""
    time.sleep(delay)
    body = {"model": "m", "prompt": f"request {i}", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])
