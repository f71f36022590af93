"""`/v1/embeddings`, `/score` and `/v1/score` on all-MiniLM-L6-v2 served in process (httpx's
ASGI transport), read as JSON and through the `openai` client; bad input is a 400 naming the
field; endpoints of the other runner answer 400 both ways."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs
from triollm.engine.processing.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio
MODEL = "minilm"
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue today."]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def app(minilm_dir: Path, anyio_backend: str) -> AsyncIterator[Any]:
    args = EngineArgs(model=str(minilm_dir), multiprocess=False, max_prompts_per_request=8)
    async with AsyncLLM.from_engine_args(args) as llm:
        yield build_app(ServerState(llm, ServerSettings(served_model_names=(MODEL,))))


@pytest.fixture
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    return torch.tensor(st.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, normalize_embeddings=True))


async def embed(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/v1/embeddings", json={"model": MODEL, **body})


def assert_400(response: httpx.Response, param: str, text: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert error["type"] == "BadRequestError" and error["code"] == 400


async def test_embeddings_float_and_base64(
    client: httpx.AsyncClient, reference: torch.Tensor, minilm_dir: Path
) -> None:
    r = await embed(client, {"input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
    got = torch.tensor([d["embedding"] for d in body["data"]])
    assert torch.nn.functional.cosine_similarity(got, reference).min() >= 0.9999
    usage = body["usage"]
    counted = sum(len(Tokenizer.from_pretrained(minilm_dir).encode(t)) for t in TEXTS)
    assert usage["prompt_tokens"] == usage["total_tokens"] == counted
    b64 = (await embed(client, {"input": TEXTS[0], "encoding_format": "base64"})).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, got[0].numpy(), atol=1e-6)
    ids = (await embed(client, {"input": [[101, 7592, 102], [101, 2088, 102]]})).json()
    assert len(ids["data"]) == 2 and ids["usage"]["prompt_tokens"] == 6
    single = (await embed(client, {"input": [101, 7592, 102]})).json()
    assert single["data"][0]["embedding"] == ids["data"][0]["embedding"]


async def test_embeddings_with_the_openai_client(app: Any, reference: torch.Tensor) -> None:
    openai = pytest.importorskip("openai")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        # Without encoding_format the client asks for base64 and decodes it itself.
        for fmt in (openai.NOT_GIVEN, "float"):
            result = await client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=fmt)
            got = torch.tensor([d.embedding for d in result.data])
            assert torch.nn.functional.cosine_similarity(got, reference).min() >= 0.9999
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            await client.embeddings.create(model=MODEL, input="x", dimensions=8)


async def test_embeddings_bad_input(client: httpx.AsyncClient) -> None:
    assert_400(await embed(client, {"input": ""}), "input", "must not be empty")
    assert_400(await embed(client, {"input": []}), "input", "empty list")
    assert_400(await embed(client, {"input": ["a", 1]}), "input", "not a mix")
    assert_400(await embed(client, {"input": 5}), "input", "Expected")
    assert_400(await embed(client, {"input": "x", "encoding_format": "hex"}), "encoding_format", "'hex'")
    assert_400(await embed(client, {"input": "x", "dimensions": 0}), "dimensions", "")
    assert_400(await embed(client, {"input": "x", "dimensions": 16}), "dimensions", "matryoshka")
    assert_400(await embed(client, {"input": "x", "truncate_prompt_tokens": -2}), "truncate_prompt_tokens", "")
    assert_400(
        await embed(client, {"input": ["fine", "word " * 300]}),
        "input",
        "input[1]: 302 tokens exceed max_model_len (256)",
    )
    assert_400(await embed(client, {"input": [[101, 99999]]}), "input", "vocab_size")
    assert_400(await embed(client, {"input": ["x"] * 9}), "input", "max_prompts_per_request")
    cut = await embed(client, {"input": "word " * 300, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    missing = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert missing.status_code == 404
    assert (await embed(client, {"input": "still serving"})).status_code == 200


async def test_score(client: httpx.AsyncClient, reference: torch.Tensor) -> None:
    cos = reference @ reference.T
    for path in ("/score", "/v1/score"):
        r = await client.post(path, json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == MODEL
        assert [d["object"] for d in body["data"]] == ["score", "score"] and [d["index"] for d in body["data"]] == [
            0,
            1,
        ]
        assert [d["score"] for d in body["data"]] == pytest.approx(cos[0, 1:].tolist(), abs=1e-4)
        assert body["usage"]["prompt_tokens"] > 0
    pairs = (await client.post("/score", json={"queries": TEXTS[:2], "documents": TEXTS[1:]})).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([cos[0, 1].item(), cos[1, 2].item()], abs=1e-4)
    assert_400(await client.post("/score", json={"text_1": "a"}), "text_2", "required")
    assert_400(await client.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}), "text_1", "2 texts for 3")
    assert_400(await client.post("/score", json={"text_1": [], "text_2": "b"}), "text_1", "non-empty list")
    assert_400(
        await client.post("/score", json={"text_1": "a", "text_2": ["word " * 300]}), "text_2", "exceed max_model_len"
    )


async def test_generation_endpoints_and_models_on_a_pooling_model(client: httpx.AsyncClient) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = await client.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400 and "does not support" in r.json()["error"]["message"]
        assert "--runner generate" in r.json()["error"]["message"]
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    tok = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert tok["tokens"] == [101, 7592, 2088, 102]


async def test_pooling_endpoints_on_a_generative_model(tiny_model_dir: Path) -> None:
    args = EngineArgs(model=str(tiny_model_dir), multiprocess=False, max_model_len=64)
    async with AsyncLLM.from_engine_args(args) as llm:
        app = build_app(ServerState(llm, ServerSettings(served_model_names=("tiny",))))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for path, body in (("/v1/embeddings", {"input": "x"}), ("/score", {"text_1": "a", "text_2": "b"})):
                r = await client.post(path, json=body)
                assert r.status_code == 400, r.text
                message = r.json()["error"]["message"]
                assert "The model does not support" in message and "--runner pooling" in message
            ok = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200
