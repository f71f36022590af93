"""`RequestOutput.metrics` (vLLM's `RequestStateStats`): the request's timings, filled on the
outputs of the sync `LLM`, of `AsyncLLM.generate` and of the sans-IO `SyncEngine`, with the
engine core in process and in a child process (the stamps then cross the wire).

The clocks are vLLM's: `arrival_time` is wall-clock, the `*_ts` stamps are monotonic, so the
ordering checked is queued <= scheduled <= first token <= last token on the monotonic clock,
and the arrival between the wall-clock readings taken around the call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from triollm import LLM, AsyncEngineArgs, AsyncLLM, EngineArgs, SamplingParams
from triollm.engine.outputs import RequestOutput, RequestStateStats
from triollm.engine.sampling_params import RequestOutputKind
from triollm.engine.sync_engine import SyncEngine

NEW_TOKENS = 5
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def check_metrics(
    out: RequestOutput, wall_before: float, wall_after: float, mono_before: float, tokens: int | None = None
) -> None:
    """`tokens`: how many the request generated (default: the output's own, a cumulative one's)."""
    m = out.metrics
    assert isinstance(m, RequestStateStats)
    assert wall_before <= m.arrival_time <= wall_after
    mono_after = time.monotonic()
    assert mono_before <= m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts <= mono_after
    assert m.first_token_ts < m.last_token_ts  # several steps made the tokens
    assert 0 < m.first_token_latency <= wall_after - wall_before
    assert m.num_generation_tokens == NEW_TOKENS == (len(out.outputs[0].token_ids) if tokens is None else tokens)


@pytest.fixture(scope="module", params=["inproc-trio", "multiprocess-asyncio"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LLM]:
    transport, backend = request.param.split("-")
    multiprocess = transport == "multiprocess"
    with LLM(str(tiny_model_dir), max_model_len=64, multiprocess=multiprocess, backend=backend) as engine:
        yield engine


def test_llm_generate_fills_metrics(llm: LLM) -> None:
    wall, mono = time.time(), time.monotonic()
    outs = llm.generate(["The capital of France is", "Once upon a time"], GREEDY, use_tqdm=False)
    after = time.time()
    for out in outs:
        check_metrics(out, wall, after, mono)
    assert outs[0].metrics is not outs[1].metrics


def test_sync_engine_fills_metrics(tiny_model_dir: Path) -> None:
    engine = SyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=64, seed=0))
    wall, mono = time.time(), time.monotonic()
    rid = engine.add_request("Hello there", GREEDY)
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.request_id == rid and o.finished]
    check_metrics(finished[0], wall, time.time(), mono)


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.anyio
@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "multiprocess"])
async def test_async_llm_stream_metrics(tiny_model_dir: Path, multiprocess: bool) -> None:
    """Every streamed (DELTA) output carries the metrics; the token stamps advance with them."""
    args = AsyncEngineArgs(model=str(tiny_model_dir), max_model_len=64, multiprocess=multiprocess, seed=0)
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    async with AsyncLLM.from_engine_args(args) as engine:
        wall, mono = time.time(), time.monotonic()
        last_seen: list[tuple[float, float, int]] = []
        final: RequestOutput | None = None
        streamed = 0
        with anyio.fail_after(60):
            async for out in engine.generate("Stream me", params, request_id="m1"):
                assert out.metrics is not None
                m = out.metrics
                assert m.first_token_ts > 0 and m.scheduled_ts > 0
                last_seen.append((m.first_token_ts, m.last_token_ts, m.num_generation_tokens))
                final = out
                streamed += len(out.outputs[0].token_ids)
        assert final is not None and final.finished
        firsts = {first for first, _, _ in last_seen}
        assert len(firsts) == 1  # the first token's stamp is set once
        assert [n for _, _, n in last_seen] == sorted(n for _, _, n in last_seen)
        assert [t for _, t, _ in last_seen] == sorted(t for _, t, _ in last_seen)
        check_metrics(final, wall, time.time(), mono, tokens=streamed)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "multiprocess"])
def test_preemptions_are_counted_per_request(tiny_model_dir: Path, multiprocess: bool) -> None:
    """A KV cache of 8 blocks for 6 requests of up to 3 blocks each: the scheduler preempts, and
    each request's metrics count its own preemptions (summing to the engine's counter)."""
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    with LLM(
        str(tiny_model_dir), max_model_len=64, multiprocess=multiprocess, num_gpu_blocks_override=8,
        block_size=16, enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        outs = llm.generate([f"request number {i}" for i in range(6)], params, use_tqdm=False)
        [total] = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
    per_request = [o.metrics.num_preemptions for o in outs if o.metrics is not None]
    assert len(per_request) == 6 and total > 0
    assert sum(per_request) == total
