"""A grammar is its own request's cost (engine/structured_outputs.py, engine/core.py): it
compiles off the step while other requests keep stepping, an abort drops it mid-compile, any
error llguidance raises ends only its request, the caches are bounded in bytes, and a grammar
thousands of rules deep is checked and compiled without overflowing a thread's stack.

The compiles are held by a stand-in for llguidance (`Shim`: the real one, with `LLMatcher(...)`
waiting for `release`, and faults injected by grammar text), so the tests assert the order of
events, not durations. The real tiny model runs every step.
"""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import llguidance
import pytest

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.engine import structured_outputs
from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams, StructuredOutputsParams
from triollm.engine.structured_outputs import GrammarCompiler, SizedCache, check, grammar_text

S = StructuredOutputsParams
HOLD_S = 5.0  # a held compile goes on by itself after this (the old in-step compile then fails)


class Shim:
    """llguidance, with every compile (`LLMatcher(tokenizer, text)`) held until `release` is set
    and, for the grammar text `faulty`, a RuntimeError injected at `fault`: "compile", "mask"
    (computing the token mask) or "consume" (consuming a token)."""

    def __init__(self, *, held: bool = False, fault: str | None = None, faulty: str | None = None) -> None:
        self.release = threading.Event()
        if not held:
            self.release.set()
        self.started = threading.Event()  # a compile began
        self.compiled = threading.Event()  # a compile ended
        self.compiles = 0
        real, shim = llguidance.LLMatcher, self

        class LLMatcher:
            def __new__(cls, tokenizer: Any, text: str, **kwargs: Any) -> Any:
                shim.compiles += 1
                shim.started.set()
                shim.release.wait(HOLD_S)
                matcher = real(tokenizer, text, **kwargs)
                shim.compiled.set()
                if text != faulty or fault is None:
                    return matcher
                if fault == "compile":
                    raise RuntimeError("injected compile fault")
                return Faulty(matcher, fault)

        for name in ("grammar_from_json_schema", "grammar_from_regex", "validate_grammar_with_warnings"):
            setattr(LLMatcher, name, staticmethod(getattr(real, name)))
        self.LLMatcher = LLMatcher

    def __getattr__(self, name: str) -> Any:
        return getattr(llguidance, name)


class Faulty:
    """A matcher that raises RuntimeError (not llguidance's ValueError) at `fault`."""

    def __init__(self, matcher: Any, fault: str) -> None:
        self._matcher, self._fault = matcher, fault

    def deep_copy(self) -> Faulty:
        return Faulty(self._matcher.deep_copy(), self._fault)

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> Any:
        if self._fault == "mask":
            raise RuntimeError("injected mask fault")
        return self._matcher.unsafe_compute_mask_ptr(ptr, size)

    def consume_token(self, token: int) -> bool:
        if self._fault == "consume":
            raise RuntimeError("injected consume fault")
        return bool(self._matcher.consume_token(token))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)


def use(monkeypatch: pytest.MonkeyPatch, shim: Shim) -> Shim:
    monkeypatch.setattr(structured_outputs, "_llguidance", lambda: shim)
    return shim


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> Iterator[EngineCore]:
    args = EngineArgs(model=str(tiny_model_dir), seed=0, max_model_len=128, enforce_eager=True)
    core = EngineCore(args.create_engine_config())
    before = grammar_threads()
    yield core
    core.close()
    assert grammar_threads() <= before  # the core closed its grammar threads


@pytest.fixture(autouse=True)
def fresh_core(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that failed leaves nothing running in the shared core."""
    yield
    if "core" in request.fixturenames:
        shared: EngineCore = request.getfixturevalue("core")
        shared.abort_requests(list(shared.requests))


def grammar_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("triollm-grammar")}


def request(rid: str, max_tokens: int = 16, regex: str | None = None) -> EngineCoreRequest:
    so = None if regex is None else S(regex=regex)
    return EngineCoreRequest(
        rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=regex is None, structured_outputs=so)
    )


def drain(core: EngineCore) -> list[EngineCoreOutput]:
    outs: list[EngineCoreOutput] = []
    for _ in range(500):
        if not core.has_unfinished_requests():
            return outs
        outs += core.step()
    raise AssertionError(f"still unfinished: {sorted(core.requests)}")


def assert_empty(core: EngineCore) -> None:
    core.check_integrity()
    stats = core.statistics()
    assert not core.requests and not core.has_unfinished_requests()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_blocks)


def text_of(tok: Tokenizer, outs: list[EngineCoreOutput], rid: str) -> str:
    return tok.decode([t for o in outs if o.request_id == rid for t in o.new_token_ids])


# ------------------------------------------------------------------------------------ the core


def test_other_requests_step_while_a_grammar_compiles(
    core: EngineCore, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim = use(monkeypatch, Shim(held=True))
    core.add_request(request("slow", regex=r"slow[0-9]{3}"))
    core.add_request(request("plain", max_tokens=8))
    assert shim.started.wait(HOLD_S)
    plain: list[int] = []
    while len(plain) < 8:
        for o in core.step():
            assert o.request_id == "plain" and not shim.compiled.is_set()  # while the compile is held
            plain += o.new_token_ids
    assert core.statistics().num_waiting == 1  # the structured one, waiting for its grammar
    core.check_integrity()
    shim.release.set()
    outs = drain(core)
    assert [str(o.finish_reason) for o in outs if o.finish_reason is not None] == ["stop"]
    assert re.fullmatch(r"slow[0-9]{3}", text_of(tok, outs, "slow"))
    assert_empty(core)


def test_an_abort_drops_a_compiling_request(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    shim = use(monkeypatch, Shim(held=True))
    core.add_request(request("running", regex=r"abort[0-9]{2}"))  # its compile starts, held
    core.add_request(request("queued", regex=r"queued[0-9]{2}"))  # its compile waits behind it
    assert shim.started.wait(HOLD_S)
    assert core.step() == []  # nothing to run: it waited a moment for a grammar, and returned
    assert core.has_unfinished_requests()
    core.abort_requests(["running", "queued"])
    assert not shim.compiled.is_set()  # applied while the compile still runs
    assert_empty(core)
    shim.release.set()
    core.add_request(request("next", regex=r"next[0-9]{2}"))  # compiled after the dropped ones
    outs = drain(core)
    assert {o.request_id for o in outs} == {"next"} and outs[-1].finish_reason is not None
    assert shim.compiles == 2  # "running" (its result unused) and "next": "queued" never compiled
    assert_empty(core)


@pytest.mark.parametrize("fault", ["compile", "mask", "consume"])
def test_any_llguidance_error_ends_only_its_request(
    core: EngineCore, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    regex = rf"{fault}[0-9]{{4}}"
    use(monkeypatch, Shim(fault=fault, faulty=grammar_text(S(regex=regex))))
    core.add_request(request("bad", regex=regex))
    core.add_request(request("plain", max_tokens=6))
    outs = drain(core)  # no step raised
    (bad,) = [o for o in outs if o.request_id == "bad"]
    assert str(bad.finish_reason) == "error" and not bad.new_token_ids
    assert f"RuntimeError: injected {fault} fault" in str(bad.stop_reason)
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "plain") == 6
    assert_empty(core)
    core.add_request(request("after", regex=rf"after{fault}[0-9]"))  # the core keeps serving grammars
    assert re.fullmatch(rf"after{fault}[0-9]", text_of(tok, drain(core), "after"))


# ------------------------------------------------------------------------------------ the engine loop


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def llm(tiny_model_dir: Path, anyio_backend: str) -> AsyncIterator[AsyncLLM]:
    args = AsyncEngineArgs(model=str(tiny_model_dir), multiprocess=False, max_model_len=128, seed=0)
    before = grammar_threads()
    async with AsyncLLM.from_engine_args(args) as llm:
        yield llm
    assert not llm.errored and grammar_threads() <= before  # the core closed its grammar threads


async def tokens(llm: AsyncLLM, rid: str, sp: SamplingParams, shim: Shim | None = None) -> list[Any]:
    outs = []
    async with aclosing(llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, rid)) as agen:
        async for out in agen:
            assert shim is None or not shim.compiled.is_set()
            outs.append(out)
    return outs


@pytest.mark.anyio
async def test_the_engine_loop_streams_while_a_grammar_compiles_and_waits_for_it(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    shim = use(monkeypatch, Shim(held=True))
    structured = SamplingParams(max_tokens=16, structured_outputs=S(regex=rf"{anyio_backend}[0-9]{{2}}"))
    slow: list[Any] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def run_slow() -> None:
                slow.extend(await tokens(llm, "slow", structured))

            tg.start_soon(run_slow)
            assert await anyio.to_thread.run_sync(shim.started.wait, HOLD_S)
            plain = await tokens(llm, "plain", SamplingParams(max_tokens=8, ignore_eos=True), shim)
            assert len(plain[-1].outputs[0].token_ids) == 8  # every token came while the compile ran
            await anyio.sleep(0.2)  # nothing to run but the compile: the loop must not go idle
            shim.release.set()
    assert slow[-1].outputs[0].finish_reason == "stop"
    assert re.fullmatch(rf"{anyio_backend}[0-9]{{2}}", slow[-1].outputs[0].text)


@pytest.mark.anyio
async def test_the_engine_loop_aborts_a_compiling_request(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    shim = use(monkeypatch, Shim(held=True))
    with anyio.fail_after(30):
        stream = await llm.add_request(
            "doomed",
            {"prompt_token_ids": [5, 6]},
            SamplingParams(structured_outputs=S(regex=rf"doomed{anyio_backend}")),
        )
        assert await anyio.to_thread.run_sync(shim.started.wait, HOLD_S)
        await llm.abort("doomed")
        stream.close()
        stats = await llm.get_engine_stats()  # answered after the abort was applied
        assert not shim.compiled.is_set()
        assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_blocks)
        await llm.check_integrity()
        shim.release.set()
        assert (
            len((await tokens(llm, "after", SamplingParams(max_tokens=3, ignore_eos=True)))[-1].outputs[0].token_ids)
            == 3
        )
    assert llm.num_unfinished_requests == 0


# ------------------------------------------------------------------------------------ caches and limits


def test_the_compiled_grammar_cache_is_bounded_in_bytes(tiny_model_dir: Path) -> None:
    compiler = GrammarCompiler(tiny_model_dir, 384)
    regexes = [f"bytes{i}[a-z]{{{i + 1}}}" for i in range(6)]
    texts = [grammar_text(S(regex=r)) for r in regexes]
    cost = [len(t) * structured_outputs._COMPILED_BYTES_PER_CHAR + structured_outputs._ENTRY_BYTES for t in texts]
    compiler._compiled.max_bytes = sum(cost[-3:])  # room for the last three, by their estimates
    for r in regexes:
        compiler.matcher(S(regex=r), [0])
    cache = compiler._compiled
    assert [t in cache for t in texts] == [False, False, False, True, True, True]
    assert cache.num_bytes == sum(cost[-3:]) <= cache.max_bytes and len(cache) == 3
    compiler._compiled.max_bytes = cost[0] - 1  # a grammar larger than the whole cache is not kept
    compiler.matcher(S(regex=regexes[0]), [0])
    assert len(cache) == 0 and cache.num_bytes == 0


def test_sized_cache_evicts_the_least_recently_used_by_bytes_and_by_entries() -> None:
    cache: SizedCache[str, int] = SizedCache(max_bytes=100, max_entries=3)
    for key, size in (("a", 40), ("b", 40), ("c", 10)):
        cache.put(key, 0, size)
    assert cache.get("a") == 0  # "a" used: "b" is now the oldest
    cache.put("d", 30, 30)  # 120 bytes: "b" goes
    assert ("a" in cache, "b" in cache, "c" in cache, "d" in cache) == (True, False, True, True)
    cache.put("e", 1, 1)  # a fourth entry: "c", the oldest, goes
    assert sorted(cache._entries) == ["a", "d", "e"] and cache.num_bytes == 71


def test_the_validation_cache_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [grammar_text(S(regex=f"valid{i}[0-9]+")) for i in range(4)]
    budget = 2 * (len(texts[0]) + structured_outputs._ENTRY_BYTES)
    monkeypatch.setattr(structured_outputs, "_VALIDATED", SizedCache(budget, 256))
    for i in range(4):
        check(S(regex=f"valid{i}[0-9]+"))
    cache = structured_outputs._VALIDATED
    assert [t in cache for t in texts] == [False, False, True, True] and cache.num_bytes <= budget


def test_a_grammar_thousands_of_rules_deep_is_checked_and_compiled(tiny_model_dir: Path) -> None:
    """Each rule refers to the next: llguidance recurses once per rule, past what a default 8 MiB
    thread stack holds (a segfault) but well within the grammar threads' stacks."""
    depth = 6000
    lark = "start: r0\n" + "".join(f'r{i}: "k" r{i + 1}?\n' for i in range(depth)) + f'r{depth}: "end"\n'
    so = S(grammar=lark)
    assert check(so)
    compiler = GrammarCompiler(tiny_model_dir, 384)
    try:
        assert compiler.submit(so, [0]).result(timeout=30).error is None
    finally:
        compiler.close()


def test_grammars_over_the_limits_are_refused_naming_the_field(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    too_long = "a" * (structured_outputs.MAX_GRAMMAR_CHARS + 1)
    with pytest.raises(ValueError, match=rf"structured_outputs\.regex: {len(too_long)} characters, more than the"):
        check(S(regex=too_long))
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: its grammar is \d+ characters"):
        check(S(choice=["x" * 1000] * 600))
    # llguidance's limits apply to validation and to the core's compile alike.
    monkeypatch.setitem(structured_outputs.PARSER_LIMITS, "max_grammar_size", 10)
    so = S(choice=[f"limit{i}" for i in range(50)])
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: invalid choice list: .*grammar size"):
        check(so)
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: .*grammar size"):
        GrammarCompiler(tiny_model_dir, 384).matcher(so, [0])
