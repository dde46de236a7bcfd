"""Text-to-video sampling behind one interface, whatever the model family.

A `Pipeline` is a model opened for sampling (see `loader.open_pipeline`). It exposes the sampler
step-wise, `prepare` -> `denoise_step` ... -> `finish`, so a scheduler can batch requests at
denoising-step granularity (requests at different steps share one pass of the weights), and
`generate` for the simple case. The ends batch too: `prepare_batch` encodes the prompts of the
requests that arrive together in one pass of the text encoder (each distinct prompt once),
`finish_batch` decodes the clips that finish together, `DECODE_CHUNK` requests per pass of the
autoencoder. Requests come in resolved (`request.ResolvedVideo`); `resolve` checks a
`VideoRequest` against this model's limits.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..interfaces import VideoModel
from ..request import ResolvedVideo, VideoRequest, resolve
from ..sources import ModelInfo
from ..streaming.streamer import StreamHandle
from .step_cache import StepCurve

if TYPE_CHECKING:
    from ..lora import Adapter, AdapterRouter

# Clips decoded in one pass of the autoencoder. Decoding's activations grow with the rows of a
# pass (a 3D VAE's are many times its latents), so more finished requests than this decode in
# several passes: the peak stays that of DECODE_CHUNK clips however large the running batch.
DECODE_CHUNK = 4

# Rows per pass of a resident model on a CPU (the denoiser's, and Wan's UMT5 prompts). Past a few
# hundred tokens a row, one pass of many rows costs more per row than several passes of few: its
# activations outgrow the caches (docs/history.md, "Passes of a few rows"). A streamed
# model, or one on a GPU, takes every row in one pass: there the weights cross once a pass, or a
# wide batch is what the device wants.
CPU_ROWS_PER_PASS = 4


def decode_chunks(shapes: Sequence[tuple], size: int = DECODE_CHUNK) -> Iterator[list[int]]:
    """Indices of states to decode together: at most `size` at a time, of one latent shape
    each (a pass needs one), in the order given."""
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(tuple(shape), []).append(i)
    for indices in groups.values():
        for start in range(0, len(indices), size):
            yield indices[start : start + size]


def distinct(items: Sequence[str]) -> tuple[list[str], list[int]]:
    """The distinct `items` in first-seen order, and each item's index among them: requests that
    share a prompt (most share one negative prompt) have it encoded once."""
    index: dict[str, int] = {}
    where = [index.setdefault(item, len(index)) for item in items]
    return list(index), where


class Pipeline(VideoModel, ABC):
    """A loaded model ready to sample clips; `handles` are its streamed modules (may be empty).
    `adapters` holds the LoRA adapters registered on it, for a family that takes them."""

    adapters: AdapterRouter | None = None
    batched: bool = True  # False: the reference mode, each request's rows in passes of their own
    decode_chunk: int = DECODE_CHUNK  # clips per pass of the autoencoder in `finish_batch`
    load_adapter: Callable[[str, Any], Adapter] | None = None  # the family's `load_adapter`
    sp: Any = None  # the ranks its tokens are split over (`parallelize`); None: one process

    def __init__(self, info: ModelInfo, handles: dict[str, StreamHandle]):
        self.info = info
        self.handles = handles
        # The adaptive step cache's calibration, when the model directory has one (`calibrate`),
        # with the single-reuse errors of each forecast it measured.
        self.step_curve = StepCurve.read(info.source.path)

    @property
    def name(self) -> str:
        return self.info.name

    def resolve(self, request: VideoRequest, **caps) -> ResolvedVideo:
        """Fill defaults and check limits; RequestError names the bad field (see `request.resolve`)."""
        info = self.info
        return resolve(
            request,
            info.limits,
            info.sampling,
            model=self.name,
            adapters=self.adapter_defaults(),
            **caps,
        )

    # -- LoRA adapters ----------------------------------------------------------------------------

    def add_adapter(self, name: str, path, *, replace: bool = False) -> dict:
        """Register the LoRA file at `path` under `name`: converted once from its key layout,
        checked against this model (AdapterError naming the first key that does not fit), its
        factors kept on the device. Returns its card (name, base, rank, bytes, defaults)."""
        from ..lora import AdapterError

        if self.adapters is None or self.load_adapter is None:
            raise AdapterError(f"{self.name} takes no LoRA adapters")
        adapter = self.load_adapter(name, path)
        return {**self.adapters.register(adapter, replace=replace).card(), "base": self.name}

    def register_adapter(self, adapter: Adapter, *, replace: bool = False) -> dict:
        """Register an adapter already converted (`loader.load_adapter`); returns its card."""
        from ..lora import AdapterError

        if self.adapters is None:
            raise AdapterError(f"{self.name} takes no LoRA adapters")
        return {**self.adapters.register(adapter, replace=replace).card(), "base": self.name}

    def remove_adapter(self, name: str) -> None:
        """Unregister adapter `name` (its factors are freed with the last reference)."""
        if self.adapters is not None:
            self.adapters.remove(name)

    def adapter_cards(self) -> list[dict]:
        if self.adapters is None:
            return []
        return [{**a.card(), "base": self.name} for a in self.adapters.adapters.values()]

    def adapter_defaults(self) -> dict[str, dict]:
        """Registered adapters by name, each with the sampling defaults it carries."""
        if self.adapters is None:
            return {}
        return {n: dict(a.defaults) for n, a in self.adapters.adapters.items()}

    def parallelize(self, sp) -> None:
        """Split each step's tokens over the ranks of `sp` (a `parallel.SequenceGroup`), in place;
        a family that supports it applies its transform here and keeps `sp` (see
        `Family.check_parallel`)."""
        raise ValueError(f"{self.name}: this model family has no sequence-parallel transform")

    def prepare(self, video: ResolvedVideo) -> Any:
        """Encode the prompts and draw the starting noise of one request: a sampling state with
        `.step`, `.num_steps`, `.done` and `.passes` (steps that ran a pass of the model)."""
        return self.prepare_batch([video])[0]

    @abstractmethod
    def prepare_batch(self, videos: list[ResolvedVideo]) -> list:
        """`prepare` for requests that arrive together: their prompts in one pass of the text
        encoder. Each state is the one `prepare` makes (its noise from its own seed); a request
        that cannot be prepared raises for all (retry them alone to find it)."""

    @abstractmethod
    def _step(self, states: list) -> None:
        """The family's step: advance every unfinished state by one step, in one batched pass of
        the weights (`denoise_step` is the public one)."""

    def one_pass(self, module: str | None = None) -> bool:
        """Whether a pass takes every row at once: the weights of `module` (None: of any module)
        stream, or the model is on a GPU (see CPU_ROWS_PER_PASS)."""
        streamed = module in self.handles if module else bool(self.handles)
        return streamed or self.device.type != "cpu"

    def passes(self, states: list) -> list[list]:
        """`states` in the passes of one step: all together, or on a CPU with the weights
        resident, consecutive runs of at most CPU_ROWS_PER_PASS rows (two for a guided state).
        The reference mode (`batched` False) runs each request in a pass of its own."""
        if not self.batched:
            return [[state] for state in states]
        if self.one_pass():
            return [states] if states else []
        parts, rows = [], CPU_ROWS_PER_PASS
        for state in states:
            n = 2 if state.guided else 1
            if rows + n > CPU_ROWS_PER_PASS:
                parts.append([])
                rows = 0
            parts[-1].append(state)
            rows += n
        return parts

    @contextlib.contextmanager
    def first_block_only(self) -> Iterator[None]:
        """Around a first-block cache's run of block 0: the streamer copies no block ahead of it,
        since the step may reuse and run no other (it copies block 1 when block 1 loads)."""
        with contextlib.ExitStack() as stack:
            for handle in self.handles.values():
                stack.enter_context(handle.ordered([0]))
            yield

    def finish(self, state) -> np.ndarray:
        """Decode a finished state to uint8 frames `(F, H, W, 3)`."""
        return self.finish_batch([state])[0]

    @abstractmethod
    def finish_batch(self, states: list) -> list[np.ndarray]:
        """`finish` for states that finish together, `decode_chunk` per pass of the autoencoder
        (`decode_chunks`); one that cannot be decoded raises for all (retry them alone)."""

    def denoise_step(self, states: list) -> dict[str, int]:
        """Advance every unfinished state by one step, in one batched pass of the weights;
        returns the bytes the streamer moved to the device meanwhile (a counter: no device
        sync)."""
        before = self.h2d_bytes()
        self._step(states)
        return {"h2d_bytes": self.h2d_bytes() - before} if self.handles else {}

    def h2d_bytes(self) -> int:
        return sum(h.h2d_bytes for h in self.handles.values())

    def stats(self) -> dict[str, dict]:
        """The streamer's accounting of each streamed module, by name."""
        return {name: handle.stats() for name, handle in self.handles.items()}

    def write_trace(self, path) -> None:
        """One Chrome trace (Perfetto) of every streamed module's block copies and computes."""
        events = []
        for k, (name, handle) in enumerate(self.handles.items()):
            events += handle.trace_events(label=name, track=10 * k)
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def generate(
        self,
        request: VideoRequest | ResolvedVideo,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Sample one clip; `progress(step, total)` is called after every step."""
        video = request if isinstance(request, ResolvedVideo) else self.resolve(request)
        state = self.prepare(video)
        while not state.done:
            self.denoise_step([state])
            if progress is not None:
                progress(state.step, state.num_steps)
        return self.finish(state)

    def close(self) -> None:
        """Stop streaming: the streamed modules' weights go back to ordinary host tensors."""
        for handle in self.handles.values():
            handle.remove()
        self.handles = {}
