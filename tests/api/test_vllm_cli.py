"""`vllm serve` command lines unchanged (issue 24, part 4): vLLM's server flags, sizes such as
`4k`, `--config FILE.yaml`, underscore spellings, API keys from `$VLLM_API_KEY` and several keys,
CORS options, `--root-path`, the log flags, `--generation-config` / `--override-generation-config`,
and the start-up checks (exit 2 naming the flag). Parse-level where possible; the app is driven
in-process through httpx's ASGI transport (one tiny engine per backend)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api import cli
from triollm.api.app import APIKeyMiddleware, RootPath, build_app
from triollm.api.request_log import log_output, log_request
from triollm.api.serve_args import api_keys
from triollm.api.server import ServeOptions, _hypercorn_config, bind_socket
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs
from triollm.engine.loading.model_config import ModelConfig

MODEL = "tiny"


def parse(*words: str) -> Any:
    parser = cli.build_parser()
    return parser.parse_args(cli.expand_argv(parser, ["serve", *words]))


def served(monkeypatch: pytest.MonkeyPatch, *words: str) -> ServeOptions:
    """What `triollm serve WORDS` would serve with (the server not started)."""
    seen: list[ServeOptions] = []

    def run_server(args: EngineArgs, options: ServeOptions) -> int:
        seen.append(options)
        return 0

    monkeypatch.setattr("triollm.api.server.run_server", run_server)
    assert cli.main(["serve", *words]) == 0
    [options] = seen
    return options


def exits_2(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """Runs `triollm serve WORDS` expecting exit 2 before anything starts; returns stderr."""
    try:
        code = cli.main(["serve", *words])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------- sizes and spellings


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("4k", 4000),
        ("4K", 4096),
        ("32k", 32000),
        ("1.5k", 1500),
        ("1M", 1 << 20),
        ("2m", 2_000_000),
        ("1g", 10**9),
    ],
)
def test_sizes_as_vllm_reads_them(text: str, value: int) -> None:
    ns = parse("--max-model-len", text, "--max-num-batched-tokens", text, "--kv-cache-memory-bytes", text)
    assert ns.max_model_len == ns.max_num_batched_tokens == ns.kv_cache_memory_bytes == value


def test_bad_sizes_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --max-model-len" in exits_2(capsys, "--max-model-len", "1.5K")
    assert "did you mean 1.5k" in exits_2(capsys, "--max-num-batched-tokens", "1.5K")
    assert "argument --max-model-len: 'lots'" in exits_2(capsys, "--max-model-len", "lots")
    # "auto" / -1: the model's own length, as vLLM's --max-model-len auto
    assert parse("--max-model-len", "auto").max_model_len == -1
    assert EngineArgs(max_model_len=-1).max_model_len is None


def test_underscore_spellings_and_a_yaml_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = parse("--max_model_len=2k", "--served_model_name", "a_b")
    assert (ns.max_model_len, ns.served_model_name) == (2000, ["a_b"])  # values keep their underscores
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 8123\nmax_model_len: 4k\nenable-prefix-caching: false\ntrust-remote-code: true\n"
        "api-key: [k1, k2]\nserved-model-name: from-file\noverride_generation_config: {temperature: 0.5}\n"
    )
    ns = parse("some/model", "--config", str(config), "--port", "9000")  # the command line wins
    assert ns.model_tag == "some/model" and ns.port == 9000
    assert (ns.max_model_len, ns.enable_prefix_caching, ns.trust_remote_code) == (4000, False, True)
    assert ns.api_key == ["k1", "k2"] and ns.served_model_name == ["from-file"]
    assert ns.override_generation_config == {"temperature": 0.5}
    config.write_text("port: 8123\nnot_a_flag: 1\n")
    assert "unknown key 'not_a_flag'" in exits_2(capsys, "--config", str(config))
    assert "cannot read" in exits_2(capsys, "--config", str(tmp_path / "missing.yaml"))


# ---------------------------------------------------------------------------------- API keys


def test_api_keys_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("TRIOLLM_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert served(monkeypatch).settings.api_keys == ()  # type: ignore[union-attr]
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert served(monkeypatch).settings.api_keys == ("from-vllm",)  # type: ignore[union-attr]
    monkeypatch.setenv("TRIOLLM_API_KEY", "from-triollm")
    with caplog.at_level(logging.WARNING, "triollm"):
        assert served(monkeypatch).settings.api_keys == ("from-triollm",)  # type: ignore[union-attr]
    assert "VLLM_API_KEY ignored" in caplog.text
    options = served(monkeypatch, "--api-key", "a", "b", "--api-key", "c")  # the flag wins
    assert options.settings is not None and options.settings.api_keys == ("a", "b", "c")
    with pytest.raises(ValueError, match="--api-key: an empty key"):
        api_keys(["a", ""])
    with pytest.raises(ValueError, match="api_key: every key must be a non-empty string"):
        ServerSettings(served_model_names=("m",), api_key=("a", ""))


@pytest.mark.anyio
async def test_the_key_middleware_accepts_any_listed_key() -> None:
    roots: list[str] = []

    async def ok(scope: Any, receive: Any, send: Any) -> None:
        roots.append(scope["root_path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = RootPath(APIKeyMiddleware(ok, ("k1", "k2"), open_paths=("/health",)), root_path="/api")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for key, status in (("k1", 200), ("k2", 200), ("k3", 401), ("k1k2", 401), ("", 401)):
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == status, key
        for path in ("/health", "/api/health"):  # open with the prefix or without
            assert (await client.get(path)).status_code == 200, path
        assert (await client.get("/api/v1/models")).status_code == 401
        assert (await client.get("/apihealth")).status_code == 401  # no prefix match by a substring
    assert set(roots) == {"/api"}  # every request the app saw carries the root_path


# ----------------------------------------------------- the app: root path, CORS, docs, keys


@pytest.mark.anyio
async def test_root_path_cors_and_docs_in_the_app(llm: AsyncLLM) -> None:
    origin = "http://ui.example"
    settings = ServerSettings(
        served_model_names=(MODEL,), api_key=("k1", "k2"), root_path="/api", disable_docs=True,
        allowed_origins=(origin,), allowed_methods=("GET", "POST"), allowed_headers=("authorization", "content-type"),
        allow_credentials=True,
    )
    app = build_app(ServerState(llm, settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for path in ("/v1/models", "/api/v1/models"):  # a proxy that strips the prefix, one that does not
            r = await client.get(path, headers={"Authorization": "Bearer k2"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, path
        assert (await client.get("/api/health")).status_code == 200  # open, through the prefix too
        for headers in ({}, {"Authorization": "Bearer k1"}):  # --disable-fastapi-docs: not served
            assert (await client.get("/openapi.json", headers=headers)).status_code == 404
        preflight = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        r = await client.options("/api/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"
        assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
        r = await client.options(
            "/v1/chat/completions", headers={**preflight, "Access-Control-Request-Method": "DELETE"}
        )
        assert r.status_code == 400  # a method not allowed


def test_cors_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    settings = served(monkeypatch).settings
    assert settings is not None
    assert (
        settings.allowed_origins,
        settings.allowed_methods,
        settings.allowed_headers,
        settings.allow_credentials,
    ) == ((), ("*",), ("*",), False)
    settings = served(
        monkeypatch, "--allowed-origins", '["http://a"]', "--allowed-methods", '["GET"]',
        "--allowed-headers", '["x-custom"]', "--allow-credentials", "--root-path", "/api/", "--disable-fastapi-docs",
    ).settings
    assert settings is not None
    assert (settings.allowed_origins, settings.allowed_methods, settings.allowed_headers) == (
        ("http://a",),
        ("GET",),
        ("x-custom",),
    )
    assert settings.allow_credentials and settings.root_path == "/api" and settings.disable_docs
    assert "argument --allowed-methods" in exits_2(capsys, "--allowed-methods", "GET")
    assert "--root-path: must start with '/'" in exits_2(capsys, "--root-path", "api")


# ------------------------------------------------------------------------------ logging


def test_log_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    options = served(monkeypatch)
    assert options.settings is not None and options.settings.disable_log_requests  # vLLM's default: off
    assert (options.uvicorn_log_level, options.access_log) == ("info", True)
    options = served(monkeypatch, "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "10")
    assert options.settings is not None and not options.settings.disable_log_requests
    assert options.settings.enable_log_outputs and options.settings.max_log_len == 10
    options = served(monkeypatch, "--enable-log-requests", "--disable-log-requests")  # the old flag wins
    assert options.settings is not None and options.settings.disable_log_requests
    options = served(monkeypatch, "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log")
    assert (options.uvicorn_log_level, options.access_log) == ("warning", False)
    assert "--enable-log-outputs requires --enable-log-requests" in exits_2(capsys, "--enable-log-outputs")
    assert "argument --uvicorn-log-level" in exits_2(capsys, "--uvicorn-log-level", "loud")


@pytest.mark.anyio
async def test_hypercorn_gets_the_level_and_a_bounded_access_line(caplog: pytest.LogCaptureFixture) -> None:
    loggers = [logging.getLogger(name) for name in ("hypercorn.error", "hypercorn.access")]
    levels = [logger.level for logger in loggers]
    try:
        with bind_socket("127.0.0.1", 0) as sock:
            quiet = _hypercorn_config(sock, log_level="warning", access_log=False)
            assert [logger.level for logger in loggers] == [logging.WARNING] * 2
            loud = _hypercorn_config(sock, log_level="trace")
            assert [logger.level for logger in loggers] == [5, 5]  # uvicorn's TRACE
        for config in (quiet, loud):
            os.close(int(config.bind[0].removeprefix("fd://")))
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    assert quiet.accesslog is None and loud.accesslog is loggers[1]
    scope = {
        "method": "GET",
        "path": "/v1/" + "x" * 5000,
        "query_string": b"a=1",
        "http_version": "1.1",
        "client": ("127.0.0.1", 5555),
        "headers": [],
    }
    with caplog.at_level(logging.INFO, "hypercorn.access"):
        await loud.log.access(scope, {"status": 200, "headers": []}, 0.01)
        await quiet.log.access(scope, {"status": 200, "headers": []}, 0.01)
        await loud.log.access(scope, None, 0.01)  # no response (the client left): no line
    [line] = [r.getMessage() for r in caplog.records if r.name == "hypercorn.access"]
    assert line.startswith('127.0.0.1:5555 - "GET /v1/xxx') and line.endswith('HTTP/1.1" 200')
    assert len(line) < 400 and "(5008 chars)" in line


def test_request_and_output_lines_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    base = ServerSettings(served_model_names=("m",))
    off = ServerSettings(served_model_names=("m",), disable_log_requests=True, enable_log_outputs=True)
    shown = ServerSettings(served_model_names=("m",), enable_log_outputs=True, max_log_len=5)
    with caplog.at_level(logging.INFO, "triollm"):
        log_request(off, "r0", {"t": 1}, prompt="secret", prompt_token_ids=[1, 2])
        log_output(off, "r0", "answer", "stop")
        log_output(base, "r1", "answer", "stop")  # outputs need --enable-log-outputs
        log_request(base, "r1", {"t": 1}, prompt="p" * 10_000, prompt_token_ids=list(range(10_000)))
        log_request(shown, "r2", {"t": 1}, prompt="hello world", prompt_token_ids=list(range(10_000)))
        log_output(shown, "r2", "y" * 10_000, "length")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(len(line) < 300 for line in lines), lines
    assert lines[0] == "Received request r1: 10000 prompt tokens, params: {'t': 1}"
    assert "'hello… (11 chars)'" in lines[1] and "[0, 1, 2, 3, 4]" in lines[1]
    assert lines[2].startswith("Generated response r2: output: 'yyyyy… (10000 chars)'") and lines[2].endswith("length")


# ---------------------------------------------------------------------- parsers at start-up


def test_tool_choice_needs_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--enable-auto-tool-choice requires --tool-call-parser" in exits_2(capsys, "--enable-auto-tool-choice")


def test_unknown_parser_names_exit_2_listing_the_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if not hasattr(pytest.importorskip("triollm.api.tool_parsers"), "ToolParserManager"):
        pytest.skip("the tool parser registry is not there yet")
    pytest.importorskip("triollm.api.reasoning_parsers")
    err = exits_2(capsys, "--enable-auto-tool-choice", "--tool-call-parser", "nope")
    assert "--tool-call-parser" in err and "nope" in err and "hermes" in err
    err = exits_2(capsys, "--reasoning-parser", "nope")
    assert "triollm: error: --reasoning-parser" in err and "nope" in err and "deepseek_r1" in err
    options = served(
        monkeypatch, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
    )
    assert options.settings is not None
    assert (
        options.settings.enable_auto_tool_choice,
        options.settings.tool_call_parser,
        options.settings.reasoning_parser,
    ) == (True, "hermes", "qwen3")


def test_a_parser_plugin_registers_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triollm.api.reasoning_parsers")
    plugin = tmp_path / "my_reasoning.py"
    plugin.write_text(
        "from triollm.api.reasoning_parsers import ReasoningParserManager\n"
        "from triollm.api.reasoning_parsers.deepseek import DeepSeekR1ReasoningParser\n"
        "ReasoningParserManager.register_module('my_think')(DeepSeekR1ReasoningParser)\n"
    )
    options = served(monkeypatch, "--reasoning-parser-plugin", str(plugin), "--reasoning-parser", "my_think")
    assert options.settings is not None and options.settings.reasoning_parser == "my_think"


# ------------------------------------------------------------------- generation config


def test_generation_config_sources_and_override(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    own = json.loads((tiny_model_dir / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({**own, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 50})
    )
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "top_k": 20, "do_sample": False}))

    def defaults(**kwargs: Any) -> tuple[dict[str, Any], tuple[int, ...]]:
        config = ModelConfig.from_pretrained(model, **kwargs)
        return config.generation_defaults, config.eos_token_ids

    auto, eos = defaults()
    assert auto == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 50}
    assert defaults(generation_config="vllm") == ({}, eos)  # OpenAI's defaults; stop tokens stay
    assert defaults(generation_config="vllm", override_generation_config={"temperature": 0.5})[0] == {
        "temperature": 0.5
    }
    assert defaults(override_generation_config={"temperature": 0.5, "max_new_tokens": 9})[0] == {
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 9,
    }
    from_folder, folder_eos = defaults(generation_config=str(elsewhere))
    assert from_folder == {"top_k": 20, "temperature": 0.0} and folder_eos[0] == 7
    args = EngineArgs.from_cli_args(
        parse("--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}')
    )
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"temperature": 0.5})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"generation_config": "/no/such/folder"},
            "generation_config: '/no/such/folder' is not 'auto', 'vllm' or a folder",
        ),
        (
            {"override_generation_config": {"temprature": 0.5}},
            "override_generation_config: unknown key 'temprature'; allowed: temperature, top_p",
        ),
        (
            {"override_generation_config": {"temperature": "hot"}},
            "override_generation_config.temperature: expected a number",
        ),
        ({"override_generation_config": [1]}, "override_generation_config: expected a JSON object"),
    ],
)
def test_bad_generation_config_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_a_folder_without_the_file_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config: .* holds no generation_config.json"):
        ModelConfig.from_pretrained(tiny_model_dir, generation_config=str(tmp_path))


def test_recipe_flags_that_cannot_apply_are_accepted_and_reported() -> None:
    args = EngineArgs.from_cli_args(
        parse(
            "--async-scheduling",
            "--disable-cascade-attn",
            "--enable-expert-parallel",
            "--trust-remote-code",
        )
    )
    assert set(args._ignored_args("cpu")) >= {
        "async_scheduling",
        "disable_cascade_attn",
        "enable_expert_parallel",
        "trust_remote_code",
    }
