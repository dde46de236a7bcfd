"""The playground in a real browser: Debian's Chromium, headless, driven by Playwright, against a live
`megaslide serve --preset tiny` on loopback.

Each test opens a fresh browser context (its own storage) and fails if the page throws or asks
anything of another origin. Screenshots of each tab go to out/playground/ (or
$MEGASLIDE_SCREENSHOT_DIR); docs/playground-create.png is a copy of the Create tab's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, Route, expect, sync_playwright

from megaslide.cli.remote import pack_dataset
from megaslide.engine.native.world import write_dataset

from server_fakes import until

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = Path(os.environ.get("MEGASLIDE_SCREENSHOT_DIR") or ROOT / "out" / "playground")


def find_chromium() -> str | None:
    if Path("/usr/bin/chromium").is_file():
        return "/usr/bin/chromium"
    return shutil.which("chromium")


CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Chromium is not installed (/usr/bin/chromium); .ci/run installs Debian's `chromium`",
    ),
]

# Playwright starts the browser with a fresh temporary profile; these keep it off the network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 860}
KEY = "sk-playground"
START_TIMEOUT_S = 120
WAIT_MS = 60_000  # the longest any step waits for the page (two busy CPU cores)
expect.set_options(timeout=WAIT_MS)
# A clip the tiny preset makes in a fraction of a second.
QUICK = {"size": "32x32", "num_frames": 4, "num_inference_steps": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`megaslide serve --preset tiny` as a child process, and an HTTP client for it."""

    def __init__(self, data_dir: Path, *flags: str, api_key: str | None = None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = data_dir.parent / f"{data_dir.name}.log"
        env = {
            **os.environ,
            # One intra-op thread: the server shares two cores with the browser and this test, and
            # with more threads than free cores every parallel region waits for a descheduled one.
            "OMP_NUM_THREADS": "1",
            "MEGASLIDE_SSE_INTERVAL_S": "0.05",  # progress reaches the page every 50 ms
            "MEGASLIDE_FINETUNE_SAVE_EVERY": "2",  # a short fine-tune still has checkpoints
        }
        for var in ("MEGASLIDE_API_KEYS", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET"):
            env.pop(var, None)
        args = ["serve", "--preset", "tiny", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--data-dir", str(data_dir), "--log-level", "warning", *flags]
        if api_key:
            args += ["--api-key", api_key]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "megaslide.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"megaslide serve exited:\n{self.log.read_text()}"
            try:
                if self.http.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{self.log.read_text()}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.http.close()

    def create(self, **fields) -> dict:
        r = self.http.post("/v1/videos", json={"prompt": "a clip", **QUICK, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, video_id: str, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while (video := self.http.get(f"/v1/videos/{video_id}").json())["status"] in (
            "queued",
            "in_progress",
        ):
            assert time.monotonic() < deadline, video
            time.sleep(0.05)
        return video


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Serve(tmp_path_factory.mktemp("playground") / "data")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@contextlib.contextmanager
def open_page(browser, base_url: str):
    """A page in a fresh context; on the way out, fails if the page threw, broke its own content
    security policy, or asked anything of another origin."""
    context = browser.new_context(viewport=VIEWPORT, base_url=base_url, accept_downloads=True)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors, urls = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
    page.on("request", lambda r: urls.append(r.url))
    try:
        yield page
        assert not errors, errors
        elsewhere = [u for u in urls if not u.startswith((base_url + "/", "blob:", "data:"))]
        assert not elsewhere, f"the page asked another origin: {elsewhere}"
    finally:
        context.close()


@pytest.fixture
def page(browser, server):
    with open_page(browser, server.url) as page:
        yield page


def screenshot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"playground-{name}.png")


def open_tab(page: Page, tab: str) -> None:
    page.goto(f"/#{tab}")
    page.wait_for_selector("#create-model option", state="attached")  # the API answered


def submit(page: Page, prompt: str, *, size="32x32", frames=4, steps=2):
    """Fill the Create form and submit it; returns the new job's card."""
    width, height = size.split("x")
    page.fill("#create-prompt", prompt)
    page.fill("#create-width", width)
    page.fill("#create-height", height)
    page.fill("#create-frames", str(frames))
    page.fill("#create-steps", str(steps))
    before = page.locator("#queue-list .job").count()
    page.click("#generate")
    expect(page.locator("#queue-list .job")).to_have_count(before + 1)
    video_id = page.locator("#queue-list .job").first.get_attribute("data-id")  # newest on top
    return page.locator(f"#queue-list .job[data-id='{video_id}']")


# What the queue's cards go through, recorded from outside the page's own code: every value a
# progress bar takes (a burst of replayed events sets several in one task, so each change's old
# value is kept) and the elements that appear in each card's media box.
WATCH_QUEUE = """() => {
  window.seen = {progress: {}, media: {}};
  new MutationObserver((records) => {
    for (const r of records) {
      const card = r.target.closest && r.target.closest(".job");
      if (!card) continue;
      const id = card.dataset.id;
      if (r.type === "attributes") (seen.progress[id] ||= []).push(Number(r.oldValue));
      for (const node of r.addedNodes) if (r.target.classList.contains("media"))
        (seen.media[id] ||= []).push(node.tagName + (node.className ? "." + node.className : ""));
    }
  }).observe(document.querySelector("#queue-list"), {subtree: true, childList: true,
    attributes: true, attributeFilter: ["aria-valuenow"], attributeOldValue: true});
}"""


def expect_playing(video) -> None:
    """The <video> has decoded its MP4: a current frame (readyState >= 2) and a duration."""
    expect(video).to_be_attached()
    video.page.wait_for_function(
        "(video) => video.readyState >= 2 && video.duration > 0", arg=video.element_handle()
    )


# ---------------------------------------------------------------------------------------------


def test_create_watch_and_play(page, server):
    open_tab(page, "create")
    expect(page.locator("#model-limits")).to_contain_text("256 px")  # tiny's limits, from the API
    expect(page.locator("#image-field")).to_be_hidden()  # the tiny preset takes no first frame

    # The server's error shows beside the field it names, and nothing is queued.
    page.fill("#create-prompt", "odd width")
    page.fill("#create-width", "33")
    page.click("#generate")
    expect(page.locator("[data-param=size] .error")).to_contain_text("33x32")
    expect(page.locator("#queue-list .job")).to_have_count(0)

    # The first events stream ends after one event and the second breaks: the page reconnects
    # on its own, resuming after the last event it received.
    opened: list[dict] = []

    def flaky_events(route: Route) -> None:
        video_id = route.request.url.split("/")[-2]
        opened.append(route.request.headers)
        if len(opened) == 1:
            data = {"id": video_id, "object": "video", "status": "queued", "progress": 0, "step": 0}
            body = f"id: 1\nevent: video.queued\ndata: {json.dumps(data)}\n\n"
            route.fulfill(status=200, content_type="text/event-stream", body=body)
        elif len(opened) == 2:
            route.abort("connectionreset")
        else:
            route.continue_()

    page.route(re.compile(r".*/v1/videos/[^/]+/events$"), flaky_events)
    page.evaluate(WATCH_QUEUE)
    card = submit(page, "a red circle moving left", steps=100)  # a few seconds of denoising
    video_id = card.get_attribute("data-id")
    expect(card).to_have_attribute("data-status", "completed")
    expect_playing(card.locator("video"))

    assert len(opened) >= 3 and opened[1].get("last-event-id") == "1"
    assert opened[2].get("last-event-id") == "1"
    seen = page.evaluate("() => seen")
    progress = seen["progress"][video_id] + [100]
    assert progress == sorted(progress), progress
    assert any(0 < p < 90 for p in progress), progress  # denoising steps, not just the ends
    # Previews while it renders (video.preview events), the thumbnail, then the clip.
    media = [m.split(".")[0] for m in seen["media"][video_id]]
    assert "IMG.preview" in seen["media"][video_id] and media[-2:] == ["IMG", "VIDEO"], media
    assert server.http.get(f"/v1/videos/{video_id}").json()["num_inference_steps"] == 100


def test_queue_positions_and_cancel(page, server):
    open_tab(page, "create")
    done = submit(page, "a red circle moving left on a black background", steps=8)
    expect(done).to_have_attribute("data-status", "completed")
    expect_playing(done.locator("video"))

    # A long clip occupies the worker (tens of seconds); two short ones of another shape cannot
    # join its batch.
    running = submit(page, "a blue square moving up", frames=8, steps=200)
    expect(running.locator(".state")).to_contain_text(re.compile(r"step \d{2,} of 200"))
    first = submit(page, "a green triangle moving right")
    expect(first.locator(".state")).to_have_text("queued · #1 in line")
    second = submit(page, "a yellow circle moving down")
    expect(second.locator(".state")).to_have_text("queued · #2 in line")
    screenshot(page, "create")

    first.locator("button.cancel").click()
    expect(first).to_have_attribute("data-status", "cancelled")
    expect(second.locator(".state")).to_have_text("queued · #1 in line")  # moved up, live
    second.locator("button.cancel").click()
    expect(second).to_have_attribute("data-status", "cancelled")
    running.locator("button.cancel").click()
    expect(running).to_have_attribute("data-status", "cancelled")
    stopped = server.http.get(f"/v1/videos/{running.get_attribute('data-id')}").json()
    assert stopped["status"] == "cancelled" and stopped["step"] < 200


def test_the_queue_finds_unfinished_videos_past_the_newest_page(page, server):
    """A video still running can be older than the newest hundred: the queue pages on. Here the
    newest page is made to hold only finished videos (none shown) and point further back."""
    running = server.create(prompt="an old long clip", num_inference_steps=200)
    pages = []

    def older_than_a_page(route: Route) -> None:
        after = re.search(r"[?&]after=([^&]+)", route.request.url)
        pages.append(after and after.group(1))
        if after is None:  # the newest page: nothing unfinished on it, more behind
            route.fulfill(
                json={
                    "object": "list",
                    "data": [],
                    "first_id": None,
                    "last_id": "video_finished",
                    "has_more": True,
                }
            )
        else:  # the page behind it: what the server lists
            route.fulfill(response=route.fetch(url=server.url + "/v1/videos?limit=100"))

    page.route(re.compile(r".*/v1/videos\?.*"), older_than_a_page)
    open_tab(page, "create")
    card = page.locator(f"#queue-list .job[data-id='{running['id']}']")
    expect(card).to_be_attached()
    assert pages[:2] == [None, "video_finished"]
    card.locator("button.cancel").click()
    expect(card).to_have_attribute("data-status", "cancelled")


def test_gallery_pages_play_download_remix_delete(page, server):
    made = [server.create(prompt=f"clip {i}", seed=i) for i in range(6)]
    made.append(server.create(prompt="clip 6", seed=6, cache="balanced"))
    for video in made:
        assert server.wait(video["id"])["status"] == "completed"
    api_pages = [server.http.get("/v1/videos", params={"limit": 6}).json()]
    api_pages.append(
        server.http.get("/v1/videos", params={"limit": 6, "after": api_pages[0]["last_id"]}).json()
    )

    page.goto("/#gallery")
    page.select_option("#gallery-size", "6")
    cards = page.locator("#gallery-list .video-card")

    def shown() -> list[str]:
        return [c.get_attribute("data-id") for c in cards.all()]

    expect(cards).to_have_count(6)
    assert shown() == [v["id"] for v in api_pages[0]["data"]]
    expect(page.locator("#gallery-newer")).to_be_disabled()
    page.click("#gallery-older")
    expect(cards.first).to_have_attribute("data-id", api_pages[1]["data"][0]["id"])
    assert shown() == [v["id"] for v in api_pages[1]["data"]]
    page.click("#gallery-newer")
    expect(cards.first).to_have_attribute("data-id", api_pages[0]["data"][0]["id"])

    newest = cards.first
    video = made[-1]
    assert newest.get_attribute("data-id") == video["id"]
    expect(newest.locator("img")).to_be_visible()
    screenshot(page, "gallery")
    newest.locator("button.play").click()
    expect_playing(newest.locator("video"))
    with page.expect_download() as download:
        newest.locator("button.download").click()
    assert download.value.suggested_filename == f"{video['id']}.mp4"
    mp4 = Path(download.value.path()).read_bytes()
    assert mp4 == server.http.get(f"/v1/videos/{video['id']}/content").content

    # Remix: the video's parameters go back into the Create form.
    newest.locator("button.remix").click()
    expect(page).to_have_url(re.compile("#create$"))
    form = {
        name: page.input_value(f"#create-{name}")
        for name in (
            "model",
            "prompt",
            "width",
            "height",
            "frames",
            "fps",
            "steps",
            "guidance",
            "seed",
        )
    }
    width, height = video["size"].split("x")
    assert form == {
        "model": video["model"],
        "prompt": video["prompt"],
        "width": width,
        "height": height,
        "frames": str(video["num_frames"]),
        "fps": str(video["fps"]),
        "steps": str(video["num_inference_steps"]),
        "guidance": f"{video['guidance_scale']:g}",
        "seed": str(video["seed"]),
    }
    assert video["cache"] and json.loads(page.input_value("#create-cache")) == video["cache"]

    # Delete asks twice, then the video is gone from the page and from the server.
    page.goto("/#gallery")
    doomed = page.locator(f"#gallery-list .video-card[data-id='{video['id']}']")
    doomed.locator("button.delete").click()
    expect(doomed.locator("button.delete")).to_have_text("Really?")
    # A reload between the clicks (a video finishing redraws the cards) keeps it armed.
    page.select_option("#gallery-size", "24")
    expect(doomed.locator("button.delete")).to_have_text("Really?")
    doomed.locator("button.delete").click()
    expect(doomed).to_have_count(0)
    assert server.http.get(f"/v1/videos/{video['id']}").status_code == 404


def test_fine_tune_then_generate_with_it(page, server, tmp_path):
    archive = tmp_path / "world.tar.gz"
    pack_dataset(
        write_dataset(tmp_path / "world", 4, seed=0, frames=4, height=32, width=32), archive
    )
    open_tab(page, "finetune")
    page.set_input_files("#upload-file", archive)
    page.click("#upload")
    expect(page.locator("#upload-status")).to_contain_text("4 clips")
    expect(page.locator("#upload-progress")).to_have_attribute("aria-valuenow", "100")

    page.fill("#ft-width", "33")  # the server's error shows beside the field it names
    page.click("#start-finetune")
    expect(page.locator("[data-param='hyperparameters.size'] .error")).to_contain_text("33x")
    page.fill("#ft-epochs", "2")
    page.fill("#ft-batch", "1")
    page.fill("#ft-frames", "4")
    page.fill("#ft-width", "32")
    page.fill("#ft-height", "32")
    page.fill("#ft-suffix", "web")
    page.click("#start-finetune")
    detail = page.locator("#ft-detail")
    expect(detail.locator(".badge")).to_have_text("succeeded")
    job_id = detail.locator("h3").text_content()

    job = server.http.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    events = server.http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000})
    reported = [e for e in events.json()["data"] if e["type"] == "metrics"]
    assert job["total_steps"] == len(reported) == 8  # 2 epochs of 4 clips, one at a time
    chart = detail.locator("svg.loss-chart")
    expect(chart).to_have_attribute("data-points", str(len(reported)))
    drawn = chart.locator("polyline.loss-line").evaluate("(line) => line.points.numberOfItems")
    assert drawn == len(reported)
    checkpoints = server.http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    expect(detail.locator("table.checkpoints tbody tr")).to_have_count(len(checkpoints))
    assert len(checkpoints) == 4  # every 2 steps
    screenshot(page, "finetune")

    # One click to the Create tab with the new model chosen; a clip from it plays.
    model = job["fine_tuned_model"]
    detail.locator("button.use-model").click()
    expect(page).to_have_url(re.compile("#create$"))
    expect(page.locator("#create-model")).to_have_value(model)
    card = submit(page, "a red circle moving left on a black background")
    expect(card).to_have_attribute("data-status", "completed")
    expect_playing(card.locator("video"))
    made = server.http.get(f"/v1/videos/{card.get_attribute('data-id')}").json()
    assert made["model"] == model


def test_validation_videos_side_by_side_and_both_loss_curves(page, server, tmp_path):
    archive = tmp_path / "world.tar.gz"
    pack_dataset(
        write_dataset(tmp_path / "world", 4, seed=1, frames=4, height=32, width=32), archive
    )
    open_tab(page, "finetune")
    page.set_input_files("#upload-file", archive)
    page.click("#upload")
    expect(page.locator("#upload-status")).to_contain_text("4 clips")
    for field, value in (
        ("#ft-epochs", "2"),
        ("#ft-batch", "1"),
        ("#ft-frames", "4"),
        ("#ft-width", "32"),
        ("#ft-height", "32"),
        ("#ft-validation", "a red circle\na blue square"),
        ("#ft-split", "1"),
        ("#ft-validation-steps", "2"),
    ):
        page.fill(field, value)
    before = len(server.http.get("/v1/fine_tuning/jobs").json()["data"])
    page.click("#start-finetune")
    # The page may still show an earlier test's job: wait for this one's.
    until(lambda: len(server.http.get("/v1/fine_tuning/jobs").json()["data"]) > before)
    job_id = server.http.get("/v1/fine_tuning/jobs").json()["data"][0]["id"]  # newest first
    detail = page.locator("#ft-detail")
    expect(detail.locator("h3")).to_have_text(job_id)
    expect(detail.locator(".badge")).to_have_text("succeeded")
    checkpoints = server.http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert [c["step_number"] for c in checkpoints] == [6, 4, 2]  # 3 clips train, 1 held out

    # Both curves: the training loss at every step, the held-out loss at every checkpoint.
    chart = detail.locator("svg.loss-chart")
    expect(chart).to_have_attribute("data-points", "6")
    expect(chart).to_have_attribute("data-held-out", "3")
    held = chart.locator("polyline.held-out-line").evaluate("(line) => line.points.numberOfItems")
    assert held == 3
    # Prompts as rows, checkpoints as columns (oldest first), every clip playing.
    grid = detail.locator("table.validation")
    expect(grid.locator("thead th")).to_have_text(["prompt", "step 2", "step 4", "step 6"])
    expect(grid.locator("tbody th")).to_have_text(["a red circle", "a blue square"])
    videos = grid.locator("video")
    expect(videos).to_have_count(6)
    for i in range(6):
        expect_playing(videos.nth(i))
    assert videos.nth(5).get_attribute("data-step") == "6"
    screenshot(page, "finetune-validation")


def test_image_field_for_models_that_take_one(page, server):
    """A model that lists "image" among its inputs gets the first-frame field; the server (which
    serves no such model yet) refuses the image, and the page shows why beside that field."""

    def with_image_input(route: Route) -> None:
        listed = route.fetch().json()
        for model in listed["data"]:
            model["inputs"] = ["text", "image"]
        route.fulfill(json=listed)

    page.route(re.compile(r".*/v1/models$"), with_image_input)
    open_tab(page, "create")
    expect(page.locator("#image-field")).to_be_visible()
    page.fill("#create-prompt", "from a first frame")
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    page.set_input_files(
        "#create-image", files=[{"name": "first.png", "mimeType": "image/png", "buffer": png}]
    )
    page.click("#generate")
    expect(page.locator("[data-param=input_reference] .error")).to_contain_text("input_reference")
    expect(page.locator("#queue-list .job")).to_have_count(0)


def test_vace_fields_for_models_that_take_them(page, server):
    """A model that lists VACE's inputs gets the control video, mask, reference images and scale
    fields; the request goes as multipart with each reference image under the field repeated and
    the scale beside; the server (which serves no VACE model) refuses the control video, and the
    page shows why beside that field."""

    def with_vace_inputs(route: Route) -> None:
        listed = route.fetch().json()
        for model in listed["data"]:
            model["inputs"] = ["text", "reference_images", "control_video", "mask"]
        route.fulfill(json=listed)

    sent = []

    def keep_body(route: Route) -> None:
        if route.request.method == "POST":
            sent.append(route.request.post_data_buffer)
        route.continue_()

    page.route(re.compile(r".*/v1/models$"), with_vace_inputs)
    page.route(re.compile(r".*/v1/videos$"), keep_body)
    open_tab(page, "create")
    expect(page.locator("#vace-field")).to_be_visible()
    expect(page.locator("#video-field")).to_be_hidden()
    page.fill("#create-prompt", "a dancer spins")
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    images = [{"name": f"ref{i}.png", "mimeType": "image/png", "buffer": png} for i in (0, 1)]
    page.set_input_files("#create-reference-images", files=images)
    mp4 = {"name": "pose.mp4", "mimeType": "video/mp4", "buffer": b"\0\0\0\x18ftypmp42"}
    page.set_input_files("#create-control-video", files=[mp4])
    page.fill("#create-conditioning-scale", "0.5")
    page.click("#generate")
    expect(page.locator("[data-param=control_video] .error")).to_contain_text("control_video")
    expect(page.locator("#queue-list .job")).to_have_count(0)
    (body,) = sent
    assert body.count(b'name="reference_images"; filename=') == 2
    assert b'name="control_video"; filename="pose.mp4"' in body
    assert re.search(rb'name="conditioning_scale"\r\n\r\n0.5\r\n', body)


def test_animate_fields_for_models_that_take_them(page, server):
    """A model that lists Animate's inputs gets the pose, face, background and mask video fields
    and the segments' two numbers, and its image field names the character; the request goes as
    multipart with each file under its API field, a segment length beside them; the server (which serves no Animate model) refuses the character image, and
    the page shows why beside that field."""

    def with_animate_inputs(route: Route) -> None:
        listed = route.fetch().json()
        for model in listed["data"]:
            model["inputs"] = ["text", "image", "pose_video", "face_video"]
            model["inputs"] += ["background_video", "background_mask"]
            model["limits"]["animate_input"] = True
        route.fulfill(json=listed)

    sent = []

    def keep_body(route: Route) -> None:
        if route.request.method == "POST":
            sent.append(route.request.post_data_buffer)
        route.continue_()

    page.route(re.compile(r".*/v1/models$"), with_animate_inputs)
    page.route(re.compile(r".*/v1/videos$"), keep_body)
    open_tab(page, "create")
    expect(page.locator("#animate-field")).to_be_visible()
    expect(page.locator("#vace-field")).to_be_hidden()
    expect(page.locator("label[for=create-image]")).to_have_text("Character image")
    page.fill("#create-prompt", "a dancer")
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    page.set_input_files(
        "#create-image", files=[{"name": "dancer.png", "mimeType": "image/png", "buffer": png}]
    )
    for name in ("pose", "face", "background", "mask"):
        mp4 = {"name": f"{name}.mp4", "mimeType": "video/mp4", "buffer": b"\0\0\0\x18ftypmp42"}
        field = "background-mask" if name == "mask" else f"{name}-video"
        page.set_input_files(f"#create-{field}", files=[mp4])
    page.fill("#create-segment-frame-length", "5")
    page.click("#generate")
    expect(page.locator("[data-param=input_reference] .error")).to_contain_text("input_reference")
    expect(page.locator("#queue-list .job")).to_have_count(0)
    (body,) = sent
    for field, file in (
        ("input_reference", "dancer.png"),
        ("pose_video", "pose.mp4"),
        ("face_video", "face.mp4"),
        ("background_video", "background.mp4"),
        ("background_mask", "mask.mp4"),
    ):
        assert f'name="{field}"; filename="{file}"'.encode() in body, field
    assert re.search(rb'name="segment_frame_length"\r\n\r\n5\r\n', body)
    assert b'name="prev_segment_conditioning_frames"' not in body  # empty: the server's default


def test_api_key_gate(browser, tmp_path_factory):
    server = Serve(tmp_path_factory.mktemp("keyed") / "data", api_key=KEY)
    try:
        video = server.create(prompt="behind a key")
        server.wait(video["id"])
        with open_page(browser, server.url) as page:
            answers: list[tuple[str, int]] = []
            page.on("response", lambda r: "/v1/" in r.url and answers.append((r.url, r.status)))

            page.goto("/#gallery")
            dialog = page.locator("#auth-dialog")
            expect(dialog).to_be_visible()
            page.wait_for_timeout(300)  # time enough for anything the page might wrongly ask
            assert [(re.sub(r".*/v1/", "", u), s) for u, s in answers] == [("models", 401)]
            expect(page.locator("#create-model option")).to_have_count(0)
            expect(page.locator("#gallery-list .video-card")).to_have_count(0)
            screenshot(page, "api-key")

            page.fill("#auth-key", "sk-wrong")
            page.click("#auth-submit")
            expect(dialog.locator(".error")).to_have_text("Incorrect API key provided")
            assert all(status == 401 for _, status in answers)

            page.fill("#auth-key", KEY)
            page.click("#auth-submit")
            expect(dialog).to_be_hidden()
            expect(page.locator("#create-model option")).to_have_count(1)
            card = page.locator(f"#gallery-list .video-card[data-id='{video['id']}']")
            expect(card.locator("img")).to_be_visible()  # media come with the key too
            page.wait_for_function(  # visible comes before decoded: wait for the pixels
                "(img) => img.complete && img.naturalWidth > 0",
                arg=card.locator("img").element_handle(),
            )
            # The clip plays from a signed link the browser streams itself, not from a blob.
            card.locator("button.play").click()
            player = card.locator("video")
            expect_playing(player)
            src = player.get_attribute("src")
            assert src.startswith("http") and f"/v1/videos/{video['id']}/content?" in src
            assert "signature=" in src
            assert player.evaluate("(v) => v.seekable.length > 0 && v.seekable.end(0) > 0")
            assert page.evaluate("() => localStorage.getItem('megaslide.apiKey')") == KEY
            expect(page.locator("#forget-key")).to_be_visible()
    finally:
        server.stop()
