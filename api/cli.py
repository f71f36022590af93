"""The `triollm` command line: `generate`, `chat`, `bench`.

Engine flags are generated from the `EngineArgs` dataclass (vLLM's names, `--max-model-len`
for `max_model_len`, `--served-model-name` included), so the CLI, `LLM(**kwargs)` and the server
share one schema: a flag vLLM knows and triollm does not is rejected (exit 2) as an unknown
keyword is rejected by `LLM(...)`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from triollm.api.bench import add_bench_parser
from triollm.api.server import DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE, DEFAULT_TIMEOUT_KEEP_ALIVE_S
from triollm.api.state import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_HEADER_COUNT,
)
from triollm.engine.config import EngineArgs

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "The three primary colors are",
    "def fibonacci(n):",
]

def _log_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", default=default, choices=["debug", "info", "warning", "error"], help="(default: %(default)s)")


def _sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triollm", description="LLM inference on structured concurrency.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (default model: the bundled SmolLM2)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="a local HF directory, .gguf file, or Hugging Face Hub repo id")
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    serve.add_argument("--backlog", type=int, default=2048, help="the listen backlog: connections the kernel queues before the server accepts them (capped by net.core.somaxconn) (default: %(default)s)")
    serve.add_argument("--api-key", default=os.environ.get("TRIOLLM_API_KEY"), help="require `Authorization: Bearer KEY` on every route but /health, /version, /openapi.json, /tokenize, /detokenize and /metrics (default: $TRIOLLM_API_KEY)")
    serve.add_argument("--api-key-all-routes", action="store_true", help="with --api-key, require the key on every route, /health and /metrics included")
    serve.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S, help="seconds an idle connection stays open, and a new request has to send its headers in (default: %(default)s)")
    serve.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, help="seconds a request's body has to arrive in, else 408 (default: %(default)s)")
    serve.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY, help="the most requests served at once, beyond it 503 (/health and /metrics not counted); 0: no cap (default: %(default)s)")
    serve.add_argument("--h11-max-incomplete-event-size", type=int, default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE, help="the most bytes of a request line and its headers (default: %(default)s)")
    serve.add_argument("--h11-max-header-count", type=int, default=DEFAULT_MAX_HEADER_COUNT, help="the most headers in a request, else 431 (default: %(default)s)")
    serve.add_argument("--allowed-origins", default=None, help='CORS origins, a JSON list or comma-separated, e.g. \'["*"]\' (default: no CORS)')
    serve.add_argument("--shutdown-timeout", type=float, default=0.0, help="seconds in-flight requests get on SIGINT/SIGTERM before they are aborted (default: %(default)s)")
    serve.add_argument("--response-role", default="assistant", help="(default: %(default)s)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one (default: the model's)")
    serve.add_argument("--disable-log-requests", action="store_true", help="(default: %(default)s)")
    serve.add_argument("--worker", choices=["trio", "asyncio"], default="trio", help="the event loop Hypercorn runs on (default: %(default)s)")
    _log_flag(serve, "info")
    EngineArgs.add_cli_args(serve)

    gen = sub.add_parser("generate", help="complete prompts (default: a few example prompts)")
    _log_flag(gen, "warning")
    gen.add_argument("prompts", nargs="*", help="prompts to complete")
    _sampling_flags(gen, 32)
    EngineArgs.add_cli_args(gen)

    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive without one)")
    chat.add_argument("message", nargs="?", default=None, help="answer this message and exit")
    chat.add_argument("--system", default=None, help="an optional system message")
    _log_flag(chat, "warning")
    _sampling_flags(chat, 128)
    EngineArgs.add_cli_args(chat)

    add_bench_parser(sub)
    return parser


def _params(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from triollm.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed
    )


def _llm(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from triollm.actors.llm import LLM

    return LLM.from_engine_args(EngineArgs.from_cli_args(ns))


def cmd_generate(ns: argparse.Namespace) -> int:
    with _llm(ns) as llm:
        prompts = ns.prompts or DEFAULT_PROMPTS
        for out in llm.generate(prompts, _params(ns), use_tqdm=False):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    """One message answered, or (no message) an interactive conversation until EOF / "exit"."""
    with _llm(ns) as llm:
        conversation = [{"role": "system", "content": ns.system}] if ns.system else []
        interactive = ns.message is None
        while True:
            if interactive:
                try:
                    message = input("> ")
                except EOFError:
                    print()
                    return 0
                if message.strip() in ("exit", "quit"):
                    return 0
                if not message.strip():
                    continue
            else:
                message = ns.message
            conversation.append({"role": "user", "content": message})
            reply = llm.chat(conversation, _params(ns), use_tqdm=False)[0].outputs[0].text
            print(reply)
            conversation.append({"role": "assistant", "content": reply})
            if not interactive:
                return 0


def _origins(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    if value.lstrip().startswith("["):
        return tuple(json.loads(value))
    return tuple(v.strip() for v in value.split(",") if v.strip())


def cmd_serve(ns: argparse.Namespace) -> int:
    from triollm.api.server import ServeOptions, default_model_name, run_server
    from triollm.api.state import ServerSettings

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    args = EngineArgs.from_cli_args(ns)
    served = args.served_model_name
    names = tuple([served] if isinstance(served, str) else served or [default_model_name(args)])
    settings = ServerSettings(
        served_model_names=names,
        api_key=ns.api_key or None,
        api_key_all_routes=ns.api_key_all_routes,
        allowed_origins=_origins(ns.allowed_origins),
        response_role=ns.response_role,
        chat_template=ns.chat_template,
        max_logprobs=args.max_logprobs,
        disable_log_requests=ns.disable_log_requests,
        limit_concurrency=ns.limit_concurrency or None,
        h11_max_header_count=ns.h11_max_header_count,
        request_body_timeout=ns.request_body_timeout,
    )
    options = ServeOptions(
        ns.host, ns.port, settings, ns.shutdown_timeout, ns.worker, ns.backlog,
        timeout_keep_alive=ns.timeout_keep_alive,
        h11_max_incomplete_event_size=ns.h11_max_incomplete_event_size,
    )
    return run_server(args, options)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(ns, "log_level", "warning").upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "chat":
            return cmd_chat(ns)
        return int(ns.func(ns))
    except ValueError as exc:
        print(f"triollm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
