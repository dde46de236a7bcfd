"""Make the README's pictures from the packaged default model, `megaslide-tiny`.

    python scripts/readme_pictures.py            # both, into docs/
    python scripts/readme_pictures.py --only strip

- `docs/megaslide-tiny.png`: frames of clips the model makes, one row per prompt (every other
  frame of 16, seed 0).
- `docs/playground-create.png`: the playground's Create tab in Chromium, against `megaslide serve`
  running that model: a finished clip playing in the queue, a long one denoising, two waiting.

Needs the `server` and `video` extras, Playwright for Python, and Chromium at /usr/bin/chromium
(Playwright drives it; it downloads no browser). A few minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

PROMPTS = [
    "a red circle moving right on a black background",
    "a blue square moving up on a black background",
    "a yellow triangle moving left on a black background",
    "a green circle moving down on a black background",
]
FRAMES_SHOWN = 8  # every other frame of 16
SCALE = 3  # pixels per clip pixel
LABEL_W = 330

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1280, "height": 860}
WAIT_MS = 120_000


def strip(out: Path) -> None:
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.request import VideoRequest

    pipe = open_pipeline()  # the packaged default model
    rows = []
    for prompt in PROMPTS:
        frames = pipe.generate(VideoRequest(prompt, seed=0))  # (F, H, W, 3)
        shown = frames[:: len(frames) // FRAMES_SHOWN]
        pad = ((2, 2), (2, 2), (0, 0))
        row_pixels = np.concatenate([np.pad(f, pad, constant_values=255) for f in shown], axis=1)
        image = Image.fromarray(row_pixels)
        image = image.resize((image.width * SCALE, image.height * SCALE), Image.NEAREST)
        row = Image.new("RGB", (LABEL_W + image.width, image.height), "white")
        ImageDraw.Draw(row).text((8, image.height // 2 - 6), prompt, fill="black")
        row.paste(image, (LABEL_W, 0))
        rows.append(row)
    sheet = Image.new("RGB", (rows[0].width, sum(r.height for r in rows)), "white")
    for i, row in enumerate(rows):
        sheet.paste(row, (0, i * row.height))
    sheet.save(out)
    print(f"wrote {out}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(data_dir: Path, port: int) -> subprocess.Popen:
    """`megaslide serve` with the packaged default model, ready."""
    import httpx

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASLIDE_")}
    env["OMP_NUM_THREADS"] = "1"  # the browser needs the other core
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "megaslide.cli", *args, "--log-level", "warning"], env=env
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("megaslide serve exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("megaslide serve did not become ready in 120 s")


def submit(page, prompt: str, *, frames: int, steps: int, side: int = 32):
    """Fill the Create form and generate; returns the new job's card."""
    page.fill("#create-prompt", prompt)
    page.fill("#create-width", str(side))
    page.fill("#create-height", str(side))
    page.fill("#create-frames", str(frames))
    page.fill("#create-steps", str(steps))
    page.fill("#create-seed", "0")
    before = page.locator("#queue-list .job").count()
    page.click("#generate")
    page.wait_for_function(
        f"() => document.querySelectorAll('#queue-list .job').length === {before + 1}"
    )
    video_id = page.locator("#queue-list .job").first.get_attribute("data-id")  # newest on top
    return page.locator(f"#queue-list .job[data-id='{video_id}']")


def playground(out: Path) -> None:
    from playwright.sync_api import sync_playwright

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = serve(Path(tmp) / "data", port)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport=VIEWPORT, base_url=f"http://127.0.0.1:{port}")
                page.set_default_timeout(WAIT_MS)
                page.goto("/#create")
                page.wait_for_selector("#create-model option", state="attached")
                done = submit(page, PROMPTS[0], frames=16, steps=20)
                page.wait_for_function(
                    "(card) => card.dataset.status === 'completed'", arg=done.element_handle()
                )
                clip = done.locator("video")
                clip.wait_for()
                # A frame from the middle of the clip, held still for the picture.
                clip.evaluate(
                    """(v) => new Promise((resolve) => {
                      const hold = () => { v.pause(); v.currentTime = v.duration / 2; };
                      v.addEventListener("seeked", resolve, { once: true });
                      if (v.readyState >= 2) hold(); else v.addEventListener("loadeddata", hold);
                    })"""
                )
                # A large clip keeps the worker busy while two more wait behind it.
                running = submit(page, PROMPTS[1], frames=32, steps=200, side=128)
                running.locator(".state").filter(has_text="step").wait_for()
                submit(page, PROMPTS[2], frames=16, steps=20)
                submit(page, PROMPTS[3], frames=16, steps=20)
                # Progress well under way: ten steps or more.
                running.locator(".state").filter(has_text=re.compile(r"step \d\d+ of")).wait_for()
                page.screenshot(path=str(out))
                print(f"wrote {out}")
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("strip", "playground"))
    ap.add_argument("--out", type=Path, default=DOCS, help="folder for the pictures (docs/)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "strip"):
        strip(args.out / "megaslide-tiny.png")
    if args.only in (None, "playground"):
        playground(args.out / "playground-create.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
