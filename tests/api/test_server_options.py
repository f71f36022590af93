"""Server options of `triollm serve` that reach the socket: `--backlog` is the listen backlog of
our socket and of Hypercorn's (which listens again on it, with 100 unless told)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import TaskStatus

from triollm.api.cli import build_parser
from triollm.api.server import (
    DEFAULT_BACKLOG,
    ServeOptions,
    _hypercorn_config,
    bind_socket,
    log_stats_interval,
    run_server,
    serve,
)
from triollm.api.state import ServerSettings
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio


def listen_backlog(port: int) -> int | None:
    """The backlog of the listening socket on `port` (ss's Send-Q), or None without ss."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    out = subprocess.run([ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True)
    [line] = out.stdout.strip().splitlines()
    return int(line.split()[2])


def test_backlog_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).backlog == DEFAULT_BACKLOG == ServeOptions().backlog
    assert parser.parse_args(["serve", "--backlog", "4096"]).backlog == 4096
    assert "--backlog" in parser._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]


def test_bind_and_hypercorn_config_use_the_backlog() -> None:
    with bind_socket("127.0.0.1", 0, backlog=777) as sock:
        port = sock.getsockname()[1]
        assert listen_backlog(port) in (777, None)
        config = _hypercorn_config(sock, 777)
        assert config.backlog == 777
        os.close(int(config.bind[0].removeprefix("fd://")))


async def test_serving_keeps_the_backlog(tiny_model_dir: Path) -> None:
    """Once Hypercorn is serving on the socket, its backlog is still ours (it was 100)."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss to read a listening socket's backlog")
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=64, multiprocess=False)
    options = ServeOptions(settings=ServerSettings(served_model_names=("m",)), backlog=777)
    with bind_socket("127.0.0.1", 0, backlog=options.backlog) as sock:
        port = sock.getsockname()[1]
        exit_code: list[int] = []

        async def run(*, task_status: TaskStatus[str]) -> None:
            exit_code.append(await serve(args, options, sock, task_status=task_status))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                url = await tg.start(run)
                async with httpx.AsyncClient() as client:
                    assert (await client.get(f"{url}/health")).status_code == 200
                assert listen_backlog(port) == 777
                os.kill(os.getpid(), signal.SIGTERM)  # the server's own signal watcher stops it
        assert exit_code == [0]


def test_client_limit_flags_reach_the_settings_and_hypercorn(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--timeout-keep-alive`, `--h11-max-incomplete-event-size` go to Hypercorn (its read_timeout
    stays off: it would cut a client waiting for a long answer); `--request-body-timeout`,
    `--limit-concurrency` (0: no cap), `--h11-max-header-count` to the app's settings."""
    from triollm.api import cli

    parser = build_parser()
    ns = parser.parse_args(["serve"])
    assert (ns.timeout_keep_alive, ns.h11_max_incomplete_event_size) == (5.0, 16 * 1024)
    assert (ns.request_body_timeout, ns.limit_concurrency, ns.h11_max_header_count) == (60.0, 2048, 256)
    seen: list[ServeOptions] = []
    monkeypatch.setattr("triollm.api.server.run_server", lambda args, options: seen.append(options) or 0)
    argv = [
        "serve", "--timeout-keep-alive", "2.5", "--h11-max-incomplete-event-size", "4096",
        "--request-body-timeout", "7", "--limit-concurrency", "0", "--h11-max-header-count", "32",
    ]
    assert cli.cmd_serve(parser.parse_args(argv)) == 0
    [options] = seen
    assert options.settings is not None
    assert (options.timeout_keep_alive, options.h11_max_incomplete_event_size) == (2.5, 4096)
    settings = options.settings
    assert (settings.request_body_timeout, settings.limit_concurrency, settings.h11_max_header_count) == (7.0, None, 32)
    with bind_socket("127.0.0.1", 0) as sock:
        config = _hypercorn_config(sock, timeout_keep_alive=2.5, h11_max_incomplete_event_size=4096)
        os.close(int(config.bind[0].removeprefix("fd://")))
    assert (config.keep_alive_timeout, config.h11_max_incomplete_size, config.read_timeout) == (2.5, 4096, None)
    for field, value in [("timeout_keep_alive", 0.0), ("h11_max_incomplete_event_size", 10)]:
        with pytest.raises(ValueError, match=field):
            run_server(EngineArgs(), ServeOptions(**{field: value}))


@pytest.mark.parametrize("disabled", [False, True], ids=["logged", "disable-log-stats"])
async def test_serving_logs_the_stats_line_periodically(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, disabled: bool
) -> None:
    """vLLM's "Avg prompt throughput ..." line every $VLLM_LOG_STATS_INTERVAL seconds while
    serving (vLLM's api_server logs it every 10 s); none with --disable-log-stats."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.05")
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=64, multiprocess=False, disable_log_stats=disabled)
    options = ServeOptions(settings=ServerSettings(served_model_names=("m",)))

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Avg prompt throughput")]

    with bind_socket("127.0.0.1", 0) as sock, caplog.at_level(logging.INFO, logger="triollm"):

        async def run(*, task_status: TaskStatus[str]) -> None:
            await serve(args, options, sock, task_status=task_status)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                url = await tg.start(run)
                async with httpx.AsyncClient() as client:
                    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
                    assert (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
                    await anyio.sleep(0.3)
                os.kill(os.getpid(), signal.SIGTERM)
    if disabled:
        assert lines() == []
    else:
        assert any("Avg generation throughput" in line and "Running: 0 reqs" in line for line in lines()), lines()
        assert any(float(line.split("Avg generation throughput: ")[1].split()[0]) > 0 for line in lines())


def test_the_stats_interval_must_be_a_positive_number(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
            log_stats_interval()
    monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL")
    assert log_stats_interval() == 10.0
