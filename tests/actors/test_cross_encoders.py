"""Cross-encoders, classifiers and XLM-R encoders end to end through `LLM` on tiny random
checkpoints: `LLM.score` / `LLM.classify` against sentence-transformers' `CrossEncoder.predict`
and transformers' logits, `LLM.embed` on an XLM-R embedder against `SentenceTransformer.encode`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tinymodel import make_tiny_encoder

from triollm import LLM, ClassificationRequestOutput, PoolingParams, ScoringRequestOutput

QUERY = "What is the capital of France?"
DOCS = [
    "The capital of France is Paris.",
    "Once upon a time there was a little robot who liked to count: one, two, three, four.",
    "Berlin",
    "The quick brown fox jumps over the lazy dog. " * 3,
]
SIGMOID = "torch.nn.modules.activation.Sigmoid"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross")
    return {
        "bert": make_tiny_encoder(root / "bert", "BertForSequenceClassification", tokenizer_dir=minilm_dir),
        "xlmr": make_tiny_encoder(root / "xlmr", "XLMRobertaForSequenceClassification", seed=1),
        # Three labels, the legacy activation key: CrossEncoder and vLLM read it (tanh here).
        "labels": make_tiny_encoder(
            root / "labels", "BertForSequenceClassification", tokenizer_dir=minilm_dir, num_labels=3, seed=2,
            config_json={"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"},
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def bert(models: dict[str, Path]) -> Iterator[LLM]:
    with LLM(str(models["bert"]), multiprocess=False) as llm:
        yield llm


def cross_encoder_scores(path: Path, pairs: list[tuple[str, str]], **kwargs: object) -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    model = st.CrossEncoder(str(path), device="cpu", **kwargs)
    return torch.tensor(model.predict(pairs, convert_to_numpy=True))


@pytest.mark.parametrize("name", ["bert", "xlmr"])
def test_score_equals_cross_encoder_predict(models: dict[str, Path], name: str) -> None:
    expected = cross_encoder_scores(models[name], [(QUERY, d) for d in DOCS])
    assert expected.std() > 0.01  # the scores differ: an ordering is tested
    with LLM(str(models[name]), multiprocess=False) as llm:
        assert llm.llm_engine.model_config.pooler.tasks == ("classify", "score")
        scores = llm.score(QUERY, DOCS, use_tqdm=False)  # 1 -> N, one batch with padding
        assert all(isinstance(s, ScoringRequestOutput) for s in scores)
        torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected, atol=1e-4, rtol=0)
        pairwise = llm.score([QUERY, DOCS[1]], [DOCS[0], QUERY], use_tqdm=False)  # N -> N
        expected_pairs = cross_encoder_scores(models[name], [(QUERY, DOCS[0]), (DOCS[1], QUERY)])
        torch.testing.assert_close(torch.tensor([s.outputs.score for s in pairwise]), expected_pairs, atol=1e-4, rtol=0)


def test_pairs_are_the_tokenizers_pair_encoding(bert: LLM, minilm_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    long = DOCS[3] * 2
    for keep in (None, 24, 25, 40):
        expected = hf(QUERY, long, truncation="longest_first" if keep else False, max_length=keep)
        [out] = bert.score(QUERY, long, truncate_prompt_tokens=keep, use_tqdm=False)
        assert out.prompt_token_ids == expected["input_ids"]
    with pytest.raises(ValueError, match=r"prompt: 1\d\d tokens exceed max_model_len \(128\).*truncate_prompt_tokens"):
        bert.score(QUERY, long * 2, use_tqdm=False)
    [cut] = bert.score(QUERY, long * 2, truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 128
    ids, types = bert.get_tokenizer().encode_pair(QUERY, DOCS[0])
    assert (ids, types) == (hf(QUERY, DOCS[0])["input_ids"], hf(QUERY, DOCS[0])["token_type_ids"])
    assert 0 < sum(types) < len(types)  # the document's segment is type 1


def test_classify_with_the_configured_activation(models: dict[str, Path]) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = models["labels"]
    texts = [QUERY, DOCS[1], "Hi"]
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        logits = hf(**tok(texts, padding=True, return_tensors="pt")).logits
    with LLM(str(path), multiprocess=False) as llm:
        outs = llm.classify(texts, use_tqdm=False)
        assert all(isinstance(o, ClassificationRequestOutput) and o.outputs.num_classes == 3 for o in outs)
        torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), torch.tanh(logits), atol=1e-4, rtol=0)
        raw = llm.classify(texts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-4, rtol=0)
        with pytest.raises(ValueError, match=r"task: 'score' is not supported .*; supported: classify"):
            llm.score(QUERY, DOCS[0], use_tqdm=False)  # three labels: no single relevance score
        with pytest.raises(ValueError, match=r"task: 'embed' is not supported .*; supported: classify"):
            llm.embed(texts, use_tqdm=False)
    # The same three labels with CrossEncoder's reading of the activation.
    expected = cross_encoder_scores(path, [(t, t) for t in texts])
    with LLM(str(path), multiprocess=False) as llm:
        pairs = [llm.get_tokenizer().encode_pair(t, t) for t in texts]
        prompts = [{"prompt_token_ids": ids, "token_type_ids": types} for ids, types in pairs]
        outs = llm.classify(prompts, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), expected, atol=1e-4, rtol=0)


def test_activation_from_sentence_transformers_config(tmp_path: Path, minilm_dir: Path) -> None:
    """A CrossEncoder saved by sentence-transformers with its activation (in
    config_sentence_transformers.json): it wins over the one-label default."""
    st = pytest.importorskip("sentence_transformers")
    raw = make_tiny_encoder(tmp_path / "raw", "BertForSequenceClassification", tokenizer_dir=minilm_dir)
    path = tmp_path / "m"
    st.CrossEncoder(str(raw), device="cpu", activation_fn=torch.nn.Identity()).save_pretrained(str(path))
    expected = cross_encoder_scores(path, [(QUERY, d) for d in DOCS])
    assert (expected < 0).any() or (expected > 1).any()  # raw logits, not probabilities
    with LLM(str(path), multiprocess=False) as llm:
        got = torch.tensor([s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    bad = json.loads((path / "config_sentence_transformers.json").read_text()) | {"activation_fn": "my.Activation"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"activation_fn: 'my.Activation' is not supported; supported: torch\.nn"):
        LLM(str(path), multiprocess=False)


def test_xlm_roberta_embedder_equals_sentence_transformers(tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    path = make_tiny_encoder(tmp_path / "e", "XLMRobertaModel", seed=3)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    texts = [QUERY, *DOCS]
    expected = torch.tensor(st.SentenceTransformer(str(path), device="cpu").encode(texts))
    with LLM(str(path), multiprocess=False) as llm:
        assert llm.llm_engine.model_config.max_model_len == 128  # 130 positions from pad + 1
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        scores = llm.score(QUERY, DOCS, use_tqdm=False)  # no classifier: the cosine of embeddings
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    cos = expected[1:] @ expected[0]
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), cos, atol=1e-4, rtol=0)


def test_encode_is_a_deprecated_alias_of_token_embed(bert: LLM, minilm_dir: Path) -> None:
    with LLM(str(minilm_dir), multiprocess=False) as llm:
        with pytest.warns(DeprecationWarning, match="pooling task 'encode' is deprecated; use 'token_embed'"):
            old = llm.encode(["two words"], pooling_task="encode", use_tqdm=False)[0]
        new = llm.encode(["two words"], pooling_task="token_embed", use_tqdm=False)[0]
        assert torch.equal(old.outputs.data, new.outputs.data) and new.outputs.data.shape == (4, 384)
    with pytest.raises(ValueError, match=r"task: 'token_embed' is not supported .*; supported: classify, score"):
        bert.encode(["x"], pooling_task="token_embed", use_tqdm=False)


def test_modernbert_classifier_and_embedder(tmp_path: Path, minilm_dir: Path) -> None:
    """ModernBERT: RoPE, global and windowed layers (texts longer than the window), mean-pooled
    head; the reranker against CrossEncoder.predict, the encoder against SentenceTransformer."""
    st = pytest.importorskip("sentence_transformers")
    path = make_tiny_encoder(tmp_path / "cls", "ModernBertForSequenceClassification", tokenizer_dir=minilm_dir)
    expected = cross_encoder_scores(path, [(QUERY, d) for d in DOCS])
    assert expected.std() > 0.01
    with LLM(str(path), multiprocess=False) as llm:
        scores = torch.tensor([s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)])
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
    encoder = make_tiny_encoder(tmp_path / "enc", "ModernBertModel", tokenizer_dir=minilm_dir, seed=4)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (encoder / "modules.json").write_text(json.dumps(modules))
    (encoder / "1_Pooling").mkdir()
    (encoder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    texts = [QUERY, *DOCS]
    reference = torch.tensor(st.SentenceTransformer(str(encoder), device="cpu").encode(texts))
    with LLM(str(encoder), multiprocess=False) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)
