"""Helpers of the HTTP API tests: requests, waits, the error envelope, metrics; training-set
uploads; images that declare huge frames."""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib

from server_fakes import until

TERMINAL = ("completed", "failed", "cancelled")
SMALL = {"num_frames": 4, "size": "32x32", "num_inference_steps": 2}


def create(client, **fields):
    body = {"prompt": "a red ball", **SMALL, **fields}
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(client, video_id, statuses=TERMINAL, timeout=10.0):
    return until(
        lambda: (v := client.get(f"/v1/videos/{video_id}").json())["status"] in statuses and v,
        timeout,
        f"{video_id} to reach {statuses}",
    )


def assert_error(r, status, param=None, fragment=None):
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if fragment is not None:
        assert fragment in err["message"], err
    return err


def scrape(text: str) -> dict[str, float]:
    """A Prometheus text exposition, parsed by prometheus-client: `name{labels}` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def dataset_zip(clips=2, extra: dict | None = None, wrap: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        lines = [json.dumps({"file": f"clips/{i}.mp4", "text": f"clip {i}"}) for i in range(clips)]
        zf.writestr(f"{wrap}metadata.jsonl", "\n".join(lines) + "\n")
        for i in range(clips):
            zf.writestr(f"{wrap}clips/{i}.mp4", b"not really a video")
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


def upload(c, data: bytes, name="data.zip", purpose="fine-tune", headers=None):
    return c.post(
        "/v1/files", data={"purpose": purpose}, files={"file": (name, data)}, headers=headers or {}
    )


def processed(c, f: dict) -> dict:
    """An upload once its validation is over: `processed`, or `error`."""
    return until(
        lambda: (x := c.get(f"/v1/files/{f['id']}").json())["status"] != "uploaded" and x,
        what=f"{f['id']} to be validated",
    )


def refused(c, archive: bytes, name: str = "data.zip") -> str:
    """Upload an archive that validation refuses; what the file's status_details say."""
    r = upload(c, archive, name)
    assert r.status_code == 200 and r.json()["status"] == "uploaded", r.text
    done = processed(c, r.json())
    assert done["status"] == "error" and done["clips"] == 0, done
    return done["status_details"]


def png_of_zeros(width: int, height: int) -> bytes:
    """A one-bit greyscale PNG of `width` x `height` zeros, compressed row by row: a few KB that
    declare a frame of width * height pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    row = bytes(1 + (width + 7) // 8)  # the filter byte, then the packed bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )
