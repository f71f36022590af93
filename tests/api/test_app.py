"""The OpenAI-compatible routes, in process: httpx's ASGI transport in front of `build_app` over
an `AsyncLLM` on the tiny random model (in-process core), on asyncio and trio.

httpx's ASGI transport returns a whole body, so SSE tests check the event sequence, not its
timing; disconnects are driven through a hand-written ASGI receive() instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import schemathesis
from asgi_scope import asgi_post

from triollm.actors.async_llm import AsyncLLM
from triollm.api import serving_common
from triollm.api.app import build_app
from triollm.api.serving_completions import CompletionFormatter
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs
from triollm.engine.execution.scripted_runner import fault_at_step

pytestmark = pytest.mark.anyio

MODEL = "tiny"  # as in conftest.py
MAX_MODEL_LEN = 256

GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]


# ------------------------------------------------------------------------------------ helpers


@asynccontextmanager
async def open_client(state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


async def post(client: httpx.AsyncClient, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return await client.post(
            path, content=body, headers={"content-type": "application/json"}, **kw
        )
    if isinstance(body, dict) and path.startswith("/v1/"):
        body = {"model": MODEL, **body}
    return await client.post(path, json=body, **kw)


async def ok(client: httpx.AsyncClient, path: str, body: Any) -> dict[str, Any]:
    r = await post(client, path, body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return dict(r.json())


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, checking the framing and that [DONE] comes last, once."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    events = []
    for block in blocks[:-2]:
        assert block.startswith("data: ") and "[DONE]" not in block
        events.append(json.loads(block[len("data: ") :]))
    return events


def assert_error(
    r: httpx.Response, status: int, *fragments: str, param: Any = ...
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["type"], str)
    for fragment in fragments:
        assert fragment in error["message"], error
    if param is not ...:
        assert error["param"] == param, error
    return dict(error)


async def assert_still_serving(client: httpx.AsyncClient) -> None:
    out = await ok(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, **GREEDY})
    assert out["usage"]["completion_tokens"] == 2


def finish_chunks(events: list[dict[str, Any]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for e in events:
        for c in e["choices"]:
            if c["finish_reason"] is not None:
                counts[c["index"]] = counts.get(c["index"], 0) + 1
    return counts


def streamed_text(events: list[dict[str, Any]], key: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            piece = c["text"] if key == "text" else c["delta"].get("content") or ""
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


# ---------------------------------------------------------------------------- completions


async def test_completion_shape_and_usage(client: httpx.AsyncClient) -> None:
    out = await ok(client, "/v1/completions", {"prompt": "Hello world", "max_tokens": 5, **GREEDY})
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert isinstance(out["created"], int) and out["model"] == MODEL
    [choice] = out["choices"]
    assert choice.keys() >= {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    count = (await ok(client, "/tokenize", {"prompt": "Hello world"}))["count"]
    assert out["usage"] == {
        "prompt_tokens": count,
        "completion_tokens": 5,
        "total_tokens": count + 5,
    }


@pytest.mark.parametrize(
    "prompt, n_prompts",
    [("Hello", 1), (["Hello", "The capital"], 2), ([5, 6, 7], 1), ([[5, 6], [7, 8, 9], [10]], 3)],
    ids=["str", "list-of-str", "token-ids", "list-of-token-ids"],
)
async def test_completion_prompt_forms(
    client: httpx.AsyncClient, prompt: Any, n_prompts: int
) -> None:
    out = await ok(client, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "n": 2, **GREEDY})
    assert [c["index"] for c in out["choices"]] == list(range(2 * n_prompts))
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompt_tokens = [(await ok(client, "/tokenize", {"prompt": t}))["count"] for t in texts]
    else:
        prompt_tokens = [len(prompt)] if isinstance(prompt[0], int) else [len(p) for p in prompt]
    # Each prompt counted once however large n; each choice's tokens counted.
    assert out["usage"] == {
        "prompt_tokens": sum(prompt_tokens),
        "completion_tokens": 3 * 2 * n_prompts,
        "total_tokens": sum(prompt_tokens) + 6 * n_prompts,
    }
    # Greedy: both samples of a prompt agree; index = prompt index * n + sample index.
    for p in range(n_prompts):
        assert out["choices"][2 * p]["text"] == out["choices"][2 * p + 1]["text"]


async def test_completion_prompt_order_matches_single_requests(client: httpx.AsyncClient) -> None:
    prompts = ["Once upon a time", "def add(a, b):"]
    batch = await ok(client, "/v1/completions", {"prompt": prompts, "max_tokens": 6, **GREEDY})
    for i, p in enumerate(prompts):
        single = await ok(client, "/v1/completions", {"prompt": p, "max_tokens": 6, **GREEDY})
        assert batch["choices"][i]["text"] == single["choices"][0]["text"]


async def test_completion_echo(client: httpx.AsyncClient) -> None:
    plain = await ok(client, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, **GREEDY})
    echoed = await ok(
        client, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "echo": True, **GREEDY}
    )
    assert echoed["choices"][0]["text"] == "Hello" + plain["choices"][0]["text"]
    ids = (await ok(client, "/tokenize", {"prompt": "Hello"}))["tokens"]
    by_ids = await ok(
        client, "/v1/completions", {"prompt": ids, "max_tokens": 4, "echo": True, **GREEDY}
    )
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]


@pytest.mark.parametrize("k", [0, 5])
async def test_completion_logprobs_shape(client: httpx.AsyncClient, k: int) -> None:
    out = await ok(
        client, "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "logprobs": k, **GREEDY}
    )
    lp = out["choices"][0]["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert isinstance(logprob, float) and logprob <= 0
        # The sampled token plus the top k (it is one of them when greedy): k or k + 1 entries,
        # fewer when several tokens decode to the same string (partial UTF-8 bytes -> "\ufffd").
        assert 1 <= len(top) <= k + 1
        if k == 0:
            assert top == {token: logprob}
        elif "\ufffd" not in top:
            assert len(top) >= k and top[token] == logprob == max(top.values())


async def test_completion_echo_with_logprobs(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Hello world", "max_tokens": 3, "logprobs": 2, "echo": True, **GREEDY}
    out = await ok(client, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    n_prompt = out["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][:n_prompt]) == "Hello world"


async def test_completion_streaming(client: httpx.AsyncClient) -> None:
    body = {"prompt": ["Hello", "Once upon"], "n": 2, "max_tokens": 5, **GREEDY}
    full = await ok(client, "/v1/completions", body)
    r = await post(
        client,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse(r)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    for e in chunks:
        assert e["object"] == "text_completion" and e["id"] == chunks[0]["id"] and "usage" not in e
        assert len(e["choices"]) == 1
    assert finish_chunks(chunks) == {i: 1 for i in range(4)}
    assert streamed_text(chunks, "text") == {c["index"]: c["text"] for c in full["choices"]}


async def test_completion_streaming_continuous_usage(client: httpx.AsyncClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "stream_options": options, **GREEDY}
    *chunks, last = sse(await post(client, "/v1/completions", body))
    assert all("usage" in e for e in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4 == last["usage"]["completion_tokens"]


async def test_completion_streaming_echo_logprobs(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Hello world", "max_tokens": 3, "logprobs": 1, "echo": True, **GREEDY}
    full = (await ok(client, "/v1/completions", body))["choices"][0]
    events = sse(await post(client, "/v1/completions", {**body, "stream": True}))
    assert streamed_text(events, "text")[0] == full["text"]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == full["logprobs"]["tokens"] and offsets == full["logprobs"]["text_offset"]


# ---------------------------------------------------------------------------------- chat


async def test_chat_shape(client: httpx.AsyncClient) -> None:
    out = await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **GREEDY})
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    [choice] = out["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    count = (await ok(client, "/tokenize", {"messages": CHAT}))["count"]
    assert out["usage"] == {
        "prompt_tokens": count,
        "completion_tokens": 4,
        "total_tokens": count + 4,
    }
    # max_completion_tokens wins over max_tokens; text parts render like a string.
    parts = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
    ]
    other = await ok(
        client,
        "/v1/chat/completions",
        {"messages": parts, "max_tokens": 9, "max_completion_tokens": 4, **GREEDY},
    )
    assert other["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_chat_streaming(client: httpx.AsyncClient) -> None:
    body = {"messages": CHAT, "n": 2, "max_tokens": 6, **GREEDY}
    full = await ok(client, "/v1/chat/completions", body)
    r = await post(
        client,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse(r)
    roles, rest = events[:2], events[2:-1]
    assert sorted(e["choices"][0]["index"] for e in roles) == [0, 1]
    for e in roles:
        assert e["object"] == "chat.completion.chunk"
        assert e["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert e["choices"][0]["finish_reason"] is None
    assert all("role" not in c["delta"] for e in rest for c in e["choices"])
    assert finish_chunks(rest) == {0: 1, 1: 1}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert streamed_text(rest, "chat") == {
        c["index"]: c["message"]["content"] for c in full["choices"]
    }


async def test_chat_logprobs(client: httpx.AsyncClient) -> None:
    body = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3, **GREEDY}
    out = await ok(client, "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted(
            (t["logprob"] for t in top), reverse=True
        )
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
    streamed = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    tokens = [
        t["token"]
        for e in streamed
        for c in e["choices"]
        if c["logprobs"]
        for t in c["logprobs"]["content"]
    ]
    assert tokens == [e["token"] for e in content]


async def test_chat_roles(llm: AsyncLLM) -> None:
    settings = ServerSettings(served_model_names=(MODEL,), response_role="bot")
    async with open_client(ServerState(llm, settings)) as client:
        out = await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
        assert out["choices"][0]["message"]["role"] == "bot"
        msgs = [*CHAT, {"role": "assistant", "content": "Blue"}]
        body = {
            "messages": msgs,
            "max_tokens": 2,
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
        out = await ok(client, "/v1/chat/completions", body)
        assert out["choices"][0]["message"]["role"] == "assistant"


# -------------------------------------------------------------------------------- errors


COMPLETION_ERRORS: list[tuple[str, Any, tuple[str, ...], str | None]] = [
    ("malformed-json", b'{"prompt": ', ("JSON",), None),
    ("not-an-object", [1, 2], ("Expected `object`",), None),
    ("missing-prompt", {"max_tokens": 3}, ("`prompt`",), "prompt"),
    ("wrong-type", {"prompt": "hi", "max_tokens": "x"}, ("$.max_tokens",), "max_tokens"),
    ("temperature", {"prompt": "hi", "temperature": -1}, ("temperature",), "temperature"),
    ("top-p", {"prompt": "hi", "top_p": 1.5}, ("top_p",), "top_p"),
    ("n-zero", {"prompt": "hi", "n": 0}, ("$.n",), "n"),
    ("max-tokens-zero", {"prompt": "hi", "max_tokens": 0}, ("max_tokens",), "max_tokens"),
    ("empty-prompt", {"prompt": ""}, ("empty",), "prompt"),
    ("empty-prompt-list", {"prompt": []}, ("empty",), "prompt"),
    ("empty-token-list", {"prompt": [[]]}, ("empty",), "prompt"),
    ("mixed-prompt-list", {"prompt": ["a", 1]}, ("not a mix",), "prompt"),
    ("too-long", {"prompt": [5] * MAX_MODEL_LEN}, ("max_model_len (256)",), "prompt"),
    ("too-long-stream", {"prompt": "x " * 400, "stream": True}, ("max_model_len (256)",), "prompt"),
    ("oov-token", {"prompt": [1, 10**6]}, ("vocab_size",), "prompt_token_ids"),
    ("negative-token", {"prompt": [-1]}, ("vocab_size",), "prompt_token_ids"),
    ("logprobs-limit", {"prompt": "hi", "logprobs": 21}, ("max_logprobs (20)",), "logprobs"),
    (
        "prompt-logprobs-limit",
        {"prompt": "hi", "prompt_logprobs": 21},
        ("max_logprobs (20)",),
        "prompt_logprobs",
    ),
    (
        "stream-options",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        ("stream=True",),
        "stream_options",
    ),
    (
        "logit-bias-oov",
        {"prompt": "hi", "logit_bias": {"999999": 5}},
        ("logit_bias",),
        "logit_bias",
    ),
    ("logit-bias-key", {"prompt": "hi", "logit_bias": {"abc": 5}}, ("logit_bias",), "logit_bias"),
    (
        "stop-token-oov",
        {"prompt": "hi", "stop_token_ids": [10**6]},
        ("stop_token_ids",),
        "stop_token_ids",
    ),
    ("seed-range", {"prompt": "hi", "seed": 2**64}, ("$.seed",), "seed"),
    ("suffix", {"prompt": "hi", "suffix": "!"}, ("suffix",), "suffix"),
]


@pytest.mark.parametrize(
    "body, fragments, param",
    [c[1:] for c in COMPLETION_ERRORS],
    ids=[c[0] for c in COMPLETION_ERRORS],
)
async def test_completion_errors(
    client: httpx.AsyncClient, body: Any, fragments: tuple[str, ...], param: str | None
) -> None:
    assert_error(await post(client, "/v1/completions", body), 400, *fragments, param=param)
    await assert_still_serving(client)


CHAT_ERRORS: list[tuple[str, dict[str, Any], tuple[str, ...], str | None]] = [
    ("no-messages", {"messages": []}, ("$.messages",), "messages"),
    ("missing-role", {"messages": [{"content": "x"}]}, ("`role`",), "messages[0]"),
    (
        "image-part",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        ("image_url parts need a vision-language model", "LlamaForCausalLM is text-only"),
        "messages[0].content[0]",
    ),
    ("top-logprobs-alone", {"messages": CHAT, "top_logprobs": 2}, ("logprobs",), "top_logprobs"),
    (
        "top-logprobs-limit",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        ("max_logprobs (20)",),
        "top_logprobs",
    ),
    (
        "response-format-type",
        {"messages": CHAT, "response_format": {"type": "yaml"}},
        ("json_object", "json_schema", "yaml"),
        "response_format",
    ),
    ("tools", {"messages": CHAT, "tools": [{"type": "function"}]}, ("tool",), "tools"),
    (
        "template-kwargs",
        {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
        ("messages",),
        "chat_template_kwargs",
    ),
    (
        "continue-and-generation-prompt",
        {"messages": CHAT, "continue_final_message": True},
        ("add_generation_prompt",),
        "continue_final_message",
    ),
    (
        "too-long",
        {"messages": [{"role": "user", "content": "x " * 400}]},
        ("max_model_len (256)",),
        "prompt",
    ),
    ("temperature", {"messages": CHAT, "temperature": "hot"}, ("$.temperature",), "temperature"),
    (
        "stream-options",
        {"messages": CHAT, "stream_options": {}},
        ("stream=True",),
        "stream_options",
    ),
]


@pytest.mark.parametrize(
    "body, fragments, param", [c[1:] for c in CHAT_ERRORS], ids=[c[0] for c in CHAT_ERRORS]
)
async def test_chat_errors(
    client: httpx.AsyncClient, body: dict[str, Any], fragments: tuple[str, ...], param: str | None
) -> None:
    assert_error(await post(client, "/v1/chat/completions", body), 400, *fragments, param=param)
    await assert_still_serving(client)


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ]:
        r = await client.post(path, json={**body, "model": "gpt-4"})
        assert assert_error(r, 404, "`gpt-4`", param="model")["type"] == "NotFoundError"
    out = await ok(
        client, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "model": "tiny-alias"}
    )
    assert out["model"] == "tiny-alias"
    assert_error(await client.get("/v1/nothing"), 404)


async def test_unknown_fields_ignored_and_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="triollm.api"):
        out = await ok(
            client, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "zap": {}}
        )
    assert out["usage"]["completion_tokens"] == 2
    [record] = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert "frobnicate" in record.getMessage() and "zap" in record.getMessage()


async def test_body_too_large(client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_common, "MAX_BODY_BYTES", 1000)
    assert_error(await post(client, "/v1/completions", {"prompt": "x" * 2000}), 413, "too large")
    await assert_still_serving(client)


async def test_unexpected_error_is_500(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("formatter bug")

    with monkeypatch.context() as m:
        m.setattr(CompletionFormatter, "final", boom)
        assert_error(
            await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            500,
            "RuntimeError",
        )
    with monkeypatch.context() as m:
        m.setattr(CompletionFormatter, "stream_output", boom)
        events = sse(
            await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True})
        )
        assert (
            events[-1]["error"]["code"] == 500
        )  # after the stream started: an error event, then [DONE]
    await assert_still_serving(client)


async def test_not_accepting_is_503(client: httpx.AsyncClient, state: ServerState) -> None:
    state.accepting = False
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ]:
        error = assert_error(await post(client, path, body), 503, "shutting down")
        assert error["type"] == "ServiceUnavailableError"
    assert (await client.get("/v1/models")).status_code == 200
    state.accepting = True
    await assert_still_serving(client)


async def test_dead_engine_is_503(tiny_model_dir: Path) -> None:
    args = EngineArgs(
        model=str(tiny_model_dir),
        max_model_len=MAX_MODEL_LEN,
        multiprocess=False,
    )
    async with AsyncLLM.from_engine_args(args, engine_core_factory=fault_at_step(1)) as llm:
        async with open_client(
            ServerState(llm, ServerSettings(served_model_names=(MODEL,)))
        ) as client:
            for stream in (False, True):
                r = await post(client, "/v1/completions", {"prompt": "hi", "stream": stream})
                assert_error(r, 503, "engine is dead")
            assert_error(await client.get("/health"), 503)


# ------------------------------------------------------------------------ auth and other routes


async def test_api_key(llm: AsyncLLM) -> None:
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,), api_key="s3cret"))
    async with open_client(state) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = await client.get("/v1/models", headers=headers)
            assert_error(r, 401, "API key")
            r = await post(client, "/v1/completions", {"prompt": "hi"}, headers=headers)
            assert_error(r, 401)
        good = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        r = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers=good)
        assert r.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/version")).status_code == 200
        assert (await post(client, "/tokenize", {"prompt": "hi"})).status_code == 200


async def test_cors(llm: AsyncLLM) -> None:
    origin = "http://ui.example"
    settings = ServerSettings(served_model_names=(MODEL,), api_key="k", allowed_origins=(origin,))
    async with open_client(ServerState(llm, settings)) as client:
        preflight = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        r = await client.options("/v1/chat/completions", headers=preflight)  # no key needed
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = await client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


async def test_models_health_version(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, "tiny-alias"]
    for m in models["data"]:
        assert m["object"] == "model" and m["owned_by"] == "triollm"
        assert m["max_model_len"] == MAX_MODEL_LEN and isinstance(m["created"], int)
    health = await client.get("/health")
    assert health.status_code == 200 and health.content == b""
    import triollm

    assert (await client.get("/version")).json() == {"version": triollm.__version__}


async def test_tokenize_detokenize(client: httpx.AsyncClient) -> None:
    out = await ok(client, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 0
    assert out["max_model_len"] == MAX_MODEL_LEN
    assert (await ok(client, "/detokenize", {"tokens": out["tokens"]}))["prompt"] == "Hello world"
    chat = await ok(client, "/tokenize", {"messages": CHAT})
    assert chat["token_strs"] is None
    text = (await ok(client, "/detokenize", {"tokens": chat["tokens"]}))["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "Name a color." in text
    no_prompt = await ok(client, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert no_prompt["count"] < chat["count"]
    assert_error(
        await post(client, "/detokenize", {"tokens": [10**6]}), 400, "tokens", param="tokens"
    )
    assert_error(await post(client, "/tokenize", {"prompt": "x", "model": "nope"}), 404)


async def test_openapi(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/version",
        "/tokenize",
        "/detokenize",
    ):
        assert path in doc["paths"]
    assert "CompletionRequest" in doc["components"]["schemas"]
    schema = schemathesis.openapi.from_dict(doc)
    operations = [op.ok().label for op in schema.get_all_operations()]
    assert "POST /v1/chat/completions" in operations


async def test_openapi_documents_every_route(llm: AsyncLLM) -> None:
    """Every API route the app serves, with its methods, is an operation of /openapi.json (so
    /docs lists it), the runtime LoRA routes included when they exist; the browser pages are
    not API operations."""
    from starlette.routing import Route

    from triollm.api.playground import page_paths

    settings = ServerSettings(served_model_names=(MODEL,), allow_runtime_lora_updating=True)
    state = ServerState(llm, settings)
    app = build_app(state)
    async with open_client(state) as client:
        doc = (await client.get("/openapi.json")).json()
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route) and route.methods is not None
        for method in route.methods - {"HEAD"}
    }
    pages = set(page_paths(playground=True, docs=True))
    assert pages and pages <= {p for p, _ in served}
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    missing = {(p, m) for p, m in served if p not in pages} - documented
    assert not missing, missing
    assert documented <= served  # and nothing documented that is not served
    assert ("/v1/load_lora_adapter", "post") in documented and ("/v1/responses/{response_id}", "delete") in documented
    schemathesis.openapi.from_dict(doc)  # a valid document


async def test_metrics_route_and_timer(llm: AsyncLLM) -> None:
    from triollm.api.metrics import Metrics

    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,)))
    state.metrics = Metrics(state, fresh_stats=False)
    body = {"prompt": ["Hello", "Once"], "n": 2, "max_tokens": 5, "logprobs": 1, **GREEDY}
    async with open_client(ServerState(llm, state.settings)) as plain:
        expected = await ok(plain, "/v1/completions", body)
    async with open_client(state) as client:
        # With a timer, non-streaming runs on DELTA outputs merged here: the same response.
        out = await ok(client, "/v1/completions", body)
        for a, b in zip(out["choices"], expected["choices"]):
            assert (a["text"], a["logprobs"]) == (b["text"], b["logprobs"])
        assert out["usage"] == expected["usage"]
        sse(await post(client, "/v1/completions", {**body, "stream": True}))
        text = (await client.get("/metrics")).text
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"} 2.0' in text
    assert 'vllm:generation_tokens_total{model_name="tiny"} 40.0' in text


# ------------------------------------------------------------------------- disconnects


async def _drive(
    app: Any, body: dict[str, Any], disconnect: anyio.Event, *, on_body: bool
) -> list[dict[str, Any]]:
    """Run one request through the ASGI app with a receive() that reports a disconnect when
    `disconnect` is set (set on the first streamed body chunk when `on_body`)."""
    pending = [
        {
            "type": "http.request",
            "body": json.dumps({"model": MODEL, **body}).encode(),
            "more_body": False,
        }
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if on_body and message["type"] == "http.response.body":
            disconnect.set()

    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    scope = asgi_post(path)
    with anyio.fail_after(10):
        await app(scope, receive, send)
    return sent


async def _engine_idle(llm: AsyncLLM) -> None:
    with anyio.fail_after(5):
        while True:
            stats = await llm.get_engine_stats()
            if (
                llm.num_unfinished_requests == 0
                and stats.num_running == 0
                and stats.num_waiting == 0
            ):
                return
            await anyio.sleep(0.005)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_disconnect_aborts(state: ServerState, stream: bool) -> None:
    llm = state.llm
    app = build_app(state)
    body = {"prompt": ["Hello", "Once upon"], "n": 2, "max_tokens": 200, "stream": stream, **GREEDY}
    disconnect = anyio.Event()
    async with anyio.create_task_group() as tg:
        if not stream:

            async def hang_up() -> None:  # once the engine has the requests
                while llm.num_unfinished_requests < 2:  # noqa: ASYNC110 (no event to wait on)
                    await anyio.sleep(0.001)
                disconnect.set()

            tg.start_soon(hang_up)
        sent = await _drive(app, body, disconnect, on_body=stream)
    assert llm.num_unfinished_requests == 0
    assert not any(m["type"] == "http.response.body" and not m.get("more_body") for m in sent)
    if stream:
        events = b"".join(m["body"] for m in sent if m["type"] == "http.response.body")
        assert events.count(b'"finish_reason":"length"') == 0
    await _engine_idle(llm)
    async with open_client(state) as client:
        await assert_still_serving(client)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_a_client_that_hangs_up_after_the_last_byte_is_no_disconnect(
    state: ServerState, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Hypercorn delivers `http.disconnect` while the last body message is still being sent (the
    # client read it and closed); that is a finished response, not an aborted request.
    app = build_app(state)
    body = {"prompt": "Hello", "max_tokens": 4, "stream": stream, **GREEDY}
    disconnect = anyio.Event()
    received = [{"type": "http.request", "body": json.dumps({"model": MODEL, **body}).encode(), "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if received:
            return received.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            disconnect.set()
            await anyio.sleep(0.01)  # the watcher runs before this send returns

    with caplog.at_level("INFO", logger="triollm.api"), anyio.fail_after(10):
        await app(asgi_post("/v1/completions"), receive, send)
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    assert not [r for r in caplog.records if "client disconnected" in r.getMessage()]
