"""Random initial weights for a model built on the meta device, drawn as its constructor draws them.

PyTorch's layers initialise themselves in `reset_parameters`, called from their constructors; a
module that adds its own initialisation (zeroing an output projection, say) does it in its own
`reset_parameters`, after its children, exactly as in its constructor. Running those in the same
order (children in registration order, then the parent) over a meta-built model that has been
given real storage draws the same random numbers in the same order as constructing the model on
the CPU after the same `torch.manual_seed`: the same weights, bitwise.

A module whose constructor draws in another order (a parameter created between two children)
defines `init_weights()` for its whole tree instead.

Layers draw from torch's global CPU generator (`reset_parameters` takes none), which every thread
of a process shares: two models drawn at once (a server's worker opening a preset while another
thread opens one too) would interleave their draws and both get other weights. `seeded` holds a
process-wide lock for the whole draw.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

# Held while a model's weights are drawn from the global generator. Reentrant: a model's
# constructor may build a part that seeds its own draw (`autoencoder.WanVAE`).
_GLOBAL_GENERATOR = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The global CPU generator seeded with `seed`, for this thread alone, until the block ends;
    its state is restored afterwards. Other threads' seeded draws wait; a thread drawing random
    numbers without `seeded` meanwhile still changes what this one draws."""
    with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def init_module(module: nn.Module) -> None:
    """Draw fresh weights for `module` (real storage, not meta) in its constructor's order."""
    if hasattr(module, "init_weights"):
        module.init_weights()
        return
    for child in module.children():
        init_module(child)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def init_parts(
    module: nn.Module, blocks: nn.ModuleList | None = None
) -> list[tuple[str, nn.Module]]:
    """`module`'s pieces in construction order, each initialisable alone by `init_module`: its
    children, with `blocks` (a child ModuleList) split into its blocks. Initialising the pieces in
    this order gives the module's weights, while only one piece needs real storage at a time.

    A module with tensors or an initialisation of its own cannot be split: it is one piece.
    """
    own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    if own or hasattr(module, "init_weights") or hasattr(module, "reset_parameters"):
        return [("", module)]
    parts = []
    for name, child in module.named_children():
        if child is blocks:
            parts += [(f"{name}.{i}", block) for i, block in enumerate(blocks)]
        else:
            parts.append((name, child))
    return parts
