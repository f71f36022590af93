"""The two checks every resolver uses: each raises `ValueError` naming the field and what it
allows (tests match these words)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["one_of", "positive"]


def one_of(name: str, value: object, allowed: Sequence[object], hint: str = "") -> None:
    """`value` is one of `allowed`, else "name: value is not supported; allowed: ..."."""
    if value not in allowed:
        listed = ", ".join(str(a) for a in allowed)
        suffix = f" ({hint})" if hint else ""
        raise ValueError(f"{name}: {value!r} is not supported; allowed: {listed}{suffix}")


def positive(name: str, value: object) -> None:
    """`value` is an int above 0, else "name: must be a positive integer, got value"."""
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
