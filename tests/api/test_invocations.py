"""The SageMaker / Vertex container contract vLLM serves: `/ping` answers as /health, and
`/invocations` takes any request body and answers as that body's own route (in process, on
asyncio and trio, on the tiny generative model and the bundled embedding model)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_app import CHAT, GREEDY, assert_error, sse

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.serving_invocations import invocation_route
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio


async def test_ping_answers_as_health(client: httpx.AsyncClient) -> None:
    assert (await client.get("/ping")).status_code == 200
    assert (await client.post("/ping")).status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **GREEDY}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, **GREEDY}),
    ],
    ids=["chat", "completions"],
)
async def test_invocations_answer_as_the_bodys_own_route(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    direct = await client.post(path, json=body)
    invoked = await client.post("/invocations", json=body)
    assert direct.status_code == invoked.status_code == 200
    strip = ("id", "created")
    assert {k: v for k, v in invoked.json().items() if k not in strip} == {
        k: v for k, v in direct.json().items() if k not in strip
    }
    streamed = sse(await client.post("/invocations", json={**body, "stream": True}))
    text = "".join(
        c.get("text") or (c.get("delta") or {}).get("content") or "" for e in streamed for c in e["choices"]
    )
    choice = direct.json()["choices"][0]
    assert text == choice.get("text", (choice.get("message") or {}).get("content"))


async def test_invocations_refuse_an_unknown_body_naming_it(client: httpx.AsyncClient) -> None:
    r = await client.post("/invocations", json={"what": 1})
    assert_error(r, 400, "/invocations takes a chat (messages)", param="body")
    assert_error(await client.post("/invocations", json=[1, 2]), 400, "JSON object", param="body")
    # The chosen route's own checks still apply.
    r = await client.post("/invocations", json={"messages": CHAT, "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in r.text


def test_the_route_is_chosen_by_the_bodys_keys() -> None:
    assert invocation_route(b'{"query": "q", "documents": ["d"]}', ("classify", "score")) == "/rerank"
    assert invocation_route(b'{"text_1": "a", "text_2": ["b"]}', ("embed",)) == "/score"
    assert invocation_route(b'{"input": "a"}', ("embed", "token_embed")) == "/v1/embeddings"
    assert invocation_route(b'{"input": "a"}', ("classify", "score")) == "/classify"
    assert invocation_route(b'{"input": "a"}', ("token_classify",)) == "/pooling"


@pytest.fixture
async def embedder(minilm_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    args = EngineArgs(model=str(minilm_dir), multiprocess=False)
    async with AsyncLLM.from_engine_args(args) as llm:
        app = build_app(ServerState(llm, ServerSettings(served_model_names=("minilm",))))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
            yield c


async def test_invocations_on_an_embedding_model(embedder: httpx.AsyncClient) -> None:
    body = {"input": ["A man is eating food.", "A cat."]}
    direct = (await embedder.post("/v1/embeddings", json=body)).json()
    invoked = await embedder.post("/invocations", json=body)
    assert invoked.status_code == 200
    assert [d["embedding"] for d in invoked.json()["data"]] == [d["embedding"] for d in direct["data"]]
    score = {"text_1": "A man is eating food.", "text_2": ["A man eats.", "A cat."]}
    assert (await embedder.post("/invocations", json=score)).json()["data"] == (
        await embedder.post("/score", json=score)
    ).json()["data"]
