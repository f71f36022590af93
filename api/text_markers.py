"""Finding markers in text that arrives in pieces: what the streaming output parsers hold back.

A parser that reads a marker (`<|channel|>`, `[THINK]`, `<|tool_call|>`) from streamed text must
not send a trailing piece that may still grow into one; `held` says how long that piece is.
"""

from __future__ import annotations

__all__ = ["earliest", "held"]


def earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, marker) of the first of `markers` in `text`; of two at one index, the longer."""
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(marker) > len(best[1]))):
            best = (i, marker)
    return best


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(len(m) > k and m.startswith(tail) for m in markers):
            return k
    return 0
