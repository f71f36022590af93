"""The playground's images in a real browser: `triollm serve` on a tiny LLaVA and one headless
Chromium (browser.py). An image attached by the file picker (larger than the page's bound: sent
downscaled), one pasted, one dropped and an SVG (sent as a PNG) show as thumbnails, one is
removed, the message is sent with the other three as `image_url` parts and answers as the same
request sent by hand does, the images show in the conversation, and the next turn sends them
again. Served a text-only model, the attach button is disabled, saying why. Skipped, saying so,
without Chromium and chromedriver.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import Browser, browser_or_skip, headless_browser
from server import Server, run_server
from vision_models import make_llava, random_image

MODEL = "llava"
# Captures each request body the page sends (the page calls the global `fetch`).
CAPTURE = (
    "window.sent = []; const plain = window.fetch;"
    "window.fetch = (url, init) => { if (init && init.body) window.sent.push(JSON.parse(init.body));"
    " return plain(url, init); };"
)
# Puts an 8 x 8 PNG made in the page into a DataTransfer and dispatches `arguments[0]` (paste
# or drop) with it on the element `arguments[1]`.
DISPATCH = (
    "const [kind, id, done] = arguments; const c = document.createElement('canvas'); c.width = c.height = 8;"
    "c.getContext('2d').fillRect(0, 0, 4, 4);"
    "c.toBlob((blob) => { const dt = new DataTransfer(); dt.items.add(new File([blob], 'x.png', {type: 'image/png'}));"
    " const init = {bubbles: true, cancelable: true};"
    " const event = kind === 'paste' ? new ClipboardEvent('paste', {...init, clipboardData: dt})"
    "   : new DragEvent('drop', {...init, dataTransfer: dt});"
    " document.getElementById(id).dispatchEvent(event); done(event.defaultPrevented); }, 'image/png');"
)
THUMBS = "document.querySelectorAll('#attachments .thumb').length"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    browser_or_skip()
    with headless_browser() as b:
        yield b


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    browser_or_skip()
    llava = make_llava(tmp_path_factory.mktemp("llava-browser"), seed=3)
    with run_server(llava, "--served-model-name", MODEL, timeout=240) as srv:
        yield srv


def decoded_size(url: str) -> tuple[int, int]:
    from PIL import Image

    head, payload = url.split(",", 1)
    assert head == "data:image/png;base64", head
    with Image.open(io.BytesIO(base64.b64decode(payload))) as image:
        return image.size  # type: ignore[no-any-return]


def add_file(b: Browser, path: Path) -> None:
    """Picks `path` in the (hidden) file input, as the picker the button opens would."""
    b._call("POST", f"/element/{b.find('#image-file')}/value", {"text": str(path)})


def test_attach_send_and_keep_images(browser: Browser, llava_server: Server, tmp_path: Path) -> None:
    browser.logs()  # what an earlier test left
    browser.get(f"{llava_server.url}/")
    assert browser.wait_for("document.getElementById('model').value") == MODEL
    assert browser.run("return document.getElementById('attach').disabled;") is False
    browser.type("#temperature", "0")
    browser.type("#max-tokens", "8")
    browser.run(CAPTURE)

    big = tmp_path / "big.png"
    random_image(7, (1000, 2000)).save(big)  # 2000 wide, 1000 high
    add_file(browser, big)
    browser.wait_for(f"{THUMBS} === 1")
    assert browser.run_async(DISPATCH, "paste", "prompt") is True
    browser.wait_for(f"{THUMBS} === 2")
    assert browser.run_async(DISPATCH, "drop", "messages") is True
    browser.wait_for(f"{THUMBS} === 3")
    svg = tmp_path / "shape.svg"  # a type Pillow does not read: sent drawn as a PNG
    svg.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10" height="20"><rect width="5" height="5"/></svg>')
    add_file(browser, svg)
    browser.wait_for(f"{THUMBS} === 4")
    browser.click("#attachments .thumb:nth-child(2) button")  # the pasted one goes
    assert browser.run(f"return {THUMBS};") == 3

    browser.type("#prompt", "What is this?")
    browser.click("#send")
    browser.wait_for("document.querySelector('.msg.assistant[data-state=done]')")
    assert browser.run("return document.querySelectorAll('.msg.user img').length;") == 3
    assert browser.run("return document.getElementById('attachments').hidden;") is True
    [first] = browser.run("return window.sent;")
    content: list[dict[str, Any]] = first["messages"][-1]["content"]
    assert [p["type"] for p in content] == ["image_url"] * 3 + ["text"] and content[3]["text"] == "What is this?"
    assert decoded_size(content[0]["image_url"]["url"]) == (1536, 768)  # downscaled, the type kept
    assert decoded_size(content[1]["image_url"]["url"]) == (8, 8)
    assert decoded_size(content[2]["image_url"]["url"]) == (10, 20)
    answer = browser.text(".msg.assistant .text")
    plain = {**first, "stream": False}
    del plain["stream_options"]
    r = httpx.post(f"{llava_server.url}/v1/chat/completions", json=plain, timeout=60)
    assert r.status_code == 200 and answer == r.json()["choices"][0]["message"]["content"]

    browser.type("#prompt", "And now?")
    browser.click("#send")
    browser.wait_for("document.querySelectorAll('.msg.assistant[data-state=done]').length === 2")
    second = browser.run("return window.sent;")[1]
    assert second["messages"][0] == first["messages"][-1]  # the images sent again
    assert second["messages"][-1] == {"role": "user", "content": "And now?"}
    assert browser.logs() == []


def test_a_text_model_has_no_attach(browser: Browser, tiny_model_dir: Path) -> None:
    browser_or_skip()
    with run_server(tiny_model_dir, timeout=240) as srv:
        browser.get(f"{srv.url}/")
        browser.wait_for("document.getElementById('model').value")
        attach = browser.run("const a = document.getElementById('attach'); return [a.disabled, a.title];")
        assert attach == [True, "The served model takes no images: it is a text-only model"]
        assert browser.run_async(DISPATCH, "paste", "prompt") is False  # a paste adds nothing
        assert browser.run(f"return {THUMBS};") == 0
