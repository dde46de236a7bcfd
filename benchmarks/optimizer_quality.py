"""Training quality of CPUAdamW's state formats: a tiny fine-tune per format and seed.

The task is shaped like a fine-tune: a "pretrained" MLP (128 -> 512 -> 512 -> 128, GELU, 0.4M
parameters, weights of typical scale ~0.04) is trained towards a teacher that differs from it
by a low-rank change of every matrix, on 2048 noisy samples, and scored on 1024 held-out ones.
As on the device, every format computes the forward and backward pass with the bf16 compute
copy of the weights (an fp32 master's `out=` copy, a bf16 master itself); only the optimizer's
storage differs. The learning rate (1e-4) is below half a bf16 spacing of most weights, the
regime where naive bf16 masters ("bf16/fp32", for reference) lose updates.

Reported per format: final train loss (mean of the last 20 steps) and held-out loss, per seed
and as mean and spread; the spread of the fp32 runs over seeds is the yardstick.

Usage: python benchmarks/optimizer_quality.py --json [--steps 300] [--seeds 0,1,2]
           [--states fp32,bf16-sr/8bit,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megaslide.engine.training.optim import CPUAdamW
from megaslide.engine.training.state_format import StateFormat

STATES = ["fp32", "fp32/8bit", "bf16-split/fp32", "bf16-split/8bit", "bf16-sr/fp32"]
STATES += ["bf16-sr/8bit", "bf16/fp32"]
WIDTHS = (128, 512, 512, 128)
TRAIN, HELD_OUT, BATCH, NOISE, RANK = 2048, 1024, 64, 0.01, 4


def pretrained(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights of the starting model, bf16-representable so every format starts equal."""
    w = {}
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        w[f"w{i}"] = (torch.randn(b, a, generator=gen) / a**0.5).bfloat16().float()
        w[f"b{i}"] = (0.01 * torch.randn(b, generator=gen)).bfloat16().float()
    return w


def forward(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    layers = len(WIDTHS) - 1
    for i in range(layers):
        x = F.linear(x, w[f"w{i}"], w[f"b{i}"])  # (B, WIDTHS[i + 1])
        if i < layers - 1:
            x = F.gelu(x)
    return x


def task(seed: int):
    """(start weights, train x, train y, held-out x, held-out y); the data seed is fixed so
    seeds vary the batch order only, as reruns of one fine-tune would."""
    gen = torch.Generator().manual_seed(1234)
    start = pretrained(gen)
    teacher = dict(start)
    for name, t in start.items():
        if t.ndim == 2:  # a low-rank change of every matrix: what the fine-tune must learn
            u = torch.randn(t.shape[0], RANK, generator=gen)
            v = torch.randn(RANK, t.shape[1], generator=gen)
            teacher[name] = t + 0.3 * (u @ v) / (RANK * t.shape[1]) ** 0.5
    x = torch.randn(TRAIN + HELD_OUT, WIDTHS[0], generator=gen)
    with torch.no_grad():
        y = forward(teacher, x) + NOISE * torch.randn(TRAIN + HELD_OUT, WIDTHS[-1], generator=gen)
    return start, x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def run(state: str, seed: int, steps: int, lr: float) -> dict:
    start, x, y, xh, yh = task(seed)
    fmt = StateFormat.parse(state)
    if fmt.master_is_compute_copy:
        master = {n: t.bfloat16() for n, t in start.items()}
        compute = master  # the bf16 master is the compute copy
    else:
        master = {n: t.clone() for n, t in start.items()}
        compute = {n: t.bfloat16() for n, t in start.items()}
    opt = CPUAdamW({0: master}, lr=lr, weight_decay=0.0, state=state, seed=seed, threads=1)
    order = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, TRAIN, (BATCH,), generator=order)
        w = {n: t.float().requires_grad_() for n, t in compute.items()}
        loss = F.mse_loss(forward(w, x[idx]), y[idx])
        loss.backward()
        losses.append(loss.item())
        grads = {n: t.grad for n, t in w.items()}
        opt.step({0: grads}, out=None if fmt.master_is_compute_copy else {0: compute})
    opt.close()
    with torch.no_grad():
        w = {n: t.float() for n, t in compute.items()}
        held_out = F.mse_loss(forward(w, xh), yh).item()
        initial = F.mse_loss(forward(start, xh), yh).item()
    return {
        "seed": seed,
        "train_loss": statistics.fmean(losses[-20:]),
        "held_out_loss": held_out,
        "held_out_loss_at_start": initial,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--states", default=",".join(STATES))
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results = {}
    for state in args.states.split(","):
        runs = [run(state, seed, args.steps, args.lr) for seed in seeds]
        summary = {}
        for key in ("train_loss", "held_out_loss"):
            values = [r[key] for r in runs]
            summary[key] = {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
            }
        results[state] = {
            "bytes_per_param": StateFormat.parse(state).bytes_per_param(),
            **summary,
            "runs": runs,
        }
    report = {
        "benchmark": "optimizer_quality",
        "torch": torch.__version__,
        "steps": args.steps,
        "lr": args.lr,
        "seeds": seeds,
        "params": sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:])),
        "seconds": time.perf_counter() - t0,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        start = next(iter(results.values()))["runs"][0]["held_out_loss_at_start"]
        print(f"held-out loss at start {start:.5f}; {args.steps} steps, seeds {seeds}")
        for state, r in results.items():
            tr, ho = r["train_loss"], r["held_out_loss"]
            print(
                f"{state:16} {r['bytes_per_param']:5.2f} B/param  "
                f"train {tr['mean']:.5f} [{tr['min']:.5f}, {tr['max']:.5f}]  "
                f"held-out {ho['mean']:.5f} [{ho['min']:.5f}, {ho['max']:.5f}]"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
