"""The browser pages (api/playground.py) through the ASGI app: `/` and `/docs` served from the
package's static files, open without the key while the API stays keyed, under `--root-path`,
switched off by `--disable-playground` and `--disable-fastapi-docs`; what `triollm serve` and
`triollm chat` print in the terminal. The pages in a real browser: tests/acceptance/test_browser.py."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api import cli
from triollm.api.app import build_app
from triollm.api.playground import STATIC_DIR, page_paths, page_urls
from triollm.api.server import ServeOptions
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

MODEL = "tiny"  # as in conftest.py
KEY = {"Authorization": "Bearer s3cret"}
ROOT = Path(__file__).resolve().parents[2]
PAGES = {  # path: the start of its Content-Type
    "/": "text/html",
    "/playground.js": "text/javascript",
    "/playground.css": "text/css",
    "/docs": "text/html",
    "/docs.js": "text/javascript",
    "/swagger-ui/swagger-ui-bundle.js": "text/javascript",
    "/swagger-ui/swagger-ui.css": "text/css",
}


@asynccontextmanager
async def open_app(llm: AsyncLLM, playground: bool = True, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,), **settings))
    transport = httpx.ASGITransport(app=build_app(state, playground=playground))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


def base_href(page: httpx.Response) -> str:
    [href] = re.findall(r'<base href="([^"]*)">', page.text)
    return href


@pytest.mark.anyio
async def test_pages_are_served_from_the_package(client: httpx.AsyncClient) -> None:
    """Each page and asset with its type, as the file in api/static/ holds it, revalidated by
    ETag; the HTML pages with a Content-Security-Policy of the server alone."""
    for path, media_type in PAGES.items():
        r = await client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type), path
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-cache"
        again = await client.get(path, headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and again.content == b"", path
        assert (await client.head(path)).status_code == 200
    bundle = await client.get("/swagger-ui/swagger-ui-bundle.js")
    assert bundle.content == (STATIC_DIR / "swagger-ui" / "swagger-ui-bundle.js").read_bytes()
    page = await client.get("/")
    assert base_href(page) == "/"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "script-src 'self';" in page.headers["content-security-policy"]
    assert 'id="prompt"' in page.text and 'src="playground.js"' in page.text
    docs = await client.get("/docs")
    assert (
        'src="swagger-ui/swagger-ui-bundle.js"' in docs.text
        and "connect-src 'self'" in docs.headers["content-security-policy"]
    )
    # The pages are no part of the API's description.
    assert not set(PAGES) & set((await client.get("/openapi.json")).json()["paths"])


@pytest.mark.anyio
async def test_pages_open_while_the_api_stays_keyed(llm: AsyncLLM) -> None:
    async with open_app(llm, api_key="s3cret") as client:
        for path in PAGES:
            assert (await client.get(path)).status_code == 200, path
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers=KEY)).status_code == 200
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert r.status_code == 401
    async with open_app(llm, api_key="s3cret", api_key_all_routes=True) as client:
        for path in PAGES:  # every route keyed: the pages too
            assert (await client.get(path)).status_code == 401, path
            assert (await client.get(path, headers=KEY)).status_code == 200, path


@pytest.mark.anyio
async def test_root_path(llm: AsyncLLM) -> None:
    """Under --root-path the pages' relative URLs resolve below it (their <base href>), whether a
    proxy strips the prefix or forwards it; /api redirects to /api/; openapi.json names /api."""
    async with open_app(llm, root_path="/api") as client:
        for path in ("/", "/api/"):
            assert base_href(await client.get(path)) == "/api/", path
        assert base_href(await client.get("/api/docs")) == "/api/"
        r = await client.get("/api")
        assert r.status_code in (307, 308) and r.headers["location"].endswith("/api/")
        doc = (await client.get("/api/openapi.json")).json()
        assert doc["servers"] == [{"url": "/api"}]
        assert (await client.get("/api/playground.js")).status_code == 200
    async with open_app(llm) as client:
        assert "servers" not in (await client.get("/openapi.json")).json()


@pytest.mark.anyio
async def test_disable_playground_and_docs(llm: AsyncLLM) -> None:
    async with open_app(llm, playground=False) as client:
        for path in ("/", "/playground.js", "/playground.css"):
            assert (await client.get(path)).status_code == 404, path
        assert (await client.get("/docs")).status_code == 200
    async with open_app(llm, disable_docs=True, api_key="s3cret") as client:
        for path in ("/docs", "/docs.js", "/swagger-ui/swagger-ui.css", "/openapi.json"):
            assert (await client.get(path, headers=KEY)).status_code == 404, path
        assert (await client.get("/")).status_code == 200
    assert page_paths(playground=False, docs=False) == ()


def test_disable_playground_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServeOptions] = []
    monkeypatch.setattr("triollm.api.server.run_server", lambda args, options: seen.append(options) or 0)
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--disable-playground"]) == 0
    assert [o.playground for o in seen] == [True, False]
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    assert "--disable-playground" in help_text


def test_page_urls() -> None:
    """What `triollm serve` prints: a wildcard host as the loopback address, IPv6 in brackets,
    the root path, only the pages that are on."""
    assert page_urls("127.0.0.1", 8000, "", playground=True, docs=True) == {
        "playground": "http://127.0.0.1:8000/", "API docs": "http://127.0.0.1:8000/docs",
    }
    assert page_urls("0.0.0.0", 80, "/api", playground=True, docs=False) == {"playground": "http://127.0.0.1:80/api/"}
    assert page_urls("::", 8000, "", playground=False, docs=True) == {"API docs": "http://[::1]:8000/docs"}
    assert page_urls("::1", 8000, "", playground=False, docs=False) == {}


def test_static_files_ship_with_the_package() -> None:
    """pyproject's package-data carries every file of api/static/ (a wheel, not only an
    editable install, serves the pages), Swagger UI's licence with them."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data.get("triollm.api", [])
    api = ROOT / "api"
    files = {p.relative_to(api) for p in STATIC_DIR.rglob("*") if p.is_file()}
    shipped = {p.relative_to(api) for g in globs for p in api.glob(g) if p.is_file()}
    assert files and files == shipped
    assert {"LICENSE", "NOTICE"} <= {p.name for p in (STATIC_DIR / "swagger-ui").iterdir()}


def test_pages_fetch_nothing_from_elsewhere() -> None:
    """No CDN and no absolute path: every src, href and fetch in the pages is relative (to the
    <base href> the server sets) or a data: URL."""
    text = {p.name: p.read_text() for p in STATIC_DIR.glob("*") if p.suffix in (".html", ".js", ".css")}
    assert set(text) == {"playground.html", "playground.js", "playground.css", "docs.html", "docs.js"}
    urls = []
    for name, body in text.items():
        body = re.sub(r"<base href=\"/\">", "", body)
        urls += [(name, u) for u in re.findall(r"""(?:src|href)=["']([^"']*)["']""", body)]
        urls += [(name, u) for u in re.findall(r"""fetch\(\s*["'`]([^"'`]*)""", body)]
        urls += [(name, u) for u in re.findall(r"""url\(\s*["']?([^"')]*)""", body)]
        urls += [(name, u) for u in re.findall(r"""new URL\(\s*["']([^"']*)""", body)]
        code = re.sub(r"<!--.*?-->|/\*.*?\*/|^\s*//.*?$", "", body, flags=re.S | re.M)
        assert not re.search(r"https?:|[\"'`(]//", code), name  # no URL of elsewhere outside comments
    assert len(urls) >= 8
    assert [u for u in urls if u[1].startswith("/") or ":" in u[1] and not u[1].startswith("data:")] == []


# ------------------------------------------------------------------------------ the terminal


def test_chat_says_what_loads_and_how_to_leave(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`triollm chat`: what is loading, then ready (as resolved), then how to clear and leave,
    on stderr; /clear starts over (the system message kept); Ctrl-D leaves with exit 0."""
    from triollm.actors.llm import LLM

    typed = iter(["hello", "/clear", "again"])
    sent: list[list[dict[str, str]]] = []
    chat = LLM.chat

    def read(prompt: str) -> str:
        assert prompt == "> "
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    def record(self: LLM, messages: list[dict[str, str]], *args: Any, **kwargs: Any) -> Any:
        sent.append([dict(m) for m in messages])
        return chat(self, messages, *args, **kwargs)

    monkeypatch.setattr("builtins.input", read)
    monkeypatch.setattr(LLM, "chat", record)
    argv = ["chat", "--model", str(tiny_model_dir), "--system", "Be brief.", "--max-tokens", "2",
            "--max-model-len", "64", "--num-threads", "1", "--no-multiprocess"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"triollm: loading {tiny_model_dir} (dtype auto, quantization auto, threads 1)..."
    assert re.fullmatch(
        rf"triollm: ready in [\d.]+ s: {tiny_model_dir.name}, float32, quantization none, 1 thread, 64 tokens of "
        rf"context",
        err[1],
    ), err[1]
    assert err[2] == cli.CHAT_HELP and "/clear" in err[2] and "Ctrl-D" in err[2]
    assert err[3] == "(a new conversation)"
    assert [[m["content"] for m in conversation] for conversation in sent] == [
        ["Be brief.", "hello"], ["Be brief.", "again"],
    ]


def test_chat_loading_line_names_the_request() -> None:
    args = EngineArgs(model=None, dtype="bfloat16", quantization="int8", num_threads=3)
    assert cli.loading_line(args) == (
        "triollm: loading the bundled SmolLM2-135M-Instruct (dtype bfloat16, quantization int8, threads 3)..."
    )
