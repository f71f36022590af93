"""The pages `triollm serve` shows a browser: the chat playground at `/` and the API reference
(Swagger UI over /openapi.json) at `/docs`.

Both are static files in api/static/, shipped in the package (pyproject's package-data): plain
HTML, CSS and JavaScript with no build step, and Swagger UI's two files vendored (their
README.md says from where), so nothing is fetched from elsewhere at run time and an offline
machine shows the same pages. The playground talks to the server's own API with `fetch`: GET
v1/models, then POST v1/chat/completions with `stream: true`, read as SSE from the response's
ReadableStream. Its stop button aborts that fetch; the server sees the disconnect and aborts the
request in the engine (sse.py).

Paths: every URL in the pages is relative, resolved against a `<base href>` set per request to
the ASGI root_path (`--root-path`) + "/", so behind a proxy that serves the app under /api the
page calls /api/v1/... whether or not the proxy strips the prefix, and /api (no slash) works too.

Keys: the pages' paths (`page_paths`) are open, as /health is (app.py adds them to the key's
open paths; with `--api-key-all-routes` nothing is open, the pages included): a browser cannot
send a key to load a page. The API behind them stays keyed: the playground's key field sends
`Authorization: Bearer` from a variable of the page (never stored), Swagger UI's "Authorize"
dialog likewise.

Images: the playground's chat view attaches images (a file picker, a paste, a drop), sent as
OpenAI `image_url` parts with data URLs, downscaled in the page (a canvas) past a bound on the
long side. Whether the served model takes images is written into the page per request (the
`<html data-accepts-images>` attribute, from the engine's model config): no route of its own,
so nothing more to key or to document; with "false" the attach button is disabled and says why.

Each file is read once (at the first `page_routes`, so missing package data fails at start-up)
and served from memory with an ETag (304 on If-None-Match) and `Cache-Control: no-cache`, so a
new version shows on the next load. The HTML pages carry a Content-Security-Policy that allows
the server itself and nothing else: model output is written into the page as text, never as
HTML, and the policy is the second line of defence.

Rejected: Starlette's `StaticFiles` (a folder served by prefix: the key's open paths would
become prefixes, and whatever file lands in the folder would be served); ReDoc (read-only, no
"try it out"); Swagger UI from a CDN (offline machines, and a third party inside the page).
"""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["STATIC_DIR", "page_paths", "page_routes", "page_urls"]

STATIC_DIR = Path(__file__).with_name("static")

_HTML = "text/html; charset=utf-8"
_JS = "text/javascript; charset=utf-8"
_CSS = "text/css; charset=utf-8"
# The playground: scripts, styles and requests from the server only.
_PLAYGROUND_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'self'; form-action 'none'; frame-ancestors 'none'"
)
# Swagger UI sets element styles from its scripts and draws icons from data: URLs.
_DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; font-src 'self' data:; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'"
)
_BASE = '<base href="/">'  # in each HTML file, replaced per request
_IMAGES = b'data-accepts-images="false"'  # in playground.html, "true" for a vision-language model


@dataclass(frozen=True)
class _Asset:
    route: str
    file: str  # under STATIC_DIR
    media_type: str
    csp: str | None = None  # HTML pages: the Content-Security-Policy, and a <base href>


_PLAYGROUND = (
    _Asset("/", "playground.html", _HTML, _PLAYGROUND_CSP),
    _Asset("/playground.js", "playground.js", _JS),
    _Asset("/playground.css", "playground.css", _CSS),
)
_DOCS = (
    _Asset("/docs", "docs.html", _HTML, _DOCS_CSP),
    _Asset("/docs.js", "docs.js", _JS),
    _Asset("/swagger-ui/swagger-ui-bundle.js", "swagger-ui/swagger-ui-bundle.js", _JS),
    _Asset("/swagger-ui/swagger-ui.css", "swagger-ui/swagger-ui.css", _CSS),
)


def _assets(playground: bool, docs: bool) -> tuple[_Asset, ...]:
    return (_PLAYGROUND if playground else ()) + (_DOCS if docs else ())


def page_paths(*, playground: bool, docs: bool) -> tuple[str, ...]:
    """The pages' paths (open without the API key unless every route is keyed)."""
    return tuple(asset.route for asset in _assets(playground, docs))


def page_routes(*, playground: bool, docs: bool) -> list[Route]:
    """GET routes for the playground (`/`, its script and style) and the docs (`/docs`, its
    script, Swagger UI's script and style). `docs` needs /openapi.json served beside it."""
    return [Route(a.route, _endpoint(a), methods=["GET"]) for a in _assets(playground, docs)]


def page_urls(
    host: str, port: int, root_path: str, *, playground: bool, docs: bool, scheme: str = "http"
) -> dict[str, str]:
    """What `triollm serve` prints once it listens: each page's address, with a wildcard host
    (0.0.0.0, ::) shown as the loopback address a browser on this machine opens."""
    shown = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    base = f"{scheme}://{f'[{shown}]' if ':' in shown else shown}:{port}{root_path}"
    urls = {"playground": f"{base}/"} if playground else {}
    if docs:
        urls["API docs"] = f"{base}/docs"
    return urls


def _accepts_images(request: Request) -> bool:
    """Whether the app's engine serves image inputs (a vision-language model whose images are
    supported here); False for a text-only or pooling model."""
    state = getattr(request.app.state, "server", None)
    config = getattr(getattr(state, "llm", None), "config", None)
    multimodal = getattr(getattr(config, "model", None), "multimodal", None)
    if multimodal is None:
        return False
    try:
        multimodal.check_image_request()
    except ValueError:
        return False
    return True


@cache
def _read(file: str) -> bytes:
    path = STATIC_DIR / file
    try:
        return path.read_bytes()
    except OSError as exc:
        raise RuntimeError(f"{path}: the package's static files are incomplete ({exc.strerror})") from exc


def _etag(body: bytes) -> str:
    return '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'


def _endpoint(asset: _Asset):  # type: ignore[no-untyped-def]
    static = _read(asset.file)
    static_etag = _etag(static)

    async def endpoint(request: Request) -> Response:
        body, etag = static, static_etag
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if asset.csp is not None:
            root = html.escape(request.scope.get("root_path", "").rstrip("/"), quote=True)
            body = static.replace(_BASE.encode(), f'<base href="{root}/">'.encode(), 1)
            if _accepts_images(request):
                body = body.replace(_IMAGES, b'data-accepts-images="true"', 1)
            etag = _etag(body)
            headers["Content-Security-Policy"] = asset.csp
            headers["Referrer-Policy"] = "no-referrer"
        headers["ETag"] = etag
        if etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(body, media_type=asset.media_type, headers=headers)

    endpoint.__name__ = f"page_{asset.file.replace('/', '_').replace('.', '_').replace('-', '_')}"
    return endpoint
