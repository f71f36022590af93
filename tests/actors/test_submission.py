"""Bad values are one request's problem: checked at submission through the real engine, on both
transports and both backends. Sampling params changed after construction, values the wire cannot
carry, requests over a per-request limit and requests that can never fit the KV cache fail alone
with a `ValueError` from `add_request`; the engine goes on serving. The sync `LLM` raises the
`ValueError` / `EngineDeadError` itself, never an `ExceptionGroup`."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from triollm import LLM
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.engine.execution.scripted_runner import fault_at_step
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams, StructuredOutputsParams
from triollm.testing import rewrite_adds

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

PROMPT = "Once upon a time there was"


def params(max_tokens: int = 4, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def big_schema(**changes: Any) -> StructuredOutputsParams:
    """A schema changed after construction to hold integers msgpack cannot carry."""
    so = StructuredOutputsParams(json={"type": "integer"})
    assert isinstance(so.json, dict)
    so.json.update(changes)
    return so


def mutated(**changes: Any) -> SamplingParams:
    sp = params()
    for name, value in changes.items():
        setattr(sp, name, value)
    return sp


async def run(llm: AsyncLLM, sp: SamplingParams, rid: str = "ok") -> int:
    tokens = 0
    async with aclosing(llm.generate(PROMPT, sp, rid)) as agen:
        async for out in agen:
            tokens = len(out.outputs[0].token_ids)
    return tokens


@pytest.fixture(scope="module")
async def small_llm(
    engine_args: Callable[..., AsyncEngineArgs], _warm_process: None
) -> AsyncIterator[AsyncLLM]:
    """4 KV blocks of 16 tokens (64 tokens) under max_model_len 256; at most 2 stop strings, n 2
    and 20,000 tokens held per request."""
    args = engine_args(num_gpu_blocks_override=4, block_size=16, max_stop_strings=2, max_n=2, max_request_tokens=20_000)
    async with AsyncLLM.from_engine_args(args) as llm:
        yield llm
    assert not llm.errored


@pytest.mark.parametrize(
    ("rid", "sp", "match"),
    [
        ("top_p", mutated(top_p=2), "top_p"),
        ("n0", mutated(n=0), "n must be >= 1"),
        ("max0", mutated(max_tokens=0), "max_tokens"),
        ("seed", mutated(seed=2**64), "seed"),
        ("top_k", mutated(top_k=2**64), "top_k"),
        ("stop-surrogate", mutated(stop=["\udc80"]), "stop"),
        ("id-\udc80", params(), "request_id"),
        ("stops", params(stop=["a", "b", "c"]), "stop: 3 strings exceed max_stop_strings=2"),
        ("n3", params(n=3), "n: 3 exceeds max_n=2"),
        ("kv", params(100), r"max_tokens: 100 .*KV cache"),
        ("kv-none", params(None), r"max_tokens: .*KV cache"),
        (
            "big-max",
            mutated(structured_outputs=big_schema(maximum=2**64 + 5)),
            r"structured_outputs\.json\.maximum: integers",
        ),
        ("big-default", mutated(structured_outputs=big_schema(default=10**30)), r"structured_outputs\.json\.default"),
        (
            "big-enum",
            mutated(structured_outputs=big_schema(enum=[1, -(2**63) - 1])),
            r"structured_outputs\.json\.enum\[1\]",
        ),
        ("x" * 513, params(), "request_id: 513 characters exceed the limit of 512"),
        (
            "fanout",
            params(n=2, stop_token_ids=[1] * 8000, allowed_token_ids=[1] * 8000),
            r"n: 2 sequences x .* exceed max_request_tokens=20000",
        ),
    ],
)
async def test_a_bad_request_fails_alone_at_submission(
    small_llm: AsyncLLM, rid: str, sp: SamplingParams, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await small_llm.add_request(rid, PROMPT, sp)
    assert small_llm.num_unfinished_requests == 0
    assert not small_llm.errored
    assert await run(small_llm, params(5)) == 5


async def test_priority_beyond_64_bits_fails_alone(small_llm: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="priority"):
        await small_llm.add_request("prio", PROMPT, params(), priority=2**64)
    assert await run(small_llm, params(3)) == 3
    assert not small_llm.errored


async def test_a_non_zero_priority_needs_the_priority_policy(small_llm: AsyncLLM) -> None:
    """vLLM's rule: with the default fcfs policy any client could jump the queue otherwise."""
    for priority in (-(2**62), 1):
        with pytest.raises(ValueError, match=r"priority: got .*scheduling_policy='fcfs'"):
            await small_llm.add_request("prio", PROMPT, params(), priority=priority)
    assert await run(small_llm, params(2)) == 2


async def test_a_request_the_wire_cannot_carry_fails_alone(
    engine_args: Callable[..., AsyncEngineArgs], transport: str
) -> None:
    """The backstop behind validation: an add whose encode fails (here: a priority set past the
    checks by a tap) ends that request with a `ValueError`; the transport, the engine and the
    other requests go on."""
    if transport != "multiprocess":
        pytest.skip("nothing is encoded in process")

    def past_the_checks(req: EngineCoreRequest) -> EngineCoreRequest:
        return msgspec.structs.replace(req, priority=2**70) if req.request_id.startswith("evil") else req

    async with AsyncLLM.from_engine_args(engine_args(), input_tap=rewrite_adds(past_the_checks)) as llm:
        async with anyio.create_task_group() as tg:
            counts: list[int] = []

            async def other() -> None:
                counts.append(await run(llm, params(6), "other"))

            tg.start_soon(other)
            with pytest.raises(ValueError, match="cannot be sent to the engine core"):
                await run(llm, params(3), "evil")
        assert counts == [6]
        assert await run(llm, params(2), "after") == 2
        assert llm.num_unfinished_requests == 0 and not llm.errored


@pytest.mark.parametrize(
    ("rid", "bad_words", "in_thread"),
    [
        ("few", ["hello", "world"], False),
        ("long", ["x" * 9000], True),  # one long word: the prompt is 6 words
        ("many", [f"w{i:05d}" for i in range(1500)], True),  # 9,000 characters in short words
        # 1,884 characters in 300 words of 1-12 letters: 600 tokenizer calls cost the rest.
        ("many-tiny", [chr(0x41 + i % 26) * (1 + i // 26) for i in range(300)], True),
    ],
)
async def test_bad_words_are_tokenized_off_the_event_loop_when_large(
    small_llm: AsyncLLM,
    monkeypatch: pytest.MonkeyPatch,
    rid: str,
    bad_words: list[str],
    in_thread: bool,
) -> None:
    """The worker-thread decision counts `bad_words` (each entry tokenized twice), not only the
    prompt: a short prompt with large bad words must not stall every other stream."""
    tokenizer = small_llm.get_tokenizer()
    encode = tokenizer.encode
    loop_thread = threading.get_ident()
    threads: set[bool] = set()  # True: an encode call ran off the event loop's thread

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.add(threading.get_ident() != loop_thread)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", spy)
    assert await run(small_llm, params(3, bad_words=bad_words), rid) == 3
    assert threads == {in_thread}


# ------------------------------------------------------------------------------ the sync LLM


@pytest.fixture(scope="module", params=["inproc-trio", "multiprocess-asyncio"])
def sync_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _llm(tiny_model_dir: Path, kind: str, **kw: Any) -> LLM:
    transport, backend = kind.split("-")
    return LLM(
        str(tiny_model_dir), max_model_len=128, multiprocess=transport == "multiprocess",
        backend=backend, **kw,
    )


def test_llm_generate_raises_the_value_error_itself(tiny_model_dir: Path, sync_kind: str) -> None:
    with _llm(tiny_model_dir, sync_kind) as llm:
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        sp.seed = 2**64
        with pytest.raises(ValueError, match="seed"):
            llm.generate(["a", "b"], sp, use_tqdm=False)
        # A schema the wire cannot carry: refused, and the LLM lives on (it used to die).
        big = SamplingParams(max_tokens=3)
        big.structured_outputs = big_schema(maximum=2**64 + 5)
        with pytest.raises(ValueError, match=r"structured_outputs\.json\.maximum"):
            llm.generate(["a", "b"], big, use_tqdm=False)
        ok = llm.generate(["a", "b"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in ok] == [3, 3]


def test_llm_generate_raises_engine_dead_error_itself(tiny_model_dir: Path, sync_kind: str) -> None:
    with _llm(tiny_model_dir, sync_kind, engine_core_factory=fault_at_step(2, scripted=True)) as llm:
        with pytest.raises(EngineDeadError):
            llm.generate(["a", "b", "c"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.generate("d", SamplingParams(max_tokens=5), use_tqdm=False)
