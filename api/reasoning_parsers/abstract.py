"""The reasoning-parser interface: split a reasoning model's output into reasoning and content.

A parser is built once per request (`--reasoning-parser NAME` picks the class, vLLM's names) and
answers two ways: `extract_reasoning(text)` for a whole output, and `stream()` for a
`ReasoningStream` that is fed the output's text deltas in order. Both agree: the pieces a
stream returns, concatenated, are the whole-output split (None read as "").

A stream holds back text only while it may be the start of a marker (`</think>` split over two
deltas, say), never more than the longest marker less one character; `finish()` flushes it.

`end_token_ids()` gives the end marker's token ids with the request's tokenizer, for callers
that must see where reasoning ends in token space (a structured-output grammar starts there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["ReasoningParser", "ReasoningStream"]


class ReasoningStream(ABC):
    """One output's incremental split. Not thread-safe; one per choice."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]:
        """The next text delta in; out the (reasoning piece, content piece) it completes, either
        may be "" (text kept back while it may be part of a marker)."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """The output ended: flush what was held back (a partial marker is text after all)."""


class ReasoningParser(ABC):
    """Base class of every reasoning parser; subclasses set the class variables.

    `chat_template_kwargs` are the request's (vLLM passes them too): a model whose chat
    template switches thinking off (`enable_thinking=False` for Qwen3, `thinking` for
    DeepSeek V3) produces no reasoning, and its parser must not claim any.
    """

    name: ClassVar[str]
    start_token: ClassVar[str]
    end_token: ClassVar[str]
    # True when the markers are special tokens (Magistral's [THINK], gpt-oss's channels): the
    # server then decodes with skip_special_tokens=False so that the parser sees them.
    keep_special_tokens: ClassVar[bool] = False

    def __init__(
        self, tokenizer: Tokenizer | None = None, *, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs: Mapping[str, Any] = chat_template_kwargs or {}

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""

    @abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh incremental split for one output."""

    def grammar_start_ids(self) -> list[int] | None:
        """Where a grammar (`response_format`, a forced tool call) starts in this request's
        output: after the end marker when the output opens in reasoning (vLLM applies the
        grammar once reasoning ends), None (from the first token) when it does not."""
        return self.end_token_ids() if self.expects_reasoning() else None

    def expects_reasoning(self) -> bool:
        """Whether this request's output opens in reasoning (its template opened `<think>`)."""
        return True

    def end_token_ids(self) -> list[int] | None:
        """The end marker as token ids of this tokenizer, or None without a tokenizer or when no
        id sequence decodes back to exactly the marker. A marker that is not one special token
        may be tokenized differently next to other text: match it on text too."""
        if self.tokenizer is None or not self.end_token:
            return None
        ids = self.tokenizer.encode(self.end_token, add_special_tokens=False)
        if not ids or self.tokenizer.decode(ids) != self.end_token:
            return None
        return ids
