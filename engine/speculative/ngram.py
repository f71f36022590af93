"""Prompt-lookup (n-gram) proposals: the tokens that followed the last time the context's tail
appeared in it.

A request's context is its prompt and output. For n from `prompt_lookup_max` down to
`prompt_lookup_min`, the last n tokens are looked up among the n-grams that end earlier in the
context; at the first n that matches, the proposal is the (up to k) tokens that followed the most
recent earlier occurrence. Output that copies its prompt (code edits, quoting summaries,
reformatting) is proposed whole, a block at a time; free text rarely matches, and then nothing is
proposed and the step is a plain decode.

The lookup is an index per request (`NgramIndex`): a dict from each n-gram (min <= n <= max) to
the position just after its latest occurrence, extended by the tokens appended since the last
lookup. A step costs O(new tokens x (max - min + 1)) dictionary operations, not a scan of the
context (which at a few thousand tokens would cost milliseconds of Python per request per step).
Rejected: vLLM's scan of the whole context with numpy on every step; simple, but it grows with the
context, and the index is no more code.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramIndex"]


class NgramIndex:
    """The n-grams of one token sequence that only grows (prompt + output), by latest position."""

    __slots__ = ("_after", "_indexed", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n-gram -> the index just after its latest occurrence that ends before the context's
        # last token (the tail being looked up is never its own match).
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in `_after`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        tail of `tokens` (an n-gram of min_n..max_n tokens); [] when none matches."""
        end = len(tokens)
        self._extend(tokens, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._after.get(tuple(tokens[end - n :]))
            if start is not None:
                return list(tokens[start : start + k])
        return []

    def _extend(self, tokens: Sequence[int], stop: int) -> None:
        """Index the n-grams that end before `stop` (exclusive) and are not indexed yet."""
        after, lo, hi = self._after, self.min_n, self.max_n
        for e in range(self._indexed, stop):  # n-grams ending at e: tokens[e - n + 1 : e + 1]
            for n in range(lo, min(hi, e + 1) + 1):
                after[tuple(tokens[e - n + 1 : e + 1])] = e + 1
        self._indexed = max(self._indexed, stop)
