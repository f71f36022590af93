"""vLLM usage patterns that scripts hit first, run as vLLM's docs and examples write them.

- `AsyncLLM.from_engine_args(...)` used from a plain coroutine, without `async with`: the engine
  starts on first use, owned by a root task of the running loop; `shutdown()` is callable without
  `await`; a script that forgets it still leaves no engine process behind.
- `await llm.abort(id)`, `is_stopped`, `pause_generation` / `resume_generation` / `is_paused`,
  `get_supported_tasks`, `model_config`, `do_log_stats`, `get_metrics`.
- `LLM.llm_engine` is an `LLMEngine`; `LLM.enqueue` + `wait_for_completion`;
  `LLM.reset_prefix_cache`, `LLM.get_metrics`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
import pytest

from triollm import LLM, AsyncEngineArgs, AsyncLLM, LLMEngine, SamplingParams
from triollm.engine.metrics import Counter, Gauge, Vector

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


async def _drain(llm: AsyncLLM, prompt: str, params: SamplingParams, rid: str) -> list:
    return [out async for out in llm.generate(prompt, params, request_id=rid)]


# ------------------------------------------------------------------ AsyncLLM without async with


async def test_plain_coroutine_starts_on_first_use_and_sync_shutdown_stops_it(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    llm = AsyncLLM.from_engine_args(engine_args())
    assert not llm.is_running
    outs = await _drain(llm, "Hello", GREEDY, "1")
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert llm.is_running and not llm.is_stopped
    assert await llm.get_supported_tasks() == ("generate",)
    assert llm.model_config.vocab_size > 0
    llm.shutdown()  # vLLM's form: no await
    assert llm.is_stopped and not llm.is_running
    with pytest.raises(RuntimeError, match="not running"):
        await llm.add_request("2", "Hello", GREEDY)
    await llm.shutdown()  # the awaitable form waits until the root task has torn it down
    assert not llm.errored


async def test_concurrent_first_uses_start_one_engine(engine_args: Callable[..., AsyncEngineArgs]) -> None:
    llm = AsyncLLM.from_engine_args(engine_args())
    results: dict[str, list] = {}

    async def one(rid: str) -> None:
        results[rid] = await _drain(llm, "Hello", GREEDY, rid)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, f"r{i}")
        assert {len(v[-1].outputs[0].token_ids) for v in results.values()} == {4}
    finally:
        await llm.shutdown()


async def test_a_bad_model_is_refused_by_the_constructor(tmp_path: Path) -> None:
    """vLLM resolves the configuration in `from_engine_args`: a typo surfaces there, at once."""
    with pytest.raises(ValueError, match="config.json"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tmp_path), multiprocess=False))


async def test_start_failure_on_first_use_is_raised_to_the_caller(tmp_path: Path, tiny_model_dir: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(broken), multiprocess=False))
    with pytest.raises(RuntimeError, match="failed to start") as info:
        await llm.add_request("1", "Hello", GREEDY)
    assert "header" in str(info.value.__cause__).lower()
    llm.shutdown()


_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    import psutil
    from triollm import AsyncEngineArgs, AsyncLLM, SamplingParams

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=sys.argv[1], max_model_len=128))
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        async for out in engine.generate("Hello", params, request_id="1"):
            final = out
        print("TOKENS", len(final.outputs[0].token_ids), flush=True)
        children = psutil.Process().children(recursive=True)
        print("CHILDREN", " ".join(str(p.pid) for p in children), flush=True)
        if sys.argv[2] == "shutdown":
            engine.shutdown()

    if sys.argv[3] == "trio":
        import trio
        trio.run(main)
    else:
        asyncio.run(main())
    """
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("ending", ["shutdown", "forgotten"])
def test_vllm_script_leaves_no_engine_process(tiny_model_dir: Path, backend: str, ending: str) -> None:
    """The multiprocess engine of a script that returns from main (with or without shutdown())
    is torn down before the loop closes, in order: the child is gone when the interpreter exits."""
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir), ending, backend],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TRIOLLM_MULTIPROCESS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "TOKENS 3" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    # An orderly stop (the Shutdown message, or the stop byte on the child's stdin when the loop
    # ended first and took the socket pump with it), not the SIGTERM fallback after the grace.
    assert "did not exit" not in proc.stderr and "killed by signal" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILDREN")]
    pids = [int(p) for p in line.split()[1:]]
    assert pids, "the engine core should have run in a child process"
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# ------------------------------------------------------------------ AsyncLLM surface


async def test_abort_is_a_coroutine(inproc_engine_args: Callable[..., AsyncEngineArgs]) -> None:
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        stream = await llm.add_request("victim", "Hello", LONG)
        await llm.abort("victim")
        outs = [out async for out in stream]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await llm.abort(["unknown", "victim"])  # unknown or finished ids: no-op
        assert llm.num_unfinished_requests == 0


async def test_pause_abort_holds_new_requests_until_resume(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        inflight = await llm.add_request("inflight", "Hello", LONG)
        await llm.pause_generation()  # mode="abort"
        assert await llm.is_paused()
        assert [o async for o in inflight][-1].outputs[0].finish_reason == "abort"
        held = await llm.add_request("held", "Hello", GREEDY)
        with anyio.move_on_after(0.3):
            await held.wait_finished()
        assert not held.finished  # not scheduled while paused
        stats = await llm.get_engine_stats()
        assert stats.num_running == stats.num_waiting == 0  # held in the frontend
        await llm.resume_generation()
        assert not await llm.is_paused()
        outs = [o async for o in held]
        assert len(outs[-1].outputs[0].token_ids) == 4


async def test_pause_wait_lets_inflight_finish(inproc_engine_args: Callable[..., AsyncEngineArgs]) -> None:
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        inflight = await llm.add_request("inflight", "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
        await llm.pause_generation(mode="wait", clear_cache=False)
        assert inflight.finished
        outs = [o async for o in inflight]
        assert outs[-1].outputs[0].finish_reason == "length"
        with pytest.warns(DeprecationWarning, match="mode"):
            await llm.pause_generation(wait_for_inflight_requests=True)
        await llm.resume_generation()


async def test_pause_keep_freezes_and_resumes(inproc_engine_args: Callable[..., AsyncEngineArgs]) -> None:
    async with AsyncLLM.from_engine_args(inproc_engine_args(output_chunk_size=1)) as llm:
        stream = await llm.add_request("kept", "Hello", LONG)
        first = await stream.get()  # running now
        await llm.pause_generation(mode="keep", clear_cache=False)
        stream.get_nowait()  # drop what arrived before the pause took effect
        with anyio.move_on_after(0.3):
            await stream.get()
            pytest.fail("a kept request must not advance while paused")
        stats = await llm.get_engine_stats()
        assert stats.num_running + stats.num_waiting == 1  # still in the core, with its blocks
        await llm.resume_generation()
        outs = [first] + [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "length"
        with pytest.raises(ValueError, match="mode: 'later' is not one of abort, wait, keep"):
            await llm.pause_generation(mode="later")  # type: ignore[arg-type]


async def test_do_log_stats_and_metrics(
    inproc_engine_args: Callable[..., AsyncEngineArgs], caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        await _drain(llm, "Hello", GREEDY, "1")
        with caplog.at_level(logging.INFO, logger="triollm"):
            await llm.do_log_stats()
        assert "Avg generation throughput" in caplog.text and "Running: 0 reqs" in caplog.text
        metrics = {m.name: m for m in await llm.get_metrics()}
        gen = metrics["vllm:generation_tokens"]
        assert isinstance(gen, Counter) and gen.value == 4
        assert isinstance(metrics["vllm:num_requests_running"], Gauge)
    quiet = AsyncLLM.from_engine_args(inproc_engine_args(disable_log_stats=True))
    caplog.clear()
    async with quiet:
        with caplog.at_level(logging.INFO, logger="triollm"):
            await quiet.do_log_stats()
    assert "throughput" not in caplog.text


async def test_spec_decode_metrics_and_stats_line(
    engine_args: Callable[..., AsyncEngineArgs], caplog: pytest.LogCaptureFixture
) -> None:
    """Speculation's counters from the real core, through either transport, in get_metrics()
    (vLLM's shapes: Counters and the per-position Vector) and vLLM's SpecDecoding line."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    async with AsyncLLM.from_engine_args(engine_args(speculative_config=spec)) as llm:
        prompt = {"prompt_token_ids": [7, 8, 9, 10] * 6}
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = [out async for out in llm.generate(prompt, params, "spec-1")]
        assert len(outs[-1].outputs[0].token_ids) == 24
        with caplog.at_level(logging.INFO, logger="triollm"):
            await llm.do_log_stats()
        metrics = {m.name: m for m in await llm.get_metrics()}
        drafts = metrics["vllm:spec_decode_num_drafts"]
        tokens = metrics["vllm:spec_decode_num_draft_tokens"]
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
        per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
        assert isinstance(drafts, Counter) and isinstance(tokens, Counter) and isinstance(accepted, Counter)
        assert isinstance(per_pos, Vector) and len(per_pos.values) == 3
        assert drafts.value > 0 and tokens.value >= drafts.value and sum(per_pos.values) == accepted.value
        assert "SpecDecoding metrics: Mean acceptance length:" in caplog.text


# ------------------------------------------------------------------ LLM


def test_llm_engine_enqueue_and_wait(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), max_model_len=128, multiprocess=False) as llm:
        assert isinstance(llm.llm_engine, LLMEngine)
        assert llm.llm_engine.model_config.vocab_size > 0
        ids = llm.enqueue(["Hello", "abc"], [GREEDY, SamplingParams(max_tokens=2, ignore_eos=True)], use_tqdm=False)
        assert len(set(ids)) == 2
        llm.llm_engine.add_request("direct", "xyz", GREEDY)
        outs = llm.wait_for_completion(use_tqdm=False)
        assert [o.request_id for o in outs] == [*ids, "direct"]
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2, 4]
        assert llm.wait_for_completion(use_tqdm=False) == []
        chat_ids = llm.enqueue_chat([{"role": "user", "content": "Hi"}], GREEDY)
        [chat] = llm.wait_for_completion(use_tqdm=False)
        assert chat.request_id == chat_ids[0] and chat.finished
        assert llm.reset_prefix_cache() is True
        names = {m.name: m.value for m in llm.get_metrics()}
        assert names["vllm:generation_tokens"] == 4 + 2 + 4 + 4
        assert names["vllm:num_requests_running"] == 0
