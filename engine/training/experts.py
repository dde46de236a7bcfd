"""Several experts of one model trained in one run, each on the flow times it owns.

Wan2.2-A14B denoises with two experts: the high-noise one while `t >= boundary_ratio`, the
low-noise one after. It was trained that way, each expert on its own noise levels, so a run that
trains both keeps the split: every micro-batch draws its flow times and noise from the run's time
sampling once, as a one-model run does, and each row goes to the expert whose `time_range` holds
its time. A batch may hold rows of both: each expert's `BlockwiseStep` (blockwise.py) runs on its
rows, with its own masters, moments and optimizer, exactly as if those rows were its whole batch
(its loss their mean). An expert none of whose rows came up in an optimizer step does not step:
its weights and moments move only for samples in its own range. With accumulated micro-batches,
one that held none of an expert's rows adds zero to its gradient (each micro-batch weighs alike,
as in a one-model run), if any other micro-batch of the step held some.

Why rows and not whole batches by turn: the experts then see exactly the times the sampling
draws, each its share, with no rule to keep them in proportion; what the split costs is a step
that holds rows of both streaming both experts' blocks.

Caution: one process. Over several devices, a rank with no rows for an expert would leave the
others waiting in that expert's gradient reduction: refused when the run opens.
"""

from __future__ import annotations

from typing import Any

import torch

from ..sampling.flow import sample_training_times
from .blockwise import BlockwiseStep


class ExpertSteps:
    """The experts' block-wise steps, by label ("high", "low"), trained as one: `micro_step`
    sends each row of a micro-batch to the expert that owns its flow time."""

    def __init__(self, steps: dict[str, BlockwiseStep], time_sampling: str):
        first = next(iter(steps.values()))
        if first.group.world > 1:
            raise ValueError(
                "training several experts in one run runs in one process: name one expert to "
                "train over several devices"
            )
        # Lowest times first: a row belongs to the last expert whose range starts at or below it.
        self.steps = dict(sorted(steps.items(), key=lambda kv: kv[1].model.time_range[0]))
        self.starts = torch.tensor([s.model.time_range[0] for s in self.steps.values()][1:])
        self.time_sampling = time_sampling
        self.grad_accum = first.config.optimizer.grad_accum
        self.micro = 0
        # Each expert's micro-steps of this optimizer step that held none of its rows, not yet
        # given to its step: given (as zeros) once it has rows, or dropped if it never does.
        self.owed = dict.fromkeys(self.steps, 0)
        self.optimizer = _Optimizers({k: s.optimizer for k, s in self.steps.items()})

    def micro_step(self, x0: torch.Tensor, condition: Any, generator: torch.Generator) -> dict:
        """One micro-step of every expert that owns a row of the batch `x0` `(B, C, F, H, W)`
        (after `grad_accum` of them, the experts' optimizer steps). The loss is the batch's mean,
        `loss_<label>` each expert's over its rows (None for an expert with none), `grad_norm`
        over the experts that trained."""
        B = x0.shape[0]
        t = sample_training_times(B, generator, self.time_sampling)  # (B,)
        noise = torch.randn(x0.shape, generator=generator)  # (B, C, F, H, W)
        owner = torch.bucketize(t, self.starts, right=True)  # (B,): the expert of each row
        last = self.micro + 1 == self.grad_accum
        out = {"loss": 0.0, "grad_norm": 0.0, "step_time_s": 0.0, "stepped": last}
        for e, (label, step) in enumerate(self.steps.items()):
            rows = (owner == e).nonzero()[:, 0]
            if len(rows) == 0:
                out[f"loss_{label}"] = None
                self.owed[label] += 1
                if last and step.micro > 0:  # it had rows earlier in this optimizer step
                    step.skip_micro_steps(self.owed[label])
                if last:
                    self.owed[label] = 0
                continue
            step.skip_micro_steps(self.owed[label])
            self.owed[label] = 0
            got = step.micro_step(
                x0[rows], _rows(condition, rows), None, drawn=(t[rows], noise[rows])
            )
            out[f"loss_{label}"] = got["loss"]
            out["loss"] += got["loss"] * len(rows) / B  # the batch's mean squared error
            out["grad_norm"] = (out["grad_norm"] ** 2 + got["grad_norm"] ** 2) ** 0.5
            out["step_time_s"] += got["step_time_s"]
        self.micro = 0 if last else self.micro + 1
        return out

    @property
    def stream_handles(self) -> dict:
        """Each streamed expert's streamer handle, by label."""
        return {k: s.handle for k, s in self.steps.items() if s.handle is not None}

    @property
    def h2d_bytes(self) -> int:
        return sum(s.h2d_bytes for s in self.steps.values())

    @property
    def d2h_bytes(self) -> int:
        return sum(s.d2h_bytes for s in self.steps.values())

    def state_dicts(self, *, values: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """Every expert's trained modules' states, by module name."""
        return {k: v for s in self.steps.values() for k, v in s.state_dicts(values=values).items()}

    def close(self) -> None:
        for step in self.steps.values():
            step.close()


class _Optimizers:
    """The experts' optimizers as the trainer sees one: one learning rate, one state dict."""

    def __init__(self, optimizers: dict):
        self.optimizers = optimizers

    @property
    def lr(self) -> float:
        return next(iter(self.optimizers.values())).lr

    @lr.setter
    def lr(self, lr: float) -> None:
        for o in self.optimizers.values():
            o.lr = lr

    def state_dict(self) -> dict:
        return {"experts": {k: o.state_dict() for k, o in self.optimizers.items()}}

    def load_state_dict(self, state) -> None:
        saved = state.get("experts")
        if saved is None or set(saved) != set(self.optimizers):
            held = "one model's" if saved is None else f"experts {sorted(saved)}'"
            raise ValueError(
                f"the checkpoint holds {held} optimizer state, the run trains experts "
                f"{sorted(self.optimizers)}: resume with the experts it was trained with"
            )
        for k, o in self.optimizers.items():
            o.load_state_dict(saved[k])


def _rows(condition: Any, rows: torch.Tensor) -> Any:
    """The rows `rows` of a batch's condition: a tensor's, or a list's (prompts)."""
    if isinstance(condition, torch.Tensor):
        return condition[rows]
    return [condition[i] for i in rows.tolist()]


__all__ = ["ExpertSteps"]
