"""Bad input is a 4xx in the error envelope naming what is wrong; an unexpected failure is an
envelope 500 that leaves the connection open."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import struct
import time
import zipfile

import httpx
import pytest

from megaslide.server import Settings, build_app
from megaslide.server.torch_backend import TorchBackend
from megaslide.server.worker import Fleet

from api_helpers import (
    SMALL,
    assert_error,
    create,
    dataset_zip,
    processed,
    refused,
    upload,
    wait_status,
)
from server_fakes import FakeBackend, live_server

JSON = {"content-type": "application/json"}


def test_bad_json_bodies_are_400s_that_name_the_field(make_client):
    c = make_client()
    video = {"prompt": "a red ball", **SMALL}
    for seconds in (1e308, "Infinity", "inf", "1e308", 10**400):
        body = {"prompt": "a red ball", "seconds": seconds}
        assert_error(c.post("/v1/videos", json=body), 400, "seconds")
    # Python's json would read the bare word Infinity; it is a number too large for any clip.
    raw = b'{"prompt": "a red ball", "seconds": Infinity}'
    assert_error(c.post("/v1/videos", content=raw, headers=JSON), 400, "seconds")

    latin1 = json.dumps(video).replace("a red ball", "caf\xe9").encode("latin-1")
    assert_error(c.post("/v1/videos", content=latin1, headers=JSON), 400, None, "not UTF-8")
    # "\ud800" is half a UTF-16 surrogate pair: valid JSON, but text with no UTF-8 form.
    surrogate = json.dumps(video).replace("a red ball", "a \\ud800 ball").encode()
    assert_error(c.post("/v1/videos", content=surrogate, headers=JSON), 400, "prompt", "surrogate")
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(c.post("/v1/videos", content=deep, headers=JSON), 400, None, "too deeply")
    nested = {**video, "input_reference": json.loads("[" * 40 + "]" * 40)}
    assert_error(c.post("/v1/videos", json=nested), 400, "input_reference", "nested")

    raw = b'{"model": "fake", "training_file": "file-\\ud800"}'
    assert_error(c.post("/v1/fine_tuning/jobs", content=raw, headers=JSON), 400, "training_file")
    raw = b'{"model": "fake", "training_file": "file-x", "metadata": {"k": "\\udfff"}}'
    assert_error(c.post("/v1/fine_tuning/jobs", content=raw, headers=JSON), 400, "metadata")
    deep = b'{"model": "fake", "training_file": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(c.post("/v1/fine_tuning/jobs", content=deep, headers=JSON), 400)


def test_nul_characters_are_400s_on_every_store(make_client, database_url):
    """PostgreSQL's text cannot hold U+0000: every id, cursor, filter, field and file name that
    would reach the store is refused first, on both stores alike."""
    c = make_client(database=database_url)
    video = create(c)
    nul = "x%00y"
    for method, url, param in [
        ("GET", f"/v1/videos/{nul}", "path"),
        ("DELETE", f"/v1/videos/{nul}", "path"),
        ("POST", f"/v1/videos/{nul}/cancel", "path"),
        ("GET", f"/v1/videos/{nul}/content", "path"),
        ("GET", f"/v1/videos/{nul}/events", "path"),
        ("GET", f"/v1/videos?after={nul}", "after"),
        ("GET", f"/v1/videos/{video['id']}/content?variant={nul}", "variant"),
        ("GET", f"/v1/files/{nul}", "path"),
        ("DELETE", f"/v1/files/{nul}", "path"),
        ("GET", f"/v1/files?purpose={nul}", "purpose"),
        ("GET", f"/v1/files?after={nul}", "after"),
        ("GET", f"/v1/fine_tuning/jobs?after={nul}", "after"),
        ("GET", f"/v1/fine_tuning/jobs/{nul}", "path"),
        ("POST", f"/v1/fine_tuning/jobs/{nul}/cancel", "path"),
        ("GET", f"/v1/fine_tuning/jobs/{nul}/events", "path"),
        ("GET", f"/v1/fine_tuning/jobs/{nul}/checkpoints", "path"),
        ("GET", f"/v1/models/{nul}", "path"),
    ]:
        assert_error(c.request(method, url), 400, param, "NUL"), (method, url)
    bad_job = {"model": "tiny", "training_file": "file-\x00"}
    assert_error(c.post("/v1/fine_tuning/jobs", json=bad_job), 400, "training_file", "NUL")
    assert_error(c.post("/v1/videos", json={"prompt": "a\x00b"}), 400, "prompt", "NUL")
    # httpx would percent-encode the name; a client that sends the byte raw:
    head = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n--B\r\n'
    part = b'Content-Disposition: form-data; name="file"; filename="a\x00.zip"\r\n\r\n'
    raw = head + part + dataset_zip() + b"\r\n--B--\r\n"
    form = {"content-type": "multipart/form-data; boundary=B"}
    assert_error(c.post("/v1/files", content=raw, headers=form), 400, "file", "NUL")
    assert_error(upload(c, dataset_zip(), purpose="fine\x00tune"), 400, "purpose", "NUL")
    assert c.get(f"/v1/videos/{video['id']}").status_code == 200  # the store is still fine


def test_a_client_that_drops_mid_upload_costs_one_info_line(make_client, caplog):
    """A dropped upload is the client's doing: one info line, no traceback, nothing stored."""
    c = make_client()
    head = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n--B\r\n'
    part = b'Content-Disposition: form-data; name="file"; filename="d.zip"\r\n\r\n'
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"multipart/form-data; boundary=B"),
            (b"content-length", b"100000"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    messages = [
        {"type": "http.request", "body": head + part + b"x" * 1000, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    caplog.clear()
    with caplog.at_level("INFO"):
        c.portal.call(c.app, scope, receive, send)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    [line] = [r.getMessage() for r in caplog.records if "disconnect" in r.getMessage()]
    assert line == "client disconnected during POST /v1/files"
    assert not any(m["type"] == "http.response.start" for m in sent)  # nobody to answer
    assert c.get("/v1/files").json()["data"] == []


def test_slow_and_surplus_clients_are_cut_off(tmp_path):
    """A client that trickles its headers or its body is answered 408 and dropped; connections
    past the cap are answered 503 at once; everyone else is served throughout."""
    options = dict(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=4)
    settings = Settings(data_dir=tmp_path / "data", **options)
    app = build_app(settings, Fleet.embedded(settings, FakeBackend()))
    with live_server(app, settings) as url:
        port = int(url.rsplit(":", 1)[1])

        def connect() -> socket.socket:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return s

        def answer(s: socket.socket) -> bytes:
            """Everything the server sends until it closes the connection."""
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            return got

        idle = [connect() for _ in range(4)]  # at the cap, sending nothing
        time.sleep(0.2)
        surplus = connect()
        assert answer(surplus).startswith(b"HTTP/1.1 503"), "past the cap: refused at once"
        start = time.monotonic()
        assert all(answer(s).startswith(b"HTTP/1.1 408") for s in idle)
        assert time.monotonic() - start < 5  # dropped at the header deadline, not left open
        slowloris = connect()
        slowloris.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: ")
        assert answer(slowloris).startswith(b"HTTP/1.1 408")
        trickle = connect()
        trickle.sendall(
            b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        trickle.settimeout(0.25)
        body_timeout, sent = b"", 1
        while not body_timeout and sent < 40:  # a byte each 0.25 s: each wait short, all late
            try:
                body_timeout = trickle.recv(4096)
            except TimeoutError:
                trickle.sendall(b" ")
                sent += 1
        assert body_timeout, "cut at the body's deadline while it still trickled"
        trickle.settimeout(10)
        body_timeout += answer(trickle)
        assert body_timeout.startswith(b"HTTP/1.1 408") and b"request_timeout" in body_timeout
        assert httpx.get(f"{url}/healthz").status_code == 200
        for s in (*idle, surplus, slowloris, trickle):
            s.close()


def _connect(port: int, address: str = "127.0.0.1") -> socket.socket:
    """A loopback connection from `address` (any of 127.0.0.0/8 is this host)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(address, 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return s


def _exchange(s: socket.socket, request: bytes) -> bytes:
    """Send `request` and read one answer's head (and a body with a length), leaving the
    connection open."""
    s.sendall(request)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        if not chunk:
            return got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    fields = head.lower().split(b"\r\n")[1:]
    length = [int(f.split(b":", 1)[1]) for f in fields if f.startswith(b"content-length:")]
    while length and len(body) < length[0]:
        body += s.recv(4096)
    return head + b"\r\n\r\n" + body


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def test_one_address_cannot_take_every_connection(tmp_path):
    """One client address may hold `max_connections_per_client` connections, and
    `max_pending_per_client` of them still sending headers; past that its new ones are answered
    429 at once, and another address is still served. Before, one address could take the whole
    global cap (a header trickler that reconnects needs no key) and every new client got 503."""
    options = dict(max_connections=8, max_connections_per_client=5, max_pending_per_client=2)
    settings = Settings(data_dir=tmp_path / "data", header_timeout_s=30.0, **options)
    app = build_app(settings, Fleet.embedded(settings, FakeBackend()))
    with live_server(app, settings) as url:
        port = int(url.rsplit(":", 1)[1])
        held = [_connect(port) for _ in range(2)]
        for s in held:  # kept alive after a request: open, not sending headers
            assert _exchange(s, HEALTHZ).startswith(b"HTTP/1.1 200")
        held += [_connect(port) for _ in range(2)]  # still sending headers
        surplus = [_connect(port)]
        refusal = _exchange(surplus[-1], HEALTHZ)
        assert refusal.startswith(b"HTTP/1.1 429") and b"still sending headers" in refusal
        assert _exchange(held[2], HEALTHZ).startswith(b"HTTP/1.1 200")  # one place frees
        held.append(_connect(port))
        assert _exchange(held[-1], HEALTHZ).startswith(b"HTTP/1.1 200")  # the fifth
        surplus.append(_connect(port))
        refusal = _exchange(surplus[-1], HEALTHZ)
        assert refusal.startswith(b"HTTP/1.1 429") and b"open connections" in refusal
        assert b"retry-after: 1" in refusal.lower()
        for address in ("127.0.0.2", "127.0.0.3"):  # other clients: served, up to the cap
            held.append(_connect(port, address))
            assert _exchange(held[-1], HEALTHZ).startswith(b"HTTP/1.1 200")
        for s in (*held, *surplus):
            s.close()


def test_streams_of_many_keys_leave_room_for_new_clients(tmp_path):
    """Event streams are capped at half the connections in all, not only per key: three keys
    each within their own limit could hold every connection, and a new client got 503."""
    keys = ["k-a", "k-b", "k-c"]
    settings = Settings(
        data_dir=tmp_path / "data", api_keys=keys, max_connections=6, max_streams_per_key=2
    )
    backend = FakeBackend()
    backend.gate.clear()  # the videos stay unfinished, so their streams stay open
    app = build_app(settings, Fleet.embedded(settings, backend))
    with live_server(app, settings) as url:
        port = int(url.rsplit(":", 1)[1])
        answers, sockets = [], []
        for key in keys:
            auth = {"Authorization": f"Bearer {key}"}
            r = httpx.post(f"{url}/v1/videos", json={"prompt": "a", **SMALL}, headers=auth)
            video = r.json()["id"]
            for _ in range(2):  # this key's own limit
                sockets.append(_connect(port))
                request = (
                    f"GET /v1/videos/{video}/events HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {key}\r\n\r\n"
                ).encode()
                answers.append(_exchange(sockets[-1], request))
        streaming = [a for a in answers if a.startswith(b"HTTP/1.1 200")]
        refusals = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
        assert len(streaming) == settings.max_streams == 3
        assert len(refusals) == 3
        assert all(b"this server holds 3 event streams" in a for a in refusals)
        for answer, s in zip(answers, sockets):
            if answer in refusals:
                s.close()
        r = httpx.get(f"{url}/v1/videos", headers={"Authorization": f"Bearer {keys[2]}"})
        assert r.status_code == 200, "a new client is served while the streams stay open"
        backend.gate.set()
        for s in sockets:
            s.close()


def test_a_body_must_arrive_whole_within_its_deadline():
    """A body's deadline is the whole body's: a byte every 0.1 s once reset a per-part timer for
    ever. A body at or above `min_body_rate` earns time with each byte and arrives whole."""
    from megaslide.server.body_limit import BodyLimit

    async def read_all(scope, receive, send):
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    limit = BodyLimit(
        read_all, max_body_bytes=10**6, uploads=[], body_timeout_s=0.3, min_body_rate=1000
    )
    scope = {"type": "http", "method": "POST", "path": "/v1/videos", "headers": []}

    def run(chunk: bytes, gap_s: float, chunks: int) -> tuple[list, int]:
        sent, taken = [], 0

        async def receive():
            nonlocal taken
            await asyncio.sleep(gap_s)
            taken += 1
            return {"type": "http.request", "body": chunk, "more_body": taken < chunks}

        async def send(message):
            sent.append(message)

        asyncio.run(limit(scope, receive, send))
        return sent, taken

    sent, taken = run(b"x", 0.1, 100)  # one byte every 0.1 s: each wait is short, the whole long
    assert sent[0]["status"] == 408 and taken < 100
    assert b"did not arrive in time" in sent[1]["body"]
    # 2,000 bytes every 0.1 s for 0.5 s, longer than body_timeout_s: each chunk earns 2 s more.
    sent, taken = run(b"x" * 2000, 0.1, 5)
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"10000" and taken == 5


def test_event_numbers_out_of_range_are_400s(make_client):
    c = make_client()
    v = create(c)
    wait_status(c, v["id"])
    # b"\xb2" is "²" in Latin-1, the headers' encoding: a digit to str.isdigit(), not to us.
    for last in ("9" * 30, str(2**63), "-1", "+1", "1_0", b"\xb2"):
        r = c.get(f"/v1/videos/{v['id']}/events", headers={"Last-Event-ID": last})
        assert_error(r, 400, "Last-Event-ID")
    r = c.get(f"/v1/videos/{v['id']}/events", headers={"Last-Event-ID": str(2**63 - 1)})
    assert r.status_code == 200 and r.text == ""  # nothing comes after the largest number

    f = processed(c, upload(c, dataset_zip()).json())
    job = c.post("/v1/fine_tuning/jobs", json={"model": "fake", "training_file": f["id"]}).json()
    events = f"/v1/fine_tuning/jobs/{job['id']}/events"
    for after in ("ftevent-" + "9" * 30, f"ftevent-{2**63}", "ftevent-\u0663", "ftevent-", "7"):
        assert_error(c.get(events, params={"after": after}), 400, "after")
    assert c.get(events, params={"after": f"ftevent-{2**63 - 1}"}).status_code == 200


def test_ranges_that_cannot_be_served_are_refused_in_the_envelope(make_client):
    c = make_client()
    v = create(c)
    wait_status(c, v["id"])
    url = f"/v1/videos/{v['id']}/content"
    full = c.get(url).content
    # Another unit is ignored (RFC 9110 section 14.2): the whole file.
    r = c.get(url, headers={"Range": "items=0-5"})
    assert r.status_code == 200 and r.content == full
    for header in ("bytes=abc", "bytes=5-3", "bytes=0-" + "9" * 5000):
        assert_error(c.get(url, headers={"Range": header}), 400, "range")
    r = c.get(url, headers={"Range": "bytes=" + "9" * 20 + "-"})
    assert_error(r, 416, "range")
    assert r.json()["error"]["code"] == "range_not_satisfiable"


def zip_member(name: str, data: bytes, *, method=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as zf:
        zf.writestr("data/metadata.jsonl", '{"file": "a.mp4", "text": "a"}\n')
        zf.writestr(name, data)
    return buf.getvalue()


def patch_last_member(archive: bytes, *, flags: int | None = None, method: int | None = None):
    """The archive with its last member's general-purpose flags or compression method changed in
    both its local and its central header (zipfile writes neither encrypted nor unknown ones)."""
    out = bytearray(archive)
    info = zipfile.ZipFile(io.BytesIO(archive)).infolist()[-1]
    local = info.header_offset
    central = archive.rindex(b"PK\x01\x02")
    for value, local_at, central_at in ((flags, 6, 8), (method, 8, 10)):
        if value is not None:
            struct.pack_into("<H", out, local + local_at, value)
            struct.pack_into("<H", out, central + central_at, value)
    return bytes(out)


def test_archive_members_that_cannot_be_unpacked_are_refused_by_name(make_client):
    c = make_client()
    clash = io.BytesIO()
    with zipfile.ZipFile(clash, "w") as zf:
        zf.writestr("data/clips", b"a file where a folder goes")
        zf.writestr("data/clips/0.mp4", b"")
    long_name = "data/" + "a" * 300 + ".mp4"
    deep = "data/" + "d/" * 40 + "a.mp4"
    deflated = zip_member("data/a.mp4", b"frames " * 1000, method=zipfile.ZIP_DEFLATED)
    info = zipfile.ZipFile(io.BytesIO(deflated)).infolist()[-1]
    start = deflated.index(b"data/a.mp4", info.header_offset) + len("data/a.mp4")
    corrupt = bytearray(deflated)
    corrupt[start : start + info.compress_size] = b"\xff" * info.compress_size
    cases = [
        (clash.getvalue(), "'data/clips/0.mp4': a file and a folder share one path"),
        (zip_member(long_name, b""), "name is longer than 255 bytes"),
        (zip_member(deep, b""), "nested 42 levels deep"),
        (patch_last_member(zip_member("data/a.mp4", b"x"), flags=1), "'data/a.mp4' is encrypted"),
        (patch_last_member(zip_member("data/a.mp4", b"x"), method=97), "cannot be read here"),
        (bytes(corrupt), "'data/a.mp4': its data is damaged"),
    ]
    for archive, fragment in cases:
        assert fragment in refused(c, archive)
    files = c.app.state.settings.data_dir / "files"
    assert not list(files.iterdir())  # every refused upload was cleaned away


def test_dataset_problems_name_files_as_the_dataset_does(tmp_path):
    root = tmp_path / "unpacked" / "data"
    root.mkdir(parents=True)
    (root / "clip.mp4").write_bytes(b"not a video")
    nested = '{"file": "clip.mp4", "text": "x", "extra": ' + "[" * 5000 + "]" * 5000 + "}"
    (root / "metadata.jsonl").write_text(
        json.dumps({"file": "clip.mp4", "text": "a clip"}) + "\n" + nested + "\n"
    )
    backend = TorchBackend(Settings(preset="tiny", data_dir=tmp_path / "server"))
    with pytest.raises(ValueError) as info:
        backend.check_dataset(root)
    message = str(info.value)
    assert "line 1 (clip.mp4): cannot decode video" in message
    assert "line 2: JSON nested too deeply" in message
    assert str(tmp_path) not in message


def test_an_unexpected_error_is_an_envelope_500_and_the_connection_stays(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    app = build_app(settings, Fleet.embedded(settings, FakeBackend()))

    @app.get("/v1/broken")
    async def broken():
        raise RuntimeError("a bug")

    with live_server(app) as url, httpx.Client(base_url=url) as client:
        first = client.get("/v1/broken")
        assert_error(first, 500)
        assert first.json()["error"]["code"] == "internal_error"
        second = client.get("/v1/models")
        assert second.status_code == 200

        def port(response):
            return response.extensions["network_stream"].get_extra_info("client_addr")[1]

        assert port(first) == port(second), "the 500 cost the client its connection"
