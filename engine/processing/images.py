"""Images from requests, decoded with Pillow under limits.

`decode_image(data, field)` reads an encoded image (PNG, JPEG, ...) and returns it as RGB.
Pillow's `Image.open` reads only the header: the pixel count is checked against
`MAX_IMAGE_PIXELS` before a single row is decoded, so a 10,000 x 10,000 PNG of a few kilobytes
costs microseconds, not 300 MB. A truncated or corrupt file fails in `load()`; both become a
`ValueError` naming the request field (`messages[0].content[1].image_url`), which the API turns
into a 400. `image_url` resolves the URLs a chat part may carry: `data:` URLs always, `file://`
only under `allowed_local_media_path`; http(s) URLs within `VLLM_IMAGE_FETCH_TIMEOUT` seconds
and `MAX_FETCH_BYTES`. The API server fetches them itself, asynchronously (api/chat_images.py),
and hands their bytes on as data URLs; here they are fetched with a blocking client, in the
caller's thread (`LLM.chat`, the user's).

Decoding is CPU work (milliseconds for a real photo): the API calls it in a worker thread, off
the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from triollm.engine import envs

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["MAX_FETCH_BYTES", "MAX_IMAGE_PIXELS", "decode_image", "fetch_url", "image_url", "load_image_url"]

# The most pixels one image may have (about 16.8 M: 4096 x 4096); the processors resize every
# image down to a few hundred pixels a side, so more only costs memory.
MAX_IMAGE_PIXELS = 4096 * 4096
# The most bytes one image file or fetched URL may have.
MAX_FETCH_BYTES = 64 << 20


def decode_image(data: bytes, field: str) -> Image.Image:
    """The RGB image encoded in `data`; a ValueError naming `field` if it is not one, too large,
    or truncated."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns above 89 M pixels: ours (below) is the limit.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise ValueError(f"{field}: not a readable image ({e})") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{field}: {width} x {height} pixels exceed the limit of {MAX_IMAGE_PIXELS} pixels per image")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ValueError(f"{field}: the image could not be decoded ({e})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def image_url(url: str, field: str, allowed_local_media_path: str | None = None) -> bytes:
    """The encoded image an `image_url` names: a data URL's payload, or a file under
    `allowed_local_media_path`."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError(f"{field}: a data URL must be 'data:image/...;base64,<data>'")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{field}: the data URL's payload is not valid base64") from None
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _local_file(Path(unquote(parsed.path)), field, allowed_local_media_path)
    if parsed.scheme in ("http", "https"):
        return fetch_url(url, field)
    raise ValueError(f"{field}: unsupported URL scheme {parsed.scheme!r}; allowed: data, file, http, https")


def fetch_url(url: str, field: str) -> bytes:
    """The body of GET `url` (blocking); a ValueError naming `field` on a failed connection, a
    status other than 200, more than `MAX_FETCH_BYTES`, or more than $VLLM_IMAGE_FETCH_TIMEOUT
    seconds (checked per read: a server that trickles may take up to one read timeout more)."""
    import httpx

    timeout = envs.image_fetch_timeout()
    deadline = time.monotonic() + timeout
    short = url if len(url) <= 100 else url[:97] + "..."
    late = f"{field}: fetching {short} took longer than {timeout:g} s ({envs.IMAGE_FETCH_TIMEOUT_ENV})"
    try:
        with (
            httpx.Client(follow_redirects=True, max_redirects=3, timeout=timeout) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ValueError(f"{field}: fetching {short} gave HTTP {response.status_code}")
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > MAX_FETCH_BYTES:
                raise ValueError(f"{field}: {short} is {length} bytes, over the limit of {MAX_FETCH_BYTES}")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_FETCH_BYTES:
                    raise ValueError(f"{field}: {short} sent more than the limit of {MAX_FETCH_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise ValueError(late)
            return bytes(body)
    except httpx.TimeoutException:
        raise ValueError(late) from None
    except httpx.HTTPError as e:
        raise ValueError(f"{field}: could not fetch {short} ({type(e).__name__}: {e})") from None


def load_image_url(url: str, field: str, allowed_local_media_path: str | None = None) -> Image.Image:
    return decode_image(image_url(url, field, allowed_local_media_path), field)


def _local_file(path: Path, field: str, allowed: str | None) -> bytes:
    if allowed is None:
        raise ValueError(f"{field}: file:// URLs need the server started with --allowed-local-media-path")
    root = Path(allowed).resolve()
    target = path.resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"{field}: {path} lies outside --allowed-local-media-path ({root})")
    if not target.is_file():
        raise ValueError(f"{field}: {path} is not a file")
    if target.stat().st_size > MAX_FETCH_BYTES:
        raise ValueError(f"{field}: {path} is larger than 64 MiB")
    return target.read_bytes()
