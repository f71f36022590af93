"""Speculative decoding's counters from the engine core's statistics to the frontend: the wire
struct, the data-parallel sum, `get_metrics()`, the stats log line and `/metrics`.

Fakes throughout (made-up `EngineCoreStats`, a namespace for the server state): the real path,
a core that speculates, is tested end to end with the engine.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from triollm.actors import stats as stats_module
from triollm.actors.data_parallel import _combine
from triollm.actors.messages import OutputBatch, UtilityResult, output_decoder
from triollm.actors.stats import FrontendStatistics, StatsLog, engine_metrics
from triollm.api.metrics import Metrics
from triollm.api.state import ServerSettings
from triollm.engine.core_protocol import EngineCoreStats, SpecDecodingStats
from triollm.engine.metrics import Counter, Vector

SPEC = EngineCoreStats(
    num_running=2,
    num_blocks=100,
    num_free_blocks=50,
    kv_cache_usage=0.5,
    spec=SpecDecodingStats(
        num_drafts=10, num_draft_tokens=30, num_accepted_tokens=18, accepted_per_pos=(9, 6, 3)
    ),
)
NO_SPEC = EngineCoreStats(num_running=1, num_blocks=100, num_free_blocks=90, kv_cache_usage=0.1)


def _frontend(prompt: int = 0, generation: int = 0) -> FrontendStatistics:
    return FrontendStatistics(
        num_requests=0, num_sequences=0, num_held=0, queued_prompt_tokens=0, paused=False,
        num_prompt_tokens=prompt, num_generation_tokens=generation, core_pids=(),
        requests_per_rank=None, core_accepting=True,
    )


# ------------------------------------------------------------------ wire and data parallel


def test_step_stats_round_trip_through_msgpack() -> None:
    for msg in (UtilityResult(3, SPEC), OutputBatch.from_outputs([], SPEC)):
        back = output_decoder.decode(msgspec.msgpack.encode(msg))
        assert back == msg
    # Without speculation the fields keep their defaults.
    back = output_decoder.decode(msgspec.msgpack.encode(UtilityResult(4, NO_SPEC)))
    assert isinstance(back, UtilityResult) and isinstance(back.result, EngineCoreStats)
    assert back.result.spec is None


def test_the_core_stats_travel_as_they_are() -> None:
    """What the core reports is the wire value: every field arrives, none copied by hand."""
    core_stats = EngineCoreStats(
        num_running=1, num_waiting=0, num_blocks=8, num_free_blocks=4, num_cached_blocks=0,
        kv_cache_usage=0.5, prefix_cache_hit_rate=0.0, num_preemptions=0,
        num_window_released_blocks=3, spec=SpecDecodingStats(5, 10, 7, (4, 3)),
    )
    back = output_decoder.decode(msgspec.msgpack.encode(OutputBatch.from_outputs([], core_stats)))
    assert isinstance(back, OutputBatch) and back.stats == core_stats
    got = back.stats.spec
    assert got is not None
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == (5, 10, 7)
    assert got.accepted_per_pos == (4, 3)


def test_data_parallel_sums_the_counters() -> None:
    other = EngineCoreStats(spec=SpecDecodingStats(4, 12, 5, (3, 1, 1)))
    combined = _combine(7, [UtilityResult(7, SPEC), UtilityResult(7, other)]).result
    assert isinstance(combined, EngineCoreStats) and combined.spec is not None
    assert combined.spec.num_drafts == 14
    assert combined.spec.num_draft_tokens == 42
    assert combined.spec.num_accepted_tokens == 23
    assert combined.spec.accepted_per_pos == (12, 7, 4)
    # Ranks without speculation add nothing, and the sum stays empty.
    none = _combine(8, [UtilityResult(8, NO_SPEC), UtilityResult(8, NO_SPEC)]).result
    assert isinstance(none, EngineCoreStats) and none.spec is None


def test_data_parallel_merges_every_field() -> None:
    """Counts are summed; the KV usage is that of the pooled blocks, the hit rate the mean."""
    a = EngineCoreStats(
        num_running=1, num_waiting=2, num_blocks=100, num_free_blocks=50, num_cached_blocks=4,
        kv_cache_usage=0.5, prefix_cache_hit_rate=0.2, num_preemptions=1,
        num_window_released_blocks=3,
    )
    b = EngineCoreStats(
        num_running=2, num_blocks=300, num_free_blocks=250, kv_cache_usage=1 / 6,
        prefix_cache_hit_rate=0.6, num_window_released_blocks=1,
    )
    merged = EngineCoreStats.merge([a, b])
    assert merged.prefix_cache_hit_rate == pytest.approx(0.4)
    assert merged == EngineCoreStats(
        num_running=3, num_waiting=2, num_blocks=400, num_free_blocks=300, num_cached_blocks=4,
        kv_cache_usage=0.25, prefix_cache_hit_rate=merged.prefix_cache_hit_rate,
        num_preemptions=1, num_window_released_blocks=4, spec=None,
    )


# ------------------------------------------------------------------ get_metrics()


def test_engine_metrics_has_vllm_spec_counters() -> None:
    metrics = engine_metrics(SPEC, _frontend())
    spec = [m for m in metrics if m.name.startswith("vllm:spec_decode_")]
    by_name = {m.name: m for m in spec if isinstance(m, Counter)}
    assert by_name["vllm:spec_decode_num_drafts"].value == 10
    assert by_name["vllm:spec_decode_num_draft_tokens"].value == 30
    assert by_name["vllm:spec_decode_num_accepted_tokens"].value == 18
    # vLLM's reader shape (its examples/offline_inference/spec_decode.py checks isinstance Vector)
    (per_pos,) = [m for m in spec if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == [9, 6, 3]


def test_engine_metrics_without_speculation_has_none() -> None:
    names = {m.name for m in engine_metrics(NO_SPEC, _frontend())}
    assert "vllm:num_preemptions" in names
    assert not any(n.startswith("vllm:spec_decode_") for n in names)


# ------------------------------------------------------------------ stats log line


def test_stats_log_adds_vllm_spec_line_over_the_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(stats_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    caplog.set_level(logging.INFO, logger="triollm")
    stats_log = StatsLog()

    now[0] = 110.0
    stats_log.log(SPEC, _frontend())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("Avg prompt throughput")
    assert lines[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.80, Accepted throughput: 1.80 tokens/s, "
        "Drafted throughput: 3.00 tokens/s, Accepted: 18 tokens, Drafted: 30 tokens, "
        "Per-position acceptance rate: 0.900, 0.600, 0.300, Avg Draft acceptance rate: 60.0%"
    )

    # The next line covers only what happened since: 5 drafts, 10 tokens, 8 accepted, in 2 s.
    caplog.clear()
    now[0] = 112.0
    later = msgspec.structs.replace(SPEC, spec=SpecDecodingStats(15, 40, 26, (14, 9, 3)))
    stats_log.log(later, _frontend())
    assert caplog.records[1].getMessage() == (
        "SpecDecoding metrics: Mean acceptance length: 2.60, Accepted throughput: 4.00 tokens/s, "
        "Drafted throughput: 5.00 tokens/s, Accepted: 8 tokens, Drafted: 10 tokens, "
        "Per-position acceptance rate: 1.000, 0.600, 0.000, Avg Draft acceptance rate: 80.0%"
    )

    # No drafts since the previous line: only the main line, as in vLLM.
    caplog.clear()
    now[0] = 113.0
    stats_log.log(later, _frontend())
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["Avg prompt throughput"]


def test_stats_log_without_speculation_has_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="triollm")
    StatsLog().log(NO_SPEC, _frontend(prompt=5, generation=7))
    assert len(caplog.records) == 1
    assert "SpecDecoding" not in caplog.records[0].getMessage()


# ------------------------------------------------------------------ /metrics


def _render(stats: EngineCoreStats | None, **llm: object) -> str:
    state = SimpleNamespace(
        llm=SimpleNamespace(last_stats=stats, **llm),
        settings=ServerSettings(served_model_names=("tiny",)),
    )
    return Metrics(state, fresh_stats=False).render().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _key(name: str, engine: str = "0", **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted({"model_name": "tiny", "engine": engine, **labels}.items()))


def test_prometheus_spec_counters() -> None:
    text = _render(SPEC)
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    s = _samples(text)
    assert s[_key("vllm:spec_decode_num_drafts_total")] == 10
    assert s[_key("vllm:spec_decode_num_draft_tokens_total")] == 30
    assert s[_key("vllm:spec_decode_num_accepted_tokens_total")] == 18
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [s[_key(per_pos, position=str(p))] for p in range(3)] == [9, 6, 3]
    assert not any(name.endswith("_created") for name, _ in s)


def test_prometheus_spec_counters_per_data_parallel_rank() -> None:
    other = EngineCoreStats(
        spec=SpecDecodingStats(num_drafts=2, num_draft_tokens=6, accepted_per_pos=(1, 1, 0))
    )
    s = _samples(_render(SPEC, rank_stats=[SPEC, other, None]))
    assert [s[_key("vllm:spec_decode_num_drafts_total", e)] for e in "012"] == [10, 2, 0]
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [s[_key(per_pos, "1", position=str(p))] for p in range(3)] == [1, 1, 0]
    assert [s[_key(per_pos, "2", position=str(p))] for p in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("stats", [NO_SPEC, None])
def test_prometheus_without_speculation_has_no_spec_series(stats: EngineCoreStats | None) -> None:
    text = _render(stats)
    assert "vllm:num_preemptions_total" in text
    assert "spec_decode" not in text


def test_an_idle_engine_logs_its_stats_line_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM keeps an idle server's log quiet: after one idle interval's line, the next idle ones
    go to DEBUG; work brings INFO back at once, and the first idle line after it is INFO."""
    caplog.set_level(logging.DEBUG, logger="triollm")
    idle = EngineCoreStats(num_blocks=100, num_free_blocks=100)
    stats_log = StatsLog()
    levels = []
    for stats, frontend in [
        (idle, _frontend()),  # the first line is written
        (idle, _frontend()),
        (idle, _frontend(prompt=5, generation=7)),  # work finished in this interval
        (idle, _frontend(prompt=5, generation=7)),  # the first idle interval after it
        (idle, _frontend(prompt=5, generation=7)),
        (NO_SPEC, _frontend(prompt=5, generation=7)),  # a request runs
    ]:
        caplog.clear()
        stats_log.log(stats, frontend)
        levels.append(caplog.records[0].levelname)
    assert levels == ["INFO", "DEBUG", "INFO", "INFO", "DEBUG", "INFO"]
