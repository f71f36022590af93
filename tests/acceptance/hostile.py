"""A bystander for hostile-client tests: `watch(url)` checks that while the test attacks the
server, another client's stream keeps its cadence and `/health` stays fast.

    with run_server(model, ...) as srv, watch(srv.url) as w:
        ...  # the hostile request(s)
    # here: AssertionError if the stream stalled or /health was slow or failed
    print(w.report())

In two background threads (each with its own httpx client and connection):
- a stream: one streaming completion after another (`max_tokens` up to the context, `ignore_eos`),
  timing the gap between consecutive chunks, across one stream's end and the next one's first
  chunk too (what a waiting client sees); a 429 or 503 answer is retried after 0.1 s, its time
  counted in the gap, so a server that refuses for long fails the same way as one that stalls;
- a prober: GET /health every 50 ms, timing each answer.

On leaving the block both threads stop and the bounds are checked (`max_gap_s`, 5 s; and
`max_health_s`, 1 s): it fails if any gap or probe went over, if any probe was not a 200, if
a stream answered anything but 200 / 429 / 503, or if no chunk or probe was seen at all. The
block's own exception, if any, wins. Keep the bodies the test sends built before the block: a
thread of the test process shares its GIL with them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

__all__ = ["Watch", "watch"]


@dataclass
class Watch:
    """What the bystander saw (read it after the block; the lists are appended to meanwhile)."""

    max_gap_s: float
    max_health_s: float
    chunks: int = 0
    streams: int = 0
    refusals: int = 0  # 429 / 503 answers to the stream's requests (retried)
    worst_gap_s: float = 0.0
    health_times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def report(self) -> str:
        worst = max(self.health_times, default=0.0)
        return (
            f"{self.chunks} chunks over {self.streams} streams (worst gap {self.worst_gap_s:.2f} s, "
            f"{self.refusals} refusals); {len(self.health_times)} /health probes "
            f"(worst {worst * 1000:.0f} ms); {len(self.errors)} errors"
        )

    def check(self) -> None:
        """AssertionError unless every bound held (see the module docstring)."""
        problems = list(self.errors[:5])
        if self.worst_gap_s >= self.max_gap_s:
            problems.append(f"a stream gap of {self.worst_gap_s:.2f} s (bound {self.max_gap_s} s)")
        slow = [t for t in self.health_times if t >= self.max_health_s]
        if slow:
            problems.append(f"{len(slow)} /health probes over {self.max_health_s} s (worst {max(slow):.2f} s)")
        if not self.chunks:
            problems.append("the stream got no chunk")
        if not self.health_times:
            problems.append("no /health probe answered")
        assert not problems, f"{'; '.join(problems)} ({self.report()})"


@contextmanager
def watch(
    url: str,
    *,
    max_gap_s: float = 5.0,
    max_health_s: float = 1.0,
    headers: dict[str, str] | None = None,
) -> Iterator[Watch]:
    """Watch the server at `url` (its root, e.g. `http://127.0.0.1:8000`) for the block's
    duration; `headers` go with every request (an `Authorization` for a keyed server)."""
    w = Watch(max_gap_s, max_health_s)
    done = threading.Event()
    threads = [
        threading.Thread(target=_stream, args=(url, headers or {}, w, done), name="watch-stream"),
        threading.Thread(target=_probe, args=(url, headers or {}, w, done), name="watch-health"),
    ]
    for t in threads:
        t.start()
    ok = False
    try:
        _wait_started(w, done)
        yield w
        ok = True
    finally:
        done.set()
        for t in threads:
            t.join(max_gap_s + 30)
    alive = [t.name for t in threads if t.is_alive()]
    if ok:
        assert not alive, f"the bystander threads {alive} did not stop ({w.report()})"
        w.check()


def _wait_started(w: Watch, done: threading.Event, timeout: float = 30.0) -> None:
    """Until the stream has a chunk and /health an answer: the attack starts on a live server."""
    deadline = time.monotonic() + timeout
    while not (w.chunks and w.health_times):
        if w.errors or time.monotonic() > deadline:
            raise AssertionError(f"the bystander did not start ({w.report()}): {w.errors[:3]}")
        time.sleep(0.02)


def _stream(url: str, headers: dict[str, str], w: Watch, done: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    last: float | None = None
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(60, read=w.max_gap_s + 10)) as client:
        # No max_tokens bigger than the context: ask the server for its context length first.
        try:
            models = client.get("/v1/models").json()["data"]
            body["max_tokens"] = max(1, int(models[0]["max_model_len"]) - 16)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            w.errors.append(f"GET /v1/models failed: {exc!r}")
            return
        while not done.is_set():
            try:
                with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code in (429, 503):
                        w.refusals += 1
                        r.read()
                        time.sleep(0.1)
                        continue
                    if r.status_code != 200:
                        w.errors.append(f"stream: HTTP {r.status_code}: {r.read()[:200]!r}")
                        return
                    w.streams += 1
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        json.loads(line[6:])
                        now = time.monotonic()
                        if last is not None:
                            w.worst_gap_s = max(w.worst_gap_s, now - last)
                        last = now
                        w.chunks += 1
                        if done.is_set():
                            return
            except httpx.HTTPError as exc:
                w.errors.append(f"stream: {exc!r}")
                return


def _probe(url: str, headers: dict[str, str], w: Watch, done: threading.Event) -> None:
    with httpx.Client(base_url=url, headers=headers, timeout=w.max_health_s + 10) as client:
        while not done.is_set():
            t0 = time.monotonic()
            try:
                status = client.get("/health").status_code
            except httpx.HTTPError as exc:
                w.errors.append(f"/health: {exc!r}")
                return
            w.health_times.append(time.monotonic() - t0)
            if status != 200:
                w.errors.append(f"/health: HTTP {status}")
                return
            time.sleep(0.05)
