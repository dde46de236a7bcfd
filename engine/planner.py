"""Memory and time planner: will a model run, in which mode, on which machine, and how fast?

Every figure is derived from the model's config (its family counts parameters on the meta device)
and a few machine numbers, and named, so the accounting can be read and checked line by line:

- Inference keeps the compute-dtype weights in host RAM (pinned once, at the exact size) and
  streams each block into one of `prefetch` device slots; resident blocks and the non-block
  parameters stay on the device. Each denoising step moves every streamed block across the bus once
  (the whole batch, guidance pairs included, runs through a block while it is loaded).
- Fine-tuning keeps the master weights and AdamW's m and v in host RAM, in the optimizer's state
  format (`Workload.optimizer_state`, state_format.py): fp32, 12 B/param; down to 4.03 with
  "bf16-sr/8bit". The masters are what streams: an fp32 master at 4 B/param per crossing, its
  compute-dtype copy cast on the fly on the device, so no full compute-dtype copy exists
  anywhere; a bf16 master (bf16-split, bf16-sr) at 2 B/param, the compute copy itself (a
  bf16-split master's low halves stay in the optimizer). The update (`optimizer` time) moves
  the format's bytes through host memory (`StateFormat.update_bytes`: 28 B/param for fp32,
  12.06 for bf16-sr/8bit) at `Machine.host_gbps`; with 8-bit moments the codecs may bound it
  instead, at `CODEC_PARAMS_PER_S` per thread on `Machine.cpu_threads` (`_optimizer_update`,
  both shown by `format_plan`). The forward keeps only block-boundary activations; the backward
  streams the blocks again in reverse, recomputes each block and sends its fp32 gradients to
  the host. Over several devices (data parallel) each device runs its share of the batch's rows
  against the one master in host RAM, and each block's gradients are reduced onto the first
  device as its backward ends.
- Inference over several devices splits each clip's tokens over them (sequence parallel); each
  streams its blocks from the one host copy (in the weights format, encoded once), keeps its
  budget's blocks resident on its own device (the budget is per device), and on the disk tier
  reads the files itself into rings of its own.

Where the weights live is a `Placement` (placement.py) seen as a `Workload` (`Workload.of`): the
placement's lasting rules refuse what can never run; what only today's code lacks is planned.

Time per step is `max(transfer, compute)` (copies overlap compute) with the bound named.

A coded weight format (`Workload.weights`, weight_formats.py) changes three lines: the host keeps
the denoiser's blocks coded (`coded_block_weights`), each slot gets a staging buffer for the coded
payload, fewer bytes cross the bus, and the decode runs on the compute stream before each streamed
block (`decode` time, at `Machine.decode_gbps` of decoded output). `lossless` is planned at
`LOSSLESS_RATIO` (measured on trained weights by benchmarks/compression.py; the exact figure
depends on the weights); `fp8` at 1 byte per matmul parameter, the rest in the compute dtype. An
fp8 single file kept as stored is the same count (its fp32 scales, one per row at most, add
4 bytes a row: under 0.1% of a 5120-wide row's 5120 bytes). With `fp8_matmul`
(streaming/fp8_matmul.py) a streamed block's matmul weights are not decoded at all (only the
rest of the block is) and its matmuls run at `Machine.fp8_tflops`; the slots keep their size
(the code still allocates the decoded block), and the activations' quantization (several
unfused elementwise passes per linear, docs/streaming.md) is left out: an upper bound on the gain.

The disk tier (`Workload.host_tier`, disk_store.py) keeps streamed blocks in the model's files:
the host holds the non-block weights and one ring of `ring_depth` blocks per streamed module
(`disk_ring`), and every streamed block is read from disk each step (`disk` time, at
`Machine.disk_gbps`; warm page cache reads are faster, so this is the cold bound). `auto` picks
disk when the RAM tier's host total exceeds `RAM_MARGIN` of the host's RAM
(`choose_host_tier`, which the loader calls with the RAM available now).

The optimizer's disk tier (`Workload.optimizer_state_tier`, training/optim_disk.py) is separate:
a fine-tune's moments (and a bf16-split master's low halves) live in files, and the host holds
a ring of `STATE_RING_DEPTH` buffers of the largest optimizer block's state instead. Every step
reads and writes the whole state once (`optimizer_disk` time, at `Machine.disk_gbps` both ways:
the write-behind goes to the page cache first, so this is the bound when the disk keeps up
with nothing else). It overlaps the updates as they overlap the backward.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

from .family import family
from .host_memory import (
    HOST_MEMORY_CHECK_ENV,
    available_ram_bytes,
    host_memory_available,
)
from .placement import HOST_TIERS, Placement
from .sources import ModelInfo
from .streaming.disk_store import DEFAULT_RING_DEPTH
from .training.finetune_spec import STATE_TIERS, check_state
from .training.optim import grad_buffer_bytes
from .training.optim_disk import DEFAULT_STATE_RING_DEPTH
from .training.state_format import StateFormat

GB = 1e9
# Coded bytes / bf16 bytes of trained weights under `lossless`: 0.68 to 0.70 on the default model
# and Gaussian-like weights (benchmarks/compression.py); planned a little above.
LOSSLESS_RATIO = 0.70
# Coded delta bytes / bf16 bytes of a fine-tune's denoiser kept as a delta over its base
# (deltas.py); `plan --delta-ratio` for another (benchmarks/deltas.py measures fine-tunes).
DELTA_RATIO = 0.30
# `auto` keeps streamed blocks in RAM while they need at most this fraction of the RAM available:
# the rest is the activations' host side, the page cache and everything else on the machine.
RAM_MARGIN = 0.8
RING_DEPTH = DEFAULT_RING_DEPTH  # disk tier: host buffers per streamed module
STATE_RING_DEPTH = DEFAULT_STATE_RING_DEPTH  # optimizer disk tier: host buffers of block state
# Parameters per second one optimizer thread updates with 8-bit moments in the fused kernel
# (compact_kernel.cpp), where the codecs, not memory, bound it: about 55 vector operations per
# 16 elements, 1.1 to 1.2e9 params/s per thread (docs/benchmarks.md, "Optimizer state formats",
# benchmarks/optimizer.py); planned at the low end.
CODEC_PARAMS_PER_S = 1.1e9


def choose_host_tier(requested: str, needed_bytes: int, available_bytes: int | None = None) -> str:
    """ "ram" or "disk": `requested` unless "auto", which picks disk when `needed_bytes` (the host
    store in RAM) exceed `RAM_MARGIN` of `available_bytes` (default: `available_ram_bytes()`)."""
    if requested not in HOST_TIERS:
        raise ValueError(f"host_tier must be one of {', '.join(HOST_TIERS)}, got {requested!r}")
    if requested != "auto":
        return requested
    if available_bytes is None:
        available_bytes = available_ram_bytes()
    return "disk" if needed_bytes > RAM_MARGIN * available_bytes else "ram"


@dataclass(frozen=True)
class Machine:
    """What the planner needs to know about the hardware."""

    gpu_mem: float = 141 * GB  # device bytes (H200)
    host_mem: float = 1.5e12  # host RAM bytes
    h2d_gbps: float = 55.0  # achieved pinned host->device bandwidth, GB/s (PCIe 5 x16)
    d2h_gbps: float = 55.0
    tflops: float = 790.0  # achieved dense bf16 TFLOP/s
    # Achieved dense fp8 TFLOP/s (`fp8_matmul`): twice bf16's, as the H100's and H200's peaks
    # are; an assumption, not a measurement.
    fp8_tflops: float = 1580.0
    host_gbps: float = 200.0  # host memory bandwidth the CPU optimizer streams through, GB/s
    # Threads the CPU optimizer updates on (CPUAdamW's `threads`; its default is torch's
    # intra-op count, the physical cores): what the 8-bit codecs' compute bound scales with. 32
    # is an assumption for the cores a GPU server leaves its optimizer, not a measurement.
    cpu_threads: int = 32
    reserve: float = 0.05  # fraction of device memory kept free for the allocator and CUDA context
    # Decoded bytes per second a coded weight format's decode writes on the device: the design
    # goal of the lossless kernel on an H200 (benchmarks/gpu_check.sh measures it), not a
    # measurement; fp8's dequantize is a plain elementwise op, faster.
    decode_gbps: float = 200.0
    # Achieved all-to-all bandwidth per device between the devices of one host, GB/s sent: an
    # assumption for NVLink-connected H200s (450 GB/s a direction), not a measurement.
    link_gbps: float = 300.0
    # Disk tier: sustained read bandwidth of the model's files with a cold page cache, GB/s (a
    # PCIe 4 NVMe drive; benchmarks/disk_streaming.py measures a machine's).
    disk_gbps: float = 3.0


@dataclass(frozen=True)
class Workload:
    """What runs: mode, clip shape and batch, and where the weights live (the planner's view of
    a `Placement`: `Workload.of` makes one from it, `placement` gives it back)."""

    mode: str = "infer"  # "infer" or "finetune"
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    batch: int = 1
    guidance: bool = True  # inference: conditional and unconditional rows in one batch
    dtype_bytes: int = 2  # compute dtype (bf16)
    prefetch: int = 2  # device slots
    gpu_budget: float | None = None  # device bytes for weights; None streams every block
    max_grad_norm: bool = False  # fine-tuning: global-norm clipping
    grad_accum: int = 1  # fine-tuning: micro-batches per optimizer step
    optimizer_state: str = "fp32"  # fine-tuning: master and moments' format (state_format.py)
    optimizer_state_tier: str = "ram"  # fine-tuning: the optimizer's own state in RAM or on disk
    # Fine-tuning a two-expert model (Wan2.2-A14B): "high" or "low" trains one, "both" (or None,
    # as a run defaults) both in one run, each on the rows whose flow times it owns.
    expert: str | None = None
    loras: int = 0  # inference: LoRA adapters registered (their factors live on the device)
    lora_rank: int = 0  # their rank, on every adaptable layer
    # Inference: fine-tunes of the model served as deltas over it (deltas.py), each holding
    # `delta_ratio` of the denoiser blocks' bytes in host RAM.
    fine_tunes: int = 0
    delta_ratio: float = DELTA_RATIO
    weights: str = "raw"  # inference: host format of streamed blocks (raw, lossless, fp8)
    fp8_matmul: bool = False  # weights="fp8": streamed blocks' linears multiply by the fp8 bytes
    # Inference: one clip's tokens split over this many devices (parallel/sequence.py); fine-tuning: the
    # batch split over them, one master in host RAM (parallel/data_parallel.py).
    devices: int = 1
    host_tier: str = "ram"  # inference: where streamed blocks live (ram, disk, auto)

    @classmethod
    def of(cls, placement: Placement, **fields) -> Workload:
        """The workload of `placement` (streamed: the planner plans streaming), with the
        clip's and the run's `fields` (`devices`, a count, in place of the placement's names)."""
        derived = dict(
            prefetch=placement.prefetch,
            gpu_budget=placement.gpu_budget_bytes,
            weights=placement.weights,
            fp8_matmul=placement.fp8_matmul,
            devices=len(placement.devices) if placement.devices else 1,
            host_tier=placement.host_tier,
        )
        return cls(**{**derived, **fields})

    @property
    def placement(self) -> Placement:
        """The placement this workload plans: streamed, over `devices` devices."""
        budget = None if self.gpu_budget is None else int(self.gpu_budget)
        return Placement(
            devices=tuple(f"device:{i}" for i in range(self.devices)) if self.devices > 1 else None,
            offload="stream",
            gpu_budget_bytes=budget,
            prefetch=self.prefetch,
            weights=self.weights,
            fp8_matmul=self.fp8_matmul,
            host_tier=self.host_tier,
        )


def tokens(info: ModelInfo, w: Workload) -> int:
    """Video tokens of one clip of the workload's shape (in pixels; the model's default when unset)."""
    s = info.sampling
    grid = info.config.token_grid(w.frames or s.frames, w.height or s.height, w.width or s.width)
    return math.prod(grid)


def adapter_bytes(info: ModelInfo, loras: int, rank: int, dtype_bytes: int) -> int:
    """Device bytes of `loras` rank-`rank` adapters on every adaptable layer of the denoiser (the
    experts share an adapter's factors); ValueError for a family that takes none."""
    if not loras:
        return 0
    targets = family(info.family).adapter_targets(info)
    if not targets:
        raise ValueError(f"{info.name} takes no LoRA adapters")
    per_rank = sum(layer.in_features + layer.out_features for layer in targets[0].values())
    return loras * rank * per_rank * dtype_bytes


def attention_keys(config, n: int) -> int:
    """Keys each query attends to: all tokens (dense, sage) or the 3D-DSA window."""
    if config.attention != "dsa":
        return n
    return min(n, math.prod(config.dsa_window) * math.prod(config.dsa_tile))


def plan(info: ModelInfo, machine: Machine = Machine(), w: Workload = Workload()) -> dict:
    """The full accounting of a described model (`sources.describe`) as a dict of named byte
    counts, times and a verdict.

    A model is its denoiser (one or more experts of `blocks` blocks each; one expert runs per
    step), a text encoder (streamed block by block too when it has blocks, else resident), an
    image encoder when it has one (Wan2.1-I2V's CLIP: fp32, streamed like the text encoder) and a
    VAE (resident, fp32). Fine-tuning trains the parameters the family names trainable (of a
    two-expert model, both unless the workload names one: twice the masters and moments, a
    slot ring each, and a step whose rows span both streams both). The workload's placement is
    checked by the placement's lasting rules (placement.py): what only today's code lacks is
    still accounted for.
    """
    if w.devices < 1:
        raise ValueError(f"devices must be at least 1, got {w.devices}")
    if machine.cpu_threads < 1:
        raise ValueError(f"cpu_threads must be at least 1, got {machine.cpu_threads}")
    if w.fine_tunes < 0 or w.delta_ratio <= 0:
        raise ValueError(
            f"fine_tunes must be at least 0 and delta_ratio above 0, got {w.fine_tunes} and "
            f"{w.delta_ratio}"
        )
    w.placement.validate(w.mode, lasting_only=True)
    if w.mode == "finetune":
        check_state(w.optimizer_state)  # a format fine-tuning trains with
        if w.optimizer_state_tier not in STATE_TIERS:
            raise ValueError(
                f"optimizer_state_tier must be one of {STATE_TIERS}, got {w.optimizer_state_tier!r}"
            )
    z = _sizes(info, w)
    device, host = _memory(info, w, z)
    device_limit = machine.gpu_mem * (1 - machine.reserve)
    if z.finetune and sum(device.values()) > device_limit:
        # Over the device budget: the block-boundary activations wait in pinned host memory instead
        # (one block's worth comes back for each block's recompute, overlapped like a weight copy).
        host["boundary_activations"] = device.pop("boundary_activations")
    host_tier, disk_bytes = _disk_tier(w, z, host, machine)
    device_total = sum(device.values())
    host_total = sum(host.values())
    t = _step_time(info, w, z, machine, host)
    bounds = t["bounds"]
    if host_tier == "disk":
        bounds["disk"] = disk_bytes / (machine.disk_gbps * GB)
    state_disk = _state_disk_bytes(w, z)
    if state_disk:
        bounds["optimizer_disk"] = state_disk / (machine.disk_gbps * GB)
    bound = max(bounds, key=bounds.get)
    problems = _problems(info, w, z, device_total, host_total, machine)
    return {
        "model": info.name,
        "mode": w.mode,
        "parameters": z.n_params,
        "trainable_parameters": z.counts["trainable"],
        "per_block_parameters": z.n_block,
        "blocks": z.depth,
        "experts": z.counts["experts"],
        **({"experts_trained": z.experts} if z.finetune else {}),
        "resident_blocks": z.resident,
        "streamed_blocks": z.streamed,
        "tokens": z.n_tok,
        "batch_rows": z.rows,
        "host_tier": host_tier,
        **({"optimizer_state": _optimizer_state(w, z, machine)} if z.finetune else {}),
        "host": {**host, "total": host_total},
        "device": {**device, "weights": z.weights_dev, "total": device_total},
        "devices": w.devices,
        "time_s": {
            **bounds,
            "decode": t["decode"],
            "communication": t["communication"],
            "step": max(bounds.values()),
            "bound": bound,
        },
        # Per device: each streams every block over its own link, from one shared host copy.
        "bytes_per_step": {
            "h2d": t["h2d"],
            "disk": disk_bytes,
            "optimizer_disk": state_disk,
            "all_to_all": t["all_to_all"],
            "gradient_reduce": t["gradient_reduce"],
        },
        "fits": not problems,
        "problems": problems,
        "machine": asdict(machine),
        "workload": asdict(w),
    }


@dataclass(frozen=True)
class _Sizes:
    """The counts and sizes every part of the plan reads: the model's, as the workload runs it."""

    counts: dict
    finetune: bool
    n_params: int
    n_block: int  # parameters of one denoiser block
    depth: int
    experts: int  # experts held (fine-tuning: those it trains)
    stepped: int  # experts a step runs: one in inference; in fine-tuning, those its rows may span
    wb: int  # bytes per streamed parameter: the compute dtype, or fine-tuning's fp32 master
    block_bytes: int
    coded_block_bytes: int  # a block as the host store keeps it and it crosses the bus
    matmul_params: int
    nonblock_bytes: int
    slots: int
    lora: int
    resident: int
    streamed: int
    weights_dev: int
    n_tok: int
    rows: int  # rows of one pass on each device
    sp: int  # sequence-parallel ways (inference over several devices)
    dp: int  # data-parallel ways (fine-tuning over several devices)


def _optimizer_state(w: Workload, z: _Sizes, machine: Machine) -> dict:
    """A fine-tune's optimizer state format, its host bytes per trained parameter (the master
    and m and v; gradient buffers apart) and what its update costs a step (`_optimizer_update`)."""
    fmt = StateFormat.parse(w.optimizer_state)
    update = _optimizer_update(w, z.counts["trainable"] * z.stepped // z.experts, machine)
    return {
        "format": fmt.name,
        "tier": w.optimizer_state_tier,
        "bytes_per_param": fmt.master_bytes + fmt.moment_bytes,
        "master_bytes_per_param": fmt.master_bytes,
        "moment_bytes_per_param": fmt.moment_bytes,
        "disk_bytes_per_param": _state_file_bytes(w),
        "update_bytes_per_param": update["bytes_per_param"],
        "update_memory_s": update["memory_s"],
        "update_compute_s": update["compute_s"],
        "update_bound": update["bound"],
    }


def _optimizer_update(w: Workload, trainable: int, machine: Machine) -> dict:
    """Seconds of one optimizer step over `trainable` parameters: the bytes the format's update
    moves through host memory (`StateFormat.update_bytes`) at `Machine.host_gbps`, or, with
    8-bit moments, the codecs' compute on `Machine.cpu_threads` threads if that is slower
    (`compute_s` is None for the formats whose kernel keeps up with memory)."""
    fmt = StateFormat.parse(w.optimizer_state)
    per_param = fmt.update_bytes()
    memory_s = per_param * trainable / (machine.host_gbps * GB)
    compute_s = None
    if fmt.moments == "8bit":
        compute_s = trainable / (CODEC_PARAMS_PER_S * machine.cpu_threads)
    bound = "compute" if compute_s is not None and compute_s > memory_s else "memory"
    return {
        "bytes_per_param": per_param,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "seconds": max(memory_s, compute_s or 0.0),
        "bound": bound,
    }


def _state_file_bytes(w: Workload) -> float:
    """Bytes per trained parameter the optimizer's disk tier keeps in files: m and v, and a
    bf16-split master's low halves (only the optimizer reads them); the streamed master stays."""
    fmt = StateFormat.parse(w.optimizer_state)
    return fmt.moment_bytes + (2 if fmt.master == "bf16-split" else 0)


def _state_disk_bytes(w: Workload, z: _Sizes) -> int:
    """Bytes the optimizer's disk tier reads and writes a step: the whole state of the experts
    that step, each way once."""
    if not z.finetune or w.optimizer_state_tier != "disk":
        return 0
    return 2 * math.ceil(_state_file_bytes(w) * z.counts["trainable"] * z.stepped / z.experts)


def _master_stream_bytes(w: Workload) -> int:
    """Bytes per parameter of a fine-tune's master as its host store keeps and streams it: the
    bf16 high halves of a bf16-split master (its low halves stay in the optimizer), else the
    master's own."""
    fmt = StateFormat.parse(w.optimizer_state)
    return 2 if fmt.master_is_compute_copy else 4


def _sizes(info: ModelInfo, w: Workload) -> _Sizes:
    counts = family(info.family).count_parameters(info)
    finetune = w.mode == "finetune"
    n_params, n_block, depth = counts["total"], counts["per_block"], counts["blocks"]
    experts = counts["experts"]
    if finetune:  # the experts it trains: each one's masters and moments, and a slot ring each
        experts = experts if w.expert in (None, "both") else 1
        counts = {**counts, "trainable": counts["trainable"] * experts}
    b = w.dtype_bytes
    # Inference streams compute-dtype weights; fine-tuning streams the masters themselves: fp32
    # ones cast to the compute dtype on the device (autocast), so no host copy in that dtype
    # exists, bf16 ones as they are.
    wb = _master_stream_bytes(w) if finetune else b
    block_bytes = n_block * wb
    # Resident outside the streamed blocks: each expert's embeddings and head, the text encoder's
    # embedding (its blocks stream like the denoiser's) or all of it, and the fp32 VAE.
    text_resident = counts["text_encoder"] - counts["text_per_block"] * counts["text_blocks"]
    # An image encoder (Wan2.1-I2V's CLIP, fp32) streams its layers like the text encoder.
    image_per_block = counts.get("image_per_block", 0)
    image_resident = counts.get("image_encoder", 0) - image_per_block * counts.get(
        "image_blocks", 0
    )
    nonblock_bytes = (
        experts * counts["denoiser_non_block"] * wb
        + text_resident * wb
        + image_resident * 4
        + counts["vae"] * 4
    )
    # A denoiser block as its host store keeps it and as it crosses the bus.
    matmul_params = n_block - 6 * info.config.dim  # all but the modulation table is a matmul
    coded_block_bytes = {
        "raw": block_bytes,
        "lossless": math.ceil(LOSSLESS_RATIO * block_bytes),
        "fp8": matmul_params + (n_block - matmul_params) * wb,
    }[w.weights]
    staging = 0 if w.weights == "raw" else coded_block_bytes  # per slot: the payload lands here
    # Device: weights. Slots hold streamed blocks (one ring per expert, and one for the text
    # encoder's blocks); the rest of the budget keeps denoiser blocks resident.
    slots = experts * w.prefetch * (block_bytes + staging) + (
        w.prefetch * (counts["text_per_block"] * wb + image_per_block * 4)
    )
    lora = 0 if finetune else adapter_bytes(info, w.loras, w.lora_rank, b)
    if w.gpu_budget is None or finetune:  # fine-tuning streams every block
        resident = 0
    else:
        free = w.gpu_budget - nonblock_bytes - slots - lora
        resident = min(int(max(0, free) // (experts * block_bytes)), depth)
    dp = w.devices if finetune else 1
    rows = -(-w.batch // dp) * (2 if (w.guidance and not finetune) else 1)
    return _Sizes(
        counts=counts,
        finetune=finetune,
        n_params=n_params,
        n_block=n_block,
        depth=depth,
        experts=experts,
        stepped=min(experts, rows) if finetune else 1,
        wb=wb,
        block_bytes=block_bytes,
        coded_block_bytes=coded_block_bytes,
        matmul_params=matmul_params,
        nonblock_bytes=nonblock_bytes,
        slots=slots,
        lora=lora,
        resident=resident,
        streamed=depth - resident,
        weights_dev=nonblock_bytes + slots + experts * resident * block_bytes,
        n_tok=tokens(info, w),
        rows=rows,
        sp=1 if finetune else w.devices,
        dp=dp,
    )


def _memory(info: ModelInfo, w: Workload, z: _Sizes) -> tuple[dict, dict]:
    """(device bytes, host bytes) by what holds them, on each device and on the host."""
    config, b, P = info.config, w.dtype_bytes, z.sp
    D, F = config.dim, config.ffn_dim
    # Device: activations of one block's forward, the largest live set (hidden state, qkv, attention
    # output, MLP hidden), and the attention workspace (flash-style kernels keep O(N) per row).
    # With P devices (sequence parallel) each holds N/P tokens of every row, or all N tokens of
    # heads/P heads around attention, plus the all-to-all's send and receive buffers of q, k, v.
    n_rank = -(-z.n_tok // P)
    act_block = z.rows * n_rank * (2 * D + max(4 * D, F + D)) * b
    if P > 1:
        act_block += 2 * z.rows * n_rank * 3 * D * b
    attn_ws = z.rows * config.heads * z.n_tok * 4 // P  # fp32 log-sum-exp per query row
    device = {
        "non_block_weights": z.nonblock_bytes,
        "slots": z.slots,
        "resident_blocks": z.experts * z.resident * z.block_bytes,
    }
    host = {}
    trainable = z.counts["trainable"]
    if not z.finetune:
        device.update(activations=act_block, attention_workspace=attn_ws)
        kept = family(info.family).kept_across_steps(info, z.rows, b)
        if kept:
            device["kept_across_steps"] = kept  # e.g. Wan's prompt keys and values
        if z.lora:
            # The factors stay on the device; the low-rank products add rows x tokens x rank.
            device["lora_adapters"] = z.lora
        if w.fine_tunes:
            # Their coded deltas, in host RAM beside the base's one copy (pinned on a GPU).
            denoisers = z.experts * z.depth * z.n_block * b
            host["fine_tune_deltas"] = math.ceil(w.fine_tunes * w.delta_ratio * denoisers)
        if w.weights == "raw":
            host["compute_dtype_weights"] = z.n_params * b  # pinned once at the exact size
        else:
            # One coded copy for the host, however many devices stream from it. Over several,
            # the blocks a budget keeps resident are in the shared copy raw (each rank copies
            # them to its device as they are); on one device they leave the host.
            coded = z.experts * (z.depth - (z.resident if z.sp > 1 else 0))
            host["compute_dtype_weights"] = (z.n_params - coded * z.n_block) * b
            host["coded_block_weights"] = coded * z.coded_block_bytes
        return device, host
    # Backward: one block's recompute plus its saved tensors (about 3x the forward live set), the
    # compute-dtype cast of that block, its fp32 gradients, and every block's boundary activation.
    # Data parallel: each device does this for its share of the batch's rows.
    device.update(
        activations=3 * act_block,
        attention_workspace=attn_ws,
        # An fp32 master's block is cast to the compute dtype; a bf16 master's is that already.
        block_cast=z.n_block * b if z.wb == 4 else 0,
        block_gradients=z.n_block * z.wb,  # in the parameters' dtype: the master's
        boundary_activations=z.rows * z.n_tok * D * b * z.depth,
    )
    fmt = StateFormat.parse(w.optimizer_state)
    if w.optimizer_state_tier == "disk":
        # The host store (the streamed master) stays; the rest of the state is in files, read
        # into a ring of the largest optimizer block's state (a denoiser block, or everything
        # outside the blocks, one optimizer block).
        per_param = _state_file_bytes(w)
        largest = max(z.n_block, trainable // z.experts - z.depth * z.n_block)
        host.update(
            master=math.ceil((fmt.master_bytes - (per_param - fmt.moment_bytes)) * trainable),
            # A ring for each expert's optimizer.
            optimizer_state_ring=z.experts * STATE_RING_DEPTH * math.ceil(per_param * largest),
        )
    else:
        host.update(
            # Pinned: the streamer's host store is the master, one for every device (shared
            # pages); a bf16-split master's low halves (2 B/param) are the optimizer's.
            master=math.ceil(fmt.master_bytes * trainable),
            adam_moments=math.ceil(fmt.moment_bytes * trainable),  # m and v (8-bit: and scales)
        )
    host.update(
        frozen_weights=(z.n_params - trainable) * b,  # the frozen text encoder, VAE, experts
        # One block's fp32 gradients on their way to the optimizer (each expert's step its own).
        pinned_gradients=z.experts * z.n_block * 4,
        # Accumulating micro-batches, or clipping by the global norm, holds every gradient.
        grad_accumulation=grad_buffer_bytes(
            trainable,
            accumulation_steps=w.grad_accum,
            max_grad_norm=1.0 if w.max_grad_norm else None,
        ),
    )
    return device, host


def _disk_tier(w: Workload, z: _Sizes, host: dict, machine: Machine) -> tuple[str, int]:
    """(the host tier streamed blocks live in, bytes read from disk a step); with the disk tier,
    `host` is changed to hold the non-block weights and the rings."""
    host_tier = "ram"
    if not z.finetune and w.weights == "raw" and w.host_tier != "ram":
        host_tier = choose_host_tier(w.host_tier, sum(host.values()), machine.host_mem)
    if host_tier != "disk":
        return host_tier, 0
    # The blocks stay in the files; each streamed module keeps a ring of its blocks.
    counts, b = z.counts, w.dtype_bytes
    on_disk = z.experts * z.depth * z.n_block + counts["text_blocks"] * counts["text_per_block"]
    host["compute_dtype_weights"] = (z.n_params - on_disk) * b
    # Each rank reads its blocks itself, into rings of its own; the page cache is the host's.
    ring = RING_DEPTH * (z.experts * z.block_bytes + counts["text_per_block"] * z.wb)
    host["disk_ring"] = z.sp * ring
    # One expert's streamed blocks a step, read from disk once: the ranks read the same blocks
    # at about the same time, the first from the disk and the others from the page cache.
    return "disk", (z.depth - z.resident) * z.block_bytes


def _step_time(info: ModelInfo, w: Workload, z: _Sizes, machine: Machine, host: dict) -> dict:
    """Seconds of one step by what bounds it (`bounds`), and the bytes that cross each link."""
    config, b, P = info.config, w.dtype_bytes, z.sp
    D, L = config.dim, config.text_tokens
    keys = attention_keys(config, z.n_tok)
    n_tok, rows = z.n_tok, z.rows
    # Time: FLOPs of one forward over the batch (matmuls 2*params*tokens, attention 4*N*keys*D).
    # With fp8_matmul the streamed blocks' matmuls run at fp8's rate: their FLOPs count at the
    # bf16 rate scaled by tflops / fp8_tflops.
    fp8_blocks = z.streamed if (w.fp8_matmul and not z.finetune) else 0
    matmul_blocks = z.depth - fp8_blocks + fp8_blocks * machine.tflops / machine.fp8_tflops
    fwd_flops = rows * (
        matmul_blocks * 2 * z.matmul_params * n_tok
        + z.depth * (4 * n_tok * keys * D + 4 * n_tok * L * D)
    )
    streamed_bytes = z.streamed * z.block_bytes  # one expert runs per step
    # Sequence parallel: each device computes 1/P of every matmul and attention (the prologue and
    # epilogue it repeats are left out), and per block sends (P-1)/P of its q, k, v and attention
    # output (4 x rows x N/P x D values); the hidden states are gathered once per step. The
    # collectives are not overlapped with compute, so their time adds to it.
    fwd_flops = fwd_flops / P
    a2a_bytes = 0
    if P > 1:
        n_rank = -(-n_tok // P)
        per_block = 4 * rows * n_rank * D * b * (P - 1) // P
        a2a_bytes = z.depth * per_block + rows * n_rank * D * b * (P - 1)
    # Data parallel: each block's fp32 gradients are summed onto rank 0 as its backward ends (a
    # reduce: (dp-1)/dp of them sent per device), not overlapped with compute either.
    reduce_bytes = z.depth * z.n_block * 4 * (z.dp - 1) // z.dp
    comm_s = (a2a_bytes + reduce_bytes) / (machine.link_gbps * GB)
    decode_s = 0.0
    if not z.finetune:
        # A coded block is decoded on the compute stream before it runs: compute time grows.
        if w.weights != "raw":
            decoded = streamed_bytes
            if w.fp8_matmul:  # only the block's other parameters are decoded
                decoded = z.streamed * (z.n_block - z.matmul_params) * z.wb
            decode_s = decoded / (machine.decode_gbps * GB)
        compute_s = fwd_flops / (machine.tflops * 1e12) + decode_s + comm_s
        h2d_bytes = z.streamed * z.coded_block_bytes
        # Each device has its own link; with several, they all read the one host copy, so host
        # memory bandwidth may bound first.
        transfer_s = max(
            h2d_bytes / (machine.h2d_gbps * GB), P * h2d_bytes / (machine.host_gbps * GB)
        )
        optimizer_s = 0.0
    else:
        # Forward, recompute, backward (2x), on each device's rows.
        compute_s = 4 * fwd_flops / (machine.tflops * 1e12) + comm_s
        offloaded = host.get("boundary_activations", 0)  # down in the forward, up in the backward
        # Every block crosses in the forward and again in the backward, except those still in their
        # slots when the backward turns around. Training two experts, a step whose rows span both
        # runs both (planned as the worst case: a batch of several rows holds rows of both).
        h2d_bytes = z.stepped * (2 * z.streamed - min(w.prefetch, z.streamed)) * z.block_bytes
        h2d_bytes += offloaded
        d2h_bytes = z.stepped * z.depth * z.n_block * 4 + offloaded  # every block's fp32 gradients
        transfer_s = h2d_bytes / (machine.h2d_gbps * GB) + d2h_bytes / (machine.d2h_gbps * GB)
        # The format's bytes through host memory, or the 8-bit codecs' compute: of the experts
        # that step.
        stepped = z.counts["trainable"] * z.stepped // z.experts
        optimizer_s = _optimizer_update(w, stepped, machine)["seconds"]
    return {
        "bounds": {"compute": compute_s, "transfer": transfer_s, "optimizer": optimizer_s},
        "decode": decode_s,
        "communication": comm_s,
        "h2d": h2d_bytes,
        "all_to_all": a2a_bytes,
        "gradient_reduce": reduce_bytes,
    }


def _problems(
    info: ModelInfo, w: Workload, z: _Sizes, device_total: int, host_total: int, machine: Machine
) -> list[str]:
    """What keeps the workload from running on the machine, each named; empty when it fits."""
    problems = []
    if z.sp > 1:
        s = info.sampling
        shape = (w.frames or s.frames, w.height or s.height, w.width or s.width)
        try:
            family(info.family).check_parallel(info, *shape, z.sp)
        except ValueError as e:
            problems.append(str(e))
    if z.finetune and z.experts > 1 and z.dp > 1:
        problems.append("both experts train in one process: name one expert to train over devices")
    if z.dp > 1 and w.batch % z.dp:
        problems.append(f"batch {w.batch} does not split over {z.dp} devices: a multiple of it")
    device_limit = machine.gpu_mem * (1 - machine.reserve)
    if device_total > device_limit:
        problems.append(
            f"device memory: needs {device_total / GB:.1f} GB of {device_limit / GB:.1f} GB usable"
        )
    if host_total > machine.host_mem:
        problems.append(
            f"host memory: needs {host_total / GB:.1f} GB of {machine.host_mem / GB:.1f} GB"
        )
    floor = z.nonblock_bytes + z.slots
    if w.gpu_budget is not None and not z.finetune and w.gpu_budget < floor:
        problems.append(
            f"gpu budget {w.gpu_budget / GB:.2f} GB is below non-block weights + slots "
            f"({floor / GB:.2f} GB)"
        )
    return problems


class HostMemoryError(ValueError):
    """The model's weights do not fit in the host memory available: the planner's verdict."""


# Skips `check_host_memory` for a user who knows better (swap, memory freed before the weights
# load, a limit read wrongly).


def check_host_memory(
    info: ModelInfo,
    placement: Placement,
    *,
    dtype_bytes: int,
    available: tuple[int, str] | None = None,
) -> None:
    """HostMemoryError, before anything is allocated, when the weights `open_pipeline` would keep
    in host memory as `placement` places them (`plan`'s host total) exceed what is available
    (`host_memory_available`): a process would otherwise be killed by the kernel halfway through
    loading. The message names the need, what is available and the options that would fit.
    Weights resident on a CUDA device take no host memory to speak of; several devices stream
    from one host copy, counted once. `MEGASLIDE_HOST_MEMORY_CHECK=off` skips the check."""
    device = placement.device or "cpu"
    resident_on_gpu = not device.startswith("cpu") and not placement.streams
    if resident_on_gpu or os.environ.get(HOST_MEMORY_CHECK_ENV) == "off":
        return
    free, bound = available or host_memory_available()
    # One device's host side: the ranks of several share it (the planner's `devices` changes
    # the device side only).
    w = Workload.of(placement.on(device), dtype_bytes=dtype_bytes)
    verdict = plan(info, Machine(host_mem=free), w)
    need = verdict["host"]["total"]
    if need <= free:
        return
    options = []
    for flags, alt in (
        ("--offload stream --weights fp8", replace(w, weights="fp8", host_tier="ram")),
        ("--offload stream --weights lossless", replace(w, weights="lossless", host_tier="ram")),
        ("--offload stream --host-tier disk", replace(w, weights="raw", host_tier="disk")),
    ):
        alt_need = plan(info, Machine(host_mem=free), alt)["host"]["total"]
        if alt_need <= free and alt != w:
            options.append(f"{flags} ({alt_need / GB:.1f} GB)")
    fits = "options that fit: " + ", ".join(options) if options else "no option fits this host"
    auto = " (auto)" if placement.host_tier == "auto" else ""
    raise HostMemoryError(
        f"{info.name} does not fit in host memory: its weights ({placement.weights}, "
        f"{dtype_bytes} bytes a parameter, host tier {verdict['host_tier']}{auto}) need "
        f"{need / GB:.1f} GB, {free / GB:.1f} GB is available (bounded by {bound}); {fits}. "
        f"{HOST_MEMORY_CHECK_ENV}=off skips this check"
    )


def format_plan(p: dict) -> str:
    """A human-readable table of a plan."""

    def gb(x):
        return f"{x / GB:10.2f} GB"

    lines = [
        f"{p['model']} {p['mode']}: {p['parameters']:,} parameters, "
        f"{p['experts']} x {p['blocks']} blocks "
        f"({p['resident_blocks']} resident, {p['streamed_blocks']} streamed), "
        f"{p['tokens']:,} tokens x {p['batch_rows']} rows"
    ]
    state = p.get("optimizer_state")
    if state is not None:
        lines.append(
            f"optimizer state {state['format']}: {state['bytes_per_param']:.2f} B per trained "
            f"parameter in host RAM (master {state['master_bytes_per_param']:g}, m and v "
            f"{state['moment_bytes_per_param']:.2f}), gradient buffers apart"
        )
        compute = ""
        if state["update_compute_s"] is not None:
            compute = (
                f", codecs {state['update_compute_s']:.3f} s on {p['machine']['cpu_threads']} "
                "threads"
            )
        lines.append(
            f"optimizer update: {state['update_bytes_per_param']:.2f} B per trained parameter "
            f"through host memory a step, {state['update_memory_s']:.3f} s at "
            f"{p['machine']['host_gbps']:g} GB/s{compute}: {state['update_bound']}-bound"
        )
        if state["tier"] == "disk":
            lines.append(
                f"optimizer state tier disk: {state['disk_bytes_per_param']:.2f} B per trained "
                "parameter in files instead, through a ring of a few blocks' state in RAM"
            )
    for side in ("host", "device"):
        lines.append(f"{side}:")
        for name, value in p[side].items():
            if name not in ("total", "weights"):
                lines.append(f"  {name:<22}{gb(value)}")
        lines.append(f"  {'total':<22}{gb(p[side]['total'])}")
    t = p["time_s"]
    lines.append(
        f"time per step: {t['step']:.3f} s, bound by {t['bound']} "
        f"(compute {t['compute']:.3f} s, transfer {t['transfer']:.3f} s, optimizer {t['optimizer']:.3f} s"
        + (f", disk {t['disk']:.3f} s)" if "disk" in t else ")")
    )
    if p["devices"] > 1 and p["mode"] == "finetune":
        lines.append(
            f"per device of {p['devices']}: {p['batch_rows']} rows, "
            f"{p['bytes_per_step']['gradient_reduce'] / GB:.2f} GB of gradients sent to the first "
            f"device a step ({t['communication']:.3f} s of the compute time), "
            "one master in host RAM"
        )
    elif p["devices"] > 1:
        source = "the shared host copy"
        if p.get("host_tier") == "disk":
            source = "the files (a ring each, one page cache)"
        lines.append(
            f"per device of {p['devices']}: {p['bytes_per_step']['all_to_all'] / GB:.2f} GB sent "
            f"in all-to-alls a step ({t['communication']:.3f} s of the compute time), "
            f"{p['bytes_per_step']['h2d'] / GB:.2f} GB of blocks streamed from {source}, "
            f"{p['resident_blocks']} blocks resident on each"
        )
    if p.get("host_tier") == "disk":
        why = " (auto: the RAM tier does not fit)" if p["workload"]["host_tier"] == "auto" else ""
        lines.append(
            f"host tier disk{why}: {p['bytes_per_step']['disk'] / GB:.2f} GB read from disk per "
            f"step at {p['machine']['disk_gbps']:g} GB/s: {t['disk']:.3f} s per step "
            "(cold page cache)"
        )
    if "optimizer_disk" in t:
        lines.append(
            f"optimizer state on disk: {p['bytes_per_step']['optimizer_disk'] / GB:.2f} GB read "
            f"and written per step at {p['machine']['disk_gbps']:g} GB/s: "
            f"{t['optimizer_disk']:.3f} s per step"
            + (" (it bounds the step)" if t["bound"] == "optimizer_disk" else "")
        )
    if p["workload"]["weights"] != "raw":
        lines.append(
            f"weights {p['workload']['weights']}: the compute time includes {t['decode']:.3f} s of "
            "decoding streamed blocks"
            + (
                " (fp8 matmuls: their linear weights stay fp8)"
                if p["workload"]["fp8_matmul"]
                else ""
            )
        )
    lines.append(
        "verdict: fits" if p["fits"] else "verdict: does not fit: " + "; ".join(p["problems"])
    )
    return "\n".join(lines)
