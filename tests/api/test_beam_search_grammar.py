"""`use_beam_search` takes no grammar (issue 39): a forced tool call (a named function or
"required") or a `guided_*` field with beam search is a 400 naming `use_beam_search`, where the
search used to run unconstrained and answer 200 with text that is no call. Beam search without
a grammar (tool_choice "none", no tools) still runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_app import CHAT
from test_tool_calling import NAMED, WEATHER

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

BEAM = {"use_beam_search": True, "n": 2, "temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def app(tiny_model_dir: Path, anyio_backend: str) -> AsyncIterator[Any]:
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, multiprocess=False, seed=0)
    async with AsyncLLM.from_engine_args(args) as llm:
        yield build_app(ServerState(llm, ServerSettings(served_model_names=("tiny",))))


@pytest.fixture
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": NAMED}),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"}),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": NAMED, "stream": True}),
        ("/v1/completions", {"prompt": "Say", "guided_regex": "(yes|no)"}),
        ("/v1/chat/completions", {"messages": CHAT, "guided_choice": ["yes", "no"]}),
    ],
)
async def test_beam_search_refuses_a_grammar(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    r = await client.post(path, json={"model": "tiny", **BEAM, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "use_beam_search" and "beam search runs without a grammar" in error["message"], error


@pytest.mark.anyio
@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER], "tool_choice": "none"}])
async def test_beam_search_without_a_grammar_still_runs(client: httpx.AsyncClient, extra: dict[str, Any]) -> None:
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, **BEAM, **extra})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
