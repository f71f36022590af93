"""Greedy parity with Hugging Face transformers through the real engine core.

Eight prompts of different lengths, batched together, 32 greedy tokens each, under four
scheduler regimes: plain, chunked prefill forced (a small token budget), prefix-cache hits
(prompts sharing prefixes, added in two waves), and preemption forced (few KV blocks).
Tokens must be identical and the chosen tokens' logprobs agree within 1e-3.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams

NEW_TOKENS = 32
REGIMES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16},
    "long_prefill": {"long_prefill_token_threshold": 7},
    "prefix": {"enable_prefix_caching": True},
    "preempt": {"num_gpu_blocks_override": 14},
}


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS neither stops nor is banned
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
            results.append((tokens, lps))
    return results


def engine_greedy(
    path: Path, prompts: list[list[int]], regime: str, **overrides: object
) -> tuple[list[tuple[list[int], list[float]]], EngineCore]:
    kwargs: dict = {"max_model_len": 160, "max_num_batched_tokens": 512, **REGIMES[regime], **overrides}
    args = EngineArgs(model=str(path), seed=0, **kwargs)
    core = EngineCore(args.create_engine_config())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    waves = [range(4), range(4, len(prompts))] if regime == "prefix" else [range(len(prompts))]
    for w, wave in enumerate(waves):
        for i in wave:
            core.add_request(EngineCoreRequest(str(i), prompts[i], params))
        steps = 3 if w < len(waves) - 1 else 10_000
        for _ in range(steps):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
                assert out.new_logprobs is not None
                lps[out.request_id] += [row[0] for row in out.new_logprobs.logprobs]
            core.check_integrity()
    stats = core.statistics()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks
    return [(tokens[str(i)], lps[str(i)]) for i in range(len(prompts))], core


def assert_parity(ours: list[tuple[list[int], list[float]]], ref: list[tuple[list[int], list[float]]]) -> None:
    for i, ((tok, lp), (rtok, rlp)) in enumerate(zip(ours, ref)):
        assert tok == rtok, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(lp, rlp)) < 1e-3, f"prompt {i}: logprobs differ"


def tiny_prompts() -> list[list[int]]:
    rng = random.Random(1)
    base = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 40, 17, 33)]
    # The second wave shares long prefixes with the first (prefix-cache hits).
    return base + [base[1][:36] + [7, 8], base[3][:32] + [9], base[1] + [11, 12, 13], base[2][:16] + [5] * 20]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> list[tuple[list[int], list[float]]]:
    return hf_greedy(tiny_model_dir, tiny_prompts())


@pytest.mark.parametrize("regime", list(REGIMES))
def test_tiny_llama_greedy_parity(tiny_model_dir: Path, tiny_reference, regime: str) -> None:
    ours, core = engine_greedy(tiny_model_dir, tiny_prompts(), regime)
    assert_parity(ours, tiny_reference)
    stats = core.statistics()
    if regime == "prefix":
        assert stats.prefix_cache_hit_rate > 0.2
    if regime == "preempt":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize(
    "variant",
    [
        {"architecture": "Qwen2ForCausalLM", "tie_word_embeddings": True},
        {"architecture": "MistralForCausalLM", "num_kv_heads": 1},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["qwen2-bias-tied", "mistral-mqa", "llama3-rope"],
)
def test_model_variants_parity(tmp_path: Path, variant: dict) -> None:
    from tinymodel import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=3, **variant)
    prompts = tiny_prompts()[:4]
    ours, _ = engine_greedy(path, prompts, "chunked")
    assert_parity(ours, hf_greedy(path, prompts))


SMOL_PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The capital of France is Paris. The capital of Germany is",
    "Once upon a time, in a small village by the sea, there lived a young girl",
    "1, 2, 3, 4,",
    "Translate to French: I like cheese. ->",
]


@pytest.mark.slow
@pytest.mark.parametrize("regime", ["chunked", "prefix", "preempt"])
def test_bundled_smollm2_greedy_parity(bundled_model_dir: Path, regime: str, smol_reference) -> None:
    ours, _ = engine_greedy(bundled_model_dir, smol_prompt_ids(bundled_model_dir), regime)
    assert_parity(ours, smol_reference)


def smol_prompt_ids(path: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [tok.encode(p).ids for p in SMOL_PROMPTS]


@pytest.fixture(scope="module")
def smol_reference(bundled_model_dir: Path) -> list[tuple[list[int], list[float]]]:
    return hf_greedy(bundled_model_dir, smol_prompt_ids(bundled_model_dir))
