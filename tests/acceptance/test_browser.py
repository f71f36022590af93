"""The playground (`/`) and the API reference (`/docs`) in a real browser, as a person uses them.

One `triollm serve` on the tiny model, keyed (`--api-key`) and under `--root-path /api`, and one
headless Chromium (browser.py) for the module; each test loads the page afresh and types the key.
Skipped, saying so, where no Chromium and chromedriver are installed (`make setup` installs them).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from browser import Browser, browser_or_skip, headless_browser
from server import Server, run_server, wait_idle

KEY = "pg-s3cret"
MODEL = "m"
AUTH = {"Authorization": f"Bearer {KEY}"}
ABORTED = f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'
STATS = re.compile(r"^(\d+) tokens · [\d.]+ tok/s · TTFT \d+ ms · finish: (\w+)$")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    browser_or_skip()  # before the server: no browser, no server started for nothing
    args = ("--served-model-name", MODEL, "--api-key", KEY, "--root-path", "/api", "--max-model-len", "512")
    with run_server(tiny_model_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(server: Server) -> Iterator[Browser]:
    with headless_browser() as b:
        yield b


def open_playground(b: Browser, server: Server) -> None:
    """Loads the page, sees it ask for the key, types it: the model list appears."""
    b.get(f"{server.url}/api/")
    assert b.wait_for("document.getElementById('status').textContent") == "this server needs an API key"
    b.type("#api-key", KEY + "\n")  # Enter: the field's change event reloads the model list
    assert b.wait_for("document.getElementById('model').value") == MODEL
    b.type("#temperature", "0")


def aborted(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(ABORTED + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_serve_prints_the_pages(server: Server) -> None:
    """Once listening, after its "(ready)" line, the server prints where the pages are."""
    lines = (f"playground: {server.url}/api/\n", f"API docs: {server.url}/api/docs\n")
    deadline = time.monotonic() + 10
    while not all(line in "".join(server.log) for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = "".join(server.log)
    assert all(line in log for line in lines), log
    assert log.index("(ready)") < log.index(lines[0]) < log.index(lines[1])


def test_a_streamed_answer(browser: Browser, server: Server) -> None:
    """Typed, sent, shown piece by piece as it streams; the same text a plain request gets, and
    the tokens, tokens per second and time to first token under it."""
    open_playground(browser, server)
    browser.type("#max-tokens", "200")
    browser.run(
        "window.seen = new Set(); new MutationObserver(() => {"
        " const e = document.querySelector('.msg.assistant .text'); if (e) window.seen.add(e.textContent.length);"
        "}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});"
    )
    browser.type("#prompt", "Hello there")
    browser.click("#send")
    browser.wait_for("document.querySelector('.msg.assistant[data-state=done]')")
    text = browser.run("return document.querySelector('.msg.assistant .text').textContent;")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 200,
        "temperature": 0,
    }
    plain = httpx.post(f"{server.url}/api/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert text == plain["choices"][0]["message"]["content"] != ""
    lengths = browser.run("return [...window.seen].filter((n) => n > 0);")
    assert len(lengths) >= 2, lengths  # painted more than once before the end
    m = STATS.match(browser.text("#stats"))
    assert m is not None, browser.text("#stats")
    assert (int(m[1]), m[2]) == (plain["usage"]["completion_tokens"], plain["choices"][0]["finish_reason"])
    assert browser.text(".msg.user") == "Hello there"
    errors = [e for e in browser.logs() if "v1/models" not in e]  # the 401 before the key
    assert errors == []


def test_stop_aborts_the_request(browser: Browser, server: Server) -> None:
    """Stop, pressed as the first words show: the fetch is aborted, the server aborts the
    request (counted as finished by "abort") and nothing runs any more."""
    open_playground(browser, server)
    browser.type("#max-tokens", "480")  # seconds of streaming: far longer than the click takes
    before = aborted(server)
    browser.type("#prompt", "Tell me a long story")
    shown = browser.run_async(
        "const done = arguments[arguments.length - 1];"
        "new MutationObserver((_, observer) => {"
        " const e = document.querySelector('.msg.assistant .text');"
        " if (e && e.textContent) { observer.disconnect(); document.getElementById('stop').click(); "
        "done(e.textContent.length); }"
        "}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});"
        "document.getElementById('send').click();"
    )
    assert shown > 0
    browser.wait_for("document.querySelector('.msg.assistant[data-state=stopped]')")
    assert browser.text(".msg.assistant .note") == "(stopped)"
    assert browser.text("#stats").endswith("finish: stopped")
    values = wait_idle(server.url)
    assert values["vllm:num_requests_running"] == 0
    assert aborted(server) == before + 1
    assert browser.run("return document.getElementById('send').disabled;") is False


def test_json_schema_and_a_400_in_place(browser: Browser, server: Server) -> None:
    """The schema box becomes `response_format`: a schema the server rejects shows its 400 where
    the answer would be (the message back in the box); a valid one constrains the answer."""
    open_playground(browser, server)
    browser.click("#format option[value=json_schema]")
    assert browser.run("return document.getElementById('schema-box').hidden;") is False
    browser.type("#schema", '{"type": "nonsense"}')
    browser.type("#prompt", "yes or no?")
    browser.click("#send")
    error = browser.wait_for("document.querySelector('.msg.assistant.error')?.innerText")
    assert error.startswith("400: response_format: invalid JSON schema"), error
    assert browser.run("return document.getElementById('prompt').value;") == "yes or no?"

    browser.type("#schema", json.dumps({"enum": ["yes", "no"]}))
    browser.click("#send")
    browser.wait_for("document.querySelector('.msg.assistant[data-state=done]')")
    assert browser.text(".msg.assistant[data-state=done] .text") in ('"yes"', '"no"')


def test_docs_list_every_route(browser: Browser, server: Server) -> None:
    """Swagger UI over /openapi.json (served beside it under the root path): every operation of
    the document is on the page, the keyed ones with the Authorize lock."""
    browser.logs()  # what earlier tests left
    browser.get(f"{server.url}/api/docs")
    browser.wait_for("document.querySelectorAll('.opblock').length")
    shown = browser.run(
        "return [...document.querySelectorAll('.opblock')].map((e) =>"
        " e.querySelector('.opblock-summary-method').textContent + ' ' + "
        "e.querySelector('.opblock-summary-path').dataset.path);"
    )
    doc = httpx.get(f"{server.url}/api/openapi.json", timeout=5).json()
    expected = [f"{method.upper()} {path}" for path, ops in doc["paths"].items() for method in ops]
    assert sorted(shown) == sorted(expected)
    assert "POST /v1/chat/completions" in shown
    assert doc["servers"] == [{"url": "/api"}]
    assert browser.run("return document.querySelector('.auth-wrapper .authorize') !== null;")
    assert browser.logs() == []
