"""Host memory for streamed blocks: one contiguous, 64-byte-aligned buffer per block.

A block's parameters and buffers are packed into one flat uint8 buffer (`HostBlockStore`), each
tensor a dtype view at an aligned offset with its original strides, so one memcpy (one DMA on CUDA)
moves a whole block and any flat buffer with the same layout (a device slot) can be viewed the same
way. The module's tensor objects are re-pointed at these views (`tensor.data = view`), so their
identity, leafness and `requires_grad` survive and their old storage is freed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

# Every tensor starts at a multiple of 64 bytes inside a flat buffer: any dtype can be viewed there,
# and CPU kernels see the same alignment as with torch's own allocator (also 64), so streamed and
# resident runs pick the same vectorised code paths and agree bitwise.
ALIGN_BYTES = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _storage_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides to store `t` with: its own when dense and non-overlapping (channels_last,
    transposed), so kernels see the layout they saw before streaming; contiguous otherwise."""
    if t.numel() == 0:
        return _contiguous_strides(t.shape)
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.size(d) == 1:
            continue  # a size-1 dimension is never stepped over, its stride is free
        if t.stride(d) != expected:
            return _contiguous_strides(t.shape)
        expected *= t.size(d)
    return tuple(t.stride())


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a block lives inside the block's flat buffer."""

    names: tuple[str, ...]  # names inside the block; several when a tensor is tied within it
    kind: str  # "param" or "buffer"
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes from the start of the flat buffer, a multiple of ALIGN_BYTES
    nbytes: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor as a view into `flat`, a uint8 buffer with the store's layout."""
        segment = flat[self.offset : self.offset + self.nbytes]  # (nbytes,) uint8
        return segment.view(self.dtype).as_strided(self.shape, self.stride)


@dataclasses.dataclass
class BoundTensor:
    """One tensor object of a module (a Parameter or a buffer) and every name it goes by."""

    tensor: torch.Tensor  # the object itself: its identity never changes while streamed
    names: list[str]
    kind: str
    persistent: bool
    device: torch.device  # where it lived before streaming; remove() puts it back there


def collect_tensors(module: nn.Module, stop: frozenset[int] = frozenset()) -> list[BoundTensor]:
    """Every parameter and buffer reachable from `module` without entering a module whose id is in
    `stop`, deduplicated by identity (tied tensors get all their names), in module order."""
    found: dict[int, BoundTensor] = {}

    def walk(sub: nn.Module, prefix: str) -> None:
        for kind, table in (("param", sub._parameters), ("buffer", sub._buffers)):
            for attr, t in table.items():
                if t is None:
                    continue
                name = prefix + attr
                persistent = kind == "param" or attr not in sub._non_persistent_buffers_set
                bound = found.get(id(t))
                if bound is None:
                    found[id(t)] = BoundTensor(t, [name], kind, persistent, t.device)
                elif name not in bound.names:
                    bound.names.append(name)
                    bound.persistent |= persistent
        for attr, child in sub._modules.items():
            if child is not None and id(child) not in stop:
                walk(child, f"{prefix}{attr}.")

    walk(module, "")
    for bound in found.values():
        t = bound.tensor
        plain = type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
        if not plain or t.is_quantized:
            raise TypeError(
                f"{bound.names[0]!r} is a {type(t).__name__} with layout {t.layout}: only plain "
                "dense tensors can be streamed"
            )
    return list(found.values())


def pack(tensors: Sequence[BoundTensor]) -> tuple[tuple[TensorEntry, ...], int]:
    """Pack `tensors` into one flat buffer: (entries, total bytes), every offset 64-byte aligned."""
    entries, cursor = [], 0
    for bound in tensors:
        t = bound.tensor
        offset = _round_up(cursor, ALIGN_BYTES)
        nbytes = t.numel() * t.element_size()
        strides = _storage_strides(t)
        entries.append(
            TensorEntry(
                tuple(bound.names), bound.kind, t.dtype, tuple(t.shape), strides, offset, nbytes
            )
        )
        cursor = offset + nbytes
    return tuple(entries), _round_up(cursor, ALIGN_BYTES)


def layout_nbytes(block: nn.Module) -> int:
    """Bytes of `block`'s flat buffer (its tensors, 64-byte aligned); works on meta blocks too."""
    return pack(collect_tensors(block))[1]


def pin_exact(buffer: torch.Tensor) -> None:
    """Page-lock `buffer` where it lies, at exactly its size, so H2D copies from it run async (DMA).

    Not `Tensor.pin_memory()` / `torch.empty(..., pin_memory=True)`: those go through torch's
    caching host allocator, which rounds every request up to a power of two (a 2.1 GB block would
    lock 4 GB; pytorch#95823) and keeps freed blocks cached. `cudaHostRegister` on a plain
    allocation locks the bytes we use and nothing more; `unpin` undoes it.
    """
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes == 0:
        return
    # Flag 1 = cudaHostRegisterPortable: pinned for every CUDA context, as torch's own helper does.
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})")


def unpin(ptr: int, nbytes: int) -> None:
    if nbytes:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err != 0:
            raise RuntimeError(f"cudaHostUnregister failed (cudaError {err})")


class HostBlockStore:
    """All parameters and buffers of one block in one contiguous host buffer, optionally pinned."""

    encoded = False  # the buffer is the block's flat layout itself (see weight_formats.py)

    def __init__(
        self,
        entries: Sequence[TensorEntry],
        nbytes: int,
        pinned: bool = False,
        buffer: torch.Tensor | None = None,
    ):
        self.entries = tuple(entries)
        self.nbytes = nbytes
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)  # plain allocation, see pin_exact
        elif (
            buffer.dtype != torch.uint8 or buffer.shape != (nbytes,) or buffer.device.type != "cpu"
        ):
            raise ValueError(
                f"a block's host buffer must be ({nbytes},) uint8 on the CPU, got "
                f"{tuple(buffer.shape)} {buffer.dtype} on {buffer.device}"
            )
        # Given: filled elsewhere (shared memory another process made, see multidevice.py).
        self.buffer = buffer
        self.pinned = pinned
        self._finalizer = None
        if pinned:
            pin_exact(self.buffer)
            # Unregister before the memory can be freed, even if close() is never called.
            self._finalizer = weakref.finalize(self, unpin, self.buffer.data_ptr(), nbytes)
            self._finalizer.atexit = False  # at exit the driver unpins; the context may be gone
        self.views = tuple(e.view(self.buffer) for e in self.entries)  # one per entry, host memory

    @classmethod
    def adopt(cls, tensors: Sequence[BoundTensor], pinned: bool = False) -> HostBlockStore:
        """Copy `tensors` (a block's, from `collect_tensors`) into a new store and point them at
        views of it.

        Their previous storage is freed unless referenced elsewhere, so the host never holds two
        copies of a block for longer than this call. Meta tensors get uninitialised bytes, to be
        filled by `fill()`.
        """
        store = cls(*pack(tensors), pinned=pinned)
        move_into(tensors, store.views)
        return store

    @classmethod
    def attach(
        cls, tensors: Sequence[BoundTensor], buffer: torch.Tensor, pinned: bool = False
    ) -> HostBlockStore:
        """A store over `buffer`, which already holds `tensors`' bytes in their packed layout
        (another process filled it), with the tensors pointed at its views: nothing is copied."""
        store = cls(*pack(tensors), pinned=pinned, buffer=buffer)
        for bound, view in zip(tensors, store.views):
            repoint(bound.tensor, view)
        return store

    @property
    def payload(self) -> torch.Tensor:
        """What one copy moves to the device: the buffer itself."""
        return self.buffer

    @property
    def payload_nbytes(self) -> int:
        return self.nbytes

    def after_copy(self, ordering) -> None:
        """The copy from `payload` has been queued (the disk tier's stores recycle a buffer
        then; this buffer is the store's own)."""

    def read(self) -> torch.Tensor:
        """The block's flat buffer (the store's own, not a copy)."""
        return self.buffer

    def tensors(self) -> dict[str, torch.Tensor]:
        """Host views by (first) name; writing into them changes what the next copy transfers."""
        return {e.names[0]: v for e, v in zip(self.entries, self.views)}

    def fill(self, source: Mapping[str, torch.Tensor], prefix: str = "") -> set[int]:
        """Copy tensors named `prefix + name` from `source` into the store, one at a time.

        `source` may be lazy (see `SafetensorsFile`): only one tensor is materialised at a time,
        so a checkpoint streams from the page cache into the store without a second copy in RAM.
        Dtypes are cast by `copy_`; shapes must match. Returns the indices of the entries filled.
        """
        return fill_views(self.entries, self.views, source, prefix)

    def close(self) -> None:
        """Unpin the buffer (if pinned); views stay readable as ordinary host memory."""
        if self._finalizer is not None:
            self._finalizer()


def move_into(tensors: Sequence[BoundTensor], views: Sequence[torch.Tensor]) -> None:
    """Copy each tensor into its view and re-point it there (meta tensors: re-point only)."""
    for bound, view in zip(tensors, views):
        if not bound.tensor.is_meta:
            view.copy_(bound.tensor.detach())
        repoint(bound.tensor, view)


def fill_views(
    entries: Sequence[TensorEntry],
    views: Sequence[torch.Tensor],
    source: Mapping[str, torch.Tensor],
    prefix: str,
) -> set[int]:
    filled = set()
    for k, (entry, view) in enumerate(zip(entries, views)):
        key = next((prefix + n for n in entry.names if prefix + n in source), None)
        if key is None:
            continue
        src = source[key]
        if tuple(src.shape) != entry.shape:
            raise ValueError(f"{key!r}: checkpoint shape {tuple(src.shape)} != {entry.shape}")
        view.copy_(src)
        filled.add(k)
    return filled


@dataclasses.dataclass(frozen=True)
class Extent:
    """Where one tensor's bytes lie in a .safetensors file, as stored (read by the disk tier)."""

    path: str
    offset: int  # bytes from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# safetensors' dtype names (its format spec) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors_header(path: str) -> dict[str, Extent]:
    """Every tensor's extent in one .safetensors file, from its header (an 8-byte little-endian
    length, then JSON with each tensor's dtype, shape and data offsets after the header).
    ValueError naming the file and tensor when the file is shorter than its header says."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base, out = 8 + n, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if base + end > size:
            raise ValueError(
                f"{path} is truncated: {key!r} ends at byte {base + end}, the file has {size}"
            )
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is not None:
            out[key] = Extent(path, base + begin, end - begin, dtype, tuple(info["shape"]))
    return out


class SafetensorsFile(Mapping):
    """A read-only mapping over one or more .safetensors files (the shards of one checkpoint).

    Each lookup opens the file, reads one tensor through its memory map and closes it again, so
    filling a host store tensor by tensor keeps one tensor's pages mapped at a time: the process
    holds about one copy of the weights (in the store), not a second in mapped file pages.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        from safetensors import safe_open

        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self._files: dict[str, str] = {}  # tensor name -> file
        self._headers: dict[str, dict[str, Extent]] = {}  # file -> its extents, when located
        for path in map(os.fspath, paths):
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in self._files:
                        raise ValueError(f"{key!r} is stored twice (again in {path})")
                    self._files[key] = path

    def locate(self, key: str) -> Extent | None:
        """Where tensor `key` lies on disk, as stored (for the disk tier); None for a dtype
        torch does not know."""
        path = self._files[key]
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
        return self._headers[path].get(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._files[key], framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


class RenamedWeights(Mapping):
    """A lazy mapping read through a key map (`names`: the module's name -> the source's key), for
    a checkpoint whose names differ from the module's by a rename only."""

    def __init__(self, source: Mapping[str, torch.Tensor], names: Mapping[str, str]):
        self.source, self.names = source, dict(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.source[self.names[name]]

    def locate(self, name: str) -> Extent | None:
        """Where tensor `name` lies on disk (the disk tier): a rename moves no bytes, so the
        source's extent of its key; None where the source cannot say. Without this the disk tier
        refused every renamed checkpoint (Wan's CLIP image encoder) as converted on load."""
        locate = getattr(self.source, "locate", None)
        return locate(self.names[name]) if locate is not None else None

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def repoint(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make the tensor object `t` alias `new`, keeping its identity, leafness and requires_grad."""
    if t.is_meta:
        # set_data refuses meta -> real storage; swapping implementations keeps the Python object.
        other = new.detach()
        if isinstance(t, nn.Parameter):
            other = nn.Parameter(other, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, other)
    else:
        t.data = new


@dataclasses.dataclass(frozen=True)
class SharedWeights:
    """A model's weights in shared memory, made once by a parent process for the processes it
    spawns (`loader.share_weights`); pickled, the tensors travel as handles, not bytes.

    `blocks[c]`: component c's blocks as every process holds them, one entry per block: a flat
    uint8 buffer in the packed layout (`pack`) each process derives from its own meta-built
    blocks (a raw store, or a block the device budget keeps resident), or a coded store's
    `weight_formats.SharedPayload`. A component whose blocks stay in the model's files (the disk
    tier) has none: each process reads them itself. `tensors[c]`: the rest of component c's
    tensors by state-dict name (for an unstreamed component, all of them). `weights` and
    `host_tier` are the placement's they were made for (the host tier resolved: "ram" or
    "disk").
    """

    tensors: dict[str, dict[str, torch.Tensor]]
    blocks: dict[str, list]
    weights: str = "raw"
    host_tier: str = "ram"
