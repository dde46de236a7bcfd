"""The sampler loop every family shares (engine/sampling/loop.py), with a family of toy hooks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaslide.engine.sampling.loop import Sampler, cfg_combine, sample_step


@dataclass
class Toy:
    """A request whose expert changes at step `switch`; its latents record the outputs taken."""

    guidance: float
    switch: int = 2
    num_steps: int = 4
    step: int = 0
    cache: None = None
    row_passes: int = 0
    keep_x0: bool = False
    x0: None = None
    guidance_memory: None = None

    def __post_init__(self):
        self.taken: list[float] = []

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    @property
    def guided(self) -> bool:
        return self.guidance != 1.0

    def flow_time(self, step: int) -> float:
        return 1 - step / self.num_steps

    def clip_latents(self) -> torch.Tensor:
        return torch.zeros(1)


class ToyFamily(Sampler):
    """Expert e outputs rows `(10 e + 2, 10 e + 1)` (conditional, unconditional); a pass holds
    one request; the update rule records the output."""

    def __init__(self):
        self.passes_run: list[tuple[int, int]] = []  # (expert, rows)

    def expert(self, state: Toy) -> int:
        return 0 if state.step < state.switch else 1

    def passes(self, states):
        return [[s] for s in states]

    def forward(self, e, states):
        rows = sum(2 if s.guided else 1 for s in states)
        self.passes_run.append((e, rows))
        cond, uncond = torch.tensor([10.0 * e + 2]), torch.tensor([10.0 * e + 1])
        return [torch.stack([cond, uncond])[: 2 if s.guided else 1] for s in states]

    def update(self, state: Toy, output):
        state.taken.append(float(output.flatten()[0]))
        state.step += 1


def test_requests_group_by_expert_combine_guidance_and_step_once():
    family = ToyFamily()
    early, late, plain = Toy(guidance=3.0), Toy(guidance=3.0), Toy(guidance=1.0, switch=1)
    late.step = 2
    sample_step(family, [early, late, plain])
    # Each request advances once, by the expert it was at when the step began: `plain` crosses
    # to expert 1 during expert 0's passes and is not run again by expert 1.
    assert (early.step, late.step, plain.step) == (1, 3, 1)
    assert family.passes_run == [(0, 2), (0, 1), (1, 2)]
    high = float(cfg_combine(torch.tensor(2.0), torch.tensor(1.0), 3.0))  # 1 + 3 * 1 = 4
    assert early.taken == [high] and plain.taken == [2.0]
    assert late.taken == [float(cfg_combine(torch.tensor(12.0), torch.tensor(11.0), 3.0))]
    while not early.done:
        sample_step(family, [early, late, plain])
    assert early.taken == [high, high, 14.0, 14.0]  # 11 + 3 * 1: expert 1 from step 2
    sample_step(family, [early, late, plain])  # finished requests are skipped
    assert len(early.taken) == 4
