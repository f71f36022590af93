"""The playground's images (api/playground.py, api/static/playground.js) without a browser: the
page says whether the served model takes images, the script's `userContent` builds the message
the page sends (run in Node where one is installed), and that exact request, on a first and a
later turn, is a 200 from the app on a tiny LLaVA. The page itself, attaching by the file
picker, a paste and a drop: tests/acceptance/test_browser_images.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vision_models import data_url, make_llava, random_image

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.playground import STATIC_DIR
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava-playground"), seed=3)


@pytest.fixture
async def llava_client(llava: Path) -> AsyncIterator[httpx.AsyncClient]:
    args = EngineArgs(model=str(llava), max_model_len=256, multiprocess=False)
    async with AsyncLLM.from_engine_args(args) as llm:
        transport = httpx.ASGITransport(app=build_app(ServerState(llm, ServerSettings(served_model_names=("llava",)))))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            yield client


def accepts_images(page: httpx.Response) -> str:
    [value] = re.findall(r'<html lang="en" data-accepts-images="(\w+)">', page.text)
    return value


async def test_the_page_says_whether_the_model_takes_images(
    client: httpx.AsyncClient, llava_client: httpx.AsyncClient
) -> None:
    """The tiny text model's page says "false", LLaVA's "true"; each page with its own ETag."""
    text_page, image_page = await client.get("/"), await llava_client.get("/")
    assert (accepts_images(text_page), accepts_images(image_page)) == ("false", "true")
    assert text_page.headers["etag"] != image_page.headers["etag"]
    again = await llava_client.get("/", headers={"If-None-Match": image_page.headers["etag"]})
    assert again.status_code == 304
    for control in ('id="attach"', 'id="image-file" type="file" accept="image/*"', 'id="attachments"'):
        assert control in image_page.text, control


def node_user_content(text: str, images: list[str]) -> Any:
    """The script's own `userContent(text, images)`, run in Node (skipped without one)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node: the script's userContent is run in the browser tests only")
    script = (STATIC_DIR / "playground.js").read_text()
    [function] = re.findall(r"^function userContent\(.*?^}$", script, flags=re.S | re.M)
    program = f"{function}\nprocess.stdout.write(JSON.stringify(userContent(...JSON.parse(process.argv[1]))));"
    out = subprocess.run([node, "-e", program, json.dumps([text, images])], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_user_content_builds_image_url_parts() -> None:
    one, two = "data:image/png;base64,AAAA", "data:image/jpeg;base64,BBBB"
    assert node_user_content("hello", []) == "hello"
    assert node_user_content("What is this?", [one, two]) == [
        {"type": "image_url", "image_url": {"url": one}},
        {"type": "image_url", "image_url": {"url": two}},
        {"type": "text", "text": "What is this?"},
    ]
    assert node_user_content("  ", [one]) == [{"type": "image_url", "image_url": {"url": one}}]  # an image alone


async def test_the_playgrounds_request_is_a_200_on_a_vision_model(llava_client: httpx.AsyncClient) -> None:
    """The JSON the page sends (as send() builds it) with an image and text, then the next turn
    with the image part kept in the history: both 200s, the image counted in each prompt."""
    image = data_url(random_image(5, (40, 30)))
    first_user = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]
    if shutil.which("node"):  # as the script builds it
        assert node_user_content("What is this?", [image]) == first_user
    history: list[dict[str, Any]] = [{"role": "user", "content": first_user}]
    usage = []
    for turn in range(2):
        body = {
            "model": "llava",
            "messages": [{"role": "system", "content": "Be brief."}, *history],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 4,
        }
        async with llava_client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        usage.append(chunks[-1]["usage"]["prompt_tokens"])
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and {turn}?"}]
    assert usage[0] > 16  # LLaVA's 16 image features
    assert usage[1] > usage[0]
    # The later turn's prompt holds the image's 16 features: without the image part it is shorter.
    history[0]["content"] = "What is this?"
    body["messages"] = [{"role": "system", "content": "Be brief."}, *history[:-2]]
    body["stream"] = False
    del body["stream_options"]
    r = await llava_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= usage[1] - 16
