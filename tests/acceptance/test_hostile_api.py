"""Hostile clients against the real `triollm serve` (issue 22): each bad request
is refused with a 4xx naming the field (or its connection closed) within seconds, while a
bystander's stream keeps its cadence and /health stays fast (`hostile.watch`), and the server
stays up.

One server for the module, keyed with `--api-key-all-routes` and with short client timeouts and
a small concurrency cap, so that every test can share it.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hostile import watch
from server import Server, run_server

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEEP_ALIVE_S = 1.5
BODY_TIMEOUT_S = 2.0
LIMIT = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    args = (
        "--api-key", KEY, "--api-key-all-routes",
        "--timeout-keep-alive", str(KEEP_ALIVE_S),
        "--request-body-timeout", str(BODY_TIMEOUT_S),
        "--limit-concurrency", str(LIMIT),
        "--max-logprobs", "-1",  # "no limit" must still mean "at most the vocabulary"
        "--enable-log-requests",  # off by default, as in vLLM: test_log_lines_stay_bounded reads them
    )
    with run_server(tiny_model_dir, *args) as srv:
        yield srv
        assert srv.proc.poll() is None, "the server died"


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def assert_refused(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def encoded(body: object) -> bytes:
    """Bodies are encoded before `watch` starts: its threads share this process's GIL."""
    return json.dumps(body).encode()


def post(client: httpx.Client, path: str, body: bytes, **headers: str) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json", **headers})


def raw(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> tuple[float, bytes]:
    """Read until the server closes `sock` (recv gives b""): (seconds it took, what was read);
    fails if it stays open longer than `seconds`."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0, data
        if not chunk:
            return time.monotonic() - t0, data
        data += chunk
    raise AssertionError(f"the connection stayed open for {seconds} s; got {data[:200]!r}")


# ------------------------------------------------------------------------------ chat fields


def test_absurd_chats_are_400_naming_the_field_before_rendering(server: Server, client: httpx.Client) -> None:
    many = {"messages": [{"role": "user", "content": "a"}] * 50_000, "max_tokens": 1}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 20_000}], "max_tokens": 1}
    role = {"messages": [{"role": "u" * 1_000_000, "content": "hi"}], "max_tokens": 1}
    cases = [
        ("/v1/chat/completions", encoded(many), "messages"),
        ("/tokenize", encoded({"messages": many["messages"][:20_000]}), "messages"),  # under 1 MiB
        ("/v1/chat/completions", encoded(parts), "messages[0].content"),
        ("/v1/chat/completions", encoded(role), "messages[0].role"),
    ]
    with watch(server.url, headers=AUTH):
        for path, body, param in cases:
            t0 = time.monotonic()
            r = post(client, path, body)
            assert_refused(r, 400, param, "length <=")
            assert time.monotonic() - t0 < 2.0, (path, param)


def test_a_chat_full_of_small_strings_is_rendered_off_the_loop(server: Server, client: httpx.Client) -> None:
    """Under the caps, but costly: 8,000 messages with a 3 MB name each side of them; answered
    (a 400: too long a prompt for the context) while the bystander keeps its pace."""
    messages = [{"role": "user", "content": "a", "name": "n" * 64}] * 8_000
    messages.append({"role": "user", "content": "hi", "name": "x" * 3_000_000})
    body = encoded({"messages": messages, "max_tokens": 1})
    with watch(server.url, headers=AUTH):
        r = post(client, "/v1/chat/completions", body)
        assert r.status_code == 400, r.text[:300]


def test_huge_token_list_prompt_is_refused_without_stalling(server: Server, client: httpx.Client) -> None:
    body = b'{"max_tokens": 1, "prompt": [' + b"1," * 5_000_000 + b"1]}"
    with watch(server.url, headers=AUTH):
        r = post(client, "/v1/completions", body)
        assert_refused(r, 400, "prompt")


# ------------------------------------------------------------------------------ request ids


def test_request_ids_are_capped(server: Server, client: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    huge = encoded({**body, "request_id": "r" * 8_000_000})
    with watch(server.url, headers=AUTH):
        t0 = time.monotonic()
        r = post(client, "/v1/completions", huge)
        assert_refused(r, 400, "request_id", "at most 256 characters")
        r = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "request_id": "r" * 257}
        )
        assert_refused(r, 400, "request_id", "at most 256")
        r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "h" * 4000})
        assert_refused(r, 400, "X-Request-Id", "at most 256")
        assert time.monotonic() - t0 < 5.0
        r = client.post("/v1/completions", json={**body, "request_id": "r" * 256})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-" + "r" * 256


# ------------------------------------------------------------------------------ routes


def test_every_route_needs_the_key_with_all_routes(server: Server) -> None:
    score = {"text_1": "a", "text_2": "b"}
    with httpx.Client(base_url=server.url, timeout=10) as anon:
        got = {
            "/score": anon.post("/score", json=score).status_code,
            "/v1/score": anon.post("/v1/score", json=score).status_code,
            "/v1/completions": anon.post("/v1/completions", json={"prompt": "hi"}).status_code,
            "/tokenize": anon.post("/tokenize", json={"prompt": "hi"}).status_code,
            "/health": anon.get("/health").status_code,
            "/version": anon.get("/version").status_code,
            "/metrics": anon.get("/metrics").status_code,
            "/openapi.json": anon.get("/openapi.json").status_code,
        }
        assert got == dict.fromkeys(got, 401)
        assert anon.get("/health", headers=AUTH).status_code == 200


def test_a_refusal_before_the_body_says_the_connection_closes(server: Server) -> None:
    """The 401 goes out before the body is read; Hypercorn then drops the connection, so the
    answer says `Connection: close` and a keep-alive client opens a new one (CI once saw
    "Server disconnected without sending a response" on the request after a 401)."""
    with raw(server) as sock:
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        took, data = closed_within(sock, 5.0)
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 401") and b"\r\nconnection: close" in head, data[:300]


# ------------------------------------------------------------------------------ log lines


def test_log_lines_stay_bounded(server: Server, client: httpx.Client) -> None:
    before = len(server.log)
    bodies = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["x" * 1_000_000]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["y" * 1000] * 60}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "bad_words": ["z" * 100] * 10_000},
        ),
    ]
    cases = [(path, encoded(body)) for path, body in bodies]
    with watch(server.url, headers=AUTH):
        for path, body in cases:
            assert post(client, path, body).status_code in (200, 400)
    time.sleep(0.5)  # the reader thread takes the last lines
    lines = server.log[before:]
    assert any("Received request" in line for line in lines), lines[-5:]
    assert max(len(line) for line in lines) < 2000, max(lines, key=len)[:300]


# ------------------------------------------------------------------------------ slow clients


def test_a_silent_or_trickling_connection_is_closed_after_the_keep_alive_timeout(server: Server) -> None:
    with watch(server.url, headers=AUTH):
        with raw(server) as silent:
            took, _ = closed_within(silent, KEEP_ALIVE_S + 2)
            assert took >= KEEP_ALIVE_S - 0.3
        with raw(server) as trickle:
            trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            trickle.settimeout(0.3)
            while time.monotonic() - t0 < KEEP_ALIVE_S + 2:
                try:
                    trickle.sendall(b"X")  # one header byte every 0.3 s
                    if trickle.recv(1) == b"":
                        break
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
            took = time.monotonic() - t0
            assert took < KEEP_ALIVE_S + 1.5, f"still open after {took:.1f} s of trickled headers"


def _slow_body_request(server: Server, path: str = "/v1/completions") -> socket.socket:
    """Complete headers (with the key), then the first byte of a 1,000-byte body."""
    sock = raw(server)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{"
    )
    sock.sendall(head.encode())
    return sock


def test_a_body_sent_a_byte_at_a_time_gets_408_and_the_connection_closed(server: Server) -> None:
    with watch(server.url, headers=AUTH):
        with _slow_body_request(server) as sock:
            t0 = time.monotonic()
            sock.settimeout(0.5)
            data = b""
            while time.monotonic() - t0 < BODY_TIMEOUT_S + 3:
                try:
                    sock.sendall(b" ")
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                if not chunk:
                    break
                data += chunk
            took = time.monotonic() - t0
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"request-body-timeout" in data
        assert took < BODY_TIMEOUT_S + 2, took


def test_requests_beyond_the_concurrency_cap_get_503_and_health_answers(server: Server, client: httpx.Client) -> None:
    with watch(server.url, headers=AUTH) as w:
        held = [_slow_body_request(server, "/tokenize") for _ in range(LIMIT)]
        try:
            # Once the server has started all of them (on a loaded machine that took over 0.3 s),
            # a new request is refused; the held ones wait BODY_TIMEOUT_S for their bodies.
            deadline = time.monotonic() + BODY_TIMEOUT_S * 0.75
            while True:
                t0 = time.monotonic()
                r = client.post("/tokenize", json={"prompt": "hi"})
                if r.status_code != 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert_refused(r, 503, None, "--limit-concurrency")
            assert r.headers["retry-after"] == "1" and time.monotonic() - t0 < 1.0
            assert client.get("/health").status_code == 200
            assert client.get("/metrics").status_code == 200
            # The held ones end at their body timeout (408), and the slots are free again.
            for sock in held:
                _, data = closed_within(sock, BODY_TIMEOUT_S + 2)
                assert data.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")), data[:100]
        finally:
            for sock in held:
                sock.close()
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    assert w.chunks


def test_oversized_headers_are_refused(server: Server) -> None:
    # h11 checks its limit while the headers are incomplete: one read (64 KiB) may pass it.
    with raw(server) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we sent: refused as well
        _, data = closed_within(sock, 5)
        assert data == b"" or data.split(b" ", 2)[1] in (b"400", b"431"), data[:100]
    many = {f"X-H{i}": "v" for i in range(300)}
    r = httpx.get(f"{server.url}/health", headers={**many, **AUTH}, timeout=10)
    assert_refused(r, 431, None, "--h11-max-header-count")


# ------------------------------------------------------------------ what reaches the engine


def _completion(**fields: object) -> dict[str, object]:
    return {"prompt": "Once upon a time", "max_tokens": 4, **fields}


def test_values_the_wire_cannot_carry_are_400_and_the_server_lives(server: Server, client: httpx.Client) -> None:
    """Big integers inside a JSON schema used to pass the grammar check and then kill the
    transport's msgpack encode (every request aborted, the server gone)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 2**64 + 5}}}
    chat_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [10**30]}}}
    cases = [
        (
            "/v1/completions",
            encoded(_completion(structured_outputs={"json": schema})),
            "structured_outputs.json.properties.a.maximum",
        ),
        (
            "/v1/completions",
            encoded(_completion(structured_outputs={"json": {"default": -(2**63) - 1}})),
            "structured_outputs.json.default",
        ),
        (
            "/v1/chat/completions",
            encoded({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": chat_format}),
            "response_format.json.enum[0]",
        ),
    ]
    with watch(server.url, headers=AUTH):
        for path, body, where in cases:
            r = post(client, path, body)
            assert r.status_code == 400, r.text[:300]
            assert f"{where}: integers must be in [-2**63, 2**64)" in r.json()["error"]["message"]
    assert post(client, "/v1/completions", encoded(_completion())).status_code == 200


def test_fan_out_beyond_what_the_engine_holds_is_400_before_anything_is_built(
    server: Server, client: httpx.Client
) -> None:
    """1,024 prompts x n 128 = 131,072 sequences used to be built (and 429ed) on the event loop."""
    body = encoded(_completion(prompt=["Hello there"] * 1024, n=128))
    with watch(server.url, headers=AUTH):
        t0 = time.monotonic()
        r = post(client, "/v1/completions", body)
        assert_refused(r, 400, "n", "131072 sequences exceed", "max_num_seqs + max_num_queued_reqs")
        assert time.monotonic() - t0 < 2.0
    # Within the budget a body is served: 4 prompts x n 2.
    r = post(client, "/v1/completions", encoded(_completion(prompt=["a", "b", "c", "d"], n=2)))
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_priority_needs_the_priority_scheduling_policy(server: Server, client: httpx.Client) -> None:
    r = post(client, "/v1/completions", encoded(_completion(priority=-(2**62))))
    assert_refused(r, 400, "priority", "priority scheduling is not enabled")
    assert post(client, "/v1/completions", encoded(_completion(priority=0))).status_code == 200


def test_logprobs_never_exceed_the_vocabulary_even_without_a_limit(server: Server, client: httpx.Client) -> None:
    """`--max-logprobs -1` used to let `logprobs` past the vocabulary, failing the whole step."""
    for field in ("logprobs", "prompt_logprobs"):
        r = post(client, "/v1/completions", encoded(_completion(**{field: 10**6})))
        assert_refused(r, 400, field, "exceeds the vocabulary")
    r = post(client, "/v1/completions", encoded(_completion(logprobs=5)))
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 5


def test_new_grammars_and_a_deep_one_do_not_stall_other_streams(server: Server, client: httpx.Client) -> None:
    """Every grammar compiles off the engine step; a 6,000-rule chain used to overflow
    llguidance's stack (a segfault); now it is checked and compiled on big-stack threads."""
    regexes = [encoded(_completion(structured_outputs={"regex": f"(ab|c){{1,{k}}}d{k}"})) for k in range(1, 9)]
    chain = "\n".join(f"r{i}: r{i + 1}" for i in range(6000)) + '\nr6000: "x"\nstart: r0'
    deep = encoded(_completion(structured_outputs={"grammar": chain}))
    with watch(server.url, headers=AUTH):
        for body in regexes:
            r = post(client, "/v1/completions", body)
            assert r.status_code == 200, r.text[:300]
        r = post(client, "/v1/completions", deep)
        assert r.status_code in (200, 400), r.text[:300]
    assert server.proc.poll() is None
