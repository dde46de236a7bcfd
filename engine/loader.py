"""The one way to open a model: build on the meta device, fill the weights once, place them once.

`open_pipeline(source, device=..., offload=...)` is what the CLI, the server, the benchmarks and
the scripts call (gpt-fast's `_load_model`, vLLM's one model loader). It

1. resolves the source once (a `--model` value, a preset, or the packaged default; sources.py)
   and reads its config;
2. has the model's family build its modules on the meta device (no memory, any size);
3. places and fills each module once, tensor by tensor:
   - streamed (`offload="stream"`): the blocks' tensors go straight into the streamer's host store,
     from the safetensors files (memory-mapped) or, for a preset, drawn block by block; only the
     tensors outside the blocks are put on the device. Peak host RAM is about one copy of the
     weights in the compute dtype;
   - resident (`offload="none"`): the module gets device storage and is filled in place.

A preset's random weights are drawn on the CPU in fp32, part by part in construction order
(initialization.py), then cast: the same seed gives the same weights on every device, in every
mode, as constructing the model eagerly would.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from .compiled_blocks import compile_blocks
from .family import Component, family
from .initialization import init_module, init_parts, seeded
from .lora import Adapter, AdapterError
from .placement import Placement
from .planner import check_host_memory, choose_host_tier
from .sampling.pipeline import Pipeline
from .sources import ModelInfo, ModelSource, describe, resolve_source
from .streaming.host_store import (
    BoundTensor,
    SharedWeights,
    collect_tensors,
    layout_nbytes,
    repoint,
)
from .streaming.ordering import Ordering
from .streaming.streamer import StreamHandle, stream_module

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`"auto"`: CUDA when available, else the CPU. ValueError for a device that is not there."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device} is not supported: use cpu or cuda")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`"auto"`: bfloat16 on CUDA, float32 on the CPU (where bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}"
        ) from None


Source = ModelInfo | ModelSource | str | Path | None


def as_source(source: Source) -> ModelSource:
    """A `ModelSource` from any way of naming a model (see `sources.resolve_source`)."""
    if isinstance(source, ModelInfo):
        return source.source
    return source if isinstance(source, ModelSource) else resolve_source(source)


def open_pipeline(
    source: Source = None,
    placement: Placement | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    batched: bool = True,
    ordering: Ordering | None = None,
    shared: SharedWeights | None = None,
    **options,
) -> Pipeline:
    """A model opened for sampling.

    `source`: a described model (`ModelInfo`), a `ModelSource`, a model directory or packaged
    model name, or None for the packaged default. `placement` is where and how its weights live
    (placement.py: device, offload, budget, prefetch, weights format, host tier, disk I/O,
    timing); its fields may be given as keywords instead (`device="cuda", offload="stream"`).
    `offload="stream"` keeps block weights in host RAM and streams them each step
    (`gpu_budget_bytes` keeps as many blocks resident as fit); `timing` records per-block copy
    and compute times for the streamer's stats and trace. `weights` is the streamed blocks' host
    format (`weight_formats.py`: "raw", "lossless" or "fp8"). `host_tier` is where streamed
    blocks live between steps: "ram", "disk" (read from the model's safetensors files through a
    bounded ring each step; disk_store.py) or "auto" (disk when the blocks would not fit in the
    available RAM with a margin; `planner.choose_host_tier`); `disk_io` is how the disk tier
    reads ("buffered" or "direct", O_DIRECT). `compile` runs each denoiser's repeated block
    through one `torch.compile`d forward (compiled_blocks.py), streamed or resident.

    `batched=False` runs each request's rows in passes of their own (a reference mode).
    `ordering` replaces the device's own streams and events for the streamed modules (see
    `stream_module`; tests run on a simulated device this way). `shared` takes the weights from
    a `share_weights` made by a parent process instead of the model's files (streamed blocks
    stream from its buffers). The other `options` replace architecture fields that leave the
    weights alone (`attention="dsa"`).
    """
    fields, overrides = Placement.split(options)
    placement = Placement.of(placement, fields)
    if isinstance(source, ModelInfo) and not overrides:
        info = source
    else:
        info = describe(as_source(source), **overrides)
    components, handles = _open_components(
        info, placement, dtype=dtype, ordering=ordering, shared=shared
    )
    parts = {c.name: c.module for c in components}
    for module in parts.values():
        module.eval()
    pipe = family(info.family).pipeline(info, parts, handles, batched=batched)
    if placement.compile:
        # A transform of the built, placed model like streaming: the blocks' forwards compile
        # at their first call (`Pipeline.warm_up` pays it ahead of a user's request).
        pipe.compiled = {
            c.name: compile_blocks(c.blocks)
            for c in components
            if c.blocks and c.name in pipe.denoisers
        }
    return pipe


def open_model(
    info: ModelInfo,
    placement: Placement | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    only: set[str] | None = None,
    ordering: Ordering | None = None,
    shared: SharedWeights | None = None,
    keep_fp32: bool = True,
    **fields,
) -> tuple[dict[str, nn.Module], dict[str, StreamHandle]]:
    """The modules of a described model, built on meta, filled and placed as `placement` says
    (or its `fields` as keywords): `(modules by name, stream handles of the streamed ones)`;
    `only` names the components to open (default: all). Fine-tuning opens its model here in fp32.

    With several streamed components (a text encoder and two denoising experts, say), the
    budget is shared in proportion to their block bytes. With `shared` (see `share_weights`),
    every streamed block streams from its shared host buffer and the other tensors are copied
    from it: nothing is read from files or drawn. `keep_fp32=False` casts the modules a family
    keeps in fp32 to `dtype` too (a bf16 training master is one dtype throughout).
    """
    components, handles = _open_components(
        info,
        Placement.of(placement, fields),
        dtype=dtype,
        only=only,
        ordering=ordering,
        shared=shared,
        keep_fp32=keep_fp32,
    )
    return {c.name: c.module for c in components}, handles


def _open_components(
    info: ModelInfo,
    placement: Placement,
    *,
    dtype: str | torch.dtype = "auto",
    only: set[str] | None = None,
    ordering: Ordering | None = None,
    shared: SharedWeights | None = None,
    keep_fp32: bool = True,
) -> tuple[list[Component], dict[str, StreamHandle]]:
    """`open_model`, with each module as its family's `Component` (its blocks named)."""
    placement = placement.validate()
    if placement.devices is not None:
        raise ValueError("open_model opens on one device: a rank opens placement.on(its device)")
    if ordering is not None and not placement.streams:
        raise ValueError("ordering needs offload='stream'")
    device = resolve_device(placement.device or "cpu")
    dtype = resolve_dtype(dtype, device)
    components = _components(info, only)
    if not keep_fp32:
        components = [dataclasses.replace(c, keep_fp32=()) for c in components]
    streamed = [c for c in components if placement.streams and c.blocks]
    if shared is not None and placement.host_tier == "auto":
        # Resolved once for the whole host, by the process that made the shared copy.
        placement = placement.replace(host_tier=shared.host_tier)
    tier = _resolve_host_tier(placement, streamed, dtype)
    placement = placement.replace(device=str(device), host_tier=tier)
    if shared is None and only is None:  # (shared weights are in memory already)
        # Refused now, on the meta device: loading weights the host cannot hold ends with the
        # kernel killing the process minutes later, or the allocator failing halfway.
        check_host_memory(info, placement, dtype_bytes=dtype.itemsize)
    if shared is not None:
        _check_shared(shared, placement, components, streamed)
    handles: dict[str, StreamHandle] = {}
    draw = shared is None and any(c.weights is None for c in components)  # a preset's weights
    with seeded(info.source.seed) if draw else contextlib.nullcontext():
        for c in components:
            # A meta twin to draw a preset's random weights in, one part at a time.
            template = copy.deepcopy(c.module) if c.weights is None and not shared else None
            _cast_floating(c.module, c.dtype or dtype, c.keep_fp32)  # on meta: costs nothing
            if c in streamed:
                handle = stream_module(
                    c.module,
                    c.blocks,
                    _share_budget(placement, c, streamed),
                    ordering=ordering,
                    host_buffers=shared.blocks.get(c.name) if shared is not None else None,
                )
                fill = handle.load_weights
                handles[c.name] = handle
            else:
                _place(c.module, device)
                fill = functools.partial(fill_module, c.module)
            if shared is not None and c.name not in shared.blocks and c in streamed:
                fill(c.weights)  # the disk tier: this process locates the blocks in the files
            elif shared is not None:  # the blocks' weights are in their shared buffers already
                fill(shared.tensors[c.name], strict=c not in streamed)
            elif c.weights is not None:
                fill(c.weights)
            else:
                for state in _random_parts(template, c):
                    fill(state, strict=False)
    return components, handles


def held_tensors(info: ModelInfo, dtype: torch.dtype) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Every persistent tensor of the model's components as a pipeline opened in `dtype` holds
    it (a component's own dtype, fp32 where the family keeps it), read one at a time from the
    model's files: `(component, name, tensor)`, a tied tensor once under its first stored name.
    ValueError for a preset, whose weights are drawn rather than stored."""
    for c in _components(info, None):
        if c.weights is None:
            raise ValueError(f"{info.name}: a preset's weights are drawn, not stored in files")
        _cast_floating(c.module, c.dtype or dtype, c.keep_fp32)  # on meta: costs nothing
        for bound in collect_tensors(c.module):
            if not bound.persistent:
                continue
            name = next((n for n in bound.names if n in c.weights), None)
            if name is None:
                raise KeyError(f"{info.name}: {c.name}.{bound.names[0]} is not in its files")
            yield c.name, name, c.weights[name].to(bound.tensor.dtype)


def held_nbytes(info: ModelInfo, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each component's tensors as a pipeline opened in `dtype` holds them (from the
    config alone)."""
    return {
        c.name: _cast_nbytes(c.module, c.dtype or dtype, c.keep_fp32)
        for c in _components(info, None)
    }


def _components(info: ModelInfo, only: set[str] | None) -> list[Component]:
    """The family's components of `info`, those named in `only` (default: all)."""
    components = family(info.family).components(info)
    if only is None:
        return components
    unknown = only - {c.name for c in components}
    if unknown:
        raise ValueError(f"{info.name} has no component {sorted(unknown)[0]!r}")
    return [c for c in components if c.name in only]


def _share_budget(placement: Placement, c: Component, streamed: list[Component]) -> Placement:
    """`placement` for streamed component `c`: its share of the device budget, in proportion to
    its block bytes among the `streamed` components."""
    budget = placement.gpu_budget_bytes
    if budget is None:
        return placement
    block_bytes = {s.name: sum(layout_nbytes(b) for b in s.blocks) for s in streamed}
    return placement.replace(
        gpu_budget_bytes=budget * block_bytes[c.name] // sum(block_bytes.values())
    )


def _check_shared(
    shared: SharedWeights,
    placement: Placement,
    components: list[Component],
    streamed: list[Component],
) -> None:
    """ValueError unless `shared` can be what the components stream and copy from: made for
    this placement's weights format and host tier (`share_weights`)."""
    if not placement.streams:
        raise ValueError("shared weights hold streamed blocks: they need offload='stream'")
    if placement.weights != shared.weights:
        raise ValueError(
            f"the shared weights are {shared.weights}: weights={placement.weights!r} does not "
            "apply (share them with the placement the blocks stream by)"
        )
    if placement.host_tier != shared.host_tier:
        raise ValueError(
            f"the shared weights were made for host_tier={shared.host_tier!r}, not "
            f"{placement.host_tier!r}"
        )
    in_ram = placement.host_tier == "ram"
    unshared = [c.name for c in streamed if in_ram and c.name not in shared.blocks]
    unshared += [c.name for c in components if c.name not in shared.tensors]
    if unshared:
        raise ValueError(f"the shared weights lack component {unshared[0]!r}")


def share_weights(
    info: ModelInfo,
    dtype: torch.dtype,
    only: set[str] | None = None,
    placement: Placement | None = None,
    keep_fp32: bool = True,
) -> SharedWeights:
    """The weights of `info` in `dtype`, in shared memory, for processes this one spawns
    (`open_pipeline(shared=...)` in each), as `placement` (a job's over several devices: its
    weights format, budget, prefetch and host tier; default: raw blocks streamed from RAM) has
    a rank keep them: one copy per host, whatever the number of ranks.

    The streamed blocks' host stores are filled once here, block by block (as `open_model`
    streams, on the CPU: a coded format is encoded here, once), then moved into shared memory
    (a block at a time is held twice meanwhile); a block the budget keeps resident is shared
    raw, as each rank copies it to its device. "auto" is resolved here, for the whole host (one
    copy counted, not one a rank); on the disk tier the blocks stay in the model's files, each
    rank reads them itself (the page cache is the host's one copy) and only the tensors outside
    the blocks are shared. `only`: these components; `keep_fp32` as for `open_model`."""
    if placement is None:
        placement = Placement(offload="stream")
    local = placement.on("cpu") if placement.devices else placement.replace(device="cpu")
    local = local.replace(timing=False)
    local = local.replace(host_tier=resolve_host_tier(info, local, dtype, only))
    if local.host_tier == "disk":  # nothing of the blocks is read here
        local = local.replace(gpu_budget_bytes=None)
    parts, handles = open_model(info, local, dtype=dtype, only=only, keep_fp32=keep_fp32)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    blocks: dict[str, list] = {}
    for name, module in parts.items():
        handle = handles.get(name)
        if handle is None:
            state = module.state_dict()
        else:
            if local.host_tier == "ram":
                # `share_memory_` moves a storage in place: the module's views of it follow.
                blocks[name] = handle.share_blocks()
            state = handle.non_block_tensors()
        tensors[name] = {k: v.detach().share_memory_() for k, v in state.items()}
    return SharedWeights(tensors, blocks, local.weights, local.host_tier)


def resolve_host_tier(
    info: ModelInfo,
    placement: Placement,
    dtype: str | torch.dtype = "auto",
    only: set[str] | None = None,
) -> str:
    """The host tier `open_model` streams `info`'s blocks from under `placement`: "ram" or
    "disk" ("auto" resolved against the RAM available now), read on the meta device."""
    device = resolve_device(placement.device or "cpu")
    components = _components(info, only)
    streamed = [c for c in components if placement.streams and c.blocks]
    return _resolve_host_tier(placement, streamed, resolve_dtype(dtype, device))


def _resolve_host_tier(placement: Placement, streamed: list[Component], dtype: torch.dtype) -> str:
    """ "ram" or "disk" for the streamed components; ValueError for a tier they cannot use."""
    host_tier = placement.host_tier
    if host_tier == "ram" or not streamed:
        # (A placement that asks for disk without streaming is refused by its rules; a family
        # with nothing to stream keeps everything where it is.)
        return "ram"
    from_files = all(c.weights is not None for c in streamed)
    if host_tier == "auto":
        if not from_files or placement.weights != "raw":
            return "ram"  # the disk tier reads raw tensors from files: nothing else can go there
        needed = sum(
            _cast_nbytes(b, c.dtype or dtype, c.keep_fp32) for c in streamed for b in c.blocks
        )
        return choose_host_tier("auto", needed)
    if not from_files:
        raise ValueError(
            "host_tier='disk' reads streamed blocks from the model's safetensors files: a preset's "
            "random weights have none (save the model to a directory first)"
        )
    return "disk"


def _cast_nbytes(module: nn.Module, dtype: torch.dtype, keep: tuple[str, ...]) -> int:
    """Bytes of `module`'s tensors once `_cast_floating(module, dtype, keep)` has run."""
    total = 0
    for bound in collect_tensors(module):
        t = bound.tensor
        size = t.element_size()
        if t.is_floating_point() and bound.persistent:
            size = (torch.float32 if _kept_fp32(bound, keep) else dtype).itemsize
        total += t.numel() * size
    return total


def load_adapter(info: ModelInfo, name: str, path: str | Path) -> Adapter:
    """A LoRA file converted for the model `info` describes and checked against it on the meta
    device, before any weights load (AdapterError naming the first key that does not fit)."""
    fam = family(info.family)
    adapter = fam.load_adapter(name, Path(path))
    targets = fam.adapter_targets(info)
    if not adapter.deltas:
        raise AdapterError(f"adapter {name!r} holds no LoRA factors")
    for t in targets:
        adapter.check(t)
    return adapter


def _kept_fp32(bound: BoundTensor, keep: tuple[str, ...]) -> bool:
    return any(part in keep for name in bound.names for part in name.split("."))


def _cast_floating(module: nn.Module, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> None:
    """Floating parameters and persistent buffers to `dtype`, but those under a submodule named
    in `keep` (kept fp32) and non-persistent buffers, which the module computed for itself."""
    for bound in collect_tensors(module):
        t = bound.tensor
        if not t.is_floating_point() or not bound.persistent:
            continue
        target = torch.float32 if _kept_fp32(bound, keep) else dtype
        if t.dtype != target:
            t.data = t.data.to(target)


def _place(module: nn.Module, device: torch.device) -> None:
    """Give every tensor storage on `device`: meta ones empty (filled next), real ones moved."""
    for bound in collect_tensors(module):
        t = bound.tensor
        repoint(t, torch.empty_like(t, device=device) if t.is_meta else t.detach().to(device))


def _random_parts(template: nn.Module, c: Component) -> Iterator[dict[str, torch.Tensor]]:
    """A preset's random weights for component `c`, part by part in construction order: each part
    gets CPU storage, is drawn in fp32, handed out as a state dict, and freed."""
    blocks = None
    if c.blocks is not None:
        name = next(n for n, m in c.module.named_modules() if m is c.blocks)
        blocks = template.get_submodule(name)
    for prefix, part in init_parts(template, blocks):
        part.to_empty(device="cpu")
        init_module(part)
        yield {(f"{prefix}.{k}" if prefix else k): v for k, v in part.state_dict().items()}
        part.to_empty(device="meta")  # free the part before drawing the next


def fill_module(module: nn.Module, source: Mapping[str, torch.Tensor], *, strict: bool = True):
    """Copy tensors named as in `module.state_dict()` from `source` (a lazy mapping is read one
    tensor at a time) into the module's own storage, casting dtypes. A tensor known by several
    names (tied weights) is filled from whichever `source` holds. With `strict`, every persistent
    tensor must be in `source` and every key of `source` must name one."""
    groups = collect_tensors(module)
    keys = set(source)
    if strict:
        known = {n for g in groups for n in g.names}
        missing = [g.names[0] for g in groups if g.persistent and not keys.intersection(g.names)]
        unexpected = sorted(keys - known)
        if missing or unexpected:
            raise KeyError(f"weights: missing {missing[:8]}, unexpected {unexpected[:8]}")
    with torch.no_grad():
        for g in groups:
            key = next((n for n in g.names if n in keys), None)
            if key is None:
                continue
            src = source[key]
            if tuple(src.shape) != tuple(g.tensor.shape):
                shapes = f"{tuple(src.shape)} != {tuple(g.tensor.shape)}"
                raise ValueError(f"{key!r}: checkpoint shape {shapes}")
            g.tensor.copy_(src)
