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
- clients for the surfaces of issue 39 (`_Surfaces`), each request with the status it must get:
  request chat templates (the server runs with `--trust-request-chat-template`): benign ones,
  distinct each time (200), ones that name a file (`/proc/self/environ`, a secret file the soak
  wrote: 200, rendered as the path's own text, never the file), budget-busting ones (nested
  `range(100000)`, `'x' * 10**9`: a quick 400 naming `chat_template`); stored responses under
  two API keys (the server runs with both: key A creates, key B's GET, DELETE and
  `previous_response_id` are 404s, key A's own reads, continuation and delete work); runtime LoRA
  loads, when the model can take adapters (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`:
  a random adapter loads (200), a corrupt one is a 400 naming the file, requests under the good
  one are served, then it is unloaded); tool-call arguments nested 10,000 deep on chat,
  Responses and /tokenize (400, never 5xx). Any answer that holds the server's environment (a
  canary variable set for it) or the secret file's text is a leak, as is another key's stored
  response;
- a `/health` probe every half second;
- every `--sigstop-every` seconds, the engine-core process(es) SIGSTOPped for `--sigstop-for`
  seconds, then SIGCONTed.

A request that takes longer than `--hang-after` seconds is a hang. After the load: the server
must become idle (no running or waiting request, KV cache usage 0 on /metrics), then it gets
SIGTERM and must exit 0 leaving no process and no ipc directory. The report: requests by
outcome, errors by kind, hangs, each surface's requests (sent, statuses, mismatches with the
status it must get, 5xx, leaks), the longest /health answer and stream gap (outside stop
windows), peak RSS of the server and its children, descriptors before and after, and the leak
checks. The exit status is 1 for a hang, a leak, a 5xx or a mismatch on a surface, or anything
left behind. Needs httpx and psutil (the dev extra).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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
    # surface kind -> "sent", "status N", "mismatch", "5xx", "leak" (`_Surfaces`)
    surfaces: dict[str, Counter[str]] = field(default_factory=dict)
    template_refusal_max_s: float = 0.0  # the slowest 400 for a budget-busting template

    def surface(self, kind: str) -> Counter[str]:
        return self.surfaces.setdefault(kind, Counter())

    def surface_total(self, key: str) -> int:
        return sum(c[key] for c in self.surfaces.values())

    def overlaps_stop(self, t0: float, t1: float, margin: float = 2.0) -> bool:
        return self.stopping or any(a - margin <= t1 and t0 <= b + margin for a, b in self.stops)


class _Server:
    def __init__(self, opts: SoakOptions, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        """`args`, `env`: more serve arguments (before `opts.server_args`) and environment."""
        model = [opts.model] if opts.model else []  # none: the bundled default
        cmd = [sys.executable, "-m", "triollm.api.cli", "serve", *model, "--port", "0", *args, *opts.server_args]
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
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


# ---------------------------------------------------------------- issue 39's surfaces

DEEP = 10_000  # levels of nesting in the tool-call arguments the server must refuse
CANARY_ENV = "TRIOLLM_SOAK_CANARY"  # set for the server only: an answer that holds it leaked the environment
QUICK_TEMPLATE_S = 10.0  # a budget-busting template must be refused within this (its budget is ~1 s of CPU)
NESTED_LOOPS = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
BUDGET_BUSTING = {"template-loops": NESTED_LOOPS, "template-repeat": "{{ 'x' * 10**9 }}"}
LORA_RANK = 8
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _deep_json() -> str:
    """A JSON object with a list nested `DEEP` levels (as text: json.dumps would recurse)."""
    return '{"city": "x", "n": ' + "[" * DEEP + "]" * DEEP + "}"


def _with_raw(body: dict[str, Any], raw: str) -> bytes:
    """`body` as JSON with its string "@RAW@" replaced by the JSON text `raw`."""
    return json.dumps(body).replace('"@RAW@"', raw, 1).encode()


def _nested_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(kind, path, body): tool-call arguments nested `DEEP` levels, each a 400."""
    chat = [{"role": "user", "content": "Weather?"}]

    def call(arguments: Any) -> list[dict[str, Any]]:
        calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]
        return [
            *chat,
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]

    base = {"model": model, "max_tokens": 2, "temperature": 0.0}
    text_args = _deep_json()
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "@RAW@"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    responses = {"model": model, "max_output_tokens": 2, "temperature": 0.0, "store": False}
    return [
        ("nested-args-chat", "/v1/chat/completions", json.dumps({**base, "messages": call(text_args)}).encode()),
        (
            "nested-args-chat",
            "/v1/chat/completions",
            json.dumps({**base, "stream": True, "messages": call(text_args)}).encode(),
        ),
        ("nested-args-chat", "/v1/chat/completions", _with_raw({**base, "messages": call("@RAW@")}, text_args)),
        ("nested-args-responses", "/v1/responses", _with_raw({**responses, "input": items}, json.dumps(text_args))),
        ("nested-args-responses", "/v1/responses", _with_raw({**responses, "input": items}, text_args)),
        (
            "nested-args-responses",
            "/v1/responses",
            _with_raw({**responses, "input": [{"role": "user", "content": "@RAW@"}]}, "[" * DEEP + "]" * DEEP),
        ),
        ("nested-args-tokenize", "/tokenize", json.dumps({"model": model, "messages": call(text_args)}).encode()),
    ]


def _dashed(word: str) -> str:
    if not word.startswith("--"):
        return word
    name, eq, value = word.partition("=")
    return name.replace("_", "-") + eq + value


def _lora_model(opts: SoakOptions) -> tuple[Any, str]:
    """The served model's config, as `triollm serve` will resolve it, if a random adapter of
    `bench/lora.py` fits it (None and why not, otherwise)."""
    try:
        # `triollm serve`'s own flags, not api/cli.py's parser (the CLI imports bench/).
        from triollm.api.serve_args import add_serve_args
        from triollm.engine.config import EngineArgs
        from triollm.engine.config.model import resolve_device, resolve_model_config

        parser = argparse.ArgumentParser(add_help=False)
        add_serve_args(parser)
        EngineArgs.add_cli_args(parser)
        # vLLM's `--flag_name` spelling, as the CLI takes it: the name dashed, a `=value` kept.
        words = [_dashed(w) for w in opts.server_args]
        ns, _ = parser.parse_known_args(words)
        if opts.model:
            ns.model = opts.model
        args = EngineArgs.from_cli_args(ns)
        if args.max_lora_rank < LORA_RANK:
            return None, f"--max-lora-rank {args.max_lora_rank} is under the soak adapter's rank {LORA_RANK}"
        cache_dir = Path(args.cache_dir) if args.cache_dir else None
        model = resolve_model_config(args, resolve_device(args.device), cache_dir)
    except (Exception, SystemExit) as exc:  # argparse exits on words it cannot parse
        return None, f"the model's config could not be read ({type(exc).__name__}: {exc})"
    if model.runner_type != "generate":
        return None, f"a {model.runner_type} model takes no adapters"
    return model, ""


def _write_adapters(model: Any, root: Path) -> tuple[Path, Path]:
    """A random adapter for `model` (checked here as the server will check it) and a corrupt copy."""
    from triollm.bench.lora import write_random_adapter
    from triollm.lora.peft import read_adapter_config
    from triollm.lora.shapes import ModelShapes

    good = write_random_adapter(root / "good", model, LORA_RANK, 0)
    ModelShapes.of(model).check(read_adapter_config(good, max_lora_rank=LORA_RANK))
    corrupt = Path(shutil.copytree(good, root / "corrupt"))
    (corrupt / ADAPTER_WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    return good, corrupt


@dataclass
class _Surfaces:
    """The clients of issue 39's surfaces; every answer is counted in `tally.surfaces` by kind."""

    client: Any
    root: str
    model: str
    tally: Tally
    hang_after: float
    stop: anyio.Event
    key_b: str  # the client's own headers carry key A
    canary: str  # the value of CANARY_ENV in the server's environment
    secret_file: Path
    secret: str  # its text
    adapters: tuple[Path, Path] | None  # (good, corrupt), None: LoRA is not exercised

    def leaked(self, text: str) -> bool:
        """Whether `text` holds the server's environment, the secret file or /etc/passwd."""
        return self.canary in text or self.secret in text or "root:x:0:0" in text

    def fail(self, kind: str, why: str) -> None:
        self.tally.surface(kind)["mismatch"] += 1
        self.tally.errors[f"surface {kind}: {why}"] += 1

    async def send(
        self, kind: str, method: str, path: str, expect: int, body: Any = None, *, key_b: bool = False
    ) -> tuple[int | None, str, dict[str, Any]]:
        """One request, counted; (status, text, JSON object) or (None, "", {}) if it failed."""
        counts = self.tally.surface(kind)
        counts["sent"] += 1
        headers = {"authorization": f"Bearer {self.key_b}"} if key_b else {}
        if isinstance(body, bytes):
            headers["content-type"] = "application/json"
            kw: dict[str, Any] = {"content": body}
        else:
            kw = {} if body is None else {"json": body}
        try:
            with anyio.fail_after(self.hang_after):
                resp = await self.client.request(method, self.root + path, headers=headers, **kw)
        except TimeoutError:
            self.tally.hangs += 1
            counts["hung"] += 1
            return None, "", {}
        except Exception as exc:
            self.tally.errors[f"surface {kind}: {type(exc).__name__}"] += 1
            return None, "", {}
        status, text = resp.status_code, resp.text
        counts[f"status {status}"] += 1
        if status >= 500:
            counts["5xx"] += 1
        if status != expect:
            self.fail(kind, f"{method} {path} answered {status}, expected {expect}")
        if self.leaked(text):
            counts["leak"] += 1
        try:
            data = resp.json()
        except ValueError:
            data = {}
        return status, text, data if isinstance(data, dict) else {}

    async def pause(self) -> None:
        await anyio.sleep(0.5)

    async def templates(self) -> None:
        chat = {"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        k = 0
        while not self.stop.is_set():
            k += 1  # distinct templates, more than the server's LRU holds
            benign = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:{# soak " + f"{k} #}}"
            await self.send("template-benign", "POST", "/v1/chat/completions", 200, {**chat, "chat_template": benign})
            await self.pause()
            for path in ("/proc/self/environ", str(self.secret_file), "/etc/passwd", "/no/such/soak-file"):
                body = {**chat, "chat_template": path, "prompt_logprobs": 0}
                status, _, data = await self.send("template-file", "POST", "/v1/chat/completions", 200, body)
                if status == 200:
                    rows = [r for r in data.get("prompt_logprobs") or [] if isinstance(r, dict)]
                    prompt = "".join(str(e.get("decoded_token", "")) for r in rows for e in r.values())
                    if self.leaked(prompt):
                        self.tally.surface("template-file")["leak"] += 1
                    if not prompt or not path.endswith(prompt):
                        self.fail("template-file", f"the prompt of template {path!r} is not its text: {prompt[:80]!r}")
                await self.pause()
            for kind, template in BUDGET_BUSTING.items():
                t0 = time.monotonic()
                body = {**chat, "chat_template": template}
                status, _, data = await self.send(kind, "POST", "/v1/chat/completions", 400, body)
                took = time.monotonic() - t0
                if status is None:
                    continue
                self.tally.template_refusal_max_s = max(self.tally.template_refusal_max_s, took)
                if took > QUICK_TEMPLATE_S:
                    self.fail(kind, f"refused after more than {QUICK_TEMPLATE_S:.0f} s")
                error = data.get("error")
                if status == 400 and not (isinstance(error, dict) and "chat_template" in str(error.get("message"))):
                    self.fail(kind, "the 400 does not name chat_template")
                await self.pause()

    async def stored(self) -> None:
        first = {"model": self.model, "input": "Hi", "max_output_tokens": 4, "store": True}
        while not self.stop.is_set():
            status, _, data = await self.send("store-own", "POST", "/v1/responses", 200, first)
            rid = data.get("id")
            if status != 200 or not isinstance(rid, str):
                await self.pause()
                continue
            at = f"/v1/responses/{rid}"
            for method, path in (("GET", at), ("DELETE", at), ("POST", "/v1/responses")):
                body = {**first, "previous_response_id": rid} if method == "POST" else None
                status, _, _ = await self.send("store-other-key", method, path, 404, body, key_b=True)
                if status == 200:
                    self.tally.surface("store-other-key")["leak"] += 1  # another key's response
            status, _, got = await self.send("store-own", "GET", at, 200)
            if status == 200 and got.get("id") != rid:
                self.fail("store-own", "GET answered another response")
            await self.send("store-own", "POST", "/v1/responses", 200, {**first, "previous_response_id": rid})
            await self.send("store-own", "DELETE", at, 200)
            await self.send("store-own", "GET", at, 404)
            await self.pause()

    async def lora(self) -> None:
        assert self.adapters is not None
        good, corrupt = self.adapters
        k = 0
        while not self.stop.is_set():
            k += 1
            name = f"soak-lora-{k}"
            body = {"lora_name": name, "lora_path": str(good)}
            status, _, _ = await self.send("lora-load", "POST", "/v1/load_lora_adapter", 200, body)
            bad = {"lora_name": f"soak-corrupt-{k}", "lora_path": str(corrupt)}
            bad_status, text, _ = await self.send("lora-corrupt", "POST", "/v1/load_lora_adapter", 400, bad)
            if bad_status == 400 and ADAPTER_WEIGHTS not in text:
                self.fail("lora-corrupt", "the 400 does not name the file")
            if status == 200:
                for _ in range(3):
                    req = {"model": name, "prompt": "The engine", "max_tokens": 4, "ignore_eos": True}
                    status, _, data = await self.send("lora-request", "POST", "/v1/completions", 200, req)
                    choices = data.get("choices") or [{}]
                    if status == 200 and choices[0].get("finish_reason") != "length":
                        self.fail("lora-request", f"finish_reason {choices[0].get('finish_reason')!r}")
                await self.send("lora-unload", "POST", "/v1/unload_lora_adapter", 200, {"lora_name": name})
                req = {"model": name, "prompt": "The engine", "max_tokens": 2}
                await self.send("lora-unloaded", "POST", "/v1/completions", 404, req)
            await self.pause()

    async def nested(self) -> None:
        bodies = _nested_bodies(self.model)
        i = 0
        while not self.stop.is_set():
            kind, path, body = bodies[i % len(bodies)]
            i += 1
            await self.send(kind, "POST", path, 400, body)
            await self.pause()

    def start(self, tg: Any) -> None:
        tg.start_soon(self.templates)
        tg.start_soon(self.stored)
        tg.start_soon(self.nested)
        if self.adapters is not None:
            tg.start_soon(self.lora)


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
    rng = random.Random(opts.seed)
    tally = Tally()
    work = Path(tempfile.mkdtemp(prefix="triollm-soak-"))
    try:
        return await _run_soak(opts, rng, tally, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _run_soak(opts: SoakOptions, rng: random.Random, tally: Tally, work: Path) -> dict[str, Any]:
    import httpx

    from triollm.api.serving_models import RUNTIME_LORA_ENV

    key_a, key_b = f"soak-a-{secrets.token_hex(8)}", f"soak-b-{secrets.token_hex(8)}"
    canary, secret = secrets.token_hex(16), f"SOAK-SECRET-{secrets.token_hex(16)}"
    secret_file = work / "secret.txt"
    secret_file.write_text(secret)
    model_config, lora_skipped = await anyio.to_thread.run_sync(_lora_model, opts)
    adapters = None
    if model_config is not None:
        try:
            adapters = await anyio.to_thread.run_sync(_write_adapters, model_config, work / "adapters")
        except Exception as exc:
            lora_skipped = f"no adapter fits the model ({type(exc).__name__}: {exc})"
    serve_args = ["--trust-request-chat-template", "--api-key", key_a, key_b]
    env = {CANARY_ENV: canary}
    server = None
    if adapters is not None:
        lora_env = {**env, RUNTIME_LORA_ENV: "1"}
        try:
            server = await anyio.to_thread.run_sync(_Server, opts, [*serve_args, "--enable-lora"], lora_env)
        except RuntimeError as exc:  # the model or the serve arguments refuse LoRA: the soak goes on without
            adapters = None
            lines = [line for line in str(exc).splitlines() if line.strip()]
            lora_skipped = "the server did not start with --enable-lora: " + (lines[-1] if lines else "")
    if server is None:
        server = await anyio.to_thread.run_sync(_Server, opts, serve_args, env)
    root = server.url
    ipc_before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"triollm-{server.proc.pid}-*")))
    # The client drops an idle pooled connection before the server's keep-alive timer (5 s by
    # default) closes it: with equal timers a request sent on a connection the server is closing
    # at that moment ends in a ReadError that is the race's, not the server's (httpx retries no
    # request; the one /health ReadError of a 30-minute run, docs/reliability.md, fits it).
    limits = httpx.Limits(max_connections=opts.streams + 16, keepalive_expiry=2.0)
    headers = {"authorization": f"Bearer {key_a}"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.hang_after), limits=limits, headers=headers) as client:
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
            surfaces = _Surfaces(
                client, root, model, tally, opts.hang_after, stop, key_b, canary, secret_file, secret, adapters
            )
            surfaces.start(tg)
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
        "surface_requests": tally.surface_total("sent"),
        "surfaces": {kind: _surface_report(counts) for kind, counts in sorted(tally.surfaces.items())},
        "surface_mismatches": tally.surface_total("mismatch"),
        "surface_5xx": tally.surface_total("5xx"),
        "leaks": tally.surface_total("leak"),
        "template_refusal_max_s": round(tally.template_refusal_max_s, 3),
        "lora": "exercised" if adapters is not None else f"skipped: {lora_skipped}",
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


def _surface_report(counts: Counter[str]) -> dict[str, Any]:
    statuses = {k.removeprefix("status "): v for k, v in sorted(counts.items()) if k.startswith("status ")}
    report: dict[str, Any] = {"sent": counts["sent"], "statuses": statuses}
    report.update({k: counts[k] for k in ("mismatch", "5xx", "leak", "hung")})
    return report


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
    bad = bad or report["leaks"] or report["surface_5xx"] or report["surface_mismatches"]
    return 1 if bad else 0
