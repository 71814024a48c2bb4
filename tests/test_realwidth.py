"""The real-width benchmark's checkpoint (benchmarks.realwidth): what its writer draws, for the real configs at
reduced depth, is exactly what qic's components load. Shapes only: the writer's tensors are drawn on the
meta device (no memory), then converted the way stage 1 converts them."""

from __future__ import annotations

import pytest
import torch

from benchmarks.realwidth import CONFIGS, reduced_configs
from qic.builder.components import expected_tensors
from qic.checkpoint import embedded
from qic.models.qwen_image.components import COMPONENTS


@pytest.fixture
def meta_writer(monkeypatch):
    """The checkpoint writer with its tensor drawing replaced by meta tensors of the same shapes."""
    monkeypatch.setattr(embedded, "draw_tensor", lambda seed, component, name, shape: torch.empty(shape, device="meta"))
    return embedded.component_state_dict


@pytest.mark.parametrize("depth", [1, 2])
def test_realwidth_checkpoint_matches_components(meta_writer, depth):
    configs = reduced_configs(CONFIGS, depth)
    for comp in COMPONENTS.values():
        written = meta_writer(comp.folder, configs[comp.folder], 0)
        converted = {k: tuple(v.shape) for k, v in comp.convert(written).items()}
        assert converted == expected_tensors(comp, comp.parse_config(configs[comp.folder]), 1), comp.name

    te = meta_writer("text_encoder", configs["text_encoder"], 0)
    tr = meta_writer("transformer", configs["transformer"], 0)
    # Real widths, reduced depth, the real layout (lm_head and the vision tower are in the hub's files).
    assert te["model.embed_tokens.weight"].shape == (152064, 3584) == te["lm_head.weight"].shape
    last, beyond = f"model.layers.{depth - 1}.mlp.down_proj.weight", f"model.layers.{depth}.mlp.down_proj.weight"
    assert last in te and beyond not in te
    assert f"visual.blocks.{depth - 1}.attn.qkv.weight" in te and f"visual.blocks.{depth}.attn.qkv.weight" not in te
    assert tr["transformer_blocks.0.img_mod.1.weight"].shape == (6 * 3072, 3072)
    assert f"transformer_blocks.{depth}.img_mod.1.weight" not in tr


def test_reduced_configs_keep_real_widths():
    c = reduced_configs(CONFIGS, 1)
    assert (c["transformer"]["num_layers"], c["text_encoder"]["num_hidden_layers"]) == (1, 1)
    assert c["transformer"]["num_attention_heads"] * c["transformer"]["attention_head_dim"] == 3072
    assert c["text_encoder"]["vision_config"]["fullatt_block_indexes"] == [0]
    assert c["vae"]["base_dim"] == 96
