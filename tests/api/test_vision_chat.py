"""`/v1/chat/completions` with `image_url` parts on a tiny LLaVA, through the official `openai`
client against the app in process: the tokens are transformers' for one and two images, and
hostile images (a 10,000 x 10,000 PNG, a truncated JPEG, fifty images, URLs the server does not
fetch) are 400s naming the part, answered in well under a second. http(s) image URLs are fetched
from a server on 127.0.0.1 in the test: an image gives the tokens its data URL gives; a 404, a
stall (a short VLLM_IMAGE_FETCH_TIMEOUT) and a body over the byte limit are 400s naming the part.
A tiny Gemma 3 gives transformers' tokens for one and two images too."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from vision_models import (
    chatml,
    data_url,
    gemma3_reference,
    huge_png_url,
    llava_reference,
    make_gemma3_vlm,
    make_llava,
    random_image,
    truncated_jpeg_url,
)

from triollm.actors.async_llm import AsyncLLM
from triollm.api import chat_images
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

openai = pytest.importorskip("openai")
# httpx and httpcore leave their body generators to the garbage collector when a read stops early
# (a cut-off body, a cancelled stall: the fetch limits), and trio's finalizer warns about it
# whenever that is (a later test, maybe): not a leak (the connection is closed); only that
# warning is ignored.
HTTPCORE_GENERATOR = (
    "ignore:Exception ignored in. <async_generator object "
    "(Response|BoundAsyncStream|AsyncResponseStream|PoolByteStream|HTTP11ConnectionByteStream|AsyncHTTP11Connection)[.]"
    ":pytest.PytestUnraisableExceptionWarning"
)
pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings(HTTPCORE_GENERATOR)]

LIMIT = 3


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava-api"), seed=3)


@pytest.fixture(scope="module")
async def http(llava: Path, anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    args = EngineArgs(model=str(llava), max_model_len=256, multiprocess=False, limit_mm_per_prompt={"image": LIMIT})
    async with AsyncLLM.from_engine_args(args) as llm:
        app = build_app(ServerState(llm, ServerSettings(served_model_names=("llava",))))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            yield c


def _parts(*items: str) -> list[dict[str, Any]]:
    """Content parts: a string that looks like a URL (or a HOSTILE key) is an image part."""
    return [
        {"type": "image_url", "image_url": {"url": item}} if _is_image(item) else {"type": "text", "text": item}
        for item in items
    ]


def _is_image(item: str) -> bool:
    return item in ("HUGE", "TRUNC", "TINY") or item.split(":", 1)[0] in ("data", "http", "https", "file")


async def test_image_parts_give_transformers_tokens(http: httpx.AsyncClient, llava: Path) -> None:
    client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    one, two = random_image(21, (40, 30)), random_image(22, (25, 50))
    cases = [
        (_parts("What is", data_url(one)), "What is\n<image>", [one]),
        (_parts(data_url(one), "and", data_url(two), "count"), "<image>\nand\n<image>\ncount", [one, two]),
    ]
    for content, rendered, images in cases:
        response = await client.chat.completions.create(
            model="llava",
            messages=[{"role": "user", "content": content}],
            max_tokens=16,
            temperature=0.0,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        tokens = [int(t.token.removeprefix("token_id:")) for t in response.choices[0].logprobs.content]
        assert tokens == llava_reference(llava, chatml(rendered), images)
        assert response.usage.prompt_tokens > 16 * len(images)  # the placeholders expanded


HOSTILE = [
    (_parts("x", "HUGE"), "messages[0].content[1].image_url", "exceed the limit of"),
    (_parts("TRUNC", "x"), "messages[0].content[0].image_url", "could not be decoded"),
    (_parts(*["TINY"] * 50), "limit_mm_per_prompt", f"50 images exceed the limit of {LIMIT}"),
    (_parts("file:///etc/passwd"), "messages[0].content[0].image_url", "--allowed-local-media-path"),
    (_parts("data:image/png;base64,@@@"), "messages[0].content[0].image_url", "not valid base64"),
]


@pytest.mark.parametrize(("content", "param", "text"), HOSTILE)
async def test_hostile_images_are_quick_400s(http: httpx.AsyncClient, content: Any, param: str, text: str) -> None:
    urls = {"HUGE": huge_png_url(), "TRUNC": truncated_jpeg_url(), "TINY": data_url(random_image(3, (4, 4)))}
    for part in content:
        if part["type"] == "image_url":
            part["image_url"]["url"] = urls.get(part["image_url"]["url"], part["image_url"]["url"])
    body = {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    start = time.monotonic()
    response = await http.post("/v1/chat/completions", json=body)
    assert time.monotonic() - start < 1.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error


async def test_image_parts_on_a_text_model_are_refused(client: httpx.AsyncClient) -> None:
    content = _parts("x", data_url(random_image(3, (4, 4))))
    response = await client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": content}]}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "LlamaForCausalLM is text-only" in error["message"]


# ------------------------------------------------------------------------------ http(s) URLs

Route = Callable[[anyio.abc.ByteStream], Awaitable[None]]


@asynccontextmanager
async def loopback_server(routes: dict[str, Route]) -> AsyncIterator[str]:
    """A bare HTTP/1.1 server on 127.0.0.1 answering each path with its route; its base URL."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def handle(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += await stream.receive()
                await routes[head.split(b" ", 2)[1].decode()](stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError):
                pass  # the client gave up: what the limits are for

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _serve(status: str, body: bytes, **headers: str) -> Route:
    async def route(stream: anyio.abc.ByteStream) -> None:
        lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        await stream.send(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    return route


async def _stall(stream: anyio.abc.ByteStream) -> None:
    """Headers and a few bytes of a 1000-byte body, then nothing."""
    await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"\x89PNG" * 2)
    await anyio.sleep_forever()


async def _endless(stream: anyio.abc.ByteStream) -> None:
    """A body with no length that never ends."""
    await stream.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    while True:
        await stream.send(b"\0" * 4096)


IMAGE = random_image(23, (36, 44))


async def test_http_image_urls_are_fetched(http: httpx.AsyncClient, llava: Path) -> None:
    """An http URL on the loopback gives the tokens its data URL gives (transformers')."""
    client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    routes = {"/cat.png": _serve("200 OK", _png(IMAGE), Content_Type="image/png")}
    async with loopback_server(routes) as base:
        response = await client.chat.completions.create(
            model="llava",
            messages=[{"role": "user", "content": _parts("What is", f"{base}/cat.png")}],
            max_tokens=16,
            temperature=0.0,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
    tokens = [int(t.token.removeprefix("token_id:")) for t in response.choices[0].logprobs.content]
    assert tokens == llava_reference(llava, chatml("What is\n<image>"), [IMAGE])


FETCH_FAILURES = [
    ("/missing.png", "gave HTTP 404"),
    ("/stall.png", "took longer than 0.3 s (VLLM_IMAGE_FETCH_TIMEOUT)"),
    ("/big.png", "is 5000 bytes, over the limit of 2000"),
    ("/endless.png", "sent more than the limit of 2000 bytes"),
]


@pytest.mark.parametrize(("path", "text"), FETCH_FAILURES)
async def test_http_image_fetch_failures_are_400s(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, path: str, text: str
) -> None:
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.3")
    monkeypatch.setattr(chat_images, "MAX_FETCH_BYTES", 2000)
    routes: dict[str, Route] = {
        "/missing.png": _serve("404 Not Found", b"no"),
        "/stall.png": _stall,
        "/big.png": _serve("200 OK", b"\0" * 5000),
        "/endless.png": _endless,
    }
    async with loopback_server(routes) as base:
        body = {"model": "llava", "messages": [{"role": "user", "content": _parts("x", base + path)}], "max_tokens": 2}
        start = time.monotonic()
        response = await http.post("/v1/chat/completions", json=body)
        assert time.monotonic() - start < 1.5
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url" and text in error["message"], error


async def test_http_urls_past_the_image_limit_are_not_fetched(http: httpx.AsyncClient) -> None:
    """Refused for the count before any URL is fetched (the server would stall every one)."""
    async with loopback_server({"/stall.png": _stall}) as base:
        content = _parts(*[f"{base}/stall.png"] * (LIMIT + 1))
        body = {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        start = time.monotonic()
        response = await http.post("/v1/chat/completions", json=body)
        assert time.monotonic() - start < 1.0
    assert response.status_code == 400 and response.json()["error"]["param"] == "limit_mm_per_prompt"


# ---------------------------------------------------------------------------------- Gemma 3


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma3_vlm(tmp_path_factory.mktemp("gemma3-api"), seed=5)


async def test_gemma3_image_parts_give_transformers_tokens(gemma3: Path, anyio_backend: str) -> None:
    args = EngineArgs(model=str(gemma3), max_model_len=160, multiprocess=False, max_num_batched_tokens=8)
    one, two = random_image(24, (40, 30)), random_image(25, (25, 50))
    cases = [
        (_parts("What is", data_url(one)), "What is\n<start_of_image>", [one]),
        (
            _parts(data_url(one), "and", data_url(two), "count"),
            "<start_of_image>\nand\n<start_of_image>\ncount",
            [one, two],
        ),
    ]
    async with AsyncLLM.from_engine_args(args) as llm:
        app = build_app(ServerState(llm, ServerSettings(served_model_names=("gemma3",))))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
            for content, rendered, images in cases:
                response = await client.chat.completions.create(
                    model="gemma3",
                    messages=[{"role": "user", "content": content}],
                    max_tokens=16,
                    temperature=0.0,
                    logprobs=True,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                )
                tokens = [int(t.token.removeprefix("token_id:")) for t in response.choices[0].logprobs.content]
                assert tokens == gemma3_reference(gemma3, chatml(rendered), images)
