"""Regional compilation: `torch.compile` of a model's repeated block, one graph for all its blocks.

    compiled = compile_blocks(dit.blocks)    # each block's forward through one compiled function
    compiled.stats()                         # {"graphs": 1, "recompiles": 0, "graph_breaks": 0}
    compiled.remove()                        # the blocks' own forwards again

A model's blocks are instances of one class, so the forward of one is the forward of all: it is
compiled once (diffusers' `compile_repeated_blocks` idea; a Wan VACE transformer's VACE blocks
are a second class, compiled once of their own), and with Dynamo's
`inline_inbuilt_nn_modules` (on by default since torch 2.5) a block's parameters are inputs of the
graph, not constants baked into it. Three things follow, each checked by tests/test_compile.py:

- Streaming keeps working. Only `forward` is compiled; the module's `__call__`, and with it the
  streamer's pre- and post-hooks that copy a block's weights into a device slot and release them,
  stay eager around it, and the graph reads whatever storage the parameters point at when it runs.
  Swapping a parameter's data for a slot's is no new input: no recompile.
- Hooks inside the block are traced into the graph: a LoRA row (lora.py's forward hook on each
  adaptable Linear) is part of it. The hook reads the pass's adapter plan, so a pass with adapters
  and one without are two graphs (a recompile, once each).
- A step cache cuts the pass between blocks (step_cache.py), never inside one: unchanged.

On the CPU the block's float32 linears run through oneDNN (`cpu_linears`, on by default): the
backend rewrites each `F.linear` of Dynamo's graph, with a GELU that is its only user fused into
it, as kernels/cpu_linear.py's custom op before inductor compiles the graph. Most of a block's
CPU time is its linears (70% of an eager `small` block, SDPA 19%, the elementwise rest 11%), and
what inductor does on its own, fusing the elementwise ops, cannot win more than that rest; its
CPU GEMM templates need the weights as constants of the graph (`freezing`), which streamed
weights are not. oneDNN's GEMM takes the weight as an input and ran the `small` block's linears
about 1.2x faster than MKL's sgemm (`F.linear`'s) in CPU seconds at one thread on the CPUs
measured (benchmarks/compile.py `--ablate` compares the two). Only inference graphs are rewritten
(the op has no autograd formula), and other devices and dtypes keep `F.linear`. Not kept:
inductor's `max-autotune-no-cudagraphs` (one `small` block 1.10x eager in CPU seconds against
default inductor's 1.06x, within the noise, for a compile four times as long: its CPU GEMM
templates need constant weights, so the linears stay MKL's), `freezing` (not tried: it makes
the parameters constants, the first block's weights baked into a graph that every block and
slot runs) and prepacking oneDNN's weights (2% faster per linear, and a packed copy of every
weight would have to follow the slots).

`dynamic=False` (the default) compiles a graph for each distinct shape a block sees: each batch
size (rows of a pass, as requests join and leave), token count and text length, once. Dynamo's
automatic dynamic shapes (`dynamic=None`) were not reliably better on our DiT: passes of 2, 4, 3
and 2 rows took 2 graphs against static's 3 (one static, one symbolic), but passes of 2, 4, 3, 2,
1 and 3 rows on the tiny preset took 5 against 4 (a size of 1 keeps a graph of its own, and the
symbolic graph was compiled twice) (tests/test_compile.py, benchmarks/compile.py `--batches`).
Static is one graph per size, predictably. Past Dynamo's `recompile_limit` (8 graphs) a block
runs eagerly.

Each `compile_blocks` compiles a copy of the forward with a code object of its own, because
Dynamo keeps its graphs, the shapes it has seen and its `recompile_limit` per code object: with
the class's own forward, every pipeline a process opens of one family would share one limit of 8
graphs, and a worker that reloads models would end up running them all eagerly.

Caution: `stats()` counts the graphs compiled through this object exactly (its backend counts
what Dynamo hands it), but `graph_breaks` is Dynamo's process-wide counter since `compile_blocks`
ran: another compiled function in the process adds to it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CountingBackend:
    """A `torch.compile` backend that counts the graphs Dynamo hands to `backend` ("inductor"),
    with the graph's CPU linears through oneDNN first when `cpu_linears` (see `cpu_linears`)."""

    def __init__(self, backend: str | Callable = "inductor", cpu_linears: bool = True):
        self.backend = backend
        self.cpu_linears = cpu_linears
        self.graphs = 0
        self.linears = 0  # linears the last graph runs through oneDNN

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        # An inference graph only: `cpu_linear` has no autograd formula. Dynamo guards on the
        # grad mode, so a pass with gradients is a graph of its own, which keeps `F.linear`.
        if self.cpu_linears and not torch.is_grad_enabled():
            self.linears = cpu_linears(gm)
        compile_fx = torch._dynamo.lookup_backend(self.backend)
        return compile_fx(gm, example_inputs)


_LINEARS = (torch._C._nn.linear, F.linear)
_GELUS = (torch._C._nn.gelu, F.gelu)


def cpu_linears(gm: torch.fx.GraphModule) -> int:
    """Rewrite each float32 CPU `F.linear` of Dynamo's graph `gm` as kernels/cpu_linear.py's
    oneDNN call, a GELU that is its only user fused into it; the count rewritten. Other devices
    and dtypes keep `F.linear` (on a GPU the compiler's own GEMMs are the ones to use)."""
    from ..kernels.cpu_linear import cpu_linear  # noqa: F401  (registers the op)

    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LINEARS:
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            continue
        if value.dtype != torch.float32:
            continue
        x, weight, bias = (*node.args, None, None)[:3]
        weight, bias = node.kwargs.get("weight", weight), node.kwargs.get("bias", bias)
        replaced, activation = node, "none"
        (user,) = node.users if len(node.users) == 1 else (None,)
        if user is not None and user.op == "call_function" and user.target in _GELUS:
            approximate = user.kwargs.get("approximate", (*user.args, "none")[1])
            if user.args[0] is node and approximate in ("none", "tanh"):
                replaced, activation = user, "gelu_tanh" if approximate == "tanh" else "gelu"
        with gm.graph.inserting_after(replaced):
            new = gm.graph.call_function(
                torch.ops.megaslide.cpu_linear.default, (x, weight, bias, activation)
            )
        new.meta = dict(replaced.meta)
        replaced.replace_all_uses_with(new)
        if replaced is not node:
            gm.graph.erase_node(replaced)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


class CompiledBlocks:
    """The blocks of one module running through one compiled forward (see the module docstring)."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        *,
        dynamic: bool | None = False,
        backend: str | Callable = "inductor",
        cpu_linears: bool = True,
    ):
        # One compiled function for every block of a class (a Wan VACE transformer streams its
        # VACE blocks and its blocks, two classes: a function each), counted apart.
        kinds = list(dict.fromkeys(type(b) for b in blocks))
        if not kinds:
            raise ValueError("compile_blocks takes at least one block")
        self.blocks = list(blocks)
        self.dynamic = dynamic
        self.counting = {kind: CountingBackend(backend, cpu_linears) for kind in kinds}
        self.compiled = {
            kind: torch.compile(
                _own_code(kind.forward), backend=self.counting[kind], dynamic=dynamic
            )
            for kind in kinds
        }
        self._breaks_before = _graph_breaks()
        for block in self.blocks:
            # An instance attribute shadows the class's forward; `Module.__call__` (and the hooks
            # it runs around forward) is untouched.
            block.forward = types.MethodType(self.compiled[type(block)], block)

    def stats(self) -> dict[str, Any]:
        """`graphs` compiled for these blocks, `recompiles` (graphs after each class's first),
        and the `graph_breaks` Dynamo recorded since (process-wide: see the module's Caution)."""
        counts = [c.graphs for c in self.counting.values()]
        return {
            "graphs": sum(counts),
            "recompiles": sum(max(n - 1, 0) for n in counts),
            "graph_breaks": _graph_breaks() - self._breaks_before,
            "dynamic": self.dynamic,
            # Linears of the last graph of each class that run through oneDNN (`cpu_linears`).
            "cpu_linears": sum(c.linears for c in self.counting.values()),
        }

    def remove(self) -> None:
        """The blocks' own (eager) forwards again."""
        for block in self.blocks:
            block.__dict__.pop("forward", None)
        self.blocks = []


def compile_blocks(
    blocks: Sequence[nn.Module],
    *,
    dynamic: bool | None = False,
    backend: str | Callable = "inductor",
    cpu_linears: bool = True,
) -> CompiledBlocks:
    """Run `blocks` (of a built model) through one `torch.compile`d forward for each class of
    them; compilation happens at the first call. `cpu_linears`: float32 linears on the CPU
    through oneDNN (see the module docstring)."""
    return CompiledBlocks(blocks, dynamic=dynamic, backend=backend, cpu_linears=cpu_linears)


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a copy of its code object, so that Dynamo's cache of it is this copy's alone
    (see the module docstring)."""
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
