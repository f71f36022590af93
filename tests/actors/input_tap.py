"""`InputTap`: a shared engine's `input_tap`, an `InputRecorder` (triollm.testing) switched on
for one test at a time by a fixture, with an optional rewrite of each `AddRequest` (to send the
core what the frontend would have refused)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from triollm.actors.messages import AddRequest, CoreInput
from triollm.testing import InputRecorder


class InputTap:
    def __init__(self) -> None:
        self.active = False
        self.rewrite: Callable[[AddRequest], AddRequest] | None = None
        self.recorder = InputRecorder()

    @property
    def added(self) -> Counter[str]:
        return self.recorder.added

    @property
    def aborted(self) -> Counter[str]:
        return self.recorder.aborted

    def __call__(self, msg: CoreInput) -> CoreInput:
        if not self.active:
            return msg
        if self.rewrite is not None and isinstance(msg, AddRequest):
            msg = self.rewrite(msg)
        return self.recorder(msg)

    def start(self) -> InputTap:
        self.recorder = InputRecorder()
        self.rewrite = None
        self.active = True
        return self

    def remove(self) -> None:
        self.active = False
        self.rewrite = None
