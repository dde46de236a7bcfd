"""Model directories: exact round trips through the loader, block-addressable tensors, the older
config format, clear errors."""

import json

import pytest
import torch

from megaslide.engine.loader import open_model, open_pipeline
from megaslide.engine.native.checkpoint import MODEL_FILE, save_model
from megaslide.engine.native.config import PRESETS
from megaslide.engine.native.dit import VideoDiT
from megaslide.engine.native.text import BuiltinTextEncoder
from megaslide.engine.sources import describe, resolve_source
from megaslide.engine.streaming.host_store import SafetensorsFile

from dit_fixtures import randomise_zero_inits

TINY = PRESETS["tiny"]


def build(seed=0):
    torch.manual_seed(seed)
    dit, text = VideoDiT(TINY.model), BuiltinTextEncoder(TINY.model.text)
    randomise_zero_inits(dit)
    return dit, text


@pytest.mark.parametrize("offload", ["none", "stream"])
def test_save_open_round_trips_exactly(tmp_path, offload):
    dit, text = build()
    sampling = TINY.sampling.replace(steps=7, guidance=2.0)
    save_model(tmp_path / "m", dit, text, sampling)
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["format"] == "megaslide-model/2" and raw["sampling"]["steps"] == 7
    pipe = open_pipeline(tmp_path / "m", offload=offload)
    assert pipe.info.config == dit.config and pipe.info.sampling == sampling
    assert pipe.info.sampling.steps == 7 and pipe.info.sampling.guidance == 2.0
    x, t = torch.randn(1, 3, 4, 16, 16), torch.tensor([0.4])
    with torch.no_grad():
        expected = dit(x, t, *text.encode(["p"]))
        assert torch.equal(pipe.dit(x, t, *pipe.text_encoder.encode(["p"])), expected)
    pipe.close()  # streamed tensors come back as ordinary host tensors
    for a, b in ((dit, pipe.dit), (text, pipe.text_encoder)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_one_block_can_be_read_alone(tmp_path):
    dit, text = build()
    save_model(tmp_path / "m", dit, text, TINY.sampling)
    file = SafetensorsFile(tmp_path / "m" / MODEL_FILE)
    block = {k: file[k] for k in file if k.startswith("blocks.2.")}
    expected = {f"blocks.2.{k}": v for k, v in dit.blocks[2].state_dict().items()}
    assert block.keys() == expected.keys()
    assert all(torch.equal(block[k], expected[k]) for k in block)


def test_bf16_save_and_config_overrides(tmp_path):
    dit, text = build()
    save_model(tmp_path / "m", dit, text, TINY.sampling, dtype=torch.bfloat16)
    info = describe(resolve_source(tmp_path / "m"), attention="dsa")
    parts, _ = open_model(info, dtype=torch.bfloat16)
    dit2 = parts["dit"]
    assert dit2.config.attention == "dsa"
    assert next(dit2.parameters()).dtype == torch.bfloat16
    assert torch.equal(dit2.blocks[0].mlp[0].weight, dit.blocks[0].mlp[0].weight.bfloat16())


def test_the_older_format_is_read(tmp_path):
    """Format 1 mixed the sampling defaults into the architecture; they are split on reading."""
    dit, text = build()
    save_model(tmp_path / "m", dit, text, TINY.sampling.replace(guidance=2.5))
    config = tmp_path / "m" / "config.json"
    raw = json.loads(config.read_text())
    legacy = {"format": "megaslide-model/1", "model": {**raw["model"], **raw["sampling"]}}
    config.write_text(json.dumps(legacy))
    info = describe(resolve_source(tmp_path / "m"))
    assert info.config == dit.config and info.sampling.guidance == 2.5


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        resolve_source(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        resolve_source(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="unsupported format"):
        describe(resolve_source(tmp_path))
