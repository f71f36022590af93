"""A request's own `chat_template` (behind `--trust-request-chat-template`), sent the way a
hostile client would, in process on the tiny model, on asyncio and trio: a path is the
template's text and never a file read; loops, repetition, output, recursion and string growth
stop at the render budget with a quick 400 naming `chat_template` and the limit, in a worker
thread, so /health keeps answering meanwhile; compiled templates stay in a bounded LRU. The
tokenizer-level case is what `LLM.chat(chat_template=...)` runs (the same `render_chat`)."""

from __future__ import annotations

import gc
import os
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import jinja2
import pytest
from test_app import CHAT, GREEDY, assert_error, post

from triollm.api.state import ServerSettings, ServerState
from triollm.engine.processing.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

NESTED_LOOPS = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
# What each hostile template does, and the words of the limit its 400 names.
HOSTILE = {
    "nested loops": (NESTED_LOOPS, "steps"),
    "repetition": ("{{ 'x' * 10**9 }}", "characters, over the limit"),
    "huge output": ("{% for i in range(100000) %}" + "y" * 1000 + "{% endfor %}", "rendered text of more than"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested more than"),
    "macro tree": (
        "{% macro f(n) %}{% if n < 30 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
        "steps",
    ),
    "doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "characters, over the limit",
    ),
}
# More ways to ask for unbounded work, checked on the tokenizer (what `LLM.chat` runs too).
MORE_HOSTILE = [
    "{% set s = namespace(v='x') %}{% for i in range(64) %}{% set t %}{{ s.v }}{{ s.v }}{% endset %}"
    "{% set s.v = t %}{% endfor %}",
    "{% set a = ['x' * 1000] * 1000 %}{% set b = [a] * 1000 %}{{ [b] * 1000 }}",
    "{% set a = ['xxxxxxxx'] %}" + "{% set a = [a, a, a, a] %}" * 20 + "{{ a }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 'x'|center(999999999) }}",
    "{{ 'x'.ljust(999999999) }}",
    "{{ 'a\nb'|indent(999999999) }}",
    "{{ [1]|batch(999999999, 0)|list }}",
    "{{ ['x' * 100000]|tojson(indent=100000) }}",
    "{{ ('a' * 100000).replace('', 'b' * 100000) }}",
    "{{ 2 ** (10 ** 8) }}",
    "{{ (['x' * 1000] * 1000)|map('center', 1000000)|join }}",
    "{% set s = 'x' * 1000000 %}{% set t = 'x' * 1000000 %}{% for i in range(100000) %}{{ s == t }}{% endfor %}",
    "{% for i in range(3) recursive %}{% if loop.depth < 4 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}",
    "{% for i in range(100000) %}{% set x = 'y' * 1000000 %}{% endfor %}",
    "{{ lipsum(1000000, max=1000000) }}",
    "{% include '/etc/passwd' %}",
]
QUICK_S = 10.0  # a budget is ~1 s of CPU; this leaves room for a loaded CI machine


@pytest.fixture(name="settings")
def server_settings() -> ServerSettings:
    return ServerSettings(served_model_names=("tiny",), trust_request_chat_template=True)


def chat_body(template: str, **extra: Any) -> dict[str, Any]:
    return {"messages": CHAT, "chat_template": template, "max_tokens": 1, **GREEDY, **extra}


@pytest.mark.timeout(120)
async def test_a_request_template_that_names_a_file_is_its_own_text(
    client: httpx.AsyncClient, state: ServerState, tmp_path: Path
) -> None:
    secret = f"SECRET-{uuid.uuid4().hex}"
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    tokenizer = state.llm.get_tokenizer()
    for path in (str(secret_file), "/proc/self/environ", str(tmp_path), "/no/such/file"):
        r = await post(client, "/v1/chat/completions", chat_body(path, prompt_logprobs=0))
        assert r.status_code == 200, r.text
        assert secret not in r.text and os.environ.get("PATH", "PATH=") not in r.text
        # The prompt is the path itself: its tokens (all but the first), in the prompt's logprobs.
        rows = r.json()["prompt_logprobs"]
        prompt = "".join(entry["decoded_token"] for row in rows[1:] for entry in row.values())
        assert secret[len("SECRET-") :] not in prompt
        ids = tokenizer.render_chat(CHAT, chat_template=path).token_ids
        assert tokenizer.decode(ids) == path and len(rows) == len(ids)
        assert [next(iter(row)) for row in rows[1:]] == [str(i) for i in ids[1:]]
        assert secret not in tokenizer.render_chat(CHAT, chat_template=path).text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_template_is_a_quick_400_naming_chat_template(client: httpx.AsyncClient, case: str) -> None:
    template, limit = HOSTILE[case]
    start = time.monotonic()
    r = await post(client, "/v1/chat/completions", chat_body(template))
    assert time.monotonic() - start < QUICK_S
    assert_error(r, 400, "chat_template:", limit, param="chat_template")


@pytest.mark.serial
@pytest.mark.timeout(120)
async def test_health_answers_within_a_second_while_hostile_templates_render(client: httpx.AsyncClient) -> None:
    # One hostile request at a time: were one to block the event loop, the test's timeout
    # interrupts it rather than the next one in line.
    answers: list[httpx.Response] = []
    slowest, probes_meanwhile = 0.0, 0

    async def hostile() -> None:
        for case in ("nested loops", "macro tree", "nested loops", "macro tree"):
            answers.append(await post(client, "/v1/chat/completions", chat_body(HOSTILE[case][0])))

    async with anyio.create_task_group() as tg:
        tg.start_soon(hostile)
        while len(answers) < 4:
            start = time.monotonic()
            health = await client.get("/health")
            slowest = max(slowest, time.monotonic() - start)
            assert health.status_code == 200
            probes_meanwhile += len(answers) < 4
            await anyio.sleep(0.02)
    assert probes_meanwhile >= 4 and slowest < 1.0, (probes_meanwhile, slowest)
    for r in answers:
        assert_error(r, 400, "chat_template:", "steps", param="chat_template")


async def test_compiled_templates_stay_in_a_bounded_lru(client: httpx.AsyncClient, state: ServerState) -> None:
    def live_templates() -> int:
        gc.collect()
        return sum(isinstance(o, jinja2.Template) for o in gc.get_objects())

    async def render(i: int) -> None:
        r = await post(client, "/v1/chat/completions", chat_body(f"T{i} {{{{ messages|length }}}}"))
        assert r.status_code == 200, r.text

    before = live_templates()
    for start in range(0, 1000, 50):
        async with anyio.create_task_group() as tg:
            for i in range(start, start + 50):
                tg.start_soon(render, i)
    assert live_templates() - before <= 64
    await render(999)  # the newest is served from the cache
    cache = state.llm.get_tokenizer().templates.statistics()
    assert cache.templates <= 64 and cache.hits >= 1


@pytest.mark.timeout(120)
def test_tokenizer_renders_a_callers_template_under_the_budget(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    long_chat = [{"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 20} for i in range(4000)]
    own = tok.render_chat(long_chat).text
    assert tok.render_chat(long_chat, chat_template=str(tok.chat_template) + "!").text == own + "!"
    for template in [*(t for t, _ in HOSTILE.values()), *MORE_HOSTILE]:
        start = time.monotonic()
        with pytest.raises(ValueError, match="^chat_template: ") as raised:
            tok.render_chat(CHAT, chat_template=template)
        assert time.monotonic() - start < QUICK_S, template
        assert "root:" not in str(raised.value)  # no file was read
