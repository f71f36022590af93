"""`/v1/chat/completions` with `image_url` parts on a tiny LLaVA, through the official `openai`
client against the app in process: the tokens are transformers' for one and two images, and
hostile images (a 10,000 x 10,000 PNG, a truncated JPEG, fifty images, URLs the server does not
fetch) are 400s naming the part, answered in well under a second."""

from __future__ import annotations

import io
import struct
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vision_models import chatml, data_url, llava_reference, make_llava, random_image

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.anyio

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


def _huge_png() -> str:
    """A PNG whose header says 10,000 x 10,000 pixels (a few hundred bytes on the wire)."""
    buf = io.BytesIO()
    random_image(1, (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = struct.pack(">II", 10_000, 10_000) + bytes(data[24:29])
    data[16:33] = ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    import base64

    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


def _truncated_jpeg() -> str:
    url = data_url(random_image(2, (64, 64)), "JPEG")
    import base64

    payload = base64.b64decode(url.split(",", 1)[1])
    return "data:image/jpeg;base64," + base64.b64encode(payload[: len(payload) // 2]).decode()


HOSTILE = [
    (_parts("x", "HUGE"), "messages[0].content[1].image_url", "exceed the limit of"),
    (_parts("TRUNC", "x"), "messages[0].content[0].image_url", "could not be decoded"),
    (_parts(*["TINY"] * 50), "limit_mm_per_prompt", f"50 images exceed the limit of {LIMIT}"),
    (_parts("http://example.com/cat.png"), "messages[0].content[0].image_url", "not fetched"),
    (_parts("file:///etc/passwd"), "messages[0].content[0].image_url", "--allowed-local-media-path"),
    (_parts("data:image/png;base64,@@@"), "messages[0].content[0].image_url", "not valid base64"),
]


@pytest.mark.parametrize(("content", "param", "text"), HOSTILE)
async def test_hostile_images_are_quick_400s(http: httpx.AsyncClient, content: Any, param: str, text: str) -> None:
    urls = {"HUGE": _huge_png(), "TRUNC": _truncated_jpeg(), "TINY": data_url(random_image(3, (4, 4)))}
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
