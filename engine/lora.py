"""LoRA adapters applied per row of a batched pass, the base weights left as they are.

An adapter is a set of low-rank deltas on a denoiser's Linear layers, in one canonical form:
diffusers' module names (`blocks.0.attn1.to_q`) with PEFT's factors, `lora_A` `(r, in)` and
`lora_B` `(out, r)` (and `lora_B`'s bias, the `diff_b` deltas). A family converts a file from
whatever key layout it came in (`Family.convert_adapter`) once, at registration; `Adapter.check`
refuses one that does not fit the model, naming the first bad key.

Applying. The host stores and the streamed weights stay the base model. The factors live on the
device, outside the modules (the streamer never sees them), and a forward hook on each adaptable
Linear adds, for each row of the batch, its own adapters' `s * lora_B(lora_A(x))` to the layer's
output (S-LoRA / Punica's idea: one pass of the base weights for every request, whatever adapters
each asks for). Rows that share one adapter list (or a batch of one request) take PEFT's own
sequence of operations, so a request alone gives bitwise the video diffusers gives with
`load_lora_weights` + `set_adapters`; mixed batches gather each adapter's rows
(`index_select` / `index_add`), a few percent of the layer's cost at rank 32.

The scale of a module is PEFT's: `scale * lora_alpha / r` with the file's alpha (1.0 when the
file folds its alphas into the factors, as diffusers' converters do).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .native.config import SAMPLERS
from .request import RequestError, check_timesteps

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias")
MAX_ADAPTERS_PER_REQUEST = 8
# Sampling defaults an adapter may carry (a step-distilled one: its sampler and timesteps).
DEFAULT_KEYS = ("steps", "guidance", "shift", "sampler", "timesteps")
# What a factor may be stored as: the dtypes a pipeline computes in. An integer or boolean factor
# is no trained adapter, and fp8 ones would need a scale the file does not carry.
FACTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AdapterError(ValueError):
    """An adapter that does not fit the model (or cannot be read); `key` names the first bad key."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass
class LoraDelta:
    """One Linear layer's low-rank delta: `lora_B(lora_A(x)) * scale * alpha / rank`."""

    down: torch.Tensor  # lora_A (r, in)
    up: torch.Tensor  # lora_B (out, r)
    bias: torch.Tensor | None = None  # lora_B's bias (out,): a `diff_b` delta
    alpha: float | None = None  # None: alpha == rank (scale 1.0, the factors carry it)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def scaling(self, scale: float) -> float:
        # In PEFT's order (`set_scale`: scale * lora_alpha / r), so the float is the same bits.
        alpha = self.rank if self.alpha is None else self.alpha
        return scale * alpha / self.rank

    @property
    def nbytes(self) -> int:
        tensors = (self.down, self.up, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Adapter:
    """A converted adapter: deltas by module name inside the denoiser, and what it says of itself."""

    name: str
    deltas: dict[str, LoraDelta]
    source: str = ""  # the file it came from
    defaults: dict = field(default_factory=dict)  # sampling defaults (steps, guidance, shift)

    @property
    def rank(self) -> int:
        ranks = [d.rank for d in self.deltas.values()]
        return max(ranks, key=ranks.count) if ranks else 0

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.deltas.values())

    def check(self, targets: Mapping[str, nn.Linear]) -> None:
        """AdapterError naming the first key that matches no adaptable layer of the model or whose
        shape does not fit it (another base model, another size)."""
        for name in sorted(self.deltas, key=_natural):
            d = self.deltas[name]
            layer = targets.get(name)
            if layer is None:
                raise AdapterError(
                    f"adapter {self.name!r}: {name}.lora_A.weight matches no adaptable layer of "
                    "this model (another model's adapter?)",
                    key=f"{name}.lora_A.weight",
                )
            out_features, in_features = layer.weight.shape
            expected = {
                "lora_A.weight": (d.rank, in_features),
                "lora_B.weight": (out_features, d.rank),
                "lora_B.bias": (out_features,),
            }
            for suffix, t in (
                ("lora_A.weight", d.down),
                ("lora_B.weight", d.up),
                ("lora_B.bias", d.bias),
            ):
                if t is not None and tuple(t.shape) != expected[suffix]:
                    raise AdapterError(
                        f"adapter {self.name!r}: {name}.{suffix} has shape {tuple(t.shape)}, the "
                        f"model's layer needs {expected[suffix]} (an adapter for another base?)",
                        key=f"{name}.{suffix}",
                    )

    def to(self, device: torch.device, dtype: torch.dtype) -> Adapter:
        def move(t):
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        deltas = {
            n: LoraDelta(move(d.down), move(d.up), move(d.bias), d.alpha)
            for n, d in self.deltas.items()
        }
        return Adapter(self.name, deltas, self.source, dict(self.defaults))

    def card(self) -> dict:
        """What the API lists of an adapter."""
        return {
            "name": self.name,
            "rank": self.rank,
            "modules": len(self.deltas),
            "bytes": self.nbytes,
            "defaults": dict(self.defaults),
        }


def _natural(name: str) -> tuple:
    """Module names in model order: blocks.2 before blocks.10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def read_adapter_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the header metadata of a LoRA file (safetensors only: no pickles)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"adapter file {path} not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"adapter file {path}: not a readable safetensors file ({e})") from None
    if not tensors:
        raise AdapterError(f"adapter file {path} holds no tensors")
    return tensors, metadata


def sidecar_defaults(path: str | Path, metadata: Mapping[str, str]) -> dict:
    """Sampling defaults an adapter carries (a step-distilled one: few steps, no guidance, its
    sampler and timesteps): a `megaslide.sampling` JSON entry in the file's metadata, or
    `<file>.json` beside it with a "sampling" object. Only `DEFAULT_KEYS` are taken; anything else
    is an error."""
    found: dict = {}
    if "megaslide.sampling" in metadata:
        found = json_object(metadata["megaslide.sampling"], f"{path}: megaslide.sampling metadata")
    side = Path(str(path) + ".json")
    if side.is_file():
        sampling = json_object(side.read_text(), str(side)).get("sampling", {})
        if not isinstance(sampling, dict):
            raise AdapterError(f"{side}: its sampling entry must be a JSON object")
        found = {**found, **sampling}
    unknown = sorted(set(found) - set(DEFAULT_KEYS))
    if unknown:
        raise AdapterError(
            f"{path}: unknown sampling default {unknown[0]!r} (known: {', '.join(DEFAULT_KEYS)})"
        )
    defaults = {}
    for k, v in found.items():
        if k == "sampler":
            if v not in SAMPLERS:
                raise AdapterError(
                    f"{path}: sampling default sampler={v!r} is not one of {', '.join(SAMPLERS)}"
                )
            defaults[k] = v
            continue
        if k == "timesteps":
            try:
                defaults[k] = list(check_timesteps(v, param="timesteps"))
            except RequestError as e:
                raise AdapterError(f"{path}: sampling default {e}") from None
            continue
        low = {"steps": 1, "guidance": 0}.get(k, 1e-6)  # a shift must be positive
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if not number or not math.isfinite(v) or v < low:
            raise AdapterError(f"{path}: sampling default {k}={v!r} is not a valid number")
        if k == "steps" and v != int(v):
            raise AdapterError(f"{path}: sampling default steps must be a whole number")
        defaults[k] = int(v) if k == "steps" else float(v)
    if "timesteps" in defaults:  # a list of timesteps alone is a step-distilled Euler schedule
        if defaults.setdefault("sampler", "euler") == "scheduler":
            raise AdapterError(
                f"{path}: sampling default timesteps need the euler or consistency sampler"
            )
    return defaults


def json_object(text: str, what: str) -> dict:
    """`text` parsed as a JSON object, or AdapterError saying what it is instead (a file may
    nest it deeper than the parser recurses)."""
    try:
        found = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise AdapterError(f"{what} is not JSON ({type(e).__name__})") from None
    if not isinstance(found, dict):
        raise AdapterError(f"{what} must be a JSON object, not {type(found).__name__}")
    return found


def deltas_from_peft(
    state: Mapping[str, torch.Tensor], alphas: Mapping[str, float] | None = None
) -> dict[str, LoraDelta]:
    """Group a state dict in PEFT's names (`<module>.lora_A.weight`, `.lora_B.weight`,
    `.lora_B.bias`) into deltas by module; AdapterError naming the first key that is not one, a
    module missing a factor, a factor of rank 0, of another dtype than `FACTOR_DTYPES` or holding
    a NaN or infinity, or an alpha that is not a finite number."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(state, key=_natural):
        suffix = next((s for s in ADAPTER_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise AdapterError(
                f"{key} is not a LoRA factor (expected <module>.lora_A.weight, .lora_B.weight or "
                ".lora_B.bias)",
                key=key,
            )
        _check_factor(key, state[key])
        parts.setdefault(key.removesuffix(suffix), {})[suffix] = state[key]
    deltas = {}
    for module, p in parts.items():
        for needed in (".lora_A.weight", ".lora_B.weight"):
            if needed not in p:
                raise AdapterError(f"{module}{needed} is missing", key=f"{module}{needed}")
        down, up = p[".lora_A.weight"], p[".lora_B.weight"]
        if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
            raise AdapterError(
                f"{module}: lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} are not the "
                "factors of one low-rank delta",
                key=f"{module}.lora_A.weight",
            )
        if down.shape[0] == 0:
            raise AdapterError(f"{module}: rank 0 (an empty delta)", key=f"{module}.lora_A.weight")
        alpha = None if alphas is None else alphas.get(module)
        if alpha is not None and (
            isinstance(alpha, bool)
            or not isinstance(alpha, int | float)
            or not math.isfinite(alpha)
        ):
            raise AdapterError(f"{module}: alpha {alpha!r} is not a finite number", key=module)
        deltas[module] = LoraDelta(down, up, p.get(".lora_B.bias"), alpha)
    return deltas


def _check_factor(key: str, t: torch.Tensor) -> None:
    """AdapterError unless `t` can be a trained factor: a float dtype we compute in, all finite
    (one NaN would turn every video naming the adapter into noise)."""
    if t.dtype not in FACTOR_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in FACTOR_DTYPES)
        raise AdapterError(
            f"{key} is {str(t.dtype).removeprefix('torch.')}; LoRA factors must be {allowed}",
            key=key,
        )
    if not bool(torch.isfinite(t).all()):
        raise AdapterError(f"{key} holds NaN or infinite values", key=key)


# ----------------------------------------------------------------------------------------------
# Applying: a forward hook on every adaptable Linear, routed per row


@dataclass(frozen=True)
class _Group:
    adapter: Adapter
    rows: torch.Tensor  # (n,) int64 on the device: the rows that use this adapter
    scales: torch.Tensor  # (n,) the user's scale of each of those rows, on the device
    scale_list: tuple[float, ...]
    span: tuple[int, int] | None  # (first, last + 1) when the rows are adjacent


class _Plan:
    """Which adapters each row of one pass uses, in the form the hooks apply fastest."""

    def __init__(self, rows: Sequence[Sequence[tuple[Adapter, float]]], device, dtype, exact: bool):
        self.num_rows = len(rows)
        self.exact = exact
        keys = [tuple((a.name, s) for a, s in r) for r in rows]
        # Every row the same list (one request, or several that ask alike): no routing needed.
        self.uniform = tuple(rows[0]) if len(set(keys)) == 1 else None
        self.groups: list[_Group] = []
        self.runs: list[tuple[Adapter | None, float]] | None = None
        if self.uniform is not None:
            return
        if all(len(r) <= 1 for r in rows):
            self.runs = _equal_runs(rows, keys)
            if self.runs is not None:
                return
        order: dict[str, Adapter] = {}
        for r in rows:
            for a, _ in r:
                order.setdefault(a.name, a)
        for name, adapter in order.items():
            idx, scales = [], []
            for i, r in enumerate(rows):
                for a, s in r:
                    if a.name == name:
                        idx.append(i)
                        scales.append(s)
            adjacent = idx == list(range(idx[0], idx[0] + len(idx)))
            # Two small host-to-device copies per pass, not per layer: the hooks then index and
            # scale with tensors already on the device.
            self.groups.append(
                _Group(
                    adapter,
                    torch.tensor(idx, dtype=torch.long, device=device),
                    torch.tensor(scales, dtype=dtype, device=device),
                    tuple(scales),
                    (idx[0], idx[-1] + 1) if adjacent else None,
                )
            )


def _equal_runs(rows, keys) -> list[tuple[Adapter | None, float]] | None:
    """The batch as G runs of equally many adjacent rows, each run with at most one adapter (and
    one scale), when it splits so (Punica's segments, made equal so one `bmm` does them all):
    `[(adapter or None, scale)] * G`; None when it does not."""
    lengths, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            lengths.append(i - start)
            start = i
    length = math.gcd(*lengths)
    runs = []
    for first in range(0, len(rows), length):
        r = rows[first]
        runs.append((r[0][0], r[0][1]) if r else (None, 0.0))
    return runs if len(runs) > 1 else None


class AdapterRouter:
    """The registered adapters of one pipeline and the hooks that apply them to its denoisers.

    `targets(module) -> {name: Linear}` is the family's declaration of what is adaptable in a
    denoiser. Adapters are converted and checked before they get here (see `register`).
    `exact` applies a batch whose rows all take the same adapters in PEFT's own sequence of
    operations (a pipeline's reference mode: bitwise diffusers); otherwise each adapter's product
    is added into the layer's output by one fused `addmm`, its scale on the rank-sized
    intermediate, without materialising the delta.
    """

    def __init__(
        self,
        denoisers: Sequence[nn.Module],
        targets: Callable[[nn.Module], dict[str, nn.Linear]],
        device: torch.device,
        dtype: torch.dtype,
        *,
        exact: bool = False,
    ):
        self.device, self.dtype = torch.device(device), dtype
        self.exact = exact
        self.targets = [targets(m) for m in denoisers]
        self.adapters: dict[str, Adapter] = {}
        self._plan: _Plan | None = None
        self._hooks: list = []

    # -- registry ---------------------------------------------------------------------------------

    def register(self, adapter: Adapter, *, replace: bool = False) -> Adapter:
        """Check `adapter` against every denoiser and keep it on the device; returns the copy
        kept. AdapterError when it does not fit or the name is taken."""
        if adapter.name in self.adapters and not replace:
            raise AdapterError(f"an adapter named {adapter.name!r} is already registered")
        if not adapter.deltas:
            raise AdapterError(f"adapter {adapter.name!r} holds no LoRA factors")
        for targets in self.targets:
            adapter.check(targets)
        kept = adapter.to(self.device, self.dtype)
        self.adapters[adapter.name] = kept
        if not self._hooks:
            self._attach()
        return kept

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    @property
    def nbytes(self) -> int:
        """Device bytes of every registered adapter's factors."""
        return sum(a.nbytes for a in self.adapters.values())

    def _attach(self) -> None:
        for targets in self.targets:
            for name, layer in targets.items():
                # First of the layer's forward hooks: the delta belongs to the layer's own
                # output (under sequence parallel, before the gather after Wan's `proj_out`).
                hook = layer.register_forward_hook(self._hook(name), prepend=True)
                self._hooks.append(hook)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- applying -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def rows(self, rows: Sequence[Sequence[tuple[str, float]]]) -> Iterator[None]:
        """Apply, inside the block, to each row `i` of the passes that run the adaptable layers
        the adapters `rows[i]` names with their scales (empty: the base model alone)."""
        resolved = [tuple((self.adapters[n], float(s)) for n, s in r) for r in rows]
        if not any(resolved):
            yield
            return
        self._plan = _Plan(resolved, self.device, self.dtype, self.exact)
        try:
            yield
        finally:
            self._plan = None

    def _hook(self, name: str):
        def hook(module, args, output):
            plan = self._plan
            if plan is None:
                return None
            return apply_deltas(name, args[0], output, plan)

        return hook


def apply_deltas(name: str, x: torch.Tensor, y: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """`y` (the layer's output for input `x`, a fresh tensor the hook owns) plus each row's
    adapters' deltas for layer `name`, added in place."""
    if plan.uniform is not None and plan.exact:
        for adapter, scale in plan.uniform:
            d = adapter.deltas.get(name)
            if d is not None:  # PEFT's LoRA Linear: result + lora_B(lora_A(x)) * scaling
                y.add_(F.linear(F.linear(x, d.down), d.up, d.bias) * d.scaling(scale))
        return y
    if plan.uniform is not None:
        for adapter, scale in plan.uniform:
            d = adapter.deltas.get(name)
            if d is not None:
                _add_product(x, y, d, d.scaling(scale), None)
        return y
    if plan.runs is not None:
        _add_grouped(name, x, y, plan.runs)
        return y
    if x.shape[0] % plan.num_rows:
        raise RuntimeError(
            f"{name}: {x.shape[0]} input rows do not split into the pass's {plan.num_rows} rows"
        )
    repeat = x.shape[0] // plan.num_rows  # a layer run once per token of each row (per-token time)
    for g in plan.groups:
        d = g.adapter.deltas.get(name)
        if d is None:
            continue
        one_scale = len(set(g.scale_list)) == 1
        factors = None
        if not one_scale:  # each row's own scale, once per token of it
            factors = g.scales.to(y.dtype) * d.scaling(1.0)
            factors = factors.repeat_interleave(repeat * (x[0].numel() // x.shape[-1]))
        scale = d.scaling(g.scale_list[0]) if one_scale else 1.0
        if g.span is not None:  # the group's rows are adjacent: slices of x and y, no gather
            a, b = g.span[0] * repeat, g.span[1] * repeat
            _add_product(x[a:b], y[a:b], d, scale, factors)
            continue
        index = g.rows
        if repeat > 1:
            index = (index[:, None] * repeat + torch.arange(repeat, device=index.device)).flatten()
        rows_y = y.new_zeros((len(index), *y.shape[1:]))
        _add_product(x.index_select(0, index), rows_y, d, scale, factors)
        y.index_add_(0, index, rows_y)
    return y


def _add_grouped(name: str, x, y, runs: list[tuple[Adapter | None, float]]) -> None:
    """`y += lora_B(lora_A(x)) * scale` with each of the G equal runs of rows taking its own
    adapter: the factors stacked (the scale folded into lora_A, ranks padded with zeros, a run
    without an adapter all zeros) and two batched matmuls for the whole pass."""
    deltas = [None if a is None else a.deltas.get(name) for a, _ in runs]
    if all(d is None for d in deltas):
        return
    g = len(runs)
    xs = x.reshape(g, -1, x.shape[-1])  # (G, tokens of a run, in): runs are adjacent rows
    ys = y.view(g, -1, y.shape[-1])  # (G, tokens of a run, out)
    rank = max(d.rank for d in deltas if d is not None)
    n_in, n_out = xs.shape[-1], ys.shape[-1]
    down = xs.new_zeros((g, rank, n_in))
    up = xs.new_zeros((g, n_out, rank))
    bias = xs.new_zeros((g, 1, n_out)) if any(d and d.bias is not None for d in deltas) else None
    for k, (d, (_, scale)) in enumerate(zip(deltas, runs)):
        if d is None:
            continue
        s = d.scaling(scale)
        down[k, : d.rank].copy_(d.down).mul_(s)
        up[k, :, : d.rank].copy_(d.up)
        if d.bias is not None:
            bias[k, 0].copy_(d.bias).mul_(s)
    h = torch.bmm(xs, down.transpose(1, 2))  # (G, tokens, r)
    ys.baddbmm_(h, up.transpose(1, 2))
    if bias is not None:
        ys.add_(bias)


def _add_product(x, y, d: LoraDelta, scale: float, factors: torch.Tensor | None) -> None:
    """`y += scale * factors * lora_B(lora_A(x))` in place, with `factors` one per token (or None):
    the scales go on the rank-sized intermediate, and `addmm_` adds the product into `y` itself."""
    x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
    y2 = y.view(-1, y.shape[-1])  # (tokens, out): y is a contiguous slice of the layer's output
    h = x2 @ d.down.t()  # (tokens, r)
    if factors is not None:
        h = h * factors[:, None]
    y2.addmm_(h, d.up.t(), alpha=scale)
    if d.bias is not None:
        if factors is None:
            y2.add_(d.bias, alpha=scale)
        else:
            y2.add_(factors[:, None] * d.bias)


def linear_targets(module: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear layer of `module` by its qualified name: the usual adaptable set."""
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
