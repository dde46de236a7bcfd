"""Does a 3D-DSA fine-tune recover what swapping dense attention for 3D-DSA loses?

    python benchmarks/wan_dsa_finetune.py --json

1. A tiny random Wan (tests/support/wan_fixtures.py) is trained, dense, on procedural world clips
   (engine/native/world.py, 17 frames of 128x128: a 5x8x8 token grid) until it has learned something.
2. That model is evaluated on held-out clips: the flow-matching loss (velocity MSE at fixed noise
   and times), dense, with 3D-DSA swapped in untrained (tile 1x2x2, window 3x3x3), and with 3D-DSA
   after `megaslide finetune --attention dsa` for `--dsa-steps` steps on the training clips.
3. A control continues the dense model for the same steps, so what the fine-tune gains can be
   told apart from what more training alone gives.

The gap is what the swap costs: loss(DSA untrained) - loss(dense). After the same number of
further steps, "recovered" = 1 - (loss(DSA fine-tuned) - loss(dense trained further)) / gap: 1
when the DSA model ends where the dense one does with the same training, 0 when the fine-tune
closes none of the swap's cost. The velocities' distance to the dense model's is reported too.

`--optimizer-state` names the optimizer state format of steps 2 and 3 (engine/training/
state_format.py; several, comma-separated, each fine-tune and control starting from the same
dense model, which always trains in fp32): a compact format is then measured by the cost it
recovers against its own control. Every run uses `--seed` (batch order, flow times, noise,
bf16-sr's rounding).

    python benchmarks/wan_dsa_finetune.py --optimizer-state fp32,bf16-sr/8bit --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' tiny Wan builder

from megaslide.engine.family import TrainingShape  # noqa: E402
from megaslide.engine.loader import open_model  # noqa: E402
from megaslide.engine.native.world import write_dataset  # noqa: E402
from megaslide.engine.sources import describe, resolve_source  # noqa: E402
from megaslide.engine.training.finetune import open_trainer  # noqa: E402
from megaslide.engine.training.finetune_spec import (  # noqa: E402
    ClipSpec,
    FinetuneSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
)
from megaslide.engine.wan.training import WanTrainingModel, latent_cache  # noqa: E402

from wan_fixtures import build_tiny_wan  # noqa: E402

SHAPE = dict(frames=17, height=128, width=128)
DSA = {"attention": "dsa", "dsa_tile": (1, 2, 2), "dsa_window": (3, 3, 3)}


def train(
    model: Path,
    data: Path,
    output: Path,
    steps: int,
    lr: float,
    attention: str | None = None,
    *,
    state: str = "fp32",
    seed: int = 0,
) -> tuple[Path, list]:
    spec = FinetuneSpec(
        run=RunSpec(output=str(output), save_every=10**6, attention=attention, seed=seed),
        schedule=ScheduleSpec(steps=steps),
        optimizer=OptimizerSpec(lr=lr, state=state),
        clips=ClipSpec(**SHAPE, batch_size=4, caption_dropout=0.0),
    )
    with open_trainer(model, data, spec) as t:
        losses = [t.train_step()["loss"] for _ in range(steps)]
        return t.export(), losses


@torch.no_grad()
def evaluate(model_dir: Path, held_out, overrides: dict, reference=None) -> dict:
    """Velocity MSE on held-out clips at fixed times and noise, and the distance of the velocity
    to `reference` (the dense model's) when given."""
    info = describe(resolve_source(model_dir), **overrides)
    parts, _ = open_model(info, dtype=torch.float32, only={"transformer"})
    model = WanTrainingModel("transformer", parts["transformer"].eval(), info.config, (0.0, 1.0))
    g = torch.Generator().manual_seed(123)
    losses, velocities = [], []
    for x0, emb in held_out:
        t = torch.rand(x0.shape[0], generator=g) * 0.9 + 0.05
        noise = torch.randn(x0.shape, generator=g)
        x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
        h, carried, static = model.prologue(x_t, t, emb)
        for i in range(len(model.blocks)):
            h = model.block(i, h, carried, static)
        v = model.epilogue(h, carried, static)
        losses.append(torch.nn.functional.mse_loss(v, noise - x0).item())
        velocities.append(v)
    out = {"loss": sum(losses) / len(losses), "velocities": velocities}
    if reference is not None:
        num = sum((a - b).square().sum() for a, b in zip(velocities, reference))
        den = sum(b.square().sum() for b in reference)
        out["velocity_relative_l2_to_dense"] = (num / den).sqrt().item()
    return out


def adapt(dense: Path, data: Path, work: Path, held_out, before, untrained, state, args) -> dict:
    """The 3D-DSA fine-tune of `dense` and its dense control, both in `state`, evaluated."""
    start = time.perf_counter()
    work = work / state.replace("/", "_")
    dsa, dsa_curve = train(
        dense, data, work / "dsa", args.dsa_steps, args.lr, "dsa", state=state, seed=args.seed
    )
    tuned = evaluate(dsa, held_out, DSA, before["velocities"])
    more, _ = train(
        dense, data, work / "more", args.dsa_steps, args.lr, state=state, seed=args.seed
    )
    control = evaluate(more, held_out, {}, before["velocities"])
    gap = untrained["loss"] - before["loss"]
    return {
        "held_out_loss": {"dsa_finetuned": tuned["loss"], "dense_trained_further": control["loss"]},
        "velocity_relative_l2_to_dense": {
            "dsa_finetuned": tuned["velocity_relative_l2_to_dense"],
            "dense_trained_further": control["velocity_relative_l2_to_dense"],
        },
        "recovered": 1 - (tuned["loss"] - control["loss"]) / gap if gap > 0 else None,
        "dsa_curve_every_25": dsa_curve[::25],
        "seconds": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=48)
    ap.add_argument("--dense-steps", type=int, default=300)
    ap.add_argument("--dsa-steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--optimizer-state",
        default="fp32",
        help="state format(s) of the fine-tune and its control, comma-separated (dense: fp32)",
    )
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    states = args.optimizer_state.split(",")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = build_tiny_wan(tmp / "base", layers=4)
        train_data = write_dataset(tmp / "train", args.clips, seed=0, **SHAPE)
        test_data = write_dataset(tmp / "test", 8, seed=99, **SHAPE)
        dense, dense_curve = train(
            base, train_data, tmp / "dense", args.dense_steps, args.lr, seed=args.seed
        )
        shape = TrainingShape(**SHAPE, batch_size=4)
        cache = latent_cache(describe(resolve_source(dense)), test_data, tmp / "eval", shape)
        held_out = []
        for start_i in range(0, len(cache), 4):
            idx = list(range(start_i, min(start_i + 4, len(cache))))
            x0 = torch.stack([cache.loader.dataset[i][0] for i in idx])
            emb = torch.stack([cache.embedding(str(i)) for i in idx])
            held_out.append((x0, emb))
        cache.close()
        before = evaluate(dense, held_out, {})
        untrained = evaluate(dense, held_out, DSA, before["velocities"])
        adapted = {
            state: adapt(dense, train_data, tmp, held_out, before, untrained, state, args)
            for state in states
        }
    result = {
        "clips": args.clips,
        "dense_steps": args.dense_steps,
        "dsa_steps": args.dsa_steps,
        "seed": args.seed,
        "token_grid": [5, 8, 8],
        "dsa_tile": list(DSA["dsa_tile"]),
        "dsa_window": list(DSA["dsa_window"]),
        "held_out_loss": {"dense": before["loss"], "dsa_untrained": untrained["loss"]},
        "velocity_relative_l2_to_dense": {
            "dsa_untrained": untrained["velocity_relative_l2_to_dense"]
        },
        "gap": untrained["loss"] - before["loss"],
        "dense_curve_every_25": dense_curve[::25],
        "optimizer_states": adapted,  # per format: its fine-tune, its control, what it recovers
        "seconds": time.perf_counter() - start,
    }
    print(json.dumps(result, indent=2) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
