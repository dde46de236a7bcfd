"""Compiled blocks (`Placement.compile`, engine/compiled_blocks.py) on the CPU through inductor:
compiled equals eager within fp32's own error, streamed, with a step cache, with 3D-DSA and with
a LoRA row on Wan, and shapes that change recompile a bounded number of times.

The tolerance is derived, not guessed: the oracle runs in fp64, and the compiled fp32 run may be
at most twice as far from it as the eager fp32 run is (plus a floor of a few fp32 ulps of the
latents, for a step where eager happens to land on the oracle).
"""

from __future__ import annotations

import json

import pytest
import torch

from megaslide.engine.compiled_blocks import compile_blocks
from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import LoraChoice, VideoRequest
from megaslide.engine.sources import resolve_source

from dit_fixtures import randomise_zero_inits

REQ = dict(frames=4, height=16, width=16, steps=3)  # the tiny DiT: 64 tokens, three passes
FIRST_BLOCK = {"policy": "first-block", "threshold": 100.0}  # reuses whenever it may
ULP_FLOOR = 1e-6  # a few fp32 ulps of latents of order one

# Inductor compiles the tiny DiT's block in 15 to 40 s on a cold cache (a few with a warm one).
pytestmark = pytest.mark.slow


def dit(dtype=torch.float32, **placement):
    pipe = open_pipeline(resolve_source(preset="tiny"), dtype=dtype, **placement)
    randomise_zero_inits(pipe.dit)  # every path of the block computes something
    return pipe


def latents(pipe, requests: list[VideoRequest]) -> list[torch.Tensor]:
    """Each request's final latents (in fp64), the requests sampled together."""
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    while not all(s.done for s in states):
        pipe.denoise_step([s for s in states if not s.done])
    return [s.latents.double() for s in states]


def request(**changes) -> VideoRequest:
    return VideoRequest(**{"prompt": "a red circle", "seed": 1, **REQ, **changes})


def check_close(compiled, eager, oracle) -> None:
    """`compiled` at most twice as far from the fp64 `oracle` as `eager` (fp32) is."""
    for c, e, o in zip(compiled, eager, oracle):
        eager_err = (e - o).abs().max().item()
        err = (c - o).abs().max().item()
        assert err <= 2 * eager_err + ULP_FLOOR, (
            f"compiled: max error {err:.3g} (mean {(c - o).abs().mean().item():.3g}), eager fp32: "
            f"{eager_err:.3g}; compiled vs eager {(c - e).abs().max().item():.3g}"
        )


@pytest.fixture(scope="module")
def oracle():
    """The fp64 eager pipeline, and the requests' latents from it, computed once."""
    pipe = dit(torch.float64)
    cache = {}

    def run(key, requests):
        if key not in cache:
            cache[key] = latents(pipe, requests)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def eager():
    return dit()


@pytest.fixture(scope="module")
def compiled():
    """The tiny DiT with its blocks compiled: inductor compiles once here, for the module."""
    return dit(compile=True)


def test_the_compiled_blocks_equal_eager_and_compile_once(compiled, eager, oracle):
    requests = [request(), request(seed=2, prompt="a blue square")]
    check_close(latents(compiled, requests), latents(eager, requests), oracle("two", requests))
    stats = compiled.compile_stats()["dit"]
    # One graph for every block of the model and every step: its weights are the graph's inputs.
    assert stats["graphs"] == 1, stats
    assert stats["graph_breaks"] == 0, stats
    # Every linear of the block through oneDNN (kernels/cpu_linear.py): self-attention's two,
    # cross-attention's four and the MLP's two, its GELU fused into the first.
    assert stats["cpu_linears"] == 8, stats


def test_streamed_compiled_blocks_read_each_slot_without_recompiling(eager, oracle):
    """The streamer's hooks put each block's weights in a device slot before it runs: the graph
    reads them there (a block whose weights it did not read would give another video)."""
    streamed = dit(compile=True, offload="stream", prefetch=1)
    requests = [request()]
    check_close(latents(streamed, requests), latents(eager, requests), oracle("one", requests))
    graphs = streamed.compile_stats()["dit"]["graphs"]
    copies = streamed.handles["dit"].stats()["copies"]
    latents(streamed, requests)  # every block's weights in a slot again: nothing compiles
    assert streamed.compile_stats()["dit"]["graphs"] == graphs
    assert streamed.handles["dit"].stats()["copies"] > copies  # the blocks did stream


def test_a_first_block_step_cache_composes_with_compiled_blocks(compiled, eager, oracle):
    requests = [request(cache=FIRST_BLOCK, steps=4), request(seed=2)]
    got, want = latents(compiled, requests), latents(eager, requests)
    check_close(got, want, oracle("cached", requests))


def test_compiled_3d_dsa_equals_eager(oracle):
    """3D-DSA's reference (the CPU's path) compiles with the block."""
    source = resolve_source(preset="tiny")
    dsa = dict(attention="dsa", dsa_tile=(1, 2, 2))  # a 6x6 token frame: 3x3 tiles, the window's
    pipes = {
        key: open_pipeline(source, dtype=dtype, compile=key == "compiled", **dsa)
        for key, dtype in (("compiled", torch.float32), ("eager", torch.float32))
    }
    oracle_pipe = open_pipeline(source, dtype=torch.float64, **dsa)
    for pipe in (*pipes.values(), oracle_pipe):
        randomise_zero_inits(pipe.dit)
    requests = [request(height=24, width=24)]
    got = latents(pipes["compiled"], requests)
    check_close(got, latents(pipes["eager"], requests), latents(oracle_pipe, requests))
    assert pipes["compiled"].compile_stats()["dit"]["graph_breaks"] == 0


@pytest.mark.parametrize("dynamic", [False, None])
def test_batches_that_change_recompile_at_most_once_a_size(dynamic):
    """Requests joining and leaving a batch: passes of 2, 4, 3 and 2 rows (a guided request is
    two rows, an unguided one one): a graph per batch size with static shapes (the default), at
    most as many with Dynamo's automatic dynamic shapes (2 here: one static, one symbolic)."""
    pipe = dit()
    blocks = compile_blocks(pipe.dit.blocks, dynamic=dynamic)
    requests = [request(), request(seed=2), request(seed=3, guidance=1.0)]
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    for batch in ([0], [0, 1], [0, 2], [1]):
        pipe.denoise_step([states[i] for i in batch])
    graphs = blocks.stats()["graphs"]
    assert graphs == 3 if dynamic is False else 1 <= graphs <= 3, blocks.stats()
    blocks.remove()
    assert "forward" not in vars(pipe.dit.blocks[0])


def test_pipelines_of_one_model_keep_graphs_and_limits_of_their_own():
    """Each pipeline's blocks compile their own graphs: one process opening a model again and
    again (a worker reloading it) never runs into Dynamo's recompile limit."""
    for _ in range(torch._dynamo.config.recompile_limit + 1):
        pipe = dit(compile=True)
        latents(pipe, [request(steps=1)])
        assert pipe.compile_stats()["dit"]["graphs"] == 1


def test_warm_up_compiles_the_default_shape(compiled):
    """After `warm_up`, a request at the model's defaults compiles nothing."""
    pipe = dit(compile=True)
    assert pipe.warm_up()
    graphs = pipe.compile_stats()["dit"]["graphs"]
    assert graphs >= 1
    state = pipe.prepare(pipe.resolve(VideoRequest("a cat", seed=3, steps=2)))
    pipe.denoise_step([state])
    assert pipe.compile_stats()["dit"]["graphs"] == graphs


def test_generate_stats_report_the_compiled_blocks(tmp_path):
    from megaslide.cli.main import main

    stats = tmp_path / "stats.json"
    argv = ["generate", "a red circle", "--preset", "tiny", "--steps", "2", "--frames", "4"]
    argv += ["--size", "16x16", "--no-progress", "-o", str(tmp_path / "a.mp4")]
    assert main([*argv, "--compile", "--stats", str(stats)]) == 0
    got = json.loads(stats.read_text())["compile"]["dit"]
    assert got["graphs"] >= 1 and got["graph_breaks"] == 0, got


def test_a_worker_warms_the_default_shape_and_counts_recompiles(tmp_path):
    """With `compile`, the worker compiles the model's default shape as it loads it; a request
    at another shape is a recompile, counted in /metrics."""
    pytest.importorskip("fastapi")
    import warnings

    with warnings.catch_warnings():  # starlette's notice that its TestClient will move to httpx2
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    from megaslide.server import Settings

    from api_helpers import wait_status
    from server_fakes import torch_app

    settings = Settings(
        data_dir=tmp_path / "data", preset="tiny", device="cpu", poll_after_ms=50, compile=True
    )
    clip = {"num_frames": 4, "size": "16x16", "num_inference_steps": 2}  # not the default shape
    with TestClient(torch_app(settings)) as c:
        v = c.post("/v1/videos", json={"prompt": "compiled", "seed": 3, **clip}).json()
        assert wait_status(c, v["id"], timeout=300)["status"] == "completed"
        metrics = c.get("/metrics").text
    counted = [
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("megaslide_compile_recompiles_total")
    ]
    assert counted == [1.0], counted


def test_compiled_wan_vace_with_a_lora_row_equals_eager(tmp_path_factory):
    """A tiny Wan VACE model, streamed: its VACE blocks and its blocks, two classes, each through
    a compiled function of its own, equal to eager within fp32's error for a batch of a request
    with a LoRA adapter and one without, at other conditioning scales, with a reference image
    and a control video: the adapter's hooks run inside the compiled blocks, and the rows still
    get their own deltas."""
    import numpy as np
    from PIL import Image

    from megaslide.engine.video import write_mp4

    from lora_fixtures import write_peft
    from wan_fixtures import build_tiny_wan

    root = tmp_path_factory.mktemp("compile-vace")
    model = build_tiny_wan(root / "vace", vace=True, layers=3)
    adapter = write_peft(root / "peft.safetensors", alpha=8, blocks=3)
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((40, 48, 3)) * 255).astype(np.uint8)).save(root / "ref.png")
    control = write_mp4(root / "c.mp4", (rng.random((9, 32, 32, 3)) * 255).astype(np.uint8))

    def vace_request(scale: float, loras=()) -> VideoRequest:
        return VideoRequest(
            prompt="a red circle moving left",
            height=32,
            width=32,
            frames=9,
            steps=2,
            guidance=4.0,
            seed=3,
            reference_images=(str(root / "ref.png"),),
            control_video=str(control),
            conditioning_scale=scale,
            loras=tuple(loras),
        )

    requests = [vace_request(0.5, [LoraChoice("a", 0.8)]), vace_request(0.5), vace_request(1.5)]
    runs = {}
    for key, dtype, compile_ in (
        ("oracle", torch.float64, False),
        ("eager", torch.float32, False),
        ("compiled", torch.float32, True),
    ):
        pipe = open_pipeline(model, dtype=dtype, compile=compile_, offload="stream")
        pipe.add_adapter("a", adapter)
        runs[key] = latents(pipe, requests)
    check_close(runs["compiled"], runs["eager"], runs["oracle"])
    assert not torch.equal(runs["eager"][0], runs["eager"][1])  # the adapter did something
    assert not torch.equal(runs["eager"][1], runs["eager"][2])  # and the scale
    compiled = pipe.compiled["transformer"]
    assert {kind.__name__ for kind in compiled.compiled} == {
        "WanVACETransformerBlock",
        "WanTransformerBlock",
    }
    assert all(c.graphs for c in compiled.counting.values())  # each class ran compiled
    stats = pipe.compile_stats()
    assert stats and all(s["graph_breaks"] == 0 for s in stats.values()), stats


def test_compiled_wan_animate_equals_eager(tmp_path_factory):
    """A tiny Wan Animate model, streamed: its blocks and the face adapters between them, two
    classes, each through a compiled function of its own without a graph break, equal to eager
    within fp32's error for an animate and a replace request sampled together."""
    import numpy as np
    from PIL import Image

    from megaslide.engine.video import write_mp4

    from wan_fixtures import FACE_SIZE, build_tiny_wan

    root = tmp_path_factory.mktemp("compile-animate")
    model = build_tiny_wan(root / "animate", animate=True, layers=2)
    rng = np.random.default_rng(0)

    def noise(*shape):
        return (rng.random(shape) * 255).astype(np.uint8)

    Image.fromarray(noise(40, 48, 3)).save(root / "character.png")
    videos = {
        "pose_video": write_mp4(root / "pose.mp4", noise(9, 32, 32, 3)),
        "face_video": write_mp4(root / "face.mp4", noise(9, FACE_SIZE, FACE_SIZE, 3)),
    }
    replace = {
        "background_video": write_mp4(root / "bg.mp4", noise(9, 32, 32, 3)),
        "background_mask": write_mp4(root / "mask.mp4", noise(9, 32, 32, 3)),
    }

    def animate_request(seed: int, **more) -> VideoRequest:
        fields = {k: str(v) for k, v in {**videos, **more}.items()}
        return VideoRequest(
            prompt="a red circle moving left",
            height=32,
            width=32,
            frames=9,
            steps=2,
            guidance=4.0,
            seed=seed,
            image=str(root / "character.png"),
            **fields,
        )

    requests = [animate_request(3), animate_request(5, **replace)]
    runs = {}
    for key, dtype, compile_ in (
        ("oracle", torch.float64, False),
        ("eager", torch.float32, False),
        ("compiled", torch.float32, True),
    ):
        pipe = open_pipeline(model, dtype=dtype, compile=compile_, offload="stream")
        runs[key] = latents(pipe, requests)
    check_close(runs["compiled"], runs["eager"], runs["oracle"])
    compiled = pipe.compiled["transformer"]
    assert {kind.__name__ for kind in compiled.compiled} == {
        "WanAnimateFaceBlockCrossAttention",
        "WanTransformerBlock",
    }
    assert all(c.graphs for c in compiled.counting.values())  # each class ran compiled
    stats = pipe.compile_stats()
    assert stats and all(s["graph_breaks"] == 0 for s in stats.values()), stats


def test_compiled_wan_compiles_one_graph_across_steps_and_prompts(tmp_path_factory):
    """A tiny Wan, streamed, compiled: its first step fills each row's kept cross-attention keys
    (prompt_cache.py) in the blocks' eager hooks and later steps read them, so both run the one
    graph the first step compiled: the second step does not recompile. A request joining at the
    third step with a prompt of another length (compact entries: another count of kept tokens,
    padded to the pass's width) recompiles once, for the new batch size, and the step after it
    not at all; compiled equals eager within fp32's error."""
    from wan_fixtures import build_tiny_wan

    model = build_tiny_wan(tmp_path_factory.mktemp("compile-wan") / "wan")
    first = VideoRequest("a red circle", height=32, width=32, frames=9, steps=4, seed=1)
    joining = VideoRequest(
        "a much longer prompt about a blue square", height=32, width=32, frames=9, steps=2, seed=2
    )
    runs, recompiles = {}, []
    for key, dtype, compile_ in (
        ("oracle", torch.float64, False),
        ("eager", torch.float32, False),
        ("compiled", torch.float32, True),
    ):
        pipe = open_pipeline(model, dtype=dtype, compile=compile_, offload="stream")
        states = [pipe.prepare(pipe.resolve(first))]
        step = 0
        while not all(s.done for s in states):
            if step == 2:
                states.append(pipe.prepare(pipe.resolve(joining)))
            counters = pipe.denoise_step([s for s in states if not s.done])
            recompiles.append(counters.get("compile_recompiles", 0))
            step += 1
        assert len({s.lengths[0] for s in states}) == 2  # the prompts' lengths differ
        runs[key] = [s.latents.double() for s in states]
    check_close(runs["compiled"], runs["eager"], runs["oracle"])
    stats = pipe.compile_stats()["transformer"]
    assert recompiles[-4:] == [0, 0, 1, 0], recompiles  # the compiled run's four steps
    assert stats["graphs"] == 2, stats  # a pass of 2 rows, then of 4 (the second request joins)
    assert stats["graph_breaks"] == 0, stats
