"""LoRA adapters on Wan models: every shared key layout gives the video diffusers gives with
`load_lora_weights` + `set_adapters`, requests with different adapters share one pass per step,
and an adapter that does not fit is refused naming its first bad key."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megaslide.engine.loader import open_pipeline
from megaslide.engine.lora import AdapterError
from megaslide.engine.request import LoraChoice, RequestError, VideoRequest

from lora_fixtures import hostile_files, write_musubi, write_original, write_peft
from wan_fixtures import CLIP, build_tiny_wan
from wan_reference import diffusers_run

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")  # diffusers' load_lora_weights needs it

PROMPT, NEGATIVE = "a red circle moving left", "blurry"
STEPS = 2  # enough for an adapter to show; each test's clips cost a second or so


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "model": build_tiny_wan(root / "wan"),
        "experts": build_tiny_wan(root / "experts", experts=2),
        "ti2v": build_tiny_wan(root / "ti2v", ti2v=True, sampling={"steps": 2}),
        "peft": write_peft(root / "peft.safetensors", alpha=8),
        "original": write_original(root / "original.safetensors"),
        "musubi": write_musubi(root / "musubi.safetensors"),
        "root": root,
    }


def request(loras=(), size: int = 32, **changes) -> VideoRequest:
    fields = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=size,
        width=size,
        frames=CLIP["num_frames"],
        steps=STEPS,
        guidance=CLIP["guidance_scale"],
        seed=3,
        loras=tuple(loras),
    )
    return VideoRequest(**{**fields, **changes})


def diffusers_frames(path, adapters: dict[str, tuple], pipe=None, **changes) -> np.ndarray:
    """diffusers' WanPipeline (the one at `path`, or `pipe`) with `adapters` (name -> (file,
    scale)) loaded and set, on `request(**changes)`, its weights re-homed (wan_reference)."""
    pipe = pipe or diffusers.WanPipeline.from_pretrained(path)
    for name, (file, _) in adapters.items():
        pipe.load_lora_weights(str(file), adapter_name=name)
    if adapters:
        pipe.set_adapters(list(adapters), [scale for _, scale in adapters.values()])
    return diffusers_run(pipe, request(**changes))[1]


def level_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("layout", ["peft", "original", "musubi"])
def test_each_layout_gives_diffusers_video(wan, layout):
    """Bitwise with each row alone, within one uint8 level batched (streamed: the adapters never
    touch the streamed weights)."""
    reference = diffusers_frames(wan["model"], {"a": (wan[layout], 0.8)})
    asked = request([LoraChoice("a", 0.8)])
    exact = open_pipeline(wan["model"], batched=False)
    card = exact.add_adapter("a", wan[layout])
    assert (card["rank"], card["modules"], card["base"]) == (4, 20, "wan")
    assert np.array_equal(exact.generate(asked), reference)
    assert level_diff(exact.generate(request()), reference) > 8  # the adapter matters
    streamed = open_pipeline(wan["model"], offload="stream")
    streamed.add_adapter("a", wan[layout])
    assert level_diff(streamed.generate(asked), reference) <= 1


def test_streamed_equals_resident(wan):
    clips = []
    for offload in ("none", "stream"):
        pipe = open_pipeline(wan["model"], offload=offload)
        pipe.add_adapter("a", wan["original"])
        pipe.add_adapter("b", wan["musubi"])
        clips.append(pipe.generate(request([LoraChoice("a", 0.6), LoraChoice("b", -0.4)])))
    assert np.array_equal(*clips)


def test_two_adapters_compose_like_diffusers(wan):
    adapters = {"a": (wan["peft"], 0.8), "b": (wan["musubi"], 0.5)}
    reference = diffusers_frames(wan["model"], adapters)
    pipe = open_pipeline(wan["model"], batched=False)
    for name, (file, _) in adapters.items():
        pipe.add_adapter(name, file)
    asked = request([LoraChoice(n, s) for n, (_, s) in adapters.items()])
    assert np.array_equal(pipe.generate(asked), reference)


def test_requests_with_different_adapters_share_one_pass_per_step(wan):
    """Three requests (two adapters, one at two scales, and none) in one batch: one forward pass of
    the transformer per step, each clip within one uint8 level of its run alone."""
    pipe = open_pipeline(wan["model"], offload="stream")
    pipe.add_adapter("a", wan["peft"])
    pipe.add_adapter("b", wan["original"])
    choices = [[("a", 1.0)], [("a", 0.5), ("b", 1.0)], []]
    requests = [request([LoraChoice(n, s) for n, s in c], seed=i) for i, c in enumerate(choices)]
    alone = [pipe.generate(r) for r in requests]
    passes = []
    hook = pipe.experts[0].register_forward_hook(lambda m, a, o: passes.append(1))
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    hook.remove()
    assert len(passes) == STEPS
    for state, clip in zip(states, alone):
        assert level_diff(pipe.finish(state), clip) <= 1
    assert level_diff(alone[0], alone[2]) > 8 and level_diff(alone[1], alone[0]) > 8


@pytest.mark.slow  # tens of seconds: the developer loop leaves it out
def test_one_adapter_a_request_runs_as_one_grouped_product(wan):
    """Guided requests with one adapter each (or none) split the batch into equal runs of rows:
    the grouped path, each clip within one uint8 level of its run alone."""
    from megaslide.engine import lora

    pipe = open_pipeline(wan["model"])
    pipe.add_adapter("a", wan["peft"])
    pipe.add_adapter("b", wan["musubi"])
    requests = [
        request([LoraChoice("a")], seed=1),
        request([LoraChoice("b", 0.5)], seed=2),
        request([], seed=3),
    ]
    alone = [pipe.generate(r) for r in requests]
    grouped = []
    original = lora._add_grouped
    lora._add_grouped = lambda *args: (grouped.append(1), original(*args))[1]
    try:
        states = [pipe.prepare(pipe.resolve(r)) for r in requests]
        while not all(s.done for s in states):
            pipe.denoise_step(states)
    finally:
        lora._add_grouped = original
    assert grouped  # the batch took the grouped path
    for state, clip in zip(states, alone):
        assert level_diff(pipe.finish(state), clip) <= 1


def test_per_token_timesteps_route_each_row(wan):
    """Wan2.2-TI2V runs the time embedder once per token of each row: a mixed batch still gives
    each request its own adapter there."""
    file = write_peft(wan["root"] / "time.safetensors", time_embedder=True, seed=5)
    pipe = open_pipeline(wan["ti2v"])
    pipe.add_adapter("t", file)
    requests = [request([LoraChoice("t")], size=64), request([], size=64)]
    alone = [pipe.generate(r) for r in requests]
    states = [pipe.prepare(pipe.resolve(r)) for r in requests]
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    for state, clip in zip(states, alone):
        assert level_diff(pipe.finish(state), clip) <= 1
    assert level_diff(alone[0], alone[1]) > 8


def test_adapters_per_expert(wan):
    pipe = open_pipeline(wan["experts"])
    pipe.add_adapter("a", wan["peft"])
    # STEPS = 2: the first on the high-noise expert, the second on the low-noise one.
    clips = {
        expert: pipe.generate(request([LoraChoice("a", 1.0, expert)] if expert != "none" else []))
        for expert in ("none", "high", "low", None)
    }
    names = list(clips)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            assert level_diff(clips[x], clips[y]) > 0, (x, y)
    with pytest.raises(RequestError, match="expert 'middle'"):
        pipe.resolve(request([LoraChoice("a", 1.0, "middle")]))
    single = open_pipeline(wan["model"])
    single.add_adapter("a", wan["peft"])
    with pytest.raises(RequestError, match="one denoiser"):
        single.resolve(request([LoraChoice("a", 1.0, "low")]))


def test_distilled_adapter_defaults(wan):
    """An adapter's sidecar gives steps, guidance and shift to requests that leave them out: a
    2-step, guidance-free request makes one pass per step and is diffusers' video with the
    adapter loaded and the scheduler's shift set alike."""
    file = write_peft(wan["root"] / "distill.safetensors", seed=7)
    (wan["root"] / "distill.safetensors.json").write_text(
        json.dumps({"sampling": {"steps": 2, "guidance": 1.0, "shift": 5.0}})
    )
    pipe = open_pipeline(wan["model"], batched=False)
    card = pipe.add_adapter("fast", file)
    assert card["defaults"] == {"steps": 2, "guidance": 1.0, "shift": 5.0}
    video = pipe.resolve(request([LoraChoice("fast")], steps=None, guidance=None))
    assert (video.steps, video.guidance, video.shift) == (2, 1.0, 5.0)
    own = pipe.resolve(request([LoraChoice("fast")], steps=3, guidance=None))
    assert (own.steps, own.guidance) == (3, 1.0)  # what the request says wins
    assert pipe.resolve(request()).shift is None  # without the adapter: the model's schedule
    passes = []
    hook = pipe.experts[0].register_forward_hook(lambda m, a, o: passes.append(a))
    ours = pipe.generate(video)
    hook.remove()
    assert len(passes) == 2

    reference = diffusers.WanPipeline.from_pretrained(wan["model"])
    reference.scheduler = type(reference.scheduler).from_config(
        reference.scheduler.config, flow_shift=5.0
    )
    adapters = {"fast": (file, 1.0)}
    assert np.array_equal(ours, diffusers_frames(None, adapters, reference, steps=2, guidance=1.0))

    (wan["root"] / "distill.safetensors.json").write_text(json.dumps({"sampling": {"cfg": 1}}))
    with pytest.raises(AdapterError, match="unknown sampling default 'cfg'"):
        pipe.add_adapter("odd", file)


def test_a_distilled_adapter_samples_its_own_timesteps_bitwise_as_diffusers(wan):
    """An adapter distilled on four timesteps names them and its sampler: a request naming it
    runs four passes at those levels, bitwise diffusers' WanPipeline with the adapter loaded and
    FlowMatchEulerDiscreteScheduler set to the same sigmas."""
    from megaslide.engine.sampling.samplers import flow_scheduler, timestep_sigmas

    timesteps, shift = [1000, 750, 500, 250], 5.0
    file = write_peft(wan["root"] / "four.safetensors", seed=11)
    sampling = {"sampler": "euler", "timesteps": timesteps, "shift": shift, "guidance": 1.0}
    (wan["root"] / "four.safetensors.json").write_text(json.dumps({"sampling": sampling}))
    pipe = open_pipeline(wan["model"], batched=False)
    pipe.add_adapter("four", file)
    video = pipe.resolve(request([LoraChoice("four")], steps=None, guidance=None))
    assert (video.sampler, video.timesteps, video.steps) == ("euler", tuple(timesteps), 4)
    passes = []
    hook = pipe.experts[0].register_forward_hook(lambda m, a, o: passes.append(a))
    ours = pipe.generate(video)
    hook.remove()
    assert len(passes) == 4

    reference = diffusers.WanPipeline.from_pretrained(wan["model"])
    sigmas = timestep_sigmas(tuple(timesteps), shift)
    scheduler = flow_scheduler("euler", sigmas, 1000, torch.device("cpu"))
    set_timesteps = scheduler.set_timesteps
    scheduler.set_timesteps = lambda n, device=None: set_timesteps(sigmas=sigmas.tolist())
    reference.scheduler = scheduler
    theirs = diffusers_frames(None, {"four": (file, 1.0)}, reference, steps=4, guidance=1.0)
    assert np.array_equal(ours, theirs)


def _bad(wan, name, **kw):
    return write_peft(wan["root"] / f"{name}.safetensors", **kw)


@pytest.mark.parametrize(
    "case, match",
    [
        ("unknown_block", "blocks.2.attn1.to_k.lora_A.weight matches no adaptable layer"),
        ("wrong_shape", r"blocks.0.attn1.to_q.lora_A.weight has shape \(4, 48\)"),
        ("stray", "text_encoder.encoder.lora_A.weight: not a key of the transformer"),
        ("missing_up", "blocks.0.attn1.to_q.lora_B.weight is missing"),
        ("not_lora", "blocks.0.attn1.to_q.weight is not a LoRA factor"),
        ("norm_diff", "diffusion_model.blocks.0.norm3.diff: full-weight and norm-layer deltas"),
        ("musubi_partial", "blocks_1_ffn_2.lora_down.weight is missing"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_naming_the_key(wan, case, match):
    root = wan["root"]
    g = torch.Generator().manual_seed(0)
    if case == "unknown_block":
        file = _bad(wan, case, blocks=8)
    elif case == "wrong_shape":
        file = _bad(
            wan,
            case,
            only=("attn1.to_k",),
            extra={
                "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 48, generator=g),
                "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(48, 4, generator=g),
            },
        )
    elif case == "stray":
        file = _bad(wan, case, extra={"text_encoder.encoder.lora_A.weight": torch.zeros(4, 8)})
    elif case == "missing_up":
        file = _bad(
            wan,
            case,
            only=("attn2",),
            extra={"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24)},
        )
    elif case == "not_lora":
        file = _bad(wan, case, extra={"transformer.blocks.0.attn1.to_q.weight": torch.zeros(1)})
    elif case == "norm_diff":
        file = write_original(root / f"{case}.safetensors", norm_diff=0.1)
    else:
        from safetensors.torch import load_file, save_file

        state = load_file(str(wan["musubi"]))
        state = {k: v for k, v in state.items() if not k.startswith("lora_unet_blocks_1_ffn_2")}
        file = root / f"{case}.safetensors"
        save_file(state, str(file))
    pipe = open_pipeline(wan["model"])
    with pytest.raises(AdapterError, match=match):
        pipe.add_adapter("bad", file)
    assert "bad" not in pipe.adapters and not pipe.adapter_cards()


def test_zero_norm_deltas_are_dropped_and_names_are_checked(wan):
    pipe = open_pipeline(wan["model"])
    pipe.add_adapter("a", wan["original"])  # carries a norm3.diff of zeros: changes nothing
    with pytest.raises(AdapterError, match="already registered"):
        pipe.add_adapter("a", wan["peft"])
    with pytest.raises(RequestError, match="no adapter named 'nope'") as e:
        pipe.resolve(request([LoraChoice("nope")]))
    assert e.value.param == "loras"
    with pytest.raises(RequestError, match="named twice"):
        pipe.resolve(request([LoraChoice("a"), LoraChoice("a", 0.5)]))
    with pytest.raises(RequestError, match="scale must be a number"):
        pipe.resolve(request([LoraChoice("a", float("nan"))]))
    with pytest.raises(AdapterError, match="not found"):
        pipe.add_adapter("b", wan["root"] / "missing.safetensors")


def test_the_planner_counts_adapter_memory(wan):
    from megaslide.engine.lora import linear_targets
    from megaslide.engine.planner import Workload, plan
    from megaslide.engine.sources import describe, resolve_source

    info = describe(resolve_source(str(wan["model"])))
    without = plan(info, w=Workload(frames=9, height=32, width=32))
    with_loras = plan(info, w=Workload(frames=9, height=32, width=32, loras=3, lora_rank=8))
    pipe = open_pipeline(wan["model"])
    per_rank = sum(m.in_features + m.out_features for m in linear_targets(pipe.experts[0]).values())
    assert with_loras["device"]["lora_adapters"] == 3 * 8 * per_rank * 2  # bf16 factors
    assert (
        with_loras["device"]["total"] - without["device"]["total"]
        == with_loras["device"]["lora_adapters"]
    )
    with pytest.raises(ValueError, match="takes no LoRA adapters"):
        plan(describe(resolve_source(preset="tiny")), w=Workload(loras=1, lora_rank=4))


def test_a_resolved_request_keeps_its_adapters_through_the_store(wan):
    from megaslide.engine.request import ResolvedVideo

    pipe = open_pipeline(wan["model"])
    pipe.add_adapter("a", wan["peft"])
    video = pipe.resolve(request([LoraChoice("a", 0.25)]))
    assert ResolvedVideo.from_dict(json.loads(json.dumps(video.to_dict()))) == video
    assert video.batch_key == pipe.resolve(request()).batch_key  # adapters do not split a batch


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return hostile_files(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize(
    "name",
    [
        "meta_list",
        "alpha_list",
        "deep_sampling",
        "original_alpha2",
        "original_alpha0",
        "musubi_alpha2",
        "musubi_alpha0",
        "alpha_nan",
        "rank0",
        "nan_factor",
        "inf_factor",
        "int_factors",
        "bool_factors",
        "fp8_factors",
    ],
)
def test_a_hostile_adapter_file_is_an_adapter_error(hostile, name):
    """Whatever the file holds, reading and converting it either gives factors a video can use
    (float, finite, rank >= 1, finite alphas) or raises AdapterError saying why: never another
    exception, and never an adapter that fails every video naming it."""
    from megaslide.engine.wan.lora import load_wan_adapter

    path, match = hostile[name]
    with pytest.raises(AdapterError, match=re.escape(match)):
        load_wan_adapter(name, path)


def test_sampling_defaults_beyond_the_servers_limits_are_refused(hostile, tmp_path):
    from megaslide.engine.request import check_adapter_defaults
    from megaslide.engine.wan.lora import load_wan_adapter

    adapter = load_wan_adapter("many", hostile["many_steps"][0])
    with pytest.raises(RequestError, match="steps=1000000000 exceeds this server's limit of 200"):
        check_adapter_defaults(adapter.defaults, max_steps=200)
    check_adapter_defaults({"steps": 200}, max_steps=200)
    flag = write_peft(
        tmp_path / "flag.safetensors", metadata_extra={"megaslide.sampling": '{"steps": true}'}
    )
    with pytest.raises(AdapterError, match="steps=True is not a valid number"):
        load_wan_adapter("flag", flag)


def test_a_pipelines_refusal_names_no_other_tenants_adapter(wan):
    """A worker's pipeline holds every key's adapters: a video that reaches it naming one it
    has not registered fails without listing them (the API lists only the requester's)."""
    import dataclasses

    pipe = open_pipeline(wan["model"])
    pipe.add_adapter("bob~secret", wan["peft"])
    video = dataclasses.replace(pipe.resolve(request()), loras=(LoraChoice("mine"),))
    with pytest.raises(RequestError, match="no adapter named 'mine'") as e:
        pipe.prepare_batch([video])
    assert "secret" not in str(e.value)
