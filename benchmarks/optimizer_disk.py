"""The optimizer's disk tier against its RAM tier: seconds per optimizer step, and the disk's.

Each state format runs the same blocks (~32M parameters each, model-like 4M-element tensors)
with the same gradients on both tiers, blocks stepped last first as the trainer steps them,
rounds interleaved (RAM, disk, RAM, ...) so that load from other processes hits both alike; the
median round is reported. Per format: the step time of each tier, their ratio, the bytes the
disk tier read and wrote per step (its whole state, each way once), the GB/s that makes, and the
RAM its ring holds against the state's size.

Caution: the files go through the page cache. While the state fits in free RAM the reads are
served from it and this measures the ring's overhead, not the disk; the disk itself bounds the
step only once the state is larger than the RAM left for the cache (or with a cold cache: drop
it between rounds, as root, with `--drop-caches`). `megaslide plan --optimizer-state-tier disk
--disk-gbps X` predicts that case.

Usage: python benchmarks/optimizer_disk.py --json [--size 200e6] [--rounds 5] [--dir /nvme/tmp]
           [--states fp32,bf16-sr/8bit] [--depth 3] [--drop-caches]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from optimizer import group_blocks, make_params

from megaslide.engine.training.optim import CPUAdamW
from megaslide.engine.training.state_format import StateFormat


def drop_caches() -> None:
    """Write back and drop the page cache (root only): the next reads come from the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def bench_state(state, params, grads, rounds, directory, depth, drop) -> dict:
    fmt = StateFormat.parse(state)
    dtype = torch.bfloat16 if fmt.master_is_compute_copy else torch.float32
    g_blocks = group_blocks(grads)
    order = list(reversed(g_blocks))
    opts = {}
    for tier in ("ram", "disk"):
        blocks = group_blocks([p.to(dtype, copy=True) for p in params])
        disk = (
            dict(state_dir=os.path.join(directory, state.replace("/", "-")))
            if tier == "disk"
            else {}
        )
        opts[tier] = CPUAdamW(
            blocks,
            lr=1e-4,
            weight_decay=0.01,
            state=state,
            state_tier=tier,
            ring_depth=depth,
            **disk,
        )

    def step(opt):
        for bid in order:
            opt.step_block(bid, g_blocks[bid])
        if opt._disk is not None:
            opt._disk.flush()  # the step's writes are in the files (the page cache) before it ends

    for opt in opts.values():
        step(opt)  # warm-up: faults the state's pages in
    times = {tier: [] for tier in opts}
    ring = opts["disk"]._disk
    read0, written0 = ring.bytes_read, ring.bytes_written
    for _ in range(rounds):
        for tier, opt in opts.items():
            if drop and tier == "disk":
                drop_caches()
            t0 = time.perf_counter()
            step(opt)
            times[tier].append(time.perf_counter() - t0)
    med = {tier: statistics.median(t) for tier, t in times.items()}
    moved = (ring.bytes_read - read0 + ring.bytes_written - written0) / rounds
    out = {
        "ram_step_s": med["ram"],
        "disk_step_s": med["disk"],
        "disk_over_ram": med["disk"] / med["ram"],
        "disk_bytes_per_step": moved,
        "disk_gbps": moved / med["disk"] / 1e9,
        "ring_bytes": ring.ring_nbytes,
        "state_file_bytes": ring.file_nbytes,
        "update_path": opts["ram"].update_path,
    }
    for opt in opts.values():
        opt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--size", default="200e6", help="parameters")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the state files go (default: a temp dir)")
    ap.add_argument("--states", default="fp32,bf16-split/8bit,bf16-sr/8bit")
    ap.add_argument("--depth", type=int, default=3, help="ring buffers (default: 3)")
    ap.add_argument("--drop-caches", action="store_true", help="cold page cache (root)")
    args = ap.parse_args(argv)
    params, grads = make_params(int(float(args.size)))
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        results = {
            s: bench_state(s, params, grads, args.rounds, directory, args.depth, args.drop_caches)
            for s in args.states.split(",")
            if s
        }
    report = {
        "benchmark": "cpu_adamw_disk_tier",
        "params": sum(p.numel() for p in params),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),  # other processes on the machine skew the figures
        "cold_cache": args.drop_caches,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for state, r in results.items():
            print(
                f"{state:16} ram {r['ram_step_s']:.3f} s, disk {r['disk_step_s']:.3f} s "
                f"(x{r['disk_over_ram']:.2f}), {r['disk_bytes_per_step'] / 1e9:.2f} GB moved a "
                f"step at {r['disk_gbps']:.2f} GB/s, ring {r['ring_bytes'] / 1e9:.2f} GB of "
                f"{r['state_file_bytes'] / 1e9:.2f} GB state"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
