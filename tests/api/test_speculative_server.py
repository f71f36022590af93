"""Speculative decoding behind the OpenAI server: streamed and whole completions equal plain
decoding's (several tokens per step reach the SSE stream as one delta), with usage counted per
token, and /metrics serving vLLM's spec_decode series."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.metrics import Metrics
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
BODY = {"model": "m", "prompt": CODE * 3, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


async def _serve(model: Path, spec: dict[str, Any] | None) -> dict[str, Any]:
    args = EngineArgs(
        model=str(model), max_model_len=512, multiprocess=False, seed=0, quantization="gguf", speculative_config=spec,
        # The streamed request repeats the whole one's prompt: without the prefix cache it is computed the same
        # way, so the comparison is of speculation and streaming only (a prefix hit's numbers equal a cold
        # prefill's only under VLLM_BATCH_INVARIANT=1; in the full suite on an AVX2 CPU a near-tie flipped).
        enable_prefix_caching=False,
    )
    async with AsyncLLM.from_engine_args(args) as llm:
        state = ServerState(llm, ServerSettings(served_model_names=("m",)))
        state.metrics = Metrics(state)  # as the server sets it
        app = build_app(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
            whole = (await client.post("/v1/completions", json=BODY)).json()
            stream = {**BODY, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            chunks = []
            async with client.stream("POST", "/v1/completions", json=stream) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            metrics = (await client.get("/metrics")).text
    return {"whole": whole, "chunks": chunks, "metrics": metrics}


async def test_completions_with_speculation_equal_plain_decoding(bundled_model_dir: Path) -> None:
    plain, spec = await _serve(bundled_model_dir, None), await _serve(bundled_model_dir, SPEC)
    assert spec["whole"]["choices"][0]["text"] == plain["whole"]["choices"][0]["text"]
    assert spec["whole"]["usage"] == plain["whole"]["usage"] and spec["whole"]["usage"]["completion_tokens"] == 24
    streamed = "".join(c["choices"][0]["text"] for c in spec["chunks"] if c["choices"])
    assert streamed == plain["whole"]["choices"][0]["text"]
    counts = [c["usage"]["completion_tokens"] for c in spec["chunks"] if c.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 24
    # Fewer chunks than tokens: steps that accepted drafts sent several tokens at once.
    assert len([c for c in spec["chunks"] if c["choices"]]) < 24
    accepted = [
        line for line in spec["metrics"].splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in spec["metrics"]
    assert "spec_decode" not in plain["metrics"]
