"""Text-to-video sampling behind one interface, whatever the model family.

A `Pipeline` is a model opened for sampling (see `loader.open_pipeline`). It exposes the sampler
step-wise, `prepare` -> `denoise_step` ... -> `finish`, so a scheduler can batch requests at
denoising-step granularity (requests at different steps share one pass of the weights), and
`generate` for the simple case. The ends batch too: `prepare_batch` encodes the prompts of the
requests that arrive together in one pass of the text encoder (each distinct prompt once),
`finish_batch` decodes the clips that finish together, `DECODE_CHUNK` requests per pass of the
autoencoder. Requests come in resolved (`request.ResolvedVideo`); `resolve` checks a
`VideoRequest` against this model's limits.

Fine-tunes of the model kept as deltas over it (`deltas.py`) are registered by name
(`add_fine_tune`) and named per request (`fine_tune`): the model's weights stay the base's on the
host, and each pass computes with one fine-tune's, its delta added on the device as each block
loads (`streaming/variants.py`). The requests of a step are grouped by fine-tune, a pass per
group; with the denoisers streamed the groups' passes run block by block (`interleaves`), so a
block crosses once a step. Prompts are encoded per group too, for a fine-tune may change the
text encoder.
"""

from __future__ import annotations

import contextlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..host_memory import HOST_MEMORY_CHECK_ENV, host_memory_available
from ..interfaces import VideoModel
from ..request import ResolvedVideo, VideoRequest, resolve
from ..sources import ModelInfo
from ..streaming.streamer import StreamHandle
from ..streaming.variants import DeltaError, ResidentVariants, digest
from .step_cache import StepCurve

if TYPE_CHECKING:
    from ..compiled_blocks import CompiledBlocks
    from ..delta_format import ModelDelta
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


def _grouped(items, key: Callable[[Any], Any]) -> list[tuple[Any, list]]:
    """`items` grouped by `key`, groups in order of first appearance, items in order."""
    groups: dict[Any, list] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.items())


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
    denoisers: tuple[str, ...] = ()  # the components a denoising pass runs (set by the family)
    # Whether its states keep the clean clip each step predicts, for `preview_batch`.
    keep_predictions: bool = False

    def __init__(
        self, info: ModelInfo, handles: dict[str, StreamHandle], parts: dict[str, nn.Module]
    ):
        self.info = info
        self.handles = handles
        self.parts = parts  # the model's modules by component name
        # The adaptive step cache's calibration, when the model directory has one (`calibrate`),
        # with the single-reuse errors of each forecast it measured.
        self.step_curve = StepCurve.read(info.source.path)
        self.fine_tunes: dict[str, ModelDelta] = {}
        self._variants: dict[str, StreamHandle | ResidentVariants] = {}  # by component
        self._digests: dict | None = None  # the base's tensors' SHA-256, once a delta needs them
        self._on_disk: dict[str, bool] = {}  # by fine-tune: its deltas read from their file
        # Denoisers whose repeated block runs compiled (`Placement.compile`), by component.
        self.compiled: dict[str, CompiledBlocks] = {}

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
            fine_tunes=self.fine_tunes,
            **caps,
        )

    # -- fine-tunes kept as deltas over this model -------------------------------------------------

    def add_fine_tune(self, name: str, delta: ModelDelta, *, checked: bool = False) -> dict:
        """Register the fine-tune `delta` (`deltas.read_delta` / `make_delta`) under `name`:
        checked against this model's weights (DeltaError naming the first tensor that is not
        its base's; `checked`: done already, by a group's parent), its deltas kept in host
        memory, or when they do not fit there and `delta.mapped`, left in their file (a memory
        map: the disk tier; pageable copies, read as blocks load). Returns its card."""
        if name in self.fine_tunes:
            raise DeltaError(f"{self.name} already has a fine-tune {name!r}")
        if any(h.weights == "fp8" for h in self.handles.values()):
            # A delta is exact over the base's own words, not over their fp8 rounding.
            raise DeltaError("fine-tunes kept as deltas need the base's weights raw or lossless")
        dtype = self.compute_dtype
        if delta.dtype != dtype:
            raise DeltaError(
                f"this delta codes {delta.dtype} weights; {self.name} computes in {dtype}: make "
                "one for that dtype"
            )
        free, bound = host_memory_available()
        on_disk = delta.nbytes > free and os.environ.get(HOST_MEMORY_CHECK_ENV) != "off"
        if on_disk and not delta.mapped:
            raise DeltaError(
                f"host memory: fine-tune {name!r} needs {delta.nbytes / 1e9:.2f} GB for its "
                f"delta, {free / 1e9:.2f} GB is available ({bound}); load it mapped "
                "(ModelDelta.load(mapped=True)) to serve it from disk"
            )
        if not checked:
            if self._digests is None:
                self._digests = self._held_digests()
            delta.check(self._digests, self.name)
        added = []
        try:
            for component, deltas in delta.deltas.items():
                owner = self._variants.get(component)
                if owner is None:
                    owner = self.handles.get(component) or ResidentVariants(self.parts[component])
                    self._variants[component] = owner
                owner.add_variant(name, deltas, on_disk)
                added.append(owner)
        except Exception:
            for owner in added:
                owner.remove_variant(name)
            raise
        self.fine_tunes[name] = delta
        self._on_disk[name] = on_disk
        return self.fine_tune_card(name)

    def _held_digests(self) -> dict[str, dict[str, str]]:
        """The SHA-256 of every tensor of every component as this model holds it, by every
        name it goes by (what a delta over it records: `deltas.base_digests`). Reads every
        weight once: made before any fine-tune is registered, and kept."""
        out = {}
        for component, module in self.parts.items():
            handle = self.handles.get(component)
            tensors = handle.held_tensors() if handle else module.state_dict().items()
            out[component] = {name: digest(t) for name, t in tensors}
        return out

    def remove_fine_tune(self, name: str) -> None:
        """Unregister fine-tune `name` (the model computes with the base's weights after)."""
        for owner in self._variants.values():
            owner.remove_variant(name)
        self.fine_tunes.pop(name, None)
        self._on_disk.pop(name, None)

    def fine_tune_card(self, name: str) -> dict:
        """A registered fine-tune: its name, base, the host bytes its deltas hold here (coded
        again per streamed block: a little less than the file's per-tensor ones) and the
        tensors it changes."""
        delta = self.fine_tunes[name]
        held = sum(
            owner.variant_nbytes(name)
            for component, owner in self._variants.items()
            if component in delta.deltas
        )
        changed = sum(len(d) for d in delta.deltas.values())
        tier = "disk" if self._on_disk[name] else "ram"
        return {"name": name, "base": self.name, "bytes": held, "tensors": changed, "tier": tier}

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (its first floating parameter's)."""
        for module in self.parts.values():
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    return p.dtype
        return torch.float32

    @contextlib.contextmanager
    def using(
        self,
        fine_tune: str | None,
        blocks_only: bool = False,
        components: Collection[str] | None = None,
    ) -> Iterator[None]:
        """Compute with fine-tune `fine_tune`'s weights (None: the model's own) from here on, in
        `components` (None: every component); with `blocks_only` in the streamed blocks only
        (see `interleaves`)."""
        changed = self.fine_tunes[fine_tune].deltas if fine_tune is not None else {}
        for component, owner in self._variants.items():
            if components is None or component in components:
                owner.select_variant(fine_tune if component in changed else None, blocks_only)
        yield

    def weights(self, states: list, blocks_only: bool = False) -> contextlib.AbstractContextManager:
        """The weights a pass over `states` computes with (they share a fine-tune: `passes`):
        the denoisers' alone, the components a pass runs. The others (the text encoders) keep
        what they hold: switching them per pass would decode their deltas for nothing, twice a
        fine-tune a step in a mixed batch; `prepare_batch` selects them with `using`."""
        fine_tune = states[0].fine_tune if states else None
        return self.using(fine_tune, blocks_only, self.denoisers or None)

    def interleaves(self, parts: list[list]) -> bool:
        """Whether the passes `parts` of one step run block by block (`loop.forward_interleaved`):
        when they are of several fine-tunes and every denoiser streams, so each block crosses
        to the device once for all of them and each fine-tune's delta is put on it in turn."""
        return (
            self.batched
            and len({p[0].fine_tune for p in parts}) > 1
            and bool(self.denoisers)
            and all(name in self.handles for name in self.denoisers)
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
        `.step`, `.num_steps`, `.done`, `.passes` (steps that ran a pass of the model) and
        `.fine_tune`."""
        return self.prepare_batch([video])[0]

    def prepare_batch(self, videos: list[ResolvedVideo]) -> list:
        """`prepare` for requests that arrive together: the prompts of those of one fine-tune in
        one pass of the text encoder. Each state is the one `prepare` makes (its noise from its
        own seed); a request that cannot be prepared raises for all (retry them alone to find
        it)."""
        unknown = {v.fine_tune for v in videos} - {None, *self.fine_tunes}
        if unknown:
            raise ValueError(f"{self.name} has no fine-tune {sorted(unknown)[0]!r} registered")
        states: list = [None] * len(videos)
        for fine_tune, group in _grouped(range(len(videos)), lambda i: videos[i].fine_tune):
            with self.using(fine_tune):
                for i, state in zip(group, self._prepare_batch([videos[i] for i in group])):
                    state.keep_x0 = self.keep_predictions
                    states[i] = state
        return states

    @abstractmethod
    def _prepare_batch(self, videos: list[ResolvedVideo]) -> list:
        """The family's `prepare_batch` for requests of one fine-tune (selected already)."""

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
        The reference mode (`batched` False) runs each request in a pass of its own. Requests
        of different fine-tunes never share a pass."""
        if not self.batched:
            return [[state] for state in states]
        groups = _grouped(states, lambda s: s.fine_tune)
        # The fine-tune the denoisers hold now runs first: one switch of weights (a delta taken
        # off, one put on) less a step than any other order. Outputs do not depend on the order.
        held = self._held_fine_tune()
        groups.sort(key=lambda group: group[0] != held)  # stable: the others keep their order
        return [part for _, group in groups for part in self._passes(group)]

    def _held_fine_tune(self) -> str | None:
        """The fine-tune the first denoiser with fine-tunes registered computes with (None: the
        base's weights)."""
        for name in self.denoisers:
            owner = self._variants.get(name)
            if owner is not None:
                return owner.variant
        return None

    def _passes(self, states: list) -> list[list]:
        """`passes` for requests of one fine-tune."""
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

    @torch.no_grad()
    def preview_batch(self, states: list) -> list[np.ndarray | None]:
        """A frame of each state's clean clip as its last step predicted it (`keep_predictions`),
        decoded cheaply (`decode_preview`, the states in one pass): uint8 `(H, W, 3)`, or None
        for a state that keeps no prediction or has made no step."""
        kept = [i for i, s in enumerate(states) if s.x0 is not None]
        out: list[np.ndarray | None] = [None] * len(states)
        for rows in decode_chunks([states[i].x0.shape for i in kept], self.decode_chunk):
            x0 = torch.cat([states[kept[r]].x0 for r in rows])  # (B, C, F', H', W')
            for r, frame in zip(rows, self.decode_preview(x0)):
                out[kept[r]] = frame
        return out

    def decode_preview(self, x0: torch.Tensor) -> np.ndarray:
        """Clean-clip latents `(B, C, F', H', W')` -> one uint8 frame of each `(B, H, W, 3)`,
        as cheaply as the family's decoder allows."""
        raise NotImplementedError(f"{self.name}: this model family decodes no previews")

    def finish(self, state) -> np.ndarray:
        """Decode a finished state to uint8 frames `(F, H, W, 3)`."""
        return self.finish_batch([state])[0]

    def finish_chunks(self, state) -> Iterator[np.ndarray]:
        """`finish` in consecutive uint8 chunks `(f, H, W, 3)` as the decoder makes them, so a
        consumer (video.write_mp4_chunks) can take each while the next decodes; a family whose
        decoder is not causal in time yields the whole clip as one chunk
        (`finish_batch_chunks`)."""
        for _, chunk in self.finish_batch_chunks([state]):
            yield chunk

    @abstractmethod
    def finish_batch(self, states: list) -> list[np.ndarray]:
        """`finish` for states that finish together, `decode_chunk` per pass of the autoencoder
        (`decode_chunks`); one that cannot be decoded raises for all (retry them alone)."""

    def denoise_step(self, states: list) -> dict[str, int]:
        """Advance every unfinished state by one step, in one batched pass of the weights;
        returns the bytes the streamer moved to the device meanwhile (a counter: no device
        sync) and, with compiled blocks, the recompiles the step caused."""
        before, recompiles = self.h2d_bytes(), self._recompiles()
        self._step(states)
        counters = {"h2d_bytes": self.h2d_bytes() - before} if self.handles else {}
        if self.compiled:
            counters["compile_recompiles"] = self._recompiles() - recompiles
        return counters

    def _recompiles(self) -> int:
        return sum(c.stats()["recompiles"] for c in self.compiled.values())

    def h2d_bytes(self) -> int:
        return sum(h.h2d_bytes for h in self.handles.values())

    def stats(self) -> dict[str, dict]:
        """The streamer's accounting of each streamed module, by name."""
        return {name: handle.stats() for name, handle in self.handles.items()}

    def compile_stats(self) -> dict[str, dict]:
        """Each compiled denoiser's graphs, recompiles and graph breaks, by name (none when the
        blocks run eagerly)."""
        return {name: compiled.stats() for name, compiled in self.compiled.items()}

    def warm_up(self) -> bool:
        """Run one step of a request at the model's defaults and drop it, so that the first
        request at that shape finds its blocks compiled (and the allocator warm). False, and
        nothing run, for a model that needs a first-frame image: its first request pays."""
        if self.info.limits.image_required:
            return False
        state = self.prepare(self.resolve(VideoRequest(prompt="warm-up", seed=0)))
        self.denoise_step([state])
        return True

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
        for compiled in self.compiled.values():
            compiled.remove()
        self.compiled = {}
