"""Input taps: what the frontend sends to the engine core, observed or rewritten.

`AsyncLLM(args, input_tap=tap)` calls `tap(msg)` (synchronously, in the event loop) with every
message the frontend sends to its engine core (`AddRequest`, `AbortRequests`, `UtilityCall`,
... from `triollm.actors.messages`) and sends what it returns instead. Core request ids are
`"{user_id}#{seq}"` for a request with `n == 1` and `"{i}_{user_id}#{seq}"` for the i-th child
of one with `n > 1`.

- `InputRecorder` counts adds and aborts (the fault tests' "no core request is aborted twice,
  and none that finished").
- `rewrite_adds(fn)` rewrites each `AddRequest`'s `EngineCoreRequest`: a prompt the frontend
  would refuse then reaches the core, to test the core's own checks.
- `chain_taps(a, b, ...)` applies several taps in order (rewrite, then record what was sent).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from triollm.actors.core_link import InputTap
from triollm.actors.messages import AbortRequests, AddRequest, CoreInput
from triollm.engine.request import EngineCoreRequest

__all__ = ["InputRecorder", "InputTap", "chain_taps", "rewrite_adds", "user_request_id"]

def user_request_id(core_id: str) -> str:
    """The id a core request id was made from: `"r1#7"` -> `"r1"`, `"2_r1#8"` -> `"2_r1"` (an
    n > 1 child keeps its `"{i}_"` prefix: each child is counted apart)."""
    return core_id.rsplit("#", 1)[0]


class InputRecorder:
    """Records the frontend's messages to the core; pass it as `input_tap=`.

    `added` / `aborted`: by user request id (see `user_request_id`); `aborted_core`: by core
    request id (each core id is used once, so a count over 1 is a double abort); `sent`: every
    message, in order."""

    def __init__(self) -> None:
        self.added: Counter[str] = Counter()
        self.aborted: Counter[str] = Counter()
        self.aborted_core: Counter[str] = Counter()
        self.sent: list[CoreInput] = []

    def __call__(self, msg: CoreInput) -> CoreInput:
        self.sent.append(msg)
        match msg:
            case AddRequest(request=req):
                self.added[user_request_id(req.request_id)] += 1
            case AbortRequests(request_ids=ids):
                self.aborted.update(user_request_id(rid) for rid in ids)
                self.aborted_core.update(ids)
        return msg


def rewrite_adds(fn: Callable[[EngineCoreRequest], EngineCoreRequest]) -> InputTap:
    """A tap that sends `AddRequest(fn(request))` for every add, other messages unchanged.
    Build the new request with `msgspec.structs.replace(request, prompt_token_ids=[...])`."""

    def tap(msg: CoreInput) -> CoreInput:
        if isinstance(msg, AddRequest):
            return AddRequest(fn(msg.request))
        return msg

    return tap


def chain_taps(*taps: InputTap) -> InputTap:
    """One tap applying `taps` in order, each to what the previous one returned."""

    def tap(msg: CoreInput) -> CoreInput:
        for t in taps:
            msg = t(msg)
        return msg

    return tap
