"""LoRA adapters through the server, the SDK and the CLI: registered at start with `--lora`, listed
on `/v1/models`, applied per request by `loras`, a bad name or file refused with the key named."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

from megaslide.server import Settings

from lora_fixtures import hostile_files, write_peft
from server_fakes import live_server, torch_app
from wan_fixtures import build_tiny_wan

pytest.importorskip("diffusers")
with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    model = build_tiny_wan(root / "wan", sampling={"steps": 2})
    adapter = write_peft(root / "style.safetensors", alpha=8)
    settings = Settings(
        data_dir=root / "data",
        models=[f"wan={model}"],
        loras=[f"style={adapter}"],
        device="cpu",
        poll_after_ms=50,
    )
    return {"app": torch_app(settings), "model": model, "adapter": adapter, "root": root}


def wait(client, video_id, timeout=60.0, headers=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = client.get(f"/v1/videos/{video_id}", headers=headers).json()
        if video["status"] in ("completed", "failed", "cancelled"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} did not finish")


def test_adapters_are_listed_applied_and_checked(served):
    with TestClient(served["app"]) as c:
        (model,) = c.get("/v1/models").json()["data"]
        (adapter,) = model["adapters"]
        assert (adapter["name"], adapter["rank"], adapter["base"]) == ("style", 4, "wan")
        assert adapter["bytes"] > 0
        ids = []
        for loras in ([{"name": "style", "scale": 0.8}], None):
            body = {"model": "wan", "prompt": "a red circle", "seed": 1}
            if loras:
                body["loras"] = loras
            v = c.post("/v1/videos", json=body)
            assert v.status_code == 200, v.text
            ids.append(v.json()["id"])
        videos = [wait(c, i) for i in ids]
        assert [v["status"] for v in videos] == ["completed", "completed"]
        assert videos[0]["loras"] == [{"name": "style", "scale": 0.8, "expert": None}]
        thumbs = [c.get(f"/v1/videos/{i}/content?variant=thumbnail").content for i in ids]
        assert thumbs[0] != thumbs[1]  # the adapter changed the clip

        unknown = c.post(
            "/v1/videos", json={"model": "wan", "prompt": "x", "loras": [{"name": "nope"}]}
        )
        assert unknown.status_code == 400, unknown.text
        assert unknown.json()["error"]["param"] == "loras"
        assert "no adapter named 'nope'" in unknown.json()["error"]["message"]
        bad = c.post(
            "/v1/videos",
            json={"model": "wan", "prompt": "x", "loras": [{"name": "style", "expert": "low"}]},
        )
        assert bad.status_code == 400 and "one denoiser" in bad.json()["error"]["message"]
        form = c.post(
            "/v1/videos",
            data={"model": "wan", "prompt": "x", "loras": '[{"name": "style", "scale": 0.5}]'},
        )
        assert form.status_code == 200, form.text
        assert form.json()["loras"] == [{"name": "style", "scale": 0.5, "expert": None}]
        assert wait(c, form.json()["id"])["status"] == "completed"


def test_sdk_sends_loras(served):
    from megaslide_client import Client

    # Over HTTP: the SDK's own httpx client, not the test client's (another HTTP library).
    with live_server(served["app"]) as url, Client(base_url=url, max_retries=0) as client:
        video = client.videos.create(prompt="a cat", model="wan", loras=[("style", 0.3)], seed=2)
        assert video.loras == [{"name": "style", "scale": 0.3, "expert": None}]
        assert client.videos.poll(video.id, max_wait=60).status == "completed"
        (model,) = client.models.list().data
        assert model.adapters[0]["name"] == "style"


def test_a_bad_adapter_is_refused_at_start_naming_the_key(served, tmp_path):
    from megaslide.engine.lora import AdapterError
    from megaslide.server.torch_backend import TorchBackend

    wrong = write_peft(tmp_path / "deep.safetensors", blocks=3)  # the model has two blocks
    settings = Settings(
        data_dir=tmp_path / "data", models=[f"wan={served['model']}"], loras=[f"deep={wrong}"]
    )
    with pytest.raises(AdapterError, match="blocks.2.attn1.to_k.lora_A.weight"):
        TorchBackend(settings)
    settings = Settings(
        data_dir=tmp_path / "data", models=[f"wan={served['model']}"], loras=[f"x:y={wrong}"]
    )
    with pytest.raises(ValueError, match="no served model is named 'x'"):
        TorchBackend(settings)


def test_a_server_on_several_devices_registers_its_adapters_on_every_rank(
    served, tmp_path, monkeypatch
):
    """`--lora` with `--devices`: taken, and registered on the model's rank group as it loads
    (tests/test_parallel_levers.py runs an adapter on real ranks)."""
    from megaslide.server import torch_backend

    class Group:  # records what the backend registers; starts no process
        def __init__(self, info, placement, **kwargs):
            self.placement, self.registered = placement, []

        def register_adapter(self, adapter, *, replace=False):
            self.registered.append(adapter.name)

    monkeypatch.setattr(torch_backend, "RankGroup", Group)
    settings = Settings(
        data_dir=tmp_path / "data",
        models=[f"wan={served['model']}"],
        loras=[f"style={served['adapter']}"],
        devices=["cpu", "cpu"],
    )
    backend = torch_backend.TorchBackend(settings)
    assert backend.takes_adapters
    (card,) = backend.cards()
    assert [a["name"] for a in card.adapters] == ["style"]
    group = backend.load(card)
    assert group.registered == ["style"] and group.placement.devices == ("cpu", "cpu")


def test_cli_generate_with_a_lora(served, tmp_path):
    from megaslide.cli.main import main

    args = ["generate", "a red circle", "--model", str(served["model"]), "--no-progress"]
    plain, styled = tmp_path / "plain.mp4", tmp_path / "styled.mp4"
    assert main([*args, "-o", str(plain)]) == 0
    lora = ["--lora", f"style={served['adapter']}", "--lora-scale", "style=0.9"]
    assert main([*args, "-o", str(styled), *lora]) == 0
    from megaslide.engine.video import read_video

    assert not np.array_equal(read_video(plain), read_video(styled))
    assert main([*args, "-o", str(tmp_path / "x.mp4"), "--lora-scale", "style=1"]) == 2
    wrong = write_peft(tmp_path / "deep.safetensors", blocks=3)
    assert main([*args, "-o", str(tmp_path / "x.mp4"), "--lora", f"deep={wrong}"]) == 2
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.slow
def test_cli_generate_with_a_lora_on_two_devices_writes_one_process_mp4(served, tmp_path):
    """`--lora` with `--devices`: each rank registers the adapter; one video split over two gloo
    processes encodes to the very bytes of one process's (tests/test_parallel_levers.py)."""
    from megaslide.cli.main import main

    args = ["generate", "a red circle", "--model", str(served["model"]), "--no-progress"]
    args += ["--lora", f"style={served['adapter']}", "--lora-scale", "style=0.9"]
    one, split = tmp_path / "one.mp4", tmp_path / "split.mp4"
    assert main([*args, "-o", str(one)]) == 0
    assert main([*args, "-o", str(split), "--devices", "cpu,cpu"]) == 0
    assert split.read_bytes() == one.read_bytes()


def test_cli_remote_generate_names_a_registered_adapter(served, tmp_path, capsys):
    from megaslide.cli.main import main

    out = tmp_path / "remote.mp4"
    with live_server(served["app"]) as url:
        args = ["generate", "a red circle", "--server", url, "--model", "wan", "--no-progress"]
        lora = ["--lora", "style", "--lora-scale", "style=0.5"]
        assert main([*args, "-o", str(out), *lora]) == 0
        assert out.stat().st_size > 100
        local = ["--lora", f"style={served['adapter']}"]  # a file is for local runs
        assert main([*args, "-o", str(tmp_path / "x.mp4"), *local]) == 2
        assert main([*args, "-o", str(tmp_path / "x.mp4"), "--lora", "nope"]) == 2
    err = capsys.readouterr().err
    assert "NAME=FILE is local" in err and "no adapter named 'nope'" in err


def wait_adapter(client, model, name, timeout=60.0, headers=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        adapter = client.get(f"/v1/adapters/{model}/{name}", headers=headers).json()
        if adapter["status"] != "uploaded":
            return adapter
        time.sleep(0.05)
    raise AssertionError(f"adapter {name} was not taken up")


def test_adapters_uploaded_over_the_api(served, tmp_path):
    good = write_peft(tmp_path / "up.safetensors", seed=11).read_bytes()
    deep = write_peft(tmp_path / "deep.safetensors", blocks=3).read_bytes()

    def upload(c, name, content, model="wan"):
        return c.post(
            "/v1/adapters",
            data={"model": model, "name": name},
            files={"file": (f"{name}.safetensors", content, "application/octet-stream")},
        )

    with TestClient(served["app"]) as c:
        answer = upload(c, "up", good)
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "uploaded"
        ready = wait_adapter(c, "wan", "up")
        assert (ready["status"], ready["rank"]) == ("ready", 4), ready
        v = c.post(
            "/v1/videos", json={"model": "wan", "prompt": "a cat", "loras": [{"name": "up"}]}
        )
        assert v.status_code == 200, v.text
        assert wait(c, v.json()["id"])["status"] == "completed"

        assert upload(c, "deep", deep).status_code == 200
        refused = wait_adapter(c, "wan", "deep")
        assert refused["status"] == "error"
        assert "blocks.2.attn1.to_k.lora_A.weight" in refused["status_details"]
        bad = c.post(
            "/v1/videos", json={"model": "wan", "prompt": "x", "loras": [{"name": "deep"}]}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "loras"

        junk = upload(c, "junk", b"not a safetensors file")
        assert junk.status_code == 400 and junk.json()["error"]["param"] == "file"
        assert upload(c, "up", good).status_code == 409
        assert upload(c, "style", good).status_code == 409  # registered at start
        assert upload(c, "x", good, model="nope").status_code == 404
        assert upload(c, "../x", good).status_code == 400
        listed = {a["id"]: a["status"] for a in c.get("/v1/adapters").json()["data"]}
        assert listed == {"style": "ready", "up": "ready", "deep": "error"}
        models = c.get("/v1/models").json()["data"]
        assert {a["name"] for a in models[0]["adapters"]} == {"style", "up"}


def test_sdk_uploads_an_adapter(served, tmp_path):
    from megaslide_client import Client

    file = write_peft(tmp_path / "sdk.safetensors", seed=12)
    with live_server(served["app"]) as url, Client(base_url=url, max_retries=0) as client:
        created = client.adapters.create(file=file, model="wan", name="sdk")
        assert created.status == "uploaded"
        ready = client.adapters.wait_until_ready("wan", "sdk", poll_interval_ms=50, max_wait=60)
        assert (ready.status, ready.rank, ready.model) == ("ready", 4, "wan")
        assert "sdk" in {a.id for a in client.adapters.list(model="wan")}
        assert client.adapters.delete("wan", "sdk").deleted
        assert "sdk" not in {a.id for a in client.adapters.list(model="wan")}


def test_an_uploaded_adapter_is_its_keys_and_can_be_deleted(served, tmp_path):
    """Ownership, replay and deletion: another key neither sees nor applies nor deletes an
    upload; a retried upload (same Idempotency-Key) gets the first answer, not a 409; deleting
    is refused while a queued or running video applies the adapter and for one registered at
    start; once deleted the workers unregister it and the name is free again."""
    settings = Settings(
        data_dir=tmp_path / "data",
        models=[f"wan={served['model']}"],
        loras=[f"style={served['adapter']}"],
        api_keys=["alice-key", "bob-key"],
        device="cpu",
        max_steps=400,
        poll_after_ms=50,
    )
    content = write_peft(tmp_path / "mine.safetensors", seed=13).read_bytes()
    alice = {"Authorization": "Bearer alice-key"}
    bob = {"Authorization": "Bearer bob-key"}

    def upload(c, headers):
        return c.post(
            "/v1/adapters",
            data={"model": "wan", "name": "mine"},
            files={"file": ("mine.safetensors", content, "application/octet-stream")},
            headers=headers,
        )

    def video(c, headers, **body):
        body = {"model": "wan", "prompt": "a cat", "loras": [{"name": "mine"}], **body}
        return c.post("/v1/videos", json=body, headers=headers)

    with TestClient(torch_app(settings)) as c:
        first = upload(c, {**alice, "Idempotency-Key": "up-1"})
        assert first.status_code == 200, first.text
        again = upload(c, {**alice, "Idempotency-Key": "up-1"})
        assert (again.status_code, again.json()) == (200, first.json())
        assert upload(c, alice).json()["error"]["code"] == "adapter_exists"
        ready = wait_adapter(c, "wan", "mine", headers=alice)
        assert (ready["status"], ready["owned_by"]) == ("ready", first.json()["owned_by"])

        def listed(headers):
            return {a["id"] for a in c.get("/v1/adapters", headers=headers).json()["data"]}

        assert listed(alice) == {"style", "mine"} and listed(bob) == {"style"}
        assert c.get("/v1/adapters/wan/mine", headers=bob).status_code == 404
        (model,) = c.get("/v1/models", headers=bob).json()["data"]
        assert [a["name"] for a in model["adapters"]] == ["style"]
        refused = video(c, bob)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "loras"
        assert c.delete("/v1/adapters/wan/mine", headers=bob).status_code == 404

        long = video(c, alice, num_inference_steps=400)
        assert long.status_code == 200, long.text
        busy = c.delete("/v1/adapters/wan/mine", headers=alice)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use"
        at_start = c.delete("/v1/adapters/wan/style", headers=alice)
        assert at_start.json()["error"]["code"] == "adapter_registered_at_start"
        c.post(f"/v1/videos/{long.json()['id']}/cancel", headers=alice)
        assert wait(c, long.json()["id"], headers=alice)["status"] == "cancelled"

        gone = c.delete("/v1/adapters/wan/mine", headers={**alice, "Idempotency-Key": "del-1"})
        assert gone.json() == {"id": "mine", "object": "adapter", "model": "wan", "deleted": True}
        retry = c.delete("/v1/adapters/wan/mine", headers={**alice, "Idempotency-Key": "del-1"})
        assert retry.json() == gone.json()
        assert c.get("/v1/adapters/wan/mine", headers=alice).status_code == 404
        until(lambda: "mine" not in adapter_names(c, alice))  # the worker unregistered it
        assert upload(c, bob).status_code == 200  # the name is free again
        assert wait_adapter(c, "wan", "mine", headers=bob)["status"] == "ready"


def adapter_names(c, headers) -> set[str]:
    (model,) = c.get("/v1/models", headers=headers).json()["data"]
    return {a["name"] for a in model["adapters"]}


def until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stored_upload_never_stops_the_worker(served, tmp_path):
    """Whatever a stored upload holds (these were written before the upload check refused
    them), the worker's scan turns it into that adapter's `error` with a reason that names no
    server path, keeps serving videos, takes up good uploads, and each can be deleted."""
    from megaslide.server.datadir import DataDir

    data = tmp_path / "data"
    folder = DataDir(data).adapters("wan")
    hostile = hostile_files(tmp_path)
    for name, (path, _) in hostile.items():
        partial = folder.partial(name)
        partial.write_bytes(path.read_bytes())
        folder.publish(name, partial, None, name)
    good = write_peft(tmp_path / "good.safetensors", seed=14).read_bytes()
    partial = folder.partial("damaged")
    partial.write_bytes(good)
    folder.publish("damaged", partial, None, "0" * 64)
    (folder.path / "damaged.json").write_text("[" * 100_000)  # its record, damaged
    settings = Settings(
        data_dir=data, models=[f"wan={served['model']}"], device="cpu", poll_after_ms=50
    )
    with TestClient(torch_app(settings)) as c:
        refused = {name: wait_adapter(c, "wan", name, timeout=30) for name in hostile}
        assert {n: a["status"] for n, a in refused.items()} == dict.fromkeys(hostile, "error")
        for name, adapter in refused.items():
            assert hostile[name][1] in adapter["status_details"], adapter
            assert str(tmp_path) not in adapter["status_details"], adapter

        plain = c.post("/v1/videos", json={"model": "wan", "prompt": "a cat", "seed": 1})
        assert wait(c, plain.json()["id"])["status"] == "completed"
        answer = c.post(
            "/v1/adapters",
            data={"model": "wan", "name": "good"},
            files={"file": ("good.safetensors", good, "application/octet-stream")},
        )
        assert answer.status_code == 200, answer.text
        assert wait_adapter(c, "wan", "good")["status"] == "ready"
        styled = c.post(
            "/v1/videos", json={"model": "wan", "prompt": "a cat", "loras": [{"name": "good"}]}
        )
        assert wait(c, styled.json()["id"])["status"] == "completed"
        assert wait_adapter(c, "wan", "damaged")["status"] == "ready"  # an owner-less upload
        for name in [*hostile, "damaged"]:
            assert c.delete(f"/v1/adapters/wan/{name}").status_code == 200, name
        assert {a["id"] for a in c.get("/v1/adapters").json()["data"]} == {"good"}


def upload_as(c, name, content, headers=None, model="wan"):
    return c.post(
        "/v1/adapters",
        data={"model": model, "name": name},
        files={"file": (f"{name}.safetensors", content, "application/octet-stream")},
        headers=headers,
    )


def test_the_upload_check_refuses_what_no_worker_could_use(served, tmp_path):
    """Checked at upload, without reading a tensor: the header's nesting depth, dtypes (factors
    float16, bfloat16 or float32), shapes (no empty factor, one-number alphas) and the metadata
    holding JSON. Each is a 400 naming no server path; nothing is stored."""
    import struct

    hostile = hostile_files(tmp_path)
    deep = b"[" * 200_000 + b"]" * 200_000
    files = {"deep_header": struct.pack("<Q", len(deep)) + deep}
    for name in (
        "meta_list",
        "deep_sampling",
        "original_alpha2",
        "original_alpha0",
        "musubi_alpha2",
        "musubi_alpha0",
        "rank0",
        "int_factors",
        "bool_factors",
        "fp8_factors",
    ):
        files[name] = hostile[name][0].read_bytes()

    def stored(c) -> set[str]:
        # What is stored, not how the workers (restarted with this client) list it meanwhile:
        # an adapter an earlier test stored moves from "uploaded" to "ready" as they take it up.
        return {a["id"] for a in c.get("/v1/adapters").json()["data"]}

    with TestClient(served["app"]) as c:
        before = stored(c)
        for name, content in files.items():
            answer = upload_as(c, name, content)
            assert answer.status_code == 400, (name, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "file" and str(served["root"]) not in error["message"]
        assert "nested too deeply" in upload_as(c, "x", files["deep_header"]).text
        assert stored(c) == before


def test_an_upload_can_be_deleted_while_no_worker_serves_its_model(make_client, tmp_path):
    """An upload that stopped the workers of an earlier version left no live worker serving its
    model: its owner still sees it and deletes it; another key does neither."""
    from megaslide.server.auth import digest
    from megaslide.server.datadir import DataDir
    from megaslide.server.protocol import adapter_id

    owner = f"key-{digest('alice-key')[:12]}"
    folder = DataDir(tmp_path / "data").adapters("wan")  # the fake worker serves no "wan"
    partial = folder.partial("x")
    partial.write_bytes(b"stored by an earlier version")
    folder.publish(adapter_id(owner, "x"), partial, owner, "0" * 64)
    c = make_client(api_keys=["alice-key", "bob-key"])
    alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
    assert c.get("/v1/adapters/wan/x", headers=bob).status_code == 404
    assert c.delete("/v1/adapters/wan/x", headers=bob).status_code == 404
    found = c.get("/v1/adapters/wan/x", headers=alice)
    assert (found.status_code, found.json()["status"]) == (200, "uploaded"), found.text
    assert [a["id"] for a in c.get("/v1/adapters", headers=alice).json()["data"]] == ["x"]
    gone = c.delete("/v1/adapters/wan/x", headers=alice)
    assert gone.json() == {"id": "x", "object": "adapter", "model": "wan", "deleted": True}
    assert folder.names() == []
    assert c.get("/v1/adapters", headers=alice).json()["data"] == []


def test_adapter_names_are_per_key_and_each_key_has_a_quota(served, tmp_path):
    """Two keys each upload an adapter `mine`: neither is refused nor told of the other's, and
    each key's requests apply its own. A key that is not an admin's keeps at most
    `max_adapters_per_key` adapters of `max_adapter_bytes_per_key` bytes (429)."""
    big = write_peft(tmp_path / "big.safetensors", seed=15).read_bytes()
    small = write_peft(tmp_path / "small.safetensors", seed=16, only=("attn1.to_q",)).read_bytes()
    settings = Settings(
        data_dir=tmp_path / "data",
        models=[f"wan={served['model']}"],
        loras=[f"style={served['adapter']}"],
        api_keys=["alice-key", "bob-key"],
        device="cpu",
        poll_after_ms=50,
        max_adapters_per_key=3,
        max_adapter_bytes_per_key=len(big) * 3 // 2,
    )
    alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
    with TestClient(torch_app(settings)) as c:
        assert upload_as(c, "mine", big, alice).status_code == 200
        theirs = upload_as(c, "mine", small, bob)
        assert theirs.status_code == 200, theirs.text
        assert theirs.json()["id"] == "mine"
        assert upload_as(c, "style", small, bob).json()["error"]["code"] == "adapter_exists"
        mine = {k: wait_adapter(c, "wan", "mine", headers=h) for k, h in (("a", alice), ("b", bob))}
        assert mine["a"]["status"] == mine["b"]["status"] == "ready"
        assert mine["a"]["bytes"] > mine["b"]["bytes"]  # each key sees its own
        for headers in (alice, bob):
            listed = c.get("/v1/adapters", headers=headers).json()["data"]
            assert sorted(a["id"] for a in listed) == ["mine", "style"]
            assert adapter_names(c, headers) == {"mine", "style"}

        ids = []
        for headers in (alice, bob):
            body = {"model": "wan", "prompt": "a cat", "seed": 3, "loras": [{"name": "mine"}]}
            v = c.post("/v1/videos", json=body, headers=headers)
            assert v.status_code == 200, v.text
            assert v.json()["loras"] == [{"name": "mine", "scale": 1.0, "expert": None}]
            ids.append(v.json()["id"])
        done = [wait(c, i, headers=h) for i, h in zip(ids, (alice, bob))]
        assert [v["status"] for v in done] == ["completed", "completed"]
        thumbs = [
            c.get(f"/v1/videos/{i}/content?variant=thumbnail", headers=h).content
            for i, h in zip(ids, (alice, bob))
        ]
        assert thumbs[0] != thumbs[1]  # each applied its own key's adapter

        over = upload_as(c, "big2", big, alice)  # 2 x big > 1.5 x big
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        assert "max_adapter_bytes_per_key" in over.json()["error"]["message"]
        assert upload_as(c, "small2", small, alice).status_code == 200
        assert upload_as(c, "small3", small, alice).status_code == 200
        full = upload_as(c, "small4", small, alice)
        assert full.status_code == 429 and "max_adapters_per_key=3" in full.text
        assert str(tmp_path) not in full.text
        assert upload_as(c, "small2", small, bob).status_code == 200  # bob's own share

        assert c.delete("/v1/adapters/wan/mine", headers=bob).status_code == 200
        assert c.get("/v1/adapters/wan/mine", headers=alice).json()["status"] == "ready"
        assert c.get("/v1/adapters/wan/mine", headers=bob).status_code == 404
