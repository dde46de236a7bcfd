"""The Python SDK and the CLI's remote mode against the real server app (`build_app`, tiny preset).

The sync client talks to a live uvicorn on 127.0.0.1; the async client goes through
httpx.ASGITransport into a second app in this process. Every resource method, each error type
the server can produce, the idempotent retry of a POST whose answer was lost, and the async twins.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

import megaslide_client
from megaslide.cli.main import main as cli_main
from megaslide.cli.remote import pack_dataset
from megaslide.server.settings import Settings

from server_fakes import live_server, torch_app

ROOT = Path(__file__).resolve().parents[1]

KEY = "sk-test-key"
# Tiny clips: 32x32, 8 frames, 2 steps take well under a second on two CPU cores.
SMALL = dict(size="32x32", num_frames=8, num_inference_steps=2)


def settings(data_dir: Path, **changes) -> Settings:
    base = dict(
        preset="tiny",
        data_dir=data_dir,
        api_keys=[KEY],
        poll_after_ms=50,
        sse_interval_s=0.02,
        cancel_wait_s=20.0,
        finetune_save_every=1,
    )
    return Settings(**{**base, **changes})


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with live_server(torch_app(settings(tmp_path_factory.mktemp("live")))) as url:
        yield url


@pytest.fixture
def client(server_url):
    with megaslide_client.Client(base_url=server_url, api_key=KEY) as c:
        yield c


class LoseFirstPostAnswer(httpx.BaseTransport):
    """Delivers every request, but the answer to the first POST is lost after the server acted."""

    def __init__(self, inner: httpx.BaseTransport, strip_idempotency_key: bool = False) -> None:
        self.inner, self.strip = inner, strip_idempotency_key
        self.posts: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.strip and "idempotency-key" in request.headers:
            del request.headers["idempotency-key"]
        response = self.inner.handle_request(request)
        if request.method == "POST":
            self.posts.append(request)
            if len(self.posts) == 1:
                response.read()  # the server has created the job ...
                response.close()
                # ... but we never hear of it.
                raise httpx.ReadError("connection reset before the answer arrived", request=request)
        return response


def all_video_ids(client) -> set:
    return {v.id for v in client.videos.list(limit=100)}


def cancel_all(client, ids) -> None:
    """Cancel videos a test made but does not need run, to keep the worker free for the next test."""
    for video_id in ids:
        assert client.videos.delete(video_id).deleted


# ---------------------------------------------------------------------------------------------
# videos


def test_video_lifecycle(client, tmp_path):
    video = client.videos.create_and_poll(
        prompt="a red circle moving right", seed=7, priority=-3, max_wait=60, **SMALL
    )
    assert video.status == "completed" and video.progress == 100 and video.error is None
    echoed = (video.size, video.num_frames, video.num_inference_steps, video.seed, video.priority)
    assert echoed == ("32x32", 8, 2, 7, -3)
    assert video.model == "tiny" and video.completed_at >= video.created_at and video.step == 2
    again = client.videos.retrieve(video.id)
    assert again.to_dict() == video.to_dict()

    out = client.videos.download_content(video.id, path=tmp_path / "clip.mp4")
    mp4 = out.read_bytes()
    assert (
        out == tmp_path / "clip.mp4"
        and mp4[4:8] == b"ftyp"
        and not (tmp_path / "clip.mp4.part").exists()
    )
    assert client.videos.download_content(video.id) == mp4
    assert client.videos.download_content(video.id, variant="thumbnail")[:8] == b"\x89PNG\r\n\x1a\n"
    link = client.videos.content_link(video.id, expires_in=120)
    assert link.object == "video.content_link" and 100 < link.expires_at - time.time() <= 120
    assert httpx.get(link.url).content == mp4  # no key

    events = list(client.videos.events(video.id))
    assert [e.event for e in events][0] == "video.queued" and events[-1].event == "video.completed"
    progress = [e.video.progress for e in events]
    assert progress == sorted(progress) and events[-1].video.status == "completed"
    tail = list(client.videos.events(video.id, last_event_id=events[-2].id))
    assert [e.id for e in tail] == [events[-1].id]

    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.status == "deleted" and deleted.object == "video.deleted"
    with pytest.raises(megaslide_client.NotFoundError):
        client.videos.retrieve(video.id)


def test_list_walks_pages(client):
    made = [client.videos.create(prompt=f"clip {i}", **SMALL).id for i in range(3)]
    page = client.videos.list(limit=1, order="asc")
    assert len(page.data) == 1 and page.has_more
    walked = [v.id for v in page]
    assert walked[-3:] == made and len(walked) == len(set(walked))
    assert [v.id for v in client.videos.list(limit=2)][:3] == made[::-1]  # newest first by default
    cancel_all(client, made)


def test_cancel_stops_a_running_video(client):
    video = client.videos.create(
        prompt="a long one", size="32x32", num_frames=8, num_inference_steps=200
    )
    deadline = time.monotonic() + 30
    while client.videos.retrieve(video.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.videos.cancel(video.id).status == "cancelled"
    stopped = client.videos.poll(video.id, max_wait=5)
    assert stopped.status == "cancelled" and stopped.step < 200
    time.sleep(0.3)
    assert client.videos.retrieve(video.id).step == stopped.step  # no step ran after the answer


def test_retried_create_makes_exactly_one_job(server_url):
    transport = LoseFirstPostAnswer(httpx.HTTPTransport())
    with megaslide_client.Client(base_url=server_url, api_key=KEY, transport=transport) as client:
        before = all_video_ids(client)
        video = client.videos.create(prompt="only once", **SMALL)
        created = all_video_ids(client) - before
        cancel_all(client, created)
    assert len(transport.posts) == 2  # the lost attempt and its retry ...
    assert (
        transport.posts[0].headers["idempotency-key"]
        == transport.posts[1].headers["idempotency-key"]
    )
    assert created == {video.id}  # ... and the server made one job


def test_without_the_key_a_retry_would_duplicate(server_url):
    """The control for the test above: the same lost answer without Idempotency-Key makes two jobs."""
    transport = LoseFirstPostAnswer(httpx.HTTPTransport(), strip_idempotency_key=True)
    with megaslide_client.Client(base_url=server_url, api_key=KEY, transport=transport) as client:
        before = all_video_ids(client)
        client.videos.create(prompt="twice", **SMALL)
        created = all_video_ids(client) - before
        cancel_all(client, created)
    assert len(created) == 2


# ---------------------------------------------------------------------------------------------
# errors


def test_error_types(client, server_url, monkeypatch):
    with pytest.raises(megaslide_client.BadRequestError) as info:
        client.videos.create(prompt="odd", size="33x32")
    assert (
        info.value.status_code == 400
        and info.value.param == "size"
        and "33x32" in info.value.message
    )
    with pytest.raises(megaslide_client.BadRequestError) as info:
        client.videos.create(prompt="x", extra_body={"colour": "red"})
    assert info.value.code == "unknown_parameter" and info.value.param == "colour"

    with pytest.raises(megaslide_client.BadRequestError) as info:
        client.videos.create(prompt="x", seconds=1, fps=8, num_frames=9)
    assert info.value.param == "seconds" and "disagree" in info.value.message

    with pytest.raises(megaslide_client.NotFoundError) as info:
        client.videos.retrieve("video_nope")
    assert info.value.status_code == 404 and info.value.type == "invalid_request_error"
    with pytest.raises(megaslide_client.NotFoundError) as info:
        client.videos.create(prompt="x", model="no-such-model")
    assert info.value.code == "model_not_found"

    monkeypatch.delenv(
        "MEGASLIDE_API_KEY", raising=False
    )  # no key at all, not even from the environment
    for key in (None, "sk-wrong"):
        with megaslide_client.Client(base_url=server_url, api_key=key) as anonymous:
            with pytest.raises(megaslide_client.AuthenticationError) as info:
                anonymous.models.list()
            assert info.value.status_code == 401

    first = client.videos.create(prompt="first body", idempotency_key="fixed-key", **SMALL)
    assert (
        client.videos.create(prompt="first body", idempotency_key="fixed-key", **SMALL).id
        == first.id
    )
    with pytest.raises(megaslide_client.ConflictError) as info:
        client.videos.create(prompt="another body", idempotency_key="fixed-key", **SMALL)
    assert info.value.code == "idempotency_key_reused"
    cancel_all(client, [first.id])

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with megaslide_client.Client(base_url=f"http://127.0.0.1:{port}", max_retries=1) as dead:
        with pytest.raises(megaslide_client.APIConnectionError):
            dead.models.list()


def test_timeout_is_typed():
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with megaslide_client.Client(base_url=url, timeout=0.2, max_retries=0) as c:
            with pytest.raises(megaslide_client.APITimeoutError):
                c.videos.retrieve("video_x")


# ---------------------------------------------------------------------------------------------
# models, files, fine-tuning


def make_dataset(root: Path) -> Path:
    """A one-clip dataset in the fine-tuning layout: metadata.jsonl and a folder of PNG frames."""
    from PIL import Image

    frames = root / "clips" / "a"
    frames.mkdir(parents=True)
    for i in range(8):
        Image.new("RGB", (32, 32), (30 * i, 0, 255 - 30 * i)).save(frames / f"{i:03d}.png")
    (root / "metadata.jsonl").write_text(
        json.dumps({"file": "clips/a", "text": "a colour fade"}) + "\n"
    )
    return root


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models] == ["tiny"] and models.data[0].kind == "preset"
    assert models.data[0].inputs == ["text"]  # the tiny preset takes no first frame
    assert client.models.retrieve("tiny").limits["max_frames"] >= 8
    with pytest.raises(megaslide_client.NotFoundError):
        client.models.retrieve("nope")


def test_files(client, server_url, tmp_path):
    archive = tmp_path / "data.tar.gz"
    pack_dataset(make_dataset(tmp_path / "data"), archive)
    uploaded = client.files.create(file=archive, purpose="fine-tune")
    assert uploaded.status == "uploaded"  # answered before it is unpacked and checked
    uploaded = client.files.wait_for_processing(uploaded.id, max_wait=30)
    assert (
        uploaded.purpose == "fine-tune"
        and uploaded.bytes == archive.stat().st_size
        and (uploaded.status, uploaded.clips) == ("processed", 1)
    )
    assert client.files.retrieve(uploaded.id).filename == "data.tar.gz"
    with open(archive, "rb") as f:
        second = client.files.create(file=f)
    assert uploaded.id in {f.id for f in client.files.list(purpose="fine-tune", limit=1)}
    assert client.files.delete(second.id).deleted
    with pytest.raises(megaslide_client.NotFoundError):
        client.files.retrieve(second.id)
    refused = client.files.create(file=("notes.txt", b"not an archive"))
    refused = client.files.wait_for_processing(refused.id, max_wait=30)
    assert refused.status == "error" and "notes.txt" in refused.status_details

    # An upload whose answer is lost is sent again whole, and still makes one file.
    transport = LoseFirstPostAnswer(httpx.HTTPTransport())
    with megaslide_client.Client(base_url=server_url, api_key=KEY, transport=transport) as lossy:
        before = {f.id for f in client.files.list()}
        again = lossy.files.create(file=archive)
    assert len(transport.posts) == 2 and {f.id for f in client.files.list()} - before == {again.id}


def test_fine_tuning_jobs(client, tmp_path):
    archive = tmp_path / "data.tar.gz"
    pack_dataset(make_dataset(tmp_path / "data"), archive)
    training_file = client.files.create(file=archive).id
    client.files.wait_for_processing(training_file, max_wait=30)
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=training_file,
        suffix="fade",
        seed=5,
        hyperparameters={"n_epochs": 2, "batch_size": 1, "num_frames": 8, "size": "32x32"},
    )
    assert (
        job.object == "fine_tuning.job"
        and job.model == "tiny"
        and job.seed == 5
        and job.suffix == "fade"
    )
    assert job.hyperparameters.n_epochs == 2
    assert job.id in {j.id for j in client.fine_tuning.jobs.list(limit=1)}
    seen = []
    done = client.fine_tuning.jobs.wait(
        job.id, on_event=seen.append, poll_interval_ms=50, max_wait=40
    )
    listed = list(client.fine_tuning.jobs.list_events(job.id, limit=2))
    assert [e.id for e in seen] == [e.id for e in reversed(listed)]  # each event once, oldest first
    assert seen[0].message.startswith("Created fine-tuning job")
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model.startswith("ft:tiny:fade:")
    assert [e.data["step"] for e in seen if e.type == "metrics"] == [
        1,
        2,
    ] and done.step == done.total_steps == 2
    assert all(isinstance(e.data["loss"], float) for e in seen if e.type == "metrics")
    checkpoints = list(client.fine_tuning.jobs.checkpoints(job.id, limit=1))
    assert [c.step_number for c in checkpoints] == [2, 1]  # newest first, one per page
    assert {c.fine_tuning_job_id for c in checkpoints} == {job.id}
    assert done.fine_tuned_model in {m.id for m in client.models.list()}
    assert client.models.retrieve(done.fine_tuned_model).parent == "tiny"


@pytest.mark.slow  # trains and samples four clips: tens of seconds on two cores
def test_fine_tuning_validation_videos_are_playable_mp4s(client, server_url, tmp_path):
    """A job with validation prompts yields a playable MP4 per prompt per checkpoint, and a
    held-out loss; the SDK lists and fetches them, sync and async."""
    from megaslide.engine.video import read_video

    data = make_dataset(tmp_path / "data")
    shutil.copytree(data / "clips" / "a", data / "clips" / "b")
    with (data / "metadata.jsonl").open("a") as f:
        f.write(json.dumps({"file": "clips/b", "text": "the same fade"}) + "\n")
    archive = tmp_path / "data.tar.gz"
    pack_dataset(data, archive)
    training_file = client.files.create(file=archive).id
    client.files.wait_for_processing(training_file, max_wait=30)
    prompts = [
        {"prompt": "a colour fade", "seed": 1, **SMALL},
        {"prompt": "a slower fade", "seed": 2, "size": "16x16", "num_frames": 4},
    ]
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=training_file,
        hyperparameters={
            "n_epochs": 2,
            "num_frames": 8,
            "size": "32x32",
            "validation_split": 1,
        },
        validation=prompts,
    )
    assert [v["prompt"] for v in job.validation] == ["a colour fade", "a slower fade"]
    assert job.hyperparameters.validation_split == 1
    done = client.fine_tuning.jobs.wait(job.id, poll_interval_ms=50, max_wait=60)
    assert done.status == "succeeded", done.error
    checkpoints = list(client.fine_tuning.jobs.checkpoints(job.id))
    assert [c.step_number for c in checkpoints] == [2, 1]  # one clip trains, one is held out
    for c in checkpoints:
        assert isinstance(c.metrics["validation_loss"], float)
        assert [v.status for v in c.validation] == ["succeeded", "succeeded"], c.validation
        first = client.fine_tuning.jobs.download_validation_video(
            job.id, c.id, 0, path=tmp_path / f"{c.id}-0.mp4"
        )
        assert read_video(first).shape == (8, 32, 32, 3)
        second = client.fine_tuning.jobs.download_validation_video(job.id, c.id, 1)
        assert second[4:8] == b"ftyp"  # an MP4, in memory

    async def fetch() -> bytes:
        async with megaslide_client.AsyncClient(base_url=server_url, api_key=KEY) as a:
            page = await a.fine_tuning.jobs.checkpoints(job.id)
            newest = page.data[0]
            return await a.fine_tuning.jobs.download_validation_video(job.id, newest.id, 1)

    got = asyncio.run(fetch())
    path = tmp_path / "async.mp4"
    path.write_bytes(got)
    assert read_video(path).shape == (4, 16, 16, 3)
    # The CLI fetches them all: step-N/<prompt index>.mp4.
    out = tmp_path / "videos"
    argv = ["finetune-videos", job.id, "--server", server_url, "--api-key", KEY, "-o", str(out)]
    assert cli_main(argv) == 0
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.mp4")) == [
        "step-1/0.mp4",
        "step-1/1.mp4",
        "step-2/0.mp4",
        "step-2/1.mp4",
    ]
    assert read_video(out / "step-2" / "1.mp4").shape == (4, 16, 16, 3)


def test_fine_tuning_cancel(client, tmp_path):
    archive = tmp_path / "data.tar.gz"
    pack_dataset(make_dataset(tmp_path / "data"), archive)
    training_file = client.files.create(file=archive).id
    client.files.wait_for_processing(training_file, max_wait=30)
    # Videos come before fine-tunes, so with one running the job stays queued until cancelled.
    blocker = client.videos.create(
        prompt="keep the worker busy", size="32x32", num_frames=8, num_inference_steps=200
    )
    job = client.fine_tuning.jobs.create(model="tiny", training_file=training_file)
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    with pytest.raises(megaslide_client.BadRequestError):
        client.fine_tuning.jobs.cancel(job.id)  # already cancelled
    with pytest.raises(megaslide_client.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    client.videos.delete(blocker.id)


# ---------------------------------------------------------------------------------------------
# the CLI's remote mode


def test_cli_generate_remote(server_url, tmp_path, capsys):
    out = tmp_path / "cli.mp4"
    argv = [
        "generate",
        "a blue square",
        "-o",
        str(out),
        "--preset",
        "tiny",
        "--steps",
        "2",
        "--frames",
        "8",
        "--size",
        "32x32",
        "--seed",
        "1",
        "--server",
        server_url,
        "--api-key",
        KEY,
        "--no-progress",
    ]
    assert cli_main(argv) == 0
    assert out.read_bytes()[4:8] == b"ftyp" and "wrote" in capsys.readouterr().err

    bad = tmp_path / "bad.mp4"
    argv[argv.index("32x32")], argv[3] = (
        "34x34",
        str(bad),
    )  # 34 is not a multiple of the 4-pixel patch
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "400" in err and "34x34" in err and not bad.exists()
    assert cli_main(argv[:-3] + ["--api-key", "sk-wrong", "--no-progress"]) == 1
    assert "401" in capsys.readouterr().err


def test_cli_finetune_remote(server_url, tmp_path, capsys):
    data = make_dataset(tmp_path / "data")
    argv = [
        "finetune",
        "--data",
        str(data),
        "--preset",
        "tiny",
        "--epochs",
        "1",
        "--frames",
        "8",
        "--size",
        "32x32",
        "--lr",
        "2e-4",
        "--optimizer-state",
        "bf16-sr/8bit",
        "--server",
        server_url,
        "--api-key",
        KEY,
    ]
    assert cli_main(argv) == 0  # with the progress bar: events are written above it
    captured = capsys.readouterr()
    model = captured.out.strip()
    assert model.startswith("ft:tiny:") and "Step 1/1: training loss=" in captured.err
    with megaslide_client.Client(base_url=server_url, api_key=KEY) as client:
        job = client.fine_tuning.jobs.retrieve(model.rsplit(":", 1)[1].join(["ftjob-", ""]))
        assert job.hyperparameters.learning_rate_multiplier == pytest.approx(2.0)
        assert job.hyperparameters.optimizer_state == "bf16-sr/8bit"
        assert model in {m.id for m in client.models.list()}
    assert cli_main(argv + ["--resume"]) == 2 and "--resume" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the async client, in process through httpx.ASGITransport


class AsyncLoseFirstPostAnswer(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.posts = inner, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST":
            self.posts.append(request)
            if len(self.posts) == 1:
                await response.aread()
                raise httpx.ReadError("connection reset before the answer arrived", request=request)
        return response


def test_async_client(tmp_path):
    app = torch_app(settings(tmp_path / "store", max_queue=1))

    async def main():
        async with app.router.lifespan_context(app):
            transport = AsyncLoseFirstPostAnswer(httpx.ASGITransport(app))
            async with megaslide_client.AsyncClient(
                base_url="http://app", api_key=KEY, transport=transport
            ) as c:
                while not app.state.workers.ready:
                    await asyncio.sleep(0.02)
                # Retried create: the first answer is lost, the retry returns the same job.
                video = await c.videos.create(
                    prompt="async clip",
                    seed=2,
                    size="32x32",
                    seconds=1,
                    fps=8,
                    num_inference_steps=2,
                )
                assert len(transport.posts) == 2 and video.num_frames == 8 and video.seconds == "1"
                assert [v.id async for v in c.videos.list()] == [video.id]

                video = await c.videos.poll(video.id, max_wait=60)
                assert (
                    video.status == "completed"
                    and (await c.videos.retrieve(video.id)).progress == 100
                )
                events = [e async for e in c.videos.events(video.id)]
                assert events[-1].video.status == "completed"
                link = await c.videos.content_link(video.id, variant="thumbnail")
                assert link.url.startswith("http://app/v1/videos/") and "signature=" in link.url
                mp4 = await c.videos.download_content(video.id, path=tmp_path / "a.mp4")
                assert mp4.read_bytes() == await c.videos.download_content(video.id)
                page = await c.videos.list(limit=1)
                assert [v.id for v in page.data] == [video.id] and not page.has_more

                archive = tmp_path / "data.tar.gz"
                pack_dataset(make_dataset(tmp_path / "data"), archive)
                uploaded = await c.files.create(file=archive)
                uploaded = await c.files.wait_for_processing(uploaded.id, max_wait=30)
                assert (await c.files.retrieve(uploaded.id)).clips == 1
                assert [f.id async for f in c.files.list()] == [uploaded.id]
                assert [m.id async for m in c.models.list()] == ["tiny"]

                # A full queue (max_queue=1): a running long video, one queued of another shape, then 429.
                long = await c.videos.create(
                    prompt="long", size="32x32", num_frames=8, num_inference_steps=200
                )
                while (await c.videos.retrieve(long.id)).status != "in_progress":
                    await asyncio.sleep(0.02)
                queued = await c.videos.create(
                    prompt="waits", size="64x64", num_frames=8, num_inference_steps=2
                )
                no_retry = c.with_options(max_retries=0)
                with pytest.raises(megaslide_client.RateLimitError) as info:
                    await no_retry.videos.create(prompt="no room", **SMALL)
                assert (
                    info.value.code == "queue_full"
                    and info.value.response.headers["retry-after"].isdigit()
                )
                with pytest.raises(megaslide_client.RateLimitError):
                    await no_retry.fine_tuning.jobs.create(model="tiny", training_file=uploaded.id)
                assert (await c.videos.cancel(queued.id)).status == "cancelled"
                assert (await c.videos.delete(long.id)).status == "deleted"

                job = await c.fine_tuning.jobs.create(
                    model="tiny",
                    training_file=uploaded.id,
                    hyperparameters={"num_frames": 8, "size": "32x32"},
                )
                assert job.id in [j.id async for j in c.fine_tuning.jobs.list()]
                assert (await c.fine_tuning.jobs.retrieve(job.id)).training_file == uploaded.id
                done = await c.fine_tuning.jobs.wait(job.id, poll_interval_ms=50, max_wait=40)
                assert done.status == "succeeded", done.error
                events = [e async for e in c.fine_tuning.jobs.list_events(job.id, limit=2)]
                assert events[-1].message.startswith("Created fine-tuning job") and len(events) > 2
                assert [x.step_number async for x in c.fine_tuning.jobs.checkpoints(job.id)] == [1]
                assert done.fine_tuned_model in [m.id for m in (await c.models.list()).data]
                with pytest.raises(megaslide_client.NotFoundError):
                    await c.fine_tuning.jobs.cancel("ftjob-nope")
                assert (await c.files.delete(uploaded.id)).deleted
                with pytest.raises(megaslide_client.AuthenticationError):
                    async with megaslide_client.AsyncClient(
                        base_url="http://app", api_key="bad", transport=httpx.ASGITransport(app)
                    ) as bad:
                        await bad.models.list()

    asyncio.run(main())
