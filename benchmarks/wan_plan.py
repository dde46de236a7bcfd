"""What the planner says of the released Wan models on the machines people have.

    python benchmarks/wan_plan.py --json

Writes config-only directories of the published shapes (wan_shapes.py) and plans, for each case,
inference (480x832, 81 frames, the CFG pair in one batch) and fine-tuning of one expert: host
RAM, device memory, seconds per step and what bounds them, and the verdict. Machine figures are
the planner's defaults (55 GB/s host-to-device, 790 bf16 TFLOP/s for an H200) scaled for the
smaller cards as noted; every number is the planner's, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from wan_shapes import write  # noqa: E402

from megaslide.engine.planner import GB, Machine, Workload, format_plan, plan  # noqa: E402
from megaslide.engine.sources import describe, resolve_source  # noqa: E402

# (model, machine name, machine, GPU budget for weights in inference)
CARD_24GB = Machine(gpu_mem=24 * GB, host_mem=64 * GB, h2d_gbps=25, d2h_gbps=25, tflops=165)
CARD_48GB = Machine(gpu_mem=48 * GB, host_mem=256 * GB, h2d_gbps=25, d2h_gbps=25, tflops=360)
CASES = [
    ("wan2.1-t2v-14b", "24 GB GPU (PCIe 4), 64 GB RAM", CARD_24GB, 12 * GB),
    ("wan2.1-t2v-14b", "H200, 1.5 TB RAM", Machine(), None),
    ("wan2.2-t2v-a14b", "H200, 1.5 TB RAM", Machine(), 100 * GB),
    ("wan2.2-t2v-a14b", "24 GB GPU (PCIe 4), 64 GB RAM", CARD_24GB, 12 * GB),
    ("wan2.2-t2v-a14b", "48 GB GPU, 256 GB RAM", CARD_48GB, 36 * GB),
]
CARD_80GB = Machine(gpu_mem=80 * GB, host_mem=1.5e12, h2d_gbps=25, d2h_gbps=25, tflops=312)
FINETUNE = {  # each card with 1.5 TB of host RAM for the fp32 masters and AdamW moments
    "24 GB": Machine(**{**CARD_24GB.__dict__, "host_mem": 1.5e12}),
    "48 GB": Machine(**{**CARD_48GB.__dict__, "host_mem": 1.5e12}),
    "80 GB": CARD_80GB,
    "141 GB (H200)": Machine(),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        infos = {}
        for model, machine_name, machine, budget in CASES:
            if model not in infos:
                infos[model] = describe(resolve_source(write(model, Path(tmp) / model)))
            workload = Workload(gpu_budget=budget, frames=81, height=480, width=832)
            p = plan(infos[model], machine, workload)
            results.append({"model": model, "machine": machine_name, "mode": "infer", "plan": p})
        for model in ("wan2.1-t2v-14b", "wan2.2-t2v-a14b"):
            for name, machine in FINETUNE.items():
                workload = Workload(
                    mode="finetune", frames=81, height=480, width=832, expert="high"
                )
                p = plan(infos[model], machine, workload)
                machine_name = f"{name} GPU, 1.5 TB RAM"
                results.append(
                    {"model": model, "machine": machine_name, "mode": "finetune", "plan": p}
                )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"== {r['model']} on {r['machine']}")
            print(format_plan(r["plan"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
