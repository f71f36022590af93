"""Decoder models on the pooling runner through `LLM`, on tiny random checkpoints that
transformers wrote: a `Qwen3ForSequenceClassification` / `LlamaForSequenceClassification`
reranker (`LLM.score`, `LLM.classify`) against transformers' logits with the configured
activation, and a `Qwen3ForCausalLM` served with `runner="pooling"` as an embedder (last-token
and mean pooling, normalised, Matryoshka `dimensions`) against `SentenceTransformer.encode`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tinymodel import make_tiny_decoder_pooler

from triollm import LLM, PoolingParams

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Berlin", "The quick brown fox jumps over the lazy dog. " * 2]


@pytest.mark.parametrize("architecture", ["Qwen3ForSequenceClassification", "LlamaForSequenceClassification"])
def test_decoder_reranker_equals_transformers(tmp_path: Path, architecture: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_decoder_pooler(tmp_path / "m", architecture)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        pairs = torch.cat([hf(**tok(QUERY, d, return_tensors="pt")).logits for d in DOCS]).squeeze(1)
        singles = hf(**tok(DOCS, padding=True, return_tensors="pt")).logits
    assert pairs.std() > 0.1
    with LLM(str(path), multiprocess=False) as llm:
        assert llm.llm_engine.model_config.runner_type == "pooling"
        scores = torch.tensor([s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)])
        probs = torch.tensor([o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)])
    torch.testing.assert_close(scores, torch.sigmoid(pairs), atol=1e-4, rtol=0)
    torch.testing.assert_close(probs, torch.sigmoid(singles), atol=1e-4, rtol=0)


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens"])
def test_decoder_embedder_equals_sentence_transformers(tmp_path: Path, pooling: str) -> None:
    st = pytest.importorskip("sentence_transformers")
    path = make_tiny_decoder_pooler(tmp_path / "e", "Qwen3ForCausalLM")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True})
    )
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    texts = [QUERY, *DOCS]
    expected = torch.tensor(st.SentenceTransformer(str(path), device="cpu").encode(texts))
    with LLM(str(path), runner="pooling", multiprocess=False) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        short = llm.embed(texts, PoolingParams(dimensions=16), use_tqdm=False)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    cut = torch.nn.functional.normalize(expected[:, :16], dim=-1)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in short]), cut, atol=1e-4, rtol=0)


def test_classifier_from_token(tmp_path: Path) -> None:
    """vLLM's convention for Qwen3-Reranker: a causal LM whose config.json names a classifier
    architecture and two tokens; the score is sigmoid(logit of the second - logit of the first)
    at the last token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_decoder_pooler(tmp_path / "lm", "Qwen3ForCausalLM")
    tok = AutoTokenizer.from_pretrained(str(path))
    no_id, yes_id = 300, 301
    no, yes = tok.convert_ids_to_tokens([no_id, yes_id])
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        last = [hf(**tok(QUERY, d, return_tensors="pt")).logits[0, -1] for d in DOCS]
    expected = torch.sigmoid(torch.stack([row[yes_id] - row[no_id] for row in last]))
    config = json.loads((path / "config.json").read_text())
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes]}
    (path / "config.json").write_text(json.dumps({**config, **overrides}))
    with LLM(str(path), multiprocess=False) as llm:
        scores = torch.tensor([s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)])
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
    (path / "config.json").write_text(json.dumps({**config, **overrides, "classifier_from_token": ["no-such"]}))
    with pytest.raises(ValueError, match=r"classifier_from_token: 'no-such' is not a token"):
        LLM(str(path), multiprocess=False)
