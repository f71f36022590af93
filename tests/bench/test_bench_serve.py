"""`triollm bench serve`: the statistics on known timings, and a run against a fake SSE server."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from triollm.bench.serve import (
    RequestResult,
    ServeBenchOptions,
    StreamAccumulator,
    add_serve_bench_parser,
    make_workload,
    percentile,
    run_benchmark,
    summarize,
)

# ---------------------------------------------------------------------------- the math


def test_percentile_matches_numpy() -> None:
    for xs in ([5.0], [3.0, 1.0], [1.0, 2.0, 3.0, 4.0], list(np.random.default_rng(0).random(37))):
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) == 0.0


def _chunk(
    text: str, completion_tokens: int | None = None, prompt_tokens: int = 3
) -> dict[str, Any]:
    out: dict[str, Any] = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if completion_tokens is not None:
        out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return out


def test_continuous_usage_counts_tokens_per_chunk() -> None:
    acc = StreamAccumulator(start=10.0, prompt_len=99)
    acc.feed(_chunk("a", 1), 10.5)  # TTFT 0.5
    acc.feed(_chunk("b", 2), 10.6)  # one token, 0.1 after the last
    acc.feed(_chunk("cde", 5), 10.9)  # three merged tokens: 0.3 / 3 each
    acc.feed(_chunk("", 5), 10.95)  # no new token (e.g. the finish chunk): no ITL
    acc.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}, 11.0)
    r = acc.finish(11.0)
    assert r.success and r.error == ""
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert r.output_len == 5
    assert r.prompt_len == 3  # the server's count wins over the workload's
    assert r.latency == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.5) / 4)


def test_without_continuous_usage_a_chunk_with_text_is_one_token() -> None:
    acc = StreamAccumulator(start=0.0, prompt_len=4)
    acc.feed(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.1
    )  # chat role chunk
    acc.feed({"choices": [{"index": 0, "delta": {"content": "x"}}]}, 0.2)
    acc.feed({"choices": [{"index": 0, "delta": {"content": "yz"}}]}, 0.5)
    acc.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, 0.5)
    acc.feed({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, 0.6)
    r = acc.finish(0.6)
    assert r.ttft == pytest.approx(0.2)
    assert r.itl == pytest.approx([0.3])
    assert r.output_len == 3  # from the final usage, not the 2 chunks
    assert "".join(acc.text) == "xyz"


def test_error_event_raises() -> None:
    acc = StreamAccumulator(start=0.0, prompt_len=1)
    with pytest.raises(RuntimeError, match="boom"):
        acc.feed({"error": {"message": "boom", "type": "InternalServerError", "code": 500}}, 0.1)


def test_summarize_known_timings() -> None:
    ok = [
        RequestResult(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(True, 20, 3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(True, 30, 1, ttft=0.2, latency=0.2, itl=[]),
    ]
    bad = RequestResult(False, 40, 0, latency=0.05, error="HTTP 503: busy")
    s = summarize([*ok, bad], duration=2.0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(float(np.percentile([100, 300, 200], 99)))
    assert s["std_ttft_ms"] == pytest.approx(float(np.std([100, 300, 200])))  # vLLM's keys
    assert s["duration"] == s["duration_s"] == 2.0 and s["latencies"] == [0.5, 0.7, 0.2, 0.05]
    assert s["itls"][0] == [0.1] * 4 and s["max_concurrent_requests"] == 3
    assert summarize(ok, 2.0, percentiles=(50, 99.9))["p99.9_e2el_ms"] == pytest.approx(
        float(np.percentile([500, 700, 200], 99.9))
    )
    assert s["mean_itl_ms"] == pytest.approx(1e3 * (0.4 + 0.4) / 6)  # per token, pooled
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["mean_tpot_ms"] == pytest.approx(
        1e3 * (0.4 / 4 + 0.4 / 2) / 2
    )  # 1-token requests have none
    assert s["mean_e2el_ms"] == pytest.approx(1e3 * 1.4 / 3)
    assert s["errors"] == ["", "", "", "HTTP 503: busy"]


def test_workload_is_seeded_and_in_range() -> None:
    a = make_workload(16, (4, 9), (2, 5))
    assert a == make_workload(16, (4, 9), (2, 5))
    assert all(4 <= len(r.prompt) == r.prompt_len <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert all(isinstance(t, int) and 0 <= t < 10000 for r in a for t in r.prompt)
    text = make_workload(4, (6, 6), (3, 3), kind="text")
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 6 for r in text)


# ---------------------------------------------------------------------------- a fake server

TTFT_S = 0.03
STEP_S = 0.01


class FakeServer:
    """/v1/models and streaming /v1/completions + /v1/chat/completions: the first token after
    TTFT_S, then two tokens per chunk every STEP_S (a merged chunk), usage as asked."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.fail_next = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
            ]
        )

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_next:
            self.fail_next -= 1
            return JSONResponse(
                {"error": {"message": "busy", "type": "ServiceUnavailableError", "code": 503}}, 503
            )
        chat = request.url.path.endswith("chat/completions")
        n = body["max_tokens"]
        prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
        continuous = body.get("stream_options", {}).get("continuous_usage_stats", False)

        def chunk(text: str, done: int, finish: str | None = None) -> str:
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            out: dict[str, Any] = {"object": "chunk", "model": body["model"], "choices": [choice]}
            if continuous:
                out["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": done}
            return f"data: {json.dumps(out)}\n\n"

        async def events() -> Any:
            await anyio.sleep(TTFT_S)
            yield chunk("t", 1)
            done = 1
            while done < n:
                await anyio.sleep(STEP_S)
                k = min(2, n - done)
                done += k
                yield chunk("t" * k, done)
            yield chunk("", done, "length")
            usage = {"prompt_tokens": len(prompt), "completion_tokens": done}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeServer]]:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.set_inheritable(True)
    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]  # Hypercorn closes the fd it is given
    config.accesslog = None
    config.graceful_timeout = 0.5
    server = FakeServer()
    stop = threading.Event()

    async def main() -> None:
        await serve(
            server.app(), config, shutdown_trigger=lambda: anyio.to_thread.run_sync(stop.wait)
        )

    thread = threading.Thread(
        target=anyio.run, args=(main,), kwargs={"backend": "trio"}, daemon=True
    )
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(f"{url}/v1/models", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    yield url, server
    stop.set()
    thread.join(5)
    sock.close()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_against_fake_server(fake_server: tuple[str, FakeServer], backend: str) -> None:
    url, server = fake_server
    server.bodies.clear()
    opts = ServeBenchOptions(
        base_url=url + "/v1/", num_prompts=6, input_len=(4, 8), output_len=(3, 7), max_concurrency=3
    )
    res = anyio.run(run_benchmark, opts, backend=backend)
    work = make_workload(6, (4, 8), (3, 7))
    assert res["model"] == "fake-model"
    assert res["completed"] == 6 and res["failed"] == 0
    assert (
        res["total_output_tokens"]
        == res["expected_output_tokens"]
        == sum(r.output_len for r in work)
    )
    assert res["total_input_tokens"] == sum(r.prompt_len for r in work)
    # The warm-up request, then the workload, in order of arrival (all at once, 3 at a time).
    first, *bodies = server.bodies
    assert first["max_tokens"] == min(work[0].output_len, 4)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(r.output_len for r in work)
    assert all(b["ignore_eos"] and b["stream"] and b["model"] == "fake-model" for b in bodies)
    assert sorted(map(tuple, (b["prompt"] for b in bodies))) == sorted(
        tuple(r.prompt) for r in work
    )
    assert all(
        b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        for b in bodies
    )
    # Timings: TTFT >= the server's delay; a merged 2-token chunk is two ITLs of STEP_S / 2.
    assert min(res["ttfts"]) >= TTFT_S * 0.9
    assert STEP_S / 2 * 0.9 <= res["median_itl_ms"] / 1e3 < STEP_S * 5
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert res["request_throughput"] == pytest.approx(6 / res["duration_s"])


def test_chat_poisson_and_failures(fake_server: tuple[str, FakeServer]) -> None:
    url, server = fake_server
    server.bodies.clear()
    server.fail_next = 2  # the first two workload requests (no warm-up) get 503
    opts = ServeBenchOptions(
        base_url=url,
        endpoint="chat",
        model="fake-model",
        num_prompts=5,
        input_len=(3, 3),
        output_len=(2, 2),
        request_rate=200.0,
        warmup=False,
        continuous_usage=False,
    )
    res = anyio.run(run_benchmark, opts)
    assert res["completed"] == 3 and res["failed"] == 2
    assert [e.startswith("HTTP 503") for e in res["errors"]].count(True) == 2
    assert res["total_output_tokens"] == 6  # from the final usage chunks
    assert all(len(b["messages"][0]["content"].split()) == 3 for b in server.bodies)
    assert all("continuous_usage_stats" not in b["stream_options"] for b in server.bodies)
    with pytest.raises(ValueError, match="text prompts"):
        anyio.run(
            run_benchmark, ServeBenchOptions(base_url=url, endpoint="chat", prompt_kind="ids")
        )


def test_cli_writes_the_result_file(
    fake_server: tuple[str, FakeServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    parser = argparse.ArgumentParser(prog="triollm bench")
    add_serve_bench_parser(parser.add_subparsers(dest="bench"))
    out = tmp_path / "res.json"
    ns = parser.parse_args(
        [
            "serve",
            "--base-url",
            url,
            "--num-prompts",
            "4",
            "--input-len",
            "5",
            "--output-len",
            "2-3",
            "--request-rate",
            "inf",
            "--result-file",
            str(out),
        ]
    )
    assert ns.input_len == (5, 5) and ns.output_len == (2, 3) and math.isinf(ns.request_rate)
    assert ns.func(ns) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["input_lens"] == [5, 5, 5, 5]
    assert "Output token throughput" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--input-len", "9-3"])


# ---------------------------------------------------------------------------- vLLM's flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triollm bench")
    add_serve_bench_parser(parser.add_subparsers(dest="bench"))
    return parser


def test_a_vllm_bench_serve_line_runs_unchanged(
    fake_server: tuple[str, FakeServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vllm bench serve`'s flags as its docs write them: the same requests (vLLM's random
    lengths, gamma arrivals, headers, sampling, extra body, ids), vLLM's report lines and its
    result file (name and keys)."""
    url, server = fake_server
    port = url.rsplit(":", 1)[1]
    server.bodies.clear()
    server.headers.clear()
    line = (
        "serve --backend vllm --model fake-model --endpoint /v1/completions --dataset-name random "
        "--random-input-len 8 --random-output-len 4 --random-range-ratio 0.5 --num-prompts 6 "
        "--request-rate 200 --burstiness 2 --max-concurrency 2 --host 127.0.0.1 --port " + port + " "
        "--tokenizer some/tokenizer --trust-remote-code --disable-tqdm --num-warmups 2 --ignore-eos "
        "--header x-team=bench --top-k 5 --request-id-prefix bench- --percentile-metrics ttft,tpot,itl,e2el "
        "--metric-percentiles 50,99.9 --save-result --result-dir " + str(tmp_path) + " --label lab "
        "--metadata tp=1 note=x"
    ).split()
    ns = _parser().parse_args([*line, "--extra-body", '{"min_tokens": 1}'])
    assert ns.func(ns) == 0
    warmups, bodies = server.bodies[:2], server.bodies[2:]
    assert len(warmups) == 2 and len(bodies) == 6
    assert all(4 <= len(b["prompt"]) <= 12 and 2 <= b["max_tokens"] <= 6 for b in bodies)  # 8 (4) x [0.5, 1.5]
    assert all(b["top_k"] == 5 and b["min_tokens"] == 1 and b["ignore_eos"] for b in bodies)
    workload = server.headers[2:]
    assert all(h["x-team"] == "bench" for h in server.headers)
    assert sorted(h["x-request-id"] for h in workload) == [f"bench-{i}" for i in range(6)]
    out = capsys.readouterr().out
    assert "{:<40} {:<10}".format("Successful requests:", 6) in out  # vLLM's line format
    assert "P99.9 ITL (ms):" in out and "P50 TTFT (ms):" in out and "Request rate configured (RPS):" in out
    [path] = tmp_path.glob("lab-200.0qps-concurrency2-fake-model-*.json")
    res = json.loads(path.read_text())
    assert res["backend"] == res["endpoint_type"] == "vllm" and res["label"] == "lab"
    assert res["model_id"] == "fake-model" and res["tokenizer_id"] == "some/tokenizer"
    assert (res["num_prompts"], res["request_rate"], res["burstiness"], res["max_concurrency"]) == (6, 200.0, 2.0, 2)
    assert res["tp"] == "1" and res["note"] == "x" and res["completed"] == 6
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{key}_ms", f"median_{key}_ms", f"std_{key}_ms", f"p50_{key}_ms", f"p99.9_{key}_ms"} <= set(res)
    assert 2 <= res["max_concurrent_requests"] <= 6 and res["max_output_tokens_per_s"] > 0
    assert "input_lens" not in res and "itls" not in res  # only with --save-detailed, as vLLM


def test_vllm_chat_backend_and_detailed_results(fake_server: tuple[str, FakeServer], tmp_path: Path) -> None:
    url, server = fake_server
    server.bodies.clear()
    out = tmp_path / "chat.json"
    ns = _parser().parse_args(
        ["serve", "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
         "--random-input-len", "5", "--random-output-len", "3", "--num-prompts", "3", "--random-prefix-len", "4",
         "--save-result", "--save-detailed", "--result-filename", str(out), "--event-loop", "trio"]
    )
    assert ns.func(ns) == 0
    assert all(len(b["messages"][0]["content"].split()) == 9 for b in server.bodies[1:])  # prefix 4 + 5
    prefixes = {" ".join(b["messages"][0]["content"].split()[:4]) for b in server.bodies[1:]}
    assert len(prefixes) == 1
    res = json.loads(out.read_text())
    assert res["backend"] == "openai-chat" and res["output_lens"] == [3, 3, 3] and len(res["itls"]) == 3
    assert res["input_lens"] == [9, 9, 9] and all(t == "ttt" for t in res["generated_texts"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset-name", "sharegpt"], "--dataset-name: 'sharegpt' is not generated here"),
        (["--random-input-len", "8", "--random-range-ratio", "1.5"], "--random-range-ratio: 1.5 is not in [0, 1)"),
        (["--percentile-metrics", "ttft,goodness"], "--percentile-metrics: goodness not among"),
        (["--metric-percentiles", "0,99"], "--metric-percentiles"),
        (["--header", "novalue"], "--header: expected KEY=VALUE"),
    ],
)
def test_vllm_flags_that_cannot_be_honoured_name_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _parser().parse_args(["serve", "--base-url", "http://127.0.0.1:9", *flags])
    assert ns.func(ns) == 2
    assert message in capsys.readouterr().err


def test_server_pid_reports_the_cpu_of_the_server_and_its_children(fake_server: tuple[str, FakeServer]) -> None:
    """--server-pid: the fake server runs in this process, and a child of it spins through the
    run: both show CPU time per output token; a missing process is an error naming the flag."""
    import subprocess
    import sys

    url, _ = fake_server
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 60: pass"])
    try:
        time.sleep(0.3)
        opts = ServeBenchOptions(
            base_url=url, num_prompts=4, input_len=(4, 4), output_len=(30, 30), server_pid=os.getpid()
        )
        res = anyio.run(run_benchmark, opts)
    finally:
        child.kill()
        child.wait()
    assert res["server_pid"] == os.getpid() and res["total_output_tokens"] == 120
    assert res["server_cpu_s"] > 0 and res["server_children_cpu_s"] > 0.05
    assert res["server_children_cpu_ms_per_token"] == pytest.approx(res["server_children_cpu_s"] * 1e3 / 120)
    with pytest.raises(ValueError, match="--server-pid"):
        anyio.run(run_benchmark, ServeBenchOptions(base_url=url, num_prompts=1, server_pid=2**22 + 12345))
