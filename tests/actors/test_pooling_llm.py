"""The pooling runner end to end on all-MiniLM-L6-v2: `LLM.embed` / `encode` / `score` against
sentence-transformers, and the runner checks both ways (vLLM's messages)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from triollm import (
    LLM,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringRequestOutput,
)

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the dark forest "
    "where nobody can find it again for a very long time.",
    "Hi",
    "Embeddings map text to vectors; similar texts get similar vectors.",
]


@pytest.fixture(scope="module")
def llm(minilm_dir: Path) -> Iterator[LLM]:
    with LLM(str(minilm_dir), multiprocess=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> torch.Tensor:
    """sentence-transformers' embeddings (its config: mean pooling, Normalize module)."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    return torch.tensor(model.encode(SENTENCES, normalize_embeddings=True))


def test_embed_matches_sentence_transformers(llm: LLM, reference: torch.Tensor) -> None:
    outs = llm.embed(SENTENCES, use_tqdm=False)  # one batch: padding exercised
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == (len(SENTENCES), 384) and outs[0].outputs.hidden_size == 384
    cosine = torch.nn.functional.cosine_similarity(got, reference)
    assert cosine.min() >= 0.9999, cosine
    assert torch.allclose(got.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)
    assert outs[2].prompt_token_ids == llm.get_tokenizer().encode("Hi")  # [CLS] hi [SEP]


def test_score_is_the_cosine_of_the_embeddings(llm: LLM, reference: torch.Tensor) -> None:
    one_to_n = llm.score(SENTENCES[0], SENTENCES[1:], use_tqdm=False)
    n_to_n = llm.score(SENTENCES[:2], SENTENCES[2:], use_tqdm=False)
    assert all(isinstance(s, ScoringRequestOutput) for s in one_to_n + n_to_n)
    cos = reference @ reference.T  # normalised: cosine = dot product
    assert [s.outputs.score for s in one_to_n] == pytest.approx(cos[0, 1:].tolist(), abs=1e-4)
    assert [s.outputs.score for s in n_to_n] == pytest.approx([cos[0, 2].item(), cos[1, 3].item()], abs=1e-4)
    assert len(llm.score("a", "b", use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="data_1: 2 texts for 3"):
        llm.score(SENTENCES[:2], SENTENCES[1:], use_tqdm=False)


def test_encode_tasks_and_parameters(llm: LLM, reference: torch.Tensor) -> None:
    embed = llm.encode(SENTENCES[:1], pooling_task="embed", use_tqdm=False)[0]
    assert isinstance(embed, PoolingRequestOutput) and embed.outputs.data.shape == (384,)
    tokens = llm.encode(SENTENCES[:1], pooling_task="token_embed", use_tqdm=False)[0]
    assert tokens.outputs.data.shape == (len(tokens.prompt_token_ids), 384)  # one vector per token
    assert torch.allclose(tokens.outputs.data.norm(dim=1), torch.ones(len(tokens.prompt_token_ids)), atol=1e-5)
    raw = llm.embed(SENTENCES[:1], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert torch.tensor(raw).norm() > 1.5  # MiniLM's mean-pooled vectors are not unit length
    assert torch.nn.functional.cosine_similarity(torch.tensor(raw), reference[0], dim=0) >= 0.9999
    with pytest.raises(ValueError, match="pooling_task: required"):
        llm.encode(SENTENCES[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: model .* does not support matryoshka"):
        llm.embed(SENTENCES[:1], PoolingParams(dimensions=64), use_tqdm=False)


def test_truncation(llm: LLM) -> None:
    long = "word " * 400  # 402 tokens with [CLS] and [SEP]
    with pytest.raises(ValueError, match=r"prompt: 402 tokens exceed max_model_len \(256\).*truncate_prompt_tokens"):
        llm.embed([long], use_tqdm=False)
    cut = llm.embed([long], truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 256 and cut.prompt_token_ids[0] == 101 and cut.prompt_token_ids[-1] == 102
    short = llm.embed([long], truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert short.prompt_token_ids == llm.get_tokenizer().encode("word " * 8)
    ids = llm.embed([{"prompt_token_ids": list(range(1000, 1300))}], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert ids.prompt_token_ids == list(range(1000, 1005))
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens: 300 exceeds max_model_len \(256\)"):
        llm.embed(["x"], truncate_prompt_tokens=300, use_tqdm=False)


def test_generation_on_a_pooling_model_is_refused(llm: LLM) -> None:
    hint = r"only supported for generative models\. Try passing `--runner generate`"
    with pytest.raises(ValueError, match=r"LLM\.generate\(\) is " + hint):
        llm.generate(["Hello"])
    with pytest.raises(ValueError, match=r"LLM\.chat\(\) is " + hint):
        llm.chat([{"role": "user", "content": "Hello"}])
    assert len(llm.embed(["still fine"], use_tqdm=False)) == 1


def test_pooling_on_a_generative_model_is_refused(tiny_model_dir: Path) -> None:
    hint = r"is only supported for pooling models\. Try passing `--runner pooling`"
    with LLM(str(tiny_model_dir), max_model_len=64, multiprocess=False) as gen:
        for call in (
            lambda: gen.embed(["x"]),
            lambda: gen.encode(["x"], pooling_task="embed"),
            lambda: gen.score("a", "b"),
        ):
            with pytest.raises(ValueError, match=hint):
                call()
        assert len(gen.generate(["Hello"], use_tqdm=False)) == 1
