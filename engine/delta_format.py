"""The file format of a fine-tune kept as a lossless delta over its base (`ModelDelta`), apart
from how deltas are made (deltas.py): what a pipeline registers needs only this.

A delta is a folder `<model>/delta/<dtype>/` (`delta_dir`): `delta.safetensors` holds the coded
delta of each tensor the fine-tune changed (`<component>/<tensor>/<part>`), `delta.json` says
what they are and what they are over (see deltas.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from ..kernels.delta_reference import DeltaBuffer
from .atomic import atomic_directory
from .streaming.host_store import read_safetensors_header
from .streaming.variants import DeltaError

FORMAT = "megaslide-delta/1"
DELTA_DIR = "delta"
TENSORS_FILE, META_FILE = "delta.safetensors", "delta.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def delta_dir(model: str | Path, dtype: torch.dtype) -> Path:
    """Where the delta of the model directory `model` in `dtype` lives."""
    return Path(model) / DELTA_DIR / dtype_name(dtype)


@dataclasses.dataclass
class ModelDelta:
    """A fine-tune as the coded deltas of the tensors it changed, and the base they apply to."""

    base: str  # the base's name, as shown
    dtype: torch.dtype  # the compute dtype whose words are coded
    deltas: dict[str, dict[str, DeltaBuffer]]  # component -> tensor name -> coded delta
    digests: dict[str, dict[str, str]]  # component -> tensor name -> the base tensor's SHA-256
    mapped: bool = False  # its bytes are a memory map of its file (`load(mapped=True)`)

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
    def load(cls, path: str | Path, *, mapped: bool = False) -> ModelDelta:
        """The delta in the folder `path`; DeltaError naming what is wrong with it. `mapped`:
        its coded streams stay a memory map of the file (`_mapped`), read from disk as they are
        used, rather than read into RAM now."""
        from safetensors.torch import load_file

        path = Path(path)
        try:
            meta = json.loads((path / META_FILE).read_text())
            if meta.get("format") != FORMAT:
                raise DeltaError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
            file = path / TENSORS_FILE
            tensors = _mapped(file) if mapped else load_file(str(file))
            parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
            for key, t in tensors.items():
                component, name, part = key.split("/")
                parts.setdefault((component, name), {})[part] = t
            deltas: dict[str, dict[str, DeltaBuffer]] = {}
            for component, names in meta["changed"].items():
                deltas[component] = {
                    n: DeltaBuffer.from_tensors(parts[(component, n)]) for n in names
                }
            dtype = getattr(torch, meta["dtype"])
            return cls(meta["base"], dtype, deltas, meta["digests"], mapped=mapped)
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
            if isinstance(exc, DeltaError):
                raise
            raise DeltaError(f"{path}: not a readable delta ({type(exc).__name__}: {exc})") from exc


def _mapped(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file as views of one private, read-only memory map of it:
    the kernel reads their pages as they are used and drops them again under memory pressure.
    A tensor whose bytes do not lie at a multiple of its element size is copied (the small
    parts: tables, offsets, escapes; a delta's bulk, its uint8 stream, stays mapped)."""
    flat = torch.from_numpy(
        np.memmap(file, dtype=np.uint8, mode="c")
    )  # copy-on-write: never written
    out = {}
    for key, e in read_safetensors_header(str(file)).items():
        part = flat[e.offset : e.offset + e.nbytes]
        if e.offset % e.dtype.itemsize:
            part = part.clone()
        out[key] = part.view(e.dtype).reshape(e.shape)
    return out
