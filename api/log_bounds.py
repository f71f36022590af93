"""Bounded log lines: `short_repr` renders any value a client chose (sampling params with a
1 MB stop string, a logit_bias of a million entries, an id) in at most about `LOG_VALUE_CHARS`
characters, so one request cannot write megabytes into the log or spend the event loop on
formatting them.

It never builds the full repr first: strings are cut before they are quoted, containers and
msgspec Structs are walked item by item until the budget is spent (dicts in their own order,
never sorted), and the cut says how much was left out (the original length, or the number of
items). `reprlib` was not enough: it sorts a dict whole before it shows any of it and falls back
to the full `repr` of any object it does not know (a Struct).

Strings come out as `repr` writes them, so a newline in a stop string cannot start a log line.
A client string logged bare with `%s` (a request id, an adapter's name or path) goes through
`log_safe` (engine/log_safe.py, below api/ so that actors/ and the frontend use it too).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

__all__ = ["LOG_VALUE_CHARS", "short_repr", "shorten"]

# The most characters one logged value takes (an ellipsis and the cut size come on top).
LOG_VALUE_CHARS = 500


def shorten(text: str, limit: int = LOG_VALUE_CHARS) -> str:
    """`text` itself when it fits in `limit` characters, else its start, an ellipsis and the
    length it had: `'abc…' (1048576 chars)`."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} chars)"


def short_repr(value: object, limit: int = LOG_VALUE_CHARS) -> str:
    """A repr of `value` of about `limit` characters at most (see the module docstring)."""
    out: list[str] = []
    writer = _Writer(out, limit)
    if not writer.value(value):
        writer.stop()
    return "".join(out)


class _Writer:
    """Appends to `out` until `left` characters are spent; the first part that does not fit
    ends the line with one marker saying what was cut (outer containers add nothing more)."""

    def __init__(self, out: list[str], limit: int) -> None:
        self.out = out
        self.left = limit
        self.cut = False

    def write(self, text: str) -> bool:
        """Append `text` if it fits; else as much as fits, and False (stop)."""
        fits = len(text) <= self.left
        self.out.append(text if fits else text[: max(self.left, 0)])
        self.left = self.left - len(text) if fits else 0
        return fits

    def stop(self, marker: str = "…") -> bool:
        """End the line with `marker`: only the innermost part that did not fit says what."""
        if not self.cut:
            self.out.append(marker)
            self.cut = True
        return False

    def value(self, value: object) -> bool:
        if isinstance(value, str | bytes | bytearray):
            text = repr(value if len(value) <= self.left else value[: max(self.left, 0)])
            if len(value) <= self.left and self.write(text):
                return True
            self.write(text)
            unit = "chars" if isinstance(value, str) else "bytes"
            return self.stop(f"… ({len(value)} {unit})")
        if isinstance(value, dict):
            return self._items("{", "}", value.items(), len(value), self._pair)
        if isinstance(value, list | tuple | set | frozenset):
            open_, close = ("[", "]") if isinstance(value, list) else ("(", ",)" if len(value) == 1 else ")")
            return self._items(open_, close, value, len(value), self.value)
        if isinstance(value, msgspec.Struct):  # the fields that differ from their defaults
            shown = ((name, getattr(value, name)) for name, default in _defaults(type(value)))
            changed = (
                (name, v) for (name, v), (_, default) in zip(shown, _defaults(type(value))) if not _same(v, default)
            )
            return self.write(type(value).__name__) and self._items("(", ")", changed, None, self._field)
        return self.write(repr(value))  # anything else is small (numbers, enums, None)

    def _pair(self, item: tuple[Any, Any]) -> bool:
        return self.value(item[0]) and self.write(": ") and self.value(item[1])

    def _field(self, item: tuple[str, Any]) -> bool:
        return self.write(f"{item[0]}=") and self.value(item[1])

    def _items(self, open_: str, close: str, items: Any, count: int | None, each: Any) -> bool:
        if not self.write(open_):
            return False
        for i, item in enumerate(items):
            if (i and not self.write(", ")) or not each(item):
                return self.stop("…" if count is None else f"… ({count} items)")
        return self.write(close)


_REQUIRED = object()


@cache
def _defaults(cls: type[msgspec.Struct]) -> tuple[tuple[str, object], ...]:
    """(name, default) of each field of a Struct type; `_REQUIRED` for fields without one."""
    out: list[tuple[str, object]] = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            out.append((f.name, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            out.append((f.name, f.default_factory()))
        else:
            out.append((f.name, _REQUIRED))
    return tuple(out)


def _same(value: object, default: object) -> bool:
    """`value == default` for the plain defaults fields have (None, numbers, empty lists):
    cheap whatever `value` is (a list of a million items differs from [] by its length)."""
    if default is _REQUIRED:
        return False
    if default is None and isinstance(value, list | dict | str) and not value:
        return True  # None normalised to an empty list (SamplingParams' stop, stop_token_ids)
    try:
        return bool(type(value) is type(default) and value == default)
    except Exception:
        return False
