"""The streaming protocol's scenarios, streamed against resident: a correctness check for CUDA.

    python benchmarks/stream_protocol.py --json                 # CUDA, real streams, small preset
    python benchmarks/stream_protocol.py --device cpu --json    # the same code paths on the CPU

Each scenario runs a model streamed (copy stream, events, slot ring, gradient drain) and the same
model resident, and compares the outputs: in fp32 bitwise, unless two resident runs already differ
(then within a few times that spread, see `compare`); in bf16 as closely as bf16 agrees with
fp32. A missing wait shows up as garbage (another block's weights, unfinished copies), far
outside either bound.
The scenarios:

- `prefetch1`, `prefetch2`, `prefetch3`: sampling with every block streamed through 1, 2, 3 slots;
- `budget`: partial residency, one block resident under a device budget, the rest streamed;
- `cfg-batch`: two guided requests in one batch (both halves of both guidance pairs per forward);
- `step-batch`: requests at different denoising steps in one batch;
- `reload`: `load_weights` between requests while cyclic prefetch has copies in flight;
- `lossless`: sampling with the host stores coded (`weights="lossless"`): payloads copied into
  staging buffers and decoded into the slots on the compute stream (the Triton kernel on CUDA);
- `training`: a full-parameter step (forward, reverse recompute with `handle.manual`, gradients
  drained into two pinned buffers, the CPU optimizer writing a block's master while the next block
  is copied), against the same step with every block resident;
- `remove`: `remove()` right after a prefetch that nothing waited for.

tests/test_stream_protocol.py runs the same functions on a simulated device (a `Probe` that
watches them), with hundreds of random interleavings each and a race detector.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.native.checkpoint import save_model
from megaslide.engine.native.config import PRESETS, DiTConfig, SamplingDefaults, TextEncoderConfig
from megaslide.engine.native.dit import VideoDiT
from megaslide.engine.native.family import DiTTrainingModel
from megaslide.engine.native.text import BuiltinTextEncoder
from megaslide.engine.request import VideoRequest
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.streaming.host_store import layout_nbytes
from megaslide.engine.streaming.streamer import stream_module
from megaslide.engine.training.blockwise import (
    NON_BLOCK,
    BlockwiseStep,
    StepConfig,
    master_state_dicts,
)
from megaslide.engine.training.finetune_spec import OptimizerSpec

# A model small enough for hundreds of simulated runs per scenario in seconds: four blocks, so a
# ring of up to three slots is always refilled.
MICRO = DiTConfig(
    dim=32,
    depth=4,
    heads=2,
    ffn_dim=64,
    text=TextEncoderConfig(dim=32, layers=1, heads=2, max_len=32),
    max_frames=8,
    max_size=64,
)


class Probe:
    """What a scenario tells whoever watches it; this one watches nothing (real streams)."""

    def ordering(self):
        """The ordering to stream with (None: the device's own)."""
        return None

    def opened(self, handle, blocks) -> None:
        """A module was streamed: `handle` over `blocks`."""

    def training(self, step: BlockwiseStep) -> None:
        """A training step was opened over a streamed model."""

    def round(self, r: int) -> None:
        """Round `r` of a scenario starts."""

    def at(self, where: str) -> None:
        """The work described by `where` (e.g. "denoising step 2") is issued next."""


def write_model(path: Path, preset: str | None = None) -> Path:
    """A model directory with random weights (`preset`, or the micro model) whose zero-initialised
    layers are randomised too: a fresh model predicts zero, which would make comparisons trivial."""
    torch.manual_seed(0)
    config = PRESETS[preset].model if preset else MICRO
    sampling = PRESETS[preset].sampling if preset else SamplingDefaults()
    dit, text = VideoDiT(config), BuiltinTextEncoder(config.text)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in [*dit.parameters(), *text.parameters()]:
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return save_model(path, dit, text, sampling)


# ------------------------------------------------------------------------------------------------
# Sampling scenarios


def _requests(batch: str, clip: tuple[int, int, int]) -> list[tuple[int, VideoRequest]]:
    """(denoising step at which the request joins the batch, request)."""
    frames, height, width = clip
    shape = dict(frames=frames, height=height, width=width)
    # One forward per request step: a round is one or two forwards, and the slot ring carries
    # over from round to round, as from step to step.
    if batch == "single":
        return [(0, VideoRequest("a red circle moving left", steps=1, seed=1, **shape))]
    if batch == "cfg":
        return [
            (0, VideoRequest("a red circle moving left", steps=1, seed=1, **shape)),
            (0, VideoRequest("a blue square", steps=1, seed=2, guidance=2.0, **shape)),
        ]
    if batch == "steps":  # the second joins one step later, unguided
        return [
            (0, VideoRequest("a red circle moving left", steps=2, seed=1, **shape)),
            (1, VideoRequest("a blue square", steps=1, seed=2, guidance=1.0, **shape)),
        ]
    raise ValueError(f"unknown batch {batch!r}")


def sample(pipe, batch: str, clip, probe: Probe, label: str = "") -> torch.Tensor:
    """Every request of `batch` to its end, stepped together; their final latents, concatenated."""
    pending = _requests(batch, clip)
    states, step = [], 0
    while pending or not all(s.done for s in states):
        states += [pipe.prepare(pipe.resolve(r)) for k, r in pending if k == step]
        pending = [(k, r) for k, r in pending if k != step]
        probe.at(f"{label}denoising step {step}")
        pipe.denoise_step(states)
        step += 1
    return torch.cat([s.latents.float().cpu() for s in states])


def _budget(model: Path, dtype: torch.dtype, prefetch: int, resident: int) -> int:
    """A device budget with room for `prefetch` slots and `resident` resident blocks."""
    config = describe(resolve_source(model)).config
    with torch.device("meta"):
        dit = VideoDiT(config).to(dtype)
    block = layout_nbytes(dit.blocks[0])
    inside = {id(t) for b in dit.blocks for t in [*b.parameters(), *b.buffers()]}
    outside = sum(
        t.numel() * t.element_size()
        for t in [*dit.parameters(), *dit.buffers()]
        if id(t) not in inside
    )
    return outside + (prefetch + resident) * block


def inference(
    model,
    device,
    dtype,
    probe,
    rounds,
    clip,
    *,
    prefetch=2,
    budget=None,
    batch="single",
    weights="raw",
):
    """Outputs of `rounds` streamed runs of `batch` (see `_requests`), host stores in `weights`."""
    budget_bytes = _budget(model, dtype, prefetch, budget) if budget is not None else None
    pipe = open_pipeline(
        model,
        device=device,
        dtype=dtype,
        offload="stream",
        prefetch=prefetch,
        gpu_budget_bytes=budget_bytes,
        ordering=probe.ordering(),
        weights=weights,
    )
    handle = pipe.handles["dit"]
    if budget is not None and handle.stats()["resident_blocks"] != budget:
        raise RuntimeError(f"the budget should keep {budget} block(s) resident: {handle.stats()}")
    probe.opened(handle, pipe.dit.blocks)
    outputs = []
    for r in range(rounds):
        probe.round(r)
        outputs.append(sample(pipe, batch, clip, probe, f"round {r}, "))
    pipe.close()
    return outputs


def resident_inference(model, device, dtype, clip, batch="single") -> list[torch.Tensor]:
    """Two resident runs of `batch`: the reference and its run-to-run spread."""
    pipe = open_pipeline(model, device=device, dtype=dtype)
    return [sample(pipe, batch, clip, Probe()) for _ in range(2)]


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v * 1.25 if v.is_floating_point() else v for k, v in state.items()}


def reload(model, device, dtype, probe, rounds, clip, *, prefetch=2):
    """Per round: weights A, a request, weights B, a request; with cyclic prefetch, copies of the
    next forward's first blocks are in flight whenever `load_weights` runs."""
    pipe = open_pipeline(
        model,
        device=device,
        dtype=dtype,
        offload="stream",
        prefetch=prefetch,
        ordering=probe.ordering(),
    )
    handle = pipe.handles["dit"]
    probe.opened(handle, pipe.dit.blocks)
    handle.set_order("forward", cyclic=True)
    weights_a = {k: v.clone() for k, v in _state(pipe.dit).items()}
    weights_b = _perturbed(weights_a)
    outputs = []
    for r in range(rounds):
        probe.round(r)
        probe.at(f"round {r}, loading weights A")
        handle.load_weights(weights_a)
        a = sample(pipe, "single", clip, probe, f"round {r}, weights A, ")
        probe.at(f"round {r}, loading weights B")
        handle.load_weights(weights_b)
        b = sample(pipe, "single", clip, probe, f"round {r}, weights B, ")
        outputs.append(torch.cat([a, b]))
    pipe.close()
    return outputs


def resident_reload(model, device, dtype, clip) -> list[torch.Tensor]:
    pipe = open_pipeline(model, device=device, dtype=dtype)
    weights_a = {k: v.clone() for k, v in pipe.dit.state_dict().items()}
    runs = []
    for _ in range(2):
        pipe.dit.load_state_dict(weights_a)
        a = sample(pipe, "single", clip, Probe())
        pipe.dit.load_state_dict(_perturbed(weights_a))
        runs.append(torch.cat([a, sample(pipe, "single", clip, Probe())]))
    return runs


def _state(dit) -> dict[str, torch.Tensor]:
    """A streamed DiT's state dict on the host (block tensors point at their host stores)."""
    return {k: v.detach().cpu() for k, v in dit.state_dict().items()}


def remove(model, device, dtype, probe, rounds, clip, *, prefetch=2):
    """Per round: stream the resident DiT, take one denoising step, prefetch blocks 0 and 1 (copies
    nothing waits for), `remove()`; output, then the weights, against the resident run."""
    pipe = open_pipeline(model, device=device, dtype=dtype)
    before = {k: v.clone() for k, v in pipe.dit.state_dict().items()}
    ordering = probe.ordering()  # one copy stream serves every handle in turn
    outputs = []
    for r in range(rounds):
        probe.round(r)
        handle = stream_module(
            pipe.dit, pipe.dit.blocks, device, prefetch=prefetch, ordering=ordering
        )
        probe.opened(handle, pipe.dit.blocks)
        state = pipe.prepare(pipe.resolve(_requests("single", clip)[0][1]))
        probe.at(f"round {r}, denoising step 0")
        pipe.denoise_step([state])
        probe.at(f"round {r}, prefetch and remove")
        handle.prefetch([0, 1])
        handle.remove()
        after = pipe.dit.state_dict()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        if changed:
            raise AssertionError(f"remove() changed {changed[:4]}")
        outputs.append(state.latents.float().cpu())
    return outputs


def resident_remove(model, device, dtype, clip) -> list[torch.Tensor]:
    pipe = open_pipeline(model, device=device, dtype=dtype)
    runs = []
    for _ in range(2):
        state = pipe.prepare(pipe.resolve(_requests("single", clip)[0][1]))
        pipe.denoise_step([state])
        runs.append(state.latents.float().cpu())
    return runs


# ------------------------------------------------------------------------------------------------
# Training


def _x0(clip) -> torch.Tensor:
    frames, height, width = clip
    return torch.randn(2, 3, frames, height, width, generator=torch.Generator().manual_seed(0))


PROMPTS = ["a red circle moving left", "a blue square"]


def _open_step(model, device, offload, prefetch, autocast, ordering=None):
    parts, handles = open_model(
        describe(resolve_source(model)),
        device=device,
        dtype=torch.float32,
        offload=offload,
        prefetch=prefetch,
        ordering=ordering,
    )
    optimizer = OptimizerSpec(lr=1e-3, weight_decay=0.01)
    config = StepConfig(optimizer=optimizer, offload=offload, autocast=autocast)
    model = DiTTrainingModel(parts["dit"].train(), parts["text_encoder"].train())
    return BlockwiseStep(model, device, config, handles.get("dit"))


def _masters(step: BlockwiseStep) -> tuple[dict, dict]:
    states = master_state_dicts(step)
    return states["dit"], states["text_encoder"]


def _snapshot(step: BlockwiseStep) -> tuple:
    dit_sd, text_sd = _masters(step)
    opt = step.optimizer.state_dict()
    opt_copy = {
        **opt,
        "m": {b: {n: t.clone() for n, t in d.items()} for b, d in opt["m"].items()},
        "v": {b: {n: t.clone() for n, t in d.items()} for b, d in opt["v"].items()},
    }
    clone = lambda sd: {k: v.clone() for k, v in sd.items()}  # noqa: E731
    return clone(dit_sd), clone(text_sd), opt_copy


def _restore(step: BlockwiseStep, snapshot: tuple) -> None:
    """Back to the weights and optimizer state of `snapshot`: on the device, in the host
    masters and in AdamW's m and v."""
    dit_sd, text_sd, opt = snapshot
    if step.handle is not None:
        step.handle.load_weights(dit_sd, strict=False)
    else:
        step.model.dit.load_state_dict(dit_sd, strict=False)
    step.model.text_encoder.load_state_dict(text_sd, strict=False)
    with torch.no_grad():
        for name, master in step.masters[NON_BLOCK].items():
            prefix, _, rest = name.partition(".")
            master.copy_((dit_sd if prefix == "dit" else text_sd)[rest])
        if step.handle is None:
            for i in range(len(step.model.blocks)):
                for name, master in step.masters[i].items():
                    master.copy_(dit_sd[f"blocks.{i}.{name}"])
    step.optimizer.load_state_dict(opt)
    step.micro = 0


def _train_rounds(step, probe, rounds, clip) -> list[dict[str, torch.Tensor]]:
    """Per round: one step from the same start; the masters and AdamW's first moments after it,
    flattened. The moments are (1 - beta1) x the gradients; the masters alone would hide them, as
    AdamW's first update is lr x the gradient's sign wherever it is not zero."""
    start = _snapshot(step)
    outputs = []
    for r in range(rounds):
        probe.round(r)
        if r:
            probe.at(f"round {r}, restoring the start")
            _restore(step, start)
        probe.at(f"round {r}, training step")
        step.micro_step(_x0(clip), PROMPTS, torch.Generator().manual_seed(0))
        dit_sd, text_sd = _masters(step)
        moments = step.optimizer.state_dict()["m"]
        outputs.append(
            {
                "masters": _flat([*dit_sd.values(), *text_sd.values()]),
                "moments": _flat(
                    [t for b in sorted(moments, key=str) for t in moments[b].values()]
                ),
            }
        )
    return outputs


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def training(model, device, dtype, probe, rounds, clip, *, prefetch=2):
    autocast = None if dtype == torch.float32 else dtype
    step = _open_step(model, device, "stream", prefetch, autocast, probe.ordering())
    probe.opened(step.handle, step.model.blocks)
    probe.training(step)
    try:
        return _train_rounds(step, probe, rounds, clip)
    finally:
        step.close()


def resident_training(model, device, dtype, clip, rounds=2) -> list[torch.Tensor]:
    autocast = None if dtype == torch.float32 else dtype
    step = _open_step(model, device, "none", 2, autocast)
    try:
        return _train_rounds(step, Probe(), rounds, clip)
    finally:
        step.close()


# ------------------------------------------------------------------------------------------------
# The table of scenarios and the comparison


def _scenario(run: Callable, resident: Callable, **options):
    return run, resident, options


SCENARIOS = {
    "prefetch1": _scenario(inference, resident_inference, prefetch=1),
    "prefetch2": _scenario(inference, resident_inference, prefetch=2),
    "prefetch3": _scenario(inference, resident_inference, prefetch=3),
    "budget": _scenario(inference, resident_inference, prefetch=2, budget=1),
    "cfg-batch": _scenario(inference, resident_inference, batch="cfg"),
    "step-batch": _scenario(inference, resident_inference, batch="steps"),
    "reload": _scenario(reload, resident_reload),
    "lossless": _scenario(inference, resident_inference, prefetch=2, weights="lossless"),
    "training": _scenario(training, resident_training),
    "remove": _scenario(remove, resident_remove),
}


def reference(name: str, model, device, dtype, clip, cache=None) -> list[torch.Tensor]:
    """Two resident runs of scenario `name` (the reference and its run-to-run spread); `cache`
    (a dict) shares them between scenarios that sample the same requests."""
    _, resident, options = SCENARIOS[name]
    kept = {k: v for k, v in options.items() if k == "batch"}
    key = (resident, kept.get("batch"), dtype)
    if cache is None or key not in cache:
        runs = resident(model, device, dtype, clip, **kept)
        if cache is None:
            return runs
        cache[key] = runs
    return cache[key]


def run(name: str, model, device, dtype, probe: Probe, rounds: int, clip) -> list[torch.Tensor]:
    """`rounds` streamed runs of scenario `name`."""
    scenario, _, options = SCENARIOS[name]
    return scenario(model, device, dtype, probe, rounds, clip, **options)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# fp32 outputs may differ from the resident run by SPREAD_FACTOR times what two resident runs
# differ by (kernels that accumulate with atomics, e.g. some attention backwards on CUDA, are not
# run-to-run bitwise); where those agree bitwise, so must the streamed run. A race gives another
# block's weights or unfinished copies: differences of the order of the outputs themselves.
SPREAD_FACTOR = 4


def identical(a, b) -> bool:
    """Bitwise equality of two outputs: tensors, or dicts of tensors (training)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def compare(outputs, resident, fp32_resident=None) -> dict:
    """fp32: within SPREAD_FACTOR x the resident runs' own spread (bitwise where they agree).
    Lower precision: as close as the resident run is to the fp32 resident run. Outputs made of
    named parts (dicts of tensors) are compared part by part, each against its own bound."""
    if isinstance(outputs[0], dict):
        parts = {
            key: compare(
                [o[key] for o in outputs],
                [r[key] for r in resident],
                None if fp32_resident is None else [r[key] for r in fp32_resident],
            )
            for key in outputs[0]
        }
        verdict = {flag: all(p[flag] for p in parts.values()) for flag in ("bitwise", "ok")}
        return {**parts, **verdict}
    worst = max(max_abs(o, resident[0]) for o in outputs)
    if fp32_resident is None:
        bound = SPREAD_FACTOR * max_abs(resident[0], resident[1])
    else:
        bound = max_abs(resident[0], fp32_resident[0])
    return {
        "max_abs_diff": worst,
        "bound": bound,
        "bitwise": all(identical(o, resident[0]) for o in outputs),
        "ok": bool(worst <= bound),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default=None, help="default: small on CUDA, the micro model on CPU")
    ap.add_argument("--rounds", type=int, default=3, help="streamed runs per scenario")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("stream_protocol: no CUDA device", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    preset = args.preset or ("small" if cuda else None)
    # Copies of the small preset's blocks (38 MB in fp32) outlast its compute on a small clip, so
    # a missing wait lets compute run ahead of its copy.
    clip = (8, 64, 64) if cuda else (2, 8, 8)
    dtypes = [torch.float32, torch.bfloat16] if cuda else [torch.float32]
    report: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": preset or "micro",
        "clip": list(clip),
        "rounds": args.rounds,
        "scenarios": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", preset)
        cache: dict = {}
        for name in args.scenarios.split(","):
            start = time.perf_counter()
            results, fp32 = {}, None
            for dtype in dtypes:
                resident = reference(name, model, args.device, dtype, clip, cache)
                outputs = run(name, model, args.device, dtype, Probe(), args.rounds, clip)
                results[str(dtype).removeprefix("torch.")] = compare(outputs, resident, fp32)
                fp32 = resident if dtype == torch.float32 else fp32
            results["ok"] = all(r["ok"] for r in results.values())
            results["seconds"] = time.perf_counter() - start
            report["scenarios"][name] = results
    report["ok"] = all(s["ok"] for s in report["scenarios"].values())
    print(json.dumps(report, indent=2) if args.json else report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
