"""Hostile images against the real `triollm serve` on a tiny LLaVA (issue 45's hostile-client
check): a 10,000 x 10,000 PNG, a truncated JPEG, an image URL whose server never answers and fifty
images in one request each get a 400 naming the part in under a second, while a bystander's
stream on the same server keeps its cadence and /health stays fast (`hostile.watch`), and the
server stays up. The stalling server is a socket on 127.0.0.1 that accepts and never writes; the
fetch gives up after VLLM_IMAGE_FETCH_TIMEOUT (set short here, as an operator may)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from hostile import watch
from server import Server, run_server
from vision_models import data_url, huge_png_url, make_llava, random_image, truncated_jpeg_url

LIMIT = 4
FETCH_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    llava = make_llava(tmp_path_factory.mktemp("llava-hostile"), seed=3)
    args = ("--served-model-name", "llava", "--limit-mm-per-prompt", json.dumps({"image": LIMIT}))
    with run_server(llava, *args, timeout=240, env={"VLLM_IMAGE_FETCH_TIMEOUT": str(FETCH_TIMEOUT_S)}) as srv:
        yield srv
        assert srv.proc.poll() is None, "the server died"


@pytest.fixture(scope="module")
def stalling_url() -> Iterator[str]:
    """http://127.0.0.1:PORT/cat.png on a listener that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)  # read nothing, write nothing

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


def _body(*urls: str) -> bytes:
    images = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content = [{"type": "text", "text": "What is this?"}, *images]
    body = {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return json.dumps(body).encode()


def test_hostile_images_are_quick_400s_beside_a_stream(server: Server, stalling_url: str) -> None:
    tiny = data_url(random_image(3, (4, 4)))
    cases = [  # (body, the part named, words of the message); bodies built before the watch starts
        (_body(huge_png_url()), "messages[0].content[1].image_url", "exceed the limit of"),
        (_body(tiny, truncated_jpeg_url()), "messages[0].content[2].image_url", "could not be decoded"),
        (_body(stalling_url), "messages[0].content[1].image_url", "VLLM_IMAGE_FETCH_TIMEOUT"),
        (_body(*[tiny] * 50), "limit_mm_per_prompt", f"50 images exceed the limit of {LIMIT}"),
    ]
    headers = {"Content-Type": "application/json"}
    with watch(server.url, max_gap_s=1.0, max_health_s=1.0) as w, httpx.Client(base_url=server.url, timeout=30) as c:
        for body, param, words in cases:
            start = time.monotonic()
            r = c.post("/v1/chat/completions", content=body, headers=headers)
            took = time.monotonic() - start
            assert r.status_code == 400, r.text[:300]
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], error
            assert took < 1.0, f"{param}: answered in {took:.2f} s"
        # The server still serves images (the refusals came from a model that takes them): a good
        # one after the attack, its placeholder expanded to the image's 16 positions.
        r = c.post("/v1/chat/completions", content=_body(tiny), headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 16, r.text[:300]
    assert w.chunks > 0, w.report()

