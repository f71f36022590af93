"""api.metrics: the scrape text from a fake server state and a few request timers."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from triollm.api.metrics import Metrics
from triollm.api.state import ServerSettings
from triollm.engine.core_protocol import EngineCoreStats


def _state(
    stats: EngineCoreStats | None, names: tuple[str, ...] = ("tiny", "alias"), **llm: object
) -> SimpleNamespace:
    return SimpleNamespace(
        llm=SimpleNamespace(last_stats=stats, **llm),
        settings=ServerSettings(served_model_names=names),
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


_PER_ENGINE = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hit_rate",
    "vllm:num_preemptions_total",
}


def _get(samples: dict, name: str, **labels: str) -> float:
    base = {"model_name": "tiny", "engine": "0"} if name in _PER_ENGINE else {"model_name": "tiny"}
    return samples[(name, tuple(sorted({**base, **labels}.items())))]


STATS = EngineCoreStats(
    num_running=3,
    num_waiting=2,
    num_blocks=100,
    num_free_blocks=75,
    num_cached_blocks=10,
    kv_cache_usage=0.25,
    prefix_cache_hit_rate=0.5,
    num_preemptions=4,
)


def test_engine_gauges_from_last_stats() -> None:
    m = Metrics(_state(STATS))
    s = _samples(m.render().decode())
    assert _get(s, "vllm:num_requests_running") == 3
    assert _get(s, "vllm:num_requests_waiting") == 2
    assert _get(s, "vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    assert _get(s, "vllm:prefix_cache_hit_rate") == 0.5
    assert _get(s, "vllm:num_preemptions_total") == 4
    # Read at scrape time: a new step's stats show up in the next scrape.
    m.state.llm.last_stats = EngineCoreStats(0, 0, 100, 100, 0, 0.0, 0.0, 5)
    s = _samples(m.render().decode())
    assert _get(s, "vllm:num_requests_running") == 0
    assert _get(s, "vllm:kv_cache_usage_perc") == 0
    assert _get(s, "vllm:num_preemptions_total") == 5


def test_each_data_parallel_rank_has_its_own_series() -> None:
    idle = EngineCoreStats(0, 0, 100, 100, 0, 0.0, 0.0, 1)
    m = Metrics(_state(STATS, rank_stats=[STATS, idle, None]))
    s = _samples(m.render().decode())
    assert [_get(s, "vllm:num_requests_running", engine=e) for e in "012"] == [3, 0, 0]
    assert _get(s, "vllm:kv_cache_usage_perc", engine="0") == pytest.approx(0.25)
    assert _get(s, "vllm:num_preemptions_total", engine="1") == 1


def test_no_stats_yet_reads_zero() -> None:
    s = _samples(Metrics(_state(None)).render().decode())
    assert _get(s, "vllm:num_requests_running") == 0
    assert _get(s, "vllm:kv_cache_usage_perc") == 0


def test_request_timers() -> None:
    m = Metrics(_state(STATS))
    t = m.request_started("tiny", now=10.0)
    t.on_tokens(0, now=10.1)  # nothing new: ignored
    t.on_tokens(1, now=10.5)  # TTFT 0.5
    t.on_tokens(1, now=10.6)  # ITL 0.1
    t.on_tokens(2, now=10.8)  # a merged chunk: two observations of 0.1
    t.finished("length", prompt_tokens=7, completion_tokens=4, now=11.0)
    t.finished("stop", 7, 4, now=12.0)  # a second call is ignored
    u = m.request_started("alias", now=0.0)  # the label is per served name
    u.on_tokens(3, now=2.0)  # TTFT 2.0; the other two tokens came with the first: no ITL
    u.finished("stop", prompt_tokens=5, completion_tokens=3, now=2.0)
    v = m.request_started("not-served", now=0.0)  # recorded under the first served name
    v.finished(None, prompt_tokens=2, completion_tokens=0, now=0.25)

    s = _samples(m.render().decode())
    assert _get(s, "vllm:time_to_first_token_seconds_count") == 1
    assert _get(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _get(s, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert _get(s, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 0
    assert _get(s, "vllm:inter_token_latency_seconds_count") == 3
    assert _get(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert _get(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.3 / 3)
    assert _get(s, "vllm:e2e_request_latency_seconds_count") == 2
    assert _get(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.25)
    assert _get(s, "vllm:prompt_tokens_total") == 9
    assert _get(s, "vllm:generation_tokens_total") == 4
    assert _get(s, "vllm:request_success_total", finished_reason="length") == 1
    assert _get(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert (
        _get(s, "vllm:request_success_total", finished_reason="stop") == 0
    )  # present from the start

    a = {"model_name": "alias"}
    assert s[
        ("vllm:time_to_first_token_seconds_sum", tuple(sorted(a.items())))
    ] == pytest.approx(2.0)
    assert s[("vllm:inter_token_latency_seconds_count", tuple(sorted(a.items())))] == 0
    assert s[("vllm:generation_tokens_total", tuple(sorted(a.items())))] == 3
    assert (
        s[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "alias")))]
        == 1
    )


def test_request_token_histograms_and_decode_time() -> None:
    # vLLM's 1-2-5 token buckets up to the model's max_model_len.
    config = SimpleNamespace(model=SimpleNamespace(max_model_len=100), actor=SimpleNamespace(data_parallel_rank=0))
    m = Metrics(_state(STATS, config=config))
    t = m.request_started("tiny", now=0.0)
    t.on_tokens(1, now=1.0)
    t.on_tokens(2, now=1.5)
    t.finished("stop", prompt_tokens=7, completion_tokens=3, now=2.0)
    u = m.request_started("tiny", now=0.0)  # aborted before any token: no decode time
    u.finished("abort", prompt_tokens=30, completion_tokens=0, now=0.5)

    s = _samples(m.render().decode())
    les = sorted(
        float(dict(k[1])["le"])
        for k in s
        if k[0] == "vllm:request_prompt_tokens_bucket" and ("model_name", "tiny") in k[1]
    )
    assert les == [1, 2, 5, 10, 20, 50, 100, float("inf")]
    assert _get(s, "vllm:request_prompt_tokens_count") == 2
    assert _get(s, "vllm:request_prompt_tokens_sum") == 37
    assert _get(s, "vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert _get(s, "vllm:request_prompt_tokens_bucket", le="50.0") == 2
    assert _get(s, "vllm:request_generation_tokens_sum") == 3
    assert _get(s, "vllm:request_generation_tokens_bucket", le="1.0") == 1  # the aborted one's 0
    assert _get(s, "vllm:request_decode_time_seconds_count") == 1
    assert _get(s, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.5)
    assert _get(s, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)


def test_every_series_has_the_vllm_prefix() -> None:
    m = Metrics(_state(STATS))
    m.request_started("tiny", now=0.0).finished("stop", 1, 1, now=1.0)
    names = {fam.name for fam in text_string_to_metric_families(m.render().decode())}
    assert names and all(n.startswith("vllm:") for n in names), names
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:request_success"} <= names
    assert "triollm:" not in m.render().decode()


def test_two_instances_do_not_clash() -> None:
    a, b = Metrics(_state(STATS)), Metrics(_state(None))
    ta = a.request_started("tiny", now=0.0)
    ta.on_tokens(1, now=1.0)
    ta.finished("stop", 1, 1, now=1.0)
    sa, sb = _samples(a.render().decode()), _samples(b.render().decode())
    assert _get(sa, "vllm:request_success_total", finished_reason="stop") == 1
    assert _get(sb, "vllm:time_to_first_token_seconds_count") == 0
    assert _get(sa, "vllm:num_requests_running") == 3
    assert _get(sb, "vllm:num_requests_running") == 0


@pytest.mark.anyio
async def test_endpoint_fetches_fresh_stats() -> None:
    calls = []

    async def get_engine_stats() -> EngineCoreStats:
        calls.append(1)
        return EngineCoreStats(9, 1, 10, 1, 0, 0.9, 0.25, 0)

    m = Metrics(_state(STATS, get_engine_stats=get_engine_stats, errored=False))
    app = Starlette(routes=[m.route()])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    s = _samples(r.text)
    assert calls == [1]
    assert _get(s, "vllm:num_requests_running") == 9
    assert _get(s, "vllm:kv_cache_usage_perc") == pytest.approx(0.9)
    assert m.current_stats() is STATS  # the fresh stats served that scrape only


@pytest.mark.anyio
async def test_endpoint_falls_back_when_the_engine_is_dead() -> None:
    async def get_engine_stats() -> EngineCoreStats:
        raise RuntimeError("engine dead")

    m = Metrics(_state(STATS, get_engine_stats=get_engine_stats, errored=False))
    r = await m.endpoint(None)  # type: ignore[arg-type]
    assert _get(_samples(r.body.decode()), "vllm:num_requests_running") == 3


@pytest.mark.anyio
async def test_the_soak_bench_reads_the_served_gauges() -> None:
    """`triollm bench soak` waits for these gauges to read idle, by their served names."""
    from triollm.bench.soak import _wait_idle

    m = Metrics(_state(EngineCoreStats(0, 0, 10, 10, 0, 0.0, 0.0, 0)))
    app = Starlette(routes=[m.route()])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        with anyio.fail_after(5):
            seen = await _wait_idle(client, "")
    assert seen == {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}


@pytest.fixture
def anyio_backend() -> str:
    return "trio"
