"""Prompts longer than the bundled model allows (issue 40), through `LLM`, against transformers.

Each RoPE type as a family uses it, on a tiny random checkpoint written by transformers'
`save_pretrained` (tinymodel.make_transformers_model: hidden 64, 2 layers): Llama with default,
linear, dynamic and llama3 RoPE, Qwen3 with YaRN, Phi-3 with LongRoPE. A 4,096-token prompt runs
through `LLM` with the default settings, so the scheduler splits it into 2,048-token chunks, each
attending over the K/V the ones before it left in the paged cache; its greedy tokens must equal
transformers' and the chosen tokens' logprobs agree within 1e-3 (test_parity.assert_parity).
The scaled types have an original length of 1,024, so the prompt runs well past it (LongRoPE then
uses its long factors throughout, as transformers does for a sequence that long).

Then Llama 3.1's own RoPE settings (llama3, factor 8, original 8,192, max_position_embeddings
131,072) with a 32,768-token prompt and nothing set but the model: max_model_len from the config,
the default KV budget, chunked prefill, the engine core in its child process. Its first tokens
must be transformers' on the whole prompt (transformers' SDPA holds 32k tokens of a tiny model in
a few GB). Dynamic NTK past max_position_embeddings is refused (rope_config's module note).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_parity import assert_parity
from tinymodel import make_transformers_model

from triollm import LLM, EngineArgs, SamplingParams

LONG = 4096
ORIGINAL = 1024  # the scaled types' original_max_position_embeddings: the prompt is 4x longer
NEW_TOKENS = 16
ROPES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "linear": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    # Within max_position_embeddings (8192), where dynamic NTK is the default RoPE.
    "dynamic": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}),
    "llama3": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "rope_theta": 5e5,
            }
        },
    ),
    "yarn": (
        "Qwen3ForCausalLM",  # Qwen2.5 / Qwen3 long-context: YaRN
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": ORIGINAL,
                "rope_theta": 1e6,
            },
        },
    ),
    "longrope": (
        "Phi3ForCausalLM",  # Phi-3 / Phi-3.5 / Phi-4-mini 128k
        {
            "original_max_position_embeddings": ORIGINAL,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5, 3.0],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0],
            },
        },
    ),
}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 5e5,
}


def random_prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def hf_greedy(path: Path, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, with both cores (the engine is stopped)."""
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # like ignore_eos
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    finally:
        torch.set_num_threads(threads)
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]


def llm_greedy(llm: LLM, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.logprobs is not None
    tokens = list(completion.token_ids)
    return tokens, [row[t].logprob for row, t in zip(completion.logprobs, tokens)]


@pytest.mark.parametrize("rope", list(ROPES))
def test_long_prompt_greedy_parity_per_rope_type(tmp_path: Path, rope: str) -> None:
    arch, overrides = ROPES[rope]
    path = make_transformers_model(tmp_path / rope, arch, seed=7, max_position_embeddings=2 * LONG, **overrides)
    ids = random_prompt(LONG)
    # Defaults but the transport: max_model_len 8192 from the config, 2048-token chunks.
    with LLM(str(path), multiprocess=False) as llm:
        assert llm.llm_engine.model_config.max_model_len == 2 * LONG
        ours = llm_greedy(llm, ids, NEW_TOKENS)
    assert_parity([ours], [hf_greedy(path, ids, NEW_TOKENS)])


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama31")
    return make_transformers_model(
        path, "LlamaForCausalLM", seed=11, max_position_embeddings=131072, rope_parameters=LLAMA31_ROPE
    )


def test_32k_prompt_with_default_settings_matches_transformers(llama31_dir: Path) -> None:
    prompt_len, new_tokens = 32768, 4
    config = EngineArgs(model=str(llama31_dir)).create_engine_config()
    assert config.model.max_model_len == 131072  # the model's own, nothing set
    assert config.scheduler.max_num_batched_tokens < prompt_len  # so the prompt is chunked
    ids = random_prompt(prompt_len, seed=1)
    with LLM(str(llama31_dir)) as llm:  # the default transport: the core in a child process
        ours = llm_greedy(llm, ids, new_tokens)
    assert_parity([ours], [hf_greedy(llama31_dir, ids, new_tokens)])


def test_dynamic_ntk_beyond_max_position_embeddings_is_refused(tmp_path: Path) -> None:
    arch, overrides = ROPES["dynamic"]
    path = make_transformers_model(tmp_path / "dynamic", arch, max_position_embeddings=LONG, **overrides)
    with pytest.raises(ValueError, match=r"rope_type 'dynamic'.*Use max_model_len <= 4096"):
        EngineArgs(model=str(path), max_model_len=LONG + 1).create_engine_config()
    assert EngineArgs(model=str(path), max_model_len=LONG).create_engine_config().model.max_model_len == LONG
