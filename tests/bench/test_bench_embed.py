"""`triollm bench embed` on all-MiniLM-L6-v2, a few short texts: the workload's token counts lie
in the asked range, both sides ran, and their embeddings agree (the smallest cosine is printed
and written so that a fast wrong answer cannot pass). Speed is not checked here: the lead
measures it (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triollm import LLM
from triollm.api.cli import main
from triollm.bench.embed import text_workload


def test_workload_lengths(minilm_dir: Path) -> None:
    with LLM(str(minilm_dir), multiprocess=False) as llm:
        tokenizer = llm.get_tokenizer()
        texts = text_workload(tokenizer, 20, 8, 40)
    counts = [len(tokenizer.encode(t)) for t in texts]
    assert all(8 <= n <= 40 for n in counts) and len(set(counts)) > 5
    assert texts == text_workload(tokenizer, 20, 8, 40)  # seeded


def _bench_embed(model: Path, out: Path) -> dict:
    """`triollm bench embed` on 12 texts of 8-40 tokens, two runs a side; its JSON."""
    rc = main([
        "bench", "embed", "--model", str(model), "--num-texts", "12", "--min-tokens", "8",
        "--max-tokens", "40", "--no-multiprocess", "--repeats", "2", "--output-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_embed_beside_sentence_transformers(minilm_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    res = _bench_embed(minilm_dir, tmp_path / "embed.json")
    assert res["task"] == "embed"
    assert res["texts"] == 12 and 12 * 8 <= res["tokens"] <= 12 * 40
    assert len(res["triollm_s"]) == len(res["st_s"]) == 2
    assert res["triollm_texts_per_s"] == pytest.approx(12 / min(res["triollm_s"])) and res["st_texts_per_s"] > 0
    assert res["min_cosine"] > 0.9999


def test_bench_embed_times_a_reranker_beside_cross_encoder(minilm_dir: Path, tmp_path: Path) -> None:
    """A one-label cross-encoder is timed as a reranker: `LLM.score(query, texts)` beside
    sentence-transformers' `CrossEncoder.predict` on the same pairs, and the two agree."""
    pytest.importorskip("sentence_transformers")
    from tinymodel import make_tiny_encoder

    model = make_tiny_encoder(tmp_path / "ce", "BertForSequenceClassification", tokenizer_dir=minilm_dir)
    res = _bench_embed(model, tmp_path / "rerank.json")
    assert res["task"] == "rerank" and res["texts"] == 12 and len(res["st_s"]) == 2
    assert res["max_abs_diff"] < 1e-4
