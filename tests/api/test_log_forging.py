"""Log forging (CWE-117, issue 39): a client string with a newline or another control character
never reaches a log line raw. `log_safe` (engine/log_safe.py) escapes it; the request log, the
Responses route and the error log use it for the request id a client chose (body `request_id`,
`X-Request-Id`), through the real app with request logging on."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_app import CHAT, GREEDY

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

FORGED = "INFO triollm.api: Received request admin: forged line"
# A newline, CR, an ANSI colour, NEL (C1), LINE SEPARATOR, a bidi override, DEL.
EVIL_ID = "evil\n" + FORGED + "\r\x1b[31m\x85\u2028\u202e\x7f"


def test_log_safe_escapes_what_would_split_or_recolour_a_line() -> None:
    from triollm.engine.log_safe import log_safe

    assert log_safe(EVIL_ID) == repr(EVIL_ID)[1:-1]
    assert log_safe(EVIL_ID).isprintable()
    plain = "chatcmpl-3f2a/é-中"
    assert log_safe(plain) is plain  # the common case costs no copy
    assert log_safe("a\\nb") == "a\\nb"  # printable backslashes are left as they are
    long = "x\n" * 1000
    assert log_safe(long, 10) == "x\\nx\\nx\\nx\\nx\\n… (2000 chars)"
    assert log_safe(7) == "7"


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def app(tiny_model_dir: Path, anyio_backend: str) -> AsyncIterator[Any]:
    """One engine per backend; request logging on, outputs too, prompts shown (max_log_len)."""
    settings = ServerSettings(
        served_model_names=("tiny",), disable_log_requests=False, enable_log_outputs=True, max_log_len=40
    )
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, multiprocess=False, seed=0)
    async with AsyncLLM.from_engine_args(args) as llm:
        yield build_app(ServerState(llm, settings))


@pytest.fixture
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


def forged_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "forged line" in r.getMessage()]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **GREEDY}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True, **GREEDY}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **GREEDY}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "temperature": 0}),
    ],
)
async def test_a_request_id_with_a_newline_writes_one_escaped_line(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    caplog.set_level(logging.INFO, logger="triollm")
    r = await client.post(path, json={"model": "tiny", "request_id": EVIL_ID, **body})
    assert r.status_code == 200, r.text
    lines = forged_lines(caplog)
    assert lines, [rec.getMessage() for rec in caplog.records]  # the request was logged
    for line in lines:
        assert line.isprintable(), line  # no raw newline, CR, ESC, C1, separator or bidi control
        assert "evil\\nINFO triollm.api" in line, line


@pytest.mark.anyio
async def test_a_request_id_header_with_a_c1_control_is_escaped(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="triollm")
    header = "hdr\x85" + FORGED  # NEL: a line break to some viewers; HTTP carries it as byte 0x85
    r = await client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, **GREEDY},
        headers={"X-Request-Id": header.encode("latin-1")},  # type: ignore[dict-item]
    )
    assert r.status_code == 200, r.text
    lines = forged_lines(caplog)
    assert lines and all(line.isprintable() and "hdr\\x85INFO" in line for line in lines), lines
