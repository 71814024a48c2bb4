"""The stored Qwen-Image-2.1 configs (tests/fixtures/qwen-image-2.1-configs, README there for their sources) parse
with diffusers' and transformers' own classes on the meta device and carry the facts the notes state; qic's 2.1
VAE modules built from them at real width hold exactly the checkpoint's tensor names and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qic.errors import ConfigError
from qic.host.schedule import check_scheduler_config, compute_mu
from qic.models.qwen_image_21.host import sampling as s
from qic.models.qwen_image_21.vae import (
    QwenImage21VAEDecoder,
    QwenImage21VAEEncoder,
    VAE21Config,
    vae21_decoder_state_dict,
    vae21_encoder_state_dict,
)

REAL = Path(__file__).parent / "fixtures" / "qwen-image-2.1-configs"
TURBO = Path(__file__).parent / "fixtures" / "qwen-image-2.1-turbo-configs"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_model_index_names_the_components():
    index = load(REAL / "model_index.json")
    assert index["_class_name"] == "QwenImage21Pipeline"
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
    }
    assert "sample_sigmas" not in index  # the base model samples on the linspace default


def test_transformer_is_32_blocks_of_32_heads_of_128():
    cfg = load(REAL / "transformer/config.json")
    with torch.device("meta"):
        m = QwenImage21Transformer2DModel.from_config(cfg)
    c = m.config
    assert (c.num_layers, c.num_attention_heads, c.attention_head_dim) == (32, 32, 128)
    assert len(m.transformer_blocks) == 32 and m.inner_dim == 4096
    assert (c.patch_size, c.in_channels, c.out_channels, c.context_in_dim) == (1, 64, 64, 4096)
    assert tuple(c.axes_dims_rope) == (16, 56, 56) and sum(c.axes_dims_rope) == 128
    assert c.causal_condition is True
    # one shared modulation (SiLU + Linear to 4 x hidden) and no per-block modulation weights
    assert tuple(m.modulation[1].weight.shape) == (4 * 4096, 4096)
    assert not any("mod" in n for n, _ in m.transformer_blocks.named_parameters())
    # SwiGLU at mlp ratio 3, bias-free linears
    blk = m.transformer_blocks[0]
    assert tuple(blk.img_mlp.gate_layer.weight.shape) == tuple(blk.img_mlp.proj.weight.shape) == (3 * 4096, 4096)
    assert all(lin.bias is None for lin in m.modules() if isinstance(lin, torch.nn.Linear))
    params = sum(p.numel() for p in m.parameters())
    assert 7.0e9 < params < 7.2e9, params  # "7B"; 7.115e9 from these configs
    # the TP plan the issue follows: attention and SwiGLU split, modulation replicated
    assert m._tp_plan["transformer_blocks.*.attn.to_out.0"] == "rowwise"
    assert not any(k.startswith("modulation") for k in m._tp_plan)


def test_vae_is_64_channels_16x_rgba_and_qic_holds_its_tensors():
    with torch.device("meta"):
        ref = AutoencoderKLQwenImage21.from_config(load(REAL / "vae/config.json"))
    c = ref.config
    assert (c.z_dim, c.in_channels, c.out_channels, c.scale_factor_spatial) == (64, 4, 4, 16)
    assert c.is_residual and c.patch_size is None and (c.base_dim, c.decoder_base_dim) == (96, 144)
    cfg = VAE21Config.from_dict(dict(c))
    assert cfg.scale_factor == s.VAE_SCALE == 16
    sd = ref.state_dict()
    with torch.device("meta"):
        enc = QwenImage21VAEEncoder(cfg, 1024, 768)
        dec = QwenImage21VAEDecoder(cfg, 1024, 1024)
    for module, want in ((enc, vae21_encoder_state_dict(sd)), (dec, vae21_decoder_state_dict(sd))):
        own = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert own == {k: tuple(v.shape) for k, v in want.items()}
    # everything the checkpoint holds is used but the temporal convs (unused on one frame)
    unused = set(sd) - set(enc.state_dict()) - set(dec.state_dict())
    assert unused and all(".time_conv." in k for k in unused)


def test_vae_config_without_latent_statistics_takes_the_published_ones_as_diffusers_does():
    """The published vae/config.json has no latents_mean / latents_std: diffusers' class then uses its defaults, and
    qic reads the same numbers (a qic that refused, or normalised otherwise, could not build the real 2.1)."""
    raw = load(REAL / "vae/config.json")
    assert "latents_mean" not in raw and "latents_std" not in raw
    with torch.device("meta"):
        ref = AutoencoderKLQwenImage21.from_config(raw)
    cfg = VAE21Config.from_dict(raw)
    assert cfg.latents_mean == tuple(ref.config.latents_mean) and cfg.latents_std == tuple(ref.config.latents_std)
    with pytest.raises(ConfigError, match="published statistics diffusers falls back to are for z_dim 64, not 16"):
        VAE21Config.from_dict({**raw, "z_dim": 16})


def test_scheduler_and_turbo():
    sched = load(REAL / "scheduler/scheduler_config.json")
    check_scheduler_config(sched)
    ref = FlowMatchEulerDiscreteScheduler.from_config(sched)
    assert ref.config.use_dynamic_shifting and ref.config.shift_terminal == 0.02
    # 1024 px: 64 x 64 = 4096 target tokens; the shift is linear between 256 and 8192 tokens
    seq = s.image_seq_len(1024, 1024)
    assert seq == 4096
    assert compute_mu(seq, sched) == pytest.approx(0.5 + 0.4 * (4096 - 256) / (8192 - 256))
    turbo = load(TURBO / "model_index.json")["sample_sigmas"]
    assert len(turbo) == 8 and turbo[0] == 1.0 and all(a > b > 0 for a, b in zip(turbo, turbo[1:]))
    turbo_sched = load(TURBO / "scheduler/scheduler_config.json")
    check_scheduler_config(turbo_sched)
    assert not FlowMatchEulerDiscreteScheduler.from_config(turbo_sched).config.use_dynamic_shifting


def test_text_encoder_is_qwen3_vl():
    cfg = Qwen3VLConfig.from_dict(load(REAL / "text_encoder/config.json"))
    t, v = cfg.text_config, cfg.vision_config
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == \
        (36, 4096, 32, 8, 128)
    # the encoder's hidden state is what the transformer's txt_in reads
    assert t.hidden_size == load(REAL / "transformer/config.json")["context_in_dim"]
    # the vision tower: patch 16, merge 2, so one image token covers 32x32 pixels = 2x2 latent tokens of the VAE
    assert (v.patch_size, v.spatial_merge_size, v.out_hidden_size) == (16, 2, 4096)
    assert v.patch_size * v.spatial_merge_size == 2 * s.VAE_SCALE
    with torch.device("meta"):
        m = Qwen3VLForConditionalGeneration(cfg)
    params = sum(p.numel() for p in m.parameters())
    assert 8.6e9 < params < 8.9e9, params  # 8.77e9, the vision tower 0.58e9 of it
