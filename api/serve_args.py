"""The flags of `triollm serve` beyond the engine's, with vLLM's names, and what they become:
`ServerSettings` (the app) and `ServeOptions` (the socket and Hypercorn).

Checked before the model loads, as vLLM checks them (`validate_parsed_serve_args`), each error
naming the flag: `--enable-auto-tool-choice` needs `--tool-call-parser`, `--enable-log-outputs`
needs request logging, a parser name must be registered (after the `--*-plugin` files are
imported). The parser registries are imported only here, when a parser flag is given.

API keys: `--api-key` takes several keys and may be repeated; without it the key comes from
`$TRIOLLM_API_KEY`, else `$VLLM_API_KEY` (a container written for vLLM keeps its key; when both
are set triollm's own name wins, and the other is reported ignored).

LoRA (serving_models.py): `--lora-modules name=path ...` (or vLLM's JSON form) needs
`--enable-lora`, and each adapter is checked before the model loads (`check_lora_modules`, called
by `run_server`); `$VLLM_ALLOW_RUNTIME_LORA_UPDATING` is read here, once, into the settings.

Request logging is off by default, as in vLLM since 0.10 (`--enable-log-requests` turns it on):
a line per request costs the event loop under load, and vLLM recipes that add
`--disable-log-requests` for that reason keep working (it wins over `--enable-log-requests`).

The browser pages (api/playground.py): `--disable-playground` turns the chat page at `/` off,
`--disable-fastapi-docs` (vLLM's) turns `/docs` off with /openapi.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from triollm.api.server import (
    DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    UVICORN_LOG_LEVELS,
    ServeOptions,
    TLSOptions,
)
from triollm.api.serving_models import (
    RUNTIME_LORA_ENV,
    LoRAModulePath,
    parse_lora_module,
    runtime_lora_updating,
)
from triollm.api.state import (
    CONTENT_FORMATS,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_HEADER_COUNT,
    ServerSettings,
)

__all__ = ["API_KEY_ENVS", "add_serve_args", "api_keys", "check_serve_args", "serve_options"]

log = logging.getLogger("triollm")

API_KEY_ENVS = ("TRIOLLM_API_KEY", "VLLM_API_KEY")  # in this order
KEYED = (
    "every route but the browser pages (/, /docs), /health, /version, /openapi.json, /tokenize, /detokenize and "
    "/metrics"
)


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    add = serve.add_argument
    add("--host", default="127.0.0.1", help="(default: %(default)s)")
    add("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    add("--uds", default=None, help="serve on this unix domain socket instead of --host/--port")
    add("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (with --ssl-certfile)")
    add("--ssl-certfile", default=None, help="serve HTTPS: the certificate (chain) file")
    add("--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates with")
    add(
        "--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
        help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*) (default: %(default)s)",
    )
    add(
        "--backlog",
        type=int,
        default=2048,
        help=(
            "the listen backlog: connections the kernel queues before the server accepts them (capped by "
            "net.core.somaxconn) (default: %(default)s)"
        ),
    )
    add(
        "--root-path",
        default="",
        help=(
            "the ASGI root_path: the prefix a path-routing proxy serves the app under, e.g. /api (requests with and "
            "without it reach the routes)"
        ),
    )
    add(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        metavar="KEY",
        help=(
            f"require `Authorization: Bearer KEY` (any of the keys; the flag may be repeated) on {KEYED} (default: "
            f"${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]})"
        ),
    )
    add(
        "--api-key-all-routes",
        action="store_true",
        help="with --api-key, require the key on every route, /health and /metrics included",
    )
    add(
        "--timeout-keep-alive",
        type=float,
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        help=(
            "seconds an idle connection stays open, and a new request has to send its headers in "
            "(default: %(default)s)"
        ),
    )
    add(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body has to arrive in, else 408 (default: %(default)s)",
    )
    add(
        "--limit-concurrency",
        type=int,
        default=DEFAULT_LIMIT_CONCURRENCY,
        help=(
            "the most requests served at once, beyond it 503 (/health and /metrics not counted); 0: no cap (default: "
            "%(default)s)"
        ),
    )
    add(
        "--h11-max-incomplete-event-size",
        type=int,
        default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
        help="the most bytes of a request line and its headers (default: %(default)s)",
    )
    add(
        "--h11-max-header-count",
        type=int,
        default=DEFAULT_MAX_HEADER_COUNT,
        help="the most headers in a request, else 431 (default: %(default)s)",
    )
    add(
        "--allowed-origins",
        default=None,
        help="CORS origins, a JSON list or comma-separated, e.g. '[\"*\"]' (default: no CORS)",
    )
    add(
        "--allowed-methods",
        type=_json_list("--allowed-methods"),
        default=["*"],
        help='with --allowed-origins, the CORS methods, a JSON list (default: ["*"])',
    )
    add(
        "--allowed-headers",
        type=_json_list("--allowed-headers"),
        default=["*"],
        help='with --allowed-origins, the CORS request headers, a JSON list (default: ["*"])',
    )
    add(
        "--allow-credentials",
        action="store_true",
        help="with --allowed-origins, allow credentials (cookies, Authorization) in CORS requests",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="seconds in-flight requests get on SIGINT/SIGTERM before they are aborted (default: %(default)s)",
    )
    add("--response-role", default="assistant", help="(default: %(default)s)")
    add("--chat-template", default=None, help="a Jinja chat template, or a file holding one (default: the model's)")
    add(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own `chat_template` (vLLM's; off: such a request is a 400)",
    )
    add(
        "--default-chat-template-kwargs",
        type=_json_object("--default-chat-template-kwargs"),
        default=None,
        metavar="JSON",
        help=(
            'a JSON object merged under each request\'s chat_template_kwargs (the request\'s keys win), e.g. '
            '\'{"enable_thinking": false}\''
        ),
    )
    add(
        "--chat-template-content-format",
        choices=list(CONTENT_FORMATS),
        default="auto",
        help=(
            "how a message's content reaches the chat template: string (its text parts joined), openai (a list "
            "of parts), auto (string unless the template loops over a message's content) (default: %(default)s)"
        ),
    )
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (the prompt tokens the prefix cache held)",
    )
    add(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help=(
            "send an OpenTelemetry span per request to this OTLP collector (http/protobuf, or grpc with "
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc); needs the `otel` extra"
        ),
    )
    add(
        "--collect-detailed-traces",
        default=None,
        metavar="MODULES",
        help="accepted (vLLM's model/worker spans); triollm's span per request carries every timing already",
    )
    add(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log a line per request (default: off, as vLLM)",
    )
    add(
        "--disable-log-requests",
        action="store_true",
        help="deprecated, as in vLLM: requests are not logged by default (wins over --enable-log-requests)",
    )
    add(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests, log each request's output text too (cut to --max-log-len, else 500 chars)",
    )
    add(
        "--max-log-len",
        type=int,
        default=None,
        help=(
            "with --enable-log-requests, show the first N prompt characters and token ids (default: the prompt's "
            "length only)"
        ),
    )
    add(
        "--uvicorn-log-level",
        choices=list(UVICORN_LOG_LEVELS),
        default="info",
        help="the HTTP server's log level (Hypercorn's loggers) (default: %(default)s)",
    )
    add("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    add(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve neither the API reference page /docs nor /openapi.json",
    )
    add("--disable-playground", action="store_true", help="serve no chat playground page at / (the API and /docs stay)")
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides, its calls parsed by --tool-call-parser (required with it)',
    )
    add(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the tool-call format the model writes (e.g. hermes, llama3_json, mistral, pythonic)",
    )
    add(
        "--tool-parser-plugin",
        default="",
        metavar="PATH",
        help="a Python file registering more tool parsers, usable by --tool-call-parser",
    )
    add(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split the model's reasoning into reasoning_content (e.g. deepseek_r1, qwen3)",
    )
    add(
        "--reasoning-parser-plugin", default="", metavar="PATH", help="a Python file registering more reasoning parsers"
    )
    add(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="accepted; no effect (the HTTP server and the engine client share one process already)",
    )
    add(
        "--worker",
        choices=["trio", "asyncio"],
        default="trio",
        help="the event loop Hypercorn runs on (default: %(default)s)",
    )
    add(
        "--lora-modules",
        action="extend",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="MODULE",
        help=(
            'with --enable-lora, LoRA adapters served by name from start-up (clients put the name in `model`): '
            'name=path, or JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; several may follow the flag, '
            'which may be repeated'
        ),
    )


def _json_list(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(
                f'expected a JSON list of strings such as \'["GET", "POST"]\', got {text!r}'
            )
        return value

    parse.__name__ = flag
    return parse


def _json_object(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> dict[str, object]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            example = '{"enable_thinking": false}'
            raise argparse.ArgumentTypeError(f"expected a JSON object such as '{example}', got {text!r}")
        return value

    parse.__name__ = flag
    return parse


def _lora_module(text: str) -> LoRAModulePath:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--lora-modules: ")) from None


def _origins(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    if value.lstrip().startswith("["):
        return tuple(json.loads(value))
    return tuple(v.strip() for v in value.split(",") if v.strip())


def api_keys(flag: list[str] | None, environ: os._Environ[str] | dict[str, str] = os.environ) -> tuple[str, ...]:
    """The keys: the flag's, else the first of API_KEY_ENVS that is set and not empty."""
    if flag:
        keys = tuple(k for k in flag if k)
        if len(keys) != len(flag):
            raise ValueError("--api-key: an empty key is not allowed (it would accept `Bearer `)")
        return keys
    found = [(name, environ[name]) for name in API_KEY_ENVS if environ.get(name)]
    if len(found) == 2 and found[0][1] != found[1][1]:
        log.warning("both $%s and $%s are set: $%s is used, $%s ignored", *API_KEY_ENVS, *API_KEY_ENVS)
    return (found[0][1],) if found else ()


def check_serve_args(ns: argparse.Namespace) -> None:
    """vLLM's start-up checks, and the parser names against the registries (ValueError naming
    the flag; the CLI exits 2 with it)."""
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser NAME")
    if ns.enable_log_outputs and not _log_requests(ns):
        raise ValueError("--enable-log-outputs requires --enable-log-requests")
    if ns.root_path and not ns.root_path.startswith("/"):
        raise ValueError(f"--root-path: must start with '/' (e.g. /api), got {ns.root_path!r}")
    if ns.max_log_len is not None and ns.max_log_len < 0:
        raise ValueError(f"--max-log-len: must be 0 or more, got {ns.max_log_len}")
    if ns.tool_parser_plugin or ns.tool_call_parser:
        from triollm.api.tool_parsers import ToolParserManager

        if ns.tool_parser_plugin:
            _named("--tool-parser-plugin", ToolParserManager.import_tool_parser, ns.tool_parser_plugin)
        if ns.tool_call_parser:
            _named("--tool-call-parser", ToolParserManager.get_tool_parser, ns.tool_call_parser)
    if ns.reasoning_parser_plugin or ns.reasoning_parser:
        from triollm.api.reasoning_parsers import ReasoningParserManager

        if ns.reasoning_parser_plugin:
            _named(
                "--reasoning-parser-plugin", ReasoningParserManager.import_reasoning_parser, ns.reasoning_parser_plugin
            )
        if ns.reasoning_parser:
            _named("--reasoning-parser", ReasoningParserManager.get_reasoning_parser, ns.reasoning_parser)
    if ns.otlp_traces_endpoint:
        from triollm.api.tracing import check_otel_available

        check_otel_available()
    if ns.collect_detailed_traces:
        log.warning(
            "--collect-detailed-traces=%s has no effect in triollm: each request's span carries its queue, prefill "
            "and decode times already",
            ns.collect_detailed_traces,
        )
    if ns.disable_frontend_multiprocessing:
        log.warning(
            "--disable-frontend-multiprocessing has no effect in triollm: the HTTP server and the engine client share "
            "one process"
        )


def _named(flag: str, check, value: str) -> None:  # type: ignore[no-untyped-def]
    try:
        check(value)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(flag) else f"{flag} {value!r}: {message}") from None


def _log_requests(ns: argparse.Namespace) -> bool:
    return bool(ns.enable_log_requests) and not ns.disable_log_requests


def serve_options(ns: argparse.Namespace, served_model_names: tuple[str, ...], max_logprobs: int) -> ServeOptions:
    runtime_lora = runtime_lora_updating()
    if runtime_lora:
        log.warning(
            "LoRA dynamic loading & unloading is enabled in the API server ($%s): /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter take adapters from any client. This should ONLY be used for local development!",
            RUNTIME_LORA_ENV,
        )
    settings = ServerSettings(
        served_model_names=served_model_names,
        api_key=api_keys(ns.api_key) or None,
        api_key_all_routes=ns.api_key_all_routes,
        allowed_origins=_origins(ns.allowed_origins),
        allowed_methods=tuple(ns.allowed_methods),
        allowed_headers=tuple(ns.allowed_headers),
        allow_credentials=ns.allow_credentials,
        root_path=ns.root_path.rstrip("/"),
        disable_docs=ns.disable_fastapi_docs,
        response_role=ns.response_role,
        chat_template=ns.chat_template,
        max_logprobs=max_logprobs,
        disable_log_requests=not _log_requests(ns),
        enable_log_outputs=ns.enable_log_outputs,
        max_log_len=ns.max_log_len,
        limit_concurrency=ns.limit_concurrency or None,
        h11_max_header_count=ns.h11_max_header_count,
        request_body_timeout=ns.request_body_timeout,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        trust_request_chat_template=ns.trust_request_chat_template,
        lora_modules=tuple(ns.lora_modules or ()),
        allow_runtime_lora_updating=runtime_lora,
        default_chat_template_kwargs=ns.default_chat_template_kwargs,
        chat_template_content_format=ns.chat_template_content_format,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
    )
    return ServeOptions(
        ns.host, ns.port, settings, ns.shutdown_timeout, ns.worker, ns.backlog,
        timeout_keep_alive=ns.timeout_keep_alive,
        h11_max_incomplete_event_size=ns.h11_max_incomplete_event_size,
        uvicorn_log_level=ns.uvicorn_log_level,
        access_log=not ns.disable_uvicorn_access_log,
        playground=not ns.disable_playground,
        uds=ns.uds,
        ssl=TLSOptions(ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs, ns.ssl_cert_reqs),
    )
