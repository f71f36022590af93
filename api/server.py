"""`triollm serve`: the OpenAI-compatible app on Hypercorn, with a lifecycle the app drives.

    bind the port ──▶ start AsyncLLM ──▶ log the URLs ──▶ serve until a stop reason
                                                            │
            SIGINT / SIGTERM, or the engine's death ────────┘
                                                            ▼
    refuse new requests (503) ──▶ let in-flight ones finish for up to --shutdown-timeout s
    (a second SIGINT / SIGTERM cuts this short)
    ──▶ abort the rest (streams end with finish_reason "abort") ──▶ Hypercorn stops
    ──▶ the engine shuts down (child process gone) ──▶ exit 0 (1 if the engine died)

Once it listens it logs the API's URL (the line ends "(ready)"), then the playground's and
/docs's (playground.py), a wildcard host shown as the loopback address a local browser opens.

The port is bound before the model loads, so a taken port fails at once and early clients wait in
the listen backlog (`--backlog`, given to Hypercorn too: it re-listens on the socket, with its own
default of 100 otherwise, and a burst of connections beyond it is reset). Hypercorn's own graceful
timeout is only a backstop: the app ends every stream itself (Hypercorn's asyncio worker did not
exit while an SSE stream stayed open).

Logs: Hypercorn's error log ("hypercorn.error") and an access log ("hypercorn.access", one line
per request as uvicorn writes it, `127.0.0.1:5555 - "GET /v1/models HTTP/1.1" 200`, the path cut
to a bounded length) go to the root handler at `--uvicorn-log-level` (vLLM's name for the HTTP
server's level); `--disable-uvicorn-access-log` drops the access lines.

Slow clients: Hypercorn closes a connection whose request headers are not complete within
`--timeout-keep-alive` seconds of its opening (or of its previous response), and refuses
headers over `--h11-max-incomplete-event-size` bytes; the app times the body and caps
concurrent requests (api/limits.py, which also says what is not bounded).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus

from triollm.actors.async_llm import AsyncLLM
from triollm.api.metrics import Metrics
from triollm.api.playground import page_urls
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

if TYPE_CHECKING:
    from hypercorn.logging import Logger

__all__ = [
    "DEFAULT_BACKLOG",
    "DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE",
    "DEFAULT_TIMEOUT_KEEP_ALIVE_S",
    "UVICORN_LOG_LEVELS",
    "ServeOptions",
    "default_model_name",
    "run_server",
    "serve",
]

log = logging.getLogger("triollm")

_HYPERCORN_GRACE_S = 3.0
DEFAULT_BACKLOG = 2048  # the kernel caps it at net.core.somaxconn
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # vLLM's (uvicorn's) and Hypercorn's default
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024  # Hypercorn's default: request line + headers
LOG_STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"  # vLLM's name and default (seconds)
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
# `--uvicorn-log-level` (vLLM's choices): the level of Hypercorn's loggers; trace is uvicorn's 5.
UVICORN_LOG_LEVELS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10, "trace": 5}
ACCESS_PATH_CHARS = 200  # the most characters of a path (and query) an access line shows


@dataclass(frozen=True)
class TLSOptions:
    """HTTPS (vLLM's --ssl-* flags, handed to Hypercorn): off unless a key and a certificate
    are given; `cert_reqs` is Python's ssl.CERT_NONE/OPTIONAL/REQUIRED (0/1/2)."""

    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0

    @property
    def enabled(self) -> bool:
        return self.keyfile is not None or self.certfile is not None

    def check(self) -> None:
        """At start-up, before the model loads: the files exist and the key fits the
        certificate; a ValueError naming the flag otherwise."""
        import ssl

        if self.enabled and (self.keyfile is None or self.certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile: HTTPS needs both")
        for flag, path in (("--ssl-keyfile", self.keyfile), ("--ssl-certfile", self.certfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: {path} is not a file")
        if self.cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs: {self.cert_reqs} is not one of 0, 1, 2")
        if self.enabled:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                context.load_cert_chain(str(self.certfile), str(self.keyfile))
                if self.ca_certs is not None:
                    context.load_verify_locations(self.ca_certs)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot be loaded ({exc})") from None


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    settings: ServerSettings | None = None  # None: served under the model's directory name
    shutdown_timeout: float = 0.0
    worker: str = "trio"
    backlog: int = DEFAULT_BACKLOG
    # Seconds an idle connection stays open, and a new request has to send its headers in.
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    # The most bytes of a request line and headers (431/400 and the connection closed above).
    h11_max_incomplete_event_size: int = DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE
    uvicorn_log_level: str = "info"  # Hypercorn's loggers (UVICORN_LOG_LEVELS)
    access_log: bool = True  # one line per request (False: `--disable-uvicorn-access-log`)
    playground: bool = True  # the chat page at / (False: `--disable-playground`)
    uds: str | None = None  # a unix domain socket's path, instead of host and port (`--uds`)
    ssl: TLSOptions = TLSOptions()


def default_model_name(engine_args: EngineArgs) -> str:
    """What clients put in `model` when no --served-model-name is given: the model argument."""
    return engine_args.model or "SmolLM2-135M-Instruct"


def bind_unix_socket(path: str, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A listening unix domain socket at `path` (`--uds`); a stale socket file left there by a
    server that died is replaced, any other file is an error."""
    import stat

    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    return _listen(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path, backlog, f"--uds: cannot bind {path}")


def bind_socket(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return _listen(sock, (host, port), backlog, f"cannot bind {host}:{port}")


def _listen(sock: socket.socket, address: str | tuple[str, int], backlog: int, failure: str) -> socket.socket:
    """`sock` bound to `address` and listening (inheritable, for the server's workers); closed when
    the bind fails, with an OSError saying `failure` and why."""
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"{failure}: {exc.strerror}") from exc
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def run_server(engine_args: EngineArgs, options: ServeOptions) -> int:
    """Bind, serve until stopped, return the process exit code."""
    if options.worker not in ("trio", "asyncio"):
        raise ValueError(f"worker: {options.worker!r} is not one of trio, asyncio")
    if options.backlog < 1:
        raise ValueError(f"backlog: must be at least 1, got {options.backlog}")
    if not 0 < options.timeout_keep_alive < float("inf"):
        raise ValueError(f"timeout_keep_alive: must be a positive number of seconds, got {options.timeout_keep_alive}")
    if options.uvicorn_log_level not in UVICORN_LOG_LEVELS:
        raise ValueError(
            f"uvicorn_log_level: {options.uvicorn_log_level!r} is not one of {', '.join(UVICORN_LOG_LEVELS)}"
        )
    if options.h11_max_incomplete_event_size < 1024:
        raise ValueError(
            f"h11_max_incomplete_event_size: must be at least 1024 bytes, got {options.h11_max_incomplete_event_size}"
        )
    if options.settings is not None:  # before the port and the model: a bad adapter fails at once
        from triollm.api.serving_models import check_lora_modules

        check_lora_modules(options.settings.lora_modules, options.settings.served_model_names, engine_args)
    options.ssl.check()
    if options.uds is not None:
        sock = bind_unix_socket(options.uds, options.backlog)
    else:
        sock = bind_socket(options.host, options.port, options.backlog)
    try:
        return anyio.run(serve, engine_args, options, sock, backend=options.worker)
    finally:
        sock.close()
        if options.uds is not None:
            with contextlib.suppress(OSError):
                os.unlink(options.uds)


async def serve(
    engine_args: EngineArgs,
    options: ServeOptions,
    sock: socket.socket,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> int:
    from triollm.api.app import build_app

    settings = options.settings or ServerSettings(served_model_names=(default_model_name(engine_args),))
    async with AsyncLLM.from_engine_args(engine_args, chat_template=settings.chat_template) as llm:
        state = ServerState(llm, settings)
        await state.models.check_adapters(llm)  # --lora-modules whole, against the model (serving_models.py)
        if settings.otlp_traces_endpoint is not None:
            from triollm.api.tracing import RequestTracer

            state.tracer = RequestTracer.for_endpoint(settings.otlp_traces_endpoint)
        _attach_metrics(state)
        app = build_app(state, playground=options.playground)
        config = _hypercorn_config(
            sock,
            options.backlog,
            timeout_keep_alive=options.timeout_keep_alive,
            h11_max_incomplete_event_size=options.h11_max_incomplete_event_size,
            log_level=options.uvicorn_log_level,
            access_log=options.access_log,
            tls=options.ssl,
        )
        scheme = "https" if options.ssl.enabled else "http"
        if sock.family == socket.AF_UNIX:
            host, port = "", 0
            url = f"{scheme}+unix:{sock.getsockname()}"
        else:
            host, port = sock.getsockname()[:2]
            url = f"{scheme}://{host}:{port}"
        stop = anyio.Event()
        died = False

        async def watch_engine() -> None:
            nonlocal died
            await llm.wait_errored()
            died = True
            stop.set()

        escalate = anyio.Event()

        async def shutdown_trigger() -> None:
            await stop.wait()
            await _drain(state, options.shutdown_timeout, escalate)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop, escalate)
            tg.start_soon(watch_engine)
            if not engine_args.disable_log_stats:
                tg.start_soon(_log_stats_every, llm, log_stats_interval())
            actor = llm.config.actor if llm.config is not None else None
            if actor is not None and actor.data_parallel_world > actor.data_parallel_size:
                log.warning(
                    "triollm: data parallel rank %d of %d (external load balancing: this server "
                    "runs that rank alone)", actor.data_parallel_rank, actor.data_parallel_world,
                )
            log.warning("triollm: serving %s on %s (ready)", ", ".join(settings.served_model_names), url)
            pages = {} if sock.family == socket.AF_UNIX else page_urls(
                host, port, settings.root_path, playground=options.playground,
                docs=not settings.disable_docs, scheme=scheme,
            )
            for name, page in pages.items():
                log.warning("triollm: %s: %s", name, page)
            task_status.started(url)
            try:
                await _hypercorn_serve(app, config, shutdown_trigger)
            finally:
                if state.tracer is not None:  # the spans not exported yet leave now
                    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                        await anyio.to_thread.run_sync(state.tracer.shutdown, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
        log.warning("triollm: shutting down%s", " after the engine died" if died else "")
    return 1 if died else 0


def log_stats_interval() -> float:
    """$VLLM_LOG_STATS_INTERVAL: seconds between two stats lines while serving (default 10);
    anything but a positive number is a ValueError naming it."""
    env = os.environ.get(LOG_STATS_INTERVAL_ENV, "")
    if env == "":
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        seconds = float(env)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{LOG_STATS_INTERVAL_ENV}: {env!r} is not a positive number of seconds")
    return seconds


async def _log_stats_every(llm: AsyncLLM, interval: float) -> None:
    """vLLM's periodic stats line while serving (`do_log_stats`: throughput, requests, KV and
    prefix cache), every `interval` seconds. A dead engine ends it: `watch_engine` stops the
    server then."""
    while llm.dead_error is None:
        await anyio.sleep(interval)
        try:
            await llm.do_log_stats()
        except Exception:  # the engine died between the check and the call
            if llm.dead_error is None:
                raise
            return


async def _drain(state: ServerState, grace_s: float, escalate: anyio.Event | None = None) -> None:
    """Refuse new requests; give in-flight ones `grace_s` seconds (cut short when `escalate` is
    set: a second signal); abort the rest. Requests that passed the check but were still being
    tokenized are waited for first (`ServerState.admission`), so none slips in after the abort."""
    state.accepting = False
    llm = state.llm
    if grace_s > 0 and not llm.errored:
        with anyio.move_on_after(grace_s):
            async with anyio.create_task_group() as tg:

                async def on_escalate() -> None:
                    if escalate is not None:
                        await escalate.wait()
                        log.warning("second signal: aborting in-flight requests now")
                        tg.cancel_scope.cancel()

                tg.start_soon(on_escalate)
                await state.wait_admitted()
                await llm.wait_idle()
                tg.cancel_scope.cancel()
    await state.wait_admitted()  # entering requests are in the engine after: abort them too
    if not llm.errored and llm.num_unfinished_requests:
        log.warning("aborting %d in-flight requests", llm.num_unfinished_requests)
        await llm.abort(llm.unfinished_request_ids())


async def _watch_signals(stop: anyio.Event, escalate: anyio.Event | None = None) -> None:
    """SIGINT / SIGTERM: the first starts the drain (`stop`), a second one escalates to abort."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.warning("received %s", signal.Signals(signum).name)
            if stop.is_set() and escalate is not None:
                escalate.set()
            stop.set()


def _hypercorn_config(  # type: ignore[no-untyped-def]
    sock: socket.socket,
    backlog: int = DEFAULT_BACKLOG,
    *,
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    h11_max_incomplete_event_size: int = DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    log_level: str = "info",
    access_log: bool = True,
    tls: TLSOptions | None = None,
):
    import ssl

    from hypercorn.config import Config

    config = Config()
    level = UVICORN_LOG_LEVELS[log_level]
    for name in ("hypercorn.error", "hypercorn.access"):  # they propagate to the root handler
        logging.getLogger(name).setLevel(level)
    config.logger_class = _access_logger_class()
    config.accesslog = logging.getLogger("hypercorn.access") if access_log else None
    config.access_log_format = '%(h)s - "%(r)s" %(s)s'  # uvicorn's line (see AccessLogger)
    config.backlog = backlog  # Hypercorn listens again on the socket it is given, with this
    # A duplicate: Hypercorn closes the descriptor it is given when it stops; ours stays ours.
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.graceful_timeout = _HYPERCORN_GRACE_S
    config.errorlog = logging.getLogger("hypercorn.error")
    # Hypercorn's idle timer: from a connection's opening (or its last response) until a
    # request's headers are complete, whatever bytes trickle in meanwhile; then it closes.
    config.keep_alive_timeout = timeout_keep_alive
    config.h11_max_incomplete_size = h11_max_incomplete_event_size
    config.read_timeout = None  # per read: it would cut a client waiting for a long answer
    if tls is not None and tls.enabled:  # Hypercorn wraps every bound socket in TLS then
        config.keyfile, config.certfile, config.ca_certs = tls.keyfile, tls.certfile, tls.ca_certs
        config.verify_mode = ssl.VerifyMode(tls.cert_reqs)
    return config


async def _hypercorn_serve(app, config, shutdown_trigger) -> None:  # type: ignore[no-untyped-def]
    import sniffio

    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as trio_serve

        await trio_serve(app, config, shutdown_trigger=shutdown_trigger)
        return
    import asyncio

    from hypercorn.asyncio import serve as asyncio_serve

    # Hypercorn's asyncio serve() returns with a cancel request of its TaskGroup (the one its
    # ShutdownError made) still pending on our task; left there, the orderly exit ends in a
    # CancelledError (exit 1). Withdraw what it added, and only that.
    task = asyncio.current_task()
    pending = task.cancelling() if task is not None else 0
    await asyncio_serve(app, config, shutdown_trigger=shutdown_trigger)
    while task is not None and task.cancelling() > pending:
        task.uncancel()


@cache
def _access_logger_class() -> type[Logger]:
    """Hypercorn's `Logger` with uvicorn's access line. Its own atoms copy every header and
    every environment variable per request; these are the three the line shows."""
    from hypercorn.logging import Logger

    from triollm.api.log_bounds import shorten

    class AccessLogger(Logger):
        async def access(self, request: Any, response: Any, request_time: float) -> None:
            # None: the client left before a response (Hypercorn logs the request again when
            # the app's response ends); uvicorn logs one line per response.
            if response is not None:
                await super().access(request, response, request_time)

        def atoms(self, request: Any, response: Any, request_time: float) -> dict[str, str]:
            client = request.get("client")
            host = f"{client[0]}:{client[1]}" if client and len(client) == 2 else (client[0] if client else "-")
            query = request.get("query_string", b"").decode("latin1")
            target = shorten(request.get("path", "") + (f"?{query}" if query else ""), ACCESS_PATH_CHARS)
            line = f"{request.get('method', 'GET')} {target} HTTP/{request.get('http_version', '1.1')}"
            return {"h": host, "r": line, "s": str(response["status"])}

    return AccessLogger


def _attach_metrics(state: ServerState) -> None:
    state.metrics = Metrics(state)
