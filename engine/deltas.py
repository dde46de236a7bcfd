"""Fine-tunes kept as lossless deltas over the base they were made from.

A full fine-tune moves most weights by a few units in the last place. Tensor by tensor, as a
pipeline holds them (bf16 on a GPU), the fine-tune's 16-bit words minus the base's (mod 2**16)
are small integers: entropy-coded (`kernels/delta_reference.py`) they take a fraction of the
bytes, and adding them to the base's words on the device gives the fine-tune's, bitwise
(`kernels/delta.py`). A pipeline keeps one copy of the base and registers any number of
fine-tunes of it as weight variants (`streaming/variants.py`), each costing its delta's bytes.

On disk a delta is a folder `<model>/delta/<dtype>/` (`delta_dir`): `delta.safetensors` holds the
coded deltas of the tensors the fine-tune changed, `delta.json` says what they are:

    {"format": "megaslide-delta/1", "dtype": "bfloat16", "base": "<the base's name>",
     "changed": {"<component>": ["<tensor>", ...]},
     "digests": {"<component>": {"<tensor>": "<sha256 of the base tensor's bytes>", ...}}}

A delta belongs to one base: `digests` holds the SHA-256 of every tensor of the base as held in
`dtype` (the components it leaves alone too: a fine-tune is served with the base's), and
registering a delta compares them with the serving model's own, naming the first tensor that
differs (`ModelDelta.check`). A delta is made for one compute dtype (the words it
codes are that dtype's); a model served in another needs its own (`make_delta(dtype=...)`).

Caution: components a pipeline decodes with (a VAE) must not change: a fine-tune kept as a delta
changes the text encoders and denoisers, which run per request group (`Family.decoders`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..kernels.delta_reference import DeltaBuffer, delta_encode
from .delta_format import META_FILE, ModelDelta, delta_dir
from .family import family
from .loader import held_tensors
from .sources import ModelInfo
from .streaming.variants import DeltaError, digest

__all__ = ["DeltaError", "ModelDelta", "base_digests", "make_delta", "read_delta", "write_delta"]


def base_digests(info: ModelInfo, dtype: torch.dtype) -> dict[str, dict[str, str]]:
    """The SHA-256 of every tensor of a model as a pipeline in `dtype` holds it, by component:
    what a delta over it records (reads every weight once)."""
    out: dict[str, dict[str, str]] = {}
    for component, name, t in held_tensors(info, dtype):
        out.setdefault(component, {})[name] = digest(t)
    return out


def make_delta(tuned: ModelInfo, base: ModelInfo, dtype: torch.dtype) -> ModelDelta:
    """The fine-tune `tuned` as a delta over `base`, both read from their files tensor by tensor
    as pipelines in `dtype` hold them. DeltaError when `tuned` is not a fine-tune of `base`'s
    architecture, or changes a component it may not (`Family.decoders`)."""
    if tuned.family != base.family or tuned.config != base.config:
        raise DeltaError(f"{tuned.name} and {base.name} are not one architecture")
    decoders = family(base.family).decoders
    deltas: dict[str, dict[str, DeltaBuffer]] = {}
    digests: dict[str, dict[str, str]] = {}
    ours = held_tensors(tuned, dtype)
    for component, name, b in held_tensors(base, dtype):
        theirs = next(ours, None)
        if theirs is None or theirs[:2] != (component, name):
            raise DeltaError(f"{tuned.name} lacks {component}.{name} of {base.name}")
        t = theirs[2]
        if t.shape != b.shape:
            raise DeltaError(
                f"{component}.{name}: {tuple(t.shape)} in {tuned.name}, {tuple(b.shape)} in "
                f"{base.name}"
            )
        digests.setdefault(component, {})[name] = digest(b)
        if torch.equal(t.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            continue
        if component in decoders:
            raise DeltaError(
                f"{tuned.name} changes {component}.{name}: a fine-tune kept as a delta may not "
                f"change the {component}"
            )
        deltas.setdefault(component, {})[name] = delta_encode(b, t)
    extra = next(ours, None)
    if extra is not None:
        raise DeltaError(f"{tuned.name} has {extra[0]}.{extra[1]}, which {base.name} lacks")
    return ModelDelta(base.name, dtype, deltas, digests)


def write_delta(tuned: ModelInfo, base: ModelInfo, dtype: torch.dtype) -> tuple[Path, ModelDelta]:
    """`make_delta`, saved beside the fine-tune's own files (`delta_dir`)."""
    delta = make_delta(tuned, base, dtype)
    return delta.save(delta_dir(tuned.source.path, dtype)), delta


def read_delta(model: str | Path, dtype: torch.dtype, *, mapped: bool = False) -> ModelDelta | None:
    """The delta saved in the model directory `model` for `dtype`, or None when it has none
    (`mapped`: see `ModelDelta.load`)."""
    path = delta_dir(model, dtype)
    return ModelDelta.load(path, mapped=mapped) if (path / META_FILE).exists() else None
