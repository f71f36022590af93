"""The retrieval routes served in process (httpx's ASGI transport) on tiny random cross-encoders
(BERT, XLM-R, ModernBERT) and all-MiniLM-L6-v2: `/rerank`, `/v1/rerank`, `/v2/rerank` against sentence-transformers'
`CrossEncoder.predict`, `/score` through the cross-encoder, `/classify`, `/pooling`, Cohere's
`/v2/embed`, the official `cohere` client's `rerank` and `embed` (v2); bad input is a 400
naming the field."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from tinymodel import make_tiny_encoder

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio
QUERY = "What is the capital of France?"
DOCS = [
    "Once upon a time there was a little robot who liked to count: one, two, three, four.",
    "The capital of France is Paris.",
    "Berlin",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerankers")
    return {
        "bert": make_tiny_encoder(root / "bert", "BertForSequenceClassification", tokenizer_dir=minilm_dir),
        "xlmr": make_tiny_encoder(root / "xlmr", "XLMRobertaForSequenceClassification", seed=1),
        "modernbert": make_tiny_encoder(
            root / "modernbert", "ModernBertForSequenceClassification", tokenizer_dir=minilm_dir, seed=2
        ),
    }


@pytest.fixture(scope="module")
async def apps(rerankers: dict[str, Path], anyio_backend: str) -> AsyncIterator[dict[str, Any]]:
    """Each reranker served in process, by name."""
    async with contextlib.AsyncExitStack() as stack:
        apps = {}
        for name, path in rerankers.items():
            args = EngineArgs(model=str(path), multiprocess=False, max_prompts_per_request=8)
            llm = await stack.enter_async_context(AsyncLLM.from_engine_args(args))
            apps[name] = build_app(ServerState(llm, ServerSettings(served_model_names=("reranker",))))
        yield apps


@pytest.fixture(params=["bert", "xlmr", "modernbert"])
def reranker(request: pytest.FixtureRequest, apps: dict[str, Any], rerankers: dict[str, Path]) -> tuple[Any, Path]:
    """(the app, the model's directory)"""
    return apps[request.param], rerankers[request.param]


@pytest.fixture(scope="module")
async def embedder(minilm_dir: Path, anyio_backend: str) -> AsyncIterator[Any]:
    args = EngineArgs(model=str(minilm_dir), multiprocess=False, max_prompts_per_request=8)
    async with AsyncLLM.from_engine_args(args) as llm:
        yield build_app(ServerState(llm, ServerSettings(served_model_names=("minilm",))))


def client_of(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def predict(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    st = pytest.importorskip("sentence_transformers")
    return [float(s) for s in st.CrossEncoder(str(path), device="cpu").predict(pairs, convert_to_numpy=True)]


def assert_400(response: httpx.Response, param: str, text: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error


async def test_rerank_equals_cross_encoder_predict(reranker: tuple[Any, Path]) -> None:
    app, path = reranker
    expected = predict(path, [(QUERY, d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    async with client_of(app) as client:
        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = await client.post(route, json={"model": "reranker", "query": QUERY, "documents": DOCS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [x["index"] for x in body["results"]] == order
            got = [x["relevance_score"] for x in body["results"]]
            assert got == pytest.approx([expected[i] for i in order], abs=1e-4)
            assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
            assert body["model"] == "reranker" and body["usage"]["total_tokens"] > 0
        # Jina's shape: documents as {"text": ...}, top_n, no documents back.
        jina = await client.post(
            "/v1/rerank",
            json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False},
        )
        assert [x["index"] for x in jina.json()["results"]] == order[:2]
        assert all("document" not in x for x in jina.json()["results"])
        scores = (await client.post("/score", json={"text_1": QUERY, "text_2": DOCS})).json()["data"]
        assert [d["score"] for d in scores] == pytest.approx(expected, abs=1e-4)


async def test_rerank_long_documents_and_bad_input(reranker: tuple[Any, Path]) -> None:
    app, path = reranker
    long = "The quick brown fox jumps over the lazy dog. " * 20
    async with client_of(app) as client:
        too_long = await client.post("/rerank", json={"query": QUERY, "documents": ["short", long]})
        assert_400(too_long, "documents", "documents[1]: ")
        assert "exceed max_model_len (128)" in too_long.json()["error"]["message"]
        assert "truncate_prompt_tokens" in too_long.json()["error"]["message"]
        cut = await client.post("/rerank", json={"query": QUERY, "documents": [long], "truncate_prompt_tokens": 40})
        assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 40
        per_doc = await client.post("/v2/rerank", json={"query": QUERY, "documents": [long], "max_tokens_per_doc": 5})
        assert per_doc.status_code == 200 and per_doc.json()["usage"]["total_tokens"] < 30
        assert_400(await client.post("/rerank", json={"query": QUERY, "documents": []}), "documents", "empty")
        assert_400(await client.post("/rerank", json={"query": QUERY, "documents": [3]}), "documents", "documents[0]")
        assert_400(await client.post("/rerank", json={"query": "", "documents": ["a"]}), "query", "empty")
        assert_400(
            await client.post("/rerank", json={"query": "q", "documents": ["a"] * 8}), "documents", "max_prompts"
        )
        assert_400(
            await client.post("/rerank", json={"query": "q", "documents": ["a"], "truncate_prompt_tokens": 500}),
            "truncate_prompt_tokens", "exceeds max_model_len",
        )  # fmt: skip
        assert_400(
            await client.post("/rerank", json={"query": "q", "documents": ["a"], "relevant_spans": {}}),
            "relevant_spans", "not supported",
        )  # fmt: skip
        assert_400(await client.post("/v1/embeddings", json={"input": "x"}), "task", "'embed' is not supported")


async def test_classify_and_pooling(reranker: tuple[Any, Path]) -> None:
    app, path = reranker
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        logits = hf(**tok(DOCS[:3], padding=True, return_tensors="pt")).logits
    async with client_of(app) as client:
        body = (await client.post("/classify", json={"input": DOCS[:3]})).json()
        probs = torch.tensor([d["probs"] for d in body["data"]])
        torch.testing.assert_close(probs, torch.sigmoid(logits), atol=1e-4, rtol=0)
        assert {d["label"] for d in body["data"]} == {"LABEL_0"} and body["data"][0]["num_classes"] == 1
        raw = (await client.post("/pooling", json={"input": DOCS[:3], "use_activation": False})).json()
        torch.testing.assert_close(torch.tensor([d["data"] for d in raw["data"]]), logits, atol=1e-4, rtol=0)
        assert_400(await client.post("/pooling", json={"input": "x", "task": "nope"}), "task", "not one of")


async def test_embedding_model_routes(embedder: Any, minilm_dir: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = torch.tensor(st.SentenceTransformer(str(minilm_dir), device="cpu").encode(DOCS))
    async with client_of(embedder) as client:
        cohere = await client.post(
            "/v2/embed",
            json={"texts": DOCS, "input_type": "search_document", "embedding_types": ["float", "base64"]},
        )
        assert cohere.status_code == 200, cohere.text
        body = cohere.json()
        assert body["response_type"] == "embeddings_by_type" and body["texts"] == DOCS
        torch.testing.assert_close(torch.tensor(body["embeddings"]["float"]), reference, atol=1e-4, rtol=0)
        decoded = np.frombuffer(base64.b64decode(body["embeddings"]["base64"][1]), dtype="<f4")
        np.testing.assert_allclose(decoded, reference[1].numpy(), atol=1e-4)
        assert body["meta"]["billed_units"]["input_tokens"] > 0
        # A bi-encoder reranks by the cosine of the embeddings.
        ranked = (await client.post("/rerank", json={"query": DOCS[1], "documents": DOCS})).json()["results"]
        assert ranked[0]["index"] == 1 and ranked[0]["relevance_score"] == pytest.approx(1.0, abs=1e-4)
        tokens = (await client.post("/pooling", json={"input": "two words", "task": "token_embed"})).json()
        assert torch.tensor(tokens["data"][0]["data"]).shape == (4, 384)
        long = {"texts": ["word " * 300]}
        assert (await client.post("/v2/embed", json=long)).status_code == 200  # Cohere's default: truncate END
        for body, param, text in (
            ({**long, "truncate": "NONE"}, "texts", "exceed max_model_len"),
            ({**long, "truncate": "START"}, "truncate", "allowed: NONE, END"),
            ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types", "int8"),
            ({"images": ["data:"]}, "images", "not supported"),
        ):
            assert_400(await client.post("/v2/embed", json=body), param, text)
        assert_400(await client.post("/classify", json={"input": "x"}), "task", "'classify' is not supported")


async def test_the_cohere_client(reranker: tuple[Any, Path], embedder: Any, minilm_dir: Path) -> None:
    cohere = pytest.importorskip("cohere")
    app, path = reranker
    expected = predict(path, [(QUERY, d) for d in DOCS])
    async with client_of(app) as http:
        client = cohere.AsyncClientV2(api_key="x", base_url="http://testserver", httpx_client=http)
        result = await client.rerank(model="reranker", query=QUERY, documents=DOCS, top_n=3)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in result.results] == order
    assert [r.relevance_score for r in result.results] == pytest.approx([expected[i] for i in order], abs=1e-4)
    async with client_of(embedder) as http:
        client = cohere.AsyncClientV2(api_key="x", base_url="http://testserver", httpx_client=http)
        embedded = await client.embed(
            model="minilm", texts=DOCS[:2], input_type="search_query", embedding_types=["float"]
        )
    assert embedded.embeddings.float_ is not None and len(embedded.embeddings.float_) == 2
    assert len(embedded.embeddings.float_[0]) == 384


async def test_rerank_on_a_decoder_reranker(tmp_path: Path, anyio_backend: str) -> None:
    """A Qwen3ForSequenceClassification through /rerank: transformers' logits of each pair (the
    tokenizer's own pair encoding), through the sigmoid, sorted."""
    from tinymodel import make_tiny_decoder_pooler
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_decoder_pooler(tmp_path / "qwen3", "Qwen3ForSequenceClassification")
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        expected = [torch.sigmoid(hf(**tok(QUERY, d, return_tensors="pt")).logits).item() for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    async with AsyncLLM.from_engine_args(EngineArgs(model=str(path), multiprocess=False)) as llm:
        app = build_app(ServerState(llm, ServerSettings(served_model_names=("qwen3",))))
        async with client_of(app) as client:
            r = await client.post("/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": False})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx([expected[i] for i in order], abs=1e-4)
