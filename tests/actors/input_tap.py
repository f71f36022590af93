"""`InputTap`: what the frontend sends to the engine core, seen through `AsyncLLM(input_tap=...)`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from triollm.actors.messages import AbortRequests, AddRequest, CoreInput


class InputTap:
    """Records what the frontend sends to the core: the shared engine's `input_tap`, switched on
    for one test at a time by the `tap` fixture. `rewrite` (optional) changes an `AddRequest` on
    its way, to send the core what the frontend would have refused."""

    def __init__(self) -> None:
        self.active = False
        self.rewrite: Callable[[AddRequest], AddRequest] | None = None
        self.aborted: Counter[str] = Counter()
        self.added: Counter[str] = Counter()

    def __call__(self, msg: CoreInput) -> CoreInput:
        if not self.active:
            return msg
        if isinstance(msg, AbortRequests):
            # Core ids are "<user id>#<tag>": count by the user's id.
            self.aborted.update(rid.rsplit("#", 1)[0] for rid in msg.request_ids)
        elif isinstance(msg, AddRequest):
            self.added[msg.request.request_id.rsplit("#", 1)[0]] += 1
            if self.rewrite is not None:
                msg = self.rewrite(msg)
        return msg

    def start(self) -> InputTap:
        self.aborted.clear()
        self.added.clear()
        self.rewrite = None
        self.active = True
        return self

    def remove(self) -> None:
        self.active = False
        self.rewrite = None
