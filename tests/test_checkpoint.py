"""Model directories: exact round trips, block-addressable tensors, clear errors."""

import json

import pytest
import torch

from megaslide.engine.checkpoint import MODEL_FILE, load_model, read_tensors, save_model
from megaslide.engine.dit import PRESETS, VideoDiT
from megaslide.engine.text import BuiltinTextEncoder
from tests.test_model import randomise_zero_inits


def build(seed=0):
    torch.manual_seed(seed)
    dit, text = VideoDiT(PRESETS["tiny"]), BuiltinTextEncoder(PRESETS["tiny"].text)
    randomise_zero_inits(dit)
    return dit, text


def test_save_load_round_trips_exactly(tmp_path):
    dit, text = build()
    save_model(tmp_path / "m", dit, text)
    dit2, text2, raw = load_model(tmp_path / "m")
    assert raw["format"] == "megaslide-model/1" and dit2.config == dit.config
    for a, b in ((dit, dit2), (text, text2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(p.is_meta for p in dit2.parameters())
    x, t = torch.randn(1, 3, 4, 16, 16), torch.tensor([0.4])
    with torch.no_grad():
        assert torch.equal(dit(x, t, *text.encode(["p"])), dit2(x, t, *text2.encode(["p"])))


def test_one_block_can_be_read_alone(tmp_path):
    dit, text = build()
    save_model(tmp_path / "m", dit, text)
    block = read_tensors(tmp_path / "m" / MODEL_FILE, prefix="blocks.2.")
    expected = {f"blocks.2.{k}": v for k, v in dit.blocks[2].state_dict().items()}
    assert block.keys() == expected.keys()
    assert all(torch.equal(block[k], expected[k]) for k in block)


def test_bf16_save_and_config_overrides(tmp_path):
    dit, text = build()
    save_model(tmp_path / "m", dit, text, dtype=torch.bfloat16)
    dit2, _, _ = load_model(tmp_path / "m", attention="dsa")
    assert dit2.config.attention == "dsa"
    assert next(dit2.parameters()).dtype == torch.bfloat16
    assert torch.equal(dit2.blocks[0].mlp[0].weight, dit.blocks[0].mlp[0].weight.bfloat16())


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="unsupported format"):
        load_model(tmp_path)
