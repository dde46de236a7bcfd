"""The Python SDK against scripted HTTP answers (httpx.MockTransport): retries, backoff,
idempotency keys, error types, pagination, SSE parsing, resumed downloads and event streams,
polling, and that the package imports without torch. Resuming, reconnecting and polling run
through both twins (`twin`), since each decision is shared and only the I/O differs. The tests
against the real server are in test_client_server.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest

import megaslide_client
from megaslide_client import _base_client, _constants
from megaslide_client._sse import iter_sse
from megaslide_client.types import Video

ROOT = Path(__file__).resolve().parents[1]

ERR = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "x"}}


def video_json(vid="video_1", status="queued", progress=0, **extra):
    return {
        "id": vid,
        "object": "video",
        "status": status,
        "progress": progress,
        "model": "tiny",
        **extra,
    }


@pytest.fixture
def sleeps(monkeypatch):
    """Record every wait of the client instead of sleeping through it."""
    waits: list[float] = []
    monkeypatch.setattr(_base_client, "_sleep", waits.append)

    async def fake_async_sleep(seconds):
        waits.append(seconds)

    monkeypatch.setattr(_base_client, "_async_sleep", fake_async_sleep)
    return waits


def scripted(answers):
    """A MockTransport answering requests with `answers` in turn; records the requests."""
    seen: list[httpx.Request] = []
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handler), seen


def client_for(transport, **kwargs):
    return megaslide_client.Client(base_url="http://test", transport=transport, **kwargs)


@pytest.fixture(params=["sync", "async"])
def twin(request):
    """`twin(transport, use, **client_kwargs)` runs `use(client)` on a Client or an AsyncClient.

    The async result is awaited, or drained into a list when it is an async iterator; the sync
    result is drained into a list when it is an iterator or a page. Both twins give one value.
    """

    def run(transport, use, **kwargs):
        if request.param == "sync":
            with client_for(transport, **kwargs) as client:
                result = use(client)
                if isinstance(result, Iterable) and not isinstance(result, bytes):
                    return list(result)
                return result

        async def main():
            async with megaslide_client.AsyncClient(
                base_url="http://test", transport=transport, **kwargs
            ) as client:
                result = use(client)
                if hasattr(result, "__aiter__"):
                    return [item async for item in result]
                return await result

        return asyncio.run(main())

    return run


class Breaking(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that sends `chunks`, then the connection breaks (for either client)."""

    def __init__(self, *chunks: bytes, error: Exception | None = None) -> None:
        self.chunks = chunks
        self.error = error or httpx.ReadError("connection reset")

    def __iter__(self):
        yield from self.chunks
        raise self.error

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        raise self.error


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "status, cls",
    [
        (400, megaslide_client.BadRequestError),
        (401, megaslide_client.AuthenticationError),
        (403, megaslide_client.PermissionDeniedError),
        (404, megaslide_client.NotFoundError),
        (409, megaslide_client.ConflictError),
        (413, megaslide_client.APIStatusError),
        (422, megaslide_client.UnprocessableEntityError),
        (429, megaslide_client.RateLimitError),
        (500, megaslide_client.InternalServerError),
        (503, megaslide_client.InternalServerError),
    ],
)
def test_status_maps_to_typed_error(status, cls, sleeps):
    body = {
        "error": {
            "message": f"bad {status}",
            "type": "invalid_request_error",
            "param": "size",
            "code": "c",
        }
    }
    transport, seen = scripted(
        [httpx.Response(status, json=body, headers={"x-request-id": "req-9"})]
    )
    with client_for(transport, max_retries=0) as client, pytest.raises(cls) as info:
        client.videos.retrieve("video_1")
    err = info.value
    assert type(err) is cls and isinstance(err, megaslide_client.APIStatusError)
    fields = (err.status_code, err.request_id, err.message, err.param, err.code)
    assert fields == (status, "req-9", f"bad {status}", "size", "c")
    assert err.body == body and str(status) in str(err)
    assert len(seen) == 1 and sleeps == []


def test_non_json_error_body_keeps_text():
    transport, _ = scripted([httpx.Response(502, text="bad gateway")])
    with (
        client_for(transport, max_retries=0) as client,
        pytest.raises(megaslide_client.InternalServerError) as info,
    ):
        client.videos.retrieve("v")
    assert info.value.message == "bad gateway" and info.value.body == "bad gateway"


# ---------------------------------------------------------------------------------------------
# retries and idempotency


@pytest.mark.parametrize("status", [408, 409, 429, 500, 503])
def test_transient_status_is_retried_with_the_same_idempotency_key(status, sleeps):
    transport, seen = scripted(
        [
            httpx.Response(status, json=ERR),
            httpx.Response(status, json=ERR),
            httpx.Response(200, json=video_json()),
        ]
    )
    with client_for(transport) as client:
        video = client.videos.create(prompt="a cat", size="64x64")
    assert video.id == "video_1" and len(seen) == 3
    keys = {r.headers["idempotency-key"] for r in seen}
    assert len(keys) == 1 and keys.pop().startswith("megaslide-")
    assert [json.loads(r.content) for r in seen] == [{"prompt": "a cat", "size": "64x64"}] * 3
    # Exponential backoff with jitter: attempt n waits in [(1-J) * d * 2^n, d * 2^n].
    d, j = _constants.INITIAL_RETRY_DELAY, _constants.RETRY_JITTER
    assert len(sleeps) == 2
    for n, wait in enumerate(sleeps):
        assert (1 - j) * d * 2**n <= wait <= d * 2**n


def test_each_logical_post_gets_its_own_key_and_gets_none(sleeps):
    transport, seen = scripted(
        [
            httpx.Response(200, json=video_json("a")),
            httpx.Response(200, json=video_json("b")),
            httpx.Response(200, json=video_json("a")),
        ]
    )
    with client_for(transport) as client:
        client.videos.create(prompt="x")
        client.videos.create(prompt="x", idempotency_key="mine")
        client.videos.retrieve("a")
    assert (
        seen[0].headers["idempotency-key"] != "mine"
        and seen[1].headers["idempotency-key"] == "mine"
    )
    assert "idempotency-key" not in seen[2].headers


def test_a_retried_delete_repeats_its_key(sleeps):
    deleted = {"id": "video_1", "object": "video.deleted", "deleted": True, "status": "deleted"}
    transport, seen = scripted([httpx.Response(503, json=ERR), httpx.Response(200, json=deleted)])
    with client_for(transport) as client:
        assert client.videos.delete("video_1").deleted
    assert [r.method for r in seen] == ["DELETE", "DELETE"]
    assert seen[0].headers["idempotency-key"] == seen[1].headers["idempotency-key"]


def test_non_transient_status_is_not_retried(sleeps):
    transport, seen = scripted([httpx.Response(400, json=ERR)])
    with (
        client_for(transport, max_retries=5) as client,
        pytest.raises(megaslide_client.BadRequestError),
    ):
        client.videos.create(prompt="x")
    assert len(seen) == 1 and sleeps == []


def test_retries_are_bounded(sleeps):
    transport, seen = scripted([httpx.Response(500, json=ERR)] * 4)
    with (
        client_for(transport, max_retries=3) as client,
        pytest.raises(megaslide_client.InternalServerError),
    ):
        client.videos.retrieve("v")
    assert len(seen) == 4 and len(sleeps) == 3


@pytest.mark.parametrize(
    "headers, expected",
    [({"retry-after-ms": "250"}, 0.25), ({"Retry-After": "3"}, 3.0), ({"Retry-After": "0"}, 0.0)],
)
def test_retry_after_is_honoured(headers, expected, sleeps):
    transport, _ = scripted(
        [httpx.Response(429, json=ERR, headers=headers), httpx.Response(200, json=video_json())]
    )
    with client_for(transport) as client:
        client.videos.create(prompt="x")
    assert sleeps == [expected]


def test_unreasonable_retry_after_falls_back_to_backoff(sleeps):
    transport, _ = scripted(
        [
            httpx.Response(429, json=ERR, headers={"Retry-After": "3600"}),
            httpx.Response(200, json=video_json()),
        ]
    )
    with client_for(transport) as client:
        client.videos.create(prompt="x")
    assert sleeps[0] <= _constants.INITIAL_RETRY_DELAY


def test_connection_errors_are_retried_then_typed(sleeps):
    req_error = httpx.ConnectError("refused")
    transport, seen = scripted([req_error, httpx.Response(200, json=video_json())])
    with client_for(transport) as client:
        assert client.videos.retrieve("video_1").id == "video_1"
    assert len(seen) == 2

    transport, seen = scripted([httpx.ConnectError("refused")] * 3)
    with (
        client_for(transport) as client,
        pytest.raises(megaslide_client.APIConnectionError) as info,
    ):
        client.videos.retrieve("v")
    assert not isinstance(info.value, megaslide_client.APITimeoutError) and len(seen) == 3

    transport, seen = scripted([httpx.ReadTimeout("slow")] * 2)
    with (
        client_for(transport, max_retries=1) as client,
        pytest.raises(megaslide_client.APITimeoutError),
    ):
        client.videos.retrieve("v")
    assert len(seen) == 2


def test_a_body_that_breaks_is_retried_then_typed(twin, sleeps):
    """An answer whose body breaks off is no answer: retried like a refused connection."""
    transport, seen = scripted(
        [
            httpx.Response(200, stream=Breaking(b'{"id": "vid')),
            httpx.Response(200, json=video_json()),
        ]
    )
    assert twin(transport, lambda c: c.videos.retrieve("video_1")).id == "video_1"
    assert len(seen) == 2 and len(sleeps) == 1

    transport, seen = scripted([httpx.Response(200, stream=Breaking(b"{")) for _ in range(2)])
    with pytest.raises(megaslide_client.APIConnectionError) as info:
        twin(transport, lambda c: c.videos.retrieve("video_1"), max_retries=1)
    assert "connection reset" in str(info.value) and len(seen) == 2


def test_upload_retry_resends_the_whole_file(tmp_path, sleeps):
    payload = os.urandom(5000)
    (tmp_path / "data.tar.gz").write_bytes(payload)
    ok = {"id": "file-1", "object": "file", "bytes": len(payload), "purpose": "fine-tune"}
    for source in (tmp_path / "data.tar.gz", io.BytesIO(payload), ("data.tar.gz", payload)):
        transport, seen = scripted([httpx.Response(503, json=ERR), httpx.Response(200, json=ok)])
        with client_for(transport) as client:
            assert client.files.create(file=source, purpose="fine-tune").id == "file-1"
        assert len(seen) == 2
        for request in seen:
            assert payload in request.content and b'name="purpose"' in request.content
            assert b'filename="data.tar.gz"' in request.content or isinstance(source, io.BytesIO)
        assert seen[0].headers["idempotency-key"] == seen[1].headers["idempotency-key"]


def test_a_first_frame_image_goes_as_multipart_and_a_retry_resends_it(twin, sleeps):
    """`input_reference` turns the create body into form fields beside the file (lists and
    objects as JSON text, as the server reads them); a retry sends the whole image again."""
    image = os.urandom(3000)
    transport, seen = scripted(
        [httpx.Response(503, json=ERR), httpx.Response(200, json=video_json())]
    )
    video = twin(
        transport,
        lambda client: client.videos.create(
            prompt="a cat",
            model="i2v",
            num_frames=9,
            guidance_scale=4.5,
            loras=[("style", 0.8)],
            cache={"policy": "adaptive", "threshold": 0.01},
            sampler="euler",
            timesteps=(1000, 500),
            guidance_interval=(0, 0.5),
            input_reference=("first.png", image),
        ),
    )
    assert video.id == "video_1" and len(seen) == 2
    assert seen[0].headers["idempotency-key"] == seen[1].headers["idempotency-key"]
    for request in seen:
        assert request.headers["content-type"].startswith("multipart/form-data")
        assert image in request.content and b'filename="first.png"' in request.content
        fields = {}
        for part in request.content.split(b"--" + request.content.split(b"\r\n", 1)[0][2:]):
            if b'name="' in part and b"filename=" not in part:
                head, _, value = part.partition(b"\r\n\r\n")
                name = head.split(b'name="')[1].split(b'"')[0].decode()
                fields[name] = value.rstrip(b"\r\n").decode()
        assert fields["num_frames"] == "9" and fields["guidance_scale"] == "4.5"
        assert json.loads(fields["loras"]) == [{"name": "style", "scale": 0.8}]
        assert json.loads(fields["cache"]) == {"policy": "adaptive", "threshold": 0.01}
        assert fields["prompt"] == "a cat" and fields["model"] == "i2v"
        assert fields["sampler"] == "euler" and json.loads(fields["timesteps"]) == [1000, 500]
        assert json.loads(fields["guidance_interval"]) == [0, 0.5]


# ---------------------------------------------------------------------------------------------
# configuration


def test_environment_supplies_url_and_key(monkeypatch):
    monkeypatch.setenv("MEGASLIDE_BASE_URL", "http://env-host:9000/v1/")
    monkeypatch.setenv("MEGASLIDE_API_KEY", "sk-env")
    transport, seen = scripted(
        [httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})]
    )
    with megaslide_client.Client(transport=transport) as client:
        assert [m.id for m in client.models.list()] == ["tiny"]
    assert str(seen[0].url) == "http://env-host:9000/v1/models"
    assert seen[0].headers["authorization"] == "Bearer sk-env"
    with megaslide_client.Client(base_url="http://x", api_key="given") as client:
        assert client.api_key == "given" and client.base_url == "http://x"


def test_typed_objects_keep_unknown_fields():
    video = Video.from_dict(
        video_json(status="failed", error={"code": "oom", "message": "out of memory"}, shiny=1)
    )
    assert video.error.message == "out of memory" and video.shiny == 1 and video.done
    assert video.to_dict()["shiny"] == 1 and video.to_dict()["error"] == {
        "code": "oom",
        "message": "out of memory",
    }
    with pytest.raises(AttributeError):
        _ = video.not_a_field


# ---------------------------------------------------------------------------------------------
# pagination, polling, events, downloads


def paging_transport(ids, seen):
    def handler(request):
        seen.append(dict(request.url.params))
        limit = int(request.url.params.get("limit", 20))
        after = request.url.params.get("after")
        start = ids.index(after) + 1 if after else 0
        page = ids[start : start + limit]
        return httpx.Response(
            200,
            json={
                "object": "list",
                "data": [video_json(i) for i in page],
                "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None,
                "has_more": start + limit < len(ids),
            },
        )

    return httpx.MockTransport(handler)


def test_list_walks_every_page():
    ids, seen = [f"video_{i}" for i in range(5)], []
    with client_for(paging_transport(ids, seen)) as client:
        page = client.videos.list(limit=2, order="asc")
        assert [v.id for v in page.data] == ids[:2] and page.has_more
        assert [v.id for v in page] == ids
        assert [len(p.data) for p in page.iter_pages()] == [2, 2, 1]
    assert seen[:3] == [
        {"limit": "2", "order": "asc"},
        {"limit": "2", "order": "asc", "after": "video_1"},
        {"limit": "2", "order": "asc", "after": "video_3"},
    ]


def test_poll_honours_poll_after_header(twin, sleeps):
    answers = [
        httpx.Response(
            200, json=video_json(status="queued"), headers={"openai-poll-after-ms": "700"}
        ),
        httpx.Response(
            200,
            json=video_json(status="in_progress", progress=50),
            headers={"openai-poll-after-ms": "300"},
        ),
        httpx.Response(200, json=video_json(status="completed", progress=100)),
    ]
    transport, seen = scripted(answers)
    video = twin(transport, lambda c: c.videos.poll("video_1"))
    assert video.status == "completed" and sleeps == [0.7, 0.3] and len(seen) == 3

    slow = httpx.Response(
        200,
        json=video_json(status="in_progress", progress=20),
        headers={"openai-poll-after-ms": "700"},
    )
    transport, seen = scripted([slow])
    with pytest.raises(TimeoutError, match=r"video_1 still in_progress \(20%\) after max_wait"):
        twin(transport, lambda c: c.videos.poll("video_1", max_wait=0.5))
    # The 0.7 s the server asks for would end past max_wait: no second look, no sleep.
    assert len(seen) == 1 and sleeps == [0.7, 0.3]


def test_sse_parser_follows_the_spec():
    text = (
        ": keep-alive\n\n"
        'event: progress\nid: 7\ndata: {"a":\ndata: 1}\n\n'
        "data: plain\nretry: 50\n\n"
        "event: end\ndata: x"
    )  # the last event lacks its blank line: the end of the stream ends it
    events = list(iter_sse(text.split("\n")))
    assert [(e.event, e.data, e.id) for e in events] == [
        ("progress", '{"a":\n1}', "7"),
        (None, "plain", None),
        ("end", "x", None),
    ]
    assert events[1].retry == 50


def test_events_yield_videos():
    jpeg = b"\xff\xd8 a tiny jpeg"
    preview = {"id": "video_1", "object": "video", "step": 5}
    preview["preview"] = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    frames = [
        ("video.progress", video_json(status="in_progress", progress=40)),
        ("video.preview", preview),
        ("video.completed", video_json(status="completed", progress=100)),
    ]
    body = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in frames)
    transport, seen = scripted(
        [httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})]
    )
    with client_for(transport) as client:
        events = list(client.videos.events("video_1"))
    assert [(e.event, e.video.status, e.video.progress) for e in events] == [
        ("video.progress", "in_progress", 40),
        ("video.preview", None, None),
        ("video.completed", "completed", 100),
    ]
    assert events[1].preview == jpeg and events[1].data["step"] == 5
    assert events[0].preview is None and events[2].preview is None
    assert seen[0].headers["accept"] == "text/event-stream"


def ranged(data: bytes, request: httpx.Request) -> httpx.Response:
    """A 206 answer to `Range: bytes=START-`."""
    start = int(request.headers["range"].split("=")[1].rstrip("-"))
    return httpx.Response(
        206,
        content=data[start:],
        headers={"content-range": f"bytes {start}-{len(data) - 1}/{len(data)}"},
    )


@pytest.mark.parametrize("to_file", [True, False], ids=["file", "bytes"])
def test_download_resumes_with_a_range_request(tmp_path, twin, sleeps, to_file):
    mp4 = os.urandom(10_000)
    seen = []

    def handler(request):
        seen.append(request.headers.get("range"))
        if len(seen) == 1:
            return httpx.Response(200, stream=Breaking(mp4[:4096]))
        return ranged(mp4, request)

    path = tmp_path / "out.mp4" if to_file else None
    out = twin(
        httpx.MockTransport(handler), lambda c: c.videos.download_content("video_1", path=path)
    )
    assert (out.read_bytes() if to_file else out) == mp4 and seen == [None, "bytes=4096-"]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.mp4"] if to_file else [])
    assert len(sleeps) == 1


def test_download_starts_over_when_the_range_is_ignored(tmp_path, twin, sleeps):
    """A server that answers the Range request with the whole file again: the file is rewritten,
    not appended to."""
    mp4 = os.urandom(10_000)
    seen = []

    def handler(request):
        seen.append(request.headers.get("range"))
        if len(seen) == 1:
            return httpx.Response(200, stream=Breaking(mp4[:4096]))
        return httpx.Response(200, content=mp4)

    out = twin(
        httpx.MockTransport(handler),
        lambda c: c.videos.download_content("video_1", path=tmp_path / "out.mp4"),
    )
    assert out.read_bytes() == mp4 and seen == [None, "bytes=4096-"]


def test_download_that_keeps_breaking_leaves_no_file(tmp_path, twin, sleeps):
    """Each resumed part arrives, yet the download breaks every time: its breaks add up."""
    mp4 = os.urandom(10_000)
    seen = []

    def handler(request):
        seen.append(request.headers.get("range"))
        if seen[-1] is None:
            return httpx.Response(200, stream=Breaking(mp4[:100]))
        start = int(seen[-1].split("=")[1].rstrip("-"))
        return httpx.Response(
            206,
            headers={"content-range": f"bytes {start}-{len(mp4) - 1}/{len(mp4)}"},
            stream=Breaking(mp4[start : start + 100]),
        )

    with pytest.raises(megaslide_client.APIConnectionError, match="the stream broke"):
        twin(
            httpx.MockTransport(handler),
            lambda c: c.videos.download_content("video_1", path=tmp_path / "out.mp4"),
            max_retries=2,
        )
    assert list(tmp_path.iterdir()) == [] and len(sleeps) == 2
    assert seen == [None, "bytes=100-", "bytes=200-"]


# ---------------------------------------------------------------------------------------------
# async twin


def test_async_client_retries_and_paginates(sleeps):
    keys, ids, calls = [], [f"video_{i}" for i in range(3)], []

    async def handler(request):
        calls.append(request.method)
        if request.method == "POST":
            keys.append(request.headers["idempotency-key"])
            if len(keys) == 1:
                return httpx.Response(503, json=ERR)
            return httpx.Response(200, json=video_json())
        return paging_transport(ids, []).handler(request)

    async def main():
        transport = httpx.MockTransport(handler)
        async with megaslide_client.AsyncClient(
            base_url="http://test", transport=transport
        ) as client:
            video = await client.videos.create(prompt="x")
            first = await client.videos.list(limit=2)
            everything = [v.id async for v in client.videos.list(limit=2)]
            return video, first, everything

    video, first, everything = asyncio.run(main())
    assert video.id == "video_1" and len(keys) == 2 and keys[0] == keys[1]
    assert [v.id for v in first.data] == ids[:2] and everything == ids and len(sleeps) == 1


# ---------------------------------------------------------------------------------------------
# packaging


@pytest.mark.slow
def test_package_imports_without_torch():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "clients" / "python"))
    code = (
        "import sys, megaslide_client\n"
        "heavy = sorted({'torch', 'numpy', 'fastapi', 'megaslide', 'pydantic'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "print(megaslide_client.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == megaslide_client.__version__


def test_wait_reports_each_event_once_oldest_first(twin, sleeps):
    """Events are listed newest first and may span pages; wait() hands each new one over once."""
    log = [
        {
            "id": f"ftevent-{i}",
            "object": "fine_tuning.job.event",
            "created_at": 0,
            "type": "metrics",
            "message": f"step {i}",
            "data": {"step": i, "total_steps": 6},
        }
        for i in range(1, 7)
    ]
    visible = iter([2, 5, 6])  # events that exist at each poll
    state = {"n": 0}

    def handler(request):
        path = request.url.path
        if path.endswith("/events"):
            newest_first = log[: state["n"]][::-1]
            after = request.url.params.get("after")
            start = [e["id"] for e in newest_first].index(after) + 1 if after else 0
            limit = int(request.url.params["limit"])
            page = newest_first[start : start + 2]  # pages of 2 whatever the limit, to force paging
            assert limit >= 2
            return httpx.Response(
                200,
                json={"object": "list", "data": page, "has_more": start + 2 < len(newest_first)},
            )
        state["n"] = next(visible)
        status = "succeeded" if state["n"] == 6 else "running"
        return httpx.Response(
            200,
            json={
                "id": "ftjob-1",
                "object": "fine_tuning.job",
                "status": status,
                "fine_tuned_model": "ft:tiny:x:ftjob-1" if status == "succeeded" else None,
            },
        )

    got = []
    job = twin(
        httpx.MockTransport(handler),
        lambda c: c.fine_tuning.jobs.wait(
            "ftjob-1", on_event=lambda e: got.append(e.id), poll_interval_ms=5
        ),
    )
    assert job.status == "succeeded" and job.fine_tuned_model == "ft:tiny:x:ftjob-1"
    assert got == [e["id"] for e in log] and sleeps == [0.005, 0.005]


def test_permanent_conflict_is_not_retried(sleeps):
    body = {
        "error": {
            "message": "key reused",
            "type": "invalid_request_error",
            "param": None,
            "code": "idempotency_key_reused",
        }
    }
    transport, seen = scripted([httpx.Response(409, json=body)])
    with client_for(transport) as client, pytest.raises(megaslide_client.ConflictError) as info:
        client.videos.create(prompt="x")
    assert info.value.code == "idempotency_key_reused" and len(seen) == 1 and sleeps == []
    transport, seen = scripted([httpx.Response(500, json=ERR, headers={"x-should-retry": "false"})])
    with client_for(transport) as client, pytest.raises(megaslide_client.InternalServerError):
        client.videos.retrieve("v")
    assert len(seen) == 1


def sse(event_id: int, status: str, progress: int) -> bytes:
    data = json.dumps({"id": "v", "status": status, "progress": progress})
    return f"id: {event_id}\nevent: video.{status}\ndata: {data}\n\n".encode()


def test_events_resume_from_the_last_event_id(twin, sleeps):
    seen = []

    def handler(request):
        seen.append(request.headers.get("last-event-id"))
        if len(seen) == 1:  # event 2 arrives whole but for the blank line that ends it
            cut = Breaking(sse(1, "queued", 0), sse(2, "in_progress", 45)[:-1])
            cut.error = httpx.RemoteProtocolError("peer closed connection")
            return httpx.Response(200, stream=cut, headers={"content-type": "text/event-stream"})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=sse(2, "in_progress", 45) + sse(3, "completed", 100),
        )

    events = twin(httpx.MockTransport(handler), lambda c: c.videos.events("v"))
    assert [(e.id, e.video.status) for e in events] == [
        ("1", "queued"),
        ("2", "in_progress"),
        ("3", "completed"),
    ]
    assert seen == [None, "1"] and len(sleeps) == 1


def test_event_stream_counts_only_breaks_in_a_row(twin, sleeps):
    """Each reconnection that delivers an event starts the count of breaks again."""
    seen = []

    def handler(request):
        seen.append(request.headers.get("last-event-id"))
        n = len(seen)
        if n < 4:  # three connections, each one event, each then broken
            return httpx.Response(200, stream=Breaking(sse(n, "in_progress", 10 * n)))
        return httpx.Response(200, content=sse(4, "completed", 100))

    events = twin(httpx.MockTransport(handler), lambda c: c.videos.events("v"), max_retries=1)
    assert [e.id for e in events] == ["1", "2", "3", "4"]
    assert seen == [None, "1", "2", "3"] and len(sleeps) == 3

    seen.clear()
    sleeps.clear()

    def silent_after_one(request):
        seen.append(request.headers.get("last-event-id"))
        return httpx.Response(200, stream=Breaking(*[sse(1, "queued", 0)][: len(seen) == 1]))

    with pytest.raises(megaslide_client.APIConnectionError, match="the stream broke"):
        twin(httpx.MockTransport(silent_after_one), lambda c: c.videos.events("v"), max_retries=1)
    assert seen == [None, "1"] and len(sleeps) == 1


def test_progress_bar_follows_the_video(sleeps, capsys):
    pytest.importorskip("tqdm")
    answers = [
        httpx.Response(200, json=video_json(status="in_progress", progress=p)) for p in (10, 55)
    ]
    transport, _ = scripted(
        answers + [httpx.Response(200, json=video_json(status="completed", progress=100))]
    )
    with client_for(transport) as client:
        client.videos.poll("video_1", progress=True, poll_interval_ms=1)
    err = capsys.readouterr().err
    assert "video video_1" in err and "100/100" in err and "completed" in err


def test_with_options_shares_the_connection(sleeps):
    transport, seen = scripted([httpx.Response(500, json=ERR)])
    with client_for(transport, max_retries=5) as client:
        quick = client.with_options(max_retries=0, timeout=3.0)
        with pytest.raises(megaslide_client.InternalServerError):
            quick.videos.retrieve("v")
        assert quick._http is client._http and quick.timeout.read == 3.0 and client.max_retries == 5
    assert len(seen) == 1
