"""The scheduler's waiting queue: requests in admission order, with O(1) pops and removals.

Order: by (priority, arrival_time), a lower value first, ties in the order the requests were
pushed. A preempted request is pushed again and so goes back to the front of its priority
class (it arrived before what still waits there). That is the order the scheduler always had;
it used to keep it in a sorted list, where `insort`, `pop(0)` and `remove` each cost O(n), so a
burst of aborts over a long queue cost O(n^2).

Mechanism. Entries are (priority, arrival_time, seq, request) tuples, `seq` a push counter, so
entries never compare equal and a request is never compared. The queue is the union of two
containers, each kept in order: a deque, which takes an entry at its back when it sorts after
everything there (requests of one priority arriving in time order: the common case) or at its
front when it sorts before everything there (a preempted request going back to the head); and a
heap for the rest (out-of-order arrival times, a priority between those queued). The head of the
queue is the smaller of the two heads. Removal is lazy: `_live` maps each queued request to its
entry, removing deletes it there in O(1), and dead entries are dropped when they surface at a
head; when they outnumber the live ones both containers are rebuilt, so memory stays O(live)
and each removal is amortised O(1).

Costs: `push` and `pop` O(1) on the deque path, O(log n) on the heap path; `peek`, `remove`
amortised O(1); ordered iteration O(n log n) (integrity checks and tests only).

Rejected: a heap alone (O(log n) for every request, where the deque makes the common FCFS
case O(1)); a sorted container dependency; an entry flag for removal (the dict of live entries
also answers `in` and `len`, and a re-pushed request gets a fresh entry without aliasing).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from triollm.engine.scheduling.request_state import Request

__all__ = ["WaitingQueue"]

_Entry = tuple[int, float, int, Request]
_MIN_REBUILD = 64  # dead entries tolerated regardless of the live count


class WaitingQueue:
    """Requests waiting for admission, in (priority, arrival_time, push order) order."""

    def __init__(self) -> None:
        self._deque: deque[_Entry] = deque()
        self._heap: list[_Entry] = []
        self._live: dict[Request, _Entry] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request: Request) -> bool:
        return request in self._live

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in order (O(n log n): for checks and tests)."""
        entries = heapq.merge(self._deque, sorted(self._heap))
        return (e[3] for e in entries if self._live.get(e[3]) is e)

    def push(self, request: Request) -> None:
        """Queue `request` at its place in the order. Raises ValueError if it is queued."""
        if request in self._live:
            raise ValueError(f"request_id: {request.request_id!r} is already waiting")
        entry = (request.priority, request.arrival_time, next(self._seq), request)
        self._live[request] = entry
        dq = self._deque
        if not dq or entry > dq[-1]:
            dq.append(entry)
        elif entry < dq[0]:
            dq.appendleft(entry)
        else:
            heapq.heappush(self._heap, entry)

    def peek(self) -> Request:
        """The first request. Raises IndexError if the queue is empty."""
        return self._head()[3]

    def pop(self) -> Request:
        """Remove and return the first request. Raises IndexError if the queue is empty."""
        entry = self._head()
        if self._deque and self._deque[0] is entry:
            self._deque.popleft()
        else:
            heapq.heappop(self._heap)
        del self._live[entry[3]]
        return entry[3]

    def remove(self, request: Request) -> None:
        """Take `request` out of the queue. Raises KeyError if it is not queued."""
        del self._live[request]
        if len(self._deque) + len(self._heap) > 2 * len(self._live) + _MIN_REBUILD:
            self._rebuild()

    # ------------------------------------------------------------------ internals

    def _alive(self, entry: _Entry) -> bool:
        return self._live.get(entry[3]) is entry

    def _head(self) -> _Entry:
        dq, heap = self._deque, self._heap
        while dq and not self._alive(dq[0]):
            dq.popleft()
        while heap and not self._alive(heap[0]):
            heapq.heappop(heap)
        if dq and heap:
            return min(dq[0], heap[0])
        if dq:
            return dq[0]
        if heap:
            return heap[0]
        raise IndexError("the waiting queue is empty")

    def _rebuild(self) -> None:
        self._deque = deque(e for e in self._deque if self._alive(e))
        self._heap = [e for e in self._heap if self._alive(e)]
        heapq.heapify(self._heap)
