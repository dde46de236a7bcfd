"""`--weights fp8` on Wan's conditioned tasks: how far a VACE or Animate clip moves when the
streamed blocks (VACE blocks and face adapters with them) keep their linear weights in fp8.

    python benchmarks/wan_conditioned_fp8.py --json

The tests' tiny random models (tests/support/wan_fixtures.py: a VACE model of three blocks, an
Animate model of two blocks and two face adapters) are built in a temporary folder with random
conditioning inputs (two reference images, a control video and a mask; a character image, pose
and face videos). Each clip is made in bf16 with every weight resident, in bf16 with the blocks
streamed from an fp8 host store, and in fp32 resident for scale; the PSNR of the frames (dB,
uint8) and the host store's bytes against the streamed blocks' raw bytes are reported.
Caution: random weights and a random VAE: the dB say how far fp8 moves this pipeline's output,
not how a real VACE or Animate model's pictures look; a tiny model's blocks hold many small
tensors kept raw (norms, biases), so its byte ratio is above a real model's (about a half).
CPU timings are not reported: they say nothing about the format.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' tiny Wan builder

from megaslide.engine.loader import open_pipeline  # noqa: E402
from megaslide.engine.request import VideoRequest  # noqa: E402
from megaslide.engine.video import write_mp4  # noqa: E402

from wan_fixtures import FACE_SIZE, NEGATIVE, PROMPT, build_tiny_wan  # noqa: E402


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def inputs(root: Path) -> dict[str, dict]:
    """The two models and each one's conditioning fields of a request."""
    from PIL import Image

    rng = np.random.default_rng(0)

    def noise(*shape):
        return (rng.random(shape) * 255).astype(np.uint8)

    for name, shape in (("ref0.png", (40, 48, 3)), ("ref1.png", (24, 40, 3))):
        Image.fromarray(noise(*shape)).save(root / name)
    write_mp4(root / "control.mp4", noise(12, 32, 32, 3), fps=8)
    mask = np.zeros((12, 32, 32, 3), np.uint8)
    mask[:, :, 16:] = 255
    mask[6:] = 255
    write_mp4(root / "mask.mp4", mask, fps=8)
    write_mp4(root / "pose.mp4", noise(12, 32, 32, 3), fps=8)
    write_mp4(root / "face.mp4", noise(12, 2 * FACE_SIZE, 2 * FACE_SIZE, 3), fps=8)
    return {
        "vace": dict(
            model=build_tiny_wan(root / "vace", vace=True, layers=3),
            fields=dict(
                reference_images=(str(root / "ref0.png"), str(root / "ref1.png")),
                control_video=str(root / "control.mp4"),
                mask=str(root / "mask.mp4"),
                conditioning_scale=0.7,
            ),
        ),
        "animate": dict(
            model=build_tiny_wan(root / "animate", animate=True, layers=2),
            fields=dict(
                image=str(root / "ref0.png"),
                pose_video=str(root / "pose.mp4"),
                face_video=str(root / "face.mp4"),
            ),
        ),
    }


def measure(model: Path, fields: dict, steps: int) -> dict:
    clip = VideoRequest(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=32,
        width=32,
        frames=9,
        steps=steps,
        guidance=4.0,
        seed=3,
        **fields,
    )
    bf16 = open_pipeline(model, dtype="bfloat16").generate(clip)
    fp32 = open_pipeline(model).generate(clip)
    pipe = open_pipeline(model, dtype="bfloat16", offload="stream", weights="fp8")
    fp8 = pipe.generate(clip)
    stats = pipe.stats()["transformer"]
    return {
        "steps": steps,
        "fp8_vs_bf16_db": round(psnr(fp8, bf16), 2),
        "bf16_vs_fp32_db": round(psnr(bf16, fp32), 2),
        "fp8_max_levels_from_bf16": int(np.abs(fp8.astype(int) - bf16.astype(int)).max()),
        "streamed_blocks": stats["streamed_blocks"],
        "host_store_over_raw": round(stats["host_store_bytes"] / stats["streamed_block_bytes"], 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    with tempfile.TemporaryDirectory() as folder:
        tasks = inputs(Path(folder))
        rows = [
            {"task": task, **measure(t["model"], t["fields"], steps)}
            for task, t in tasks.items()
            for steps in args.steps
        ]
    if args.json:
        print(json.dumps({"device": "cpu", "rows": rows}))
    else:
        for r in rows:
            print(
                f"{r['task']:8s} {r['steps']} steps: fp8 {r['fp8_vs_bf16_db']:.1f} dB from bf16 "
                f"(bf16 {r['bf16_vs_fp32_db']:.1f} dB from fp32), store "
                f"{r['host_store_over_raw']:.2f} of raw"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
