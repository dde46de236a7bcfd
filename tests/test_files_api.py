"""`/v1/files`: uploads validated after they return, retried slow uploads stored once."""

from __future__ import annotations

import concurrent.futures
import io
import json
import tarfile
import threading
import warnings
import zipfile

with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
    warnings.simplefilter("ignore")


from api_helpers import assert_error, dataset_zip, processed, refused, upload
from server_fakes import FakeBackend


def test_file_upload_validation(make_client):
    c = make_client(max_upload_bytes=50_000)
    uploaded = upload(c, dataset_zip(wrap="mydata/")).json()  # one wrapping folder is looked into
    assert uploaded["status"] == "uploaded"  # answered before the archive is even unpacked
    f = processed(c, uploaded)
    assert (f["object"], f["purpose"], f["filename"]) == ("file", "fine-tune", "data.zip")
    assert (f["status"], f["clips"], f["status_details"]) == ("processed", 2, None)
    assert [x["id"] for x in c.get("/v1/files").json()["data"]] == [f["id"]]

    assert "'../evil.txt'" in refused(c, dataset_zip(extra={"../evil.txt": "x"}))
    assert "absolute" in refused(c, dataset_zip(extra={"/etc/passwd": "x"}))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        link = tarfile.TarInfo("data/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    assert "'data/link' is a link" in refused(c, buf.getvalue(), "d.tar.gz")
    bad_meta = io.BytesIO()
    with zipfile.ZipFile(bad_meta, "w") as zf:
        zf.writestr("metadata.jsonl", json.dumps({"file": "clips/missing.mp4", "text": "x"}) + "\n")
    assert "clips/missing.mp4" in refused(c, bad_meta.getvalue())
    assert "not a .zip" in refused(c, b"just some bytes")
    assert_error(upload(c, b"x" * 60_000), 413, "file")
    assert_error(upload(c, dataset_zip(), purpose="batch"), 400, "purpose")
    assert_error(
        c.post("/v1/files", data={"purpose": "fine-tune"}, files={"other": ("a", b"b")}),
        400,
        "file",
    )
    # Refused uploads stay listed, as errors, with nothing of them left on disk.
    statuses = [x["status"] for x in c.get("/v1/files").json()["data"]]
    assert statuses == ["error"] * 5 + ["processed"]
    files_dir = c.app.state.settings.data_dir / "files"
    assert [p.name for p in files_dir.iterdir()] == [f["id"]]
    refusal = c.get("/v1/files", params={"limit": 1}).json()["data"][0]["id"]
    job = {"model": "fake", "training_file": refusal}
    assert_error(c.post("/v1/fine_tuning/jobs", json=job), 400, "training_file", "failed valid")

    r1 = upload(c, dataset_zip(), headers={"Idempotency-Key": "u1"}).json()
    r2 = upload(c, dataset_zip(), headers={"Idempotency-Key": "u1"}).json()
    assert r1["id"] == r2["id"], (r1, r2)
    processed(c, r1)
    assert c.delete(f"/v1/files/{r1['id']}").json() == {
        "id": r1["id"],
        "object": "file",
        "deleted": True,
    }
    assert_error(c.get(f"/v1/files/{r1['id']}"), 404)


def test_a_slow_upload_retried_meanwhile_is_stored_once_and_validated_later(make_client):
    backend = FakeBackend()
    checking = threading.Event()
    check = backend.check_dataset

    def slow_check(root):
        checking.wait(10)  # validation takes as long as the test says
        return check(root)

    backend.check_dataset = slow_check
    c = make_client(backend)
    archive, key = dataset_zip(), {"Idempotency-Key": "slow-1"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: upload(c, archive, headers=key).json(), range(4)))
    assert len({a["id"] for a in answers}) == 1 and answers[0]["status"] == "uploaded"
    job = {"model": "fake", "training_file": answers[0]["id"]}
    assert_error(c.post("/v1/fine_tuning/jobs", json=job), 400, "training_file", "being valid")
    checking.set()
    assert processed(c, answers[0])["status"] == "processed"
    assert len(c.get("/v1/files").json()["data"]) == 1
    assert c.post("/v1/fine_tuning/jobs", json=job).status_code == 200
