"""Config presets for the embedded tiny Qwen-Image checkpoints.

`shapes` (the default of `qic build`) is trained (training/train_shapes.py): its configs and weights ship in
qic/checkpoint/data/shapes/ and are read through qic/checkpoint/trained.py; the others are random weights
drawn by qic/checkpoint/embedded.py's recipe, for the parity tests.

`tiny` is the random preset most tests build; `tiny-alt` differs from
it in heads, GQA ratio, layers, z_dim and VAE depth (so the VAE scale factor), so that tests catch
anything about sizes that leaked into code as a constant. Both follow the real checkpoint's config
layout (`Qwen/Qwen-Image`): flat Qwen2.5-VL text_encoder config with a nested vision_config,
diffusers configs for transformer/vae/scheduler.
"""

from __future__ import annotations

import copy

from qic.family import EMBEDDED_CLASS

PIPELINE_CLASS = EMBEDDED_CLASS   # what every embedded checkpoint's model_index.json names (qic.family.default)

# The embedded tokenizer: byte-level BPE with TOKENIZER_REGULAR ordinary tokens (256 bytes + merges),
# then Qwen2's special tokens in their real order (151643.. in the real vocab), then unused ids up to
# TOKENIZER_VOCAB. Both presets share it.
TOKENIZER_REGULAR = 1000
TOKENIZER_VOCAB = 1024
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]


def special_id(token: str) -> int:
    return TOKENIZER_REGULAR + SPECIAL_TOKENS.index(token)

# The real Qwen-Image scheduler config (scheduler/scheduler_config.json on the hub).
QWEN_IMAGE_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.34.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


# The real VAE's latent statistics (vae/config.json of Qwen/Qwen-Image).
QWEN_IMAGE_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
                           0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
QWEN_IMAGE_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
                          1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


def _text_encoder(hidden, intermediate, layers, heads, kv_heads, mrope_section, vocab, vision_out):
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": special_id("<|endoftext|>"),
        "eos_token_id": special_id("<|im_end|>"),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "image_token_id": special_id("<|image_pad|>"),
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 128000,
        "max_window_layers": layers,
        "model_type": "qwen2_5_vl",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_section": list(mrope_section), "rope_type": "default", "type": "default"},
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.53.1",
        "use_cache": True,
        "use_sliding_window": False,
        "video_token_id": special_id("<|video_pad|>"),
        "vision_config": {
            "depth": 2,
            "fullatt_block_indexes": [1],
            "hidden_act": "silu",
            "hidden_size": 32,
            "in_channels": 3,
            "in_chans": 3,
            "intermediate_size": 64,
            "model_type": "qwen2_5_vl",
            "num_heads": 2,
            "out_hidden_size": vision_out,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
            "window_size": 112,
            "torch_dtype": "float32",
        },
        "vision_end_token_id": special_id("<|vision_end|>"),
        "vision_start_token_id": special_id("<|vision_start|>"),
        "vision_token_id": special_id("<|vision_pad|>"),
        "vocab_size": vocab,
    }


def _transformer(in_channels, out_channels, layers, head_dim, heads, joint_dim, axes):
    return {
        "_class_name": "QwenImageTransformer2DModel",
        "_diffusers_version": "0.34.0.dev0",
        "attention_head_dim": head_dim,
        "axes_dims_rope": list(axes),
        "guidance_embeds": False,
        "in_channels": in_channels,
        "joint_attention_dim": joint_dim,
        "num_attention_heads": heads,
        "num_layers": layers,
        "out_channels": out_channels,
        "patch_size": 2,
    }


def _vae(base_dim, z_dim, dim_mult, temperal_downsample, latents_mean, latents_std):
    return {
        "_class_name": "AutoencoderKLQwenImage",
        "_diffusers_version": "0.34.0.dev0",
        "attn_scales": [],
        "base_dim": base_dim,
        "dim_mult": list(dim_mult),
        "dropout": 0.0,
        "latents_mean": list(latents_mean),
        "latents_std": list(latents_std),
        "num_res_blocks": 2,
        "temperal_downsample": list(temperal_downsample),
        "z_dim": z_dim,
    }



PRESETS = {
    "tiny": {
        "text_encoder": _text_encoder(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                                      mrope_section=(2, 3, 3), vocab=TOKENIZER_VOCAB, vision_out=64),
        "transformer": _transformer(in_channels=16, out_channels=4, layers=3, head_dim=32, heads=4,
                                    joint_dim=64, axes=(8, 12, 12)),
        "vae": _vae(base_dim=16, z_dim=4, dim_mult=(1, 2, 4, 4), temperal_downsample=(False, True, True),
                    latents_mean=(-0.7571, -0.7089, -0.9113, 0.1075),
                    latents_std=(2.8184, 1.4541, 2.3275, 2.6558)),
        "scheduler": QWEN_IMAGE_SCHEDULER,
        "default_resolution": (48, 80),  # (height, width): non-square on purpose
    },
    "tiny-alt": {
        "text_encoder": _text_encoder(hidden=96, intermediate=160, layers=3, heads=6, kv_heads=2,
                                      mrope_section=(2, 3, 3), vocab=TOKENIZER_VOCAB, vision_out=96),
        "transformer": _transformer(in_channels=32, out_channels=8, layers=2, head_dim=48, heads=2,
                                    joint_dim=96, axes=(8, 20, 20)),
        "vae": _vae(base_dim=8, z_dim=8, dim_mult=(1, 2, 2), temperal_downsample=(False, True),
                    latents_mean=(0.1, -0.3, 0.5, -0.2, 0.0, 0.7, -0.6, 0.2),
                    latents_std=(1.5, 2.0, 0.8, 1.2, 2.5, 1.1, 0.9, 1.7)),
        "scheduler": QWEN_IMAGE_SCHEDULER,
        "default_resolution": (40, 24),
    },
    # Large enough that a denoise step is dominated by matrix work (head_dim 128 like the real model),
    # small enough to compile in minutes here: the run benchmark's checkpoint.
    "small": {
        "text_encoder": _text_encoder(hidden=256, intermediate=704, layers=4, heads=4, kv_heads=2,
                                      mrope_section=(8, 12, 12), vocab=TOKENIZER_VOCAB, vision_out=256),
        "transformer": _transformer(in_channels=64, out_channels=16, layers=4, head_dim=128, heads=4,
                                    joint_dim=256, axes=(16, 56, 56)),
        "vae": _vae(base_dim=32, z_dim=16, dim_mult=(1, 2, 4, 4), temperal_downsample=(False, True, True),
                    latents_mean=QWEN_IMAGE_LATENTS_MEAN, latents_std=QWEN_IMAGE_LATENTS_STD),
        "scheduler": QWEN_IMAGE_SCHEDULER,
        "default_resolution": (256, 256),
    },
}


def shapes_architecture() -> dict:
    """The trained `shapes` model's configs before training (training/train_shapes.py): tiny's text encoder
    (random, frozen), a 4-block denoiser on 16 latent channels, and a one-res-block-per-level VAE whose
    latent statistics training fills in. Kept here so the training script and the preset agree."""
    tiny = PRESETS["tiny"]
    return {
        "text_encoder": copy.deepcopy(tiny["text_encoder"]),
        "transformer": _transformer(in_channels=64, out_channels=16, layers=4, head_dim=32, heads=4,
                                    joint_dim=64, axes=(8, 12, 12)),
        "vae": _vae(base_dim=16, z_dim=16, dim_mult=(1, 2, 4, 4), temperal_downsample=(False, True, True),
                    latents_mean=(0.0,) * 16, latents_std=(1.0,) * 16) | {"num_res_blocks": 1},
        "scheduler": copy.deepcopy(QWEN_IMAGE_SCHEDULER),
    }


# The trained edit model's pipeline and condition areas: its pictures are the shapes model's (128*128 pixels), so a
# condition image keeps its size on both sides (the real Edit Plus: 1024*1024 VAE side, 384*384 vision side).
SHAPES_EDIT = {"pipeline": "QwenImageEditPlusPipeline", "areas": {"vae": 128 * 128, "vision": 128 * 128}}


def shapes_edit_architecture(shapes: dict) -> dict:
    """The trained `shapes-edit` model's configs (training/train_shapes_edit.py): the trained `shapes` model's
    `shapes` (its text encoder, denoiser and VAE, which training starts from) as an Edit Plus model."""
    return copy.deepcopy(shapes) | {"edit": copy.deepcopy(SHAPES_EDIT)}


def _trained_presets() -> dict:
    """The trained models' presets (qic/checkpoint/trained.py), when their package data is present."""
    from qic.checkpoint import trained
    out = {}
    for name in trained.TRAINED:
        if (trained.folder(name) / "trained.json").is_file():
            res = trained.resolutions(name)
            out[name] = trained.configs(name) | {"default_resolution": res[0], "default_resolutions": res,
                                                 "trained": True}
    return out


PRESETS.update(_trained_presets())
DEFAULT = "shapes"   # what `qic build` builds when no model is named


def default_resolutions(model: str | None) -> tuple[tuple[int, int], ...]:
    """A build's resolutions when none are given, for its `model` (None: the default): an embedded preset's
    own (the trained model's three), else 48x80 (the random presets' test shape, and what an explicit
    checkpoint gets unless its config names its own)."""
    if model is not None and not model.startswith("embedded:"):
        return ((48, 80),)
    p = PRESETS.get(model.removeprefix("embedded:") if model else DEFAULT, {})
    return tuple(tuple(r) for r in p.get("default_resolutions", ((48, 80),)))


# An embedded edit model's text bucket: the Edit Plus template with one picture is 167 tokens in the embedded
# tokenizer (its system prompt is 149 tokens where Qwen's vocabulary needs 64), and the edit grammar's longest
# instruction 7 more, so the text-to-image default of 128 cannot hold it.
EDIT_TEXT_BUCKET = 192


def default_text_buckets(model: str | None) -> tuple[int, ...]:
    """A build's text buckets when none are given: 128, or an embedded edit preset's EDIT_TEXT_BUCKET."""
    if model is not None and model.startswith("embedded:") and PRESETS.get(model.removeprefix("embedded:"), {}).get(
            "edit"):
        return (EDIT_TEXT_BUCKET,)
    return (128,)


def preset(name: str) -> dict:
    """A deep copy of a preset, so callers may edit it freely."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])
