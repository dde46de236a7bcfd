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

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from ..kernels.delta_reference import DeltaBuffer, delta_encode
from .atomic import atomic_directory
from .family import family
from .loader import held_tensors
from .sources import ModelInfo

FORMAT = "megaslide-delta/1"
DELTA_DIR = "delta"
TENSORS_FILE, META_FILE = "delta.safetensors", "delta.json"


class DeltaError(ValueError):
    """A delta that does not belong to the model it is given to, or cannot be read."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def delta_dir(model: str | Path, dtype: torch.dtype) -> Path:
    """Where the delta of the model directory `model` in `dtype` lives."""
    return Path(model) / DELTA_DIR / dtype_name(dtype)


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a host tensor's bytes."""
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@dataclasses.dataclass
class ModelDelta:
    """A fine-tune as the coded deltas of the tensors it changed, and the base they apply to."""

    base: str  # the base's name, as shown
    dtype: torch.dtype  # the compute dtype whose words are coded
    deltas: dict[str, dict[str, DeltaBuffer]]  # component -> tensor name -> coded delta
    digests: dict[str, dict[str, str]]  # component -> tensor name -> the base tensor's SHA-256

    @property
    def nbytes(self) -> int:
        """Host bytes of the coded deltas."""
        return sum(d.nbytes for part in self.deltas.values() for d in part.values())

    def check(self, digests: dict[str, dict[str, str]], base: str) -> None:
        """DeltaError unless `digests` (a model's own, `base_digests`) are this delta's base's."""
        for component, mine in self.digests.items():
            theirs = digests.get(component)
            if theirs is None:
                raise DeltaError(f"this delta changes {component!r}, which {base} does not have")
            for name, sha in mine.items():
                if theirs.get(name) != sha:
                    what = "lacks" if name not in theirs else "has another"
                    raise DeltaError(
                        f"this delta is over {self.base}, not {base}: {base} {what} "
                        f"{component}.{name}"
                    )

    def save(self, path: str | Path) -> Path:
        """Write the delta to the folder `path` (atomically)."""
        from safetensors.torch import save_file

        tensors = {
            f"{component}/{name}/{part}": t
            for component, deltas in self.deltas.items()
            for name, delta in deltas.items()
            for part, t in delta.to_tensors().items()
        }
        meta = {
            "format": FORMAT,
            "dtype": dtype_name(self.dtype),
            "base": self.base,
            "changed": {c: sorted(d) for c, d in self.deltas.items()},
            "digests": self.digests,
        }
        path = Path(path)
        with atomic_directory(path) as tmp:
            save_file(tensors, str(tmp / TENSORS_FILE))
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> ModelDelta:
        """The delta in the folder `path`; DeltaError naming what is wrong with it."""
        from safetensors.torch import load_file

        path = Path(path)
        try:
            meta = json.loads((path / META_FILE).read_text())
            if meta.get("format") != FORMAT:
                raise DeltaError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
            tensors = load_file(str(path / TENSORS_FILE))
            parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
            for key, t in tensors.items():
                component, name, part = key.split("/")
                parts.setdefault((component, name), {})[part] = t
            deltas: dict[str, dict[str, DeltaBuffer]] = {}
            for component, names in meta["changed"].items():
                deltas[component] = {
                    n: DeltaBuffer.from_tensors(parts[(component, n)]) for n in names
                }
            return cls(meta["base"], getattr(torch, meta["dtype"]), deltas, meta["digests"])
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
            if isinstance(exc, DeltaError):
                raise
            raise DeltaError(f"{path}: not a readable delta ({type(exc).__name__}: {exc})") from exc


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


def read_delta(model: str | Path, dtype: torch.dtype) -> ModelDelta | None:
    """The delta saved in the model directory `model` for `dtype`, or None when it has none."""
    path = delta_dir(model, dtype)
    return ModelDelta.load(path) if (path / META_FILE).exists() else None
