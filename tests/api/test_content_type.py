"""A POST body that is not declared JSON gets vLLM's answer: 400 with an OpenAI error body."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.anyio

MESSAGE = "Unsupported Media Type: Only 'application/json' is allowed"
BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain"},
        {"content-type": "application/x-www-form-urlencoded"},  # what `curl -d` sends
        {"content-type": "application/jsonx"},
        {},  # no Content-Type at all
    ],
)
async def test_non_json_content_type_is_a_400(
    client: httpx.AsyncClient, path: str, headers: dict[str, str]
) -> None:
    body = json.dumps(BODIES[path]).encode()
    r = await client.post(path, content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {
        "error": {"message": MESSAGE, "type": "BadRequestError", "param": None, "code": 400}
    }


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
async def test_json_with_parameters_is_accepted(client: httpx.AsyncClient, content_type: str) -> None:
    for path, body in BODIES.items():
        r = await client.post(path, content=json.dumps(body).encode(), headers={"content-type": content_type})
        assert r.status_code == 200, (path, r.text)


async def test_get_routes_need_no_content_type(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/models")).status_code == 200
    assert (await client.get("/health")).status_code == 200
