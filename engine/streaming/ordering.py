"""Ordering primitives: the streams and events that order copies against compute.

Streaming (streamer.py) and the training step's gradient drain (training/blockwise.py) make every ordering
call through one small interface, `Ordering`: on CUDA a dedicated copy stream beside the compute
stream, ordered by events (`_CudaOrdering`); on the CPU synchronous memcpy, where every wait is a
no-op (`_HostOrdering`). Because nothing else orders their work, a simulated device that implements
the same interface (tests/support/simulated_device.py) checks the whole protocol without a GPU.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Protocol

import torch

from .host_store import pin_exact, unpin

__all__ = ["Ordering", "make_ordering"]


class Ordering(Protocol):
    """Every ordering call the streamer and the training step's gradient drain make.

    Two streams: the compute stream (whatever stream is current) and one copy stream of this
    ordering's own; the host drives both. Work queued on one stream runs in order; work on
    different streams is ordered only by an event recorded on one and waited on by the other, and
    the host knows a copy has finished only after a host wait. `make_ordering(device)` gives the
    device's own (`_CudaOrdering`, `_HostOrdering`); tests pass a simulated device here, which runs
    copies at any moment these rules allow and reports the reads and writes they do not order.
    """

    device_is_host: bool  # device memory is host memory (the CPU): nothing crosses a bus

    def sibling(self) -> Ordering:
        """Another copy stream on the same device and compute stream."""

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """`(nbytes,)` uint8 device memory, allocated in the compute stream's order."""

    def host_buffer(self, numel: int) -> torch.Tensor:
        """`(numel,)` fp32 host memory that copies from the device may fill asynchronously."""

    def new_event(self) -> Any:
        """An event that has not been recorded (waiting on it does nothing)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)` on the copy stream: it reads `src` and writes `dst` later."""

    def record_on_copy(self, event: Any) -> None:
        """`event` now marks the end of the work queued on the copy stream so far."""

    def record_on_compute(self, event: Any) -> None:
        """`event` now marks the end of the work queued on the compute stream so far."""

    def compute_wait(self, event: Any) -> None:
        """Compute work queued from now on starts after the work `event` marks."""

    def copy_wait(self, event: Any) -> None:
        """Copies queued from now on start after the work `event` marks."""

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """`tensor`'s memory, once freed, is not reused before the copies queued so far finish."""

    def host_wait(self, event: Any) -> None:
        """Block the calling thread until the work `event` marks has finished."""

    def drain_copies(self) -> None:
        """Block the host until every queued copy has finished."""

    def synchronize(self) -> None:
        """Block the host until all work on the device has finished."""

    def stamp(self, on_copy: bool) -> Any:
        """A time mark on the copy or the compute stream (for `timing=True`)."""

    def seconds(self, origin: Any, stamp: Any) -> float:
        """Seconds from one time mark to another."""


class _HostOrdering:
    """device="cpu": copies are synchronous memcpy, so a copy has landed when `copy` returns and no
    compute can overlap it. Every event and wait is therefore a no-op; stamps are perf_counter."""

    # Device memory is host memory: gradients need no copy to reach the CPU optimizer.
    device_is_host = True

    def sibling(self) -> _HostOrdering:
        return _HostOrdering()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_buffer(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32)

    def new_event(self) -> Any:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_on_copy(self, event: Any) -> None:
        pass

    def record_on_compute(self, event: Any) -> None:
        pass

    def compute_wait(self, event: Any) -> None:
        pass

    def copy_wait(self, event: Any) -> None:
        pass

    def keep_alive(self, tensor: torch.Tensor) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        pass

    def drain_copies(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def stamp(self, on_copy: bool) -> Any:
        return time.perf_counter()

    def seconds(self, origin: Any, stamp: Any) -> float:
        return stamp - origin


class _CudaOrdering:
    """A dedicated copy stream beside whatever stream is current for compute, ordered by events.

    Each method is one CUDA call; the reason for every call lives at its call site (see the table
    in docs/streaming.md and the tests that delete each one)."""

    device_is_host = False

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def sibling(self) -> _CudaOrdering:
        return _CudaOrdering(self.device)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        # Allocated on the compute stream: the caching allocator may hand out memory that kernels
        # queued there earlier still use (callers order their first copy after an event for it).
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, numel: int) -> torch.Tensor:
        """A page-locked fp32 host buffer, locked at its exact size (see `pin_exact`) and unlocked
        when it is freed."""
        buffer = torch.empty(numel, dtype=torch.float32)
        nbytes = buffer.numel() * buffer.element_size()
        pin_exact(buffer)
        # Unregister before the memory is freed; at exit the driver unpins (the context may be gone).
        weakref.finalize(buffer, unpin, buffer.data_ptr(), nbytes).atexit = False
        return buffer

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)  # async only to/from page-locked host memory

    def record_on_copy(self, event: torch.cuda.Event) -> None:
        event.record(self.copy_stream)

    def record_on_compute(self, event: torch.cuda.Event) -> None:
        event.record(self._compute_stream())

    def compute_wait(self, event: torch.cuda.Event) -> None:
        self._compute_stream().wait_event(event)

    def copy_wait(self, event: torch.cuda.Event) -> None:
        self.copy_stream.wait_event(event)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        # The caching allocator reuses a freed block on its own (compute) stream at once; this makes
        # it wait for the work queued on the copy stream so far, which still reads the tensor.
        tensor.record_stream(self.copy_stream)

    def host_wait(self, event: torch.cuda.Event) -> None:
        # Host sync (of the calling thread only): callers read host memory a copy is filling.
        event.synchronize()

    def drain_copies(self) -> None:
        # Host sync, never in the block loop: callers are about to write host memory that a queued
        # DMA may still be reading; without it the device could receive half-updated weights.
        self.copy_stream.synchronize()

    def synchronize(self) -> None:
        # Host sync, only in remove(): slots are freed and host stores unpinned next; without it a
        # queued copy or kernel could touch memory that is no longer ours.
        torch.cuda.synchronize(self.device)

    def stamp(self, on_copy: bool) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.copy_stream if on_copy else self._compute_stream())
        return event

    def seconds(self, origin: torch.cuda.Event, stamp: torch.cuda.Event) -> float:
        # Host sync, only when stats or a trace are read: elapsed_time needs both events completed.
        origin.synchronize()
        stamp.synchronize()
        return origin.elapsed_time(stamp) / 1e3


def make_ordering(device: str | torch.device) -> Ordering:
    """The ordering backend of a device: CUDA streams and events, or synchronous CPU copies."""
    device = torch.device(device)
    if device.type == "cpu":
        return _HostOrdering()
    if device.type == "cuda":
        return _CudaOrdering(device)
    raise ValueError(f"device {device} is not supported: use 'cpu' or 'cuda'")
