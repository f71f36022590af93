"""The engine end to end on the Triton path (the CUDA code path), run on CPU under the
interpreter: `TRIOLLM_KERNELS=triton` sends attention (decode and prefill over the paged cache),
RMSNorm with the fused residual add, and rotary fused with the cache write through the Triton
kernels. Greedy tokens must equal the torch path's, through mixed batches, chunked prefill and
prefix-cache hits (prefill attending to cached blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from triollm import SamplingParams
from triollm.engine.config import EngineArgs
from triollm.engine.sync_engine import SyncEngine

PROMPTS = ["hello there world " * 3, "a", "the quick brown fox jumps over the lazy dog " * 2]


def _greedy(
    model: Path, kernels: str, monkeypatch: pytest.MonkeyPatch, prompts: list[str] = PROMPTS, max_tokens: int = 6,

) -> list[list[int]]:
    monkeypatch.setenv("TRIOLLM_KERNELS", kernels)
    engine = SyncEngine.from_engine_args(
        EngineArgs(
            model=str(model), max_model_len=256, dtype="float32", num_threads=1, block_size=16,
            long_prefill_token_threshold=8,  # prompts arrive in chunks: prefill over cached blocks
        )
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    cached = 0
    for round_ in range(2):  # the second round hits the prefix cache the first one filled
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt + " more" * round_, params, request_id=f"{round_}-{i}")
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
                    cached = max(cached, o.num_cached_tokens or 0)
    assert cached >= 16  # a whole block came from the prefix cache
    return [outs[k] for k in sorted(outs)]


def test_greedy_tokens_on_the_triton_path_equal_the_torch_path(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    torch_tokens = _greedy(tiny_model_dir, "torch", monkeypatch)
    assert _greedy(tiny_model_dir, "triton", monkeypatch) == torch_tokens


def test_speculative_decoding_on_the_triton_path(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts as decode rows through the Triton kernels (rotary + cache write of every row, then
    the decode attention): the greedy tokens of plain decoding on the same path. The prompt holds
    half the tiny vocabulary, so the random model's tokens often have an earlier occurrence and
    the n-gram lookup (one token) drafts."""
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    prompts = [{"prompt_token_ids": list(range(3, 200))}, {"prompt_token_ids": list(range(150, 300, 2))}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    for config in (None, spec):
        engine = SyncEngine.from_engine_args(
            EngineArgs(
                model=str(tiny_model_dir), max_model_len=256, dtype="float32", num_threads=1, speculative_config=config
            )
        )
        runs.append(([o.outputs[0].token_ids for o in engine.generate(prompts, params)], engine.core.statistics()))
    (plain, _), (with_drafts, stats) = runs
    assert stats.spec.num_drafts > 0
    assert with_drafts == plain
