"""The real `triollm serve` on a tiny random cross-encoder and on all-MiniLM-L6-v2, driven with
the official `cohere` client (v2 `rerank` and `embed`) and a Jina-style rerank call with httpx:
the scores equal sentence-transformers' `CrossEncoder.predict`, the embeddings `LLM.embed`'s."""

from __future__ import annotations

from pathlib import Path

import cohere
import httpx
import pytest
import torch
from server import run_server
from tinymodel import make_tiny_encoder

from triollm import LLM

QUERY = "What is the capital of France?"
DOCS = ["Berlin", "The capital of France is Paris.", "The quick brown fox jumps over the lazy dog."]


def test_rerank_over_http(tmp_path: Path, minilm_dir: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    model = make_tiny_encoder(tmp_path / "reranker", "BertForSequenceClassification", tokenizer_dir=minilm_dir)
    expected = [float(s) for s in st.CrossEncoder(str(model), device="cpu").predict([(QUERY, d) for d in DOCS])]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    serve = run_server(model, "--served-model-name", "reranker", "--max-model-len", "128", "--runner", "pooling")
    with serve as srv, httpx.Client() as http:
        client = cohere.ClientV2(api_key="unused", base_url=srv.url, httpx_client=http)
        result = client.rerank(model="reranker", query=QUERY, documents=DOCS, top_n=2)
        assert [r.index for r in result.results] == order[:2]
        assert [r.relevance_score for r in result.results] == pytest.approx([expected[i] for i in order[:2]], abs=1e-4)
        jina = httpx.post(
            f"{srv.url}/v1/rerank",
            json={"model": "reranker", "query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 3},
        )
        assert jina.status_code == 200, jina.text
        body = jina.json()
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
        assert body["usage"]["total_tokens"] > 0
        with pytest.raises(cohere.BadRequestError) as err:
            client.rerank(model="reranker", query=QUERY, documents=["word " * 200])
        assert "documents: " in str(err.value.body) and "truncate_prompt_tokens" in str(err.value.body)


def test_cohere_embed_over_http(minilm_dir: Path) -> None:
    with LLM(str(minilm_dir), num_threads=1) as llm:
        reference = torch.tensor([o.outputs.embedding for o in llm.embed(DOCS, use_tqdm=False)])
    with run_server(minilm_dir, "--served-model-name", "minilm") as srv, httpx.Client() as http:
        client = cohere.ClientV2(api_key="unused", base_url=srv.url, httpx_client=http)
        out = client.embed(model="minilm", texts=DOCS, input_type="search_document", embedding_types=["float"])
        assert out.embeddings.float_ is not None
        torch.testing.assert_close(torch.tensor(out.embeddings.float_), reference, atol=1e-5, rtol=0)
        assert out.texts == DOCS
