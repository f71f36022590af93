"""What one request may cost the HTTP layer (issue 22): chats sized by every field they carry and
rendered off the event loop when large, prompt lists walked off it, client ids capped, log lines
bounded, and the ASGI limits (api/limits.py): a body deadline, a concurrency cap that leaves
/health alone, a header count. The real server's side of it: tests/acceptance/test_hostile_api.py.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import anyio
import httpx
import pytest
from asgi_scope import asgi_post
from test_app import GREEDY, assert_error, post

from triollm.api import serving_completions
from triollm.api.limits import RequestLimits
from triollm.api.log_bounds import LOG_VALUE_CHARS, short_repr, shorten
from triollm.api.protocol import ChatMessage, ContentPart
from triollm.api.serving_common import MAX_REQUEST_ID_LEN, chat_size, items_size
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------------------ pure functions


def test_short_repr_is_bounded_and_never_builds_the_whole_repr() -> None:
    params = SamplingParams(
        max_tokens=3, stop=["x" * 1_000_000], logit_bias={i: 1.0 for i in range(200_000)}
    )
    text = short_repr(params)
    assert len(text) < LOG_VALUE_CHARS + 40 and text.endswith("… (1000000 chars)")
    assert text.startswith("SamplingParams(stop=['xxx")
    # Defaults are left out, so an ordinary request's params fit whole.
    assert short_repr(SamplingParams(max_tokens=3, temperature=0.5)) == "SamplingParams(temperature=0.5, max_tokens=3)"
    many = short_repr(SamplingParams(max_tokens=1, logit_bias={i: 0.0 for i in range(100_000)}))
    assert len(many) < LOG_VALUE_CHARS + 40 and many.endswith("… (100000 items)")
    assert short_repr({"a": [1, (2,)], "b": b"x"}) == "{'a': [1, (2,)], 'b': b'x'}"
    deep: list[Any] = []
    for _ in range(5_000):
        deep = [deep]
    assert len(short_repr(deep, 50)) <= 50 + 12  # one marker, not one per level
    assert len(short_repr("\x00" * 1_000, 30)) < 60  # escapes cannot blow the budget
    assert shorten("abc", 3) == "abc" and shorten("abcd", 3) == "abc… (4 chars)"


def test_chat_size_counts_every_field_and_stops_early() -> None:
    one = chat_size([ChatMessage(role="user", content="hi")])
    assert one == chat_size([ChatMessage(role="user", content="hi")], None) - 16
    # Fifty thousand one-letter messages weigh what they cost, not fifty thousand characters.
    many = [ChatMessage(role="user", content="a")] * 50_000
    assert chat_size(many) > 32 * 50_000
    assert 8192 < chat_size(many, stop_above=8192) < 8192 + 100  # O(limit), however many
    parts = [ChatMessage(role="user", content=[ContentPart(text="a")] * 1000)]
    assert chat_size(parts) > 16 * 1000
    named = [ChatMessage(role="user", content="hi", name="n" * 3_000_000)]
    assert chat_size(named) > 3_000_000
    calls = [ChatMessage(role="assistant", tool_calls=[{"function": {"arguments": "x" * 10_000}}])]
    assert chat_size(calls) > 10_000
    huge_list: list[Any] = [[]] * 1_000_000
    assert chat_size([ChatMessage(role="user")], {"k": huge_list}, stop_above=8192) < 9000
    wide = {str(i): i for i in range(100_000)}
    assert chat_size([ChatMessage(role="user")], wide, stop_above=8192) < 9000
    assert items_size(["a" * 10_000]) == 10_001 and items_size([1] * 20_000) == 20_000
    assert items_size([[1] * 5_000] * 1_000) < 20_000  # stops once past the threshold


# ------------------------------------------------------------------------------ through the app


async def test_large_chats_render_off_the_loop_whatever_field_makes_them_large(
    client: httpx.AsyncClient, state: ServerState, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = state.llm.get_tokenizer()
    on_loop: list[bool] = []
    real = tokenizer.render_chat

    def recording(*args: Any, **kwargs: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "render_chat", recording)
    cases = [
        {"messages": HI},  # small: on the loop
        {"messages": [{"role": "user", "content": "hi", "name": "n" * 100_000}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1_000}]},
        {"messages": [{"role": "user", "content": "a"}] * 1_000},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x" * 20_000}]}, *HI]},
        {"messages": HI, "chat_template_kwargs": {"notes": "k" * 20_000}},
    ]
    for body in cases:
        for path in ("/v1/chat/completions", "/tokenize"):
            await post(client, path, {**body, "max_tokens": 1, **GREEDY} if path != "/tokenize" else body)
    assert on_loop == [True, True] + [False] * 10


async def test_prompt_lists_are_walked_off_the_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: list[bool] = []
    real = serving_completions.normalize_prompts

    def recording(prompt: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(prompt)

    monkeypatch.setattr(serving_completions, "normalize_prompts", recording)
    for prompt in ([1, 2, 3], [1] * 100_000):
        await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert on_loop == [True, False]


async def test_client_ids_are_capped(client: httpx.AsyncClient) -> None:
    ok_id = "r" * MAX_REQUEST_ID_LEN
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, **GREEDY}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, **GREEDY}),
    ]:
        r = await post(client, path, {**body, "request_id": ok_id + "r"})
        assert_error(r, 400, f"at most {MAX_REQUEST_ID_LEN} characters", "got 257", param="request_id")
        r = await post(client, path, body, headers={"X-Request-Id": "h" * 1_000})
        assert_error(r, 400, f"at most {MAX_REQUEST_ID_LEN}", param="X-Request-Id")
        r = await post(client, path, {**body, "request_id": ok_id})
        assert r.status_code == 200 and r.json()["id"].endswith(ok_id)
    r = await post(client, "/v1/completions", {"model": "m" * 1_000_000, "prompt": "hi"})
    assert_error(r, 404, "does not exist", param="model")
    assert len(r.content) < 1_000  # the unknown name is not echoed whole


async def test_request_log_lines_are_bounded(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    bodies = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["x" * 1_000_000]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1.0 for i in range(100_000)}}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "bad_words": ["z" * 100] * 10_000}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "request_id": "i" * MAX_REQUEST_ID_LEN}),
    ]
    with caplog.at_level(logging.INFO, logger="triollm.api"):
        for path, body in bodies:
            await post(client, path, body)
    received = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    assert len(received) == len(bodies)
    assert max(len(m) for m in caplog.messages) < 2 * LOG_VALUE_CHARS, max(caplog.messages, key=len)[:200]


# ------------------------------------------------------------------------------ the ASGI limits


def _app(release: anyio.Event, entered: list[str]) -> Any:
    """An endpoint that reads its whole body, then waits for `release`, then answers 200."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        entered.append(scope["path"])
        from triollm.api.openai_errors import APIError

        try:
            while (await receive()).get("more_body"):
                pass
        except APIError as exc:
            await exc.response()(scope, receive, send)
            return
        if scope["path"] != "/health":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def _call(app: Any, path: str, receive: Any = None, headers: int = 0) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    scope = asgi_post(path)
    scope["headers"] = scope["headers"] + [(f"x-{i}".encode(), b"v") for i in range(headers)]

    async def once() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive or once, send)
    return sent


async def test_a_trickled_body_gets_408_at_its_deadline_and_a_read_body_waits_freely() -> None:
    release = anyio.Event()
    release.set()
    app = RequestLimits(_app(release, []), limit_concurrency=None, max_header_count=100, body_timeout=0.3)
    sent_chunks = 0

    async def trickle() -> dict[str, Any]:
        nonlocal sent_chunks
        await anyio.sleep(0.1)
        sent_chunks += 1
        return {"type": "http.request", "body": b" ", "more_body": True}

    with anyio.fail_after(5):
        t0 = anyio.current_time()
        sent = await _call(app, "/v1/completions", trickle)
        took = anyio.current_time() - t0
    assert sent[0]["status"] == 408 and 0.25 < took < 1.0 and sent_chunks <= 4
    assert b"--request-body-timeout" in sent[1]["body"]

    # Once the body is complete, receive() is not timed (a stream's disconnect watch).
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def then_wait() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await anyio.sleep(0.5)
        return {"type": "http.disconnect"}

    async def watcher(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        assert (await receive())["type"] == "http.disconnect"  # 0.5 s later: past the deadline
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = RequestLimits(watcher, limit_concurrency=None, max_header_count=100, body_timeout=0.3)
    with anyio.fail_after(5):
        assert (await _call(app, "/v1/completions", then_wait))[0]["status"] == 204


async def test_the_concurrency_cap_refuses_with_503_and_leaves_health_alone() -> None:
    release = anyio.Event()
    entered: list[str] = []
    app = RequestLimits(_app(release, entered), limit_concurrency=2, max_header_count=100, body_timeout=10)
    results: list[int] = []

    async def one(path: str) -> None:
        results.append((await _call(app, path))[0]["status"])

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "/v1/completions")
            tg.start_soon(one, "/tokenize")
            await anyio.wait_all_tasks_blocked()
            sent = await _call(app, "/v1/chat/completions")
            assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
            assert b"--limit-concurrency" in sent[1]["body"]
            assert (await _call(app, "/health"))[0]["status"] == 200
            assert app.in_flight == 2
            release.set()
        assert results == [200, 200] and app.in_flight == 0
        assert (await _call(app, "/v1/chat/completions"))[0]["status"] == 200
    assert "/v1/chat/completions" in entered


async def test_too_many_headers_are_431() -> None:
    release = anyio.Event()
    release.set()
    app = RequestLimits(_app(release, []), limit_concurrency=None, max_header_count=10, body_timeout=10)
    assert (await _call(app, "/health", headers=8))[0]["status"] == 200
    sent = await _call(app, "/health", headers=9)
    assert sent[0]["status"] == 431
    assert json.loads(sent[1]["body"])["error"]["code"] == 431


def test_settings_are_validated() -> None:
    for field, value in [
        ("limit_concurrency", 0), ("h11_max_header_count", 0),
        ("request_body_timeout", 0.0), ("request_body_timeout", float("inf")),
    ]:
        with pytest.raises(ValueError, match=field):
            ServerSettings(served_model_names=("m",), **{field: value})
    assert ServerSettings(served_model_names=("m",), limit_concurrency=None).limit_concurrency is None


def _declared(path: str, length: int) -> dict[str, Any]:
    scope = asgi_post(path)
    scope["headers"] = [*scope["headers"], (b"content-length", str(length).encode())]
    return scope


async def _answer_unread(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An endpoint that answers (as the API-key check does) without reading the body."""
    await send({"type": "http.response.start", "status": 401, "headers": [(b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize("read_first", [False, True], ids=["unread", "read"])
async def test_an_answer_before_the_body_closes_the_connection(read_first: bool) -> None:
    """Hypercorn drops a connection whose request body was still arriving when the response
    ended; the response must say so (`Connection: close`), or a keep-alive client sends its next
    request into the closed connection (CI: "Server disconnected without sending a response")."""

    async def endpoint(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if read_first:
            while (await receive()).get("more_body"):
                pass
        await _answer_unread(scope, receive, send)

    app = RequestLimits(endpoint, limit_concurrency=None, max_header_count=100, body_timeout=10)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(_declared("/v1/score", 2), receive, send)
    closes = (b"connection", b"close") in sent[0]["headers"]
    assert closes == (not read_first) and (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    # No body declared (a GET): nothing to leave unread, the connection stays open.
    sent.clear()
    await app(asgi_post("/v1/models"), receive, send)
    assert (b"connection", b"close") not in sent[0]["headers"]


async def test_refusals_of_the_limits_close_a_connection_with_a_body_coming() -> None:
    release = anyio.Event()
    app = RequestLimits(_app(release, []), limit_concurrency=0, max_header_count=100, body_timeout=10)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def never() -> dict[str, Any]:
        raise AssertionError("the refusal reads no body")

    await app(_declared("/v1/completions", 100), never, send)
    assert sent[0]["status"] == 503 and (b"connection", b"close") in sent[0]["headers"]
