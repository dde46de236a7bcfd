"""kernels/cpu_linear.py (a Linear through oneDNN, with a fused GELU) against its reference, and
compiled_blocks' graph pass that routes a compiled block's CPU linears to it.

Tolerances are derived: the oracle runs in fp64, and the op may be at most twice as far from it
as `F.linear` in fp32 is.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megaslide.engine.compiled_blocks import CountingBackend
from megaslide.kernels.cpu_linear import cpu_linear, cpu_linear_reference


@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_linear_equals_its_reference_within_fp32_error(activation, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 96, generator=g)  # (B, N, in): a batch of token rows
    w = torch.randn(160, 96, generator=g) / 10
    b = torch.randn(160, generator=g) if bias else None
    oracle = cpu_linear_reference(
        x.double(), w.double(), None if b is None else b.double(), activation
    )
    got = cpu_linear(x, w, b, activation)
    torch_err = (cpu_linear_reference(x, w, b, activation).double() - oracle).abs().max().item()
    err = (got.double() - oracle).abs().max().item()
    assert got.shape == (2, 37, 160) and got.dtype == torch.float32
    assert err <= 2 * torch_err + 1e-7, f"max error {err:.3g}, F.linear in fp32 {torch_err:.3g}"


def test_cpu_linear_names_what_is_wrong():
    x, w = torch.zeros(3, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="activation"):
        cpu_linear(x, w, activation="relu")
    with pytest.raises(ValueError, match="last dimension 8"):
        cpu_linear(x, torch.zeros(4, 5))


class Recorder:
    """A backend that keeps the graph it is handed and runs it eagerly."""

    def __call__(self, gm, example_inputs):
        self.gm = gm
        return gm.forward


def compiled_mlp(grad: bool):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    x = torch.randn(2, 5, 32)
    recorder = Recorder()
    counting = CountingBackend(recorder)
    with torch.set_grad_enabled(grad):
        got = torch.compile(mlp, backend=counting)(x)
        want = mlp(x)
    return got, want, counting, recorder.gm


def test_the_graph_pass_routes_cpu_linears_to_onednn_and_fuses_the_gelu():
    got, want, counting, gm = compiled_mlp(grad=False)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert counting.linears == 2
    assert targets.count(torch.ops.megaslide.cpu_linear.default) == 2
    assert not any("gelu" in str(t) or "linear" == getattr(t, "__name__", "") for t in targets)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_graph_that_needs_gradients_keeps_f_linear():
    """`cpu_linear` has no autograd formula: with gradients the pass leaves the graph alone."""
    got, want, counting, gm = compiled_mlp(grad=True)
    assert counting.linears == 0
    assert torch.ops.megaslide.cpu_linear.default not in [n.target for n in gm.graph.nodes]
    got.sum().backward()  # and it differentiates
