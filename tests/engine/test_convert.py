"""vLLM's `--convert`: a generative `*ForCausalLM` checkpoint served as a pooling model, through
`LLM`, on tiny random Qwen3 and Llama checkpoints that transformers wrote, against transformers
computing the same numbers by hand: "embed" (the last token's final hidden state, normalised),
"classify" (a `score.weight` head at the last token, or one made from the LM head with
`classifier_from_token` and vLLM's `method`), "reward" (`LLM.reward`: every token's hidden
state through softmax). Then how `runner` and `convert` resolve, and what is refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tinymodel import make_tiny_decoder_pooler

from triollm import LLM, PoolingParams
from triollm.engine.config import EngineArgs
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.pooling_outputs import PoolingRequestOutput

TEXTS = ["What is the capital of France?", "Berlin", "The quick brown fox jumps over the lazy dog. " * 2]
FAMILIES = ["Qwen3ForCausalLM", "LlamaForCausalLM"]


def hidden_states(path: Path, texts: list[str]) -> list[torch.Tensor]:
    """transformers' final-norm hidden states `[n, H]` of each text, one at a time (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        return [hf.model(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in texts]


def last_logits(path: Path, texts: list[str]) -> torch.Tensor:
    """transformers' LM-head logits at each text's last token, `[B, V]`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        return torch.stack([hf(**tok(t, return_tensors="pt")).logits[0, -1] for t in texts])


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_embed_is_the_normalised_last_hidden_state(tmp_path: Path, family: str) -> None:
    path = make_tiny_decoder_pooler(tmp_path / "m", family)
    expected = torch.nn.functional.normalize(torch.stack([h[-1] for h in hidden_states(path, TEXTS)]), dim=-1)
    with LLM(str(path), convert="embed", multiprocess=False) as llm:  # runner "auto" becomes "pooling"
        assert llm.llm_engine.model_config.runner_type == "pooling"
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_classify_reads_the_score_head(tmp_path: Path, family: str) -> None:
    """A sequence classifier's checkpoint whose config says `*ForCausalLM` (as a fine-tuned
    reranker often ships): `score.weight` at the last token, softmax over its two labels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_decoder_pooler(
        tmp_path / "c", family.replace("ForCausalLM", "ForSequenceClassification"), num_labels=2
    )
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        logits = torch.cat([hf(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    assert logits.std() > 0.1
    overrides = {"architectures": [family]}
    with LLM(str(path), runner="pooling", convert="classify", hf_overrides=overrides, multiprocess=False) as llm:
        probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
        raw = llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_classify_from_tokens(tmp_path: Path, family: str) -> None:
    """vLLM's `classifier_from_token` with `method` in hf_overrides: "from_2_way_softmax" scores
    sigmoid(second token's logit - first's); "no_post_processing" gives each token's logit one
    label (softmax over them)."""
    from transformers import AutoTokenizer

    path = make_tiny_decoder_pooler(tmp_path / "lm", family)
    names = AutoTokenizer.from_pretrained(str(path)).convert_ids_to_tokens([300, 301, 302])
    logits = last_logits(path, TEXTS)[:, [300, 301, 302]]
    two_way = {"classifier_from_token": names[:2], "method": "from_2_way_softmax"}
    with LLM(str(path), convert="classify", hf_overrides=two_way, multiprocess=False) as llm:
        assert llm.llm_engine.model_config.pooler.num_labels == 1
        scores = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]).squeeze(1)
    torch.testing.assert_close(scores, torch.sigmoid(logits[:, 1] - logits[:, 0]), atol=1e-4, rtol=0)
    rows = {"classifier_from_token": names, "method": "no_post_processing"}
    with LLM(str(path), convert="classify", hf_overrides=rows, multiprocess=False) as llm:
        probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_reward_gives_per_token_rewards(tmp_path: Path, family: str) -> None:
    path = make_tiny_decoder_pooler(tmp_path / "r", family)
    expected = hidden_states(path, TEXTS)
    with LLM(str(path), runner="pooling", convert="reward", multiprocess=False) as llm:
        outputs = llm.reward(TEXTS, use_tqdm=False)
        raw = llm.reward(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        with pytest.raises(ValueError, match=r"task: 'embed' is not supported .* supported: token_classify"):
            llm.embed(TEXTS[:1], use_tqdm=False)
        encoded = llm.encode(TEXTS[:1], pooling_task="token_classify", use_tqdm=False)
    for out, plain, want in zip(outputs, raw, expected):
        assert isinstance(out, PoolingRequestOutput) and out.outputs.data.shape == want.shape
        torch.testing.assert_close(out.outputs.data, torch.softmax(want, dim=-1), atol=1e-4, rtol=0)
        torch.testing.assert_close(plain.outputs.data, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(encoded[0].outputs.data, outputs[0].outputs.data, atol=0, rtol=0)


# ------------------------------------------------------------------ runner and convert at load


def test_runner_and_convert_resolve_as_vllm(tmp_path: Path, minilm_dir: Path) -> None:
    causal = make_tiny_decoder_pooler(tmp_path / "lm", "Qwen3ForCausalLM")
    classifier = make_tiny_decoder_pooler(tmp_path / "cls", "Qwen3ForSequenceClassification")
    cases = [
        (causal, "auto", "auto", "generate", None),
        (causal, "pooling", "auto", "pooling", ("embed", "token_embed")),  # vLLM: --runner pooling -> embed
        (causal, "auto", "embed", "pooling", ("embed", "token_embed")),
        (causal, "auto", "classify", "pooling", ("classify", "score")),
        (causal, "pooling", "reward", "pooling", ("token_classify",)),
        (causal, "generate", "none", "generate", None),
        (classifier, "auto", "classify", "pooling", ("classify", "score")),  # already one: not converted
        (minilm_dir, "pooling", "none", "pooling", ("embed", "token_embed")),
    ]
    for path, runner, convert, runner_type, tasks in cases:
        overrides = {"classifier_from_token": ["a", "b"]} if path == causal and convert == "classify" else None
        mc = ModelConfig.from_pretrained(path, runner=runner, convert=convert, hf_overrides=overrides)
        assert mc.runner_type == runner_type, (runner, convert)
        assert (mc.pooler.tasks if mc.pooler is not None else None) == tasks, (runner, convert)
    reward = ModelConfig.from_pretrained(causal, convert="reward")
    assert reward.pooler is not None and not reward.pooler.normalize and reward.pooler.activation == "softmax"


def test_bad_convert_is_refused_at_load(tmp_path: Path, minilm_dir: Path) -> None:
    causal = make_tiny_decoder_pooler(tmp_path / "lm", "Qwen3ForCausalLM")
    allowed = "auto, none, embed, classify, reward"
    with pytest.raises(ValueError, match=rf"convert: 'embedding' is not supported; allowed: {allowed}"):
        EngineArgs(model=str(causal), convert="embedding")
    with pytest.raises(ValueError, match=rf"convert: 'rank' is not one of {allowed}"):
        ModelConfig.from_pretrained(causal, convert="rank")
    with pytest.raises(ValueError, match=r"convert: 'embed' makes Qwen3ForCausalLM a pooling model, which runner"):
        ModelConfig.from_pretrained(causal, runner="generate", convert="embed")
    with pytest.raises(ValueError, match=r"convert: 'none' leaves Qwen3ForCausalLM a generative model"):
        ModelConfig.from_pretrained(causal, runner="pooling", convert="none")
    with pytest.raises(ValueError, match=r"convert: BertModel is already a pooling model \(embed\); allowed"):
        ModelConfig.from_pretrained(minilm_dir, convert="classify")
    with pytest.raises(ValueError, match=r"method: 'softmax' is not one of from_2_way_softmax, no_post_processing"):
        ModelConfig.from_pretrained(causal, convert="classify", hf_overrides={"method": "softmax"})
    three = {"classifier_from_token": ["a", "b", "c"], "method": "from_2_way_softmax"}
    with pytest.raises(ValueError, match=r"classifier_from_token: method 'from_2_way_softmax' needs two tokens"):
        ModelConfig.from_pretrained(causal, convert="classify", hf_overrides=three)
    # A causal LM without a score head nor tokens to make one: refused as the engine loads.
    with pytest.raises(ValueError, match=r"lacks score.weight; .* set classifier_from_token"):
        LLM(str(causal), convert="classify", multiprocess=False)
    config = json.loads((causal / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]  # hf_overrides never write the file
