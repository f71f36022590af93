"""The Responses store and large bodies, as a hostile client would use them, through the real
app (tiny model, in process, asyncio and trio): two API keys never see each other's stored
responses (404 as for an unknown id, on GET, DELETE and `previous_response_id`); the store
counts what it holds (tracemalloc over entries full of the small JSON values a response echoes)
and stays under its cap; echoed client JSON is bounded at decoding; /health answers while a
large chat or Responses body is decoded and converted."""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api import json_pieces
from triollm.api.app import build_app
from triollm.api.json_pieces import decode_in_pieces
from triollm.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, decode_request
from triollm.api.protocol_responses import FunctionTool, ResponseObject, ResponsesRequest
from triollm.api.serving_responses import ENTRY_BYTES, ResponseStore
from triollm.api.state import ServerSettings, ServerState

pytestmark = pytest.mark.anyio
MODEL = "tiny"
KEYS = ("key-a", "key-b")


@pytest.fixture
async def keyed(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(ServerState(llm, ServerSettings(served_model_names=(MODEL,), api_key=KEYS)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


def as_key(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_another_key_sees_none_of_a_keys_responses(keyed: httpx.AsyncClient) -> None:
    a, b = as_key(KEYS[0]), as_key(KEYS[1])
    first = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    created = await keyed.post("/v1/responses", json=first, headers=a)
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    unknown = "resp_" + "0" * 32

    def hidden(response: httpx.Response, probe: httpx.Response) -> None:
        """A 404 that reads as the one for an id nobody made."""
        assert response.status_code == probe.status_code == 404, response.text
        assert response.text.replace(rid, unknown) == probe.text

    hidden(await keyed.get(f"/v1/responses/{rid}", headers=b), await keyed.get(f"/v1/responses/{unknown}", headers=b))
    hidden(
        await keyed.delete(f"/v1/responses/{rid}", headers=b),
        await keyed.delete(f"/v1/responses/{unknown}", headers=b),
    )
    hidden(
        await keyed.post("/v1/responses", json={**first, "previous_response_id": rid}, headers=b),
        await keyed.post("/v1/responses", json={**first, "previous_response_id": unknown}, headers=b),
    )
    # The owner still has it, whole, and continues it; B's delete deleted nothing.
    got = await keyed.get(f"/v1/responses/{rid}", headers=a)
    assert got.status_code == 200 and got.json() == created.json()
    followup = await keyed.post("/v1/responses", json={**first, "previous_response_id": rid}, headers=a)
    assert followup.status_code == 200, followup.text
    assert followup.json()["usage"]["input_tokens"] > created.json()["usage"]["input_tokens"]
    # B's own responses are B's: A cannot read them either.
    mine = (await keyed.post("/v1/responses", json=first, headers=b)).json()["id"]
    assert (await keyed.get(f"/v1/responses/{mine}", headers=b)).status_code == 200
    assert (await keyed.get(f"/v1/responses/{mine}", headers=a)).status_code == 404
    assert (await keyed.delete(f"/v1/responses/{rid}", headers=a)).status_code == 200
    assert (await keyed.get(f"/v1/responses/{rid}", headers=a)).status_code == 404


def small_values(n: int) -> dict[str, Any]:
    """JSON of small values, as a client can send it in `text`, tool parameters or tool calls:
    each value a Python object many times its encoded size."""
    return {f"p{i}": [0, {}, [], ""] for i in range(n)}


def echoing(i: int) -> tuple[ResponseObject, list[ChatMessage]]:
    response = ResponseObject(
        id=f"resp_{i}",
        created_at=0,
        status="completed",
        model="m",
        metadata={f"k{j}": "v" for j in range(500)},
        text={"format": {"type": "json_schema", "schema": small_values(500)}},
        tools=[FunctionTool(name="f", parameters=small_values(500))],
    )
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "extra": small_values(500)}
    return response, [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", tool_calls=[call])]


def test_the_store_holds_what_it_counts_and_stays_under_its_cap() -> None:
    cap = 2 * 1024 * 1024
    store = ResponseStore(max_bytes=cap)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(150):  # ~80 KB each as JSON: about twice the cap in all
            response, conversation = echoing(i)
            store.put(response, conversation, owner="key")
            del response, conversation
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    store.check_integrity()  # the count is the sum of the entries' bytes, and each is bytes only
    stats = store.statistics()
    assert 0 < stats.responses < 150 and cap / 2 < stats.bytes <= cap
    entries = [store.get(f"resp_{i}", "key") for i in range(150)]
    assert stats.bytes == sum(ENTRY_BYTES + len(e.response) + len(e.conversation) for e in entries if e is not None)
    assert 0.9 * stats.bytes <= held <= 1.05 * stats.bytes, (held, stats)  # it holds what it counts
    # A response comes back as it was stored; another owner's id is not there.
    kept = next(e for e in entries if e is not None)
    assert msgspec.json.decode(kept.response, type=ResponseObject).tools[0].parameters == small_values(500)
    assert store.get(msgspec.json.decode(kept.response, type=ResponseObject).id, "other") is None


async def test_echoed_client_json_is_bounded(client: httpx.AsyncClient) -> None:
    base = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    junk = {"effort": "low", "junk": [small_values(200)]}
    r = await client.post("/v1/responses", json={**base, "reasoning": junk, "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    assert r.json()["reasoning"] == {"effort": "low", "summary": None, "generate_summary": None}
    stored = await client.get(f"/v1/responses/{r.json()['id']}")
    assert stored.json()["reasoning"] == r.json()["reasoning"] and stored.json()["metadata"] == {"k": "v"}
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        bad = await client.post("/v1/responses", json={**base, "metadata": metadata})
        assert bad.status_code == 400 and "`$.metadata" in bad.json()["error"]["message"], bad.text


def large_bodies() -> dict[str, bytes]:
    """~11 MB each, of thousands of items full of small values: a second of decoding at once."""
    junk = [[0] * 10 for _ in range(60)]
    items = [{"role": "user", "content": "hi", "junk": junk}] * 8000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "junk": junk}
    messages = [{"role": "assistant", "content": "hi", "tool_calls": [call]}] * 8000
    return {
        "/v1/responses": msgspec.json.encode({"model": MODEL, "input": items, "max_output_tokens": 1}),
        "/v1/chat/completions": msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 1}),
    }


async def test_health_answers_while_a_large_body_is_decoded(client: httpx.AsyncClient) -> None:
    for path, body in large_bodies().items():
        assert len(body) > 10_000_000
        health: list[float] = []
        gaps: list[float] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, client, health, gaps)
            await anyio.sleep(0.02)
            start = time.perf_counter()
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            took = time.perf_counter() - start
            tg.cancel_scope.cancel()
        assert r.status_code == 400 and "max_model_len" in r.text, r.text[:300]  # too long a prompt, nothing worse
        # Decoded whole, the loop stopped for most of the request (the GIL held by msgspec);
        # in pieces, for short moments only (the longest a garbage collection).
        assert health and max(health) < 1.0, (path, health, took)
        assert max(gaps) < took / 3, (path, max(gaps), took)


async def watch(client: httpx.AsyncClient, health: list[float], gaps: list[float]) -> None:
    """/health's answer times, and how late the loop wakes from a 5 ms sleep, until cancelled."""
    while True:
        start = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        health.append(time.perf_counter() - start)
        start = time.perf_counter()
        await anyio.sleep(0.005)
        gaps.append(time.perf_counter() - start)


def test_decoding_in_pieces_reads_as_decoding_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_pieces, "PIECE_BYTES", 8)  # every list of objects goes in pieces
    user = {"role": "user", "content": "hi"}
    cases: list[tuple[Any, type[Any]]] = [
        ({"messages": [user] * 3, "temperature": 1, "unknown": [1]}, ChatCompletionRequest),
        ({"messages": [user, {"content": "x"}]}, ChatCompletionRequest),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, ChatCompletionRequest),
        ({"messages": [user] * 9000}, ChatCompletionRequest),
        ({"messages": []}, ChatCompletionRequest),
        ({"messages": [1, 2]}, ChatCompletionRequest),
        ({"messages": [user], "n": 0}, ChatCompletionRequest),
        ({"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}] * 3}, ChatCompletionRequest),
        ({"model": "x"}, ChatCompletionRequest),
        ([1], ChatCompletionRequest),
        ({"prompt": [[1, 2, 3]] * 10, "max_tokens": 3}, CompletionRequest),
        ({"input": [user] * 4, "metadata": {"a": "b"}, "reasoning": {"effort": "low"}}, ResponsesRequest),
        ({"input": [user, 3]}, ResponsesRequest),
        ({"input": [user] * 9000}, ResponsesRequest),
    ]
    bodies = [(msgspec.json.encode(value), type_) for value, type_ in cases]
    bodies.append((b'{"messages": [{"role": "user"}]', ChatCompletionRequest))  # truncated
    for body, type_ in bodies:
        assert outcome(decode_in_pieces, body, type_) == outcome(decode_request, body, type_), body[:80]


def outcome(decode: Any, body: bytes, type_: type[Any]) -> Any:
    try:
        return decode(body, type_)
    except msgspec.MsgspecError as exc:
        return type(exc), str(exc)
