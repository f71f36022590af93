"""StopChecker: linear in the text and the stop strings, and exactly the naive semantics.

The reference searches the whole text with `str.find`: the match that ends first wins (the
longest stop string on a tie); with `min_tokens` the text fed unchecked may hold no match. The
streamed output must never contain a character that a stop string later removes, and the
held-back text must be the longest suffix that is a proper prefix of some stop string.
"""

from __future__ import annotations

import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.engine.processing.detokenizer import StopChecker

ALPHABET = "ab c"


def reference(
    text: str, stops: list[str], include: bool, checked_from: int = 0
) -> tuple[str, str | None]:
    """(the whole output, the stop string) by searching the full text."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, checked_from - len(stop) + 1))
        if index >= 0:
            candidate = (index + len(stop), -len(stop), stop)
            best = candidate if best is None else min(best, candidate)
    if best is None:
        return text, None
    end, _, stop = best
    return text[: end if include else end - len(stop)], stop


def held_reference(text: str, stops: list[str]) -> int:
    """The longest suffix of `text` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def run(
    checker: StopChecker, pieces: list[str], num_unchecked: int = 0, trace: bool = False
) -> tuple[str, str | None, list[tuple[str, str]]]:
    """Feed the pieces (the first `num_unchecked` with check=False); flush at the end. Returns
    the output, the stop string and, with `trace`, (text fed so far, output so far) after each
    piece."""
    parts, steps = [], []
    stop = None
    for i, piece in enumerate(pieces):
        emitted, stop = checker.feed(piece, check=i >= num_unchecked)
        parts.append(emitted)
        if trace:
            steps.append(("".join(pieces[: i + 1]), "".join(parts)))
        if stop is not None:
            break
    else:
        parts.append(checker.flush())
    return "".join(parts), stop, steps


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[str], list[str], int]:
    text = draw(st.text(alphabet=ALPHABET, max_size=60))
    # Stop strings drawn from the text itself as well, so that matches are common.
    stops = draw(
        st.lists(
            st.one_of(
                st.text(alphabet=ALPHABET, min_size=1, max_size=6),
                st.builds(lambda a, n: text[a : a + n], st.integers(0, 60), st.integers(1, 12)),
            ),
            min_size=1,
            max_size=4,
        )
    )
    stops = [s for s in stops if s] or ["a"]
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=15)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    num_unchecked = draw(st.integers(0, len(pieces)))
    return text, stops, pieces, num_unchecked


@settings(max_examples=150, deadline=None)
@given(case=cases(), include=st.booleans())
def test_matches_the_full_text_reference(
    case: tuple[str, list[str], list[str], int], include: bool
) -> None:
    text, stops, pieces, num_unchecked = case
    checked_from = len("".join(pieces[:num_unchecked]))
    expected, expected_stop = reference(text, stops, include, checked_from)
    out, stop, trace = run(StopChecker(stops, include), pieces, num_unchecked, trace=True)
    assert (out, stop) == (expected, expected_stop)
    for fed, emitted in trace:
        assert expected.startswith(emitted)  # never emits what a stop string later removes
        if not include and stop is None:
            assert len(fed) - len(emitted) == held_reference(fed, stops)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    period=st.sampled_from(["ab", "aab", "abaab", "a"]),
    include=st.booleans(),
)
def test_long_periodic_stop_strings(seed: int, period: str, include: bool) -> None:
    """Periodic stop strings with near misses: the inputs that make naive suffix checks slow
    and exercise long fall-backs along the failure function."""
    rng = random.Random(seed)
    stop = period * rng.randint(20, 200) + rng.choice("abc")
    text = "".join(
        period * rng.randint(0, 220) + rng.choice(["c", "b", "", stop[: rng.randint(1, len(stop))]])
        for _ in range(rng.randint(1, 6))
    )
    stops = [stop, period * 3]
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        pieces.append(text[i : i + n])
        i += n
    assert run(StopChecker(stops, include), pieces)[:2] == reference(text, stops, include)


def test_duplicate_and_empty_stop_strings_are_dropped() -> None:
    checker = StopChecker(["", "end", "end", "nd"])
    assert checker.stop == ["end", "nd"]
    assert checker.feed("the e") == ("the ", None)
    assert checker.feed("nd") == ("", "end")  # "end" (longer) beats "nd" on the tie


def test_a_long_stop_string_costs_memory_linear_in_it() -> None:
    """A 100,000-character stop string (and 1,000 and 10,000 on the way, so that a quadratic
    checker fails at 10,000 instead of exhausting memory at 100,000): setting it up and
    streaming text that matches half of it, in 4-character pieces, then misses, stays within a
    small multiple of the stop string's own size."""
    rng = random.Random(0)
    for size in (1_000, 10_000, 100_000):
        stop = "".join(rng.choice("abcdefgh") for _ in range(size))
        text = "xyz " + stop[: size // 2] + "!" + stop[: size // 4]
        pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
        tracemalloc.start()
        try:
            out, found, _ = run(StopChecker([stop, "!!"]), pieces)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert (out, found) == (text, None)
        # The output alone is ~0.75 x size characters; the failure function 8 bytes per
        # character matched. A quadratic checker needs size**2 / 2 bytes (50 MB at 10,000).
        assert peak < 16 * size + 1_000_000, f"stop string of {size} characters: peak {peak} bytes"


def test_a_long_stop_string_still_matches_across_pieces() -> None:
    stop = "ab" * 50_000
    checker = StopChecker([stop])
    text = "x" + "ab" * 60_000
    out = ""
    for i in range(0, len(text), 7):
        emitted, found = checker.feed(text[i : i + 7])
        out += emitted
        if found:
            break
    assert (out, found) == ("x", stop)
