"""Block manager and scheduler, without a model: hypothesis state machines and unit tests."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from triollm.engine.config import SchedulerConfig
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.scheduling.block_manager import BlockManager, hash_full_blocks
from triollm.engine.scheduling.request_state import Request, RequestStatus
from triollm.engine.scheduling.scheduler import Scheduler

EOS = 99


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, t: float = 0.0) -> Request:
    core = EngineCoreRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=[EOS], arrival_time=t, priority=priority
    )
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
    sched.add_request(make_request("a", [1] * 3, max_tokens=4))
    run_step(sched, lambda r: 5)  # "a" prefilled (3 <= 6) and decoding
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


# ------------------------------------------------------------------------ the state machine


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
