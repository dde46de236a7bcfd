"""Limits that hold whatever the client sends: bodies counted as they arrive, images bounded before
they are decoded."""

from __future__ import annotations

import io
import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megaslide.engine.request import RequestError
from megaslide.server import Settings, build_app
from megaslide.server.routers.videos import save_image
from megaslide.server.worker import Fleet

from api_helpers import assert_error, png_of_zeros
from server_fakes import FakeBackend, live_server

CHUNK = 64 * 1024


def answer_to_chunked_body(url: str, path: str, content_type: str, start: bytes, limit: int):
    """Send a chunked body to `path` without Content-Length: `start`, then filler up to twice
    `limit` bytes, never ended. Return what the server answers meanwhile (b"" if it waits)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode() + f"{len(start):x}\r\n".encode() + start + b"\r\n")
        sent = len(start)
        while sent < 2 * limit:
            try:
                sock.sendall(f"{CHUNK:x}\r\n".encode() + b"x" * CHUNK + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: what it said is still in the buffer
            sent += CHUNK
        sock.settimeout(2)
        return read_answer(sock)


def read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer off `sock`: its head and a body of its Content-Length, which may come in
    separate packets; what came before a silence or a close otherwise."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
            head, sep, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            if sep and length and len(body) >= int(length.group(1)):
                break
    except (TimeoutError, ConnectionResetError):
        pass
    return answer


def test_bodies_are_cut_off_at_the_limit_not_read_to_the_end(tmp_path):
    """A chunked body announces no length: the server must count it, and answer 413 while the
    client is still sending, on upload and JSON routes alike."""
    settings = Settings(data_dir=tmp_path / "data", max_upload_bytes=200_000, max_body_bytes=50_000)
    app = build_app(settings, Fleet.embedded(settings, FakeBackend()))
    with live_server(app) as url:
        multipart = "multipart/form-data; boundary=b"
        part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.zip"\r\n\r\n'
        for path, content_type, start, limit in (
            ("/v1/files", multipart, part, 200_000),
            ("/v1/videos", "application/json", b'{"prompt": "', 50_000),
            ("/v1/fine_tuning/jobs", "application/json", b'{"model": "', 50_000),
        ):
            answer = answer_to_chunked_body(url, path, content_type, start, limit)
            assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "file_too_large" and str(limit) in error["message"]
    assert not list((settings.data_dir / "files").iterdir())  # nothing spooled into the store


def test_a_declared_length_over_the_limit_is_refused_unread(make_client):
    c = make_client(max_upload_bytes=200_000, max_body_bytes=1000)
    big_json = {"prompt": "x" * 2000}
    assert_error(c.post("/v1/videos", json=big_json), 413, None, "limit of 1000 bytes")
    body = {"model": "fake", "training_file": "file-" + "x" * 2000}
    assert_error(c.post("/v1/fine_tuning/jobs", json=body), 413)
    # Only a multipart body to an upload route gets that route's larger limit.
    files = {"file": ("d.zip", b"x" * 300_000)}
    assert_error(c.post("/v1/files", data={"purpose": "fine-tune"}, files=files), 413, "file")
    assert_error(c.post("/v1/files", content=b"x" * 2000, headers={"content-type": "a/b"}), 413)
    assert c.get("/v1/models").status_code == 200  # the limit leaves bodiless requests alone


def test_first_frame_images_are_bounded_and_opened_with_few_decoders(tmp_path):
    bomb = png_of_zeros(8192, 8192)  # 67 Mpixels, 200 MB as RGB
    assert len(bomb) < 16_000
    with pytest.raises(RequestError, match="8192x8192 pixels; at most 1000000"):
        save_image(io.BytesIO(bomb), tmp_path / "bomb.png", max_pixels=1_000_000)
    assert not (tmp_path / "bomb.png").exists()

    frame = Image.fromarray(np.zeros((8, 8, 3), np.uint8))
    tiff = io.BytesIO()
    frame.save(tiff, format="TIFF")
    with pytest.raises(RequestError, match="not a PNG, JPEG or WEBP file"):
        save_image(io.BytesIO(tiff.getvalue()), tmp_path / "t.png", max_pixels=1_000_000)
    png = io.BytesIO()
    frame.save(png, format="PNG")
    # A chunk length pointing past the data: PIL reports it as a SyntaxError.
    broken = png.getvalue()[:33] + b"\x00\x00\x00\x0dtEXt" + b"\x19" * 40
    with pytest.raises(RequestError, match="input_reference is not a readable"):
        save_image(io.BytesIO(broken), tmp_path / "b.png", max_pixels=1_000_000)
    save_image(io.BytesIO(png.getvalue()), tmp_path / "ok.png", max_pixels=1_000_000)
    assert Path(tmp_path / "ok.png").read_bytes().startswith(b"\x89PNG")


def test_input_videos_are_bounded_and_opened_with_a_forced_demuxer(tmp_path):
    """An input video: its bytes bounded as they are copied (413), its frame size and count as
    they are decoded, its container by its first bytes; nothing stays behind a refusal."""
    from megaslide.engine.video import write_mp4
    from megaslide.server.errors import PayloadTooLarge
    from megaslide.server.services.videos import save_video

    mp4 = write_mp4(tmp_path / "in.mp4", np.zeros((6, 64, 48, 3), np.uint8), fps=8).read_bytes()
    limits = dict(max_bytes=len(mp4), max_pixels=64 * 48, max_frames=6)
    assert save_video(io.BytesIO(mp4), tmp_path / "ok", **limits) == 6
    refusals = [
        (mp4, dict(max_bytes=len(mp4) - 1), PayloadTooLarge, "videos up to"),
        (mp4, dict(max_pixels=64 * 48 - 1), RequestError, "frames of 48x64 pixels"),
        (mp4, dict(max_frames=5), RequestError, "more than 5 frames"),
        (b"#EXTM3U\n#EXTINF:1,\nin.mp4\n", {}, RequestError, "not a MP4"),
        (mp4[:4] + b"ftyp" + b"\x00" * 64, {}, RequestError, "not a readable video"),
    ]
    for data, changes, error, message in refusals:
        with pytest.raises(error, match=message) as refused:
            save_video(io.BytesIO(data), tmp_path / "bad", **{**limits, **changes})
        assert refused.value.param == "input_video"
        assert not (tmp_path / "bad").exists()
