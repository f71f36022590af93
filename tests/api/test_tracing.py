"""OpenTelemetry tracing (`--otlp-traces-endpoint`, api/tracing.py): one "llm_request" span per
engine request with vLLM's `gen_ai.*` attributes, its parent the caller's `traceparent`.

In process through an in-memory exporter handed to `RequestTracer.with_exporter` (asyncio and
trio), and through a real `triollm serve` exporting OTLP http/protobuf to a collector on
127.0.0.1 that this test runs.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from acceptance.server import run_server

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.api.tracing import RequestTracer, SpanAttributes

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
A = SpanAttributes


@pytest.mark.anyio
async def test_a_span_per_request_under_the_callers_trace(llm: AsyncLLM) -> None:
    exporter = InMemorySpanExporter()
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,)))
    state.tracer = RequestTracer.with_exporter(exporter)
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9}
        r = await client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
        r = await client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
    state.tracer.shutdown()
    completion, streamed = exporter.get_finished_spans()
    assert completion.name == streamed.name == "llm_request"
    assert completion.parent is not None
    assert format(completion.context.trace_id, "032x") == TRACE_ID
    assert format(completion.parent.span_id, "016x") == PARENT_ID
    assert streamed.parent is None  # no traceparent: a trace of its own
    attrs: dict[str, Any] = dict(completion.attributes or {})
    assert attrs[A.GEN_AI_REQUEST_ID].startswith("cmpl-")
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == MODEL
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == prompt_tokens
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 4
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert abs(attrs[A.GEN_AI_REQUEST_TOP_P] - 0.9) < 1e-6
    assert attrs[A.GEN_AI_REQUEST_N] == 1
    e2e = attrs[A.GEN_AI_LATENCY_E2E]
    assert 0 < attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] <= e2e
    assert 0 <= attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] <= e2e
    assert attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] > 0 and attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] > 0
    inference = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE]
    prefill_decode = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] + attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE]
    assert abs(inference - prefill_decode) < 1e-6
    assert completion.start_time is not None and completion.end_time is not None
    assert (completion.end_time - completion.start_time) / 1e9 == pytest.approx(e2e, abs=0.05)
    assert dict(streamed.attributes or {})[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 3


def test_tracing_off_imports_nothing() -> None:
    """The server without an endpoint never imports OpenTelemetry (a fresh interpreter)."""
    code = (
        "import sys\n"
        "import triollm.api.app, triollm.api.server, triollm.api.serve_args, triollm.api.tracing\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- an OTLP collector on loopback


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes]
    got: threading.Event

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append(body)
        type(self).got.set()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, type[_Collector]]]:
    handler = type("Collector", (_Collector,), {"bodies": [], "got": threading.Event()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_serve_exports_spans_to_an_otlp_collector(
    tiny_model_dir: Path, collector: tuple[str, type[_Collector]]
) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    endpoint, handler = collector
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # export within 50 ms rather than 5 s
    with run_server(tiny_model_dir, "--otlp-traces-endpoint", endpoint, env=env) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"model": "x", "prompt": "Hello", "max_tokens": 2}
            body["model"] = client.get("/v1/models").json()["data"][0]["id"]
            r = client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
            assert r.status_code == 200, r.text
        assert handler.got.wait(30), "no spans reached the collector:\n" + "".join(server.log)
    spans = []
    for raw in handler.bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(raw)
        spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    [span] = spans
    assert span.name == "llm_request"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS].int_value == 2
    assert attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN].double_value > 0
