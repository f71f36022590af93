"""The waiting queue: the scheduler's admission order, with O(1) pops and removals.

The order is that of a list sorted by (priority, arrival_time, push order): the reference.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.engine.config import SchedulerConfig
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.scheduling.block_manager import BlockManager
from triollm.engine.scheduling.request_state import Request, RequestStatus
from triollm.engine.scheduling.scheduler import Scheduler
from triollm.engine.scheduling.waiting_queue import WaitingQueue


def make_request(rid: str, priority: int = 0, t: float = 0.0, prompt_len: int = 3) -> Request:
    core = EngineCoreRequest(
        rid, [1] * prompt_len, SamplingParams(max_tokens=4), arrival_time=t, priority=priority
    )
    return Request(core, 4)


# ----------------------------------------------------------------------- the queue alone

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(-1, 2), st.integers(0, 6)),  # priority, time
        st.tuples(st.just("add_in_order"), st.integers(-1, 2), st.just(0)),  # time increasing
        st.tuples(st.just("remove"), st.integers(0, 1000), st.just(0)),
        st.tuples(st.just("pop"), st.just(0), st.just(0)),
        st.tuples(st.just("repush"), st.integers(0, 1000), st.just(0)),  # a preemption
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_order_is_the_sorted_reference(ops: list[tuple[str, int, int]]) -> None:
    queue = WaitingQueue()
    keys: dict[Request, tuple[int, float, int]] = {}  # the reference: queued -> sort key
    popped: list[Request] = []
    pushes = 0
    clock = 10.0

    def push(req: Request) -> None:
        nonlocal pushes
        queue.push(req)
        keys[req] = (req.priority, req.arrival_time, pushes)
        pushes += 1

    for n, (op, a, b) in enumerate(ops):
        if op == "add":
            push(make_request(f"r{n}", priority=a, t=float(b)))
        elif op == "add_in_order":
            clock += 1.0
            push(make_request(f"r{n}", priority=a, t=clock))
        elif op == "remove" and keys:
            req = sorted(keys, key=keys.__getitem__)[a % len(keys)]
            queue.remove(req)
            del keys[req]
        elif op == "pop" and keys:
            head = min(keys, key=keys.__getitem__)
            assert queue.peek() is head
            assert queue.pop() is head
            del keys[head]
            popped.append(head)
        elif op == "repush" and popped:
            push(popped.pop(a % len(popped)))
        expected = sorted(keys, key=keys.__getitem__)
        assert list(queue) == expected
        assert len(queue) == len(expected) and bool(queue) == bool(expected)
        assert all(r in queue for r in expected) and not any(r in queue for r in popped)
    while keys:  # draining pops in order too (and skips every removed entry)
        head = min(keys, key=keys.__getitem__)
        assert queue.pop() is head
        del keys[head]
    with pytest.raises(IndexError):
        queue.peek()


def test_push_twice_and_remove_unknown_raise() -> None:
    queue = WaitingQueue()
    req = make_request("a")
    queue.push(req)
    with pytest.raises(ValueError, match="request_id"):
        queue.push(req)
    queue.remove(req)
    with pytest.raises(KeyError):
        queue.remove(req)


def test_removed_entries_do_not_pile_up() -> None:
    """A burst of adds and aborts leaves memory proportional to what is still queued."""
    queue = WaitingQueue()
    keep = make_request("keep", t=-1.0)
    queue.push(keep)
    for i in range(10_000):
        req = make_request(f"r{i}", priority=i % 3, t=float(i % 7))
        queue.push(req)
        queue.remove(req)
    assert len(queue._deque) + len(queue._heap) < 200
    assert list(queue) == [keep]


# ----------------------------------------------------------------------- in the scheduler


class _CountingRequest(Request):
    """Counts equality comparisons: removing from a list compares with every request before."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _CountingRequest.comparisons += 1
        return self is other

    __hash__ = Request.__hash__


def test_aborting_a_long_queue_compares_no_requests() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, True), bm, max_model_len=64)
    reqs = []
    for i in range(2_000):
        core = EngineCoreRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=2), arrival_time=i)
        reqs.append(_CountingRequest(core, 2))
        sched.add_request(reqs[-1])
    _CountingRequest.comparisons = 0
    for req in reversed(reqs):  # the worst order for a list: each is found last
        sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert _CountingRequest.comparisons < len(reqs)  # a list compares ~2,000,000 times
    assert not sched.has_unfinished_requests()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "abort", "step", "preempt"]),
            st.integers(0, 2),
            st.integers(0, 5),
        ),
        max_size=50,
    )
)
def test_scheduler_admits_in_queue_order(ops: list[tuple[str, int, int]]) -> None:
    """Random adds (priorities, out-of-order arrival times), aborts, steps and preemptions:
    the scheduler's waiting queue stays in reference order and admits from its head."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(3, 12, True), bm, max_model_len=64)
    live: dict[str, Request] = {}
    pushed: dict[Request, int] = {}  # the push count at each request's last (re)queueing
    pushes = 0

    def order() -> list[Request]:
        waiting = [
            r for r in live.values() if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        ]
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time, pushed[r]))

    for n, (op, a, b) in enumerate(ops):
        if op == "add":
            req = make_request(f"r{n}", priority=a, t=float(b), prompt_len=1 + 3 * b)
            sched.add_request(req)
            live[req.request_id] = req
            pushed[req], pushes = pushes, pushes + 1
        elif op == "abort" and live:
            req = live.pop(sorted(live)[b % len(live)])
            sched.finish(req, RequestStatus.FINISHED_ABORTED)
        elif op == "step":
            before = order()
            out = sched.schedule()
            for victim in out.preempted:  # requeued by the scheduler, in this order
                pushed[victim], pushes = pushes, pushes + 1
            admitted = [r for r in before if r.status == RequestStatus.RUNNING]
            assert admitted == before[: len(admitted)]  # admission takes from the head
            for item in out.scheduled:
                sched.advance(item)
        elif op == "preempt" and sched.running:
            victim = sched._pick_victim()
            sched._preempt(victim)
            pushed[victim], pushes = pushes, pushes + 1
        assert list(sched.waiting) == order()
        bm.check_integrity(sched.live_requests())
