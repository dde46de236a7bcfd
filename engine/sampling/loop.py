"""The sampler loop every model family shares: one denoising step over a batch of requests.

A step groups the unfinished requests by the expert that owns their current time (one group for
a model with one denoiser; Wan2.2-A14B's high- and low-noise experts are two), asks each
request's step cache whether it reuses an earlier output, runs the rest through the expert in
passes, both halves of every guidance pair together, combines each guidance pair, records the
output in the request's cache and hands it to the family's update rule.

A family supplies the hooks (`Sampler`): which expert a request is at, how a step's requests
split into passes, a forward pass over some requests' rows, that pass cut at its blocks
(`ForwardCut`, for a cache that decides after the first block) and its update rule (our Euler
step, or the model's diffusers scheduler). A request's state declares `SamplingState`.

The first-block cache (step_cache.py) decides inside the pass: `forward_probed` runs every row
through the prologue and the first block, lets each probing request compare its first residual
with its cache's, and runs the remaining blocks only over the rows that did not reuse. Under
sequence parallel (parallel/sequence.py) the cut's blocks run on this rank's share of the tokens, as the
model's own forward does: block 0 takes the whole sequence and keeps this rank's tokens, the
epilogue gathers them; a probing request's measure is reduced over the ranks (step_cache.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from .step_cache import StepCache, extrapolate


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance: float) -> torch.Tensor:
    """Classifier-free guidance: extrapolate from the unconditional toward the conditional
    output, in the outputs' dtype."""
    return v_uncond + guidance * (v_cond - v_uncond)


class GuidanceMemory:
    """The guidance direction `v_cond - v_uncond` of a request's last two guided steps, per
    expert, by flow time: what the steps its guidance interval leaves out take instead of an
    unconditional pass, extrapolated linearly to their flow time (from one step: as it is).

    Dropping guidance there outright moves the clip further: on the packaged model, with the
    last 40% of 20 steps unguided, 32.6 dB PSNR against full guidance dropped, 35.4 dB forecast,
    adherence alike (benchmarks/samplers.py, docs/sampling.md)."""

    def __init__(self):
        self._held: dict[int, list[tuple[float, torch.Tensor]]] = {}

    def record(self, expert: int, t: float, delta: torch.Tensor) -> None:
        self._held[expert] = [*self._held.get(expert, [])[-1:], (t, delta)]

    def forecast(self, expert: int, t: float) -> torch.Tensor | None:
        """The direction at flow time `t`; None before the expert's first guided step."""
        held = self._held.get(expert)
        if not held:
            return None
        return extrapolate([h[0] for h in held], [h[1] for h in held], t)


class SamplingState(Protocol):
    """One request as the loop sees it; a family's state adds its latents and conditions."""

    step: int
    cache: StepCache | None
    guidance: float
    row_passes: int  # rows of the passes it ran (two a guided step): the loop counts them
    # The clean clip its last step predicted, `x - t * v` `(1, C, F, H, W)`, kept when
    # `keep_x0` (for previews of a video while it renders).
    keep_x0: bool
    x0: torch.Tensor | None
    # Set when a guidance interval leaves some steps unguided (`GuidanceMemory`); else None.
    guidance_memory: GuidanceMemory | None

    @property
    def done(self) -> bool: ...

    @property
    def guided(self) -> bool:
        """Whether the request runs a guidance pair this step: its conditional and unconditional
        rows (a guidance interval turns it off on some steps)."""
        ...

    def flow_time(self, step: int) -> Any:
        """The flow time (1: noise, 0: data) at `step`, as the step cache reads it."""
        ...

    def clip_latents(self) -> torch.Tensor:
        """The clip's latents as they stand, `(1, C, F, H, W)`, as the step cache records them."""
        ...


class ForwardCut(ABC):
    """A denoiser's forward pass over the rows of some requests, cut at its blocks.

    Made for one pass (it holds the pass's inputs); `prologue`, then `block(i)` for each block,
    then `epilogue` is the model's own forward, op for op. `adapters` names each row's LoRA
    adapters for `router` (an `AdapterRouter`; None: the model takes none). `sp` (a
    `parallel.SequenceGroup`; None: one process): the model's tokens are split over its ranks,
    `block(0)` takes every token and returns this rank's, later blocks take and return this
    rank's, and `epilogue` gathers them."""

    router: Any = None
    adapters: list | None = None
    sp: Any = None

    @property
    @abstractmethod
    def depth(self) -> int:
        """The number of blocks."""

    @abstractmethod
    def prologue(self) -> tuple[torch.Tensor, Any]:
        """Everything before the first block: tokens `(B, N, D)` and what the blocks read."""

    @abstractmethod
    def block(self, i: int, h: torch.Tensor, carry: Any) -> torch.Tensor:
        """Block `i` on tokens `(B, N, D)`."""

    @abstractmethod
    def rows(self, carry: Any, index: torch.Tensor) -> Any:
        """What the blocks read, for some rows of the pass (`index`: row numbers)."""

    @abstractmethod
    def epilogue(self, h: torch.Tensor, carry: Any) -> torch.Tensor:
        """Everything after the last block: the model's output `(B, C, F, H, W)`."""

    def local(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's tokens `(B, n, D)` of the whole sequence `h` `(B, N, D)`, as block 0 keeps
        them (contiguous equal shards in rank order); `h` itself on one process."""
        if self.sp is None:
            return h
        return h.chunk(self.sp.world, dim=1)[self.sp.rank]  # (B, N / P, D)

    def scope(self, index: Sequence[int] | None = None) -> AbstractContextManager:
        """Around a part of the pass: each row's adapters applied (`index`: of some rows only)."""
        if self.router is None or self.adapters is None:
            return nullcontext()
        rows = self.adapters if index is None else [self.adapters[i] for i in index]
        return self.router.rows(rows)


class Sampler(ABC):
    """What a family supplies to the sampler loop."""

    def expert(self, state) -> int:
        """The expert that runs `state`'s current step (its step cache keeps one history each)."""
        return 0

    def passes(self, states: list) -> list[list]:
        """How the requests that run an expert this step split into passes."""
        return [states] if states else []

    @abstractmethod
    def forward(self, expert: int, states: list) -> list[torch.Tensor]:
        """One pass of `expert` over the rows of `states` (each request's conditional row, then its
        unconditional one when guided): each request's output rows `(1 or 2, C, F, H, W)`."""

    def cut(self, expert: int, states: list) -> ForwardCut:
        """The same pass, cut at its blocks, for a step cache that decides inside it."""
        raise ValueError("this model's forward is not cut at its blocks: no first-block cache")

    def first_block_only(self) -> AbstractContextManager:
        """Entered around the first block of a cut pass, which may be the only block the step
        runs (a streamed model's pipeline stops the streamer copying the next block ahead)."""
        return nullcontext()

    def weights(self, states: list, blocks_only: bool = False) -> AbstractContextManager:
        """Entered around a pass over `states`: the weights it computes with (a fine-tune kept
        as a delta, which all of a pass's requests share: see `passes`); `blocks_only`: around
        its blocks alone (see `interleaves`)."""
        return nullcontext()

    def interleaves(self, parts: list[list]) -> bool:
        """Whether the passes `parts` of one step run block by block (`forward_interleaved`)."""
        return False

    @abstractmethod
    def update(self, state, output: torch.Tensor) -> None:
        """Advance `state` by one step given its model output `(1, C, F, H, W)`, guidance
        combined: the family's update rule (it also counts the step)."""


@torch.no_grad()
def sample_step(sampler: Sampler, states: list) -> None:
    """Advance every unfinished state of `states` by one step of its own schedule.

    Requests at different steps share the pass of their expert, so a streamed model moves its
    weights once per step and expert for all of them. A request whose step cache reuses an
    earlier output stays out of the pass; when every request of an expert reuses, the expert does
    not run. The experts run in order; each request is in the group of the expert it is at when
    the step begins, so it advances once."""
    states = [s for s in states if not s.done]
    experts = [sampler.expert(s) for s in states]
    for e in sorted(set(experts)):
        group = [s for s, x in zip(states, experts) if x == e]
        reuse = [
            s.cache is not None
            and not s.cache.probes
            and s.cache.reuse(s.step, s.flow_time(s.step), s.flow_time(s.step + 1), key=e)
            for s in group
        ]
        computed = iter(_compute(sampler, e, [s for s, r in zip(group, reuse) if not r]))
        for s, reused in zip(group, reuse):
            t = s.flow_time(s.step)
            if reused:
                output = s.cache.output(t, key=e)
            else:
                output, ran = next(computed)  # ran: False when a first-block cache reused
                if ran:
                    s.row_passes += 2 if s.guided else 1
                memory = s.guidance_memory
                if s.guided:
                    if memory is not None:
                        memory.record(e, float(t), output[:1] - output[1:2])
                    output = cfg_combine(output[:1], output[1:2], s.guidance)
                elif memory is not None and (delta := memory.forecast(e, float(t))) is not None:
                    # cfg_combine's extrapolation, with the direction forecast: no uncond row.
                    output = output + (s.guidance - 1) * delta
                if ran and s.cache is not None:
                    s.cache.record(t, s.clip_latents(), output, key=e)
            if s.keep_x0:
                s.x0 = s.clip_latents() - t * output  # (1, C, F, H, W): the flow's clean end
            sampler.update(s, output)


def _compute(sampler: Sampler, e: int, run: list) -> list[tuple[torch.Tensor, bool]]:
    """Each request of `run`'s output rows from the passes of expert `e`, in `run`'s order, and
    whether its rows ran every block. A pass holding a request whose cache decides after the
    first block is cut. (Passes may group the requests in another order: by fine-tune.)"""
    outputs = {}
    parts = sampler.passes(run)
    probed = any(s.cache is not None and s.cache.probes for s in run)
    if not probed and sampler.interleaves(parts):
        for part, done in zip(parts, forward_interleaved(sampler, e, parts)):
            outputs.update(zip(map(id, part), done))
        return [outputs[id(s)] for s in run]
    for part in parts:
        with sampler.weights(part):
            if any(s.cache is not None and s.cache.probes for s in part):
                done = forward_probed(sampler.cut(e, part), part, e, sampler.first_block_only)
            else:
                done = [(output, True) for output in sampler.forward(e, part)]
        outputs.update(zip(map(id, part), done))
    return [outputs[id(s)] for s in run]


def forward_interleaved(
    sampler: Sampler, e: int, parts: list[list]
) -> list[list[tuple[torch.Tensor, bool]]]:
    """The passes of expert `e` over `parts` (each of requests that share weights: a fine-tune
    kept as a delta), cut at their blocks and run block by block: block i runs for every part
    before block i + 1 runs for any, so a streamed block crosses to the device once a step and
    each part's delta is put on it in turn. Each part's prologue and epilogue run with its own
    weights. Per part, each request's output rows, as `forward` gives them.

    The epilogues run in the reverse order of the prologues: the tensors outside the blocks
    hold the last part's weights when the blocks are done and the first part's when the
    epilogues are, which the next step's prologues start with, so they switch weights
    `len(parts) - 1` times each, not `len(parts)` (a switch is a delta taken off and one put
    on). A part's outputs do not depend on the order the parts run in."""
    cuts = [sampler.cut(e, part) for part in parts]
    carried = []
    for part, cut in zip(parts, cuts):
        with sampler.weights(part), cut.scope():
            carried.append(cut.prologue())  # (B, N, D), what the blocks read
    for i in range(cuts[0].depth):
        for k, (part, cut) in enumerate(zip(parts, cuts)):
            h, c = carried[k]
            with sampler.weights(part, blocks_only=True), cut.scope():
                carried[k] = (cut.block(i, h, c), c)  # (B, n, D)
    outputs: list = [None] * len(parts)
    for k in reversed(range(len(parts))):
        (h, c), part = carried[k], parts[k]
        with sampler.weights(part), cuts[k].scope():
            out = cuts[k].epilogue(h, c)  # (B, C, F, H, W)
        outputs[k] = [(out[r], True) for r in row_slices(part)]
    return outputs


def row_slices(states: list) -> list[slice]:
    """Each request's rows in a pass over `states`: its conditional row, then its unconditional
    one when guided."""
    rows, offset = [], 0
    for s in states:
        rows.append(slice(offset, offset + (2 if s.guided else 1)))
        offset = rows[-1].stop
    return rows


def forward_probed(
    cut: ForwardCut,
    states: list,
    e: int,
    first_block_only: Callable[[], AbstractContextManager] = nullcontext,
) -> list[tuple[torch.Tensor, bool]]:
    """A pass cut after the first block, for requests some of whose caches decide there
    (FBCache): each request's output rows `(1 or 2, C, F, H, W)` and whether they ran every block.

    Every row runs the prologue and the first block; a probing request compares its rows' first
    residual `h_1 - h_0` with its cache's, and when it reuses, its rows skip the remaining blocks
    and take `h_1` plus the residual those blocks made at its last computed step. The other rows
    run the remaining blocks as one smaller batch; the epilogue runs on every row. When no row
    reuses this is the model's own forward, op for op."""
    rows = row_slices(states)
    with cut.scope():
        h0, carry = cut.prologue()  # (B, N, D)
        with first_block_only():
            h1 = cut.block(0, h0, carry)  # (B, n, D): n = N on one process, this rank's else
    h0 = cut.local(h0)  # (B, n, D)
    reuse = [
        s.cache is not None
        and s.cache.probes
        and s.cache.reuse_probed(s.step, h1[r] - h0[r], key=e, sp=cut.sp)
        for s, r in zip(states, rows)
    ]
    keep = [i for r, u in zip(rows, reuse) if not u for i in range(r.start, r.stop)]
    if len(keep) == h1.shape[0]:
        h = h1
        with cut.scope():
            for i in range(1, cut.depth):
                h = cut.block(i, h, carry)  # (B, n, D)
    else:
        h = h1.clone()
        if keep:
            index = torch.tensor(keep, device=h1.device)
            part, part_carry = h1[index], cut.rows(carry, index)  # (B', n, D)
            with cut.scope(keep):
                for i in range(1, cut.depth):
                    part = cut.block(i, part, part_carry)  # (B', n, D)
            h[index] = part
        for s, r, u in zip(states, rows, reuse):
            if u:
                h[r] = h1[r] + s.cache.tail(s.flow_time(s.step), key=e)  # (rows, n, D)
    for s, r, u in zip(states, rows, reuse):
        if s.cache is not None and s.cache.probes and not u:
            s.cache.record_probed(h1[r] - h0[r], h[r] - h1[r], key=e)
    with cut.scope():
        out = cut.epilogue(h, carry)  # (B, C, F, H, W)
    return [(out[r], not u) for r, u in zip(rows, reuse)]
