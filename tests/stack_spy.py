"""A spy on a model's native decode stack (`model.decode_stack`), for the tests that check the
stack runs, and with what."""

from __future__ import annotations

from typing import Any

import torch


class StackSpy:
    """Stands in for the stack: the same `takes` and `lora_args`, every call's arguments kept in
    `calls` (as passed: the caches are the live ones), then the stack's own result."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.takes, self.lora_args = stack.takes, stack.lora_args
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls.append(args)
        return self.stack(*args)  # type: ignore[no-any-return]

    def rows(self) -> list[int]:
        """Each call's row count."""
        return [a[0].shape[0] for a in self.calls]


def stack_against_layers(engine: Any, prompts: list[Any], params: Any) -> StackSpy:
    """Generate `prompts` through a spy on the engine's native decode stack, then through the
    layers (the stack taken away, then put back), and assert the two give the same tokens and
    logprobs; returns the spy (its calls prove the stack ran, and with how many rows)."""
    model = engine.core.model
    stack = model.decode_stack
    spy = StackSpy(stack)
    model.decode_stack = spy
    try:
        fused = engine.generate(prompts, params)
        model.decode_stack = None
        layered = engine.generate(prompts, params)
    finally:
        model.decode_stack = stack
    for a, b in zip(fused, layered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    return spy
