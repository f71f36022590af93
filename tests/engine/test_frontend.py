"""The `Frontend` alone: a hypothesis state machine drives its request table through adds,
aborts, outputs, request errors, pause / resume, releases and the engine's death, against a
model of the core, with the invariants of issue 21:

- every stream ends exactly once (its finished output or its error; nothing after it);
- the queued-token count equals the prompt tokens of the sent (or held) sequences that have
  produced no output yet;
- no core request id is ever used twice;
- `check_integrity()` holds after every step.

Plus a few plain tests of what the state machine cannot see (busy, duplicate ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from triollm.engine.config import LimitsConfig
from triollm.engine.frontend import Frontend, InputProcessor, Phase
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest, FinishReason
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

IDS = ["a", "b", "c", "d"]
PROMPTS = ["Hello", "The capital of France is", "one two three four five six"]


@dataclass(eq=False)
class Sink:
    """A consumer's end of one request: asserts that nothing arrives after the end."""

    request_id: str
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return bool(self.errors) or any(o.finished for o in self.outputs)

    def put(self, output: RequestOutput) -> None:
        assert not self.ended, f"{self.request_id}: an output after the end"
        assert output.request_id == self.request_id
        self.outputs.append(output)

    def put_error(self, error: BaseException) -> None:
        assert not self.ended, f"{self.request_id}: an error after the end"
        self.errors.append(error)


class FrontendMachine(RuleBasedStateMachine):
    def __init__(self, inp: InputProcessor) -> None:
        super().__init__()
        self.inp = inp

    @initialize()
    def start(self) -> None:
        self.fe = Frontend(self.inp)
        self.sinks: dict[str, Sink] = {}  # by user id: the sink that owns it in the table
        self.all_sinks: list[Sink] = []  # every sink of a request that was added
        self.core: dict[str, int] = {}  # what the core runs: core id -> tokens left
        self.late: set[str] = set()  # aborted here, the core may still send one output
        self.prompt_len: dict[str, int] = {}  # core id -> prompt tokens (queued until output)
        self.queued: set[str] = set()
        self.used_core_ids: set[str] = set()
        self.owner: dict[str, str] = {}  # core id -> user id
        self.dead = False

    # ------------------------------------------------------------------ helpers

    def _send(self, requests: list[EngineCoreRequest]) -> None:
        for req in requests:
            assert req.request_id not in self.core
            assert req.sampling_params.max_tokens is not None
            self.core[req.request_id] = req.sampling_params.max_tokens

    def _abort_in_core(self, core_ids: list[str]) -> None:
        for cid in core_ids:
            assert cid in self.core, f"abort of {cid}, which the core does not run"
            del self.core[cid]
            self.late.add(cid)
            self.queued.discard(cid)

    def _ended(self, rid: str) -> None:
        """Request `rid` ended here (abort, release, error): none of its sequences is queued."""
        self.queued -= {cid for cid in self.queued if self.owner[cid] == rid}

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: not self.dead)
    @rule(
        rid=st.sampled_from(IDS),
        prompt=st.sampled_from(PROMPTS),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 6),
        kind=st.sampled_from(list(RequestOutputKind)),
        how=st.sampled_from(["add", "abort-while-adding", "discard"]),
    )
    def add(self, rid: str, prompt: str, n: int, max_tokens: int, kind: RequestOutputKind, how: str) -> None:
        sink = Sink(rid)
        if rid in self.sinks:
            with pytest.raises(ValueError, match="already running"):
                self.fe.open(rid, sink)
            return
        state = self.fe.open(rid, sink)
        params = SamplingParams(max_tokens=max_tokens, n=n, output_kind=kind, ignore_eos=True, seed=1)
        processed = self.fe.process(state, prompt, params)
        if how == "discard":  # the shell failed to add it: forgotten, no output
            self.fe.discard(rid)
            assert self.fe.get(rid) is None and not sink.outputs and not sink.errors
            return
        if how == "abort-while-adding":
            assert self.fe.abort(rid) == []
        self.sinks[rid] = sink
        self.all_sinks.append(sink)
        sent = self.fe.add(processed)
        ids = [r.request_id for r in processed.core_requests]
        assert not self.used_core_ids & set(ids), "a core id was used twice"
        self.used_core_ids.update(ids)
        if how == "abort-while-adding":
            assert sent == [] and sink.ended and sink.outputs[-1].outputs[0].finish_reason == "abort"
            return
        for cid in ids:
            self.owner[cid] = rid
            self.prompt_len[cid] = len(processed.prompt_token_ids)
            self.queued.add(cid)
        if self.fe.paused:
            assert sent == [] and self.fe.get(rid).phase is Phase.HELD  # type: ignore[union-attr]
        else:
            assert sent == processed.core_requests
        self._send(sent)

    @precondition(lambda self: not self.dead)
    @rule(rid=st.sampled_from([*IDS, "unknown"]))
    def abort(self, rid: str) -> None:
        sink = self.sinks.get(rid)
        to_abort = self.fe.abort(rid)
        self._abort_in_core(to_abort)
        self._ended(rid)
        if sink is not None:
            assert sink.ended

    @rule(rid=st.sampled_from(IDS))
    def release(self, rid: str) -> None:
        sink = self.sinks.pop(rid, None)
        if sink is None:
            assert self.fe.release(rid, Sink(rid)) == []  # a stale handle changes nothing
            return
        self._abort_in_core(self.fe.release(rid, sink))
        self._ended(rid)
        assert self.fe.get(rid) is None
        assert sink.ended or self.dead

    @precondition(lambda self: not self.dead)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One core step: some running sequences advance (and late outputs of aborted ones)."""
        running = sorted(self.core)
        chosen = data.draw(st.lists(st.sampled_from(running), unique=True)) if running else []
        late = sorted(self.late)
        outputs = []
        for cid in chosen:
            self.core[cid] -= 1
            finished = self.core[cid] == 0
            outputs.append(EngineCoreOutput(cid, [7], finish_reason=FinishReason.LENGTH if finished else None))
            if finished:
                del self.core[cid]
            self.queued.discard(cid)
        outputs += [EngineCoreOutput(cid, [7]) for cid in late]  # ignored by the frontend
        self.late.clear()
        result = self.fe.on_outputs(outputs)
        assert result.reqs_to_abort == []  # no stop strings here

    @precondition(lambda self: not self.dead and bool(self.core))
    @rule(data=st.data())
    def request_error(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.core)))
        del self.core[cid]
        self.queued.discard(cid)
        others = self.fe.on_request_error(cid, ValueError("the core refused it"))
        self._abort_in_core(others)
        rid = self.owner[cid]
        self._ended(rid)
        assert self.sinks[rid].errors

    @precondition(lambda self: not self.dead)
    @rule()
    def pause(self) -> None:
        self.fe.pause()

    @precondition(lambda self: not self.dead)
    @rule()
    def resume(self) -> None:
        self._send(self.fe.resume())

    @precondition(lambda self: not self.dead)
    @rule()
    def die(self) -> None:
        self.fe.fail(lambda: RuntimeError("the engine died"))
        self.dead = True
        self.core.clear()
        self.queued.clear()
        for sink in self.sinks.values():
            assert sink.ended

    # ------------------------------------------------------------------ invariants

    @invariant()
    def table_is_consistent(self) -> None:
        if not hasattr(self, "fe"):
            return
        self.fe.check_integrity()
        stats = self.fe.statistics()
        expected = sum(self.prompt_len[cid] for cid in self.queued)
        assert stats.queued_prompt_tokens == expected, (stats, sorted(self.queued))
        assert stats.num_requests == len(self.sinks)
        if not self.dead:
            running = {cid for rid in self.sinks for cid in self.fe.unfinished_core_ids(rid)}
            held = {r.request_id for rid in self.sinks for r in (self.fe.get(rid).pending)}  # type: ignore[union-attr]
            assert running == set(self.core) | held, (sorted(running), sorted(self.core), sorted(held))

    def teardown(self) -> None:
        if not hasattr(self, "fe"):
            return
        for rid in list(self.sinks):
            self.release(rid)
        assert self.fe.num_requests == 0 and self.fe.num_sequences == 0
        assert self.fe.statistics().queued_prompt_tokens == 0
        self.fe.check_integrity()
        for sink in self.all_sinks:  # every stream ended, exactly once (Sink asserts "once")
            assert sink.ended, sink


def test_the_request_table_under_random_operations(model_config: ModelConfig, tok: Tokenizer) -> None:
    inp = InputProcessor(model_config, tok)
    run_state_machine_as_test(
        lambda: FrontendMachine(inp),
        settings=settings(
            max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


# ---------------------------------------------------------------------------------- plain tests


def _limits(**kw: int | None) -> LimitsConfig:
    base: dict[str, int | None] = dict(
        max_num_queued_reqs=None, max_num_queued_tokens=None, max_request_tokens=1 << 20, max_stop_strings=8,
        max_stop_string_len=64, max_token_list_len=64, max_prompts_per_request=8, max_n=8,
    )
    return LimitsConfig(**{**base, **kw})  # type: ignore[arg-type]


def _add(fe: Frontend, rid: str, n: int = 1) -> list[EngineCoreRequest]:
    state = fe.open(rid, Sink(rid))
    return fe.add(fe.process(state, "Hello", SamplingParams(max_tokens=4, n=n)))


def test_busy_counts_queued_tokens_until_the_first_output(model_config: ModelConfig, tok: Tokenizer) -> None:
    fe = Frontend(InputProcessor(model_config, tok), limits=_limits(max_num_queued_tokens=5), max_num_seqs=4)
    [first] = _add(fe, "a")
    prompt_len = len(first.prompt_token_ids)
    state = fe.open("b", Sink("b"))
    second = fe.process(state, "Hello", SamplingParams(max_tokens=4))
    assert prompt_len * 2 > 5 and "max_num_queued_tokens=5" in (fe.busy(second) or "")
    fe.on_outputs([EngineCoreOutput(first.request_id, [3])])  # "a" is past the queue now
    assert fe.busy(second) is None
    fe.check_integrity()


def test_busy_counts_sequences_beyond_max_num_seqs(model_config: ModelConfig, tok: Tokenizer) -> None:
    fe = Frontend(InputProcessor(model_config, tok), limits=_limits(max_num_queued_reqs=1), max_num_seqs=2)
    _add(fe, "a", n=2)
    state = fe.open("b", Sink("b"))
    one, three = (fe.process(state, "Hi", SamplingParams(max_tokens=2, n=k)) for k in (1, 3))
    assert fe.busy(one) is None  # 3 sequences, 1 beyond max_num_seqs
    assert "max_num_queued_reqs=1" in (fe.busy(three) or "")


def test_core_ids_are_tagged_once_and_never_reused(model_config: ModelConfig, tok: Tokenizer) -> None:
    fe = Frontend(InputProcessor(model_config, tok))
    seen: set[str] = set()
    for _ in range(3):
        ids = [r.request_id for r in _add(fe, "same", n=2)]
        assert [i.rsplit("#", 1)[0] for i in ids] == ["0_same", "1_same"]
        assert not seen & set(ids)
        seen.update(ids)
        state = fe.get("same")
        assert state is not None
        fe.release("same", state.sink)
    assert fe.num_requests == 0
