"""Per-request token-id lists are prepared once (deduplicated) when the core takes a request,
and the per-step stop checks and logit processors never walk them again."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.engine.config import SchedulerConfig
from triollm.engine.execution.model_runner import _sampling_row
from triollm.engine.execution.sampler import SamplingRow, process_logits
from triollm.engine.execution.sampling_plan import BadWords, SamplingPlan
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.scheduling.block_manager import BlockManager
from triollm.engine.scheduling.request_state import Request
from triollm.engine.scheduling.scheduler import ScheduledRequest, Scheduler

V = 64


class _Touches:
    count = 0


class CountingList(list[int]):
    def __iter__(self) -> Any:
        _Touches.count += 1
        return super().__iter__()

    def __contains__(self, item: object) -> bool:
        _Touches.count += 1
        return super().__contains__(item)

    def __getitem__(self, i: Any) -> Any:
        _Touches.count += 1
        return super().__getitem__(i)

    def __len__(self) -> int:
        _Touches.count += 1
        return super().__len__()


class CountingDict(dict[int, float]):
    def __iter__(self) -> Any:
        _Touches.count += 1
        return super().__iter__()

    def __len__(self) -> int:
        _Touches.count += 1
        return super().__len__()

    def values(self) -> Any:
        _Touches.count += 1
        return super().values()


def test_lists_are_walked_at_admission_only() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=3)
    params.stop_token_ids = CountingList(range(10, 40))
    params.allowed_token_ids = CountingList([*range(5, 50), 7, 7])
    params.logit_bias = CountingDict({5: 1.0, 6: -2.0})
    core = EngineCoreRequest("r", [1, 2, 3], params, eos_token_ids=[0])
    req = Request(core, 8)  # the core's admission: the only place the lists are read
    sched = Scheduler(SchedulerConfig(4, 64, True), BlockManager(8, 4), max_model_len=64)
    _Touches.count = 0
    logits = torch.randn(1, V)
    for step in range(6):
        row = _sampling_row(ScheduledRequest(req, 1, req.num_tokens - 1))
        token = int(process_logits(logits, [row]).argmax())
        req.append_output_token(token)
        if step < 2:
            assert token not in range(10, 40)  # min_tokens bans the stop token ids
        sched.check_stop(req, 12 + step)  # a stop token id, once past min_tokens
    assert _Touches.count == 0


def test_plan_deduplicates() -> None:
    params = SamplingParams(stop_token_ids=[3, 3, 4], allowed_token_ids=[9, 8, 9, 8, 7])
    plan = SamplingPlan.prepare(params, [4, 2, 2], [[1, 2], [1, 2], [5], [5], []])
    assert plan.eos_token_ids == {2, 4} and plan.stop_token_ids == {3, 4}
    assert plan.min_tokens_bans == (4, 2, 3)
    assert plan.allowed_token_ids is not None and plan.allowed_token_ids.tolist() == [9, 8, 7]
    assert plan.bad_words == BadWords((5,), {1: {(1,): (2,)}})
    assert SamplingPlan.prepare(SamplingParams()).bad_words is None


def _bans_reference(words: list[list[int]], out: list[int]) -> set[int]:
    """The rule as it was computed every step: compare each word with the output's tail."""
    bans = set()
    for word in words:
        prefix = len(word) - 1
        if prefix <= len(out) and (prefix == 0 or out[-prefix:] == word[:-1]):
            bans.add(word[-1])
    return bans


@settings(max_examples=150, deadline=None)
@given(
    words=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=8),
    out=st.lists(st.integers(0, 3), max_size=6),
)
def test_bad_words_table_matches_the_rule(words: list[list[int]], out: list[int]) -> None:
    table = BadWords.prepare(words)
    assert (set(table.bans(out)) if table else set()) == _bans_reference(words, out)


def test_duplicates_do_not_change_the_logits() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    kw: dict[str, Any] = {"min_tokens": 2, "logit_bias": {3: 5.0, 4: -1.0}}
    plain = SamplingParams(stop_token_ids=[6], allowed_token_ids=[3, 4, 5, 6], **kw)
    doubled = SamplingParams(stop_token_ids=[6, 6], allowed_token_ids=[3, 4, 3, 5, 6, 5], **kw)
    rows = [
        SamplingRow(plain, [1], [], [5], [[3]]),
        SamplingRow(doubled, [1], [], [5, 5], [[3], [3]]),
    ]
    out = process_logits(logits.clone(), rows)
    expected = torch.full((V,), float("-inf"))
    expected[4] = logits[1, 4] - 1.0  # 3 is a bad word, 5 EOS and 6 a stop id below min_tokens
    assert torch.equal(out[1], expected)
    expected[4] = logits[0, 4] - 1.0
    assert torch.equal(out[0], expected)
