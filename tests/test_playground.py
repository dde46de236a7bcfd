"""The playground as the server hands it out, without a browser: the page, the modules it imports,
package data, the open page beside a locked API, and the API fields the page relies on (a model's
inputs, a queued video's place in the queue). The page itself runs in test_playground_browser.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import tomllib
import warnings
from pathlib import Path

import httpx
import pytest

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from megaslide.server import Settings, build_app
from megaslide.server.worker import Fleet

from server_fakes import FakeBackend, live_server

ROOT = Path(__file__).resolve().parents[1]
PLAYGROUND = ROOT / "server" / "playground"
# The one absolute URL the page may hold: SVG's namespace, a name that is never fetched.
NAMESPACES = {"http://www.w3.org/2000/svg"}


def make_app(tmp_path: Path, backend: FakeBackend | None = None, **overrides):
    settings = Settings(data_dir=tmp_path / "data", sse_interval_s=0.02, **overrides)
    return build_app(settings, Fleet.embedded(settings, backend or FakeBackend()))


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
    for var in ("MEGASLIDE_API_KEYS", "MEGASLIDE_MODELS", "MEGASLIDE_PRESET"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def client(tmp_path):
    with TestClient(make_app(tmp_path)) as c:
        yield c


def test_the_page_and_every_module_it_imports_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    assert client.head("/").status_code == 200
    linked = set(re.findall(r'(?:src|href)="(assets/[^"]+)"', page.text))
    assert {"assets/main.js", "assets/style.css", "assets/icon.svg"} <= linked

    served, todo = set(), sorted(linked)
    while todo:  # follow the modules' imports from main.js down
        path = todo.pop()
        if path in served:
            continue
        served.add(path)
        r = client.get(f"/{path}")
        assert r.status_code == 200 and r.headers["cache-control"] == "no-cache", path
        if path.endswith(".js"):
            assert "javascript" in r.headers["content-type"], r.headers["content-type"]
            todo += [f"assets/{name}" for name in re.findall(r'from "\./([\w.-]+)"', r.text)]
    shipped = {f"assets/{p.name}" for p in (PLAYGROUND / "assets").iterdir()}
    assert served == shipped  # every module is reachable, and every file is used


def test_the_page_asks_nothing_of_other_origins():
    for path in PLAYGROUND.rglob("*"):
        if path.is_file():
            urls = set(
                re.findall(r"""(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s"'`)]*""", path.read_text())
            )
            assert urls <= NAMESPACES, f"{path.name} refers to {urls - NAMESPACES}"
    csp = re.search(
        r'http-equiv="Content-Security-Policy"\s+content="([^"]+)"',
        (PLAYGROUND / "index.html").read_text(),
    )
    assert csp and "default-src 'self'" in csp.group(1)


def test_the_page_is_package_data():
    """A non-editable install ships the page: pyproject's package-data globs, expanded as
    setuptools expands them (relative to the package's folder), cover every file of it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["megaslide.server"] == "server"
    globs = config["package-data"]["megaslide.server"]
    included = {p for pattern in globs for p in (ROOT / "server").glob(pattern) if p.is_file()}
    files = {p for p in PLAYGROUND.rglob("*") if p.is_file()}
    assert files and files <= included, sorted(str(p) for p in files - included)


def test_the_page_is_open_while_the_api_wants_a_key(tmp_path):
    with TestClient(make_app(tmp_path, api_keys=["sk-k"])) as c:
        assert c.get("/").status_code == 200 and c.get("/assets/main.js").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sk-k"}).status_code == 200


def test_unknown_paths_still_answer_the_error_envelope(client):
    for method, path in (("GET", "/assets/nope.js"), ("GET", "/nope"), ("POST", "/v1/nope")):
        r = client.request(method, path)
        assert r.status_code == 404, (method, path)
        assert r.json()["error"]["code"] == "unknown_url", r.json()


def test_models_say_what_a_request_may_give_them(client):
    """The page shows the first-frame field only for a model whose inputs list "image"."""
    assert [m["inputs"] for m in client.get("/v1/models").json()["data"]] == [["text"]]


def read_event(lines) -> dict:
    """The next event of an SSE stream as {"event", "data", "id"?}."""
    event = {}
    for line in lines:
        if not line:
            if event:
                return event
            continue
        if line.startswith(":"):
            continue  # a keep-alive comment
        name, _, value = line.partition(": ")
        event[name] = json.loads(value) if name == "data" else value
    raise AssertionError("the stream ended")


def test_events_tell_a_queued_video_its_place(tmp_path):
    backend = FakeBackend()
    with (
        live_server(make_app(tmp_path, backend)) as url,
        httpx.Client(base_url=url, timeout=10) as http,
    ):

        def create(steps: int) -> str:
            body = {"prompt": "a clip", "num_frames": 4, "size": "32x32"}
            r = http.post("/v1/videos", json={**body, "num_inference_steps": steps})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        backend.gate.clear()  # hold the worker inside the running video's first step
        running = create(50)
        deadline = time.monotonic() + 10
        while http.get(f"/v1/videos/{running}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Another step count: neither can join the running batch, so both wait, in order.
        first, second = create(2), create(2)
        with http.stream("GET", f"/v1/videos/{second}/events") as stream:
            lines = stream.iter_lines()
            queued = read_event(lines)
            assert queued["event"] == "video.queued" and queued["id"].isdigit()
            assert queued["data"]["queue_position"] == 2

            assert http.post(f"/v1/videos/{first}/cancel").json()["status"] == "cancelled"
            moved = read_event(lines)
            assert moved["event"] == "video.queue_position" and "id" not in moved
            assert moved["data"] == {
                "id": second,
                "object": "video",
                "status": "queued",
                "progress": 0,
                "step": 0,
                "queue_position": 1,
            }
            # A higher priority arrival goes ahead of it.
            ahead = http.post(
                "/v1/videos",
                json={"prompt": "urgent", "num_frames": 4, "size": "32x32", "priority": 5},
            ).json()["id"]
            assert read_event(lines)["data"]["queue_position"] == 2

            http.post(f"/v1/videos/{second}/cancel")
            assert read_event(lines)["event"] == "video.cancelled"
        backend.gate.set()
        for video_id in (ahead, running):
            http.delete(f"/v1/videos/{video_id}")


def test_the_create_form_has_a_field_for_every_file_a_model_may_take():
    """Each input a model card may list (VACE's and Animate's among them) has a file input in
    the Create form, named as the API names its upload, inside the container create.js shows
    when a model lists that input; every upload the API takes has one."""
    from html.parser import HTMLParser

    from megaslide.server.services.videos import UPLOADS

    from server_fakes import FAKE_CARD

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}
    script = (PLAYGROUND / "assets" / "create.js").read_text()
    listed = re.search(r"const FILE_INPUTS = \[(.*?)\n\];", script, re.S).group(1)
    file_inputs = re.findall(r'\["(\w+)", "#([\w-]+)", "(\w+)"\]', listed)

    class FileInputs(HTMLParser):
        """Each file input's name, with the ids of the elements around it."""

        def __init__(self):
            super().__init__()
            self.open: list[str | None] = []
            self.found: dict[str, set[str]] = {}

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "input" and a.get("type") == "file":
                self.found[a["name"]] = {i for i in [*self.open, a.get("id")] if i}
            if tag not in VOID:
                self.open.append(a.get("id"))

        def handle_endtag(self, tag):
            if tag not in VOID:
                self.open.pop()

    html = FileInputs()
    html.feed((PLAYGROUND / "index.html").read_text())
    for _, container, name in file_inputs:
        assert name in html.found, f"create.js names a form field {name!r} the page lacks"
        assert container in html.found[name], (name, container)
    every = dataclasses.replace(
        FAKE_CARD.limits, image_input=True, last_image_input=True, video_input=True
    )
    inputs = set(FAKE_CARD.replace(limits=every).inputs)
    inputs |= set(
        FAKE_CARD.replace(
            limits=dataclasses.replace(every, vace_input=True, animate_input=True)
        ).inputs
    )
    assert {i for i, _, _ in file_inputs} == inputs - {"text"}
    assert {n for _, _, n in file_inputs} == set(UPLOADS)
