"""Images decoded under limits (engine/processing/images.py): the pixel limit is checked from the
header, before any row is decoded; truncated and non-image data, bad data URLs and file URLs
outside the allowed folder are ValueErrors naming the field."""

from __future__ import annotations

import base64
import io
import re
import struct
import time
import zlib
from pathlib import Path

import pytest

from triollm.engine.processing.images import MAX_IMAGE_PIXELS, decode_image, image_url, load_image_url

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

FIELD = "messages[0].content[1].image_url"
AT = re.escape(FIELD)


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header says width x height (the pixel data is an 8 x 8 image's)."""
    data = bytearray(encoded(Image.new("RGB", (8, 8), (10, 20, 30)), "PNG"))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:33] = ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def test_decodes_to_rgb() -> None:
    image = decode_image(encoded(Image.new("L", (5, 7), 128), "PNG"), FIELD)
    assert image.mode == "RGB" and image.size == (5, 7)


def test_a_huge_png_is_refused_from_its_header() -> None:
    data = png_claiming(10_000, 10_000)
    assert len(data) < 1000
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^{AT}: 10000 x 10000 pixels exceed the limit of {MAX_IMAGE_PIXELS}"):
        decode_image(data, FIELD)
    assert time.monotonic() - start < 0.5


def test_truncated_and_foreign_data_are_refused() -> None:
    noise = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    jpeg = encoded(noise, "JPEG")  # cut in its scan data: the header reads, the pixels do not
    with pytest.raises(ValueError, match=rf"^{AT}: the image could not be decoded"):
        decode_image(jpeg[: len(jpeg) // 2], FIELD)
    with pytest.raises(ValueError, match=rf"^{AT}: not a readable image"):
        decode_image(b"GIF89a but not really", FIELD)


def test_urls(tmp_path: Path) -> None:
    png = encoded(Image.new("RGB", (3, 3)), "PNG")
    assert image_url("data:image/png;base64," + base64.b64encode(png).decode(), FIELD) == png
    with pytest.raises(ValueError, match="not valid base64"):
        image_url("data:image/png;base64,@@", FIELD)
    with pytest.raises(ValueError, match="must be 'data:image/...;base64,<data>'"):
        image_url("data:image/png,raw", FIELD)
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'; allowed: data, file, http, https"):
        image_url("ftp://example.com/a.png", FIELD)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    with pytest.raises(ValueError, match="need the server started with --allowed-local-media-path"):
        image_url(f"file://{tmp_path}/media/a.png", FIELD)
    allowed = str(tmp_path / "media")
    assert load_image_url(f"file://{tmp_path}/media/a.png", FIELD, allowed).size == (3, 3)
    with pytest.raises(ValueError, match="lies outside --allowed-local-media-path"):
        image_url(f"file://{tmp_path}/media/../secret.png", FIELD, allowed)
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        image_url("ftp://x/a.png", FIELD)
