"""What one client may cost the server, over HTTP (in process, on asyncio and trio): a full engine
queue is a 429 with `Retry-After`, over-deep JSON a 400, oversized bodies a 413 read no further
than the limit, too many prompts a 400 naming the setting."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from asgi_scope import asgi_post
from test_app import CHAT, GREEDY, MAX_MODEL_LEN, MODEL, assert_error, open_client, post, sse

from triollm.actors.async_llm import AsyncLLM
from triollm.actors.errors import EngineBusyError
from triollm.actors.request_stream import OutputMerger, RequestStream, merge_output
from triollm.api import serving_common
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs
from triollm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from triollm.engine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.anyio

GENERATION = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, **GREEDY}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **GREEDY}),
]


def assert_busy(r: httpx.Response, retry_after: str) -> None:
    error = assert_error(r, 429, "queue is full", param=None)
    assert error["type"] == "RateLimitError"
    assert r.headers["retry-after"] == retry_after
    assert r.headers["content-type"].startswith("application/json")


# ------------------------------------------------------------------------------- 429 (busy)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", GENERATION, ids=["completions", "chat"])
async def test_engine_busy_is_429_with_retry_after(
    client: httpx.AsyncClient,
    llm: AsyncLLM,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, Any],
    stream: bool,
) -> None:
    """A fake engine refusal (the real queue limit is below): 429 before any SSE header."""

    async def busy(*args: object, **kwargs: object) -> None:
        raise EngineBusyError("the engine's queue is full (max_num_queued_reqs=1)", retry_after_s=2.5)

    with monkeypatch.context() as m:
        m.setattr(llm, "add_request", busy)
        assert_busy(await post(client, path, {**body, "stream": stream}), "3")
    r = await post(client, path, {**body, "stream": stream})
    assert r.status_code == 200, r.text


async def test_engine_busy_on_a_later_prompt_aborts_the_earlier_ones(
    client: httpx.AsyncClient, llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = llm.add_request
    calls = 0

    async def second_busy(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise EngineBusyError("the engine's queue is full", retry_after_s=0.01)
        return await real(*args, **kwargs)

    monkeypatch.setattr(llm, "add_request", second_busy)
    body = {"prompt": ["a", "b", "c"], "max_tokens": 50, "stream": True, **GREEDY}
    assert_busy(await post(client, "/v1/completions", body), "1")
    with anyio.fail_after(10):
        await llm.wait_idle()
    assert llm.num_unfinished_requests == 0


@pytest.fixture
async def small_queue_llm(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    args = EngineArgs(
        model=str(tiny_model_dir),
        max_model_len=MAX_MODEL_LEN,
        multiprocess=False,
        max_num_seqs=2,
        max_num_queued_reqs=2,
    )
    async with AsyncLLM.from_engine_args(args) as engine:
        yield engine


async def test_real_queue_limit_is_429(small_queue_llm: AsyncLLM) -> None:
    """max_num_seqs=2 + max_num_queued_reqs=2: with generation paused ("keep": requests stay
    queued), four requests are held and the fifth is refused; after resume all four finish."""
    llm = small_queue_llm
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,)))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **GREEDY}
    async with open_client(state) as client:
        await llm.pause_generation(mode="keep")
        held: list[httpx.Response] = []

        async def send(stream: bool) -> None:
            held.append(await post(client, "/v1/completions", {**body, "stream": stream}))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(send, i % 2 == 1)
                while llm.num_unfinished_requests < 4:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                for stream in (False, True):
                    r = await post(client, "/v1/completions", {**body, "stream": stream})
                    assert r.status_code == 429, r.text
                    error = r.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == 429 and error["type"] == "RateLimitError"
                    assert "max_num_queued_reqs" in error["message"]
                    assert int(r.headers["retry-after"]) >= 1
                await llm.resume_generation()
        assert [r.status_code for r in held] == [200] * 4
        for r in held:
            if r.headers["content-type"].startswith("text/event-stream"):
                sse(r)
            else:
                assert r.json()["usage"]["completion_tokens"] == 3


# -------------------------------------------------------------------- malformed and large bodies


def nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
)
async def test_deeply_nested_json_is_400(client: httpx.AsyncClient, path: str) -> None:
    r = await post(client, path, nested(50_000))
    assert_error(r, 400, "Invalid JSON body", "nested too deeply")
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {}}
    deep = json.dumps(body).encode().replace(b"{}", b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert_error(await post(client, "/v1/chat/completions", deep), 400, "nested too deeply")


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_small_body_limit_on_tokenize(
    client: httpx.AsyncClient, state: ServerState, path: str
) -> None:
    limit = serving_common.SMALL_BODY_BYTES
    assert limit < serving_common.MAX_BODY_BYTES
    # Declared too large: refused before reading.
    r = await post(client, path, b" " * (limit + 1))
    assert_error(r, 413, "too large", str(limit))
    # Streamed without a length (a 60 MiB body): refused once past the limit, the rest unread.
    chunk = b" " * 65536
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        return {"type": "http.request", "body": chunk, "more_body": received < 960}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(10):
        await build_app(state)(asgi_post(path), receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == 413
    assert received <= limit // len(chunk) + 1
    # Just under the limit is read (and tokenized) as usual.
    prompt = {"prompt": "hi", "pad": " " * (limit - 100)} if path == "/tokenize" else None
    if prompt is not None:
        assert (await post(client, path, prompt)).status_code == 200


async def test_generation_keeps_the_large_limit(client: httpx.AsyncClient) -> None:
    prompt = "hi" + " " * (2 * serving_common.SMALL_BODY_BYTES)
    r = await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert_error(r, 400, "max_model_len")  # read and tokenized: too long a prompt, not too large a body


# ------------------------------------------------------------------------- prompts per request


@pytest.fixture
async def few_prompts_llm(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    args = EngineArgs(
        model=str(tiny_model_dir),
        max_model_len=MAX_MODEL_LEN,
        multiprocess=False,
        max_prompts_per_request=2,
    )
    async with AsyncLLM.from_engine_args(args) as engine:
        yield engine


async def test_too_many_prompts_is_400_before_tokenizing(
    few_prompts_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = few_prompts_llm
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,)))
    added = 0
    real = llm.add_request

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal added
        added += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(llm, "add_request", counting)
    async with open_client(state) as client:
        for prompt in (["a", "b", "c"], [[1, 2], [3], [4]]):
            for stream in (False, True):
                r = await post(client, "/v1/completions", {"prompt": prompt, "stream": stream})
                assert_error(r, 400, "max_prompts_per_request (2)", "3 prompts", param="prompt")
        assert added == 0
        # At the limit, and one token-id list (one prompt however long): served.
        for prompt in (["a", "b"], [1, 2, 3, 4]):
            r = await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **GREEDY})
            assert r.status_code == 200, r.text


async def test_large_bodies_are_decoded_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[bool] = []
    real, real_pieces = serving_common.decode_request, serving_common.decode_in_pieces

    def recording(body: bytes, type_: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(body, type_)

    def recording_pieces(body: bytes, type_: Any) -> Any:  # a large body: in short pieces (json_pieces.py)
        threads.append(threading.current_thread() is threading.main_thread())
        return real_pieces(body, type_)

    monkeypatch.setattr(serving_common, "decode_request", recording)
    monkeypatch.setattr(serving_common, "decode_in_pieces", recording_pieces)
    big = ["word " * 20] * (serving_common.LARGE_BODY // 100)
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, **GREEDY}),
        ("/v1/completions", {"prompt": big, "max_tokens": 1, "stop": ["x"]}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "bad_words": big}),
    ]:
        await post(client, path, body)
    assert threads == [True, False, False]


# ------------------------------------------------------------------ a consumer that stops reading


class CountingStr(str):
    """Counts the characters that `+` / `+=` copy (and stays a CountingStr)."""

    copied = 0

    def __add__(self, other: str) -> CountingStr:
        CountingStr.copied += len(self) + len(other)
        return CountingStr(str.__add__(self, other))


class CountingList(list[Any]):
    """Counts the elements copied out of it by iteration (`[*a, *b]`, `a + b`, `extend(a)`)."""

    copied = 0

    def __iter__(self) -> Any:
        CountingList.copied += len(self)
        return super().__iter__()

    def __add__(self, other: Any) -> CountingList:
        CountingList.copied += len(self) + len(other)
        return CountingList(list.__add__(self, other))


def one_token(i: int, *, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1],
        prompt_logprobs=CountingList([None]),
        outputs=[
            CompletionOutput(0, CountingStr("x"), CountingList([i]), -1.0, CountingList([{i: Logprob(-1.0)}]))
        ],
        finished=finished,
    )


async def test_an_unread_stream_merges_in_linear_work() -> None:
    """20,000 one-token DELTA outputs put into a stream nobody reads, then read once: the
    characters and elements copied stay within a small multiple of n (they were ~n²/2)."""
    n = 20_000
    CountingStr.copied = CountingList.copied = 0
    stream = RequestStream("r", RequestOutputKind.DELTA, lambda s: None)
    for i in range(n):
        stream.put(one_token(i, finished=i == n - 1))
    merged = stream.get_nowait()
    assert merged is not None and merged.finished
    [c] = merged.outputs
    assert c.text == "x" * n and c.token_ids == list(range(n))
    assert c.logprobs is not None and len(c.logprobs) == n
    assert merged.prompt_logprobs is not None and len(merged.prompt_logprobs) == n
    assert CountingStr.copied <= 4 * n, CountingStr.copied
    assert CountingList.copied <= 8 * n, CountingList.copied


async def test_merge_output_pairs_and_merger_agree() -> None:
    """`merge_output` (one merge) and `OutputMerger` (many) apply the same rule."""
    a = one_token(1)
    merge_output(a, one_token(2, finished=True), RequestOutputKind.DELTA)
    merger = OutputMerger(RequestOutputKind.DELTA)
    merger.add(one_token(1))
    merger.add(one_token(2, finished=True))
    b = merger.take()
    assert b is not None and merger.take() is None
    for o in (a, b):
        assert (o.outputs[0].text, o.outputs[0].token_ids, o.finished) == ("xx", [1, 2], True)
        assert o.prompt_logprobs == [None, None]
