"""`triollm bench soak`: a mixed load against a real `triollm serve`, for as long as asked, with
the engine stopped (SIGSTOP / SIGCONT) every few minutes; what it served, how each request
ended, and what was left behind.

It starts the server itself (so that it can stop the engine-core process and read the memory,
descriptors and children of both processes), then runs at once, until `--duration` is over:

- `--streams` clients streaming completions back to back (`max_tokens` 16-160, `ignore_eos`),
  one in five cancelled after a few chunks (the client closes the stream);
- a client sending hostile requests one after another (`HOSTILE`: big integers in a JSON schema,
  an oversized request id, fan-out over the budget, 50,000 chat messages, a queue-jumping
  priority, logprobs over the limit, malformed JSON ...), each of which must get a 4xx;
- a client asking for a new grammar every request (distinct regexes and JSON schemas);
- a `/health` probe every half second;
- every `--sigstop-every` seconds, the engine-core process(es) SIGSTOPped for `--sigstop-for`
  seconds, then SIGCONTed.

A request that takes longer than `--hang-after` seconds is a hang. After the load: the server
must become idle (no running or waiting request, KV cache usage 0 on /metrics), then it gets
SIGTERM and must exit 0 leaving no process and no ipc directory. The report: requests by
outcome, errors by kind, hangs, the longest /health answer and stream gap (outside stop
windows), peak RSS of the server and its children, descriptors before and after, and the leak
checks. Needs httpx and psutil (the dev extra).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

__all__ = ["HOSTILE", "add_soak_parser", "run_soak"]

READY = re.compile(r"serving .* on (http://\S+) \(ready\)")


# Hostile requests a server may also serve, within bounds (a 3 MB `name` is under every cap, and
# a chat template that ignores names renders a short prompt): a 200 or a 4xx is right for them.
MAY_BE_SERVED = frozenset({"huge-name"})


def _hostile(model: str) -> list[tuple[str, str, Any]]:
    """(name, path, body): requests a server must refuse with a 4xx (or, for `MAY_BE_SERVED`,
    serve), quickly, alone."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    base = {"model": model, "prompt": "Hello", "max_tokens": 4}
    return [
        ("schema-big-int", c, {**base, "structured_outputs": {"json": {"type": "integer", "maximum": 2**64 + 5}}}),
        (
            "schema-big-enum",
            chat,
            {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [10**30]}}},
            },
        ),
        ("huge-request-id", c, {**base, "request_id": "x" * 100_000}),
        ("fan-out", c, {**base, "prompt": ["Hello there"] * 1024, "n": 128}),
        (
            "many-messages",
            chat,
            {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}] * 50_000},
        ),
        (
            "huge-name",
            chat,
            {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "a", "name": "n" * 3_000_000}]},
        ),
        (
            "many-parts",
            chat,
            {
                "model": model,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 20_000}],
            },
        ),
        (
            "deep-grammar",
            c,
            {
                **base,
                "structured_outputs": {
                    "grammar": "\n".join(f"r{i}: r{i + 1}" for i in range(60_000)) + '\nr60000: "x"\nstart: r0'
                },
            },
        ),
        ("priority", c, {**base, "priority": -(2**62)}),
        ("logprobs", c, {**base, "logprobs": 10**6}),
        ("bad-json", c, b'{"model": "x", "prompt": '),
        ("bad-type", c, {**base, "max_tokens": "many"}),
        ("too-long", c, {**base, "prompt": "hello " * 100_000}),
    ]


HOSTILE = [name for name, _, _ in _hostile("m")]


@dataclass
class SoakOptions:
    model: str | None
    duration: float = 1800.0
    streams: int = 8
    sigstop_every: float = 180.0
    sigstop_for: float = 5.0
    hang_after: float = 120.0
    server_args: tuple[str, ...] = ()
    seed: int = 0


@dataclass
class Tally:
    started: float = field(default_factory=time.monotonic)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    hostile: Counter[str] = field(default_factory=Counter)
    hangs: int = 0
    health_max_s: float = 0.0
    health_slow: int = 0  # answers over 1 s outside stop windows
    stream_gap_max_s: float = 0.0  # outside stop windows
    peak_rss_mib: float = 0.0
    stops: list[tuple[float, float]] = field(default_factory=list)  # (start, end), monotonic
    stopping: bool = False

    def overlaps_stop(self, t0: float, t1: float, margin: float = 2.0) -> bool:
        return self.stopping or any(a - margin <= t1 and t0 <= b + margin for a, b in self.stops)


class _Server:
    def __init__(self, opts: SoakOptions) -> None:
        model = [opts.model] if opts.model else []  # none: the bundled default
        cmd = [sys.executable, "-m", "triollm.api.cli", "serve", *model, "--port", "0", *opts.server_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                del self.log[:-2000]
                m = READY.search(line)
                if m and not self.url:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or not self.url:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-40:]))

    def processes(self) -> list[Any]:
        import psutil

        try:
            parent = psutil.Process(self.proc.pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def engine_processes(self) -> list[Any]:
        return self.processes()[1:]

    def rss_mib(self) -> float:
        total = 0
        for p in self.processes():
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        return total / 2**20

    def fds(self) -> int:
        total = 0
        for p in self.processes():
            try:
                total += p.num_fds()
            except Exception:
                pass
        return total


async def _stream(client: Any, url: str, model: str, rng: random.Random, tally: Tally, hang_after: float) -> None:
    body = {"model": model, "prompt": rng.choice(["Once upon a time", "The engine", "Hello, my name is"]),
            "max_tokens": rng.randint(16, 160), "ignore_eos": True, "stream": True}
    cancel_after = rng.randint(1, 8) if rng.random() < 0.2 else None
    t0 = last = time.monotonic()
    gap = 0.0
    chunks = 0
    try:
        with anyio.fail_after(hang_after):
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    tally.outcomes[f"stream {resp.status_code}"] += 1
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
                    chunks += 1
                    if cancel_after is not None and chunks >= cancel_after:
                        tally.outcomes["stream cancelled by the client"] += 1
                        return
        tally.outcomes["stream served"] += 1
    except TimeoutError:
        tally.hangs += 1
        tally.outcomes["stream hung"] += 1
    except Exception as exc:
        tally.errors[f"stream {type(exc).__name__}"] += 1
    finally:
        if not tally.overlaps_stop(t0, time.monotonic()):
            tally.stream_gap_max_s = max(tally.stream_gap_max_s, gap)


async def _post(client: Any, url: str, body: Any, hang_after: float) -> tuple[int, dict[str, Any]]:
    with anyio.fail_after(hang_after):
        if isinstance(body, bytes):
            resp = await client.post(url, content=body, headers={"content-type": "application/json"})
        else:
            resp = await client.post(url, json=body)
    try:
        data = resp.json()
    except ValueError:
        data = {}
    return resp.status_code, data if isinstance(data, dict) else {}


async def _hostile_loop(client: Any, root: str, model: str, tally: Tally, hang_after: float, stop: anyio.Event) -> None:
    cases = _hostile(model)
    encoded = [
        (name, path, body if isinstance(body, bytes) else json.dumps(body).encode()) for name, path, body in cases
    ]
    i = 0
    while not stop.is_set():
        name, path, body = encoded[i % len(encoded)]
        i += 1
        try:
            status, data = await _post(client, root + path, body, hang_after)
        except TimeoutError:
            tally.hangs += 1
            tally.hostile[f"{name}: hung"] += 1
            continue
        except Exception as exc:
            tally.errors[f"hostile {name}: {type(exc).__name__}"] += 1
            continue
        ok = (400 <= status < 500 and isinstance(data.get("error"), dict)) or (status == 200 and name in MAY_BE_SERVED)
        tally.hostile[f"{name}: {status}"] += 1
        if not ok:
            tally.errors[f"hostile {name} not refused: {status}"] += 1
        await anyio.sleep(0.5)


async def _grammar_loop(
    client: Any, root: str, model: str, rng: random.Random, tally: Tally, hang_after: float, stop: anyio.Event
) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        if k % 2:
            so: dict[str, Any] = {"regex": f"(ab|c){{1,{rng.randint(1, 50)}}}d{k}"}
        else:
            props = {
                f"f{k}_{j}": {"type": rng.choice(["integer", "string", "boolean"])} for j in range(rng.randint(1, 6))
            }
            so = {"json": {"type": "object", "properties": props, "required": list(props)}}
        body = {"model": model, "prompt": "Answer:", "max_tokens": 32, "structured_outputs": so}
        try:
            status, _ = await _post(client, root + "/v1/completions", body, hang_after)
            tally.outcomes[f"grammar {status}"] += 1
            if status != 200:
                tally.errors[f"grammar {status}"] += 1
        except TimeoutError:
            tally.hangs += 1
            tally.outcomes["grammar hung"] += 1
        except Exception as exc:
            tally.errors[f"grammar {type(exc).__name__}"] += 1
        await anyio.sleep(1.0)


async def _health_loop(client: Any, root: str, tally: Tally, stop: anyio.Event) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            with anyio.fail_after(30):
                resp = await client.get(root + "/health")
            took = time.monotonic() - t0
            if resp.status_code != 200:
                tally.errors[f"health {resp.status_code}"] += 1
        except Exception as exc:
            took = time.monotonic() - t0
            tally.errors[f"health {type(exc).__name__}"] += 1
        if not tally.overlaps_stop(t0, t0 + took, margin=0.0):
            tally.health_max_s = max(tally.health_max_s, took)
            tally.health_slow += took > 1.0
        await anyio.sleep(0.5)


async def _chaos_loop(server: _Server, opts: SoakOptions, tally: Tally, stop: anyio.Event) -> None:
    while True:
        with anyio.move_on_after(opts.sigstop_every):
            await stop.wait()
        if stop.is_set():
            return
        procs = server.engine_processes()
        t0 = time.monotonic()
        tally.stopping = True
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        await anyio.sleep(opts.sigstop_for)
        for p in procs:
            p.send_signal(signal.SIGCONT)
        tally.stopping = False
        tally.stops.append((t0, time.monotonic()))


async def _sample_loop(server: _Server, tally: Tally, stop: anyio.Event) -> None:
    while not stop.is_set():
        tally.peak_rss_mib = max(tally.peak_rss_mib, await anyio.to_thread.run_sync(server.rss_mib))
        await anyio.sleep(1.0)


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _wait_idle(client: Any, root: str) -> dict[str, float | None]:
    """The engine's gauges once they read idle (or after a minute: what they read then)."""
    seen: dict[str, float | None] = {}
    with anyio.move_on_after(60):
        while True:
            text = (await client.get(root + "/metrics")).text
            seen = {
                n: _metric(text, f"vllm:{n}")
                for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            }
            if all(v == 0 for v in seen.values()):
                break
            await anyio.sleep(0.5)
    return seen


async def run_soak(opts: SoakOptions) -> dict[str, Any]:
    import httpx

    rng = random.Random(opts.seed)
    tally = Tally()
    server = await anyio.to_thread.run_sync(_Server, opts)
    root = server.url
    ipc_before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"triollm-{server.proc.pid}-*")))
    limits = httpx.Limits(max_connections=opts.streams + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.hang_after), limits=limits) as client:
        model = (await client.get(root + "/v1/models")).json()["data"][0]["id"]
        fds_before = server.fds()
        stop = anyio.Event()

        async def streamer(seed: int) -> None:
            r = random.Random(seed)
            while not stop.is_set():
                await _stream(client, root, model, r, tally, opts.hang_after)

        async with anyio.create_task_group() as tg:
            for i in range(opts.streams):
                tg.start_soon(streamer, opts.seed * 1000 + i)
            tg.start_soon(_hostile_loop, client, root, model, tally, opts.hang_after, stop)
            tg.start_soon(_grammar_loop, client, root, model, rng, tally, opts.hang_after, stop)
            tg.start_soon(_health_loop, client, root, tally, stop)
            tg.start_soon(_chaos_loop, server, opts, tally, stop)
            tg.start_soon(_sample_loop, server, tally, stop)
            await anyio.sleep(opts.duration)
            stop.set()
        idle = await _wait_idle(client, root)
    await anyio.sleep(6)  # the client's pooled connections closed, the keep-alive timer run out
    fds_after = server.fds()
    engine_pids = [p.pid for p in server.engine_processes()]
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = await anyio.to_thread.run_sync(lambda: server.proc.wait(60))
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = None
    import psutil

    left = [
        pid for pid in engine_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    ipc_left = sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"triollm-{server.proc.pid}-*")))
    served = sum(
        v for k, v in tally.outcomes.items() if k in ("stream served", "stream cancelled by the client", "grammar 200")
    )
    return {
        "duration_s": round(time.monotonic() - tally.started, 1),
        "requests_served": served,
        "hostile_requests": sum(tally.hostile.values()),
        "outcomes": dict(tally.outcomes),
        "hostile": dict(sorted(tally.hostile.items())),
        "errors": dict(tally.errors),
        "hangs": tally.hangs,
        "engine_stops": len(tally.stops),
        "health_max_s": round(tally.health_max_s, 3),
        "health_over_1s": tally.health_slow,
        "stream_gap_max_s": round(tally.stream_gap_max_s, 3),
        "peak_rss_mib": round(tally.peak_rss_mib, 1),
        "fds_before": fds_before,
        "fds_after_idle": fds_after,
        "idle_after_load": idle,
        "exit_code": code,
        "processes_left": left,
        "ipc_dirs_left": ipc_left,
        "ipc_dirs_at_start": sorted(ipc_before),
    }


def add_soak_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "soak",
        help=(
            "a mixed load (streams, cancellations, bad requests, grammars, engine SIGSTOPs) against a real server, "
            "with leak checks"
        ),
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="the model to serve (a directory, .gguf file or hub id; default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming clients (default: %(default)s)")
    p.add_argument(
        "--sigstop-every", type=float, default=180.0, help="seconds between engine SIGSTOPs (default: %(default)s)"
    )
    p.add_argument("--sigstop-for", type=float, default=5.0, help="seconds each SIGSTOP lasts (default: %(default)s)")
    p.add_argument(
        "--hang-after", type=float, default=120.0, help="a request taking longer is a hang (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="also write the report to this file")
    p.add_argument(
        "--serve-args",
        default="",
        help='arguments for `triollm serve`, as one string (e.g. "--num-threads 2 --worker trio")',
    )
    p.set_defaults(func=_main)


def _main(ns: argparse.Namespace) -> int:
    args = shlex.split(ns.serve_args)
    opts = SoakOptions(
        ns.model, ns.duration, ns.streams, ns.sigstop_every, ns.sigstop_for, ns.hang_after, tuple(args), ns.seed
    )
    report = anyio.run(run_soak, opts)
    text = json.dumps(report, indent=2)
    print(text)
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            f.write(text + "\n")
    bad = report["hangs"] or report["processes_left"] or report["ipc_dirs_left"] or report["exit_code"] != 0
    return 1 if bad else 0
