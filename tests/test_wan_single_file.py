"""A Wan transformer from one safetensors file over a base pipeline directory: the original Wan
and ComfyUI layouts, fp8 "scaled" files, and errors naming the keys that do not fit."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.wan.config import WanFormatError

from wan_fixtures import build_tiny_wan

diffusers = pytest.importorskip("diffusers")

# diffusers' names -> the original Wan code's, for writing checkpoints as they are shared.
RENAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
    ("norm2", "norm__swap"),  # the original code's norm3 is diffusers' norm2, and back
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)


def original_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    name = name.replace("scale_shift_table", "modulation")
    for ours, theirs in RENAMES:
        name = name.replace(ours, theirs)
    return name


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    base = build_tiny_wan(root / "base", seed=0, sampling={"steps": 2})
    # "A fine-tune": the base pipeline with its transformer's weights moved.
    tuned = Path(shutil.copytree(base, root / "tuned"))
    weights = tuned / "transformer" / "diffusion_pytorch_model.safetensors"
    g = torch.Generator().manual_seed(1)
    state = {
        k: v + 0.2 * v.std().nan_to_num() * torch.randn(v.shape, generator=g)
        for k, v in load_file(str(weights)).items()
    }
    save_file(state, str(weights))
    original = {original_name(k): v for k, v in state.items()}
    save_file(original, str(root / "original.safetensors"))
    save_file(state, str(root / "diffusers.safetensors"))
    return {"base": base, "tuned": tuned, "state": state, "original": original, "root": root}


def test_original_names_are_diffusers_own_conversion(wan):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    renamed = convert_wan_transformer_to_diffusers({k: k for k in wan["original"]})
    assert set(renamed) == set(wan["state"])  # the test's layout is the one diffusers reads


@pytest.mark.parametrize("layout", ["original", "comfyui", "diffusers"])
def test_single_file_over_a_base_gives_the_fine_tunes_video(wan, layout):
    root = wan["root"]
    if layout == "comfyui":
        file = root / "comfy.safetensors"
        save_file({f"model.diffusion_model.{k}": v for k, v in wan["original"].items()}, str(file))
    else:
        file = root / f"{layout}.safetensors"
    from megaslide.engine.request import VideoRequest

    request = VideoRequest("a red circle", seed=2)
    reference = open_pipeline(wan["tuned"]).generate(request)
    # Streamed once: its host stores are filled from the same lazy mapping.
    offload = "stream" if layout == "original" else "none"
    pipe = open_pipeline(wan["base"], offload=offload, transformer_files=(str(file),))
    assert np.array_equal(pipe.generate(request), reference)
    if layout == "original":
        assert not np.array_equal(open_pipeline(wan["base"]).generate(request), reference)


def test_fp8_scaled_files_upcast_with_their_scales(wan):
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("this torch has no float8")
    state, scales = {}, {}
    for k, v in wan["original"].items():
        if v.dim() == 2 and k.endswith(".weight"):  # Linear weights in fp8, one scale each
            scale = v.abs().max() / 448.0
            state[k] = (v / scale).to(e4m3)
            state[k.removesuffix(".weight") + ".scale_weight"] = scale.reshape(1)
            scales[k] = scale
        else:
            state[k] = v
    state["scaled_fp8"] = torch.zeros(0, dtype=e4m3)
    file = wan["root"] / "fp8.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(file))
    info = describe(resolve_source(str(wan["base"])), transformer_files=(str(file),))
    parts, _ = open_model(info, offload="stream")
    q = parts["transformer"].blocks[0].attn1.to_q.weight
    key = "blocks.0.self_attn.q.weight"
    expected = state[key].to(torch.float32) * scales[key]
    assert torch.equal(q, expected)
    assert (q - wan["original"][key]).abs().max() <= 0.07 * wan["original"][key].abs().max()


def write_fp8(wan, name: str, scale: str | None, fp8=torch.float8_e4m3fn) -> Path:
    """The fine-tune as an fp8 file in ComfyUI's layout: every 2-D `*.weight` in `fp8`, with a
    `scale_weight` of one value (`scale="tensor"`), one per output row ("row"), or none."""
    state = {}
    for k, v in wan["original"].items():
        if v.dim() != 2 or not k.endswith(".weight"):
            state[k] = v
            continue
        amax = v.abs().amax(dim=1) if scale == "row" else v.abs().max()
        s = amax / torch.finfo(fp8).max if scale else torch.ones(())
        state[k] = (v / s.reshape(-1, 1) if scale == "row" else v / s).to(fp8)
        if scale:
            state[k.removesuffix(".weight") + ".scale_weight"] = s
    if scale:
        state["scaled_fp8"] = torch.zeros(0, dtype=fp8)
    file = wan["root"] / f"{name}.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(file))
    return file


@pytest.mark.parametrize(
    "scale, fp8, dtype",
    [
        ("tensor", torch.float8_e4m3fn, "bfloat16"),
        ("row", torch.float8_e4m3fn, "float32"),
        (None, torch.float8_e5m2, "bfloat16"),
    ],
)
def test_fp8_files_stream_as_stored_and_give_the_upcast_output(wan, scale, fp8, dtype):
    from megaslide.engine.streaming.weight_formats import Fp8Codec

    file = write_fp8(wan, f"fp8-{scale}-{fp8}", scale, fp8)
    files = (str(file),)
    info = describe(resolve_source(str(wan["base"])), transformer_files=files)
    # The transformer alone: `weights="fp8"` also codes the text encoder's blocks (lossy).
    only = {"transformer"}
    upcast = open_model(info, dtype=dtype, only=only)[0]["transformer"]
    parts, handles = open_model(info, dtype=dtype, offload="stream", weights="fp8", only=only)
    kept = parts["transformer"]
    g = torch.Generator().manual_seed(0)
    c = kept.config
    x = torch.randn(1, c.in_channels, 3, 8, 8, generator=g).to(getattr(torch, dtype))
    text = torch.randn(1, 7, c.text_dim, generator=g).to(x.dtype)
    with torch.no_grad():
        for t in (999.0, 500.0):
            args = dict(hidden_states=x, encoder_hidden_states=text, return_dict=False)
            expected = upcast(timestep=torch.tensor([t]), **args)[0]
            assert torch.equal(kept(timestep=torch.tensor([t]), **args)[0], expected)

    # The store holds the file's fp8 bytes and scales for every linear of every block.
    handle = handles["transformer"]
    linear_bytes, stored_bytes = 0, 0
    for block in handle._blocks:
        store = block.store
        stored = store.codec.stored([p.view(store.payload) for p in store.parts], store.meta)
        linears = [k for k, e in enumerate(store.entries) if e.names[0].endswith(".weight")]
        linears = [k for k in linears if len(store.entries[k].shape) == 2]
        assert sorted(stored) == linears and linears
        for w in stored.values():
            assert w.q.dtype == fp8 and w.scale.numel() == (len(w.q) if scale == "row" else 1)
            linear_bytes += w.q.numel() * 2  # in bf16
            stored_bytes += w.q.numel() * w.q.element_size() + w.scale.numel() * 4
    rows = 4 / 24 / 2 if scale == "row" else 0  # an fp32 scale per row of 24 inputs
    assert stored_bytes / linear_bytes == pytest.approx(0.5 + rows, abs=0.01)
    # Norms, biases and modulation stay in the compute dtype: the tiny blocks' linears are
    # about two thirds of their bytes.
    stats = handle.stats()
    assert stats["host_store_bytes"] < 0.75 * stats["streamed_block_bytes"] * 2 / x.element_size()

    # Filling one tensor again keeps the others as the file stores them.
    norm = next(k for k in wan["state"] if k.startswith("blocks.0.") and ".norm" in k)
    handle.load_weights({norm: wan["state"][norm]}, strict=False)
    store = handle._blocks[0].store
    assert sorted(store.codec.stored([p.view(store.payload) for p in store.parts], store.meta))
    assert isinstance(store.codec, Fp8Codec)


def test_fp8_files_refuse_what_does_not_fit(wan):
    file = write_fp8(wan, "fp8-lossless", "tensor")
    with pytest.raises(ValueError, match=r"q.weight is stored in fp8: weights='lossless'"):
        open_pipeline(
            wan["base"], offload="stream", weights="lossless", transformer_files=(str(file),)
        )
    state = load_file(str(file))
    key = "model.diffusion_model.blocks.0.self_attn.q.scale_weight"
    state[key] = torch.ones(3)
    bad = wan["root"] / "fp8-bad-scale.safetensors"
    save_file(state, str(bad))
    with pytest.raises(WanFormatError, match=r"q.scale_weight has shape \[3\]: a scale_weight"):
        open_pipeline(wan["base"], transformer_files=(str(bad),))


def test_keys_that_do_not_fit_are_named(wan):
    root = wan["root"]
    extra = root / "extra.safetensors"
    save_file({**wan["original"], "blocks.9.self_attn.q.weight": torch.zeros(24, 24)}, str(extra))
    with pytest.raises(WanFormatError, match=r"blocks.9.self_attn.q.weight \(diffusers: blocks.9"):
        open_pipeline(wan["base"], transformer_files=(str(extra),))
    missing = root / "missing.safetensors"
    save_file({k: v for k, v in wan["original"].items() if "head.head" not in k}, str(missing))
    with pytest.raises(WanFormatError, match="lacks proj_out.bias"):
        open_pipeline(wan["base"], transformer_files=(str(missing),))
    with pytest.raises(WanFormatError, match="2 transformer files for a model with 1"):
        describe(resolve_source(str(wan["base"])), transformer_files=(str(extra), str(extra)))
    with pytest.raises(WanFormatError, match="not found"):
        describe(resolve_source(str(wan["base"])), transformer_files=(str(root / "none"),))


def test_cli_and_server_take_a_transformer_file(wan, tmp_path):
    from megaslide.cli.main import main

    file = str(wan["root"] / "original.safetensors")
    args = ["generate", "a red circle", "--model", str(wan["base"]), "--no-progress"]
    assert main([*args, "-o", str(tmp_path / "a.mp4"), "--transformer", file]) == 0
    bad = str(wan["root"] / "absent.safetensors")
    assert main([*args, "-o", str(tmp_path / "b.mp4"), "--transformer", bad]) == 2
    assert not (tmp_path / "b.mp4").exists()

    from megaslide.server import Settings
    from megaslide.server.torch_backend import TorchBackend

    def backend(*transformers):
        return TorchBackend(
            Settings(
                data_dir=tmp_path / "data",
                models=[f"wan={wan['base']}"],
                transformers=list(transformers),
            )
        )

    (card,) = backend(f"wan={file}").cards()
    assert card.name == "wan"
    with pytest.raises(ValueError, match="no served model is named 'other'"):
        backend(f"other={file}")


@pytest.mark.parametrize(
    "scale, fp8",
    [("tensor", torch.float8_e4m3fn), ("row", torch.float8_e4m3fn), (None, torch.float8_e5m2)],
)
def test_fp8_files_with_fp8_matmul_multiply_by_the_stored_bytes(wan, scale, fp8):
    file = write_fp8(wan, f"fp8-{scale}-{fp8}", scale, fp8)
    info = describe(resolve_source(str(wan["base"])), transformer_files=(str(file),))
    only = {"transformer"}
    upcast = open_model(info, dtype="float32", only=only)[0]["transformer"]
    parts, handles = open_model(
        info, dtype="float32", offload="stream", weights="fp8", fp8_matmul=True, only=only
    )
    g = torch.Generator().manual_seed(0)
    c = upcast.config
    x = torch.randn(1, c.in_channels, 3, 8, 8, generator=g)
    text = torch.randn(1, 7, c.text_dim, generator=g)
    args = dict(hidden_states=x, encoder_hidden_states=text, return_dict=False)
    with torch.no_grad():
        got = parts["transformer"](timestep=torch.tensor([500.0]), **args)[0]
        expected = upcast(timestep=torch.tensor([500.0]), **args)[0]
    assert handles["transformer"].stats()["fp8_matmul"] == "on"
    if fp8 == torch.float8_e5m2:  # dequantized as without the lever: the upcast output
        assert torch.equal(got, expected)
        return
    # The file's bytes and scales as they are; only the activations' rounding differs.
    assert not torch.equal(got, expected)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 0.1, rel
