"""OpenTelemetry tracing of generation requests, as vLLM traces them (`--otlp-traces-endpoint`).

One span per engine request (one prompt of an HTTP request), named "llm_request" with vLLM's
`gen_ai.*` attribute names (`SpanAttributes`), kind SERVER, from the request's arrival to its
end. Its parent is the caller's span when the HTTP request carries W3C trace context
(`traceparent`, `tracestate`), so an instrumented client's trace continues through the server.
The timings are the request's `RequestOutput.metrics` (engine/outputs.py): time in queue,
to the first token, prefill, decode, inference and end to end.

```
start_generation ── RequestTracer.trace(headers) ──▶ RequestTrace (the parent context)
GenerationResponse._produce ── the finished output ──▶ RequestTrace.record(...) ──▶ span ──▶ exporter
```

Off (no endpoint) it costs nothing: no module of OpenTelemetry is imported (they are imported
here, inside the functions, only when a tracer is built), no context is read, no span made.

Exporters. The endpoint gets the OTLP http/protobuf exporter (a POST of protobuf to the URL as
given, e.g. http://127.0.0.1:4318/v1/traces), or the gRPC one when
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc` (it needs `opentelemetry-exporter-otlp-proto-grpc`).
vLLM's default is gRPC; http is triollm's because it needs no grpcio. Spans leave through
OpenTelemetry's `BatchSpanProcessor` (its own thread: an export never blocks the event loop);
`shutdown()` flushes them when the server stops. Tests hand `RequestTracer.with_exporter` any
`SpanExporter` (an in-memory one): spans are then exported as each ends.

Rejected: setting the global tracer provider (`trace.set_tracer_provider`) as vLLM does. The
server owns its provider; a process that embeds the app keeps its own global one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from triollm.engine.outputs import RequestOutput
from triollm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["TRACE_HEADERS", "RequestTrace", "RequestTracer", "SpanAttributes", "check_otel_available"]

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
SPAN_NAME = "llm_request"  # vLLM's
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_INSTALL_HINT = "pip install 'triollm[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing/utils.py), so dashboards built on them work."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def check_otel_available(flag: str = "--otlp-traces-endpoint") -> None:
    """ValueError naming `flag` when the OpenTelemetry SDK or the exporter is missing."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        if os.environ.get(PROTOCOL_ENV, "http/protobuf") == "grpc":
            import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        else:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"{flag}: OpenTelemetry is not installed ({exc}); {_INSTALL_HINT}") from None


class RequestTracer:
    """The server's tracer: an OpenTelemetry provider and its exporter (see the module
    docstring). Build one with `for_endpoint` or `with_exporter`; `shutdown()` at the end."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("triollm.api")

    @classmethod
    def for_endpoint(cls, endpoint: str) -> RequestTracer:
        """Spans batched to the OTLP collector at `endpoint` (http/protobuf, or grpc by
        `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`)."""
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        check_otel_available()
        protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
        exporter: SpanExporter
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            exporter = GrpcExporter(endpoint=endpoint, insecure=True)
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter(endpoint=endpoint)
        else:
            raise ValueError(f"${PROTOCOL_ENV}: {protocol!r} is not one of http/protobuf, grpc")
        provider = _provider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    @classmethod
    def with_exporter(cls, exporter: SpanExporter) -> RequestTracer:
        """Each span handed to `exporter` as it ends (tests: an in-memory exporter)."""
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = _provider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    def trace(self, headers: Mapping[str, str]) -> RequestTrace:
        """The trace of one HTTP request: its parent is the caller's span in `headers`."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
        return RequestTrace(self, parent)

    def shutdown(self) -> None:
        """Flush the spans not exported yet and stop the exporter (blocking: call from a thread)."""
        self.provider.shutdown()


class RequestTrace:
    """One HTTP request's trace context; `record` makes the span of each of its prompts."""

    def __init__(self, tracer: RequestTracer, parent: Context | None) -> None:
        self._tracer = tracer
        self._parent = parent

    def record(self, request_id: str, model: str, params: SamplingParams, output: RequestOutput) -> None:
        """The span of one finished engine request (its last output carries the metrics)."""
        from opentelemetry.trace import SpanKind

        now = time.time()
        metrics = output.metrics
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: model,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
            SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES: len(output.outputs),
            SpanAttributes.GEN_AI_REQUEST_N: params.n,
        }
        if params.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        attributes[SpanAttributes.GEN_AI_REQUEST_TEMPERATURE] = params.temperature
        attributes[SpanAttributes.GEN_AI_REQUEST_TOP_P] = params.top_p
        start = now
        if metrics is not None:
            start = metrics.arrival_time or now
            attributes.update(
                {
                    SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: metrics.num_generation_tokens,
                    SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: _span(metrics.queued_ts, metrics.scheduled_ts),
                    SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: metrics.first_token_latency,
                    SpanAttributes.GEN_AI_LATENCY_E2E: now - start,
                    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: _span(
                        metrics.scheduled_ts, metrics.first_token_ts
                    ),
                    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: _span(
                        metrics.first_token_ts, metrics.last_token_ts
                    ),
                    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: _span(
                        metrics.scheduled_ts, metrics.last_token_ts
                    ),
                }
            )
        span = self._tracer.tracer.start_span(
            SPAN_NAME,
            context=self._parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=int(start * 1e9),
        )
        span.end(end_time=int(now * 1e9))


def _span(start: float, end: float) -> float:
    """Seconds from `start` to `end` (0.0 when either stamp was never taken)."""
    return end - start if start and end else 0.0


def _provider() -> TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider(resource=Resource.create({"service.name": "triollm", "process.pid": os.getpid()}))
