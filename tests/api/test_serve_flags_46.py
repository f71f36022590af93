"""vLLM's serve flags that used to exit 2 (issue 46), each honoured: `--default-chat-template-kwargs`,
`--chat-template-content-format`, `--hf-overrides` (also `LLM(hf_overrides=...)`) and
`--enable-prompt-tokens-details` (usage.prompt_tokens_details.cached_tokens from the prefix cache).

In process through the ASGI app on the tiny model (asyncio and trio), and once through a real
`triollm serve` given every flag at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from acceptance.server import run_server

from triollm import LLM, SamplingParams
from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.cli import build_parser
from triollm.api.state import ServerSettings, ServerState

MODEL = "tiny"
# Shows the kwarg it is given and loops over a message's content: "openai" when detected.
KWARG_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }};{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}"
)
LOOP_TEMPLATE = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
LONG_PROMPT = " ".join(f"word{i}" for i in range(12))  # several KV blocks of 16 tokens


async def client_for(llm: AsyncLLM, **settings: Any) -> httpx.AsyncClient:
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,), **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://testserver")


async def tokenize(client: httpx.AsyncClient, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": False, **extra}
    r = await client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


@pytest.fixture
async def plain(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with await client_for(llm) as client:
        yield client


# ---------------------------------------------------------------- --default-chat-template-kwargs


@pytest.mark.anyio
async def test_default_chat_template_kwargs_merge_under_the_request(llm: AsyncLLM) -> None:
    tok = llm.get_tokenizer()
    hello = [{"role": "user", "content": "Hello"}]
    async with await client_for(llm, chat_template=KWARG_TEMPLATE) as bare:
        assert await tokenize(bare, hello) == tok.encode("Hello;", add_special_tokens=False)
    defaults = {"enable_thinking": False}
    async with await client_for(llm, chat_template=KWARG_TEMPLATE, default_chat_template_kwargs=defaults) as client:
        assert await tokenize(client, hello) == tok.encode("Hello;NOTHINK", add_special_tokens=False)
        # The request's own key wins over the server's default.
        ids = await tokenize(client, hello, chat_template_kwargs={"enable_thinking": True})
        assert ids == tok.encode("Hello;", add_special_tokens=False)
        # The chat route renders the same prompt.
        body = {"model": MODEL, "messages": hello, "max_tokens": 1, "add_generation_prompt": False}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("Hello;NOTHINK", add_special_tokens=False))
        # The Messages API's count_tokens and the Responses API render it the same way.
        count = {"model": MODEL, "messages": hello, "max_tokens": 1}
        r = await client.post("/v1/messages/count_tokens", json=count)
        assert r.status_code == 200, r.text
        with_prompt = tok.encode("Hello;NOTHINK", add_special_tokens=False)
        assert r.json()["input_tokens"] == len(with_prompt)  # (this template adds no generation prompt)
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == len(with_prompt)


# ---------------------------------------------------------------- --chat-template-content-format


@pytest.mark.anyio
async def test_content_parts_join_for_a_string_template(plain: httpx.AsyncClient, llm: AsyncLLM) -> None:
    """The tiny model's ChatML template adds `message['content']` to strings: "auto" gives it the
    parts joined (a list used to fail to render)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    assert await tokenize(plain, parts) == await tokenize(plain, joined)
    body = {"model": MODEL, "messages": parts, "max_tokens": 3, "temperature": 0}
    a = (await plain.post("/v1/chat/completions", json=body)).json()
    b = (await plain.post("/v1/chat/completions", json={**body, "messages": joined})).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"] == b["usage"]


@pytest.mark.anyio
async def test_openai_format_gives_a_looping_template_parts(llm: AsyncLLM) -> None:
    tok = llm.get_tokenizer()
    text = [{"role": "user", "content": "Hello"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    async with await client_for(llm, chat_template=LOOP_TEMPLATE, chat_template_content_format="openai") as client:
        # A plain string becomes one text part, as vLLM's "openai" format gives it.
        assert await tokenize(client, text) == tok.encode("[Hello]", add_special_tokens=False)
        assert await tokenize(client, parts) == tok.encode("[Hello]", add_special_tokens=False)
    async with await client_for(llm, chat_template=LOOP_TEMPLATE) as auto:  # detected: the parts stay a list
        assert await tokenize(auto, parts) == tok.encode("[Hello]", add_special_tokens=False)
    async with await client_for(llm, chat_template=KWARG_TEMPLATE, chat_template_content_format="string") as client:
        two = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        ids = await tokenize(client, [{"role": "user", "content": two}])
        assert ids == tok.encode("a\nb;", add_special_tokens=False)


def test_content_format_detection() -> None:
    from triollm.api.serving_common import content_format_of

    assert content_format_of(LOOP_TEMPLATE) == "openai"
    assert content_format_of(KWARG_TEMPLATE) == "string"
    via_variable = "{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}"
    assert content_format_of(via_variable) == "openai"
    assert content_format_of("{% for m in messages %}") == "string"  # does not parse


def test_bad_content_format_is_refused() -> None:
    with pytest.raises(ValueError, match="chat_template_content_format: 'xml' is not one of auto, string, openai"):
        ServerSettings(served_model_names=(MODEL,), chat_template_content_format="xml")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-content-format", "xml"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--default-chat-template-kwargs", "[1]"])


# ---------------------------------------------------------------- --enable-prompt-tokens-details


@pytest.mark.anyio
async def test_cached_tokens_in_usage(llm: AsyncLLM) -> None:
    async with await client_for(llm, enable_prompt_tokens_details=True) as client:
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}
        first = (await client.post("/v1/completions", json=body)).json()["usage"]
        second = (await client.post("/v1/completions", json=body)).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert 16 <= cached < second["prompt_tokens"] and cached % 16 == 0
        # The streamed final usage chunk carries it too, and chat reports it.
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=stream)
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2}
        await client.post("/v1/chat/completions", json=chat)
        usage = (await client.post("/v1/chat/completions", json=chat)).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
        streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/chat/completions", json=streamed)
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


@pytest.mark.anyio
async def test_no_details_without_the_flag(plain: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    usage = (await plain.post("/v1/completions", json=body)).json()["usage"]
    assert "prompt_tokens_details" not in usage


# ---------------------------------------------------------------- --hf-overrides


def test_llm_hf_overrides_reach_the_model(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), multiprocess=False) as llm:
        assert llm.llm_engine.async_llm.get_model_config().max_model_len == 512
        plain = llm.generate("The capital of France", params, use_tqdm=False)[0].outputs[0].token_ids
    overrides = {"max_position_embeddings": 40, "rope_theta": 3.0}
    with LLM(str(tiny_model_dir), multiprocess=False, hf_overrides=overrides) as llm:
        assert llm.llm_engine.async_llm.get_model_config().max_model_len == 40  # seen by the load-time checks
        changed = llm.generate("The capital of France", params, use_tqdm=False)[0].outputs[0].token_ids
    assert changed != plain  # the model runs with the overridden RoPE base
    with LLM(str(tiny_model_dir), multiprocess=True, hf_overrides=overrides) as llm:  # the engine core's child too
        assert llm.generate("The capital of France", params, use_tqdm=False)[0].outputs[0].token_ids == changed


def test_bad_hf_overrides_name_the_field(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="hf_overrides: expected a JSON object"):
        LLM(str(tiny_model_dir), hf_overrides=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hidden_act: 'bogus' is not supported"):
        LLM(str(tiny_model_dir), multiprocess=False, hf_overrides={"hidden_act": "bogus"})


# ---------------------------------------------------------------- a real `triollm serve`


def test_serve_takes_every_flag(tiny_model_dir: Path) -> None:
    flags = [
        "--max-model-len", "auto",
        "--hf-overrides", '{"max_position_embeddings": 200}',
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--chat-template-content-format", "string",
        "--enable-prompt-tokens-details",
        "--collect-detailed-traces", "all",
    ]  # fmt: skip
    with run_server(tiny_model_dir, *flags) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        [model] = client.get("/v1/models").json()["data"]
        assert model["max_model_len"] == 200
        parts = [{"role": "user", "content": [{"type": "text", "text": LONG_PROMPT}]}]
        body = {"model": model["id"], "messages": parts, "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
    assert any("--collect-detailed-traces" in line for line in server.log)
