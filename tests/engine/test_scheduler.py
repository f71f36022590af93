"""Block manager and scheduler, without a model: hypothesis state machines and unit tests."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from triollm.engine.config import SchedulerConfig
from triollm.engine.request import EngineCoreRequest, FinishReason, Logprobs, RunnerOutput
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams
from triollm.engine.scheduling import scheduler as scheduler_module
from triollm.engine.scheduling.block_manager import BlockManager, hash_full_blocks
from triollm.engine.scheduling.request_state import Request, RequestStatus
from triollm.engine.scheduling.scheduler import (
    FAIR_WAIT_STEPS,
    MAX_PREFILL_STEP_S,
    MAX_STEP_RATIO,
    MAX_WAVE_HOLD_S,
    TARGET_STEP_RATIO,
    WAVE_JOIN_TOKENS,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from triollm.engine.scheduling.step_cost import StepCost
from triollm.lora.request import LoRARequest

EOS = 99


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, t: float = 0.0, lora: int | None = None
) -> Request:
    adapter = None if lora is None else LoRARequest(f"lora{lora}", lora, f"/adapters/{lora}")
    core = EngineCoreRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=[EOS], arrival_time=t, priority=priority,
        lora_request=adapter,
    )  # fmt: skip
    return Request(core, max_tokens)


def run_step(sched: Scheduler, next_token, kv: dict[int, tuple[int, ...]] | None = None) -> list[Request]:
    """One step with a fake model: returns the requests that finished. With `kv` (slot -> the
    prefix whose K/V it holds) it writes each fed token's slot and checks every key the step's
    queries attend to (those inside the block manager's window) holds its own prefix, in a
    block some request still references."""
    out = sched.schedule()
    if kv is not None:
        for item in out.scheduled:
            _fake_attention(sched.blocks, item.request, item.num_computed_tokens, item.num_new_tokens, kv)
    finished = []
    for item in out.scheduled:
        sched.advance(item)
        if item.samples:
            req = item.request
            tok = next_token(req)
            req.append_output_token(tok)
            status = sched.check_stop(req, tok)
            if status is not None:
                sched.finish(req, status)
                finished.append(req)
    return finished


def _fake_attention(bm: BlockManager, req: Request, start: int, n: int, kv: dict[int, tuple[int, ...]]) -> None:
    bs, tokens = bm.block_size, req.all_token_ids
    for p in range(start, start + n):
        kv[req.block_ids[p // bs] * bs + p % bs] = tuple(tokens[: p + 1])
    first = 0 if bm.window is None else max(0, start - bm.window + 1)  # the chunk's first query
    for j in range(first, start + n):
        block = req.block_ids[j // bs]
        assert j // bs >= req.num_released_blocks and bm._ref[block] > 0, f"{req}: reads freed block {block}"
        assert kv.get(block * bs + j % bs) == tuple(tokens[: j + 1]), f"{req}: wrong KV at position {j}"


# ------------------------------------------------------------------------ block manager units


def test_prefix_cache_keyed_by_adapter() -> None:
    """K/V computed under one adapter is never reused under another or the base model (the
    same tokens give other keys and values there); under the same adapter it is."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(10)), lora=1)
    assert bm.allocate(a, 3)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    bm.free(a)
    for rid, lora, hit in (("other", 2, 0), ("base", None, 0), ("same", 1, 8)):
        r = make_request(rid, list(range(10)), lora=lora)
        assert bm.match_prefix(r) == hit, rid
        bm.free(r)
    # The same id with another path is another adapter (a reused id must not serve stale K/V).
    moved = make_request("moved", list(range(10)))
    moved.lora_request = LoRARequest("lora1", 1, "/adapters/elsewhere")
    assert bm.match_prefix(moved) == 0


def test_at_most_max_loras_adapters_run_at_once() -> None:
    """max_loras=2: adapters 1 and 2 run, a request under adapter 3 waits while base-model and
    adapter-1 requests behind it are admitted past it; once adapter 1's requests finish, 3 runs."""
    sched = Scheduler(SchedulerConfig(8, 512, True, max_loras=2), BlockManager(num_blocks=64, block_size=4), 256)
    reqs = [
        make_request("a1", [1, 2, 3], max_tokens=2, t=0, lora=1),
        make_request("b2", [1, 2, 4], max_tokens=6, t=1, lora=2),
        make_request("c3", [1, 2, 5], max_tokens=2, t=2, lora=3),
        make_request("d0", [1, 2, 6], max_tokens=6, t=3),
        make_request("e1", [1, 2, 7], max_tokens=2, t=4, lora=1),
    ]
    for r in reqs:
        sched.add_request(r)
    assert set(_chunks(sched)) == {"a1", "b2", "d0", "e1"}
    assert [r.request_id for r in sched.waiting] == ["c3"]
    running: list[set[int]] = []
    for _ in range(12):
        run_step(sched, lambda r: 5)
        running.append({r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None})
        if not sched.has_unfinished_requests():
            break
    assert all(len(ids) <= 2 for ids in running)
    assert any(3 in ids for ids in running)
    assert not sched.has_unfinished_requests()


def test_prefix_cache_hit_and_lru_eviction() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(10)))
    assert bm.match_prefix(a) == 0
    assert bm.allocate(a, 3)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # two full blocks cached
    bm.free(a)
    bm.check_integrity([])
    b = make_request("b", list(range(9)) + [77])
    assert bm.match_prefix(b) == 8  # both full blocks hit, the partial one not
    assert bm.statistics().prefix_cache_hits == 8
    bm.check_integrity([b])
    # A full-length identical prompt leaves its last token to compute.
    c = make_request("c", list(range(8)))
    assert bm.match_prefix(c) == 4
    bm.check_integrity([b, c])
    bm.free(b)
    bm.free(c)
    # Allocating everything evicts every cached hash.
    d = make_request("d", [1] * 30)
    assert bm.allocate(d, 6)
    assert bm.statistics().num_cached_blocks == 0
    assert not bm.allocate(d, 1)
    bm.check_integrity([d])


def test_check_integrity_catches_a_leak() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", [1, 2, 3])
    assert bm.allocate(a, 1)
    with pytest.raises(AssertionError):
        bm.check_integrity([])  # a holds a block nobody accounts for


def test_preemption_recomputes_and_completes() -> None:
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(8, 64, True), bm, max_model_len=64)
    reqs = [make_request(f"r{i}", [i + 1] * 6, max_tokens=8, t=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    done: list[Request] = []
    for _ in range(200):
        done += run_step(sched, lambda r: len(r.output_token_ids) + 1)
        bm.check_integrity(sched.live_requests())
        if not sched.has_unfinished_requests():
            break
    assert sched.num_preemptions > 0
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    for r in done:
        assert r.output_token_ids == list(range(1, 9))
        assert r.status == RequestStatus.FINISHED_LENGTH
    assert bm.num_free_blocks == 5


def test_priority_order_and_chunked_prefill_budget() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=5, enable_chunked_prefill=True), bm, 64)
    sched.add_request(make_request("low", [1] * 12, priority=5, t=0))
    sched.add_request(make_request("high", [2] * 12, priority=-1, t=1))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("high", 5)]
    assert not out.scheduled[0].samples


def test_long_prefill_token_threshold_caps_each_prompt_per_step() -> None:
    """vLLM's --long-prefill-token-threshold: a prompt takes at most that many tokens per step,
    so the decodes running beside it keep a steady step time; decodes are unaffected."""
    bm = BlockManager(num_blocks=64, block_size=4)
    config = SchedulerConfig(4, 64, True, long_prefill_token_threshold=6)
    sched = Scheduler(config, bm, 64)
    sched.add_request(make_request("a", [1] * 3, max_tokens=50))
    for _ in range(1 + WAVE_JOIN_TOKENS):
        run_step(sched, lambda r: 5)  # "a" prefilled (3 <= 6) and decoding (a cadence: no wave)
    sched.add_request(make_request("b", [2] * 20))
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        chunks.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        for item in out.scheduled:
            sched.advance(item)
            if item.samples:
                item.request.append_output_token(5)
    assert [c.get("b") for c in chunks] == [6, 6, 6, 2]
    assert all(c.get("a") == 1 for c in chunks[:3])


# ------------------------------------------------------------------------ the prefill budget


def test_step_cost_fits_a_line_and_keeps_it_through_alike_steps() -> None:
    cost = StepCost()
    assert cost.fit is None
    for tokens in [200, 16, 16, 48, 16, 80] * 5:
        cost.observe(tokens, 0.1 + 0.002 * tokens)
    assert cost.fit is not None
    assert cost.fit.seconds_per_step == pytest.approx(0.1)
    assert cost.fit.seconds_per_token == pytest.approx(0.002)
    for _ in range(150):  # decode-only steps, all alike and noisy: the spread fades
        cost.observe(16, 0.5 if cost.num_steps % 2 else 0.05)
    fitted = cost.fit
    for _ in range(100):  # and then no line is drawn through them: the last good one stays
        cost.observe(16, 0.5 if cost.num_steps % 2 else 0.05)
    assert cost.fit is fitted
    cost.observe(0, 1.0)  # no tokens, or no time: ignored
    cost.observe(16, 0.0)
    assert cost.num_steps == 280
    with pytest.raises(ValueError, match="alpha"):
        StepCost(alpha=0)


def test_a_steps_prompt_tokens_are_what_is_not_a_decode() -> None:
    """What the cost model is told of a step (`SchedulerOutput.num_prompt_tokens`): every request's
    own tokens but a decode's one; a prompt chunk of one token that samples nothing is a prompt's,
    and a decode's drafts are not."""
    prompt = make_request("p", [7] * 10)
    decode = make_request("d", [1, 2])
    decode.num_computed_tokens = 2
    decode.append_output_token(5)  # one token to feed, then it samples
    out = SchedulerOutput(
        [
            ScheduledRequest(prompt, 1, 3),  # a one-token chunk mid-prompt: samples nothing
            ScheduledRequest(decode, 3, 2, num_draft=2),  # a decode with two drafts
        ],
        [],
    )
    assert out.num_prompt_tokens == 1 and out.carries_prompt and out.num_tokens == 4
    last = SchedulerOutput([ScheduledRequest(prompt, 1, 9)], [])  # the prompt's last token: it samples
    assert last.num_prompt_tokens == 0 and not last.carries_prompt
    cost = StepCost()
    cost.observe(4, 0.5, prefill=True, prompt_tokens=1)
    cost.observe(1, 0.3)
    assert cost.latest_prefill == (4, 0.5) and cost.latest_prompt_tokens == 1 and cost.latest_decode == (1, 0.3)
    line = cost.line()  # no fit yet: through the two latest steps
    assert line is not None and line.seconds(1) == pytest.approx(0.3) and line.seconds(4) == pytest.approx(0.5)


def _timed(sched: Scheduler, a: float, b: float, tokens: tuple[int, ...] = (200, 16, 48, 16)) -> None:
    """Teach the scheduler's cost model `seconds = a + b * tokens` (a fake clock: no model runs)."""
    for n in tokens * 3:
        sched.step_cost.observe(n, a + b * n)


def _decoding(sched: Scheduler, n: int) -> list[Request]:
    """n running requests, each past its prompt and `WAVE_JOIN_TOKENS` decodes (the next step is
    a decode for all, and they stream with a cadence: no wave holds them)."""
    reqs = [make_request(f"d{i}", [1, 2, 3], max_tokens=50, t=i) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(1 + WAVE_JOIN_TOKENS):
        run_step(sched, lambda r: 5)
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in reqs)
    return reqs


def _chunks(sched: Scheduler, seconds: float | None = None) -> dict[str, int]:
    """One step (recorded as taking `seconds`, what the engine core reports, where given); the
    tokens each request took."""
    out = sched.schedule()
    if seconds is not None:
        sched.record_step(out, seconds)
    for item in out.scheduled:
        sched.advance(item)
        if item.samples:
            item.request.append_output_token(5)
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_prefill_budget_keeps_steps_near_the_decode_step() -> None:
    """Beside 16 decodes a step costing 0.1 s + 1 ms/token takes (1.5 * 0.117 - 0.116) / 0.001 =
    59 prompt tokens (1.5x the decode-only step of the load, 17 requests, less the 16 decodes'
    step); the prompt still finishes, and its chunks shrink to fit no further."""
    sched = Scheduler(SchedulerConfig(32, 2048, True), BlockManager(num_blocks=256, block_size=16), 1024)
    _decoding(sched, 16)
    _timed(sched, 0.1, 0.001)
    sched.add_request(make_request("p", [7] * 300, t=99))
    steps = [_chunks(sched) for _ in range(6)]
    assert [s.get("p") for s in steps] == [59, 59, 59, 59, 59, 5]
    assert all(sum(v == 1 for v in s.values()) == 16 for s in steps)  # every decode, every step
    # The predicted step: within TARGET_STEP_RATIO of the load's decode-only one.
    assert 0.1 + 0.001 * (16 + 59) <= TARGET_STEP_RATIO * (0.1 + 0.001 * 17)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_prefill_budget_grows_with_the_wait() -> None:
    """Fair admission: beside 16 decodes a newcomer's prompt gets 1.5x the load's decode-only step
    (17 rows, 0.117 s): 59 tokens. The ratio grows with the longer of two waits: the queue's
    head's (no sequence slot free) and a running prompt's own time since it was queued. Half of
    FAIR_WAIT_STEPS such steps give 1.65x (77 tokens), FAIR_WAIT_STEPS and more 1.8x (94), never
    more; with neither (the queue empty or its head a newcomer, the prompt young), 1.5x again."""
    load_step = 0.1 + 0.001 * 17

    def budget(ratio: float) -> int:
        return int((ratio * load_step - (0.1 + 0.001 * 16)) / 0.001 + 1e-6)

    def decoding_16(clock: FakeClock) -> Scheduler:
        sched = Scheduler(SchedulerConfig(17, 2048, True), BlockManager(num_blocks=512, block_size=16), 2048, clock)
        _decoding(sched, 16)
        _timed(sched, 0.1, 0.001)
        return sched

    clock = FakeClock()
    sched = decoding_16(clock)
    sched.add_request(make_request("p", [7] * 4000, t=99))
    assert _chunks(sched)["p"] == budget(TARGET_STEP_RATIO) == 59
    clock.now += FAIR_WAIT_STEPS / 2 * load_step  # its own prefill's time
    assert _chunks(sched)["p"] == budget((TARGET_STEP_RATIO + MAX_STEP_RATIO) / 2) == 77
    clock.now += FAIR_WAIT_STEPS * load_step
    assert _chunks(sched)["p"] == budget(MAX_STEP_RATIO) == 94
    clock.now += 3600
    assert _chunks(sched)["p"] == 94

    clock = FakeClock()
    sched = decoding_16(clock)
    sched.add_request(make_request("p", [7] * 4000, t=99))
    assert _chunks(sched)["p"] == 59
    p = next(r for r in sched.running if r.request_id == "p")
    sched.add_request(make_request("q", [8] * 1000, t=100))  # the 18th: waits for a slot
    assert _chunks(sched)["p"] == 59
    clock.now += FAIR_WAIT_STEPS / 2 * load_step
    p.waiting_since = clock.now  # keep p young: the queue's wait alone
    assert _chunks(sched)["p"] == 77
    q = sched.waiting.peek()
    sched.finish(q, RequestStatus.FINISHED_ABORTED)  # the queue empties: back to 1.5x
    assert _chunks(sched)["p"] == 59
    sched.add_request(make_request("r", [9] * 1000, t=101))  # a newcomer: no wait yet
    assert _chunks(sched)["p"] == 59


@pytest.mark.parametrize("ahead", [0, 3])
def test_a_wave_takes_the_whole_budget_and_streams_that_came_before_keep_their_ratio(ahead: int) -> None:
    """Issue 41's c16 start-up: one request arrives alone, 15 arrive during its prompt step (or
    `ahead` decode steps later: a served burst's first request reaches the core alone, and a
    cached prompt makes its prefill short). That is a wave: the one with a few tokens waits for
    its next while the others' prompts take the whole budget (the time bound aside), in two
    steps, and then all 16 decode. A wave holds a stream once: the next prompt meets a cadence.
    A stream that decoded before prompts arrive (more than `WAVE_JOIN_TOKENS` tokens) is no
    wave, however many they are: its steps keep their ratio."""
    sched = Scheduler(SchedulerConfig(17, 2048, True), BlockManager(num_blocks=1024, block_size=16), 1024)
    sched.add_request(make_request("first", [7] * 200, max_tokens=50))
    assert _chunks(sched, 0.15) == {"first": 200}
    for _ in range(ahead):
        assert _chunks(sched, 0.03) == {"first": 1}
    for i in range(15):
        sched.add_request(make_request(f"b{i}", [8 + i] * 200, max_tokens=50, t=1 + i))
    chunks = _chunks(sched, 1.3)
    assert "first" not in chunks and sum(chunks.values()) == 2048  # the whole budget, no decode
    chunks = _chunks(sched, 0.7)
    assert set(chunks) == {f"b{i}" for i in range(10, 15)} and sum(chunks.values()) == 15 * 200 - 2048
    assert _chunks(sched, 0.04) == {"first": 1, **{f"b{i}": 1 for i in range(15)}}  # the wave is in
    sched.add_request(make_request("late", [30] * 200, max_tokens=50, t=20))
    chunks = _chunks(sched, 0.05)  # "first" was held once: no second wave, the ratio
    assert all(chunks[r] == 1 for r in ["first", *(f"b{i}" for i in range(15))]) and chunks["late"] < 200

    stream = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=1024, block_size=16), 16384)
    stream.add_request(make_request("s", [7] * 30, max_tokens=10**6))
    _chunks(stream, 0.05)
    for _ in range(20):
        _chunks(stream, 0.04)
    for i in range(5):
        stream.add_request(make_request(f"long{i}", [9 + i] * 8000, max_tokens=4, t=1 + i))
    for _ in range(5):
        chunks = _chunks(stream, 0.06)
        assert chunks["s"] == 1 and sum(chunks.values()) < 100  # the ratio, not the budget


def test_a_wave_ends_at_its_time_bound_or_where_no_prompt_can_progress() -> None:
    """A wave holds its streams' second tokens for MAX_WAVE_HOLD_S at most (then they decode, and
    the ratio protects them as any stream), and never where no prompt can progress: a wave that
    waits for a sequence slot would wait forever."""
    clock = FakeClock()
    sched = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=4096, block_size=16), 4096, clock)
    for i in range(16):
        sched.add_request(make_request(f"r{i}", [7 + i] * 2048, max_tokens=50, t=i))
    assert _chunks(sched, 1.5) == {"r0": 2048}
    held = 0
    for _ in range(16):
        clock.now += 1.5
        chunks = _chunks(sched, 1.5)
        if "r0" in chunks:
            break
        held += 1
    assert chunks["r0"] == 1 and held == math.ceil(MAX_WAVE_HOLD_S / 1.5)  # then r0 decodes...
    assert any(not r.output_token_ids for r in sched.live_requests())  # ...though prompts wait
    assert all(len(_chunks(sched, 0.5)) > 1 for _ in range(3))  # no wave again: decodes every step

    full = Scheduler(SchedulerConfig(4, 2048, True), BlockManager(num_blocks=1024, block_size=16), 1024)
    for i in range(6):
        full.add_request(make_request(f"r{i}", [7 + i] * 100, max_tokens=50, t=i))
    assert _chunks(full, 0.2) == {f"r{i}": 100 for i in range(4)}  # 4 seats: two wait
    assert _chunks(full, 0.05) == {f"r{i}": 1 for i in range(4)}  # no seat for them: decode


def test_requests_nobody_streams_have_no_cadence_to_keep() -> None:
    """`LLM.generate`'s requests (FINAL_ONLY: one output at the end) have no inter-token latency
    anyone sees: beside their decodes the prompts take the whole budget (no ratio), and a wave
    does not hold them (their decodes ride in its steps). A streamed request beside them has
    its ratio again."""

    def final_only(rid: str, prompt: list[int], t: float) -> Request:
        params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.FINAL_ONLY)
        return Request(EngineCoreRequest(rid, prompt, params, eos_token_ids=[EOS], arrival_time=t), 50)

    sched = Scheduler(SchedulerConfig(32, 2048, True), BlockManager(num_blocks=1024, block_size=16), 1024)
    for i in range(4):
        sched.add_request(final_only(f"d{i}", [7 + i] * 100, i))
    assert sum(_chunks(sched, 0.3).values()) == 400
    for i in range(8):
        sched.add_request(final_only(f"p{i}", [20 + i] * 300, 10 + i))
    chunks = _chunks(sched, 0.8)  # their first tokens only: a wave, but nothing to hold
    assert all(chunks[f"d{i}"] == 1 for i in range(4)) and sum(chunks.values()) == 2048
    _timed(sched, 0.1, 0.001)
    sched.add_request(final_only("late", [9] * 600, 30))
    chunks = _chunks(sched)  # decodes with many tokens: still no ratio
    assert all(chunks[f"d{i}"] == 1 for i in range(4)) and chunks["late"] > 500
    sched.add_request(make_request("stream", [5] * 10, max_tokens=50, t=40))
    for _ in range(1 + WAVE_JOIN_TOKENS):
        _chunks(sched)  # past its prompt and its first tokens: a cadence
    sched.add_request(final_only("after", [9] * 600, 50))
    chunks = _chunks(sched)
    assert chunks["stream"] == 1 and chunks.get("after", 0) < 200  # a stream: the ratio


def test_a_decode_only_step_is_measured_once_before_a_ratio_is_taken() -> None:
    """Where no decode-only step of at least half the decodes' rows was measured (after a
    wave, or first decodes), the next step beside decodes carries no prompt tokens, once: the
    ratio is then taken of that step, not of the line through prompt steps (which priced a
    decode row as a prompt token: in the served c16 start-up, a 16-row step at 16-24 ms against
    26-40 ms measured). Without a cost model (no step recorded) nothing is held back."""
    sched = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=1024, block_size=16), 1024)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", [7 + i] * 100, max_tokens=50))
    assert sum(_chunks(sched, 0.3).values()) == 400  # nothing decodes: the whole budget
    for _ in range(WAVE_JOIN_TOKENS):
        _chunks(sched)  # decodes not timed (streams with a cadence: no wave holds them)
    sched.add_request(make_request("p", [20] * 500, max_tokens=5, t=9))
    assert _chunks(sched, 0.05) == {f"d{i}": 1 for i in range(4)}  # measured first
    assert _chunks(sched, 0.09)["p"] > 0  # then the prompt beside the decodes
    assert sched.step_cost.latest_decode == (4, 0.05)

    # Speculating, the step held decode-only keeps the decodes' drafts (only prompts are held
    # back), where a step whose prompts took the budget has none left.
    spec = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=1024, block_size=16), 1024)
    for i in range(4):
        spec.add_request(make_request(f"d{i}", [7 + i] * 100, max_tokens=50))
    _chunks(spec, 0.3)
    for _ in range(WAVE_JOIN_TOKENS):
        _chunks(spec)
    spec.add_request(make_request("p", [20] * 500, max_tokens=5, t=9))
    for r in spec.running:
        r.spec_wanted = 2
    out = spec.schedule()
    assert {s.request.request_id: (s.num_new_tokens, s.num_draft) for s in out.scheduled} == {
        f"d{i}": (3, 2) for i in range(4)
    }

    untimed = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=1024, block_size=16), 1024)
    untimed.add_request(make_request("a", [1] * 10, max_tokens=50))
    for _ in range(1 + WAVE_JOIN_TOKENS):
        run_step(untimed, lambda r: 5)
    untimed.add_request(make_request("b", [2] * 100, t=1))
    assert _chunks(untimed) == {"a": 1, "b": 100}


def _closed_loop(
    clock: FakeClock,
    clients: int,
    prompt: int,
    output: int,
    rounds: int,
    max_model_len: int = 1024,
    lead: float = 0.0,
) -> tuple[list[float], list[float], list[float]]:
    """`clients` clients, each sending a `prompt`-token request for `output` tokens and the next
    one as soon as it ends (`vllm bench serve --max-concurrency`), on a fake machine whose step
    costs 75 ms + 0.85 ms a token (the bundled model on 2 Zen 4 cores). Returns every request's
    time to first token, every inter-token gap, and the gaps after the start-up (once every
    first request has its first token) but each stream's first (from its first token to its
    second: the one gap a wave may make it wait, module note). With a `lead` the first client
    sends `lead` seconds before the others (a served burst's first request reaches the core
    alone, and a cached prompt makes its prefill short)."""
    blocks = BlockManager(clients * max_model_len // 16 + 64, 16)
    sched = Scheduler(SchedulerConfig(clients, 2048, True), blocks, max_model_len, clock)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    steady: list[float] = []
    gapped: set[str] = set()
    count = 0

    def send() -> None:
        nonlocal count
        rid = f"r{count}"
        count += 1
        sent[rid] = clock.now
        sched.add_request(make_request(rid, [count % 90 + 1] * prompt, max_tokens=output, t=clock.now))

    send()
    late = clock.now + lead
    while count < clients * rounds:
        if count < clients and clock.now >= late:
            for _ in range(clients - 1):
                send()
        out = sched.schedule()
        took = 0.075 + 0.00085 * out.num_tokens
        clock.now += took
        sched.record_step(out, took)
        for item in out.scheduled:
            sched.advance(item)
            if not item.samples:
                continue
            req, rid = item.request, item.request.request_id
            req.append_output_token(5)
            if rid in last:
                itl.append(clock.now - last[rid])
                if len(ttft) >= clients and rid in gapped:
                    steady.append(itl[-1])
                gapped.add(rid)
            else:
                ttft.append(clock.now - sent[rid])
            last[rid] = clock.now
            if sched.check_stop(req, 5) is not None:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                send()
    return ttft, itl, steady


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_fair_admission_bounds_time_to_first_token_under_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 clients sending 200-token prompts for 128 tokens each (the served sitting of issue 41),
    all at once. The start-up is a wave (`Scheduler._wave`): the prompts take the whole budget
    while some wait for a first token and the decoders have their first token only, held for
    their second, so the last first token of the start-up comes at 11.4 s against 19.2 s with
    the ratio applied from the first decode. The streams then decode together, end together, and
    their clients' next requests are the next wave. After the start-up no step beside decodes
    outgrows its ratio of the full load's decode-only step (64 rows) but each stream's one wave
    gap, p99 inter-token latency stays within 2x the median (here: equal), and the first tokens
    take at most 4.9 s. A wave held for at most two of the longest prompt steps (8 s, the bound
    before) is cut short: its last prompts trickle in at the ratio's pace beside decoders that
    then end at different times, so later requests arrive one by one into a queue the ratio
    drains slowly (7.6 s after the start-up with waves holding first tokens only; 5.4 s now that
    a later round's first streams join its wave), p99 inter-token latency 1.8x the median."""
    ttft, itl, steady = _closed_loop(FakeClock(), clients=64, prompt=200, output=128, rounds=4)
    load_step = 0.075 + 0.00085 * 64
    assert max(steady) <= MAX_STEP_RATIO * load_step * 1.001
    assert _percentile(itl, 0.99) <= 2 * _percentile(itl, 0.5) * 1.001
    after = _percentile(ttft[64:], 0.99)  # after the start-up
    assert after < 5.5
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "_wave", lambda self, decodes, prefills, now: False)
        ttft_ratio, _, _ = _closed_loop(FakeClock(), clients=64, prompt=200, output=128, rounds=4)
    assert max(ttft[:64]) < 0.7 * max(ttft_ratio[:64])
    monkeypatch.setattr(scheduler_module, "MAX_WAVE_HOLD_S", 2 * MAX_PREFILL_STEP_S)
    ttft_short, itl_short, _ = _closed_loop(FakeClock(), clients=64, prompt=200, output=128, rounds=4)
    assert _percentile(ttft_short[64:], 0.99) > after
    assert _percentile(itl_short, 0.99) > 1.5 * _percentile(itl, 0.99)


def test_one_long_prompt_beside_a_young_stream_is_no_wave() -> None:
    """A stream three tokens in and one 8,000-token prompt arriving: no burst (one request waits
    for a first token, one stream is past its first), so the stream keeps decoding beside the
    prompt's chunks. Holding it would stall it for the whole wave bound (a 20 s gap in the
    issue-40 machine's simulation); a stream at its first token only is held, as before."""
    sched = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=1024, block_size=16), 16384)
    sched.add_request(make_request("s", [5] * 30, max_tokens=100))
    _chunks(sched, 0.05)
    _chunks(sched, 0.04), _chunks(sched, 0.04)
    sched.add_request(make_request("long", [7] * 8000, max_tokens=4, t=1))
    for _ in range(3):
        chunks = _chunks(sched, 0.06)
        assert chunks["s"] == 1 and 0 < chunks.get("long", 0) < 2048
    first = Scheduler(SchedulerConfig(16, 2048, True), BlockManager(num_blocks=1024, block_size=16), 16384)
    first.add_request(make_request("s", [5] * 30, max_tokens=100))
    _chunks(first, 0.05)
    first.add_request(make_request("long", [7] * 8000, max_tokens=4, t=1))
    assert _chunks(first, 0.9) == {"long": 2048}  # its first token only: held


@pytest.mark.parametrize("lead", [0.3, 0.6])
def test_a_burst_whose_first_request_went_ahead_is_a_wave(lead: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The served c64 start-up as the core saw it (docs/benchmarks-history.md, "A wave that
    waits for nobody's second token"): the burst's first request arrived alone, its cached
    prompt took 8 tokens, and it had two tokens when the other 63 came, so a wave that holds
    first tokens only never formed: the burst was admitted by the ratio, its streams ended
    apart and every later round trickled in too. A stream within its first
    `WAVE_JOIN_TOKENS` tokens joins the wave (held once): the start-up's last first token
    comes as it does with no lead, where waves holding a first token only take 1.8x longer."""
    ttft, itl, _ = _closed_loop(FakeClock(), clients=64, prompt=200, output=128, rounds=4, lead=lead)
    assert max(ttft[:64]) < 11.5
    assert _percentile(itl, 0.99) <= 2 * _percentile(itl, 0.5) * 1.001
    monkeypatch.setattr(scheduler_module, "WAVE_JOIN_TOKENS", 1)
    ttft_first_only, _, _ = _closed_loop(FakeClock(), clients=64, prompt=200, output=128, rounds=4, lead=lead)
    assert max(ttft[:64]) < 0.6 * max(ttft_first_only[:64])


@pytest.mark.parametrize("clients", [8, 16])
def test_a_wave_of_long_prompts_breaks_each_stream_once_at_most(clients: int) -> None:
    """Clients sending 2,000-token prompts for 64 tokens each, all at once and again as each
    ends: the prompts' steps are long (a whole budget each), so a stream that waited through
    more than one of them would lose its cadence for the start of every round. The wave rule
    gives each decoder one such gap at most (from its first token to its second, while the
    wave's prompts go first), and every other gap stays within 2x the median: p99 12.4x at 8
    clients with the rule that counted decoders queued with the prompts, however many tokens
    they had. (With 64 tokens a request, one gap in 63 is more than 1% of the gaps: the wave's
    show in the p99 of all of them, 12.5 s at 8 clients; at 128 tokens, as served in issue 41's
    sitting, they do not.)"""
    ttft, itl, steady = _closed_loop(FakeClock(), clients=clients, prompt=2000, output=64, rounds=3,
                                     max_model_len=4096)
    assert len(ttft) >= clients * 2
    median = _percentile(itl, 0.5)
    assert sum(gap > 2 * median * 1.001 for gap in itl) <= len(ttft)  # once a stream at most
    assert _percentile(steady, 0.99) <= 2 * median * 1.001


# Machines for the stream-and-8k-prompt run: a step's fixed cost (the weights read), a prompt
# token's cost at no context, and what each token already in the cache adds to a prompt token.
_MACHINES = {
    # The 0.5B model of issue 40 on a slow, shared 2-core Xeon: a token at 8k costs twice one at 0.
    "slow": (0.5, 0.004, 6e-7),
    # The same model measured on a quiet 2-core Zen 4 (docs/reliability.md): a decode-only step of
    # 42 ms, a prompt token 1.6 ms at no context and 9.3 ms at 8k: one at 8k costs six times one
    # at 0, and 32 of them eight decode-only steps.
    "zen4": (0.042, 0.0016, 9.7e-7),
}


@pytest.mark.parametrize("machine", sorted(_MACHINES))
def test_a_stream_keeps_its_cadence_beside_an_8k_prompt(machine: str) -> None:
    """Issue 40, stream first: a stream decodes, then an 8,000-token prompt arrives, on a fake
    machine shaped like the 0.5B model of that issue (`_MACHINES`; the cost model's line lags
    the growth of a prompt token's cost with the context). Every step of the prompt is heard well
    inside the watchdog's 60 s, no step beside the stream reaches twice a decode-only one, the
    stream's p99 inter-token latency stays within 2x its median, and the prompt is served. With
    the budget off, its one step of 8,000 tokens stalls the stream for most of a minute (on the
    slow machine); with the chunks sized by the line's slope and floored at 32 tokens (before
    this run's measurement), the steps grew with the context to eight decode-only steps."""
    fixed, per_token, per_context = _MACHINES[machine]

    def run(prefill_budget: str) -> tuple[list[float], float, float]:
        clock = FakeClock()
        config = SchedulerConfig(256, 8192, True, prefill_budget=prefill_budget)
        sched = Scheduler(config, BlockManager(4096, 16), 16384, clock)
        sched.add_request(make_request("stream", [5] * 30, max_tokens=10**6, t=clock.now))
        last: dict[str, float] = {}
        itl: list[float] = []
        longest = 0.0
        for step in range(5000):
            if step == 20:
                sent = clock.now
                sched.add_request(make_request("long", [7] * 8000, max_tokens=4, t=clock.now))
            out = sched.schedule()
            took = fixed + sum(
                n * per_token + per_context * n * (item.num_computed_tokens + n / 2)
                for item in out.scheduled
                if (n := item.num_new_tokens)
            )
            clock.now += took
            if step >= 20:  # beside the stream (before: the stream's own prompt, then decodes)
                longest = max(longest, took)
            sched.record_step(out, took)
            for item in out.scheduled:
                sched.advance(item)
                if item.samples:
                    req = item.request
                    req.append_output_token(5)
                    if req.request_id == "stream" and "stream" in last:
                        itl.append(clock.now - last["stream"])
                    last[req.request_id] = clock.now
                    if sched.check_stop(req, 5) is not None:
                        sched.finish(req, RequestStatus.FINISHED_LENGTH)
                        return itl, longest, clock.now - sent
        raise AssertionError("the 8k prompt was not served in 5,000 steps")

    itl, longest, took = run("auto")
    # No step beside the stream outgrows MAX_STEP_RATIO of the load's decode-only step (2 rows),
    # but for the cost model's lag (the prompt-token cost it reads is one chunk old).
    assert longest < MAX_STEP_RATIO * (fixed + 2 * per_token) * 1.05
    assert _percentile(itl, 0.99) <= 2 * _percentile(itl, 0.5)
    # Served, at about 1.5x of its work alone (~60 s slow, ~45 s zen4): the stream's steps share the time.
    assert took < {"slow": 200, "zen4": 160}[machine]
    if machine == "slow":
        itl_off, longest_off, _ = run("off")
        assert longest_off > 40 and _percentile(itl_off, 0.99) > 2 * _percentile(itl_off, 0.5)


def test_prefill_budget_floor_whole_budget_when_nothing_decodes_and_off_switch() -> None:
    bm = BlockManager(num_blocks=256, block_size=16)
    sched = Scheduler(SchedulerConfig(32, 512, True), bm, 1024)
    _timed(sched, 0.1, 0.05)  # a costly token
    sched.add_request(make_request("alone", [7] * 300, max_tokens=50))
    assert _chunks(sched) == {"alone": 300}  # nothing decodes: the whole budget
    for _ in range(WAVE_JOIN_TOKENS):
        assert _chunks(sched) == {"alone": 1}  # a cadence (no wave holds it)
    sched.add_request(make_request("p", [8] * 300, t=1))
    # 1.5x the load's decode-only step (2 rows, 0.2 s) less the decode's 0.15 s: 3 tokens at 0.05 s.
    assert _chunks(sched) == {"alone": 1, "p": 3}
    sched.record_step(SchedulerOutput([ScheduledRequest(sched.running[1], 10, 3)], []), 10.0)  # ~1 s a token
    fit = sched.step_cost.fit
    assert fit is not None and sched.step_cost.prompt_token_seconds(fit) == pytest.approx(
        (10 - sched.step_cost.decode_seconds(0, fit)) / 10
    )
    assert _chunks(sched) == {"alone": 1, "p": 1}  # none within the ratio: prompts still progress
    # Off: the whole budget beside the decode, as before.
    off = Scheduler(SchedulerConfig(32, 512, True, prefill_budget="off"), BlockManager(256, 16), 1024)
    _decoding(off, 1)
    _timed(off, 0.1, 0.05)
    off.add_request(make_request("p", [8] * 600, t=1))
    assert _chunks(off) == {"d0": 1, "p": 511}
    # Without chunked prefill a prompt is never split: no budget either.
    whole = Scheduler(SchedulerConfig(32, 1024, False), BlockManager(256, 16), 1024)
    _decoding(whole, 1)
    _timed(whole, 0.1, 0.05)
    whole.add_request(make_request("p", [8] * 600, t=1))
    assert _chunks(whole) == {"d0": 1, "p": 600}


def test_prefill_budget_off_for_steps_too_fast_to_matter() -> None:
    """Decode-only steps under a millisecond (a GPU's tiny batches, scripted runners): no limit."""
    sched = Scheduler(SchedulerConfig(32, 512, True), BlockManager(256, 16), 1024)
    _decoding(sched, 2)
    _timed(sched, 1e-4, 1e-6)
    sched.add_request(make_request("p", [8] * 600, t=9))
    assert _chunks(sched)["p"] == 510


def test_decodes_first_even_behind_a_running_prefill() -> None:
    """A decode behind a running request still prefilling gets its token first: with 8 tokens
    a step, the decode 1 and the prompt 7, every step (the prompt used to take all 8). The
    running order is set by hand: admission alone rarely puts a decode there."""
    sched = Scheduler(SchedulerConfig(4, 8, True, prefill_budget="off"), BlockManager(64, 4), 128)
    _decoding(sched, 1)
    sched.add_request(make_request("first", [1] * 40, t=1))
    assert _chunks(sched) == {"d0": 1, "first": 7}
    sched.running.reverse()  # "first" ahead of the decode
    for _ in range(3):
        assert _chunks(sched) == {"d0": 1, "first": 7}
    sched.blocks.check_integrity(sched.live_requests())


def test_engine_core_times_its_steps_for_the_prefill_budget(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: the core times each forward pass (here on a fake clock the runner advances
    by 0.1 s + 1 ms per token), and a prompt that arrives while another decodes is cut to
    (1.5 * 0.102 - 0.101) / 0.001 = 52 tokens a step (1.5x the decode-only step of the two
    requests' load, less the decode's step)."""
    import types

    import triollm.engine.core as core_module
    from triollm.engine.config import EngineArgs
    from triollm.engine.core import EngineCore
    from triollm.engine.execution.scripted_runner import ScriptedRunner

    clock = [0.0]
    monkeypatch.setattr(core_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    config = EngineArgs(model=str(tiny_model_dir), max_model_len=512, num_gpu_blocks_override=64).create_engine_config()
    assert config.scheduler.prefill_budget == "auto"  # the default
    scripted = ScriptedRunner(config.model.vocab_size)
    seen: list[dict[str, int]] = []

    class TimedRunner:
        def execute(self, scheduled: list[ScheduledRequest]):
            seen.append({s.request.request_id: s.num_new_tokens for s in scheduled})
            clock[0] += 0.1 + 0.001 * sum(s.num_new_tokens for s in scheduled)
            return scripted.execute(scheduled)

    core = EngineCore(config, runner=TimedRunner())
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", [3] * 200, params))
    core.step()  # "a": 200 tokens alone
    for _ in range(WAVE_JOIN_TOKENS):
        core.step()  # "a" decodes (a cadence: no wave holds it for "b")
    core.add_request(EngineCoreRequest("b", [4] * 230, params))
    for _ in range(5):
        core.step()
    assert seen[0] == {"a": 200}
    assert seen[1 + WAVE_JOIN_TOKENS : 5 + WAVE_JOIN_TOKENS] == [{"a": 1, "b": 52}] * 4
    assert seen[5 + WAVE_JOIN_TOKENS] == {"a": 1, "b": 22}
    with pytest.raises(ValueError, match="scheduler_prefill_budget: 'sometimes'.*auto, off"):
        EngineArgs(model=str(tiny_model_dir), scheduler_prefill_budget="sometimes").create_engine_config()


# ------------------------------------------------------------------------ the state machine


def test_a_held_decode_that_preempts_leaves_no_preempted_request_in_the_step() -> None:
    """Found by `SchedulerMachine`: a wave holds four streams while a fifth request waits for a
    seat, so no prompt can progress and the held decodes run after all; one of them needs a
    block and preempts another held one already scheduled in this step. The step must not
    carry the preempted request (its blocks are gone: the fake model's K/V write failed)."""
    machine = SchedulerMachine()
    machine.add(max_tokens=2, priority=1, prompt=[0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 0])
    machine.add(max_tokens=1, priority=0, prompt=[0])
    machine.add(max_tokens=1, priority=0, prompt=[0, 0, 0, 1])
    machine.step(), machine.step()
    machine.add(max_tokens=2, priority=0, prompt=[0, 0, 0, 1, 0, 0, 0, 0])
    machine.add(max_tokens=1, priority=0, prompt=[0])
    machine.add(max_tokens=1, priority=0, prompt=[0] * 16)
    machine.step()
    machine.add(max_tokens=1, priority=0, prompt=[0])
    machine.step()
    machine.add(max_tokens=2, priority=0, prompt=[0, 0, 0, 0])
    machine.step()
    machine.add(max_tokens=1, priority=0, prompt=[0])
    before = machine.sched.num_preemptions
    machine.step()  # the fake model writes the K/V of every scheduled token into its blocks
    assert machine.sched.num_preemptions == before + 1
    machine.integrity()
    machine.teardown()


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / abort / step / preempt / reset sequences over a small cache, on a fake model
    that checks the KV every step reads."""

    WINDOW: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)
        self.kv: dict[int, tuple[int, ...]] = {}
        self.bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, window=self.WINDOW)
        self.sched = Scheduler(SchedulerConfig(4, 16, True, long_prefill_token_threshold=5), self.bm, max_model_len=40)
        self.live: dict[str, Request] = {}
        self.ended: dict[str, int] = {}
        self.counter = 0

    @rule(
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 2),
    )
    def add(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        req = make_request(rid, prompt, max_tokens, priority, t=self.counter)
        self.live[rid] = req
        self.sched.add_request(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.finish(self.live.pop(rid), RequestStatus.FINISHED_ABORTED)
        self._ended(rid)

    @rule()
    def step(self) -> None:
        for req in run_step(self.sched, lambda r: self.rng.choice([1, 2, 3, EOS]), self.kv):
            assert self.live.pop(req.request_id) is req
            self._ended(req.request_id)

    @precondition(lambda self: self.sched.running)
    @rule()
    def preempt(self) -> None:
        self.sched._preempt(self.sched._pick_victim())

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    def _ended(self, rid: str) -> None:
        assert rid not in self.ended, f"{rid} ended twice"
        self.ended[rid] = 1

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity(self.sched.live_requests())
        # A cached block holds the K/V of the prefix its hash stands for.
        bs = self.bm.block_size
        for h, block in self.bm._cached.items():
            prefix = self.kv[block * bs + bs - 1]
            assert hash_full_blocks(prefix, bs)[-1] == h, f"block {block}: cached under another prefix's hash"
            for off in range(bs - 1):
                assert self.kv[block * bs + off] == prefix[: len(prefix) - bs + off + 1], f"block {block}: stale"
        assert {r.request_id for r in self.sched.live_requests()} == set(self.live)
        assert len(self.sched.running) <= 4

    def teardown(self) -> None:
        # Drain: every request must end, exactly once, and all blocks come back.
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.live
        assert len(self.ended) == self.counter
        assert self.bm.num_free_blocks == self.bm.num_blocks  # free or only held by the cache
        self.bm.check_integrity([])


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class WindowedSchedulerMachine(SchedulerMachine):
    """The same under a 6-token window on 4-token blocks: blocks are released as requests move
    on, reused by others, and must never be read again."""

    WINDOW = 6


TestWindowedSchedulerMachine = WindowedSchedulerMachine.TestCase
TestWindowedSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- update_from_output, no model


def _rows(tokens: list[int]) -> Logprobs:
    return Logprobs([[t] for t in tokens], [[-0.5] for _ in tokens], [1 for _ in tokens])


def _prefilled(sched: Scheduler, rid: str = "r", prompt_len: int = 8) -> Request:
    req = make_request(rid, list(range(1, prompt_len + 1)), max_tokens=16)
    sched.add_request(req)
    out = sched.schedule()
    [first] = sched.update_from_output(out, RunnerOutput({rid: 5}, {}, {}))
    assert first.new_token_ids == [5] and req.num_computed_tokens == prompt_len
    return req


def _drafting_step(sched: Scheduler, req: Request, drafts: int, emitted: list[int]):
    """Schedule `req` with `drafts` drafts; the forward pass emits `emitted`: the accepted
    drafts, then the model's own token."""
    req.spec_wanted = drafts
    out = sched.schedule()
    [item] = out.scheduled
    assert item.num_draft == drafts and item.num_new_tokens == 1 + drafts
    rid = req.request_id
    result = RunnerOutput({rid: emitted[0]}, {rid: _rows(emitted)}, {}, {rid: list(emitted)})
    return out, sched.update_from_output(out, result)


def test_update_from_output_rolls_back_rejected_drafts() -> None:
    """3 drafts, 1 accepted plus the model's own token: 2 tokens emitted, the 2 rejected drafts'
    slots counted out (K/V computed for every token but the last), blocks kept."""
    sched = Scheduler(SchedulerConfig(8, 512, True), BlockManager(16, 4), 64)
    req = _prefilled(sched)
    computed, blocks = req.num_computed_tokens, list(req.block_ids)
    _, [out] = _drafting_step(sched, req, 3, [7, 8])
    assert out.new_token_ids == [7, 8] and out.finish_reason is None
    assert req.output_token_ids == [5, 7, 8]
    assert req.num_computed_tokens == computed + 2 == req.num_tokens - 1
    assert req.block_ids[: len(blocks)] == blocks  # a rollback is a count: the blocks stay
    assert out.new_logprobs is not None and len(out.new_logprobs.token_ids) == 2
    sched.blocks.check_integrity(list(sched.live_requests()))


def test_update_from_output_stops_inside_the_drafts() -> None:
    """An EOS among the accepted drafts ends the request there: the tokens after it, and their
    logprobs rows, are dropped, and its blocks are freed."""
    sched = Scheduler(SchedulerConfig(8, 512, True), BlockManager(16, 4), 64)
    req = _prefilled(sched)
    free = sched.blocks.statistics().num_free_blocks
    _, [out] = _drafting_step(sched, req, 3, [7, EOS, 8, 9])
    assert out.new_token_ids == [7, EOS] and out.finish_reason == FinishReason.STOP
    assert out.new_logprobs is not None and out.new_logprobs.token_ids == [[7], [EOS]]
    assert req.status == RequestStatus.FINISHED_STOPPED and not sched.has_unfinished_requests()
    assert sched.blocks.statistics().num_free_blocks > free
    sched.blocks.check_integrity([])


def test_update_from_output_without_drafts_advances_first() -> None:
    """A plain decode: counted computed, then the sampled token appended; a prompt chunk that
    samples nothing yields an output only with prompt logprobs."""
    sched = Scheduler(SchedulerConfig(8, 512, True, long_prefill_token_threshold=4), BlockManager(16, 4), 64)
    req = make_request("p", list(range(1, 9)))
    sched.add_request(req)
    assert sched.update_from_output(sched.schedule(), RunnerOutput({}, {}, {})) == []
    assert req.num_computed_tokens == 4 and req.output_token_ids == []
    rows = _rows([3, 4, 5])
    [out] = sched.update_from_output(sched.schedule(), RunnerOutput({"p": 6}, {}, {"p": rows}))
    assert out.new_token_ids == [6] and out.new_prompt_logprobs is rows
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
