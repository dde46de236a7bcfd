"""Repeated requests: a request equal to one of its tenant's completed videos in everything that
decides the pixels is answered at once with that video's MP4 (services/repeats.py); anything that
differs, another tenant, an opt-out, or an original that failed, expired or went runs again."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import httpx

import megaslide_client
from megaslide.cli.main import main as cli_main
from megaslide.engine.request import ANIMATE_VIDEOS, CacheSpec, LoraChoice, ResolvedVideo
from megaslide.server import Settings, build_app
from megaslide.server.services.repeats import NOT_PIXELS, pixel_key
from megaslide.server.worker import Fleet

from api_helpers import SMALL, assert_error, create, wait_status
from server_fakes import FAKE_CARD, FakeBackend, live_server, until

VIDEO = ResolvedVideo(
    model="fake",
    prompt="a red ball",
    negative_prompt="",
    frames=4,
    width=32,
    height=32,
    fps=8,
    steps=2,
    guidance=1.0,
    seed=3,
)
RUNS = ("queued", "in_progress")  # a worker may have claimed it before the answer was read
SDK_SMALL = dict(num_frames=4, size="32x32", num_inference_steps=2)
# A value other than VIDEO's for the fields whose type a plain string would not fit; any other
# field, including one added after this test, is changed to a string.
OTHER = {
    "cache": CacheSpec("output-change", 0.05),
    "loras": (LoraChoice("style", 0.5),),
    "image": "videos/video_other.input.png",
    "last_image": "videos/video_other.last.png",
    "video": "videos/video_other.input.video",
    "strength": 0.5,
    "control_video": "videos/video_other.control.video",
    "mask": "videos/video_other.mask.video",
    "reference_images": ("videos/video_other.ref0.png",),
    "conditioning_scale": 0.5,
}


def key(video=VIDEO, card=FAKE_CARD, image="0" * 64, **kwargs) -> str:
    digests = {
        "image": image,
        "last_image": "2" * 64,
        "video": "3" * 64,
        "control_video": "4" * 64,
        "mask": "5" * 64,
        "reference_images": ["6" * 64],
        **{name: str(i) * 64 for i, name in enumerate(ANIMATE_VIDEOS, start=7)},
    }
    return pixel_key(video, card, digests=digests, **kwargs)


def test_every_field_of_a_resolved_video_counts_unless_excluded_by_name():
    fields = {f.name for f in dataclasses.fields(ResolvedVideo)}
    assert NOT_PIXELS <= fields, f"NOT_PIXELS names no field: {sorted(NOT_PIXELS - fields)}"
    assert set(VIDEO.to_dict()) == fields  # to_dict drops none: the key sees every field
    for name in sorted(fields - NOT_PIXELS - {"image"}):
        changed = dataclasses.replace(VIDEO, **{name: OTHER.get(name, f"another {name}")})
        assert key(changed) != key(), f"{name} changes the pixels but not the pixel key"
    # The image counts by its bytes: a path of its own for every upload, the same pixels; so do
    # the last frame, the input video and VACE's files.
    for name in ("image", "last_image", "video", "control_video", "mask", *ANIMATE_VIDEOS):
        one, other = (dataclasses.replace(VIDEO, **{name: f"videos/{n}"}) for n in "ab")
        assert key(one) == key(other) != key()
    one, other = (dataclasses.replace(VIDEO, reference_images=(f"videos/{n}",)) for n in "ab")
    assert key(one) == key(other) != key()
    image = dataclasses.replace(VIDEO, image=OTHER["image"])
    assert key(image, image="1" * 64) != key(image)


def test_the_weights_count_by_their_revision():
    styled = dataclasses.replace(VIDEO, loras=(LoraChoice("alice~style", 0.5),))
    adapter = {"name": "style", "id": "alice~style", "rank": 4, "sha256": "a" * 64}
    card = FAKE_CARD.replace(adapters=(adapter,))
    assert key(styled, card) == key(styled, card.replace(adapters=({**adapter, "name": "x"},)))
    # The same adapter at another scale, or a file uploaded again under its name.
    other_scale = dataclasses.replace(styled, loras=(LoraChoice("alice~style", 0.6),))
    assert key(other_scale, card) != key(styled, card)
    reuploaded = card.replace(adapters=({**adapter, "sha256": "b" * 64},))
    assert key(styled, reuploaded) != key(styled, card)
    # One given at start (`--lora`), its file rewritten before the server restarted.
    given = {"name": "style", "id": "style", "rank": 4, "modified_at": 1_700_000_000}
    at_start = dataclasses.replace(styled, loras=(LoraChoice("style", 0.5),))
    rewritten = card.replace(adapters=({**given, "modified_at": 1_700_000_001},))
    assert key(at_start, rewritten) != key(at_start, card.replace(adapters=(given,)))
    # A model registered again (a directory changed, a preset's server restarted), and the base
    # a fine-tune stands on.
    assert key(card=FAKE_CARD.replace(created=FAKE_CARD.created + 1)) != key()
    tuned = FAKE_CARD.replace(name="ft:fake:x", kind="fine-tune", parent="fake", source="models/x")
    restarted = FAKE_CARD.replace(created=FAKE_CARD.created + 1)
    assert key(card=tuned, parent=FAKE_CARD) != key(card=tuned, parent=restarted)


def run(c, **fields) -> dict:
    """A video made by a run, completed."""
    video = wait_status(c, create(c, **fields)["id"])
    assert video["status"] == "completed" and video["cached_from"] is None, video
    return video


def test_a_repeated_request_is_answered_at_once_with_the_same_mp4(make_client):
    backend = FakeBackend()
    c = make_client(backend)
    first = run(c, seed=3)
    passes = len(backend.passes)
    r = c.post("/v1/videos", json={"prompt": "a red ball", "seed": 3, **SMALL})
    assert r.status_code == 200 and "openai-poll-after-ms" not in r.headers
    again = r.json()
    assert again["id"] != first["id"] and again["cached_from"] == first["id"]
    assert again["status"] == "completed" and again["progress"] == 100
    assert again["passes"] == 0 and again["step"] == first["step"]
    assert c.get(f"/v1/videos/{again['id']}").json() == again
    for variant in ("video", "thumbnail"):
        url = "/v1/videos/{}/content?variant=" + variant
        assert c.get(url.format(again["id"])).content == c.get(url.format(first["id"])).content
    events = c.get(f"/v1/videos/{again['id']}/events").text
    assert "video.completed" in events
    # A repeat of the repeat: the newest video with those pixels answers.
    third = c.post("/v1/videos", json={"prompt": "a red ball", "seed": 3, **SMALL}).json()
    assert third["cached_from"] == again["id"]
    assert len(backend.passes) == passes  # no pass ran for either


def test_what_differs_or_opts_out_runs_again(make_client):
    backend = FakeBackend()
    c = make_client(backend)
    first = run(c, seed=3)
    differing = [
        {"seed": 4},
        {"prompt": "a blue ball"},
        {"num_inference_steps": 3},
        {"fps": 16},
        {"cache": "fast"},
        {"guidance_interval": [0, 0.5]},
        {"reuse": False},
    ]
    for fields in differing:
        video = create(c, **{"seed": 3, **fields})
        assert video["cached_from"] is None and video["status"] in RUNS, fields
    # An unseeded request gets a seed of its own: it runs.
    assert create(c)["cached_from"] is None
    # The opt-out as a multipart form field, as the openai SDK sends it.
    form = {"prompt": "a red ball", "seed": "3", "size": "32x32", "num_frames": "4"}
    r = c.post("/v1/videos", data={**form, "num_inference_steps": "2", "reuse": "false"})
    assert r.status_code == 200 and r.json()["cached_from"] is None, r.text
    r = c.post("/v1/videos", data={**form, "num_inference_steps": "2"})
    assert r.json()["cached_from"] == first["id"]
    assert_error(c.post("/v1/videos", json={"prompt": "p", "reuse": "maybe"}), 400, "reuse")
    api = c.get("/openapi.json").json()
    body = api["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["properties"]["reuse"]["default"] is True
    assert "cached_from" in api["components"]["schemas"]["Video"]["properties"]


def test_another_tenants_video_is_never_the_answer(make_client):
    c = make_client(api_keys=["k-one", "k-two"])
    one, two = ({"Authorization": f"Bearer {k}"} for k in ("k-one", "k-two"))
    body = {"prompt": "a red ball", "seed": 3, **SMALL}
    first = c.post("/v1/videos", json=body, headers=one).json()
    until(lambda: c.get(f"/v1/videos/{first['id']}", headers=one).json()["status"] == "completed")
    theirs = c.post("/v1/videos", json=body, headers=two).json()
    assert theirs["cached_from"] is None and theirs["status"] in RUNS
    mine = c.post("/v1/videos", json=body, headers=one).json()
    assert mine["cached_from"] == first["id"]


def test_a_copy_outlives_its_original_and_a_gone_original_is_not_the_answer(make_client):
    c = make_client()
    first = run(c, seed=3)
    mp4 = c.get(f"/v1/videos/{first['id']}/content").content
    copy = create(c, seed=3)
    assert copy["cached_from"] == first["id"]
    assert c.delete(f"/v1/videos/{first['id']}").json()["deleted"] is True
    assert c.get(f"/v1/videos/{copy['id']}/content").content == mp4
    # The copy answers the next repeat; once it is deleted too, the request runs.
    assert create(c, seed=3)["cached_from"] == copy["id"]
    for video in c.get("/v1/videos").json()["data"]:
        c.delete(f"/v1/videos/{video['id']}")
    assert create(c, seed=3)["cached_from"] is None


def test_a_failed_or_expired_original_is_not_the_answer(make_client):
    c = make_client()
    failed = wait_status(c, create(c, prompt="explode please", seed=1)["id"])
    assert failed["status"] == "failed"
    assert create(c, prompt="explode please", seed=1)["cached_from"] is None
    expired = run(c, seed=5)
    with c.app.state.store.sync.db.tx() as conn:  # past the video's lifetime
        conn.exec_driver_sql("UPDATE videos SET expires_at = 1 WHERE id = ?", (expired["id"],))
    assert create(c, seed=5)["cached_from"] is None
    # Its MP4 gone from disk, though the record says completed: the request runs.
    kept = run(c, seed=6)
    (c.app.state.settings.data_dir / "videos" / f"{kept['id']}.mp4").unlink()
    assert create(c, seed=6)["cached_from"] is None


def test_an_idempotency_key_answers_its_retries_with_its_own_video(make_client):
    c = make_client()
    first = run(c, seed=3)
    headers = {"Idempotency-Key": "repeat-1"}
    body = {"prompt": "a red ball", "seed": 3, **SMALL}
    repeat = c.post("/v1/videos", json=body, headers=headers).json()
    assert repeat["cached_from"] == first["id"]
    assert c.post("/v1/videos", json=body, headers=headers).json()["id"] == repeat["id"]
    explicit = c.post("/v1/videos", json={**body, "reuse": True}, headers=headers)
    assert explicit.json()["id"] == repeat["id"]  # the default, said or not, is one request
    # The opt-out is part of the request: the same key with it is another request.
    opted = c.post("/v1/videos", json={**body, "reuse": False}, headers=headers)
    assert_error(opted, 409, fragment="different request body")


def test_the_metrics_count_repeats(make_client):
    c = make_client()
    run(c, seed=3)
    assert "megaslide_video_repeats 0.0" in c.get("/metrics").text
    create(c, seed=3, reuse=False)
    create(c, seed=3)
    assert "megaslide_video_repeats 1.0" in c.get("/metrics").text


def test_the_sdk_reads_cached_from_and_sends_the_opt_out(make_client):
    c = make_client()

    def to_app(request):  # the sync SDK's requests, through the app's test client
        r = c.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        return httpx.Response(r.status_code, content=r.content, headers=r.headers)

    with megaslide_client.Client(base_url="http://t", transport=httpx.MockTransport(to_app)) as sdk:
        first = sdk.videos.create_and_poll(prompt="a red ball", seed=3, **SDK_SMALL)
        again = sdk.videos.create(prompt="a red ball", seed=3, **SDK_SMALL)
        assert first.cached_from is None and again.cached_from == first.id
        assert again.status == "completed" and again.passes == 0
        fresh = sdk.videos.create(prompt="a red ball", seed=3, reuse=False, **SDK_SMALL)
        assert fresh.cached_from is None
    sent = []

    def handler(request):  # the async twin, and the opt-out as a multipart field
        sent.append(request)
        return httpx.Response(200, json={"id": "video_2", "status": "completed"})

    async def main():
        transport = httpx.MockTransport(handler)
        async with megaslide_client.AsyncClient(base_url="http://t", transport=transport) as sdk:
            await sdk.videos.create(prompt="p", reuse=False)
            await sdk.videos.create(prompt="p", reuse=False, input_reference=b"\x89PNG")

    asyncio.run(main())
    assert json.loads(sent[0].content)["reuse"] is False
    assert b'name="reuse"\r\n\r\nfalse\r\n' in sent[1].content


def test_the_cli_says_what_answered_and_takes_the_opt_out(tmp_path, monkeypatch, capsys):
    for var in ("MEGASLIDE_API_KEYS", "MEGASLIDE_API_KEY", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET"):
        monkeypatch.delenv(var, raising=False)
    settings = Settings(data_dir=tmp_path / "data", poll_after_ms=50)
    app = build_app(settings, Fleet.embedded(settings, FakeBackend()))
    with live_server(app) as url:
        out = tmp_path / "a.mp4"
        argv = ["generate", "a red ball", "-o", str(out), "--model", "fake", "--frames", "4"]
        argv += ["--size", "32x32", "--steps", "2", "--server", url, "--no-progress"]
        assert cli_main(argv) == 0 and "the MP4 of" not in capsys.readouterr().err
        first = out.read_bytes()
        assert cli_main(argv) == 0 and "completed" in (err := capsys.readouterr().err)
        assert re.search(r"the MP4 of video_\w+", err) and out.read_bytes() == first
        assert cli_main([*argv, "--no-reuse"]) == 0
        assert "the MP4 of" not in capsys.readouterr().err
