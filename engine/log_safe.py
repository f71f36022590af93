"""`log_safe`: a string a client chose, fit for one log line (CWE-117, log forging).

Request ids, model and adapter names, adapter paths, prompts and error texts that quote them
reach log lines formatted with `%s`. A body `{"request_id": "x\\nINFO triollm: ..."}` would
otherwise write a line of the attacker's choosing; an ESC sequence would recolour the terminal
or hide what follows; U+2028, NEL (U+0085) or a bidi override would split or reorder the line
in viewers that honour them. Every such value passes through `log_safe` (the one helper, used by
api/, actors/ and engine/frontend/; it sits in engine/ so that all three can import it) before
it is formatted.

What it does: every character that `str.isprintable` rejects (the C0 and C1 controls, DEL, line
and paragraph separators, format characters such as bidi overrides and zero-width marks,
unassigned code points, spaces other than " ") is written as its Python escape (`\\n`, `\\x1b`,
`\\u2028`), as `repr` writes it; printable text, non-ASCII letters included, is left alone, so
a printable id comes back as the same object without a copy. The value is cut to `limit`
characters first (its length said after the cut), so the line stays bounded whatever was sent.

Rejected: `repr` itself (quotes every value and escapes every backslash and quote, which makes
plain ids harder to grep), `unicode_escape` (escapes every non-ASCII letter of a prompt), and a
logging `Filter` that rewrites records (a logger's filter does not see its children's records,
and a handler's is the application's to install).
"""

from __future__ import annotations

__all__ = ["LOG_SAFE_CHARS", "log_safe"]

# The most characters of one value a line shows (escaping then writes at most 10 for one).
LOG_SAFE_CHARS = 500
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def log_safe(value: object, limit: int = LOG_SAFE_CHARS) -> str:
    """`value` (a str, or anything as `str()` writes it) cut to `limit` characters, with every
    non-printable character escaped: a log line's worth that cannot start another line."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text)} chars)"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    named = _NAMED.get(c)
    if named is not None:
        return named
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
